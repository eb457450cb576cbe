//! The orchestrator against real PostgreSQL and SQLite: many sagas through step pools
//! with duplicated commands, lost replies, handlers failing after their write, business
//! refusals, and a crash (the runtime dropped mid-flight) followed by a resume. Every
//! check reads the database.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::Utc;
use ractor::Actor;
use sagabox::orchestrator::{
    Dispatch, DriveStats, InProcess, Orchestrator, OrchestratorArguments, OrchestratorMessage,
};
use sagabox::saga::{
    Direction, EventKind, SagaDefinition, SagaEvent, SagaInsert, SagaInstance, SagaSave,
    SagaStatus, SagaStore,
};
use sagabox::step::{StepError, StepHandler, StepPool, StepPoolConfig};
use sagabox::testing::FaultyDispatch;
use sagabox::{Envelope, InboxConfig, InboxGuard};
use serde_json::{Value, json};

const TRIP: &str = r#"
name = "trip"

[[steps]]
name = "hotel"
consumer_type = "hotel"
command = "book_hotel"
compensation = "cancel_hotel"
timeout = "5s"
[steps.retry]
max_attempts = 30
initial_backoff = "1ms"
max_backoff = "20ms"

[[steps]]
name = "flight"
consumer_type = "flight"
command = "book_flight"
compensation = "cancel_flight"
timeout = "5s"
[steps.retry]
max_attempts = 30
initial_backoff = "1ms"
max_backoff = "20ms"

[[steps]]
name = "notify"
consumer_type = "notify"
command = "send_notice"
timeout = "5s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "20ms"
"#;

/// Four steps, the first three with a compensation; the car is always refused, so every
/// saga compensates the hotel and then the flight.
const JOURNEY: &str = r#"
name = "journey"

[[steps]]
name = "flight"
consumer_type = "flight"
command = "book_flight"
compensation = "cancel_flight"
timeout = "5s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "20ms"

[[steps]]
name = "hotel"
consumer_type = "hotel"
command = "book_hotel"
compensation = "cancel_hotel"
timeout = "5s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "20ms"

[[steps]]
name = "car"
consumer_type = "car"
command = "rent_car"
compensation = "return_car"
timeout = "5s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "20ms"

[[steps]]
name = "notify"
consumer_type = "notify"
command = "send_notice"
timeout = "5s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "20ms"
"#;

/// Three steps; the car's desk never answers, and the car has three attempts with a
/// backoff of 40 ms, then 80 ms (no jitter) before the saga gives up on it. A step that
/// ran out of attempts may have applied with its answer lost, so it has a compensation
/// too, and is undone first.
const RETRIED: &str = r#"
name = "retried"

[[steps]]
name = "flight"
consumer_type = "flight"
command = "book_flight"
compensation = "cancel_flight"
timeout = "5s"

[[steps]]
name = "hotel"
consumer_type = "hotel"
command = "book_hotel"
compensation = "cancel_hotel"
timeout = "5s"

[[steps]]
name = "car"
consumer_type = "car"
command = "rent_car"
compensation = "return_car"
timeout = "5s"
[steps.retry]
max_attempts = 3
initial_backoff = "40ms"
multiplier = 2.0
max_backoff = "1s"
jitter = 0.0
"#;

/// What each step applied, in the order the handlers ran (`seq` from one counter).
const JOURNAL_DDL: &str =
    "CREATE TABLE journal (seq BIGINT NOT NULL, saga_id TEXT NOT NULL, kind TEXT NOT NULL)";

const LEDGER_DDL: &str = "CREATE TABLE ledger (saga_id TEXT NOT NULL, kind TEXT NOT NULL)";

/// Appends `(saga, kind)` to the ledger — not idempotent by itself. A `book_*` command
/// is refused for good when the saga's data names its step in `refuse`; every
/// `fail_every`-th call writes its row and then fails (before commit).
#[derive(Debug)]
struct Ledger {
    calls: AtomicU64,
    fail_every: u64,
}

fn refused(envelope: &Envelope) -> bool {
    let refuse = envelope.payload.get("refuse").and_then(Value::as_str);
    matches!(
        (refuse, envelope.kind.as_str()),
        (Some("hotel"), "book_hotel") | (Some("flight"), "book_flight")
    )
}

async fn wait_idle(orchestrator: &ractor::ActorRef<OrchestratorMessage>) {
    ractor::call_t!(orchestrator, OrchestratorMessage::WhenIdle, 120_000)
        .expect("orchestrator idle in time");
}

fn trip() -> Arc<SagaDefinition> {
    Arc::new(SagaDefinition::from_toml_str(TRIP).unwrap())
}

/// Sagas 0, 7, 14, … are refused at the flight, 3, 10, … at the hotel; the rest complete.
fn plan(n: usize) -> Value {
    match n % 7 {
        0 => json!({"n": n, "refuse": "flight"}),
        3 => json!({"n": n, "refuse": "hotel"}),
        _ => json!({"n": n}),
    }
}

macro_rules! orchestrator_suite {
    ($backend:ident, $fixture:ty, $db:ty, $store:ty) => {
        mod $backend {
            use super::*;

            #[derive(Debug, Clone)]
            struct Handler(Arc<Ledger>);

            impl StepHandler<$db> for Handler {
                async fn handle(
                    &self,
                    conn: &mut <$db as sqlx::Database>::Connection,
                    envelope: &Envelope,
                ) -> Result<Value, StepError> {
                    if refused(envelope) {
                        return Err(StepError::Permanent("no availability".into()));
                    }
                    let saga = envelope.saga_id.clone().unwrap_or_default();
                    sqlx::query("INSERT INTO ledger (saga_id, kind) VALUES ($1, $2)")
                        .bind(&saga)
                        .bind(envelope.kind.as_str())
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| StepError::Retryable(e.to_string()))?;
                    let call = self.0.calls.fetch_add(1, Ordering::SeqCst);
                    if self.0.fail_every > 0 && call % self.0.fail_every == 0 {
                        return Err(StepError::Retryable("failed after writing".into()));
                    }
                    Ok(json!({ "kind": envelope.kind }))
                }
            }

            /// Journals every command it applies; refuses every car for good.
            #[derive(Debug, Clone)]
            struct Journal(Arc<AtomicU64>);

            impl StepHandler<$db> for Journal {
                async fn handle(
                    &self,
                    conn: &mut <$db as sqlx::Database>::Connection,
                    envelope: &Envelope,
                ) -> Result<Value, StepError> {
                    if envelope.kind == "rent_car" {
                        return Err(StepError::Permanent("no cars left".into()));
                    }
                    let seq = i64::try_from(self.0.fetch_add(1, Ordering::SeqCst)).unwrap();
                    sqlx::query("INSERT INTO journal (seq, saga_id, kind) VALUES ($1, $2, $3)")
                        .bind(seq)
                        .bind(envelope.saga_id.clone().unwrap_or_default())
                        .bind(envelope.kind.as_str())
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| StepError::Retryable(e.to_string()))?;
                    Ok(Value::Null)
                }
            }

            /// Journals like [`Journal`], but the car's desk fails every attempt with a
            /// retryable error.
            #[derive(Debug, Clone)]
            struct Unanswered(Arc<AtomicU64>);

            impl StepHandler<$db> for Unanswered {
                async fn handle(
                    &self,
                    conn: &mut <$db as sqlx::Database>::Connection,
                    envelope: &Envelope,
                ) -> Result<Value, StepError> {
                    if envelope.kind == "rent_car" {
                        return Err(StepError::Retryable("the rental desk does not answer".into()));
                    }
                    Journal(Arc::clone(&self.0)).handle(conn, envelope).await
                }
            }

            /// An in-process dispatch to a step pool for each of `definition`'s steps,
            /// each of `workers` workers running `handler`, with a connection more than
            /// its workers.
            async fn pools<H>(fx: &$fixture, definition: &SagaDefinition, handler: H, workers: usize) -> InProcess
            where
                H: StepHandler<$db> + Clone,
            {
                let mut dispatch = InProcess::new();
                for step in definition.steps() {
                    let connections = u32::try_from(workers + 1).unwrap();
                    let guard = InboxGuard::new(fx.store(connections).await, InboxConfig::default()).unwrap();
                    let pool = StepPool::spawn(guard, step.consumer_type().clone(), handler.clone(), StepPoolConfig { workers })
                        .await
                        .unwrap();
                    dispatch = dispatch.with_pool(pool);
                }
                dispatch
            }

            /// A step that fails on every attempt is sent `max_attempts` times, each
            /// attempt recorded in the history and each retry after its backoff; then
            /// the saga compensates (`exhausted`): the car, then the hotel, then the flight.
            #[tokio::test]
            async fn a_step_out_of_attempts_is_retried_with_its_backoff_then_compensated() {
                let fx = <$fixture>::new().await;
                fx.exec(JOURNAL_DDL).await;
                let definition = Arc::new(SagaDefinition::from_toml_str(RETRIED).unwrap());
                let seq = Arc::new(AtomicU64::new(0));
                let dispatch = pools(&fx, &definition, Unanswered(seq.clone()), 1).await;
                let store = fx.store(4).await;
                let (orchestrator, _) = Actor::spawn(
                    None,
                    Orchestrator::new(),
                    OrchestratorArguments::new(definition, store.clone(), Arc::new(dispatch)),
                )
                .await
                .unwrap();
                let saga = SagaInstance::new("r-1", "retried", json!({}), Utc::now());
                let mut conn = store.pool().acquire().await.unwrap();
                store.insert(&mut conn, &saga).await.unwrap();
                drop(conn);
                orchestrator.send_message(OrchestratorMessage::Drive(saga.id)).unwrap();
                wait_idle(&orchestrator).await;
                orchestrator.stop(None);

                let saga = store.load("r-1").await.unwrap().unwrap();
                assert_eq!(saga.status.as_str(), "compensated");
                let history: Vec<SagaEvent> =
                    store.history("r-1").await.unwrap().into_iter().map(|entry| entry.event).collect();
                let car = |kind: EventKind| -> Vec<&SagaEvent> {
                    history
                        .iter()
                        .filter(|event| {
                            event.kind == kind
                                && event.step.as_deref() == Some("car")
                                && event.direction == Some(Direction::Forward)
                        })
                        .collect()
                };
                let (sent, failed) = (car(EventKind::Sent), car(EventKind::Failed));
                let attempts = |events: &[&SagaEvent]| -> Vec<Option<i32>> {
                    events.iter().map(|event| event.attempt).collect()
                };
                assert_eq!(attempts(&sent), [Some(1), Some(2), Some(3)], "{history:#?}");
                assert_eq!(attempts(&failed), [Some(1), Some(2), Some(3)], "{history:#?}");
                for (retry, wait_ms) in [(0, 40), (1, 80)] {
                    let waited = sent[retry + 1].at - failed[retry].at;
                    assert!(
                        waited >= chrono::Duration::milliseconds(wait_ms),
                        "attempt {} sent {waited} after attempt {} failed: less than its {wait_ms} ms backoff",
                        retry + 2,
                        retry + 1
                    );
                }
                let turned: Vec<&SagaEvent> =
                    history.iter().filter(|event| event.kind == EventKind::Compensating).collect();
                assert_eq!(turned.len(), 1, "{history:#?}");
                assert_eq!(turned[0].detail.as_deref(), Some("exhausted"));
                assert!(turned[0].at >= failed[2].at, "it compensates after the last attempt");
                let kinds: Vec<String> = sqlx::query_scalar("SELECT kind FROM journal ORDER BY seq")
                    .fetch_all(&fx.pool)
                    .await
                    .unwrap();
                assert_eq!(
                    kinds,
                    ["book_flight", "book_hotel", "return_car", "cancel_hotel", "cancel_flight"]
                );
            }

            /// A saga refused at its third step undoes the second step before the first,
            /// each once, under duplicated commands and lost replies: compensations run
            /// in reverse order.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn compensations_run_in_reverse_order_once_each() {
                let fx = <$fixture>::new().await;
                fx.exec(JOURNAL_DDL).await;
                let definition = Arc::new(SagaDefinition::from_toml_str(JOURNEY).unwrap());
                let seq = Arc::new(AtomicU64::new(0));
                let dispatch = pools(&fx, &definition, Journal(seq.clone()), 2).await;
                let store = fx.store(4).await;
                let (orchestrator, _) = Actor::spawn(
                    None,
                    Orchestrator::new(),
                    OrchestratorArguments::new(definition, store.clone(), Arc::new(FaultyDispatch::new(dispatch, 0.5, 0.2, 11).unwrap())).with_stats(Arc::default()),
                )
                .await
                .unwrap();
                const SAGAS: usize = 20;
                for n in 0..SAGAS {
                    let saga = SagaInstance::new(format!("j-{n:03}"), "journey", json!({ "n": n }), Utc::now());
                    let mut conn = store.pool().acquire().await.unwrap();
                    store.insert(&mut conn, &saga).await.unwrap();
                    drop(conn);
                    orchestrator.send_message(OrchestratorMessage::Drive(saga.id)).unwrap();
                }
                wait_idle(&orchestrator).await;
                assert_eq!(
                    fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'compensated'").await,
                    SAGAS as i64
                );
                let rows: Vec<(String, String)> =
                    sqlx::query_as("SELECT saga_id, kind FROM journal ORDER BY saga_id, seq")
                        .fetch_all(&fx.pool)
                        .await
                        .unwrap();
                let mut journeys: std::collections::BTreeMap<String, Vec<String>> = Default::default();
                for (saga, kind) in rows {
                    journeys.entry(saga).or_default().push(kind);
                }
                assert_eq!(journeys.len(), SAGAS);
                for (saga, kinds) in journeys {
                    assert_eq!(
                        kinds,
                        ["book_flight", "book_hotel", "cancel_hotel", "cancel_flight"],
                        "{saga}: undone in reverse order, each once"
                    );
                }
                orchestrator.stop(None);
            }

            /// Without faults a saga is saved once per answer, and the change that ends
            /// it rides in the save of the answer that led to it: flight and hotel
            /// booked, the car refused (turned to compensate), hotel and flight
            /// cancelled (compensated) — five answers, version 5.
            #[tokio::test]
            async fn a_saga_is_saved_once_per_answer_its_ending_included() {
                let fx = <$fixture>::new().await;
                fx.exec(JOURNAL_DDL).await;
                let definition = Arc::new(SagaDefinition::from_toml_str(JOURNEY).unwrap());
                let dispatch = pools(&fx, &definition, Journal(Arc::default()), 1).await;
                let store = fx.store(4).await;
                let (orchestrator, _) = Actor::spawn(
                    None,
                    Orchestrator::new(),
                    OrchestratorArguments::new(definition, store.clone(), Arc::new(dispatch)),
                )
                .await
                .unwrap();
                let saga = SagaInstance::new("once-1", "journey", json!({ "n": 0 }), Utc::now());
                let mut conn = store.pool().acquire().await.unwrap();
                store.insert(&mut conn, &saga).await.unwrap();
                drop(conn);
                orchestrator.send_message(OrchestratorMessage::Drive(saga.id)).unwrap();
                wait_idle(&orchestrator).await;
                let stored = store.load("once-1").await.unwrap().unwrap();
                assert_eq!((stored.status.as_str(), stored.version), ("compensated", 5));
                orchestrator.stop(None);
            }

            /// A saga handed over as its caller stored it is driven from that copy: fresh,
            /// it ends as a read one would (five answers, version 5, nothing sent twice);
            /// stale (the row saved once more since), its first save finds the row moved
            /// and reloads it, and the command it sent from the copy is answered by the
            /// step's inbox — one duplicate, every side effect once.
            #[tokio::test]
            async fn a_saga_run_from_its_stored_copy_ends_alike_and_a_stale_copy_applies_nothing_twice() {
                let fx = <$fixture>::new().await;
                fx.exec(JOURNAL_DDL).await;
                let definition = Arc::new(SagaDefinition::from_toml_str(JOURNEY).unwrap());
                let dispatch = pools(&fx, &definition, Journal(Arc::default()), 1).await;
                let store = fx.store(4).await;
                let stats = Arc::new(DriveStats::default());
                let (orchestrator, _) = Actor::spawn(
                    None,
                    Orchestrator::new(),
                    OrchestratorArguments::new(definition, store.clone(), Arc::new(dispatch))
                        .with_stats(Arc::clone(&stats)),
                )
                .await
                .unwrap();
                let fresh = SagaInstance::new("copy-fresh", "journey", json!({ "n": 0 }), Utc::now());
                let stale = SagaInstance::new("copy-stale", "journey", json!({ "n": 1 }), Utc::now());
                let mut conn = store.pool().acquire().await.unwrap();
                store.insert(&mut conn, &fresh).await.unwrap();
                store.insert(&mut conn, &stale).await.unwrap();
                drop(conn);
                // Another save since the copy was taken: the row is at version 1.
                assert!(store.save(&mut stale.clone(), &[]).await.unwrap());

                ractor::call!(orchestrator, OrchestratorMessage::RunStored, Box::new(fresh))
                    .unwrap()
                    .unwrap();
                let ended = store.load("copy-fresh").await.unwrap().unwrap();
                assert_eq!((ended.status.as_str(), ended.version), ("compensated", 5));
                assert_eq!(stats.duplicates.load(Ordering::SeqCst), 0);

                ractor::call!(orchestrator, OrchestratorMessage::RunStored, Box::new(stale))
                    .unwrap()
                    .unwrap();
                let ended = store.load("copy-stale").await.unwrap().unwrap();
                assert_eq!((ended.status.as_str(), ended.version), ("compensated", 6));
                assert_eq!(
                    stats.duplicates.load(Ordering::SeqCst),
                    1,
                    "the command sent from the stale copy was answered by the step's inbox"
                );
                let applied: Vec<String> =
                    sqlx::query_scalar("SELECT kind FROM journal WHERE saga_id = 'copy-stale' ORDER BY seq")
                        .fetch_all(&fx.pool)
                        .await
                        .unwrap();
                assert_eq!(applied, ["book_flight", "book_hotel", "cancel_hotel", "cancel_flight"]);
                orchestrator.stop(None);
            }

            /// A batch of saves is written as each save alone would be, in one
            /// transaction: a copy at its saga's version is written (version bumped, its
            /// event in the history), a stale copy is not, and neither holds the other.
            #[tokio::test]
            async fn a_batch_of_saves_writes_each_save_by_its_own_version() {
                let fx = <$fixture>::new().await;
                let store = fx.store(2).await;
                let sagas: Vec<SagaInstance> = ["batch-c", "batch-a", "batch-b"]
                    .into_iter()
                    .map(|id| SagaInstance::new(id, "journey", json!({}), Utc::now()))
                    .collect();
                let mut conn = store.pool().acquire().await.unwrap();
                for saga in &sagas {
                    store.insert(&mut conn, saga).await.unwrap();
                }
                drop(conn);
                // batch-a's row moves on: the batch's copy of it is stale.
                assert!(store.save(&mut sagas[1].clone(), &[]).await.unwrap());
                let event = SagaEvent::new(EventKind::Completed, Utc::now());
                let mut batch: Vec<SagaSave> = sagas
                    .into_iter()
                    .map(|mut saga| {
                        saga.status = SagaStatus::Completed;
                        SagaSave::new(saga, vec![event.clone()])
                    })
                    .collect();
                store.save_batch(&mut batch).await.unwrap();
                let outcome: Vec<(&str, bool, i64)> = batch
                    .iter()
                    .map(|save| (save.instance.id.as_str(), save.written, save.instance.version))
                    .collect();
                assert_eq!(
                    outcome,
                    [("batch-a", false, 0), ("batch-b", true, 1), ("batch-c", true, 1)],
                    "sorted by id; the stale copy unwritten"
                );
                for (id, status, completed_events) in
                    [("batch-a", "running", 0), ("batch-b", "completed", 1), ("batch-c", "completed", 1)]
                {
                    let stored = store.load(id).await.unwrap().unwrap();
                    assert_eq!(stored.status.as_str(), status, "{id}");
                    let history = store.history(id).await.unwrap();
                    let completed =
                        history.iter().filter(|entry| entry.event.kind == EventKind::Completed).count();
                    assert_eq!(completed, completed_events, "{id}: {history:#?}");
                }
                // The two it finished count as finished, by the minute it finished them.
                let finished = store.finished_per_minute(Utc::now() - chrono::TimeDelta::hours(1)).await.unwrap();
                assert_eq!(finished.iter().map(|minute| minute.sagas).sum::<i64>(), 2, "{finished:?}");
            }

            /// Two saves of one saga in one batch: the first is written, the second is
            /// fenced by the version the first moved on, as two saves one after the
            /// other would be; a save's several events all reach the history.
            #[tokio::test]
            async fn a_batch_with_two_saves_of_one_saga_writes_the_first_alone() {
                let fx = <$fixture>::new().await;
                let store = fx.store(2).await;
                let saga = SagaInstance::new("twice", "journey", json!({}), Utc::now());
                let other = SagaInstance::new("other", "journey", json!({}), Utc::now());
                let mut conn = store.pool().acquire().await.unwrap();
                store.insert(&mut conn, &saga).await.unwrap();
                store.insert(&mut conn, &other).await.unwrap();
                drop(conn);
                let events = vec![
                    SagaEvent::new(EventKind::Applied, Utc::now()),
                    SagaEvent::new(EventKind::Completed, Utc::now()),
                ];
                let mut first = saga.clone();
                first.status = SagaStatus::Completed;
                let mut second = saga;
                second.status = SagaStatus::Compensated;
                let mut batch = vec![
                    SagaSave::new(first, events.clone()),
                    SagaSave::new(other, events),
                    SagaSave::new(second, vec![SagaEvent::new(EventKind::Compensated, Utc::now())]),
                ];
                store.save_batch(&mut batch).await.unwrap();
                let outcome: Vec<(&str, &str, bool)> = batch
                    .iter()
                    .map(|save| (save.instance.id.as_str(), save.instance.status.as_str(), save.written))
                    .collect();
                assert_eq!(
                    outcome,
                    [("other", "running", true), ("twice", "completed", true), ("twice", "compensated", false)]
                );
                let stored = store.load("twice").await.unwrap().unwrap();
                assert_eq!((stored.status.as_str(), stored.version), ("completed", 1));
                for id in ["twice", "other"] {
                    let kinds: Vec<EventKind> =
                        store.history(id).await.unwrap().into_iter().map(|entry| entry.event.kind).collect();
                    assert_eq!(kinds, [EventKind::Started, EventKind::Applied, EventKind::Completed], "{id}");
                }
            }

            /// Many sagas inserted at once in the caller's transaction: each stored as one
            /// insert stores it, with its `started` event, a finished one counted as
            /// finished; rolled back with the transaction, none is.
            #[tokio::test]
            async fn sagas_inserted_together_are_stored_as_each_alone_would_be() {
                let fx = <$fixture>::new().await;
                let store = fx.store(2).await;
                let mut sagas: Vec<SagaInstance> = ["all-a", "all-b", "all-c"]
                    .into_iter()
                    .map(|id| SagaInstance::new(id, "journey", json!({"id": id}), Utc::now()))
                    .collect();
                sagas[2].status = SagaStatus::Completed;
                let mut tx = store.pool().begin().await.unwrap();
                store.insert_all(&mut tx, &sagas).await.unwrap();
                tx.rollback().await.unwrap();
                assert!(store.load("all-a").await.unwrap().is_none(), "rolled back with the caller");

                let mut tx = store.pool().begin().await.unwrap();
                store.insert_all(&mut tx, &sagas).await.unwrap();
                store.insert_all(&mut tx, &[]).await.unwrap();
                tx.commit().await.unwrap();
                for saga in &sagas {
                    let stored = store.load(&saga.id).await.unwrap().unwrap();
                    assert_eq!((&stored.id, &stored.status, &stored.data, stored.version), (&saga.id, &saga.status, &saga.data, 0));
                    let kinds: Vec<EventKind> =
                        store.history(&saga.id).await.unwrap().into_iter().map(|entry| entry.event.kind).collect();
                    assert_eq!(kinds, [EventKind::Started], "{}", saga.id);
                }
                let finished = store.finished_per_minute(Utc::now() - chrono::TimeDelta::hours(1)).await.unwrap();
                assert_eq!(finished.iter().map(|minute| minute.sagas).sum::<i64>(), 1, "{finished:?}");
            }

            /// Step pools and an orchestrator on `fx`, with faults.
            async fn start(
                fx: &$fixture,
                duplicate_rate: f64,
                lost_reply_rate: f64,
                seed: u64,
            ) -> (ractor::ActorRef<OrchestratorMessage>, $store, Arc<DriveStats>) {
                let ledger = Arc::new(Ledger { calls: AtomicU64::new(0), fail_every: 5 });
                let dispatch = pools(&fx, &trip(), Handler(ledger.clone()), 3).await;
                let store = fx.store(4).await;
                let stats = Arc::new(DriveStats::default());
                let (orchestrator, _) = Actor::spawn(
                    None,
                    Orchestrator::new(),
                    OrchestratorArguments::new(trip(), store.clone(), Arc::new(FaultyDispatch::new(dispatch, duplicate_rate, lost_reply_rate, seed).unwrap())).with_stats(stats.clone()),
                )
                .await
                .unwrap();
                (orchestrator, store, stats)
            }

            async fn create(store: &$store, n: usize) -> String {
                let id = format!("saga-{n:05}");
                let saga = SagaInstance::new(&id, "trip", plan(n), Utc::now());
                let mut conn = store.pool().acquire().await.unwrap();
                store.insert(&mut conn, &saga).await.unwrap();
                id
            }

            /// Every invariant, by SQL over the ledger and sagabox_saga_instances.
            async fn check(fx: &$fixture, sagas: usize) {
                let count = |sql: &'static str| fx.scalar(sql);
                assert_eq!(count("SELECT COUNT(*) FROM sagabox_saga_instances").await, sagas as i64);
                assert_eq!(
                    count("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status NOT IN ('completed', 'compensated')").await,
                    0,
                    "unfinished sagas"
                );
                assert_eq!(
                    count("SELECT COUNT(*) FROM (SELECT saga_id, kind FROM ledger GROUP BY saga_id, kind HAVING COUNT(*) > 1) d").await,
                    0,
                    "a command applied twice"
                );
                let expected_completed = (0..sagas).filter(|n| !matches!(n % 7, 0 | 3)).count() as i64;
                assert_eq!(count("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'completed'").await, expected_completed);
                // completed: the three bookings, no cancellation.
                assert_eq!(
                    count("SELECT COUNT(*) FROM sagabox_saga_instances s WHERE status = 'completed' AND \
                           (SELECT COUNT(*) FROM ledger l WHERE l.saga_id = s.id AND kind IN ('book_hotel', 'book_flight', 'send_notice')) <> 3").await,
                    0
                );
                assert_eq!(
                    count("SELECT COUNT(*) FROM ledger l JOIN sagabox_saga_instances s ON s.id = l.saga_id \
                           WHERE s.status = 'completed' AND l.kind LIKE 'cancel_%'").await,
                    0
                );
                // compensated: every booking undone, nothing notified.
                assert_eq!(
                    count("SELECT COUNT(*) FROM sagabox_saga_instances s WHERE status = 'compensated' AND ( \
                           (SELECT COUNT(*) FROM ledger l WHERE l.saga_id = s.id AND kind = 'book_hotel') <> \
                           (SELECT COUNT(*) FROM ledger l WHERE l.saga_id = s.id AND kind = 'cancel_hotel') OR \
                           (SELECT COUNT(*) FROM ledger l WHERE l.saga_id = s.id AND kind = 'book_flight') <> \
                           (SELECT COUNT(*) FROM ledger l WHERE l.saga_id = s.id AND kind = 'cancel_flight') OR \
                           (SELECT COUNT(*) FROM ledger l WHERE l.saga_id = s.id AND kind = 'send_notice') <> 0)").await,
                    0
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sagas_complete_or_compensate_exactly_once_under_faults() {
                let fx = <$fixture>::new().await;
                fx.exec(LEDGER_DDL).await;
                let (orchestrator, store, stats) = start(&fx, 0.5, 0.2, 7).await;
                const SAGAS: usize = 150;
                for n in 0..SAGAS {
                    let id = create(&store, n).await;
                    orchestrator.send_message(OrchestratorMessage::Drive(id)).unwrap();
                }
                wait_idle(&orchestrator).await;
                check(&fx, SAGAS).await;
                assert!(stats.retries.load(Ordering::SeqCst) > 0, "lost replies and failures caused retries");
                assert!(stats.duplicates.load(Ordering::SeqCst) > 0, "retries after lost replies met the inbox");
                orchestrator.stop(None);
            }

            /// Two drivers (or a stale process) holding copies of one saga: the second save
            /// from the older copy writes nothing, neither state nor history, so state never
            /// goes backwards and the history holds only what the state says happened.
            #[tokio::test]
            async fn a_save_from_a_stale_copy_changes_nothing() {
                let fx = <$fixture>::new().await;
                let store = fx.store(2).await;
                let id = create(&store, 1).await;
                let mut first = store.load(&id).await.unwrap().unwrap();
                let mut stale = first.clone();
                first.current_step = 2;
                let applied = SagaEvent::new(EventKind::Applied, Utc::now())
                    .step("first", Direction::Forward)
                    .attempt(1);
                assert!(store.save(&mut first, std::slice::from_ref(&applied)).await.unwrap());
                stale.current_step = 1;
                let stale_event = SagaEvent::new(EventKind::Refused, Utc::now()).detail("stale");
                assert!(!store.save(&mut stale, &[stale_event]).await.unwrap(), "stale copy refused");
                let stored = store.load(&id).await.unwrap().unwrap();
                assert_eq!((stored.current_step, stored.version), (2, 1));
                let history = store.history(&id).await.unwrap();
                let kinds: Vec<_> = history.iter().map(|e| (e.version, e.event.kind)).collect();
                assert_eq!(kinds, [(0, EventKind::Started), (1, EventKind::Applied)]);
                assert_eq!(history[1].event.step.as_deref(), Some("first"));
            }

            /// ResumeAll drives only sagas of the orchestrator's own definition.
            #[tokio::test]
            async fn resume_leaves_other_sagas_alone() {
                let fx = <$fixture>::new().await;
                fx.exec(LEDGER_DDL).await;
                let (orchestrator, store, _) = start(&fx, 0.0, 0.0, 5).await;
                let other = SagaInstance::new("other-1", "shipping", json!({}), Utc::now());
                let mut conn = store.pool().acquire().await.unwrap();
                store.insert(&mut conn, &other).await.unwrap();
                drop(conn);
                let mine = create(&store, 1).await;
                let resumed = ractor::call_t!(orchestrator, OrchestratorMessage::ResumeAll, 30_000).unwrap().unwrap();
                assert_eq!(resumed, 1);
                wait_idle(&orchestrator).await;
                let untouched = store.load("other-1").await.unwrap().unwrap();
                assert_eq!((untouched.status.as_str(), untouched.version), ("running", 0));
                // Driving it by id is refused too.
                ractor::call_t!(orchestrator, OrchestratorMessage::Run, 30_000, "other-1".to_owned()).unwrap().unwrap();
                assert_eq!(store.load("other-1").await.unwrap().unwrap().version, 0);
                assert_eq!(store.load(&mine).await.unwrap().unwrap().status.as_str(), "completed");
                orchestrator.stop(None);
            }

            /// A saga older than the inbox TTL: its commands are refused as expired, its
            /// compensation too. The driver must stop and say why, not retry forever.
            #[tokio::test]
            async fn a_rejected_compensation_stops_the_driver_with_the_reason() {
                let fx = <$fixture>::new().await;
                fx.exec(LEDGER_DDL).await;
                let (orchestrator, store, _) = start(&fx, 0.0, 0.0, 6).await;
                let old = SagaInstance::new("old-1", "trip", plan(1), Utc::now() - chrono::TimeDelta::days(60));
                let mut conn = store.pool().acquire().await.unwrap();
                store.insert(&mut conn, &old).await.unwrap();
                drop(conn);
                ractor::call_t!(orchestrator, OrchestratorMessage::Run, 30_000, "old-1".to_owned())
                    .expect("the driver ends instead of looping")
                    .expect("the driver did not crash");
                let stuck = store.load("old-1").await.unwrap().unwrap();
                assert_eq!(stuck.status.as_str(), "compensating");
                let error = stuck.last_error.unwrap_or_default();
                assert!(error.contains("deduplication window"), "{error}");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM ledger").await, 0);
                orchestrator.stop(None);
            }

            /// Many `Drive` messages for the same sagas at once: still one driver per saga,
            /// so each step is sent exactly once when nothing fails.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn one_driver_per_saga_however_often_it_is_asked() {
                let fx = <$fixture>::new().await;
                fx.exec(LEDGER_DDL).await;
                let (orchestrator, store, stats) = start(&fx, 0.0, 0.0, 3).await;
                let mut ids = Vec::new();
                for n in 0..42 {
                    ids.push(create(&store, n).await);
                }
                for _ in 0..5 {
                    for id in &ids {
                        orchestrator.send_message(OrchestratorMessage::Drive(id.clone())).unwrap();
                    }
                }
                wait_idle(&orchestrator).await;
                // fail_every = 5 makes some attempts fail after writing: count only the
                // commands that went out more than their retries explain.
                let sent = stats.deliveries.load(Ordering::SeqCst) - stats.retries.load(Ordering::SeqCst);
                // 30 complete (3 commands), 6 are refused at the hotel (1), 6 at the flight
                // (hotel, flight, cancel_hotel).
                assert_eq!(sent, 30 * 3 + 6 + 6 * 3, "one driver per saga");
                assert_eq!(stats.duplicates.load(Ordering::SeqCst), 0, "no second driver resent a command");
                check(&fx, ids.len()).await;
                orchestrator.stop(None);
            }

            /// A process dies mid-flight (its runtime dropped: every task gone, every open
            /// transaction rolled back with its connection); a new one resumes.
            #[test]
            fn a_crashed_orchestrator_resumes_every_unfinished_saga() {
                const SAGAS: usize = 120;
                let setup = tokio::runtime::Runtime::new().unwrap();
                let fx = setup.block_on(async {
                    let fx = <$fixture>::new().await;
                    fx.exec(LEDGER_DDL).await;
                    fx
                });

                let first = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
                first.block_on(async {
                    let (orchestrator, store, _) = start(&fx, 0.3, 0.1, 11).await;
                    for n in 0..SAGAS {
                        let id = create(&store, n).await;
                        orchestrator.send_message(OrchestratorMessage::Drive(id)).unwrap();
                    }
                    // Let it get part of the way: an amount of work, not a span of time.
                    // Counted through the dying process's own pool: a connection the
                    // fixture's pool opened on this runtime would be dead after it.
                    let deadline = std::time::Instant::now() + Duration::from_secs(120);
                    let ledger = || sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM ledger").fetch_one(store.pool());
                    while ledger().await.unwrap() < 60 {
                        assert!(std::time::Instant::now() < deadline, "the orchestrator made no progress");
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                });
                first.shutdown_background();
                let unfinished = setup.block_on(fx.scalar(
                    "SELECT COUNT(*) FROM sagabox_saga_instances WHERE status NOT IN ('completed', 'compensated')",
                ));
                assert!(unfinished > 0, "the crash left work to resume");

                let second = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
                second.block_on(async {
                    let (orchestrator, _, _) = start(&fx, 0.3, 0.1, 12).await;
                    let resumed = ractor::call_t!(orchestrator, OrchestratorMessage::ResumeAll, 30_000).unwrap().unwrap();
                    // A statement of the dead process may still commit after the count:
                    // that can only finish a saga, never unfinish one.
                    assert!(resumed > 0 && resumed as i64 <= unfinished, "{resumed} of {unfinished}");
                    wait_idle(&orchestrator).await;
                    check(&fx, SAGAS).await;
                    orchestrator.stop(None);
                });
                second.shutdown_timeout(Duration::from_secs(5));
                drop(setup);
            }
        }
    };
}

orchestrator_suite!(postgres, common::Pg, sqlx::Postgres, sagabox::PostgresStore);
orchestrator_suite!(sqlite, common::Lite, sqlx::Sqlite, sagabox::SqliteStore);

/// PostgreSQL: sagas driven at once share commits — the saves asked for while a batch is
/// written go together in the next, and so do the commands of a step whose pool claims
/// in batches — and a batch that fails is written again a save at a time, so a saga
/// whose save cannot be written holds no other.
mod group_commit {
    use super::*;

    /// Books every command, journaling it.
    #[derive(Debug, Clone)]
    struct Books;

    impl StepHandler<sqlx::Postgres> for Books {
        async fn handle(
            &self,
            conn: &mut sqlx::PgConnection,
            envelope: &Envelope,
        ) -> Result<Value, StepError> {
            sqlx::query("INSERT INTO journal (seq, saga_id, kind) VALUES (0, $1, $2)")
                .bind(envelope.saga_id.clone().unwrap_or_default())
                .bind(envelope.kind.as_str())
                .execute(&mut *conn)
                .await
                .map_err(|e| StepError::Retryable(e.to_string()))?;
            Ok(json!({}))
        }
    }

    /// Every saga row update takes 5 ms: saves queue behind the batch being written.
    const SLOW_SAVES: &str = "CREATE FUNCTION slow_save() RETURNS trigger AS $$ \
        BEGIN PERFORM pg_sleep(0.005); RETURN NEW; END $$ LANGUAGE plpgsql; \
        CREATE TRIGGER slow_save BEFORE UPDATE ON sagabox_saga_instances \
        FOR EACH ROW EXECUTE FUNCTION slow_save()";

    /// The first three saves of saga `stubborn` fail (the sequence is not rolled back
    /// with them).
    const STUBBORN: &str = "CREATE SEQUENCE refusals; \
        CREATE FUNCTION refuse_stubborn() RETURNS trigger AS $$ \
        BEGIN IF NEW.id = 'stubborn' AND nextval('refusals') <= 3 THEN \
        RAISE EXCEPTION 'the stubborn saga is refused'; END IF; RETURN NEW; END $$ \
        LANGUAGE plpgsql; \
        CREATE TRIGGER refuse_stubborn BEFORE UPDATE ON sagabox_saga_instances \
        FOR EACH ROW EXECUTE FUNCTION refuse_stubborn()";

    /// Drives `ids` at once on a journey whose steps all book, their pools claiming in
    /// batches of up to `claims` (1: each command alone), half the commands sent twice
    /// when `duplicates`; returns, once every saga is driven, how many deliveries a
    /// step's inbox answered as duplicates.
    async fn drive_all(fx: &common::Pg, ids: &[String], claims: usize, duplicates: bool) -> u64 {
        let definition = Arc::new(SagaDefinition::from_toml_str(JOURNEY).unwrap());
        let mut dispatch = InProcess::new();
        for step in definition.steps() {
            let guard = InboxGuard::new(fx.store(5).await, InboxConfig::default()).unwrap();
            let pool = StepPool::spawn(
                guard,
                step.consumer_type().clone(),
                Books,
                StepPoolConfig { workers: 4 },
            )
            .await
            .unwrap();
            dispatch = if claims > 1 {
                dispatch.with_batched_pool(pool, claims)
            } else {
                dispatch.with_pool(pool)
            };
        }
        let duplicate_rate = if duplicates { 0.5 } else { 0.0 };
        let dispatch = Arc::new(FaultyDispatch::new(dispatch, duplicate_rate, 0.0, 7).unwrap());
        let store = fx.store(8).await;
        let (orchestrator, _) = Actor::spawn(
            None,
            Orchestrator::new(),
            OrchestratorArguments::new(definition, store.clone(), Arc::clone(&dispatch)),
        )
        .await
        .unwrap();
        let mut runs = tokio::task::JoinSet::new();
        for id in ids {
            let saga = SagaInstance::new(id.as_str(), "journey", json!({}), Utc::now());
            let mut conn = store.pool().acquire().await.unwrap();
            store.insert(&mut conn, &saga).await.unwrap();
            let orchestrator = orchestrator.clone();
            runs.spawn(async move {
                ractor::call_t!(
                    orchestrator,
                    OrchestratorMessage::RunStored,
                    60_000,
                    Box::new(saga)
                )
            });
        }
        while let Some(run) = runs.join_next().await {
            run.unwrap().expect("answered in time").expect("driven");
        }
        orchestrator.stop(None);
        dispatch.counts().duplicates.load(Ordering::SeqCst)
    }

    /// Every saga completed (four steps, four saves: version 4) and every step applied once.
    async fn assert_each_completed_once(fx: &common::Pg, sagas: i64) {
        assert_eq!(
            fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'completed' AND version = 4")
                .await,
            sagas
        );
        assert_eq!(fx.scalar("SELECT COUNT(*) FROM journal").await, 4 * sagas);
        assert_eq!(
            fx.scalar(
                "SELECT COUNT(*) FROM (SELECT DISTINCT saga_id, kind FROM journal) AS applied"
            )
            .await,
            4 * sagas,
            "each step applied once"
        );
    }

    #[tokio::test]
    async fn sagas_driven_at_once_share_their_commits() {
        let fx = common::Pg::new().await;
        fx.exec(JOURNAL_DDL).await;
        fx.exec(SLOW_SAVES).await;
        let ids: Vec<String> = (0..100).map(|n| format!("shared-{n:03}")).collect();
        drive_all(&fx, &ids, 1, false).await;
        assert_each_completed_once(&fx, 100).await;
        // The rows one transaction wrote share its id (xmin): one per commit.
        let saves = fx
            .scalar("SELECT COUNT(DISTINCT (saga_id, version)) FROM sagabox_saga_events WHERE version > 0")
            .await;
        let commits = fx
            .scalar("SELECT COUNT(DISTINCT xmin::text) FROM sagabox_saga_events WHERE version > 0")
            .await;
        println!("{saves} saves in {commits} commits");
        assert_eq!(saves, 400);
        assert!(
            commits * 2 <= saves,
            "{saves} saves in {commits} commits: batches of two or more on average"
        );
    }

    #[tokio::test]
    async fn a_save_that_fails_its_batch_is_written_alone_and_holds_no_other_saga() {
        let fx = common::Pg::new().await;
        fx.exec(JOURNAL_DDL).await;
        fx.exec(SLOW_SAVES).await;
        fx.exec(STUBBORN).await;
        let mut ids: Vec<String> = (0..40).map(|n| format!("other-{n:02}")).collect();
        ids.push("stubborn".to_owned());
        drive_all(&fx, &ids, 1, false).await;
        assert_each_completed_once(&fx, 41).await;
        assert!(
            fx.scalar("SELECT last_value FROM refusals").await > 3,
            "the stubborn saga's saves were refused, then written"
        );
    }

    #[tokio::test]
    async fn commands_claimed_in_batches_share_commits_and_each_applies_once() {
        let fx = common::Pg::new().await;
        fx.exec(JOURNAL_DDL).await;
        let ids: Vec<String> = (0..100).map(|n| format!("claimed-{n:03}")).collect();
        // Half the commands sent twice: copies of one command meet in a batch, or not.
        let duplicates = drive_all(&fx, &ids, 16, true).await;
        assert!(
            duplicates > 0,
            "copies of commands were answered as duplicates"
        );
        assert_each_completed_once(&fx, 100).await;
        let claims = fx.inbox_rows().await;
        let commits = fx
            .scalar("SELECT COUNT(DISTINCT xmin::text) FROM sagabox_inbox")
            .await;
        println!("{claims} claims in {commits} commits");
        assert_eq!(claims, 400, "one inbox row per command");
        assert!(
            commits * 2 <= claims,
            "{claims} claims in {commits} commits: batches of two or more on average"
        );
    }

    /// Books; its `alive` count tells whether the pool that runs it still lives.
    #[derive(Debug, Clone)]
    struct Held {
        _alive: Arc<()>,
    }

    impl StepHandler<sqlx::Postgres> for Held {
        async fn handle(
            &self,
            conn: &mut sqlx::PgConnection,
            envelope: &Envelope,
        ) -> Result<Value, StepError> {
            Books.handle(conn, envelope).await
        }
    }

    /// Stopping an `InProcess` stops its batched pools too, after the batch in flight:
    /// their handlers are gone once `stop` returns.
    #[tokio::test]
    async fn stopping_in_process_stops_a_batched_pool() {
        let fx = common::Pg::new().await;
        fx.exec(JOURNAL_DDL).await;
        let alive = Arc::new(());
        let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default()).unwrap();
        let flight = sagabox::ConsumerType::new("flight").unwrap();
        let pool = StepPool::spawn(
            guard,
            flight.clone(),
            Held {
                _alive: Arc::clone(&alive),
            },
            StepPoolConfig { workers: 2 },
        )
        .await
        .unwrap();
        let dispatch = InProcess::new().with_batched_pool(pool, 8);
        let command = Envelope::new(sagabox::MessageId::new_v7(), "book_flight", json!({}))
            .unwrap()
            .with_saga_id("held-1");
        let reply = dispatch
            .dispatch(&flight, command, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(!reply.duplicate);
        dispatch.stop().await;
        assert_eq!(
            Arc::strong_count(&alive),
            1,
            "the pool's handlers are dropped"
        );
    }
}
