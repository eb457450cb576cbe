//! Batched claims (`InboxGuard::process_batch`): the single-claim contract, per envelope,
//! for a batch in one transaction — one suite run against real PostgreSQL and SQLite.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use sagabox::{
    ConsumerType, Envelope, GuardError, InboxConfig, InboxError, MAX_BATCH, ManualClock, MessageId,
    Outcome,
};
use serde_json::json;

const DAY: Duration = Duration::from_secs(86_400);

fn at(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
}

fn consumer(name: &str) -> ConsumerType {
    ConsumerType::new(name).unwrap()
}

/// How a test message carries its time.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Timing {
    /// A plain id, a publish time not trusted: the claim looks in every partition.
    Published(DateTime<Utc>),
    /// A plain id and no time: every partition, filed under the processing month.
    Unknown,
    /// A UUIDv7 id (made from `at`): one partition.
    UuidV7(DateTime<Utc>),
}

fn envelope(id: &str, timing: Timing) -> Envelope {
    let message_id = match timing {
        Timing::UuidV7(time) => {
            // A stable UUIDv7 per test id: its time from `time`, its random bits from the id.
            let millis = u64::try_from(time.timestamp_millis()).unwrap();
            let seed = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, id.as_bytes());
            let random: [u8; 10] = seed.as_bytes()[..10].try_into().unwrap();
            let v7 = uuid::Builder::from_unix_timestamp_millis(millis, &random).into_uuid();
            MessageId::new(v7.to_string()).unwrap()
        }
        _ => MessageId::new(id).unwrap(),
    };
    let envelope = Envelope::new(message_id, "charge", json!({"cents": 100})).unwrap();
    match timing {
        Timing::Published(time) => envelope.with_published_at(time),
        _ => envelope,
    }
}

const EFFECTS_DDL: &str = "CREATE TABLE effects (consumer_type TEXT NOT NULL, message_id TEXT NOT NULL, note TEXT NOT NULL)";

macro_rules! batch_suite {
    ($backend:ident, $fixture:ty, $db:ty) => {
        mod $backend {
            use super::*;
            use sagabox::{InboxGuard, InboxStore};

            type Fixture = $fixture;

            async fn fixture() -> Fixture {
                let fx = <$fixture>::new().await;
                fx.exec(EFFECTS_DDL).await;
                fx
            }

            async fn guard(fx: &Fixture, clock: &ManualClock, connections: u32) -> InboxGuard<impl InboxStore<Db = $db>> {
                InboxGuard::new(fx.store(connections).await, InboxConfig::default().with_ttl(60 * DAY))
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

            async fn batch(
                guard: &InboxGuard<impl InboxStore<Db = $db>>,
                consumer_type: &ConsumerType,
                envelopes: &[Envelope],
                note: &str,
            ) -> Vec<Outcome> {
                guard
                    .process_batch(consumer_type, envelopes, async |conn, env| apply(conn, consumer_type, env, note).await)
                    .await
                    .expect("process_batch")
                    .into_iter()
                    .map(|outcome| outcome.expect("accepted"))
                    .collect()
            }

            #[tokio::test]
            async fn a_batch_applies_each_message_once_and_duplicates_get_the_first_result() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let timings = [Timing::UuidV7(at(2026, 12, 2, 9, 0, 0)), Timing::Published(at(2026, 12, 2, 9, 0, 0)), Timing::Unknown];
                for (round, timing) in timings.into_iter().enumerate() {
                    let [m1, m2, m3] = ["m1", "m2", "m3"].map(|id| envelope(&format!("{round}/{id}"), timing));
                    let single = guard
                        .process(&payment, &m1, async |conn, env| apply(conn, &payment, env, "single").await)
                        .await
                        .unwrap();
                    assert!(matches!(single, Outcome::Applied(_)));
                    clock.advance(chrono::TimeDelta::seconds(1));
                    let processed_at = guard.now();

                    let outcomes = batch(&guard, &payment, &[m2.clone(), m1.clone(), m3.clone(), m2.clone()], "batch").await;
                    assert_eq!(outcomes[0], Outcome::Applied(json!({"note": "batch", "id": m2.id.as_str()})), "{timing:?}");
                    assert_eq!(
                        outcomes[1],
                        Outcome::Duplicate {
                            first_processed_at: at(2026, 12, 2, 10, 0, 0) + chrono::TimeDelta::seconds(round as i64),
                            result: json!({"note": "single", "id": m1.id.as_str()}),
                        },
                        "{timing:?}"
                    );
                    assert_eq!(outcomes[2], Outcome::Applied(json!({"note": "batch", "id": m3.id.as_str()})), "{timing:?}");
                    assert_eq!(
                        outcomes[3],
                        Outcome::Duplicate { first_processed_at: processed_at, result: json!({"note": "batch", "id": m2.id.as_str()}) },
                        "a repeat inside the batch is a duplicate of its first ({timing:?})"
                    );

                    // Everything again, as a batch: all duplicates, no handler runs.
                    let runs = AtomicUsize::new(0);
                    let again = guard
                        .process_batch(&payment, &[m3.clone(), m2.clone(), m1.clone()], async |conn, env| {
                            runs.fetch_add(1, Ordering::SeqCst);
                            apply(conn, &payment, env, "again").await
                        })
                        .await
                        .unwrap();
                    assert_eq!(runs.load(Ordering::SeqCst), 0, "{timing:?}");
                    let notes: Vec<_> = again.iter().map(|o| o.as_ref().unwrap().result()["note"].clone()).collect();
                    assert_eq!(notes, [json!("batch"), json!("batch"), json!("single")], "{timing:?}");
                    assert!(again.iter().all(|o| o.as_ref().unwrap().is_duplicate()));
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 9);
                assert_eq!(fx.inbox_rows().await, 9);
                // Duplicates of recorded messages are counted on their first rows, as
                // single duplicates are (m1 in the first batch, all three in the second,
                // per round); `sagabox inspect` reads them there.
                let report = sagabox::inspect::inspect(&fx.url, &Default::default()).await.unwrap();
                let counted: i64 = report.duplicate_deliveries.iter().map(|d| d.in_inbox).sum();
                assert_eq!(counted, 4 * 3);
            }

            #[tokio::test]
            async fn a_handler_failure_rolls_back_the_whole_batch_and_leaves_no_rows() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let messages: Vec<Envelope> = (0..5).map(|k| envelope(&format!("fail-{k}"), Timing::Unknown)).collect();

                #[derive(Debug, PartialEq)]
                struct CardNetworkDown;
                let failed = guard
                    .process_batch(&payment, &messages, async |conn, env| {
                        apply(conn, &payment, env, "doomed").await.expect("insert");
                        if env.id.as_str() == "fail-3" {
                            return Err(CardNetworkDown);
                        }
                        Ok(json!("ok"))
                    })
                    .await;
                assert!(matches!(failed, Err(GuardError::Handler(CardNetworkDown))), "{failed:?}");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 0, "every side effect rolled back");
                assert_eq!(fx.inbox_rows().await, 0, "no inbox row");

                let retried = batch(&guard, &payment, &messages, "retry").await;
                assert!(retried.iter().all(|o| matches!(o, Outcome::Applied(_))), "{retried:?}");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 5);
                assert_eq!(fx.inbox_rows().await, 5);
            }

            /// Batches over overlapping key ranges, walked in different orders, from
            /// separate sessions, with single deliveries among them: each key applied once,
            /// no deadlock (PostgreSQL would abort a deadlocked batch with an error).
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_overlapping_batches_apply_each_key_exactly_once() {
                const KEYS: usize = 120;
                const TASKS: usize = 6;
                const BATCH: usize = 16;
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let payment = consumer("payment");
                for (round, timing) in [Timing::UuidV7(at(2026, 12, 2, 9, 0, 0)), Timing::Unknown, Timing::Published(at(2026, 11, 30, 23, 0, 0))].into_iter().enumerate() {
                    let messages: Vec<Envelope> = (0..KEYS).map(|k| envelope(&format!("round-{round}/key-{k}"), timing)).collect();
                    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
                    let mut tasks = Vec::new();
                    for task in 0..TASKS {
                        let guard = guard(&fx, &clock, 1).await;
                        let (messages, payment, barrier) = (messages.clone(), payment.clone(), barrier.clone());
                        tasks.push(tokio::spawn(async move {
                            // Odd tasks walk backwards: their batches take shared keys in
                            // the opposite input order.
                            let mut order: Vec<usize> = (0..KEYS).map(|i| (i + task * 7) % KEYS).collect();
                            if task % 2 == 1 {
                                order.reverse();
                            }
                            barrier.wait().await;
                            let (mut applied, mut duplicates) = (0, 0);
                            for chunk in order.chunks(BATCH) {
                                let outcomes = if task == 0 {
                                    // One task delivers singly, racing the batches.
                                    let mut outcomes = Vec::new();
                                    for &i in chunk {
                                        outcomes.push(
                                            guard
                                                .process(&payment, &messages[i], async |conn, env| apply(conn, &payment, env, "single").await)
                                                .await
                                                .expect("process"),
                                        );
                                    }
                                    outcomes
                                } else {
                                    let envelopes: Vec<Envelope> = chunk.iter().map(|&i| messages[i].clone()).collect();
                                    batch(&guard, &payment, &envelopes, &format!("task {task}")).await
                                };
                                for outcome in outcomes {
                                    match outcome {
                                        Outcome::Applied(_) => applied += 1,
                                        Outcome::Duplicate { .. } => duplicates += 1,
                                    }
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
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 3 * KEYS as i64);
                assert_eq!(
                    fx.scalar("SELECT COUNT(*) FROM (SELECT message_id FROM effects GROUP BY message_id HAVING COUNT(*) > 1) d").await,
                    0,
                    "a key was applied twice"
                );
                assert_eq!(fx.inbox_rows().await, 3 * KEYS as i64);
            }

            /// A delivery of a key the batch holds waits for the batch, never runs its
            /// handler, and gets the batch's result.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_racing_delivery_waits_for_the_batch_and_gets_its_result() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let batch_guard = guard(&fx, &clock, 1).await;
                let single_guard = guard(&fx, &clock, 1).await;
                let payment = consumer("payment");
                let messages: Vec<Envelope> = (0..3).map(|k| envelope(&format!("held-{k}"), Timing::Published(at(2026, 12, 2, 9, 0, 0)))).collect();
                let runs = Arc::new(AtomicUsize::new(0));
                let (inside_tx, inside_rx) = tokio::sync::oneshot::channel::<()>();
                let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
                let held = {
                    let (payment, messages, runs) = (payment.clone(), messages.clone(), runs.clone());
                    tokio::spawn(async move {
                        // The first handler run signals and waits; the closure is cloned
                        // per envelope, so the one-shot pair is shared.
                        let signal = std::sync::Mutex::new(Some((inside_tx, release_rx)));
                        let signal = &signal;
                        batch_guard
                            .process_batch(&payment, &messages, async |conn, env| {
                                runs.fetch_add(1, Ordering::SeqCst);
                                let result = apply(conn, &payment, env, "batch").await;
                                let taken = signal.lock().unwrap().take();
                                if let Some((inside, release)) = taken {
                                    inside.send(()).expect("signal");
                                    release.await.expect("release");
                                }
                                result
                            })
                            .await
                            .expect("batch")
                    })
                };
                inside_rx.await.expect("the batch is inside its first handler");
                let single = {
                    let (payment, message, runs) = (payment.clone(), messages[2].clone(), runs.clone());
                    tokio::spawn(async move {
                        single_guard
                            .process(&payment, &message, async |conn, env| {
                                runs.fetch_add(1, Ordering::SeqCst);
                                apply(conn, &payment, env, "single").await
                            })
                            .await
                            .expect("single")
                    })
                };
                fx.wait_for_blocked_claim().await;
                assert_eq!(runs.load(Ordering::SeqCst), 1, "the racing delivery ran its handler while the batch was open");
                release_tx.send(()).expect("release");
                let held = held.await.unwrap();
                assert!(held.iter().all(|o| matches!(o, Ok(Outcome::Applied(_)))), "{held:?}");
                let single = single.await.unwrap();
                assert!(matches!(&single, Outcome::Duplicate { result, .. } if result["note"] == "batch"), "{single:?}");
                assert_eq!(runs.load(Ordering::SeqCst), 3);
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 3);
            }

            /// The insert-first claim: handlers with no result to record, so a batch's
            /// claim writes its fresh rows in its first statement and falls back to
            /// blocking locks in key order when a racing delivery holds one. Batches over
            /// overlapping keys in opposite orders, single deliveries of both kinds
            /// (writing their row first, and recording a result after the handler) among
            /// them, repeated: each key applied once, no deadlock, every duplicate
            /// answered with its first delivery's result.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_insert_first_batches_apply_each_key_exactly_once() {
                const KEYS: usize = 150;
                const TASKS: usize = 8;
                const BATCH: usize = 25;
                const ROUNDS: usize = 4;
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let payment = consumer("payment");
                for round in 0..ROUNDS {
                    let timing = Timing::UuidV7(at(2026, 12, 2, 9, 0, 0));
                    let messages: Vec<Envelope> = (0..KEYS).map(|k| envelope(&format!("fast-{round}/key-{k}"), timing)).collect();
                    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
                    let mut tasks = Vec::new();
                    for task in 0..TASKS {
                        let guard = guard(&fx, &clock, 1).await;
                        let (messages, payment, barrier) = (messages.clone(), payment.clone(), barrier.clone());
                        tasks.push(tokio::spawn(async move {
                            let mut order: Vec<usize> = (0..KEYS).map(|i| (i + task * 11 + round * 5) % KEYS).collect();
                            if task % 2 == 1 {
                                order.reverse();
                            }
                            barrier.wait().await;
                            let mut outcomes = Vec::new();
                            for chunk in order.chunks(BATCH) {
                                if task < 2 {
                                    // Task 0 delivers singly with no result (its claim writes
                                    // the row first); task 1 singly with a result (its claim
                                    // looks, and the row is inserted after the handler).
                                    for &i in chunk {
                                        let outcome = guard
                                            .process(&payment, &messages[i], async |conn, env| {
                                                let result = apply(conn, &payment, env, "single").await?;
                                                Ok::<_, sqlx::Error>(if task == 0 { serde_json::Value::Null } else { result })
                                            })
                                            .await
                                            .expect("process");
                                        outcomes.push((i, outcome, task));
                                    }
                                } else {
                                    let envelopes: Vec<Envelope> = chunk.iter().map(|&i| messages[i].clone()).collect();
                                    let batch = guard
                                        .process_batch(&payment, &envelopes, async |conn, env| {
                                            apply(conn, &payment, env, "batch").await?;
                                            Ok::<_, sqlx::Error>(serde_json::Value::Null)
                                        })
                                        .await
                                        .expect("a batch failed (a deadlock is an error)");
                                    for (&i, outcome) in chunk.iter().zip(batch) {
                                        outcomes.push((i, outcome.expect("accepted"), task));
                                    }
                                }
                            }
                            outcomes
                        }));
                    }
                    let mut first_result: Vec<Option<serde_json::Value>> = vec![None; KEYS];
                    let mut all = Vec::new();
                    for task in tasks {
                        all.extend(task.await.expect("task"));
                    }
                    for (i, outcome, _) in &all {
                        if let Outcome::Applied(result) = outcome {
                            assert!(first_result[*i].is_none(), "round {round}: key {i} applied twice");
                            first_result[*i] = Some(result.clone());
                        }
                    }
                    assert!(first_result.iter().all(Option::is_some), "round {round}: a key was never applied");
                    for (i, outcome, task) in &all {
                        if let Outcome::Duplicate { result, .. } = outcome {
                            assert_eq!(Some(result), first_result[*i].as_ref(), "round {round}: task {task}, key {i}");
                        }
                    }
                    assert_eq!(all.len(), KEYS * TASKS);
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, (ROUNDS * KEYS) as i64);
                assert_eq!(
                    fx.scalar("SELECT COUNT(*) FROM (SELECT message_id FROM effects GROUP BY message_id HAVING COUNT(*) > 1) d").await,
                    0,
                    "a key was applied twice"
                );
                assert_eq!(fx.inbox_rows().await, (ROUNDS * KEYS) as i64);
            }

            /// A batch one of whose keys a single delivery holds (inside its handler)
            /// waits for it, does not run that key's handler, and answers it with the
            /// single delivery's result; its other keys apply.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_insert_first_batch_waits_for_a_key_held_by_a_single_delivery() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let batch_guard = guard(&fx, &clock, 1).await;
                let single_guard = guard(&fx, &clock, 1).await;
                let payment = consumer("payment");
                let timing = Timing::UuidV7(at(2026, 12, 2, 9, 0, 0));
                let messages: Vec<Envelope> = (0..4).map(|k| envelope(&format!("wait-{k}"), timing)).collect();
                let (inside_tx, inside_rx) = tokio::sync::oneshot::channel::<()>();
                let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
                let single = {
                    let (payment, message) = (payment.clone(), messages[2].clone());
                    tokio::spawn(async move {
                        single_guard
                            .process(&payment, &message, async |conn, env| {
                                apply(conn, &payment, env, "single").await?;
                                inside_tx.send(()).expect("signal");
                                release_rx.await.expect("release");
                                Ok::<_, sqlx::Error>(json!("single's result"))
                            })
                            .await
                            .expect("single")
                    })
                };
                inside_rx.await.expect("the single delivery is inside its handler");
                let runs = Arc::new(AtomicUsize::new(0));
                let batch = {
                    let (payment, messages, runs) = (payment.clone(), messages.clone(), runs.clone());
                    tokio::spawn(async move {
                        batch_guard
                            .process_batch(&payment, &messages, async |conn, env| {
                                runs.fetch_add(1, Ordering::SeqCst);
                                apply(conn, &payment, env, "batch").await?;
                                Ok::<_, sqlx::Error>(serde_json::Value::Null)
                            })
                            .await
                            .expect("batch")
                    })
                };
                fx.wait_for_blocked_claim().await;
                assert_eq!(runs.load(Ordering::SeqCst), 0, "the batch ran a handler while a key of it was held");
                release_tx.send(()).expect("release");
                assert!(matches!(single.await.unwrap(), Outcome::Applied(_)));
                let outcomes: Vec<Outcome> = batch.await.unwrap().into_iter().map(|o| o.unwrap()).collect();
                assert_eq!(runs.load(Ordering::SeqCst), 3);
                for (k, outcome) in outcomes.iter().enumerate() {
                    if k == 2 {
                        assert!(matches!(outcome, Outcome::Duplicate { result, .. } if *result == json!("single's result")), "{outcome:?}");
                    } else {
                        assert_eq!(*outcome, Outcome::Applied(serde_json::Value::Null));
                    }
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 4);
                assert_eq!(fx.inbox_rows().await, 4);
            }

            /// A batch whose claim wrote the rows first and whose handler then returns a
            /// result for some envelopes: those results are recorded, the others stay
            /// null, and redeliveries get each one.
            #[tokio::test]
            async fn results_of_an_insert_first_batch_are_recorded_where_not_null() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let timing = Timing::UuidV7(at(2026, 12, 2, 9, 0, 0));
                let messages: Vec<Envelope> = (0..6).map(|k| envelope(&format!("mixed-{k}"), timing)).collect();
                let result_of = |k: usize| if k % 2 == 0 { json!({"charge": k}) } else { serde_json::Value::Null };
                for round in 0..2 {
                    let outcomes = guard
                        .process_batch_set(&payment, &messages, async |conn, fresh| {
                            let mut results = Vec::new();
                            for envelope in fresh {
                                apply(conn, &payment, envelope, "set").await?;
                                let k: usize = messages.iter().position(|m| m.id == envelope.id).unwrap();
                                results.push(result_of(k));
                            }
                            Ok::<_, sqlx::Error>(results)
                        })
                        .await
                        .unwrap();
                    for (k, outcome) in outcomes.into_iter().enumerate() {
                        let outcome = outcome.unwrap();
                        assert_eq!(outcome.is_duplicate(), round == 1, "round {round}, message {k}");
                        assert_eq!(*outcome.result(), result_of(k), "round {round}, message {k}");
                    }
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 6);
                assert_eq!(fx.inbox_rows().await, 6);
            }

            /// A message without a time first processed on the 30th lands in November's
            /// partition; redelivered in a batch on the 1st, it must still be found.
            #[tokio::test]
            async fn a_batch_finds_first_deliveries_in_an_earlier_month() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 11, 30, 23, 59, 59));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let old = envelope("boundary/old", Timing::Unknown);
                let first = guard
                    .process(&payment, &old, async |conn, env| apply(conn, &payment, env, "november").await)
                    .await
                    .unwrap();
                assert!(matches!(first, Outcome::Applied(_)));
                clock.set(at(2026, 12, 1, 0, 0, 1));
                let new = envelope("boundary/new", Timing::Unknown);
                let outcomes = batch(&guard, &payment, &[new, old], "december").await;
                assert!(matches!(outcomes[0], Outcome::Applied(_)), "{outcomes:?}");
                assert!(
                    matches!(&outcomes[1], Outcome::Duplicate { first_processed_at, result } if *first_processed_at == at(2026, 11, 30, 23, 59, 59) && result["note"] == "november"),
                    "{outcomes:?}"
                );
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 2);
            }

            #[tokio::test]
            async fn refused_envelopes_keep_their_slot_and_the_rest_apply() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let expired = envelope("too-old", Timing::Published(at(2026, 9, 1, 0, 0, 0)));
                let future = envelope("too-new", Timing::Published(at(2027, 1, 1, 0, 0, 0)));
                let fine = envelope("fine", Timing::Published(at(2026, 12, 2, 9, 0, 0)));
                let outcomes = guard
                    .process_batch(&payment, &[expired, fine, future], async |conn, env| apply(conn, &payment, env, "batch").await)
                    .await
                    .unwrap();
                assert!(matches!(outcomes[0], Err(InboxError::Expired { .. })), "{outcomes:?}");
                assert!(matches!(outcomes[1], Ok(Outcome::Applied(_))), "{outcomes:?}");
                assert!(matches!(outcomes[2], Err(InboxError::PublishedInFuture { .. })), "{outcomes:?}");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1);
                assert_eq!(fx.inbox_rows().await, 1);
            }

            /// The set-based handler sees only the fresh envelopes, once each, in order;
            /// its results map back to their slots; a wrong result count rolls back.
            #[tokio::test]
            async fn a_set_based_handler_gets_only_fresh_envelopes_and_its_results_map_back() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let [a, b, c] = ["a", "b", "c"].map(|id| envelope(&format!("set/{id}"), Timing::UuidV7(at(2026, 12, 2, 9, 0, 0))));
                batch(&guard, &payment, std::slice::from_ref(&b), "earlier").await;

                let seen = std::sync::Mutex::new(Vec::new());
                let outcomes = guard
                    .process_batch_set(&payment, &[a.clone(), b.clone(), c.clone(), a.clone()], async |conn, fresh| {
                        seen.lock().unwrap().extend(fresh.iter().map(|e| e.id.clone()));
                        let mut results = Vec::new();
                        for (n, envelope) in fresh.iter().enumerate() {
                            apply(conn, &payment, envelope, "set").await?;
                            results.push(json!({"position": n}));
                        }
                        Ok::<_, sqlx::Error>(results)
                    })
                    .await
                    .unwrap();
                assert_eq!(*seen.lock().unwrap(), [a.id.clone(), c.id.clone()]);
                assert_eq!(outcomes[0].as_ref().unwrap(), &Outcome::Applied(json!({"position": 0})));
                assert!(matches!(outcomes[1].as_ref().unwrap(), Outcome::Duplicate { result, .. } if result["note"] == "earlier"));
                assert_eq!(outcomes[2].as_ref().unwrap(), &Outcome::Applied(json!({"position": 1})));
                assert!(matches!(outcomes[3].as_ref().unwrap(), Outcome::Duplicate { result, .. } if *result == json!({"position": 0})));

                let d = envelope("set/d", Timing::UuidV7(at(2026, 12, 2, 9, 0, 0)));
                let short = guard
                    .process_batch_set(&payment, std::slice::from_ref(&d), async |conn, fresh| {
                        apply(conn, &payment, fresh[0], "short").await?;
                        Ok::<_, sqlx::Error>(Vec::new())
                    })
                    .await;
                assert!(
                    matches!(short, Err(GuardError::Inbox(InboxError::BatchResultCount { expected: 1, returned: 0 }))),
                    "{short:?}"
                );
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 3, "the short batch rolled back");
                assert_eq!(fx.inbox_rows().await, 3);
            }

            #[tokio::test]
            async fn an_empty_batch_does_nothing_and_an_oversized_one_is_refused() {
                let fx = fixture().await;
                let clock = ManualClock::new(at(2026, 12, 2, 10, 0, 0));
                let guard = guard(&fx, &clock, 2).await;
                let payment = consumer("payment");
                let handle = async |conn: &mut <$db as sqlx::Database>::Connection, env: &Envelope| apply(conn, &payment, env, "x").await;
                assert!(guard.process_batch(&payment, &[], handle).await.unwrap().is_empty());
                let many: Vec<Envelope> = (0..=MAX_BATCH).map(|k| envelope(&format!("k{k}"), Timing::Unknown)).collect();
                let refused = guard.process_batch(&payment, &many, handle).await;
                assert!(
                    matches!(refused, Err(GuardError::Inbox(InboxError::BatchTooLarge { len, max })) if len == MAX_BATCH + 1 && max == MAX_BATCH),
                    "{refused:?}"
                );
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 0);
            }
        }
    };
}

batch_suite!(postgres, common::Pg, sqlx::Postgres);
batch_suite!(sqlite, common::Lite, sqlx::Sqlite);
