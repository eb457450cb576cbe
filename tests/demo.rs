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

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn thousands_of_orders_under_faults_keep_every_invariant() {
                let fx = <$fixture>::new().await;
                let summary = run(&fx.url, &faulty(2000)).await.unwrap();
                assert_eq!(summary.orders, 2000);
                assert_eq!(summary.unfinished, 0);
                assert_eq!(summary.completed + summary.compensated, 2000);
                assert!(summary.compensated > 100, "declines and stock-outs compensate: {summary:?}");
                assert_eq!(summary.damage(), 0, "{summary:?}");
                assert!(summary.retries > 0 && summary.duplicate_replies > 0, "{summary:?}");
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
                        "demo", "--database-url", &fx.url, "--orders", "3000", "--concurrency", "32",
                        "--duplicate-rate", "0.5", "--lost-reply-rate", "0.1", "--fail-rate", "0.1",
                        "--decline-rate", "0.05", "--seed", "9", "--json",
                    ])
                    .env_remove("DATABASE_URL").env_remove("SAGABOX_DATABASE_URL")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap();
                // The kill waits for an amount of work, never for a span of time: 300 of
                // the 3,000 sagas finished, whatever the build's speed.
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
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                assert!(common::chaos::kill(&mut demo), "the demo had ended before the kill");
                let placed = fx.scalar("SELECT COUNT(*) FROM demo_orders").await;
                let unfinished = fx.scalar("SELECT COUNT(*) FROM saga_instances WHERE status NOT IN ('completed', 'compensated')").await;
                assert!(placed < 3000 || unfinished > 0, "killed part-way: {placed} placed, {unfinished} unfinished");

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

/// PostgreSQL only (SQLite runs one writer at a time): the payment step gives up on a
/// charge that is still running (its timeout passes while the charge's transaction is
/// open) and the refund starts at once. The refund must see the charge — not refund 0
/// while the charge commits after it.
mod late_charge {
    use std::sync::Arc;

    use chrono::Utc;
    use ractor::Actor;
    use sagabox::demo::{Checkout, POSTGRES_TABLES};
    use sagabox::orchestrator::{
        DriveStats, InProcess, Orchestrator, OrchestratorArguments, OrchestratorMessage,
    };
    use sagabox::saga::{SagaDefinition, SagaInstance, SagaStore};
    use sagabox::step::{StepError, StepHandler, StepPool, StepPoolConfig};
    use sagabox::{Envelope, InboxConfig, InboxGuard};
    use serde_json::{Value, json};

    use super::*;

    const IMPATIENT: &str = r#"
name = "checkout"
[[steps]]
name = "payment"
consumer_type = "payment"
command = "charge"
compensation = "refund"
timeout = "50ms"
[steps.retry]
max_attempts = 1
[[steps]]
name = "email"
consumer_type = "email"
command = "send_confirmation"
timeout = "5s"
"#;

    /// The charge stays open for a while after writing.
    #[derive(Debug)]
    struct SlowCharge(Checkout);

    impl StepHandler<sqlx::Postgres> for SlowCharge {
        async fn handle(
            &self,
            conn: &mut sqlx::PgConnection,
            envelope: &Envelope,
        ) -> Result<Value, StepError> {
            let result = StepHandler::<sqlx::Postgres>::handle(&self.0, conn, envelope).await;
            if envelope.kind == "charge" {
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            result
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_refund_waits_for_a_charge_still_running() {
        let fx = common::Pg::new().await;
        sqlx::raw_sql(POSTGRES_TABLES)
            .execute(&fx.pool)
            .await
            .unwrap();
        let definition = Arc::new(SagaDefinition::from_toml_str(IMPATIENT).unwrap());
        let mut dispatch = InProcess::new();
        for step in definition.steps() {
            let guard = InboxGuard::new(fx.store(4).await, InboxConfig::default()).unwrap();
            let handler = SlowCharge(Checkout::new(0.0, 1));
            let pool = StepPool::spawn(
                guard,
                step.consumer_type().clone(),
                handler,
                StepPoolConfig {
                    workers: 2,
                    ..StepPoolConfig::default()
                },
            )
            .await
            .unwrap();
            dispatch = dispatch.with_pool(pool);
        }
        let store = fx.store(2).await;
        let (orchestrator, _) = Actor::spawn(
            None,
            Orchestrator::new(),
            OrchestratorArguments {
                definition,
                store: store.clone(),
                dispatch: Arc::new(dispatch),
                stats: Arc::new(DriveStats::default()),
            },
        )
        .await
        .unwrap();
        let order = json!({"order_id": "o-1", "sku": "sku-apple", "quantity": 1, "amount_cents": 500, "decline": false});
        sqlx::query("INSERT INTO demo_orders (id, saga_id, sku, quantity, amount_cents) VALUES ('o-1', 's-1', 'sku-apple', 1, 500)")
            .execute(&fx.pool)
            .await
            .unwrap();
        let saga = SagaInstance::new("s-1", "checkout", order, Utc::now());
        let mut conn = store.pool().acquire().await.unwrap();
        <sagabox::PostgresStore as SagaStore>::insert(&mut conn, &saga)
            .await
            .unwrap();
        drop(conn);

        ractor::call_t!(
            orchestrator,
            OrchestratorMessage::Run,
            30_000,
            "s-1".to_owned()
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            store.load("s-1").await.unwrap().unwrap().status.as_str(),
            "compensated"
        );
        // Wait for the slow charge to finish: both payment commands on record.
        let deadline = Instant::now() + Duration::from_secs(10);
        while fx
            .scalar("SELECT COUNT(*) FROM sagabox_inbox WHERE consumer_type = 'payment'")
            .await
            < 2
        {
            assert!(Instant::now() < deadline, "the charge never finished");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let net = fx
            .scalar("SELECT CAST(COALESCE(SUM(CASE kind WHEN 'charge' THEN amount_cents ELSE -amount_cents END), 0) AS BIGINT) FROM payment_charges")
            .await;
        assert_eq!(net, 0, "charged and not refunded");
        orchestrator.stop(None);
    }
}

/// A run that fails part-way leaves no actor behind: its pruner, on a clock a million
/// times fast, would otherwise go on creating months in the database after `run`
/// returned the error.
mod failed_run {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_that_fails_stops_its_pruner() {
        let fx = common::Pg::new().await;
        // A `demo_run` the demo cannot write its size to: the run fails after the pruner
        // has started.
        fx.exec("CREATE TABLE demo_run (unrelated INTEGER)").await;
        let newest = async || {
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT MAX(c.relname::text) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                 WHERE i.inhparent = 'sagabox_inbox'::regclass",
            )
            .fetch_one(&fx.pool)
            .await
            .unwrap()
        };
        let config = DemoConfig {
            clock_speed: 1e6,
            ..faulty(10)
        };
        let error = run(&fx.url, &config).await.unwrap_err();
        assert!(error.to_string().contains("orders"), "{error}");
        let after_error = newest().await;
        // 4 s at a million times is 46 days: a live pruner would have added a month.
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(
            newest().await,
            after_error,
            "the pruner outlived the failed run"
        );
    }
}
