//! Idempotent saga start against real PostgreSQL and SQLite: the same start message,
//! sent twice, and sent at once by eight tasks each on its own connection (or its own
//! orchestrator), creates one saga; every sender gets its id; its steps apply once.
//! Every check reads the database.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use chrono::Utc;
use ractor::{Actor, ActorRef};
use sagabox::orchestrator::{InProcess, Orchestrator, OrchestratorArguments, OrchestratorMessage};
use sagabox::saga::{SagaDefinition, SagaInstance, SagaStore, StartError};
use sagabox::step::{StepError, StepHandler, StepPool, StepPoolConfig};
use sagabox::{Envelope, InboxConfig, InboxGuard, MessageId};
use serde_json::{Value, json};
use tokio::sync::Barrier;

const BOOKING: &str = r#"
name = "booking"

[[steps]]
name = "reserve"
consumer_type = "reserve"
command = "reserve"
compensation = "release"
timeout = "5s"

[[steps]]
name = "confirm"
consumer_type = "confirm"
command = "confirm"
timeout = "5s"
"#;

/// Every command a step applied, not idempotent by itself.
const LEDGER_DDL: &str = "CREATE TABLE ledger (saga_id TEXT NOT NULL, kind TEXT NOT NULL)";

/// Concurrent senders of one start message.
const SENDERS: usize = 8;
/// Rounds of concurrent starts, a new start message each.
const ROUNDS: usize = 4;

fn booking() -> Arc<SagaDefinition> {
    Arc::new(BOOKING.parse().unwrap())
}

fn start_message(n: usize) -> Envelope {
    Envelope::new(MessageId::new_v7(), "booking", json!({ "n": n })).unwrap()
}

/// Waits for every one of `orchestrators` to have no saga in flight.
async fn wait_idle(orchestrators: &[ActorRef<OrchestratorMessage>]) {
    for orchestrator in orchestrators {
        ractor::call_t!(orchestrator, OrchestratorMessage::WhenIdle, 60_000)
            .expect("orchestrator idle in time");
    }
}

async fn start(
    orchestrator: &ActorRef<OrchestratorMessage>,
    message: &Envelope,
) -> Result<String, StartError> {
    ractor::call_t!(
        orchestrator,
        OrchestratorMessage::Start,
        30_000,
        message.clone()
    )
    .expect("the orchestrator answers")
}

macro_rules! start_suite {
    ($backend:ident, $fixture:ty, $db:ty, $store:ty) => {
        mod $backend {
            use super::*;

            #[derive(Debug, Clone)]
            struct Ledger;

            impl StepHandler<$db> for Ledger {
                async fn handle(
                    &self,
                    conn: &mut <$db as sqlx::Database>::Connection,
                    envelope: &Envelope,
                ) -> Result<Value, StepError> {
                    sqlx::query("INSERT INTO ledger (saga_id, kind) VALUES ($1, $2)")
                        .bind(envelope.saga_id.clone().unwrap_or_default())
                        .bind(envelope.kind.as_str())
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| StepError::Retryable(e.to_string()))?;
                    Ok(Value::Null)
                }
            }

            /// Step pools shared by every orchestrator of the test, as if the steps were
            /// separate services.
            async fn steps(fx: &$fixture) -> Arc<InProcess> {
                let mut dispatch = InProcess::new();
                for step in booking().steps() {
                    let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default()).unwrap();
                    let pool = StepPool::spawn(guard, step.consumer_type().clone(), Ledger, StepPoolConfig { workers: 2 })
                        .await
                        .unwrap();
                    dispatch = dispatch.with_pool(pool);
                }
                Arc::new(dispatch)
            }

            /// An orchestrator with a store (and its connections) of its own.
            async fn orchestrator(fx: &$fixture, dispatch: &Arc<InProcess>) -> ActorRef<OrchestratorMessage> {
                let (orchestrator, _) = Actor::spawn(
                    None,
                    Orchestrator::new(),
                    OrchestratorArguments::new(booking(), fx.store(1).await, Arc::clone(dispatch)).with_stats(Arc::default()),
                )
                .await
                .unwrap();
                orchestrator
            }

            /// Each saga of `ids` completed with each step applied once; no other saga.
            async fn check(fx: &$fixture, ids: &[String]) {
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances").await, ids.len() as i64, "one saga per start message");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status <> 'completed'").await, 0);
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM ledger").await, 2 * ids.len() as i64, "each step applied once per saga");
                assert_eq!(
                    fx.scalar("SELECT COUNT(*) FROM (SELECT saga_id, kind FROM ledger GROUP BY saga_id, kind HAVING COUNT(*) > 1) d").await,
                    0
                );
                let store = fx.store(1).await;
                for id in ids {
                    assert!(store.load(id).await.unwrap().is_some(), "{id} stored");
                }
            }

            /// The store alone: the second start of a message finds the first's saga, with
            /// the first's data.
            #[tokio::test]
            async fn the_same_start_twice_stores_one_saga() {
                let fx = <$fixture>::new().await;
                let store = fx.store(2).await;
                let definition = booking();
                let message = start_message(1);
                let first = SagaInstance::from_start(&definition, &message, Utc::now()).unwrap();
                let created = store.create_if_absent(&first).await.unwrap();
                assert!(created.created);
                assert_eq!(created.saga, first);

                let mut resent = message.clone();
                resent.payload = json!({"n": "changed by a confused sender"});
                let second = SagaInstance::from_start(&definition, &resent, Utc::now()).unwrap();
                let found = store.create_if_absent(&second).await.unwrap();
                assert!(!found.created);
                assert_eq!(found.saga.id, first.id);
                assert_eq!(found.saga.data, json!({"n": 1}), "the first start's data is kept");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances").await, 1);
            }

            /// Eight tasks, each with its own connection, store the same start at once;
            /// a few rounds, a new message each.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_starts_on_separate_connections_store_one_saga() {
                let fx = <$fixture>::new().await;
                let definition = booking();
                for round in 0..ROUNDS {
                    let message = start_message(round);
                    let barrier = Arc::new(Barrier::new(SENDERS));
                    let mut tasks = Vec::new();
                    for _ in 0..SENDERS {
                        let store = fx.store(1).await;
                        let (definition, message, barrier) = (definition.clone(), message.clone(), barrier.clone());
                        tasks.push(tokio::spawn(async move {
                            let saga = SagaInstance::from_start(&definition, &message, Utc::now()).unwrap();
                            barrier.wait().await;
                            store.create_if_absent(&saga).await.unwrap()
                        }));
                    }
                    let mut started = Vec::new();
                    for task in tasks {
                        started.push(task.await.unwrap());
                    }
                    let id = SagaInstance::start_id("booking", &message.id);
                    assert!(started.iter().all(|s| s.saga.id == id), "round {round}: every caller got the one saga");
                    assert_eq!(started.iter().filter(|s| s.created).count(), 1, "round {round}: one caller created it");
                    assert_eq!(fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances").await, round as i64 + 1);
                }
            }

            /// One orchestrator, the same start sent twice in a row, then eight times at
            /// once: one saga, its id in every answer, each step applied once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn an_orchestrator_started_twice_runs_one_saga() {
                let fx = <$fixture>::new().await;
                fx.exec(LEDGER_DDL).await;
                let dispatch = steps(&fx).await;
                let orchestrator = orchestrator(&fx, &dispatch).await;
                let message = start_message(0);
                let id = start(&orchestrator, &message).await.unwrap();
                assert_eq!(start(&orchestrator, &message).await.unwrap(), id);
                wait_idle(std::slice::from_ref(&orchestrator)).await;
                assert_eq!(start(&orchestrator, &message).await.unwrap(), id, "a start after the saga finished");

                let concurrent = start_message(1);
                let mut tasks = Vec::new();
                for _ in 0..SENDERS {
                    let (orchestrator, concurrent) = (orchestrator.clone(), concurrent.clone());
                    tasks.push(tokio::spawn(async move { start(&orchestrator, &concurrent).await.unwrap() }));
                }
                let mut answers = Vec::new();
                for task in tasks {
                    answers.push(task.await.unwrap());
                }
                let second = SagaInstance::start_id("booking", &concurrent.id);
                assert!(answers.iter().all(|answer| *answer == second), "{answers:?}");
                wait_idle(std::slice::from_ref(&orchestrator)).await;
                check(&fx, &[id, second]).await;

                let refused = Envelope::new(MessageId::new_v7(), "checkout", json!({})).unwrap();
                let error = start(&orchestrator, &refused).await.unwrap_err();
                assert!(matches!(error, StartError::WrongSaga { .. }), "{error:?}");
                orchestrator.stop(None);
            }

            /// Eight orchestrators (as eight processes: each its own connections) get the
            /// same start at once, a few rounds: one saga each round, every orchestrator
            /// answers its id, the steps apply once although several drive it.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn eight_orchestrators_started_at_once_run_one_saga() {
                let fx = <$fixture>::new().await;
                fx.exec(LEDGER_DDL).await;
                let dispatch = steps(&fx).await;
                let mut orchestrators = Vec::new();
                for _ in 0..SENDERS {
                    orchestrators.push(orchestrator(&fx, &dispatch).await);
                }
                let mut ids = Vec::new();
                for round in 0..ROUNDS {
                    let message = start_message(round);
                    let barrier = Arc::new(Barrier::new(SENDERS));
                    let mut tasks = Vec::new();
                    for orchestrator in &orchestrators {
                        let (orchestrator, message, barrier) = (orchestrator.clone(), message.clone(), barrier.clone());
                        tasks.push(tokio::spawn(async move {
                            barrier.wait().await;
                            start(&orchestrator, &message).await.unwrap()
                        }));
                    }
                    let id = SagaInstance::start_id("booking", &message.id);
                    for task in tasks {
                        assert_eq!(task.await.unwrap(), id, "round {round}");
                    }
                    ids.push(id);
                }
                wait_idle(&orchestrators).await;
                check(&fx, &ids).await;
                for orchestrator in orchestrators {
                    orchestrator.stop(None);
                }
            }
        }
    };
}

start_suite!(postgres, common::Pg, sqlx::Postgres, sagabox::PostgresStore);
start_suite!(sqlite, common::Lite, sqlx::Sqlite, sagabox::SqliteStore);
