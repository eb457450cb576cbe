//! The pruner actor: its schedule under tokio's paused clock, and its pass against real
//! PostgreSQL and SQLite inboxes.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{TimeZone, Utc};
use ractor::Actor;
use sagabox::pruner::{Maintenance, PrunePass, Pruner, PrunerArguments, PrunerMessage};
use sagabox::{InboxConfig, InboxError, InboxGuard, ManualClock, Month};

/// Counts passes; fails the ones it is told to. No I/O, so the paused clock alone decides
/// when passes happen.
#[derive(Debug, Clone, Default)]
struct Counting {
    passes: Arc<AtomicU64>,
    fail_first: u64,
}

impl Maintenance for Counting {
    async fn run_pass(&self, dry_run: bool) -> Result<PrunePass, InboxError> {
        let n = self.passes.fetch_add(1, Ordering::SeqCst);
        if n < self.fail_first {
            return Err(InboxError::UnsupportedUrl("injected failure".into()));
        }
        Ok(PrunePass {
            dry_run,
            ..PrunePass::default()
        })
    }
}

/// Lets the actor run until `passes` reaches `expected` (or a bound of yields passes).
async fn settle(passes: &AtomicU64, expected: u64) -> u64 {
    for _ in 0..1000 {
        if passes.load(Ordering::SeqCst) >= expected {
            break;
        }
        tokio::task::yield_now().await;
    }
    // A few more yields: a pass that should not happen would show up here.
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    passes.load(Ordering::SeqCst)
}

#[tokio::test(start_paused = true)]
async fn passes_run_at_start_then_once_per_interval() {
    let counting = Counting::default();
    let passes = counting.passes.clone();
    let (pruner, handle) = Actor::spawn(
        None,
        Pruner::new(),
        PrunerArguments {
            maintenance: counting,
            interval: Duration::from_secs(3600),
        },
    )
    .await
    .unwrap();

    assert_eq!(settle(&passes, 1).await, 1, "one pass at start");
    tokio::time::advance(Duration::from_secs(3599)).await;
    assert_eq!(settle(&passes, 1).await, 1, "nothing before the hour");
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(settle(&passes, 2).await, 2, "one pass on the hour");
    for hour in 3..=6 {
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert_eq!(settle(&passes, hour).await, hour);
    }
    pruner.stop(None);
    handle.await.unwrap();
    tokio::time::advance(Duration::from_secs(10 * 3600)).await;
    assert_eq!(settle(&passes, 6).await, 6, "no passes after stop");
}

#[tokio::test(start_paused = true)]
async fn a_failed_pass_does_not_stop_the_pruner() {
    let counting = Counting {
        fail_first: 2,
        ..Counting::default()
    };
    let passes = counting.passes.clone();
    let (pruner, handle) = Actor::spawn(
        None,
        Pruner::new(),
        PrunerArguments {
            maintenance: counting,
            interval: Duration::from_secs(60),
        },
    )
    .await
    .unwrap();
    assert_eq!(settle(&passes, 1).await, 1);
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(settle(&passes, 2).await, 2);
    // Third pass succeeds, on demand.
    let answer = ractor::call_t!(pruner, PrunerMessage::RunNow, 5_000).unwrap();
    assert!(answer.is_ok(), "{answer:?}");
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(settle(&passes, 4).await, 4, "still ticking after failures");
    pruner.stop(None);
    handle.await.unwrap();
}

#[tokio::test]
async fn a_zero_interval_is_refused() {
    let spawned = Actor::spawn(
        None,
        Pruner::new(),
        PrunerArguments {
            maintenance: Counting::default(),
            interval: Duration::ZERO,
        },
    )
    .await;
    let error = spawned.expect_err("refused").to_string();
    assert!(error.contains("interval is zero"), "{error}");
}

fn month(y: i32, m: u32) -> Month {
    Month::new(y, m).unwrap()
}

macro_rules! pass_suite {
    ($backend:ident, $fixture:ty) => {
        mod $backend {
            use super::*;

            /// Aug–Dec exist; at 2026-12-20 with a 14-day TTL a pass drops Aug–Nov and
            /// creates Jan and Feb ahead; a dry run before it changes nothing.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_pass_creates_ahead_and_drops_the_expired_months() {
                let fx = <$fixture>::new().await;
                let clock = ManualClock::new(Utc.with_ymd_and_hms(2026, 12, 20, 0, 0, 0).unwrap());
                let guard = InboxGuard::new(
                    fx.store(2).await,
                    InboxConfig::default().with_ttl(Duration::from_secs(14 * 86_400)),
                )
                .unwrap()
                .with_clock(clock);
                guard
                    .create_partitions(month(2026, 8), month(2026, 12))
                    .await
                    .unwrap();

                let dry = guard.run_pass(true).await.unwrap();
                assert_eq!(dry.created, vec![month(2027, 1), month(2027, 2)]);
                assert_eq!(
                    dry.dropped,
                    month(2026, 8).through(month(2026, 11)).collect::<Vec<_>>()
                );
                assert_eq!(
                    guard.partitions().await.unwrap().len(),
                    5,
                    "dry run changed nothing"
                );

                let (pruner, handle) = Actor::spawn(
                    None,
                    Pruner::new(),
                    PrunerArguments {
                        maintenance: guard.clone(),
                        interval: Duration::from_secs(3600),
                    },
                )
                .await
                .unwrap();
                // The start pass did the work; an on-demand pass then finds nothing to do.
                let again = ractor::call_t!(pruner, PrunerMessage::RunNow, 30_000)
                    .unwrap()
                    .unwrap();
                assert!(
                    again.created.is_empty() && again.dropped.is_empty(),
                    "{again:?}"
                );
                assert_eq!(again.oldest, Some(month(2026, 12)));
                assert_eq!(
                    guard.partitions().await.unwrap(),
                    vec![month(2026, 12), month(2027, 1), month(2027, 2)]
                );
                pruner.stop(None);
                handle.await.unwrap();
            }

            #[test]
            fn a_pass_reports_through_metrics() {
                use metrics_util::debugging::{DebugValue, DebuggingRecorder};
                let recorder = DebuggingRecorder::new();
                let snapshotter = recorder.snapshotter();
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                metrics::with_local_recorder(&recorder, || {
                    runtime.block_on(async {
                        let fx = <$fixture>::new().await;
                        let guard = InboxGuard::new(
                            fx.store(1).await,
                            InboxConfig::default().with_ttl(Duration::from_secs(14 * 86_400)),
                        )
                        .unwrap()
                        .with_clock(ManualClock::new(
                            Utc.with_ymd_and_hms(2026, 12, 20, 0, 0, 0).unwrap(),
                        ));
                        guard
                            .create_partitions(month(2026, 9), month(2026, 12))
                            .await
                            .unwrap();
                        guard.run_pass(false).await.unwrap();
                    })
                });
                let mut seen = std::collections::HashMap::new();
                for (key, _, _, value) in snapshotter.snapshot().into_vec() {
                    let value = match value {
                        DebugValue::Counter(n) => n as f64,
                        DebugValue::Gauge(g) => g.into_inner(),
                        DebugValue::Histogram(_) => continue,
                    };
                    seen.insert(key.key().name().to_owned(), value);
                }
                assert_eq!(
                    seen.get("sagabox_pruner_partitions_created_total"),
                    Some(&2.0),
                    "{seen:?}"
                );
                assert_eq!(
                    seen.get("sagabox_pruner_partitions_dropped_total"),
                    Some(&3.0),
                    "{seen:?}"
                );
                // Oldest left: December, 19 days old at 2026-12-20T00:00Z.
                assert_eq!(
                    seen.get("sagabox_inbox_oldest_partition_age_seconds"),
                    Some(&(19.0 * 86_400.0)),
                    "{seen:?}"
                );
            }
        }
    };
}

pass_suite!(postgres, common::Pg);
pass_suite!(sqlite, common::Lite);

/// The advisory lock class of the maintenance lock (`'Sagb'`), as the PostgreSQL store
/// takes it: a test holds it to stand for another instance in the middle of a pass.
const MAINTENANCE_CLASS: i32 = 1_398_892_386;

/// What a pruner's passes did, for an instance among several.
#[derive(Debug, Clone)]
struct Tallied {
    inner: InboxGuard<sagabox::PostgresStore>,
    passes: Arc<std::sync::Mutex<Vec<Result<PrunePass, String>>>>,
}

impl Maintenance for Tallied {
    async fn run_pass(&self, dry_run: bool) -> Result<PrunePass, InboxError> {
        let pass = self.inner.run_pass(dry_run).await;
        self.passes
            .lock()
            .unwrap()
            .push(pass.as_ref().map(Clone::clone).map_err(ToString::to_string));
        pass
    }
}

/// Three instances on one PostgreSQL inbox, each with its pruner: while another
/// instance holds the maintenance lock every pass is skipped and changes nothing; once
/// that instance is gone (its session closed, as when it is killed) the three pruners
/// take over within an interval, each expired month is dropped exactly once, and no pass
/// fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_at_a_time_prunes_and_a_dead_holder_is_replaced() {
    use sqlx::Connection;
    let fx = common::Pg::new().await;
    let clock = ManualClock::new(Utc.with_ymd_and_hms(2026, 12, 20, 0, 0, 0).unwrap());
    let mut guards = Vec::new();
    for _ in 0..3 {
        guards.push(
            InboxGuard::new(
                fx.store(2).await,
                InboxConfig::default().with_ttl(Duration::from_secs(14 * 86_400)),
            )
            .unwrap()
            .with_clock(clock.clone()),
        );
    }
    guards[0]
        .create_partitions(month(2026, 8), month(2026, 12))
        .await
        .unwrap();

    // Another instance is in the middle of a pass.
    let mut holder = sqlx::PgConnection::connect(&fx.url).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1, 0)")
        .bind(MAINTENANCE_CLASS)
        .execute(&mut holder)
        .await
        .unwrap();
    for guard in &guards {
        let pass = guard.run_pass(false).await.unwrap();
        assert!(pass.skipped, "{pass:?}");
        assert!(
            pass.created.is_empty() && pass.dropped.is_empty(),
            "{pass:?}"
        );
    }
    assert_eq!(
        guards[0].partitions().await.unwrap().len(),
        5,
        "nothing changed"
    );

    // Three pruners, started while the lock is still held; then its holder dies.
    let mut pruners = Vec::new();
    let mut tallies = Vec::new();
    for guard in &guards {
        let tallied = Tallied {
            inner: guard.clone(),
            passes: Arc::default(),
        };
        tallies.push(Arc::clone(&tallied.passes));
        pruners.push(
            Actor::spawn(
                None,
                Pruner::new(),
                PrunerArguments {
                    maintenance: tallied,
                    interval: Duration::from_millis(50),
                },
            )
            .await
            .unwrap(),
        );
    }
    holder.close().await.unwrap();
    let done = vec![month(2026, 12), month(2027, 1), month(2027, 2)];
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while guards[0].partitions().await.unwrap() != done {
        assert!(
            std::time::Instant::now() < deadline,
            "no pruner took over: {:?}",
            guards[0].partitions().await.unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A few more passes each, so that a second drop of a month would show.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while tallies
        .iter()
        .any(|passes| passes.lock().unwrap().len() < 5)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "pruners stopped passing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (pruner, handle) in pruners {
        pruner.stop(None);
        handle.await.unwrap();
    }
    let mut dropped = Vec::new();
    for passes in &tallies {
        for pass in passes.lock().unwrap().iter() {
            let pass = pass
                .as_ref()
                .unwrap_or_else(|error| panic!("a pass failed: {error}"));
            dropped.extend(pass.dropped.iter().copied());
        }
    }
    dropped.sort();
    assert_eq!(
        dropped,
        month(2026, 8).through(month(2026, 11)).collect::<Vec<_>>(),
        "each expired month dropped exactly once"
    );
}

/// The inbox pruner and the saga history's pass take locks of their own: one holding
/// its lock never makes the other skip (an orchestrator runs both at start), while
/// each still lets one instance at a time through.
#[tokio::test]
async fn the_inbox_and_the_history_passes_have_locks_of_their_own() {
    use sagabox::InboxStore;
    let pg = common::Pg::new().await;
    let store = pg.store(4).await;
    let inbox = store.try_maintenance_lock().await.unwrap().expect("free");
    let history = store
        .try_history_lock()
        .await
        .unwrap()
        .expect("not held by the inbox's pass");
    assert!(
        store.try_maintenance_lock().await.unwrap().is_none(),
        "one inbox pass at a time"
    );
    assert!(
        store.try_history_lock().await.unwrap().is_none(),
        "one history pass at a time"
    );
    inbox.release().await;
    history.release().await;
    let again = store.try_history_lock().await.unwrap();
    assert!(again.is_some(), "free again once released");
    if let Some(lock) = again {
        lock.release().await;
    }
}
