//! Running sagas in production, against real PostgreSQL and SQLite: the history written
//! with every state change (and agreeing with it), parking a saga that cannot move, an
//! operator's retry and cancel while its driver runs, deadlines on a manual clock (and
//! across an orchestrator restart), and definition versions (old sagas finish on their
//! old steps after the definition changed; a changed definition under a stored version
//! is refused). Every check reads the database.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use ractor::{Actor, ActorRef};
use sagabox::clock::{Clock, ManualClock};
use sagabox::orchestrator::{InProcess, Orchestrator, OrchestratorArguments, OrchestratorMessage};
use sagabox::saga::operator::{self, OperatorError};
use sagabox::saga::{
    EventKind, SagaDefinition, SagaFilter, SagaInsert, SagaInstance, SagaState, SagaStatus,
    SagaStore,
};
use sagabox::step::{StepError, StepHandler, StepPool, StepPoolConfig};
use sagabox::testing::FaultyDispatch;
use sagabox::{Envelope, InboxConfig, InboxGuard, Month};
use serde_json::{Value, json};

/// `a` then `b`, both compensated, then `c` without compensation.
const ORDER_V1: &str = r#"
name = "order"
[[steps]]
name = "a"
consumer_type = "a"
command = "do_a"
compensation = "undo_a"
timeout = "5s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "10ms"
[[steps]]
name = "b"
consumer_type = "b"
command = "do_b"
compensation = "undo_b"
timeout = "5s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "10ms"
[[steps]]
name = "c"
consumer_type = "c"
command = "do_c"
timeout = "5s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "10ms"
"#;

/// Version 2 of the same saga: a step `x` inserted between `a` and `b`.
fn order_v2() -> String {
    const X: &str = r#"[[steps]]
name = "x"
consumer_type = "x"
command = "do_x"
compensation = "undo_x"
timeout = "5s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "10ms"
"#;
    ORDER_V1
        .replacen("name = \"order\"", "name = \"order\"\nversion = 2", 1)
        .replacen(
            "[[steps]]\nname = \"b\"",
            &format!("{X}[[steps]]\nname = \"b\""),
            1,
        )
}

const LEDGER_DDL: &str = "CREATE TABLE ledger (saga_id TEXT NOT NULL, kind TEXT NOT NULL)";

/// What the steps do, switched by the test while sagas run: kinds refused for good, and
/// kinds that fail (retryably) until allowed.
#[derive(Debug, Default)]
struct Control {
    refused: Mutex<HashSet<String>>,
    failing: Mutex<HashSet<String>>,
}

impl Control {
    fn refuse(&self, kind: &str) {
        self.refused.lock().unwrap().insert(kind.to_owned());
    }
    fn fail(&self, kind: &str) {
        self.failing.lock().unwrap().insert(kind.to_owned());
    }
    fn allow(&self, kind: &str) {
        self.refused.lock().unwrap().remove(kind);
        self.failing.lock().unwrap().remove(kind);
    }
}

fn definition(text: &str) -> Arc<SagaDefinition> {
    Arc::new(SagaDefinition::from_toml_str(text).unwrap())
}

async fn wait_idle(orchestrator: &ActorRef<OrchestratorMessage>) {
    ractor::call_t!(orchestrator, OrchestratorMessage::WhenIdle, 60_000)
        .expect("orchestrator idle in time");
}

macro_rules! saga_ops_suite {
    ($backend:ident, $fixture:ty, $db:ty, $store:ty) => {
        mod $backend {
            use super::*;

            /// Writes `(saga, kind)` to the ledger unless `Control` says otherwise.
            #[derive(Debug, Clone)]
            struct Ledger(Arc<Control>);

            impl StepHandler<$db> for Ledger {
                async fn handle(
                    &self,
                    conn: &mut <$db as sqlx::Database>::Connection,
                    envelope: &Envelope,
                ) -> Result<Value, StepError> {
                    let kind = envelope.kind.as_str();
                    let flagged = envelope.payload.get("refuse").and_then(Value::as_str) == Some(kind);
                    if flagged || self.0.refused.lock().unwrap().contains(kind) {
                        return Err(StepError::Permanent(format!("{kind} refused by the test")));
                    }
                    if self.0.failing.lock().unwrap().contains(kind) {
                        return Err(StepError::Retryable(format!("{kind} held by the test")));
                    }
                    sqlx::query("INSERT INTO ledger (saga_id, kind) VALUES ($1, $2)")
                        .bind(envelope.saga_id.clone().unwrap_or_default())
                        .bind(kind)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| StepError::Retryable(e.to_string()))?;
                    Ok(json!({ "kind": kind }))
                }
            }

            struct Setup {
                fx: $fixture,
                store: $store,
                control: Arc<Control>,
            }

            impl Setup {
                async fn new() -> Self {
                    let fx = <$fixture>::new().await;
                    fx.exec(LEDGER_DDL).await;
                    let store = fx.store(4).await;
                    Self { fx, store, control: Arc::default() }
                }

                /// An orchestrator of `definition` with a step pool per consumer type of
                /// both versions, on `clock`, through `FaultyDispatch` with the given rates.
                async fn orchestrator(
                    &self,
                    definition: Arc<SagaDefinition>,
                    clock: Option<ManualClock>,
                    faults: (f64, f64),
                ) -> Result<ActorRef<OrchestratorMessage>, ractor::SpawnErr> {
                    let mut dispatch = InProcess::new();
                    for consumer in ["a", "b", "c", "x"] {
                        let guard = InboxGuard::new(self.fx.store(2).await, InboxConfig::default()).unwrap();
                        let pool = StepPool::spawn(
                            guard,
                            consumer.parse().unwrap(),
                            Ledger(Arc::clone(&self.control)),
                            StepPoolConfig { workers: 2 },
                        )
                        .await
                        .unwrap();
                        dispatch = dispatch.with_pool(pool);
                    }
                    let dispatch = FaultyDispatch::new(dispatch, faults.0, faults.1, 7).unwrap();
                    let mut arguments = OrchestratorArguments::new(definition, self.store.clone(), Arc::new(dispatch));
                    if let Some(clock) = clock {
                        arguments = arguments.with_clock(Arc::new(clock));
                    }
                    Actor::spawn(None, Orchestrator::new(), arguments).await.map(|(actor, _)| actor)
                }

                async fn create(&self, definition: &SagaDefinition, id: &str, now: chrono::DateTime<Utc>) -> SagaInstance {
                    self.create_with(definition, id, json!({ "id": id }), now).await
                }

                async fn create_with(&self, definition: &SagaDefinition, id: &str, data: Value, now: chrono::DateTime<Utc>) -> SagaInstance {
                    let saga = SagaInstance::under(definition, id, data, now);
                    let mut conn = self.store.pool().acquire().await.unwrap();
                    self.store.insert(&mut conn, &saga).await.unwrap();
                    saga
                }

                async fn saga(&self, id: &str) -> SagaInstance {
                    self.store.load(id).await.unwrap().unwrap()
                }

                async fn kinds(&self, id: &str) -> Vec<EventKind> {
                    self.store.history(id).await.unwrap().into_iter().map(|e| e.event.kind).collect()
                }

                /// How many times saga `id` had `kind` applied.
                async fn applied(&self, id: &str, kind: &str) -> i64 {
                    sqlx::query_scalar("SELECT COUNT(*) FROM ledger WHERE saga_id = $1 AND kind = $2")
                        .bind(id)
                        .bind(kind)
                        .fetch_one(&self.fx.pool)
                        .await
                        .unwrap()
                }
            }

            /// Under duplicated commands, lost replies and refusals, every saga's history
            /// has an entry for each version of its state (started at 0, the newest at the
            /// saga's version) and ends with how the saga ended.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn history_and_state_agree_for_every_saga() {
                let setup = Setup::new().await;
                let order = definition(ORDER_V1);
                let orchestrator = setup.orchestrator(Arc::clone(&order), None, (0.3, 0.2)).await.unwrap();
                const SAGAS: usize = 30;
                for n in 0..SAGAS {
                    // Every third saga is refused at b: a is compensated.
                    let id = format!("h-{n:03}");
                    let data = if n % 3 == 0 { json!({ "refuse": "do_b" }) } else { json!({}) };
                    let saga = setup.create_with(&order, &id, data, Utc::now()).await;
                    orchestrator.send_message(OrchestratorMessage::Drive(saga.id)).unwrap();
                }
                wait_idle(&orchestrator).await;
                for n in 0..SAGAS {
                    let id = format!("h-{n:03}");
                    let saga = setup.saga(&id).await;
                    let history = setup.store.history(&id).await.unwrap();
                    let versions: std::collections::BTreeSet<i64> = history.iter().map(|e| e.version).collect();
                    assert_eq!(
                        versions,
                        (0..=saga.version).collect(),
                        "{id}: one save, one entry; none without its state"
                    );
                    let kinds: Vec<EventKind> = history.iter().map(|e| e.event.kind).collect();
                    assert_eq!(kinds.first(), Some(&EventKind::Started));
                    let (status, last) = if n % 3 == 0 {
                        (SagaStatus::Compensated, EventKind::Compensated)
                    } else {
                        (SagaStatus::Completed, EventKind::Completed)
                    };
                    assert_eq!((saga.status, kinds.last()), (status, Some(&last)), "{id}: {kinds:?}");
                    let sent = kinds.iter().filter(|k| **k == EventKind::Sent).count();
                    let answered = kinds
                        .iter()
                        .filter(|k| matches!(k, EventKind::Applied | EventKind::Duplicate | EventKind::Refused | EventKind::Failed | EventKind::TimedOut | EventKind::Rejected))
                        .count();
                    assert_eq!(sent, answered, "{id}: every attempt has its answer: {kinds:?}");
                }
                orchestrator.stop(None);
            }

            /// A compensation refused for good parks the saga (resume passes leave it
            /// alone); once the cause is fixed, an operator's retry sends it on and it
            /// ends compensated, each step applied and undone once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_refused_compensation_parks_the_saga_until_an_operator_retries_it() {
                let setup = Setup::new().await;
                let order = definition(ORDER_V1);
                let orchestrator = setup.orchestrator(Arc::clone(&order), None, (0.0, 0.0)).await.unwrap();
                setup.control.refuse("do_b");
                setup.control.refuse("undo_a");
                let saga = setup.create(&order, "p-1", Utc::now()).await;
                ractor::call!(orchestrator, OrchestratorMessage::Run, saga.id.clone()).unwrap().unwrap();
                let parked = setup.saga("p-1").await;
                assert_eq!(parked.state(), SagaState::Parked);
                assert_eq!(parked.status, SagaStatus::Compensating);
                assert!(parked.parked.as_deref().unwrap().contains("undo a refused"), "{parked:?}");
                let resumed = ractor::call!(orchestrator, OrchestratorMessage::ResumeAll).unwrap().unwrap();
                assert_eq!(resumed, 0, "a parked saga is not resumed");
                let listed = |state: Option<SagaState>, name: Option<&str>| {
                    let filter = SagaFilter { state, saga_name: name.map(str::to_owned), limit: 10, ..SagaFilter::default() };
                    let store = setup.store.clone();
                    async move {
                        store.list(&filter).await.unwrap().into_iter().map(|s| s.id).collect::<Vec<_>>()
                    }
                };
                assert_eq!(listed(Some(SagaState::Parked), None).await, ["p-1"]);
                assert_eq!(listed(Some(SagaState::Parked), Some("order")).await, ["p-1"]);
                assert!(listed(Some(SagaState::Parked), Some("trip")).await.is_empty());
                assert!(
                    listed(Some(SagaState::Status(SagaStatus::Compensating)), None).await.is_empty(),
                    "a parked saga is listed as parked, not by its status"
                );
                assert_eq!(listed(None, None).await, ["p-1"]);
                // Driving it by id does not move it either.
                ractor::call!(orchestrator, OrchestratorMessage::Run, "p-1".to_owned()).unwrap().unwrap();
                assert_eq!(setup.saga("p-1").await.version, parked.version);

                let error = operator::cancel(&setup.store, "p-1", "ops: try", Utc::now()).await.unwrap_err();
                assert!(matches!(error, OperatorError::AlreadyCompensating { .. }), "{error:?}");
                setup.control.allow("undo_a");
                let retried = operator::retry(&setup.store, "p-1", "ops: refunds fixed", Utc::now()).await.unwrap();
                assert_eq!(retried.parked, None);
                let resumed = ractor::call!(orchestrator, OrchestratorMessage::ResumeAll).unwrap().unwrap();
                assert_eq!(resumed, 1);
                wait_idle(&orchestrator).await;
                assert_eq!(setup.saga("p-1").await.status, SagaStatus::Compensated);
                assert_eq!((setup.applied("p-1", "do_a").await, setup.applied("p-1", "undo_a").await), (1, 1));
                let kinds = setup.kinds("p-1").await;
                for kind in [EventKind::Refused, EventKind::Parked, EventKind::Retried, EventKind::Compensated] {
                    assert!(kinds.contains(&kind), "{kind:?} in {kinds:?}");
                }
                let history = setup.store.history("p-1").await.unwrap();
                let retried = history.iter().find(|e| e.event.kind == EventKind::Retried).unwrap();
                assert_eq!(retried.event.detail.as_deref(), Some("ops: refunds fixed"));
                let error = operator::retry(&setup.store, "p-1", "again", Utc::now()).await.unwrap_err();
                assert!(matches!(error, OperatorError::Finished { status: SagaStatus::Compensated, .. }), "{error:?}");
                let error = operator::retry(&setup.store, "nope", "x", Utc::now()).await.unwrap_err();
                assert!(matches!(error, OperatorError::NotFound(_)), "{error:?}");
                orchestrator.stop(None);
            }

            /// An operator cancels sagas whose step keeps failing while their drivers
            /// retry it: the drivers' next saves are refused, they go on from the
            /// cancelled state and compensate what ran, the step in flight included.
            /// Nothing is applied or undone twice.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn cancel_while_the_driver_runs_compensates_once() {
                let setup = Setup::new().await;
                let order = definition(ORDER_V1);
                let orchestrator = setup.orchestrator(Arc::clone(&order), None, (0.3, 0.2)).await.unwrap();
                setup.control.fail("do_b");
                const SAGAS: usize = 10;
                for n in 0..SAGAS {
                    let saga = setup.create(&order, &format!("c-{n}"), Utc::now()).await;
                    orchestrator.send_message(OrchestratorMessage::Drive(saga.id)).unwrap();
                }
                for n in 0..SAGAS {
                    let id = format!("c-{n}");
                    common::wait_for("the saga retrying b", async || {
                        let saga = setup.saga(&id).await;
                        saga.current_step == 1 && saga.attempts >= 2
                    })
                    .await;
                    let cancelled = operator::cancel(&setup.store, &id, "ops: customer left", Utc::now()).await.unwrap();
                    assert_eq!((cancelled.status, cancelled.current_step), (SagaStatus::Compensating, 1));
                }
                wait_idle(&orchestrator).await;
                for n in 0..SAGAS {
                    let id = format!("c-{n}");
                    assert_eq!(setup.saga(&id).await.status, SagaStatus::Compensated, "{id}");
                    for (kind, times) in [("do_a", 1), ("undo_a", 1), ("do_b", 0), ("undo_b", 1), ("do_c", 0)] {
                        assert_eq!(setup.applied(&id, kind).await, times, "{id}: {kind}");
                    }
                    assert!(setup.kinds(&id).await.contains(&EventKind::Cancelled));
                }
                // Finished, unknown, and past the step without compensation: refused.
                let error = operator::cancel(&setup.store, "c-0", "again", Utc::now()).await.unwrap_err();
                assert!(matches!(error, OperatorError::Finished { .. }), "{error:?}");
                let error = operator::cancel(&setup.store, "nope", "x", Utc::now()).await.unwrap_err();
                assert!(matches!(error, OperatorError::NotFound(_)), "{error:?}");
                setup.control.allow("do_b");
                setup.control.fail("do_c");
                let saga = setup.create(&order, "pivot", Utc::now()).await;
                orchestrator.send_message(OrchestratorMessage::Drive(saga.id)).unwrap();
                common::wait_for("the saga retrying c", async || setup.saga("pivot").await.current_step == 2).await;
                let error = operator::cancel(&setup.store, "pivot", "x", Utc::now()).await.unwrap_err();
                assert!(matches!(&error, OperatorError::PastPivot { step, .. } if step == "c"), "{error:?}");
                let error = operator::retry(&setup.store, "pivot", "x", Utc::now()).await.unwrap_err();
                assert!(matches!(error, OperatorError::NotParked { .. }), "{error:?}");
                setup.control.allow("do_c");
                wait_idle(&orchestrator).await;
                assert_eq!(setup.saga("pivot").await.status, SagaStatus::Completed);
                orchestrator.stop(None);
            }

            /// A saga still running at its deadline (on the orchestrator's clock) is
            /// compensated, from the step it was at; one past its step without
            /// compensation is parked. The deadline is stored with the saga: a new
            /// orchestrator that finds it passed compensates without sending a command.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_deadline_compensates_a_late_saga_and_survives_a_restart() {
                let setup = Setup::new().await;
                let order = definition(&format!("deadline = \"10m\"\n{ORDER_V1}"));
                assert_eq!(order.deadline(), Some(Duration::from_secs(600)));
                let start = Utc::now();
                let clock = ManualClock::new(start);
                let orchestrator = setup.orchestrator(Arc::clone(&order), Some(clock.clone()), (0.0, 0.0)).await.unwrap();
                setup.control.fail("do_b");
                setup.control.fail("do_c");
                let late = setup.create(&order, "late", start).await;
                assert_eq!(late.deadline_at, Some(start + TimeDelta::minutes(10)));
                // The pivot saga is past its compensated steps when its deadline passes.
                setup.create(&order, "pivot", start).await;
                {
                    let mut pivot = setup.saga("pivot").await;
                    pivot.current_step = 2;
                    assert!(setup.store.save(&mut pivot, &[]).await.unwrap());
                }
                orchestrator.send_message(OrchestratorMessage::Drive("late".into())).unwrap();
                orchestrator.send_message(OrchestratorMessage::Drive("pivot".into())).unwrap();
                common::wait_for("the saga retrying b", async || setup.saga("late").await.attempts >= 2).await;
                clock.set(start + TimeDelta::minutes(11));
                wait_idle(&orchestrator).await;
                let late = setup.saga("late").await;
                assert_eq!(late.status, SagaStatus::Compensated);
                assert_eq!((setup.applied("late", "do_a").await, setup.applied("late", "undo_a").await, setup.applied("late", "undo_b").await), (1, 1, 1));
                let kinds = setup.kinds("late").await;
                assert!(kinds.contains(&EventKind::DeadlinePassed), "{kinds:?}");
                let pivot = setup.saga("pivot").await;
                assert_eq!(pivot.state(), SagaState::Parked);
                assert!(pivot.parked.as_deref().unwrap().contains("step `c`"), "{pivot:?}");
                // An operator lets the pivot saga finish: retry clears the deadline.
                setup.control.allow("do_c");
                operator::retry(&setup.store, "pivot", "ops: let it finish", clock.now()).await.unwrap();
                ractor::call!(orchestrator, OrchestratorMessage::Run, "pivot".to_owned()).unwrap().unwrap();
                assert_eq!(setup.saga("pivot").await.status, SagaStatus::Completed);
                orchestrator.stop(None);

                // Stored before any orchestrator ran it; its deadline passes while none runs.
                let restarted = setup.create(&order, "restarted", start).await;
                assert_eq!(restarted.deadline_at, Some(start + TimeDelta::minutes(10)));
                // Past its last step, not yet marked completed (its driver died between the
                // two saves): a deadline has nothing left to stop, the saga completes.
                let mut done = setup.create(&order, "all-steps-done", start).await;
                done.current_step = 3;
                assert!(setup.store.save(&mut done, &[]).await.unwrap());
                let clock = ManualClock::new(start + TimeDelta::hours(1));
                let orchestrator = setup.orchestrator(Arc::clone(&order), Some(clock), (0.0, 0.0)).await.unwrap();
                ractor::call!(orchestrator, OrchestratorMessage::ResumeAll).unwrap().unwrap();
                wait_idle(&orchestrator).await;
                assert_eq!(setup.saga("restarted").await.status, SagaStatus::Compensated);
                assert_eq!(setup.applied("restarted", "do_a").await, 0, "no command sent after the deadline");
                assert_eq!(setup.saga("all-steps-done").await.status, SagaStatus::Completed);
                orchestrator.stop(None);
            }

            /// History is pruned by the month its saga was created in, once the month is
            /// older than the retention and only for finished sagas: on PostgreSQL a month
            /// whose sagas all finished goes whole (its partition dropped), a month with an
            /// unfinished saga keeps that saga's rows; SQLite deletes the same rows.
            #[tokio::test]
            async fn history_is_pruned_by_month_for_finished_sagas_only() {
                let setup = Setup::new().await;
                let order = definition(ORDER_V1);
                let (january, february, march) = (
                    Month::new(2026, 1).unwrap(),
                    Month::new(2026, 2).unwrap(),
                    Month::new(2026, 3).unwrap(),
                );
                let created = setup.store.prepare_history(&[january, february]).await.unwrap();
                let partitioned = created == [january, february];
                assert!(partitioned || created.is_empty(), "{created:?}");
                let at = |month: Month| month.start() + TimeDelta::days(3);
                for (id, month, finished) in [
                    ("jan-done", january, true),
                    ("feb-done", february, true),
                    ("feb-running", february, false),
                    ("mar-done", march, true),
                ] {
                    let mut saga = setup.create(&order, id, at(month)).await;
                    if finished {
                        saga.status = SagaStatus::Completed;
                        let event = sagabox::saga::SagaEvent::new(EventKind::Completed, at(month));
                        assert!(setup.store.save(&mut saga, &[event]).await.unwrap());
                    }
                }
                let rows = |id: &'static str| {
                    let store = setup.store.clone();
                    async move { store.history(id).await.unwrap().len() }
                };
                let dry = setup.store.prune_history(march, true).await.unwrap();
                assert_eq!(rows("jan-done").await, 2, "a dry run changes nothing");
                let pruned = setup.store.prune_history(march, false).await.unwrap();
                assert_eq!(dry, pruned, "the dry run told what the pass did");
                if partitioned {
                    assert_eq!(pruned.months_dropped, [january]);
                    assert_eq!(pruned.rows_deleted, 2, "feb-done's rows, one by one");
                } else {
                    assert_eq!(pruned.months_dropped, []);
                    assert_eq!(pruned.rows_deleted, 4);
                }
                assert_eq!(
                    (rows("jan-done").await, rows("feb-done").await, rows("feb-running").await, rows("mar-done").await),
                    (0, 0, 1, 2),
                    "finished sagas of months before March lose their history; the rest keep it"
                );
                // The saga rows themselves stay.
                assert_eq!(setup.saga("jan-done").await.status, SagaStatus::Completed);
            }

            /// Sagas started under version 1 finish on version 1's steps after the
            /// orchestrator restarted with version 2 (a step inserted); new sagas run
            /// version 2's. Version 1 changed without a new number is refused.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn old_sagas_finish_on_their_version_after_the_definition_changed() {
                let setup = Setup::new().await;
                let v1 = definition(ORDER_V1);
                let orchestrator = setup.orchestrator(Arc::clone(&v1), None, (0.3, 0.2)).await.unwrap();
                setup.control.fail("do_b");
                for n in 0..5 {
                    let saga = setup.create(&v1, &format!("old-{n}"), Utc::now()).await;
                    orchestrator.send_message(OrchestratorMessage::Drive(saga.id)).unwrap();
                }
                for n in 0..5 {
                    let id = format!("old-{n}");
                    common::wait_for("old sagas at b", async || setup.saga(&id).await.current_step == 1).await;
                }
                orchestrator.stop(None);
                tokio::time::sleep(Duration::from_millis(100)).await;

                let v2 = definition(&order_v2());
                let names: Vec<&str> = v2.steps().iter().map(|step| step.name()).collect();
                assert_eq!((v2.version(), names), (2, vec!["a", "x", "b", "c"]));
                let orchestrator = setup.orchestrator(Arc::clone(&v2), None, (0.3, 0.2)).await.unwrap();
                for n in 0..5 {
                    setup.create(&v2, &format!("new-{n}"), Utc::now()).await;
                }
                setup.control.allow("do_b");
                let resumed = ractor::call!(orchestrator, OrchestratorMessage::ResumeAll).unwrap().unwrap();
                assert_eq!(resumed, 10);
                wait_idle(&orchestrator).await;
                for n in 0..5 {
                    for (id, expected) in [
                        (format!("old-{n}"), (1, 0, 1, 1)),
                        (format!("new-{n}"), (1, 1, 1, 1)),
                    ] {
                        let saga = setup.saga(&id).await;
                        assert_eq!(saga.status, SagaStatus::Completed, "{id}");
                        let applied = (
                            setup.applied(&id, "do_a").await,
                            setup.applied(&id, "do_x").await,
                            setup.applied(&id, "do_b").await,
                            setup.applied(&id, "do_c").await,
                        );
                        assert_eq!(applied, expected, "{id} ran its own version's steps once each");
                    }
                    assert_eq!(setup.saga(&format!("old-{n}")).await.definition_version, 1);
                    assert_eq!(setup.saga(&format!("new-{n}")).await.definition_version, 2);
                }
                orchestrator.stop(None);

                let changed = definition(&ORDER_V1.replace("timeout = \"5s\"", "timeout = \"6s\""));
                let error = setup.orchestrator(changed, None, (0.0, 0.0)).await.unwrap_err();
                let message = error.to_string();
                assert!(message.contains("version 1 is stored with other steps"), "{message}");
                assert_eq!(
                    <$fixture>::scalar(&setup.fx, "SELECT COUNT(*) FROM sagabox_saga_definitions").await,
                    2
                );
            }

            /// What an operator's overview reads: sagas per definition and state (parked
            /// apart), finished sagas per minute, and listings narrowed by age and paged
            /// by a cursor, newest first, that together list every saga once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn counts_finished_minutes_and_paged_listings_read_what_the_table_holds() {
                let setup = Setup::new().await;
                let order = definition(ORDER_V1);
                let minute = chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap();
                let mut conn = setup.store.pool().acquire().await.unwrap();
                let states = [
                    (SagaStatus::Completed, false, 0),
                    (SagaStatus::Completed, false, 0),
                    (SagaStatus::Completed, false, 1),
                    (SagaStatus::Compensated, false, 1),
                    (SagaStatus::Running, false, 2),
                    (SagaStatus::Compensating, true, 2),
                ];
                for (n, (status, parked, minutes)) in states.into_iter().enumerate() {
                    let at = minute + TimeDelta::minutes(minutes) + TimeDelta::seconds(n as i64);
                    let mut saga = SagaInstance::under(&order, format!("s-{n}"), json!({}), at);
                    saga.status = status;
                    saga.parked = parked.then(|| "held".to_owned());
                    setup.store.insert(&mut conn, &saga).await.unwrap();
                }
                drop(conn);
                let mut counts: Vec<(String, &str, i64)> = setup.store.counts().await.unwrap()
                    .into_iter().map(|c| (c.saga_name, c.state.as_str(), c.sagas)).collect();
                counts.sort();
                let order_counts = |state: &'static str, n: i64| ("order".to_owned(), state, n);
                assert_eq!(counts, [
                    order_counts("compensated", 1), order_counts("completed", 3),
                    order_counts("parked", 1), order_counts("running", 1),
                ]);
                let finished: Vec<(i64, &str, i64)> = setup.store.finished_per_minute(minute).await.unwrap()
                    .into_iter().map(|m| ((m.minute - minute).num_minutes(), m.status.as_str(), m.sagas)).collect();
                assert_eq!(finished, [(0, "completed", 2), (1, "compensated", 1), (1, "completed", 1)]);
                let later = setup.store.finished_per_minute(minute + TimeDelta::minutes(1)).await.unwrap();
                assert_eq!(later.iter().map(|m| m.sagas).sum::<i64>(), 2);

                let mut filter = SagaFilter { limit: 4, ..SagaFilter::default() };
                let first = setup.store.list(&filter).await.unwrap();
                let ids: Vec<&str> = first.iter().map(|s| s.id.as_str()).collect();
                assert_eq!(ids, ["s-5", "s-4", "s-3", "s-2"]);
                filter.after = first.last().map(sagabox::saga::SagaCursor::of);
                let second = setup.store.list(&filter).await.unwrap();
                let ids: Vec<&str> = second.iter().map(|s| s.id.as_str()).collect();
                assert_eq!(ids, ["s-1", "s-0"]);
                let recent = SagaFilter {
                    created_since: Some(minute + TimeDelta::minutes(1)),
                    state: Some(SagaState::Status(SagaStatus::Completed)),
                    ..SagaFilter::default()
                };
                let ids: Vec<String> = setup.store.list(&recent).await.unwrap().into_iter().map(|s| s.id).collect();
                assert_eq!(ids, ["s-2"]);

                // Sagas created at the same instant are paged by id: pages of two list
                // every saga once, in the order of one long page.
                let mut conn = setup.store.pool().acquire().await.unwrap();
                for n in 0..5 {
                    let at = minute + TimeDelta::minutes(10);
                    let saga = SagaInstance::under(&order, format!("t-{n}"), json!({}), at);
                    setup.store.insert(&mut conn, &saga).await.unwrap();
                }
                drop(conn);
                let everything: Vec<String> = setup.store
                    .list(&SagaFilter { limit: 100, ..SagaFilter::default() }).await.unwrap()
                    .into_iter().map(|s| s.id).collect();
                assert_eq!(&everything[..5], ["t-4", "t-3", "t-2", "t-1", "t-0"]);
                let mut paged = Vec::new();
                let mut filter = SagaFilter { limit: 2, ..SagaFilter::default() };
                loop {
                    let page = setup.store.list(&filter).await.unwrap();
                    let Some(last) = page.last() else { break };
                    filter.after = Some(sagabox::saga::SagaCursor::of(last));
                    paged.extend(page.into_iter().map(|s| s.id));
                }
                assert_eq!(paged, everything);
            }
        }
    };
}

saga_ops_suite!(postgres, common::Pg, sqlx::Postgres, sagabox::PostgresStore);
saga_ops_suite!(sqlite, common::Lite, sqlx::Sqlite, sagabox::SqliteStore);
