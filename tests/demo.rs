//! The checkout demo's acceptance checks, read from the business tables by SQL, on real
//! PostgreSQL and SQLite: under duplicates, lost replies, failures after the write and
//! declined cards; the `--no-inbox` control; and a run killed with SIGKILL part-way
//! (the built binary) and finished with `--resume`.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sagabox::demo::{DemoConfig, run};

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

/// Every invariant of the saga issue, each a query that counts violations.
const INVARIANTS: [(&str, &str); 9] = [
    (
        "order with more than one charge",
        "SELECT COUNT(*) FROM (SELECT order_id FROM payment_charges WHERE kind = 'charge' GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "order with more than one refund",
        "SELECT COUNT(*) FROM (SELECT order_id FROM payment_charges WHERE kind = 'refund' GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "order with more than one email",
        "SELECT COUNT(*) FROM (SELECT order_id FROM emails_sent GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "saga neither completed nor compensated",
        "SELECT COUNT(*) FROM saga_instances WHERE status NOT IN ('completed', 'compensated')",
    ),
    (
        "order without its saga",
        "SELECT COUNT(*) FROM demo_orders o WHERE NOT EXISTS (SELECT 1 FROM saga_instances s WHERE s.id = o.saga_id)",
    ),
    (
        "completed order without exactly one charge, no refund and one email",
        "SELECT COUNT(*) FROM demo_orders o JOIN saga_instances s ON s.id = o.saga_id WHERE s.status = 'completed' AND ( \
        (SELECT COUNT(*) FROM payment_charges c WHERE c.order_id = o.id AND c.kind = 'charge') <> 1 OR \
        (SELECT COUNT(*) FROM payment_charges c WHERE c.order_id = o.id AND c.kind = 'refund') <> 0 OR \
        (SELECT COUNT(*) FROM emails_sent e WHERE e.order_id = o.id) <> 1)",
    ),
    (
        "compensated order whose charges and refunds do not net to zero, or with an email",
        "SELECT COUNT(*) FROM demo_orders o JOIN saga_instances s ON s.id = o.saga_id WHERE s.status = 'compensated' AND ( \
        (SELECT COALESCE(SUM(CASE kind WHEN 'charge' THEN amount_cents ELSE -amount_cents END), 0) \
           FROM payment_charges c WHERE c.order_id = o.id) <> 0 OR \
        (SELECT COUNT(*) FROM emails_sent e WHERE e.order_id = o.id) <> 0)",
    ),
    (
        "sku whose stock is not initial minus the completed orders",
        "SELECT COUNT(*) FROM inventory i WHERE i.on_hand <> i.initial - COALESCE((SELECT SUM(o.quantity) \
        FROM demo_orders o JOIN saga_instances s ON s.id = o.saga_id WHERE o.sku = i.sku AND s.status = 'completed'), 0)",
    ),
    (
        "sku with negative stock",
        "SELECT COUNT(*) FROM inventory WHERE on_hand < 0",
    ),
];

macro_rules! demo_suite {
    ($backend:ident, $fixture:ty) => {
        mod $backend {
            use super::*;

            async fn assert_invariants(fx: &$fixture) {
                for (what, sql) in INVARIANTS {
                    assert_eq!(fx.scalar(sql).await, 0, "{what}");
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn thousands_of_orders_under_faults_keep_every_invariant() {
                let fx = <$fixture>::new().await;
                let summary = run(&fx.url, &faulty(2000)).await.unwrap();
                assert_eq!(summary.orders, 2000);
                assert_eq!(summary.unfinished, 0);
                assert_eq!(summary.completed + summary.compensated, 2000);
                assert!(summary.compensated > 100, "declines and stock-outs compensate: {summary:?}");
                assert_eq!(summary.damage(), 0, "{summary:?}");
                assert!(summary.retries > 0 && summary.duplicates_skipped > 0, "{summary:?}");
                assert_invariants(&fx).await;
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

            /// The built binary, killed with SIGKILL once part of its sagas are done, then
            /// `--resume`: every invariant holds.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_run_killed_part_way_then_resumed_keeps_every_invariant() {
                let fx = <$fixture>::new().await;
                let mut demo = Command::new(env!("CARGO_BIN_EXE_sagabox"))
                    .args([
                        "demo", "--database-url", &fx.url, "--orders", "3000", "--concurrency", "32",
                        "--duplicate-rate", "0.5", "--lost-reply-rate", "0.1", "--fail-rate", "0.1",
                        "--decline-rate", "0.05", "--seed", "9", "--json",
                    ])
                    .env_remove("DATABASE_URL")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap();
                let deadline = Instant::now() + Duration::from_secs(120);
                loop {
                    let done = sqlx::query_scalar::<_, i64>(
                        "SELECT COUNT(*) FROM saga_instances WHERE status IN ('completed', 'compensated')",
                    )
                    .fetch_one(&fx.pool)
                    .await
                    .unwrap_or(0);
                    if done >= 300 {
                        break;
                    }
                    assert!(demo.try_wait().unwrap().is_none(), "the demo ended before it could be killed");
                    assert!(Instant::now() < deadline, "the demo made no progress");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                demo.kill().unwrap(); // SIGKILL
                demo.wait().unwrap();
                let unfinished = fx.scalar("SELECT COUNT(*) FROM saga_instances WHERE status NOT IN ('completed', 'compensated')").await;
                assert!(unfinished > 0, "killed part-way");

                let resumed = Command::new(env!("CARGO_BIN_EXE_sagabox"))
                    .args(["demo", "--database-url", &fx.url, "--resume", "--json", "--seed", "10"])
                    .env_remove("DATABASE_URL")
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
