//! The checkout demo's acceptance checks, read from the business tables by SQL, on real
//! PostgreSQL and SQLite: under duplicates, lost replies, failures after the write and
//! declined cards; the `--no-inbox` control; and a run killed with SIGKILL part-way
//! (the built binary) and finished with `--resume`.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sagabox_checkout::{DemoConfig, run};

fn faulty(orders: usize) -> DemoConfig {
    DemoConfig {
        orders,
        concurrency: 32,
        duplicate_rate: 0.5,
        lost_reply_rate: 0.1,
        fail_rate: 0.1,
        decline_rate: 0.05,
        seed: 42,
        ..DemoConfig::default()
    }
}

use common::invariants::CHECKOUT as INVARIANTS;

macro_rules! demo_suite {
    ($backend:ident, $fixture:ty) => {
        mod $backend {
            use super::*;

            async fn assert_invariants(fx: &$fixture) {
                for (what, sql) in INVARIANTS {
                    assert_eq!(fx.scalar(sql).await, 0, "{what}");
                }
            }

            /// Runs 1,000 orders under the demo's faults with `config` and checks that
            /// every saga finished, the faults happened, and nothing was applied twice.
            async fn a_faulty_thousand_keeps_every_invariant(config: DemoConfig) {
                let fx = <$fixture>::new().await;
                let summary = run(&fx.url, &config).await.unwrap();
                assert_eq!(summary.orders, 1000);
                assert_eq!(summary.unfinished, 0);
                assert_eq!(summary.completed + summary.compensated, 1000);
                assert!(summary.compensated > 50, "declines and stock-outs compensate: {summary:?}");
                assert_eq!(summary.damage(), 0, "{summary:?}");
                assert!(summary.retries > 0 && summary.duplicate_replies > 0, "{summary:?}");
                assert_invariants(&fx).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_thousand_orders_under_faults_keep_every_invariant() {
                a_faulty_thousand_keeps_every_invariant(faulty(1000)).await;
            }

            /// The same faults with each step's commands claimed in batches: the
            /// participants apply a batch of charges, decrements or confirmations with a
            /// few statements for the whole batch, and an injected failure rolls the
            /// batch back to be run one by one; stock and money still come out exact.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn orders_claimed_in_batches_under_faults_keep_every_invariant() {
                a_faulty_thousand_keeps_every_invariant(DemoConfig { claim_batch: 16, concurrency: 64, ..faulty(1000) }).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn without_the_inbox_the_same_run_double_charges() {
                let fx = <$fixture>::new().await;
                let control = DemoConfig { no_inbox: true, ..faulty(500) };
                let summary = run(&fx.url, &control).await.unwrap();
                assert!(summary.double_charges > 0, "the control shows the damage: {summary:?}");
                // The same figure, counted independently here: orders with two charges.
                let doubled = fx
                    .scalar("SELECT COUNT(DISTINCT a.order_id) FROM payment_charges a JOIN payment_charges b \
                             ON a.order_id = b.order_id AND a.id < b.id WHERE a.kind = 'charge' AND b.kind = 'charge'")
                    .await;
                assert_eq!(doubled, summary.double_charges);
            }

            /// The soak's test mode: the run's clock goes four hours a second, starting half
            /// an hour before an earlier month (holding a delivery) expires. The demo's pruner
            /// drops that month while orders flow, keeps the live ones and the months
            /// ahead, and no invariant breaks.
            ///
            /// The clock is a real one sped up, so the verdict holds for any run that
            /// outlasts the pruner's second pass (a quarter second in, January expired
            /// since the first) and ends before February expires (168 s in): a window wide
            /// enough for a release build on a fast machine and a debug build on a busy
            /// one.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_fast_clock_prunes_the_expired_month_while_orders_flow() {
                use chrono::{TimeZone, Utc};
                use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, ManualClock, MessageId};

                let fx = <$fixture>::new().await;
                let january = Utc.with_ymd_and_hms(2027, 1, 15, 0, 0, 0).unwrap();
                let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default())
                    .unwrap()
                    .with_clock(ManualClock::new(january));
                guard.migrate().await.unwrap();
                let envelope =
                    Envelope::new(MessageId::derive_v7(january, "old"), "charge", serde_json::json!({})).unwrap();
                guard
                    .process(&ConsumerType::new("payment").unwrap(), &envelope, async |_, _| {
                        Ok::<_, std::convert::Infallible>(serde_json::Value::Null)
                    })
                    .await
                    .unwrap();

                // January's rows all expire (30-day TTL) on 2027-03-03 00:00, February's on
                // 2027-03-31 00:00.
                let january_expires = Utc.with_ymd_and_hms(2027, 3, 3, 0, 0, 0).unwrap();
                let start = january_expires - chrono::TimeDelta::minutes(30);
                let config = DemoConfig {
                    // The pruner passes at start, then every hour of the run's clock but
                    // at most every quarter second: at this speed, both. January expires
                    // between the first pass and the second; February 672.5 hours
                    // (168 s) in.
                    clock_speed: 14_400.0,
                    clock_start: Some(start),
                    ..faulty(800)
                };
                let summary = run(&fx.url, &config).await.unwrap();
                assert!(summary.clock_end > january_expires, "the run outlasted January: {summary:?}");
                assert_eq!(summary.months_pruned, ["2027-01"], "{summary:?}");
                assert_eq!(summary.months_kept[..4], ["2027-02", "2027-03", "2027-04", "2027-05"], "{summary:?}");
                assert_eq!(summary.unfinished, 0, "{summary:?}");
                assert_eq!(summary.damage(), 0, "{summary:?}");
                assert_invariants(&fx).await;
                // The demo's own deliveries were filed under the fast clock, in March.
                assert!(fx.scalar("SELECT COUNT(*) FROM sagabox_inbox_2027_03").await > 800);
            }

            /// The built binary, killed with SIGKILL once part of its sagas are done, then
            /// `--resume`: every invariant holds.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_run_killed_part_way_then_resumed_keeps_every_invariant() {
                let fx = <$fixture>::new().await;
                let mut demo = Command::new(env!("CARGO_BIN_EXE_sagabox"))
                    .args([
                        "demo", "--database-url", &fx.url, "--orders", "1000", "--concurrency", "32",
                        "--duplicate-rate", "0.5", "--lost-reply-rate", "0.1", "--fail-rate", "0.1",
                        "--decline-rate", "0.05", "--seed", "9", "--json",
                    ])
                    .env_remove("DATABASE_URL").env_remove("SAGABOX_DATABASE_URL")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap();
                // The kill waits for an amount of work, never for a span of time: 300 of
                // the 1,000 sagas finished, whatever the build's speed.
                let deadline = Instant::now() + Duration::from_secs(120);
                loop {
                    let done = sqlx::query_scalar::<_, i64>(
                        "SELECT COUNT(*) FROM sagabox_saga_instances WHERE status IN ('completed', 'compensated')",
                    )
                    .fetch_one(&fx.pool)
                    .await
                    .unwrap_or(0);
                    if done >= 300 {
                        break;
                    }
                    assert!(demo.try_wait().unwrap().is_none(), "the demo ended before it could be killed");
                    assert!(Instant::now() < deadline, "the demo made no progress");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                assert!(common::chaos::kill(&mut demo), "the demo had ended before the kill");
                let placed = fx.scalar("SELECT COUNT(*) FROM demo_orders").await;
                let unfinished = fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status NOT IN ('completed', 'compensated')").await;
                assert!(placed < 1000 || unfinished > 0, "killed part-way: {placed} placed, {unfinished} unfinished");

                let resumed = Command::new(env!("CARGO_BIN_EXE_sagabox"))
                    .args(["demo", "--database-url", &fx.url, "--resume", "--json", "--seed", "10"])
                    .env_remove("DATABASE_URL").env_remove("SAGABOX_DATABASE_URL")
                    .output()
                    .unwrap();
                assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
                let summary: serde_json::Value = serde_json::from_slice(&resumed.stdout).unwrap();
                assert_eq!(summary["unfinished"], 0, "{summary}");
                assert_eq!(summary["double_charges"], 0, "{summary}");
                assert_invariants(&fx).await;
            }
        }
    };
}

demo_suite!(postgres, common::Pg);
demo_suite!(sqlite, common::Lite);
