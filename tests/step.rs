//! Step pools against real PostgreSQL and SQLite: competing workers behind the inbox,
//! permanent refusals recorded, retryable failures and panics leaving nothing behind.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sagabox::step::{
    StepError, StepFailure, StepHandler, StepOutcome, StepPool, StepPoolConfig, StepReply,
};
use sagabox::supervisor::Supervision;
use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId};
use serde_json::{Value, json};
use tokio::sync::Notify;

const EFFECTS_DDL: &str = "CREATE TABLE effects (message_id TEXT NOT NULL, note TEXT NOT NULL)";
const WAIT: Duration = Duration::from_secs(30);

/// Behaviour by message kind: `apply`, `refuse`, `flaky` (retryable twice, then applies),
/// `panic` (panics once, then applies), `slow` (waits for `release`, then applies).
#[derive(Debug, Default)]
struct TestStep {
    calls: AtomicUsize,
    flaky_left: AtomicUsize,
    panics_left: AtomicUsize,
    release: Notify,
}

impl TestStep {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            flaky_left: AtomicUsize::new(2),
            panics_left: AtomicUsize::new(1),
            ..Self::default()
        })
    }
}

fn command(id: &str, kind: &str) -> Envelope {
    Envelope::new(MessageId::new(id).unwrap(), kind, json!({})).unwrap()
}

macro_rules! step_suite {
    ($backend:ident, $fixture:ty, $db:ty $(, $extra:item)*) => {
        mod $backend {
            use super::*;

            #[derive(Debug, Clone)]
            struct Handler(Arc<TestStep>);

            impl StepHandler<$db> for Handler {
                async fn handle(
                    &self,
                    conn: &mut <$db as sqlx::Database>::Connection,
                    envelope: &Envelope,
                ) -> Result<Value, StepError> {
                    let step = &self.0;
                    step.calls.fetch_add(1, Ordering::SeqCst);
                    match envelope.kind.as_str() {
                        "refuse" => return Err(StepError::Permanent("out of stock".into())),
                        "flaky" if step.flaky_left.load(Ordering::SeqCst) > 0 => {
                            step.flaky_left.fetch_sub(1, Ordering::SeqCst);
                            return Err(StepError::Retryable("lock timeout".into()));
                        }
                        "panic" if step.panics_left.load(Ordering::SeqCst) > 0 => {
                            step.panics_left.fetch_sub(1, Ordering::SeqCst);
                            sqlx::query("INSERT INTO effects (message_id, note) VALUES ($1, 'before panic')")
                                .bind(envelope.id.as_str())
                                .execute(&mut *conn)
                                .await
                                .unwrap();
                            panic!("handler bug");
                        }
                        "slow" => step.release.notified().await,
                        _ => {}
                    }
                    sqlx::query("INSERT INTO effects (message_id, note) VALUES ($1, $2)")
                        .bind(envelope.id.as_str())
                        .bind(envelope.kind.as_str())
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| StepError::Retryable(e.to_string()))?;
                    Ok(json!({ "applied": envelope.id.as_str() }))
                }
            }

            async fn pool(fx: &$fixture, step: &Arc<TestStep>, workers: usize) -> StepPool {
                let guard = InboxGuard::new(fx.store(workers as u32 + 1).await, InboxConfig::default()).unwrap();
                StepPool::spawn(guard, ConsumerType::new("payment").unwrap(), Handler(step.clone()), StepPoolConfig { workers })
                    .await
                    .unwrap()
            }

            async fn effects(fx: &$fixture) -> i64 {
                fx.scalar("SELECT COUNT(*) FROM effects").await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_duplicates_through_the_pool_apply_once() {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                let step = TestStep::new();
                let pool = Arc::new(pool(&fx, &step, 4).await);
                for round in 0..20 {
                    let message = command(&format!("charge-{round}"), "apply");
                    let calls: Vec<_> = (0..4)
                        .map(|_| {
                            let (pool, message) = (pool.clone(), message.clone());
                            tokio::spawn(async move { pool.deliver(message, WAIT).await.unwrap() })
                        })
                        .collect();
                    let mut fresh = 0;
                    for call in calls {
                        let reply = call.await.unwrap();
                        assert_eq!(reply.outcome, StepOutcome::Done(json!({"applied": format!("charge-{round}")})));
                        fresh += usize::from(!reply.duplicate);
                    }
                    assert_eq!(fresh, 1, "round {round}");
                }
                assert_eq!(effects(&fx).await, 20);
                Arc::try_unwrap(pool).unwrap().stop().await;
            }

            #[tokio::test]
            async fn a_permanent_refusal_is_recorded_and_repeated_to_duplicates() {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                let step = TestStep::new();
                let pool = pool(&fx, &step, 2).await;
                let message = command("order-1/decrement", "refuse");
                let first = pool.deliver(message.clone(), WAIT).await.unwrap();
                assert_eq!(first.outcome, StepOutcome::Refused("out of stock".into()));
                assert!(!first.duplicate);
                let again = pool.deliver(message, WAIT).await.unwrap();
                assert_eq!(again.outcome, StepOutcome::Refused("out of stock".into()));
                assert!(again.duplicate);
                assert_eq!(step.calls.load(Ordering::SeqCst), 1, "the duplicate did not run the handler");
                assert_eq!(fx.inbox_rows().await, 1, "the refusal is on record");
                pool.stop().await;
            }

            #[tokio::test]
            async fn a_retryable_failure_leaves_nothing_and_the_retry_applies() {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                let step = TestStep::new();
                let pool = pool(&fx, &step, 2).await;
                let message = command("order-2/charge", "flaky");
                for _ in 0..2 {
                    let failed = pool.deliver(message.clone(), WAIT).await;
                    assert_eq!(failed, Err(StepFailure::Retryable("lock timeout".into())));
                    assert_eq!(fx.inbox_rows().await, 0);
                }
                let applied = pool.deliver(message.clone(), WAIT).await.unwrap();
                assert!(!applied.duplicate);
                assert!(pool.deliver(message, WAIT).await.unwrap().duplicate);
                assert_eq!(effects(&fx).await, 1);
                pool.stop().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_panicking_handler_is_replaced_and_its_message_applies_on_retry() {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                let step = TestStep::new();
                let pool = pool(&fx, &step, 2).await;
                let message = command("order-3/charge", "panic");
                let crashed = pool.deliver(message.clone(), WAIT).await;
                assert!(matches!(crashed, Err(StepFailure::Retryable(_))), "{crashed:?}");
                assert_eq!(effects(&fx).await, 0, "the panicked transaction rolled back");
                assert_eq!(fx.inbox_rows().await, 0);
                // Supervision replaced the worker: the pool still answers, the retry applies.
                let retried = pool.deliver(message.clone(), WAIT).await.unwrap();
                assert!(!retried.duplicate);
                for n in 0..6 {
                    pool.deliver(command(&format!("after-{n}"), "apply"), WAIT).await.unwrap();
                }
                assert_eq!(effects(&fx).await, 7);
                pool.stop().await;
            }

            /// With a single worker there is no other worker to fall back on: the
            /// second command can only be served by the replacement the pool started.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_pool_of_one_serves_the_next_command_with_the_replacement_worker() {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                let step = TestStep::new();
                let pool = pool(&fx, &step, 1).await;
                let crashed = pool.deliver(command("one/crash", "panic"), WAIT).await;
                assert!(matches!(crashed, Err(StepFailure::Retryable(_))), "{crashed:?}");
                let served = pool.deliver(command("one/next", "apply"), WAIT).await.unwrap();
                assert!(!served.duplicate);
                assert_eq!(effects(&fx).await, 1, "only the second command applied");
                pool.stop().await;
            }

            /// A batch through one worker: fresh ones applied, a duplicate answered with
            /// the first result, a refusal recorded; a batch with a message that asks for
            /// a retry is rolled back and run one by one, so only that one fails.
            #[tokio::test]
            async fn a_batch_is_answered_per_envelope_and_a_failing_one_fails_alone() {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                let step = TestStep::new();
                let pool = pool(&fx, &step, 2).await;
                let earlier = command("batch/earlier", "apply");
                pool.deliver(earlier.clone(), WAIT).await.unwrap();
                let answers = pool
                    .deliver_batch(vec![command("batch/a", "apply"), earlier.clone(), command("batch/r", "refuse")], WAIT)
                    .await
                    .unwrap();
                assert_eq!(answers[0], Ok(StepReply { outcome: StepOutcome::Done(json!({"applied": "batch/a"})), duplicate: false }));
                assert_eq!(answers[1], Ok(StepReply { outcome: StepOutcome::Done(json!({"applied": "batch/earlier"})), duplicate: true }));
                assert_eq!(answers[2], Ok(StepReply { outcome: StepOutcome::Refused("out of stock".into()), duplicate: false }));
                assert_eq!(effects(&fx).await, 2);
                assert_eq!(fx.inbox_rows().await, 3);

                let answers = pool
                    .deliver_batch(vec![command("batch/b", "apply"), command("batch/f", "flaky"), command("batch/c", "apply")], WAIT)
                    .await
                    .unwrap();
                assert!(matches!(&answers[0], Ok(reply) if !reply.duplicate), "{answers:?}");
                assert_eq!(answers[1], Err(StepFailure::Retryable("lock timeout".into())));
                assert!(matches!(&answers[2], Ok(reply) if !reply.duplicate), "{answers:?}");
                assert_eq!(effects(&fx).await, 4, "b and c applied once each, f not at all");
                assert_eq!(fx.inbox_rows().await, 5);
                assert!(pool.deliver_batch(Vec::new(), WAIT).await.unwrap().is_empty());
                pool.stop().await;
            }

            /// [`Handler`], taking batches as a set: it counts the commands of each batch
            /// it gets and applies them with its own loop.
            #[derive(Debug, Clone)]
            struct SetHandler(Handler, Arc<std::sync::Mutex<Vec<usize>>>);

            impl StepHandler<$db> for SetHandler {
                async fn handle(
                    &self,
                    conn: &mut <$db as sqlx::Database>::Connection,
                    envelope: &Envelope,
                ) -> Result<Value, StepError> {
                    self.0.handle(conn, envelope).await
                }

                async fn handle_batch(
                    &self,
                    conn: &mut <$db as sqlx::Database>::Connection,
                    envelopes: &[&Envelope],
                ) -> Option<Vec<Result<Value, StepError>>> {
                    self.1.lock().unwrap().push(envelopes.len());
                    let mut answers = Vec::new();
                    for envelope in envelopes {
                        answers.push(self.0.handle(conn, envelope).await);
                    }
                    Some(answers)
                }
            }

            /// A handler that takes batches as a set gets each batch's fresh commands at
            /// once (not the duplicate), its refusal is recorded, and a retry asked for
            /// by one command rolls the batch back and runs its commands one by one.
            #[tokio::test]
            async fn a_set_handler_gets_a_batchs_fresh_commands_at_once() {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                let step = TestStep::new();
                let batches = Arc::new(std::sync::Mutex::new(Vec::new()));
                let guard = InboxGuard::new(fx.store(3).await, InboxConfig::default()).unwrap();
                let handler = SetHandler(Handler(step.clone()), batches.clone());
                let pool = StepPool::spawn(guard, ConsumerType::new("payment").unwrap(), handler, StepPoolConfig { workers: 2 })
                    .await
                    .unwrap();
                let earlier = command("set/earlier", "apply");
                pool.deliver(earlier.clone(), WAIT).await.unwrap();
                let answers = pool
                    .deliver_batch(vec![command("set/a", "apply"), earlier, command("set/r", "refuse")], WAIT)
                    .await
                    .unwrap();
                assert_eq!(*batches.lock().unwrap(), [2], "the two fresh commands, at once");
                assert_eq!(answers[0], Ok(StepReply { outcome: StepOutcome::Done(json!({"applied": "set/a"})), duplicate: false }));
                assert_eq!(answers[1], Ok(StepReply { outcome: StepOutcome::Done(json!({"applied": "set/earlier"})), duplicate: true }));
                assert_eq!(answers[2], Ok(StepReply { outcome: StepOutcome::Refused("out of stock".into()), duplicate: false }));
                let again = pool.deliver(command("set/r", "refuse"), WAIT).await.unwrap();
                assert_eq!(again, StepReply { outcome: StepOutcome::Refused("out of stock".into()), duplicate: true });
                assert_eq!(effects(&fx).await, 2);

                let answers = pool
                    .deliver_batch(vec![command("set/b", "apply"), command("set/f", "flaky"), command("set/c", "apply")], WAIT)
                    .await
                    .unwrap();
                assert_eq!(*batches.lock().unwrap(), [2, 3]);
                assert!(matches!(&answers[0], Ok(reply) if !reply.duplicate), "{answers:?}");
                assert_eq!(answers[1], Err(StepFailure::Retryable("lock timeout".into())));
                assert!(matches!(&answers[2], Ok(reply) if !reply.duplicate), "{answers:?}");
                assert_eq!(effects(&fx).await, 4, "the set rolled back; b and c applied once each, one by one");
                assert_eq!(fx.inbox_rows().await, 5);
                pool.stop().await;
            }

            /// Stopping the pool (here through its supervision) lets the command a
            /// worker runs finish and be answered, answers the one waiting in the queue
            /// at once (retryable: its sender still holds it), and a pool that stopped
            /// answers a new command at once too, never a hang.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stopping_finishes_the_running_command_and_answers_the_waiting_one() {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                let step = TestStep::new();
                let supervision = Supervision::start().await.unwrap();
                let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default()).unwrap();
                let pool = Arc::new(
                    StepPool::spawn_supervised(guard, ConsumerType::new("payment").unwrap(), Handler(step.clone()), StepPoolConfig { workers: 1 }, &supervision)
                        .await
                        .unwrap(),
                );
                let deliver = |id: &'static str, kind: &'static str| {
                    let pool = Arc::clone(&pool);
                    tokio::spawn(async move { pool.deliver(command(id, kind), WAIT).await })
                };
                let running = deliver("held", "slow");
                common::wait_for("the worker busy", async || step.calls.load(Ordering::SeqCst) == 1).await;
                let waiting = deliver("queued", "apply");
                common::wait_for("a command waiting", async || pool.waiting() == 1).await;
                let stopping = tokio::spawn(supervision.stop());

                match tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("answered at once").unwrap() {
                    Err(StepFailure::Retryable(reason)) => assert!(reason.contains("stopping"), "{reason}"),
                    other => panic!("expected a retryable failure, got {other:?}"),
                }
                assert!(!stopping.is_finished(), "the stop waits for the running command");
                step.release.notify_one();
                assert_eq!(
                    running.await.unwrap(),
                    Ok(StepReply { outcome: StepOutcome::Done(json!({"applied": "held"})), duplicate: false })
                );
                stopping.await.unwrap();
                match tokio::time::timeout(Duration::from_secs(5), pool.deliver(command("late", "apply"), WAIT)).await.expect("answered at once") {
                    Err(StepFailure::Retryable(reason)) => assert!(reason.contains("not running"), "{reason}"),
                    other => panic!("expected a retryable failure, got {other:?}"),
                }
                let late_batch = tokio::time::timeout(Duration::from_secs(5), pool.deliver_batch(vec![command("late-1", "apply"), command("late-2", "apply")], WAIT))
                    .await
                    .expect("answered at once")
                    .expect("each envelope answered");
                assert_eq!(late_batch.len(), 2);
                for answer in late_batch {
                    assert!(matches!(&answer, Err(StepFailure::Retryable(reason)) if reason.contains("not running")), "{answer:?}");
                }
                assert_eq!(step.calls.load(Ordering::SeqCst), 1, "neither the queued nor the late commands ran");
                assert_eq!(effects(&fx).await, 1);
            }

            $($extra)*
        }
    };
}

step_suite!(
    postgres,
    common::Pg,
    sqlx::Postgres,
    /// PostgreSQL only: on SQLite every claim holds the one write lock until it commits,
    /// so a slow handler does hold up the others there (documented).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_slow_message_does_not_stall_the_others() {
        let fx = common::Pg::new().await;
        fx.exec(EFFECTS_DDL).await;
        let step = TestStep::new();
        let pool = Arc::new(pool(&fx, &step, 3).await);
        let slow = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.deliver(command("slow-1", "slow"), WAIT).await })
        };
        // Wait until the slow one is inside its handler.
        while step.calls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        for n in 0..10 {
            let reply = pool
                .deliver(command(&format!("fast-{n}"), "apply"), WAIT)
                .await;
            assert!(reply.is_ok(), "{reply:?}");
        }
        assert!(!slow.is_finished(), "the slow message is still held");
        step.release.notify_one();
        assert!(slow.await.unwrap().is_ok());
        assert_eq!(effects(&fx).await, 11);
        Arc::try_unwrap(pool).unwrap().stop().await;
    }
);
step_suite!(sqlite, common::Lite, sqlx::Sqlite);
