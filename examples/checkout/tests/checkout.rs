//! The checkout example's handlers and runner through the library alone, on a real
//! PostgreSQL: a refund that must wait for a charge still running, and a failed run
//! that leaves no actor behind.

#![allow(clippy::unwrap_used)]

#[path = "../../../tests/common/mod.rs"]
mod common;

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

/// PostgreSQL only (SQLite runs one writer at a time): the payment step gives up on a
/// charge that is still running (its timeout passes while the charge's transaction is
/// open) and the refund starts at once. The refund must see the charge — not refund 0
/// while the charge commits after it.
mod late_charge {
    use std::sync::Arc;

    use chrono::Utc;
    use ractor::Actor;
    use sagabox::orchestrator::{
        InProcess, Orchestrator, OrchestratorArguments, OrchestratorMessage,
    };
    use sagabox::saga::{SagaDefinition, SagaInsert, SagaInstance, SagaStore};
    use sagabox::step::{StepError, StepHandler, StepPool, StepPoolConfig};
    use sagabox::{Envelope, InboxConfig, InboxGuard};
    use sagabox_checkout::{CheckoutStep, POSTGRES_TABLES};
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
    struct SlowCharge(CheckoutStep);

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
            let handler = SlowCharge(CheckoutStep::of(step.consumer_type().as_str()).unwrap());
            let pool = StepPool::spawn(
                guard,
                step.consumer_type().clone(),
                handler,
                StepPoolConfig { workers: 2 },
            )
            .await
            .unwrap();
            dispatch = dispatch.with_pool(pool);
        }
        let store = fx.store(2).await;
        let (orchestrator, _) = Actor::spawn(
            None,
            Orchestrator::new(),
            OrchestratorArguments::new(definition, store.clone(), Arc::new(dispatch)),
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
        store.insert(&mut conn, &saga).await.unwrap();
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

/// A paced run places its orders no faster than its pace: ten orders at ten a second
/// take at least the nine gaps between them (unpaced, they finish in a fraction of that).
#[tokio::test]
async fn a_paced_run_places_its_orders_no_faster_than_its_pace() {
    let fx = common::Pg::new().await;
    let config = DemoConfig {
        orders: 10,
        pace: Some(10.0),
        ..DemoConfig::default()
    };
    let started = Instant::now();
    let summary = run(&fx.url, &config).await.unwrap();
    assert_eq!(summary.completed + summary.compensated, 10);
    assert!(
        started.elapsed() >= Duration::from_millis(900) && summary.elapsed_ms >= 900,
        "placed faster than 10 a second: {summary:?}"
    );
}

/// A participant takes a batch of its forward command as a set, in the batch's order
/// (the second decrement finds the stock the first one left, and is refused without a
/// write), and leaves a batch holding a compensation to be run one by one; the
/// `CheckoutStep` that names it passes both on.
#[tokio::test]
async fn a_batch_of_decrements_is_taken_as_a_set_in_its_order() {
    use sagabox::step::{StepError, StepHandler};
    use sagabox::{Envelope, MessageId};
    use sagabox_checkout::{CheckoutStep, POSTGRES_TABLES};
    use serde_json::json;

    let fx = common::Pg::new().await;
    sqlx::raw_sql(POSTGRES_TABLES)
        .execute(&fx.pool)
        .await
        .unwrap();
    fx.exec(
        "INSERT INTO demo_orders (id, saga_id, sku, quantity, amount_cents) VALUES \
         ('o-1', 's-1', 'A', 2, 100), ('o-2', 's-2', 'A', 2, 100); \
         INSERT INTO inventory (sku, initial, on_hand) VALUES ('A', 3, 3)",
    )
    .await;
    let decrement = |id: &str, order: &str| {
        let payload = json!({"order_id": order, "sku": "A", "quantity": 2});
        Envelope::new(MessageId::new(id).unwrap(), "decrement_stock", payload).unwrap()
    };
    let (first, second) = (decrement("d-1", "o-1"), decrement("d-2", "o-2"));
    let step = CheckoutStep::of("inventory").unwrap();
    let mut conn = fx.pool.acquire().await.unwrap();
    let answers = StepHandler::<sqlx::Postgres>::handle_batch(&step, &mut conn, &[&first, &second])
        .await
        .expect("decrements are taken as a set");
    assert_eq!(
        answers,
        [
            Ok(json!({"sku": "A", "taken": 2})),
            Err(StepError::Permanent("out of stock: A".into()))
        ]
    );
    let restock = Envelope::new(
        MessageId::new("r-1").unwrap(),
        "restock",
        json!({"order_id": "o-1", "sku": "A"}),
    )
    .unwrap();
    let mixed =
        StepHandler::<sqlx::Postgres>::handle_batch(&step, &mut conn, &[&restock, &second]).await;
    assert!(
        mixed.is_none(),
        "a batch with a compensation goes one by one"
    );
    drop(conn);
    assert_eq!(
        fx.scalar("SELECT on_hand FROM inventory WHERE sku = 'A'")
            .await,
        1
    );
    assert_eq!(
        fx.scalar("SELECT COUNT(*) FROM inventory_moves WHERE order_id = 'o-1' AND delta = -2")
            .await,
        1
    );
    assert_eq!(fx.scalar("SELECT COUNT(*) FROM inventory_moves").await, 1);
}

/// On PostgreSQL a batch's orders are found through the primary key, not by reading the
/// whole table: the planner guesses a set-returning function at a hundred rows and, on a
/// table of some thousands, would rather scan it than look a hundred keys up.
#[tokio::test]
async fn a_batchs_orders_are_found_through_the_index() {
    use sagabox_checkout::{OrderDb, POSTGRES_TABLES};

    let fx = common::Pg::new().await;
    sqlx::raw_sql(POSTGRES_TABLES)
        .execute(&fx.pool)
        .await
        .unwrap();
    fx.exec(
        "INSERT INTO demo_orders (id, saga_id, sku, quantity, amount_cents) \
         SELECT 'o-' || n, 's-' || n, 'A', 1, 100 FROM generate_series(1, 20000) n; \
         ANALYZE demo_orders",
    )
    .await;
    let explain = format!(
        "EXPLAIN SELECT 1 FROM demo_orders WHERE {}",
        <sqlx::Postgres as OrderDb>::json_in("id", "order_id")
    );
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
        .bind(r#"[{"order_id": "o-1"}, {"order_id": "o-2"}, {"order_id": "o-3"}]"#)
        .fetch_all(&fx.pool)
        .await
        .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("demo_orders_pkey"), "{plan}");
    assert!(!plan.contains("Seq Scan on demo_orders"), "{plan}");
}
