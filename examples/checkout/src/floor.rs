//! The checkout saga written by hand in plain SQL on PostgreSQL — no actor, no broker, no
//! guard — as the floor that `sagabox bench-saga` measures the demo's saga against, on the
//! same tables ([`run_floor`]).
//!
//! Per order, as little as a hand-written saga that keeps its guarantees can commit:
//! - one transaction places the order and inserts its saga (`sagabox_saga_instances`);
//! - per step, one participant transaction: the inbox row (`INSERT … ON CONFLICT DO
//!   NOTHING` into `sagabox_inbox`), the order's lock and the step's business statements,
//!   as the demo's handlers run them;
//! - per step, one orchestrator transaction: the saga's `UPDATE`.
//!
//! An order out of stock is compensated (its charge refunded), as the demo's saga does;
//! with the demo's seed the orders, and so the share of them compensated, are the demo's.
//! Nothing retries: nothing here fails but the database itself.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rand::SeedableRng;
use rand::rngs::StdRng;
use sagabox::Month;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use crate::runner::{DemoDb, Order};
use crate::{DemoConfig, DemoError};

/// The saga name of the floor's rows in `sagabox_saga_instances`.
pub const FLOOR_SAGA: &str = "checkout-floor";

/// What a floor run did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FloorSummary {
    /// Sagas run.
    pub sagas: usize,
    /// Sagas completed (charged, decremented, emailed).
    pub completed: usize,
    /// Sagas compensated (out of stock: refunded).
    pub compensated: usize,
    /// Wall time from the first order placed to the last saga finished.
    pub elapsed_ms: u64,
    /// Sagas finished per second.
    pub sagas_per_sec: f64,
}

/// Runs `config.orders` checkout sagas by hand on the PostgreSQL database at `url`, at
/// most `config.concurrency` in flight (and at `config.pace` orders per second at most),
/// with the orders of `config.seed`. Resets the demo's tables first, as the demo does;
/// the inbox and saga tables must exist (`sagabox migrate`).
pub async fn run_floor(url: &str, config: &DemoConfig) -> Result<FloorSummary, DemoError> {
    config.validate()?;
    let connections = u32::try_from(config.concurrency.clamp(4, 64)).unwrap_or(16);
    let pool = sagabox::PostgresStore::connect(url, connections)
        .await?
        .pool()
        .clone();
    let schema = &config.schema;
    // The demo's own set-up: its tables, emptied, the stock for this many orders.
    let fresh = DemoConfig {
        resume: false,
        ..config.clone()
    };
    <sqlx::Postgres as DemoDb>::prepare(&pool, schema, &fresh, url).await?;
    sqlx::query(AssertSqlSafe(schema.sql(
        "DELETE FROM {schema}.sagabox_saga_instances WHERE saga_name = $1",
    )))
    .bind(FLOOR_SAGA)
    .execute(&pool)
    .await?;

    let sql = Arc::new(FloorSql::new(schema));
    let permits = Arc::new(tokio::sync::Semaphore::new(config.concurrency));
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut running = tokio::task::JoinSet::new();
    let started = Instant::now();
    let placing_since = tokio::time::Instant::now();
    let (mut completed, mut compensated) = (0, 0);
    let mut tally = |done: Result<Result<bool, sqlx::Error>, tokio::task::JoinError>| {
        match done.map_err(|e| DemoError::Actor(e.to_string()))?? {
            true => completed += 1,
            false => compensated += 1,
        }
        Ok::<_, DemoError>(())
    };
    for placed in 0..config.orders {
        if let Some(pace) = config.pace {
            let due = Duration::from_secs_f64(placed as f64 / pace);
            tokio::time::sleep_until(placing_since + due).await;
        }
        while let Some(done) = running.try_join_next() {
            tally(done)?;
        }
        let permit = Arc::clone(&permits)
            .acquire_owned()
            .await
            .map_err(|e| DemoError::Actor(e.to_string()))?;
        let order = Order::random(&mut rng, 0.0);
        let (pool, sql) = (pool.clone(), Arc::clone(&sql));
        running.spawn(async move {
            let done = saga(&pool, &sql, order).await;
            drop(permit);
            done
        });
    }
    while let Some(done) = running.join_next().await {
        tally(done)?;
    }
    let elapsed = started.elapsed();
    pool.close().await;
    Ok(FloorSummary {
        sagas: config.orders,
        completed,
        compensated,
        elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        sagas_per_sec: config.orders as f64 / elapsed.as_secs_f64().max(1e-9),
    })
}

/// The floor's statements on sagabox's tables, with the schema filled in.
struct FloorSql {
    insert_saga: String,
    save_saga: String,
    claim: String,
}

impl FloorSql {
    fn new(schema: &sagabox::Schema) -> Self {
        Self {
            insert_saga: schema.sql(
                "INSERT INTO {schema}.sagabox_saga_instances \
                 (id, saga_name, status, current_step, data, created_at, updated_at) \
                 VALUES ($1, $2, 'running', 0, $3, $4, $4)",
            ),
            save_saga: schema.sql(
                "UPDATE {schema}.sagabox_saga_instances \
                 SET status = $2, current_step = $3, updated_at = $4, \
                 finished_at = CASE WHEN $2 IN ('completed', 'compensated') THEN $4 END, \
                 version = version + 1 \
                 WHERE id = $1",
            ),
            claim: schema.sql(
                "INSERT INTO {schema}.sagabox_inbox \
                 (consumer_type, message_id, bucket, processed_at, result) \
                 VALUES ($1, $2, $3, $4, 'null'::jsonb) ON CONFLICT DO NOTHING",
            ),
        }
    }
}

/// One order's saga from start to end; `true` if it completed, `false` if compensated.
async fn saga(pool: &PgPool, sql: &FloorSql, order: Order) -> Result<bool, sqlx::Error> {
    let saga_id = uuid::Uuid::now_v7().to_string();
    let text = |name: &str| order.data[name].as_str().unwrap_or_default().to_owned();
    let number = |name: &str| order.data[name].as_i64().unwrap_or_default();
    let (order_id, sku) = (text("order_id"), text("sku"));
    let (quantity, amount) = (number("quantity"), number("amount_cents"));
    place(pool, sql, &saga_id, &order, (&sku, quantity, amount)).await?;

    let step = |consumer: &'static str, kind: &'static str| Step {
        sql,
        consumer,
        message_id: format!("{saga_id}:{kind}"),
        order_id: &order_id,
    };
    step("payment", "charge")
        .run(pool, async |conn| {
            let refunded: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM payment_charges WHERE order_id = $1 AND kind = 'refund'",
            )
            .bind(&order_id)
            .fetch_one(&mut *conn)
            .await?;
            if refunded == 0 {
                sqlx::query(
                    "INSERT INTO payment_charges (order_id, amount_cents, kind) \
                     VALUES ($1, $2, 'charge')",
                )
                .bind(&order_id)
                .bind(amount)
                .execute(&mut *conn)
                .await?;
            }
            Ok(true)
        })
        .await?;
    save(pool, sql, &saga_id, "running", 1).await?;

    let taken = step("inventory", "decrement")
        .run(pool, async |conn| {
            let _restocked: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM inventory_moves WHERE order_id = $1 AND kind = 'restock'",
            )
            .bind(&order_id)
            .fetch_one(&mut *conn)
            .await?;
            let taken: Option<i64> = sqlx::query_scalar(
                "UPDATE inventory SET on_hand = on_hand - $1 WHERE sku = $2 AND on_hand >= $1 \
                 RETURNING on_hand",
            )
            .bind(quantity)
            .bind(&sku)
            .fetch_optional(&mut *conn)
            .await?;
            if taken.is_some() {
                sqlx::query(
                    "INSERT INTO inventory_moves (order_id, sku, delta, kind) \
                     VALUES ($1, $2, $3, 'decrement')",
                )
                .bind(&order_id)
                .bind(&sku)
                .bind(-quantity)
                .execute(&mut *conn)
                .await?;
            }
            Ok(taken.is_some())
        })
        .await?;
    if !taken {
        save(pool, sql, &saga_id, "compensating", 0).await?;
        step("payment", "refund")
            .run(pool, async |conn| refund(conn, &order_id).await)
            .await?;
        save(pool, sql, &saga_id, "compensated", -1).await?;
        return Ok(false);
    }
    save(pool, sql, &saga_id, "running", 2).await?;

    step("email", "send_confirmation")
        .run(pool, async |conn| {
            sqlx::query("INSERT INTO emails_sent (order_id, template) VALUES ($1, 'confirmation')")
                .bind(&order_id)
                .execute(&mut *conn)
                .await?;
            Ok(true)
        })
        .await?;
    save(pool, sql, &saga_id, "completed", 3).await?;
    Ok(true)
}

/// Starts a saga: the order (`sku`, quantity, amount) and its saga row, in one
/// transaction.
async fn place(
    pool: &PgPool,
    sql: &FloorSql,
    saga_id: &str,
    order: &Order,
    (sku, quantity, amount): (&str, i64, i64),
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO demo_orders (id, saga_id, sku, quantity, amount_cents) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(order.data["order_id"].as_str().unwrap_or_default())
    .bind(saga_id)
    .bind(sku)
    .bind(quantity)
    .bind(amount)
    .execute(&mut *tx)
    .await?;
    sqlx::query(AssertSqlSafe(sql.insert_saga.as_str()))
        .bind(saga_id)
        .bind(FLOOR_SAGA)
        .bind(sqlx::types::Json(&order.data))
        .bind(Utc::now())
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// The payment's compensation: refunds what `order_id` was charged.
async fn refund(conn: &mut PgConnection, order_id: &str) -> Result<bool, sqlx::Error> {
    let charged: i64 = sqlx::query_scalar(
        "SELECT CAST(COALESCE(SUM(amount_cents), 0) AS BIGINT) FROM payment_charges \
         WHERE order_id = $1 AND kind = 'charge'",
    )
    .bind(order_id)
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO payment_charges (order_id, amount_cents, kind) \
         VALUES ($1, $2, 'refund')",
    )
    .bind(order_id)
    .bind(charged)
    .execute(&mut *conn)
    .await?;
    Ok(true)
}

/// One participant's transaction for one command.
struct Step<'a> {
    sql: &'a FloorSql,
    consumer: &'static str,
    message_id: String,
    order_id: &'a str,
}

impl Step<'_> {
    /// Claims the command in the inbox and, if it is new, takes the order's lock and runs
    /// `apply`, all in one transaction. A duplicate (none happen here) answers `true`
    /// without applying.
    async fn run(
        self,
        pool: &PgPool,
        apply: impl AsyncFnOnce(&mut PgConnection) -> Result<bool, sqlx::Error>,
    ) -> Result<bool, sqlx::Error> {
        let now = Utc::now();
        let bucket = Month::of(now).map_or_else(|_| now.date_naive(), Month::first_day);
        let mut tx = pool.begin().await?;
        let claimed = sqlx::query(AssertSqlSafe(self.sql.claim.as_str()))
            .bind(self.consumer)
            .bind(&self.message_id)
            .bind(bucket)
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        let outcome = if claimed == 1 {
            sqlx::query(crate::order::LOCK_ORDER_POSTGRES)
                .bind(self.order_id)
                .execute(&mut *tx)
                .await?;
            apply(&mut tx).await?
        } else {
            true
        };
        tx.commit().await?;
        Ok(outcome)
    }
}

/// The orchestrator's save of a saga's progress.
async fn save(
    pool: &PgPool,
    sql: &FloorSql,
    saga_id: &str,
    status: &str,
    step: i32,
) -> Result<(), sqlx::Error> {
    let now: DateTime<Utc> = Utc::now();
    sqlx::query(AssertSqlSafe(sql.save_saga.as_str()))
        .bind(saga_id)
        .bind(status)
        .bind(step)
        .bind(now)
        .execute(pool)
        .await?;
    Ok(())
}
