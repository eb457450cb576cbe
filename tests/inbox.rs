//! The inbox contract, one suite run against both backends: real PostgreSQL (a fresh
//! database per test) and SQLite (a fresh file per test).

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use sagabox::{
    Clock, ConsumerType, Envelope, GuardError, InboxConfig, InboxError, KeyError, ManualClock,
    MessageId, Month, Outcome,
};
use serde_json::json;

const DAY: Duration = Duration::from_secs(86_400);

fn at(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
}

fn month(y: i32, m: u32) -> Month {
    Month::new(y, m).unwrap()
}

fn consumer(name: &str) -> ConsumerType {
    ConsumerType::new(name).unwrap()
}

/// How a test message carries (or does not carry) its time.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Timing {
    /// A plain id and a publish time, not trusted to be stable: the claim probes every
    /// partition.
    Published(DateTime<Utc>),
    /// A plain id and a publish time the configuration trusts: one partition.
    Trusted(DateTime<Utc>),
    /// A plain id and no time at all: the slow path.
    Unknown,
    /// A UUIDv7 id minted at this time (the tests' clocks are fixed, so a real-time
    /// id would drift out of their window) and no publish time.
    UuidV7(DateTime<Utc>),
}

fn envelope(id: &str, timing: Timing) -> Envelope {
    let id = match timing {
        Timing::UuidV7(t) => MessageId::derive_v7(t, id),
        _ => MessageId::new(id).unwrap(),
    };
    let envelope = Envelope::new(id, "charge", json!({"cents": 100})).unwrap();
    match timing {
        Timing::Published(t) | Timing::Trusted(t) => envelope.with_published_at(t),
        _ => envelope,
    }
}

/// A clock that says when a guard first asked it for the time.
#[derive(Debug)]
struct SignalClock {
    inner: ManualClock,
    started: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl SignalClock {
    fn new(inner: ManualClock, started: tokio::sync::oneshot::Sender<()>) -> Self {
        Self {
            inner,
            started: std::sync::Mutex::new(Some(started)),
        }
    }
}

impl Clock for SignalClock {
    fn now(&self) -> DateTime<Utc> {
        if let Some(started) = self.started.lock().unwrap().take() {
            let _ = started.send(());
        }
        self.inner.now()
    }
}

const EFFECTS_DDL: &str = "CREATE TABLE effects (consumer_type TEXT NOT NULL, message_id TEXT NOT NULL, note TEXT NOT NULL)";

/// The whole suite, instantiated once per backend: `$fixture` is `common::Pg` or
/// `common::Lite`, `$db` the matching sqlx database type.
/// Whether a test handler records its result or none.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Recording {
    Result,
    Nothing,
}

macro_rules! inbox_suite {
    ($backend:ident, $fixture:ty, $db:ty) => {
        mod $backend {
            use super::*;
            use sagabox::InboxGuard;

            type Fixture = $fixture;

            async fn fixture() -> Fixture {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                fx
            }

            fn config() -> InboxConfig {
                InboxConfig::default().with_ttl(60 * DAY)
            }

            fn config_for(timing: Timing) -> InboxConfig {
                config().with_trust_publish_time(matches!(timing, Timing::Trusted(_)))
            }

            async fn guard_for(fx: &Fixture, clock: &ManualClock, connections: u32, timing: Timing) -> InboxGuard<impl sagabox::InboxStore<Db = $db>> {
                InboxGuard::new(fx.store(connections).await, config_for(timing))
                    .unwrap()
                    .with_clock(clock.clone())
            }

            async fn guard(fx: &Fixture, clock: &ManualClock, connections: u32) -> InboxGuard<impl sagabox::InboxStore<Db = $db>> {
                InboxGuard::new(fx.store(connections).await, config())
                    .unwrap()
                    .with_clock(clock.clone())
            }

            /// The side effect: one row appended to `effects`, not idempotent by itself.
            async fn apply(
                conn: &mut <$db as sqlx::Database>::Connection,
                consumer_type: &ConsumerType,
                envelope: &Envelope,
                note: &str,
            ) -> Result<serde_json::Value, sqlx::Error> {
                sqlx::query("INSERT INTO effects (consumer_type, message_id, note) VALUES ($1, $2, $3)")
                    .bind(consumer_type.as_str())
                    .bind(envelope.id.as_str())
                    .bind(note)
                    .execute(&mut *conn)
                    .await?;
                Ok(json!({"note": note, "id": envelope.id.as_str()}))
            }

            async fn deliver(
                guard: &InboxGuard<impl sagabox::InboxStore<Db = $db>>,
                consumer_type: &ConsumerType,
                envelope: &Envelope,
                note: &str,
            ) -> Outcome {
                deliver_with(guard, consumer_type, envelope, note, Recording::Result).await
            }

            /// `deliver`, with a handler that records its result or none (null).
            async fn deliver_with(
                guard: &InboxGuard<impl sagabox::InboxStore<Db = $db>>,
                consumer_type: &ConsumerType,
                envelope: &Envelope,
                note: &str,
                recording: Recording,
            ) -> Outcome {
                guard
                    .process(consumer_type, envelope, async |conn, env| {
                        let result = apply(conn, consumer_type, env, note).await?;
                        Ok::<_, sqlx::Error>(match recording {
                            Recording::Result => result,
                            Recording::Nothing => serde_json::Value::Null,
                        })
                    })
                    .await
                    .expect("process")
            }

            /// A handler that returns nothing lets the claim write the row up front; one
            /// that returns a result has the row inserted after it. The guard learns which
            /// from the last result, so switching between the two must not matter.
            #[tokio::test]
            async fn handlers_with_and_without_results_alternate_and_duplicates_get_their_own() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard_for(&fx, &clock, 2, Timing::UuidV7(at(2026, 12, 2, 9, 0, 0))).await;
                let payment = consumer("payment");
                let pattern = [
                    Recording::Nothing, Recording::Nothing, Recording::Result, Recording::Nothing,
                    Recording::Result, Recording::Result, Recording::Nothing,
                ];
                let messages: Vec<Envelope> = (0..pattern.len())
                    .map(|n| envelope(&format!("switch-{n}"), Timing::UuidV7(at(2026, 12, 2, 9, 0, 0))))
                    .collect();
                let mut firsts = Vec::new();
                for (message, recording) in messages.iter().zip(pattern) {
                    match deliver_with(&guard, &payment, message, "first", recording).await {
                        Outcome::Applied(result) => firsts.push(result),
                        duplicate => panic!("a fresh message was a duplicate: {duplicate:?}"),
                    }
                }
                // Redeliveries, each with the other kind of handler than the first had.
                for ((message, recording), first) in messages.iter().zip(pattern).zip(&firsts) {
                    assert_eq!(first.is_null(), recording == Recording::Nothing);
                    let other = match recording {
                        Recording::Nothing => Recording::Result,
                        Recording::Result => Recording::Nothing,
                    };
                    match deliver_with(&guard, &payment, message, "again", other).await {
                        Outcome::Duplicate { result, .. } => assert_eq!(&result, first),
                        applied => panic!("a redelivery applied: {applied:?}"),
                    }
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 7);
                assert_eq!(fx.inbox_rows().await, 7);
            }

            #[tokio::test]
            async fn three_deliveries_apply_once_and_duplicates_get_the_first_result() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let message = envelope("order-1/charge", Timing::Published(at(2026, 12, 2, 9, 59, 0)));

                let first = deliver(&guard, &payment, &message, "delivery 1").await;
                assert_eq!(first, Outcome::Applied(json!({"note": "delivery 1", "id": "order-1/charge"})));
                clock.advance(TimeDelta::seconds(5));
                for n in 2..=3 {
                    let again = deliver(&guard, &payment, &message, &format!("delivery {n}")).await;
                    assert_eq!(
                        again,
                        Outcome::Duplicate {
                            first_processed_at: at(2026, 12, 2, 10, 0, 0),
                            result: json!({"note": "delivery 1", "id": "order-1/charge"}),
                        }
                    );
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1);
                assert_eq!(fx.inbox_rows().await, 1);
            }

            async fn competing_round(fx: &Fixture, round: usize, timing: Timing, recording: Recording) {
                const KEYS: usize = 200;
                const TASKS: usize = 8;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let payment = consumer("payment");
                let messages: Vec<Envelope> = (0..KEYS)
                    .map(|k| envelope(&format!("round-{round}/key-{k}"), timing))
                    .collect();
                let counted_before = fx.duplicates_counted().await;
                let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(TASKS));
                let mut tasks = Vec::new();
                for task in 0..TASKS {
                    // Each task has its own pool of one connection: separate sessions.
                    let guard = guard_for(fx, &clock, 1, timing).await;
                    let messages = messages.clone();
                    let payment = payment.clone();
                    let barrier = barrier.clone();
                    tasks.push(tokio::spawn(async move {
                        barrier.wait().await;
                        let (mut applied, mut duplicates) = (0, 0);
                        // Tasks walk the keys from different offsets so they collide
                        // both head-on and staggered.
                        for i in 0..KEYS {
                            let message = &messages[(i + task * 7) % KEYS];
                            match deliver_with(&guard, &payment, message, &format!("task {task}"), recording).await {
                                Outcome::Applied(_) => applied += 1,
                                Outcome::Duplicate { .. } => duplicates += 1,
                            }
                        }
                        (applied, duplicates)
                    }));
                }
                let (mut applied, mut duplicates) = (0, 0);
                for task in tasks {
                    let (a, d) = task.await.expect("task");
                    applied += a;
                    duplicates += d;
                }
                assert_eq!(applied, KEYS, "round {round} ({timing:?})");
                assert_eq!(duplicates, KEYS * (TASKS - 1), "round {round} ({timing:?})");
                // Each answered duplicate is counted once on its first delivery's row,
                // whether the claim counted it in its own statement or after a lookup.
                assert_eq!(
                    fx.duplicates_counted().await - counted_before,
                    i64::try_from(duplicates).unwrap(),
                    "round {round} ({timing:?})"
                );
            }

            /// `keys` side effects, none for the same key twice, and one inbox row each.
            async fn assert_each_key_applied_once(fx: &Fixture, keys: i64) {
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, keys);
                assert_eq!(
                    fx.scalar("SELECT COUNT(*) FROM (SELECT message_id FROM effects GROUP BY message_id HAVING COUNT(*) > 1) d").await,
                    0,
                    "a key was applied twice"
                );
                assert_eq!(fx.inbox_rows().await, keys);
            }

            /// The same race, with handlers that record no result: every claim of a timed
            /// key then inserts its row up front, and the insert decides who applies.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn competing_consumers_without_results_apply_each_key_exactly_once() {
                let fx = fixture().await;
                let rounds = [
                    Timing::UuidV7(at(2026, 12, 2, 9, 0, 0)),
                    Timing::Trusted(at(2026, 12, 2, 9, 0, 0)),
                    Timing::Unknown,
                    Timing::UuidV7(at(2026, 12, 2, 9, 0, 0)),
                    Timing::Trusted(at(2026, 11, 30, 23, 59, 0)),
                ];
                for (round, timing) in rounds.into_iter().enumerate() {
                    competing_round(&fx, round, timing, Recording::Nothing).await;
                }
                assert_each_key_applied_once(&fx, 1000).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn competing_consumers_apply_each_key_exactly_once() {
                let fx = fixture().await;
                let rounds = [
                    Timing::Published(at(2026, 12, 2, 9, 0, 0)),
                    Timing::Unknown,
                    Timing::Published(at(2026, 12, 1, 0, 0, 0)),
                    Timing::Unknown,
                    Timing::UuidV7(at(2026, 12, 2, 9, 0, 0)),
                    Timing::Trusted(at(2026, 12, 2, 9, 0, 0)),
                ];
                for (round, timing) in rounds.into_iter().enumerate() {
                    competing_round(&fx, round, timing, Recording::Result).await;
                }
                assert_each_key_applied_once(&fx, 1200).await;
            }

            async fn month_boundary(timing: Timing) {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 11, 30, 23, 59, 59));
                let guard = guard_for(&fx, &clock, 2, timing).await;
                let payment = consumer("payment");
                let message = envelope("order-7/charge", timing);

                let first = deliver(&guard, &payment, &message, "first").await;
                assert!(matches!(first, Outcome::Applied(_)), "{first:?}");
                for redelivery in [at(2026, 12, 1, 0, 0, 1), at(2027, 1, 5, 12, 0, 0)] {
                    clock.set(redelivery);
                    let again = deliver(&guard, &payment, &message, "again").await;
                    assert!(
                        matches!(&again, Outcome::Duplicate { first_processed_at, .. } if *first_processed_at == at(2026, 11, 30, 23, 59, 59)),
                        "{timing:?} at {redelivery}: {again:?}"
                    );
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1);
                assert_eq!(fx.inbox_rows().await, 1);
            }

            #[tokio::test]
            async fn month_boundary_with_publish_time() {
                month_boundary(Timing::Published(at(2026, 11, 30, 23, 59, 58))).await;
            }

            #[tokio::test]
            async fn month_boundary_with_trusted_publish_time() {
                month_boundary(Timing::Trusted(at(2026, 11, 30, 23, 59, 58))).await;
            }

            /// A publisher that stamps each attempt: the same id published at 23:59:59 on
            /// the 30th and again at 00:00:01 on the 1st is still one message.
            #[tokio::test]
            async fn a_publish_time_that_drifts_across_the_boundary_is_still_deduplicated() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 1, 0, 0, 2));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let first = envelope("order-8/charge", Timing::Published(at(2026, 11, 30, 23, 59, 59)));
                let retry = envelope("order-8/charge", Timing::Published(at(2026, 12, 1, 0, 0, 1)));
                assert!(matches!(deliver(&guard, &payment, &first, "first").await, Outcome::Applied(_)));
                assert!(deliver(&guard, &payment, &retry, "retry").await.is_duplicate());
                let before = envelope("order-9/charge", Timing::Published(at(2026, 11, 30, 23, 59, 59)));
                let after = envelope("order-9/charge", Timing::Published(at(2026, 12, 1, 0, 0, 1)));
                let (a, b) = tokio::join!(
                    deliver(&guard, &payment, &before, "a"),
                    deliver(&guard, &payment, &after, "b"),
                );
                assert_ne!(a.is_duplicate(), b.is_duplicate(), "{a:?} / {b:?}");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 2);
            }

            #[tokio::test]
            async fn month_boundary_without_publish_time() {
                month_boundary(Timing::Unknown).await;
            }

            #[tokio::test]
            async fn month_boundary_with_uuid_v7_id_only() {
                // The id's own time is "now"; the clock runs from Nov 30 so place the
                // first delivery near it: the guard only needs the id's month to be stable.
                let fx = fixture().await;
                let id = MessageId::new_v7();
                let created = id.uuid_v7_time().unwrap();
                let clock = ManualClock::new(created);
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let message = Envelope::new(id, "charge", json!({})).unwrap();
                assert!(matches!(deliver(&guard, &payment, &message, "first").await, Outcome::Applied(_)));
                for later in [TimeDelta::days(1), TimeDelta::days(31), TimeDelta::days(45)] {
                    clock.set(created + later);
                    assert!(deliver(&guard, &payment, &message, "again").await.is_duplicate(), "after {later}");
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1);
            }

            async fn race_across_boundary(timing: Timing) {
                let fx = fixture().await;
                let before = ManualClock::new(at(2026, 11, 30, 23, 59, 59));
                let after = ManualClock::new(at(2026, 12, 1, 0, 0, 1));
                let guard_before = guard_for(&fx, &before, 1, timing).await;
                let guard_after = guard_for(&fx, &after, 1, timing).await;
                let payment = consumer("payment");
                const KEYS: usize = 50;
                for k in 0..KEYS {
                    let message = envelope(&format!("boundary-{k}"), timing);
                    let (a, b) = tokio::join!(
                        deliver(&guard_before, &payment, &message, "before"),
                        deliver(&guard_after, &payment, &message, "after"),
                    );
                    assert_ne!(a.is_duplicate(), b.is_duplicate(), "key {k}: {a:?} / {b:?}");
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, KEYS as i64);
                assert_eq!(fx.inbox_rows().await, KEYS as i64);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn deliveries_racing_across_the_month_boundary_apply_once() {
                race_across_boundary(Timing::Unknown).await;
            }

            /// Two processing clocks either side of midnight, one publish time: both
            /// deliveries must meet in the publish month, not in their processing months.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn deliveries_processed_either_side_of_the_boundary_meet_in_the_publish_month() {
                race_across_boundary(Timing::Trusted(at(2026, 11, 30, 23, 59, 58))).await;
                race_across_boundary(Timing::Published(at(2026, 11, 30, 23, 59, 58))).await;
            }

            /// A pruner whose clock is ahead drops November while consumers whose clocks
            /// are behind still count a late-November message inside the window: their
            /// redeliveries must be refused, never applied to a recreated, empty month.
            async fn pruned_month_is_never_recreated(timing: Timing) {
                let fx = fixture().await;
                let two_weeks = config_for(timing).with_ttl(14 * DAY);
                let first_clock = ManualClock::new(at(2026, 12, 1, 8, 0, 0));
                let cached = InboxGuard::new(fx.store(2).await, two_weeks.clone()).unwrap().with_clock(first_clock.clone());
                let payment = consumer("payment");
                const KEYS: usize = 40;
                let messages: Vec<Envelope> = (0..KEYS).map(|k| envelope(&format!("late-{k}"), timing)).collect();
                for message in &messages {
                    assert!(matches!(deliver(&cached, &payment, message, "first").await, Outcome::Applied(_)));
                }

                // Consumers 1 s behind the pruner redeliver until they are refused, while
                // the pruner drops November under them.
                let behind = ManualClock::new(at(2026, 12, 14, 23, 59, 59));
                first_clock.set(behind.now());
                let pruner = InboxGuard::new(fx.store(1).await, two_weeks.clone())
                    .unwrap()
                    .with_clock(ManualClock::new(at(2026, 12, 15, 0, 0, 1)));
                let mut tasks = Vec::new();
                for task in 0..4 {
                    // Task 0 reuses the guard that cached November as present.
                    let guard = if task == 0 {
                        cached.clone()
                    } else {
                        InboxGuard::new(fx.store(1).await, two_weeks.clone()).unwrap().with_clock(behind.clone())
                    };
                    let (messages, payment) = (messages.clone(), payment.clone());
                    tasks.push(tokio::spawn(async move {
                        for round in 0..10_000 {
                            let mut refused = 0;
                            for message in &messages {
                                match guard
                                    .process(&payment, message, async |conn, env| apply(conn, &payment, env, "late").await)
                                    .await
                                {
                                    Ok(Outcome::Duplicate { .. }) => {}
                                    Ok(applied) => panic!("round {round}: {} applied again: {applied:?}", message.id),
                                    Err(GuardError::Inbox(InboxError::PartitionPruned(month))) => {
                                        assert_eq!(month, Month::new(2026, 11).unwrap());
                                        refused += 1;
                                    }
                                    // A claim caught mid-drop fails like any database error.
                                    Err(GuardError::Inbox(error)) if error.is_retryable() => {}
                                    Err(other) => panic!("unexpected: {other:?}"),
                                }
                            }
                            if refused == messages.len() {
                                return round;
                            }
                        }
                        panic!("never refused: the pruned month kept answering");
                    }));
                }
                assert_eq!(pruner.drop_expired_partitions().await.unwrap(), vec![Month::new(2026, 11).unwrap()]);
                for task in tasks {
                    task.await.expect("no double apply, and every guard ends up refusing");
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, KEYS as i64);
                assert!(!guard(&fx, &behind, 1).await.partitions().await.unwrap().contains(&Month::new(2026, 11).unwrap()));
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_pruned_month_is_never_recreated_for_a_late_redelivery() {
                pruned_month_is_never_recreated(Timing::Published(at(2026, 11, 30, 23, 59, 59))).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_pruned_month_is_never_recreated_for_a_late_redelivery_with_trusted_time() {
                pruned_month_is_never_recreated(Timing::Trusted(at(2026, 11, 30, 23, 59, 59))).await;
            }

            #[tokio::test]
            async fn handler_error_leaves_no_row_and_the_redelivery_applies() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let message = envelope("order-9/charge", Timing::Unknown);

                #[derive(Debug, PartialEq)]
                struct CardNetworkDown;
                let failed = guard
                    .process(&payment, &message, async |conn, env| {
                        apply(conn, &payment, env, "doomed").await.expect("insert");
                        Err::<serde_json::Value, _>(CardNetworkDown)
                    })
                    .await;
                assert!(matches!(failed, Err(GuardError::Handler(CardNetworkDown))), "{failed:?}");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 0, "side effect rolled back");
                assert_eq!(fx.inbox_rows().await, 0, "no inbox row");

                let retried = deliver(&guard, &payment, &message, "retry").await;
                assert!(matches!(retried, Outcome::Applied(_)));
                assert!(deliver(&guard, &payment, &message, "again").await.is_duplicate());
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_racing_duplicate_waits_for_the_first_and_never_runs_its_handler() {
                use std::sync::atomic::{AtomicUsize, Ordering};
                use std::sync::Arc;
                for timing in [Timing::Trusted(at(2026, 12, 2, 9, 0, 0)), Timing::Published(at(2026, 12, 2, 9, 0, 0)), Timing::Unknown] {
                    let fx = fixture().await;
                    let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                    let first_guard = guard_for(&fx, &clock, 1, timing).await;
                    // Tells us when the second delivery has entered the guard.
                    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
                    let second_guard = InboxGuard::new(fx.store(1).await, config_for(timing))
                        .unwrap()
                        .with_clock(SignalClock::new(clock.clone(), started_tx));
                    let payment = consumer("payment");
                    let message = envelope("order-race/charge", timing);
                    let handler_runs = Arc::new(AtomicUsize::new(0));
                    let (inside_tx, inside_rx) = tokio::sync::oneshot::channel::<()>();
                    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();

                    let first = {
                        let (payment, message, runs) = (payment.clone(), message.clone(), handler_runs.clone());
                        tokio::spawn(async move {
                            first_guard
                                .process(&payment, &message, async |conn, env| {
                                    runs.fetch_add(1, Ordering::SeqCst);
                                    let result = apply(conn, &payment, env, "first").await;
                                    inside_tx.send(()).expect("signal");
                                    release_rx.await.expect("release");
                                    result
                                })
                                .await
                                .expect("first")
                        })
                    };
                    inside_rx.await.expect("first is inside its handler");
                    let second = {
                        let (payment, message, runs) = (payment.clone(), message.clone(), handler_runs.clone());
                        tokio::spawn(async move {
                            second_guard
                                .process(&payment, &message, async |conn, env| {
                                    runs.fetch_add(1, Ordering::SeqCst);
                                    apply(conn, &payment, env, "second").await
                                })
                                .await
                                .expect("second")
                        })
                    };
                    started_rx.await.expect("second delivery started");
                    fx.wait_for_blocked_claim().await;
                    assert_eq!(handler_runs.load(Ordering::SeqCst), 1, "{timing:?}: the duplicate ran its handler while the first was open");
                    release_tx.send(()).expect("release");
                    assert!(matches!(first.await.unwrap(), Outcome::Applied(_)));
                    let second = second.await.unwrap();
                    assert!(matches!(&second, Outcome::Duplicate { result, .. } if result["note"] == "first"), "{timing:?}: {second:?}");
                    assert_eq!(handler_runs.load(Ordering::SeqCst), 1, "{timing:?}");
                    assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1);
                }
            }

            /// A duplicate that waited for a first delivery which then rolled back applies
            /// in its place, once: with handlers that record nothing (the claim inserts
            /// the row up front), the waiting claim finds no row after the lock and runs.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_duplicate_waiting_on_a_first_that_rolls_back_applies_instead() {
                for timing in [Timing::UuidV7(at(2026, 12, 2, 9, 0, 0)), Timing::Trusted(at(2026, 12, 2, 9, 0, 0))] {
                    let fx = fixture().await;
                    let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                    let first_guard = guard_for(&fx, &clock, 1, timing).await;
                    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
                    let second_guard = InboxGuard::new(fx.store(1).await, config_for(timing))
                        .unwrap()
                        .with_clock(SignalClock::new(clock.clone(), started_tx));
                    let payment = consumer("payment");
                    let message = envelope("order-undone/charge", timing);
                    let (inside_tx, inside_rx) = tokio::sync::oneshot::channel::<()>();
                    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
                    let first = {
                        let (payment, message) = (payment.clone(), message.clone());
                        tokio::spawn(async move {
                            first_guard
                                .process(&payment, &message, async |conn, env| {
                                    apply(conn, &payment, env, "first").await?;
                                    inside_tx.send(()).expect("signal");
                                    release_rx.await.expect("release");
                                    Err::<serde_json::Value, _>(sqlx::Error::Protocol("the first fails".into()))
                                })
                                .await
                        })
                    };
                    inside_rx.await.expect("first is inside its handler");
                    let second = {
                        let (payment, message) = (payment.clone(), message.clone());
                        tokio::spawn(async move {
                            deliver_with(&second_guard, &payment, &message, "second", Recording::Nothing).await
                        })
                    };
                    started_rx.await.expect("second delivery started");
                    fx.wait_for_blocked_claim().await;
                    release_tx.send(()).expect("release");
                    assert!(matches!(first.await.unwrap(), Err(GuardError::Handler(_))), "{timing:?}");
                    assert!(matches!(second.await.unwrap(), Outcome::Applied(_)), "{timing:?}");
                    assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects WHERE note = 'second'").await, 1, "{timing:?}");
                    assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1, "{timing:?}");
                    assert_eq!(fx.inbox_rows().await, 1, "{timing:?}");
                }
            }

            #[tokio::test]
            async fn one_message_two_consumer_types_both_apply() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;
                let message = envelope("order-3/placed", Timing::Published(at(2026, 12, 2, 10, 0, 0)));
                for name in ["payment", "inventory"] {
                    let c = consumer(name);
                    assert!(matches!(deliver(&guard, &c, &message, name).await, Outcome::Applied(_)));
                    assert!(deliver(&guard, &c, &message, name).await.is_duplicate());
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 2);
                assert_eq!(fx.inbox_rows().await, 2);
            }

            #[tokio::test]
            async fn bad_keys_are_refused_and_sql_looking_keys_are_data() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;

                for bad in ["".to_owned(), "x".repeat(256), "abc\0def".to_owned(), "line\nbreak".to_owned()] {
                    let id = MessageId::new(bad.clone());
                    let ct = ConsumerType::new(bad.clone());
                    assert!(matches!(id, Err(KeyError::Empty { .. } | KeyError::TooLong { .. } | KeyError::ControlCharacter { .. })), "{bad:?}");
                    assert!(ct.is_err(), "{bad:?}");
                    let from_json = serde_json::from_value::<Envelope>(json!({"id": bad, "kind": "charge"}));
                    assert!(from_json.is_err(), "{bad:?}");
                }
                assert_eq!(fx.inbox_rows().await, 0);

                let sneaky_id = "'); DROP TABLE sagabox_inbox;--";
                let sneaky_consumer = consumer("payment'; DROP TABLE effects;--");
                let message = envelope(sneaky_id, Timing::Unknown);
                assert!(matches!(deliver(&guard, &sneaky_consumer, &message, "x").await, Outcome::Applied(_)));
                assert!(deliver(&guard, &sneaky_consumer, &message, "x").await.is_duplicate());
                assert_eq!(fx.inbox_rows().await, 1);
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1);
                let (stored_consumer, stored_id): (String, String) =
                    sqlx::query_as("SELECT consumer_type, message_id FROM effects")
                        .fetch_one(&fx.pool)
                        .await
                        .unwrap();
                assert_eq!(stored_id, sneaky_id);
                assert_eq!(stored_consumer, sneaky_consumer.as_str());
            }

            #[tokio::test]
            async fn expired_partitions_are_dropped_whole_and_live_rows_stay() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 10, 8, 0, 0));
                let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default().with_ttl(14 * DAY))
                    .unwrap()
                    .with_clock(clock.clone());
                let created = guard.create_partitions(month(2026, 8), month(2026, 12)).await.unwrap();
                assert_eq!(created, month(2026, 8).through(month(2026, 12)).collect::<Vec<_>>());
                let payment = consumer("payment");
                let december = envelope("order-12/charge", Timing::Published(at(2026, 12, 10, 7, 0, 0)));
                assert!(matches!(deliver(&guard, &payment, &december, "dec").await, Outcome::Applied(_)));

                clock.set(at(2026, 12, 20, 0, 0, 0));
                assert_eq!(
                    guard.expired_partitions().await.unwrap(),
                    vec![month(2026, 8), month(2026, 9), month(2026, 10), month(2026, 11)]
                );
                let dropped = guard.drop_expired_partitions().await.unwrap();
                assert_eq!(dropped, vec![month(2026, 8), month(2026, 9), month(2026, 10), month(2026, 11)]);
                assert_eq!(guard.partitions().await.unwrap(), vec![month(2026, 12)]);
                assert_eq!(fx.inbox_rows().await, 1);
                assert!(deliver(&guard, &payment, &december, "again").await.is_duplicate());
                assert!(guard.drop_expired_partitions().await.unwrap().is_empty());
            }

            #[tokio::test]
            async fn ttl_shorter_than_broker_retention_is_refused() {
                let fx = fixture().await;
                let refused = InboxGuard::new(
                    fx.store(1).await,
                    InboxConfig::default().with_ttl(7 * DAY).with_broker_retention(14 * DAY),
                );
                let err = refused.err().expect("refused");
                assert!(matches!(err, sagabox::ConfigError::TtlShorterThanRetention { .. }));
                assert!(err.to_string().contains("ttl of 7.0 days is shorter than the broker retention of 14.0 days"), "{err}");
            }

            #[tokio::test]
            async fn a_message_older_than_the_ttl_is_refused_not_applied() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 20, 0, 0, 0));
                let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default().with_ttl(14 * DAY))
                    .unwrap()
                    .with_clock(clock.clone());
                let payment = consumer("payment");
                let stale = envelope("order-old/charge", Timing::Published(at(2026, 11, 30, 0, 0, 0)));
                let refused = guard
                    .process(&payment, &stale, async |conn, env| apply(conn, &payment, env, "stale").await)
                    .await;
                assert!(matches!(refused, Err(GuardError::Inbox(InboxError::Expired { .. }))), "{refused:?}");
                assert!(refused.unwrap_err().to_string().contains("before the deduplication window"));
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 0);
                assert_eq!(fx.inbox_rows().await, 0);
            }

            #[tokio::test]
            async fn a_producer_clock_ahead_does_not_break_the_claim() {
                let fx = fixture().await;
                // The producer's clock runs ten minutes ahead, across the month boundary.
                let clock = ManualClock::new(at(2026, 12, 31, 23, 55, 0));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let ahead = envelope("order-ahead/charge", Timing::Published(at(2027, 1, 1, 0, 5, 0)));
                assert!(matches!(deliver(&guard, &payment, &ahead, "ahead").await, Outcome::Applied(_)));
                clock.set(at(2027, 1, 1, 0, 1, 0));
                assert!(deliver(&guard, &payment, &ahead, "again").await.is_duplicate());
                assert!(guard.partitions().await.unwrap().contains(&month(2027, 1)));

                // A clock days ahead is refused with a clear error, not filed in the future.
                let far = envelope("order-far/charge", Timing::Published(at(2027, 1, 5, 0, 0, 0)));
                let refused = guard
                    .process(&payment, &far, async |conn, env| apply(conn, &payment, env, "far").await)
                    .await;
                assert!(matches!(refused, Err(GuardError::Inbox(InboxError::PublishedInFuture { .. }))), "{refused:?}");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_partition_creation_creates_each_month_once() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 0, 0, 0));
                let mut tasks = Vec::new();
                for _ in 0..8 {
                    let guard = guard(&fx, &clock, 1).await;
                    tasks.push(tokio::spawn(async move {
                        guard.create_partitions(month(2027, 3), month(2027, 8)).await.expect("create").len()
                    }));
                }
                let mut created = 0;
                for task in tasks {
                    created += task.await.unwrap();
                }
                assert_eq!(created, 6, "each of 6 months created exactly once");
            }

            #[tokio::test]
            async fn migrate_is_idempotent_and_prepares_partitions_ahead() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 0, 0, 0));
                let guard = guard(&fx, &clock, 1).await;
                assert_eq!(guard.migrate().await.unwrap(), vec![month(2026, 12), month(2027, 1), month(2027, 2)]);
                assert!(guard.migrate().await.unwrap().is_empty());
            }

            #[test]
            fn metrics_count_every_outcome() {
                use metrics_util::debugging::{DebugValue, DebuggingRecorder};
                let recorder = DebuggingRecorder::new();
                let snapshotter = recorder.snapshotter();
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                metrics::with_local_recorder(&recorder, || {
                    runtime.block_on(async {
                        let fx = fixture().await;
                        let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                        let guard = guard(&fx, &clock, 1).await;
                        let payment = consumer("payment");
                        let message = envelope("order-m/charge", Timing::Unknown);
                        deliver(&guard, &payment, &message, "a").await;
                        deliver(&guard, &payment, &message, "b").await;
                        deliver(&guard, &payment, &message, "c").await;
                        let other = envelope("order-n/charge", Timing::Unknown);
                        let failed = guard
                            .process(&payment, &other, async |_, _| Err::<serde_json::Value, _>("boom"))
                            .await;
                        assert!(failed.is_err());
                    })
                });
                let mut counts = std::collections::HashMap::new();
                let mut claim_samples = 0;
                for (key, _, _, value) in snapshotter.snapshot().into_vec() {
                    let key = key.key();
                    match (key.name(), value) {
                        ("sagabox_inbox_messages_total", DebugValue::Counter(n)) => {
                            let label = |name: &str| key.labels().find(|l| l.key() == name).map(|l| l.value().to_owned());
                            assert_eq!(label("consumer_type").as_deref(), Some("payment"));
                            counts.insert(label("outcome").unwrap(), n);
                        }
                        ("sagabox_inbox_claim_seconds", DebugValue::Histogram(samples)) => {
                            let labels: Vec<_> = key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
                            assert_eq!(labels, [("consumer_type".to_owned(), "payment".to_owned())]);
                            claim_samples = samples.len();
                        }
                        _ => {}
                    }
                }
                assert_eq!(counts.get("applied"), Some(&1), "{counts:?}");
                assert_eq!(counts.get("duplicate"), Some(&2), "{counts:?}");
                assert_eq!(counts.get("failed"), Some(&1), "{counts:?}");
                assert_eq!(claim_samples, 4, "one claim timing per delivery that reached the claim");
            }
        }
    };
}

inbox_suite!(postgres, common::Pg, sqlx::Postgres);
inbox_suite!(sqlite, common::Lite, sqlx::Sqlite);

/// Only PostgreSQL can have a row appear under a claim: SQLite's claim holds the write lock.
mod postgres_only {
    use super::*;
    use sagabox::InboxGuard;

    /// A delivery of the same key commits while our handler runs (here: written behind
    /// the guard's back, as a racing claim whose commit slipped between our lookup's
    /// snapshot and our lock would). Our insert then meets it: the handler's writes must
    /// roll back and the answer must be the row that won.
    #[tokio::test]
    async fn a_late_conflict_rolls_back_the_handler_and_answers_with_the_winner() {
        let fx = common::Pg::new().await;
        fx.exec(EFFECTS_DDL).await;
        let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
        let guard = InboxGuard::new(fx.store(1).await, InboxConfig::default())
            .unwrap()
            .with_clock(clock);
        let payment = consumer("payment");
        let message = envelope(
            "order-late/charge",
            Timing::Published(at(2026, 12, 2, 9, 0, 0)),
        );
        let outside = fx.pool.clone();
        let outcome = guard
            .process(&payment, &message, async |conn, env| {
                sqlx::query("INSERT INTO effects (consumer_type, message_id, note) VALUES ($1, $2, 'loser')")
                    .bind(payment.as_str())
                    .bind(env.id.as_str())
                    .execute(&mut *conn)
                    .await?;
                sqlx::query(
                    "INSERT INTO sagabox_inbox (consumer_type, message_id, bucket, processed_at, result) \
                     VALUES ($1, $2, '2026-12-01', '2026-12-02T09:59:00Z', '{\"winner\": true}')",
                )
                .bind(payment.as_str())
                .bind(env.id.as_str())
                .execute(&outside)
                .await?;
                Ok::<_, sqlx::Error>(json!({"winner": false}))
            })
            .await
            .expect("process");
        assert_eq!(
            outcome,
            Outcome::Duplicate {
                first_processed_at: at(2026, 12, 2, 9, 59, 0),
                result: json!({"winner": true})
            }
        );
        assert_eq!(
            fx.scalar("SELECT COUNT(*) FROM effects").await,
            0,
            "the loser's side effect rolled back"
        );
        assert_eq!(fx.inbox_rows().await, 1);
    }
}

mod postgres_partition_ddl {
    use super::*;
    use sagabox::InboxGuard;

    /// Creating a month on the claim path must not wait for open transactions on the
    /// inbox (`CREATE TABLE … PARTITION OF` would: it locks the parent exclusively).
    #[tokio::test]
    async fn creating_a_month_does_not_wait_for_open_claims() {
        let fx = common::Pg::new().await;
        let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default())
            .unwrap()
            .with_clock(ManualClock::new(at(2026, 12, 2, 10, 0, 0)));
        guard
            .create_partitions(month(2026, 12), month(2026, 12))
            .await
            .unwrap();
        // A transaction that wrote to the inbox and stays open.
        let mut open = fx.pool.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO sagabox_inbox (consumer_type, message_id, bucket, processed_at, result) \
             VALUES ('payment', 'open-tx', '2026-12-01', now(), 'null')",
        )
        .execute(&mut *open)
        .await
        .unwrap();
        // 10 s is a hang detector, not a speed claim: blocked, this never returns.
        let created = tokio::time::timeout(
            Duration::from_secs(10),
            guard.create_partitions(month(2027, 6), month(2027, 6)),
        )
        .await
        .expect("partition creation waited for an open transaction on the parent")
        .unwrap();
        assert_eq!(created, vec![month(2027, 6)]);
        open.rollback().await.unwrap();
    }
}
