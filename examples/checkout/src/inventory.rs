//! The inventory participant: `decrement_stock` and its compensation `restock`, on the
//! `inventory` counter with every move in `inventory_moves` (neither is idempotent: the
//! inbox is what keeps them exact).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, ColumnIndex, Decode, Encode, Executor, IntoArguments, Type};

use crate::order::{self, OrderDb, retryable};

/// The consumer type the inventory step deduplicates as, and its queue's suffix.
pub const CONSUMER: &str = "inventory";
/// The command that takes the order's `quantity` of its `sku` from stock.
pub const DECREMENT: &str = "decrement_stock";
/// The compensation that returns what was taken.
pub const RESTOCK: &str = "restock";

/// Takes and returns stock. Too little stock is a permanent failure, which compensates
/// the saga. Answers `{"sku": …, "taken": n}` and `{"sku": …, "returned": n}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Inventory;

impl<DB: OrderDb> StepHandler<DB> for Inventory
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Decode<'t, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    async fn handle(
        &self,
        conn: &mut DB::Connection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let order_id = order::lock::<DB>(conn, envelope).await?;
        match envelope.kind.as_str() {
            DECREMENT => {
                // A decrement that arrives after its restock (a late retry) must not land.
                let restocked: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM inventory_moves WHERE order_id = $1 AND kind = 'restock'",
                )
                .bind(order_id.as_str())
                .fetch_one(&mut *conn)
                .await
                .map_err(retryable)?;
                if restocked > 0 {
                    return Err(StepError::Permanent("order cancelled".into()));
                }
                let sku = order::text(envelope, "sku")?;
                let quantity = order::number(envelope, "quantity")?;
                // RETURNING rather than the rows affected, which sqlx reports per database.
                let taken: Option<i64> = sqlx::query_scalar(
                    "UPDATE inventory SET on_hand = on_hand - $1 WHERE sku = $2 AND on_hand >= $1 \
                 RETURNING on_hand",
                )
                .bind(quantity)
                .bind(sku.as_str())
                .fetch_optional(&mut *conn)
                .await
                .map_err(retryable)?;
                if taken.is_none() {
                    return Err(StepError::Permanent(format!("out of stock: {sku}")));
                }
                sqlx::query(
                    "INSERT INTO inventory_moves (order_id, sku, delta, kind) VALUES ($1, $2, $3, 'decrement')",
                )
                .bind(order_id.as_str())
                .bind(sku.as_str())
                .bind(-quantity)
                .execute(&mut *conn)
                .await
                .map_err(retryable)?;
                Ok(json!({ "sku": sku, "taken": quantity }))
            }
            RESTOCK => {
                let sku = order::text(envelope, "sku")?;
                let taken: i64 = sqlx::query_scalar(
                    "SELECT CAST(COALESCE(-SUM(delta), 0) AS BIGINT) FROM inventory_moves \
                     WHERE order_id = $1 AND kind = 'decrement'",
                )
                .bind(order_id.as_str())
                .fetch_one(&mut *conn)
                .await
                .map_err(retryable)?;
                sqlx::query("UPDATE inventory SET on_hand = on_hand + $1 WHERE sku = $2")
                    .bind(taken)
                    .bind(sku.as_str())
                    .execute(&mut *conn)
                    .await
                    .map_err(retryable)?;
                // Always leave a restock row: it also blocks a late decrement.
                sqlx::query(
                    "INSERT INTO inventory_moves (order_id, sku, delta, kind) VALUES ($1, $2, $3, 'restock')",
                )
                .bind(order_id.as_str())
                .bind(sku.as_str())
                .bind(taken)
                .execute(&mut *conn)
                .await
                .map_err(retryable)?;
                Ok(json!({ "sku": sku, "returned": taken }))
            }
            other => Err(order::unknown(CONSUMER, other)),
        }
    }

    /// A batch of decrements with five statements, whatever its size: the orders
    /// locked, the restocks among them read, the stock of their skus read and locked,
    /// then taken in the batch's order, and every move inserted. A batch holding
    /// anything else goes one by one.
    async fn handle_batch(
        &self,
        conn: &mut DB::Connection,
        envelopes: &[&Envelope],
    ) -> Option<Vec<Result<Value, StepError>>> {
        order::as_set(envelopes, DECREMENT, decrement_all::<DB>(conn, envelopes)).await
    }
}

/// One decrement of a batch, once its order and payload passed.
struct Take {
    order_id: String,
    sku: String,
    quantity: i64,
}

/// Decrements a batch as [`Inventory::handle`] decrements each, in the batch's order: a
/// restocked order, or a sku with too little left, is refused and takes nothing.
async fn decrement_all<DB: OrderDb>(
    conn: &mut DB::Connection,
    envelopes: &[&Envelope],
) -> Result<Vec<Result<Value, StepError>>, StepError>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Decode<'t, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    let order_ids = order::order_ids(envelopes);
    order::lock_all::<DB>(conn, &order_ids).await?;
    let restocked = order::having::<DB>(conn, &order_ids, "inventory_moves", "restock").await?;
    let takes: Vec<Result<Take, StepError>> = envelopes
        .iter()
        .zip(order_ids)
        .map(|(envelope, order_id)| {
            let order_id = order_id?;
            if restocked.contains(&order_id) {
                return Err(StepError::Permanent("order cancelled".into()));
            }
            Ok(Take {
                order_id,
                sku: order::text(envelope, "sku")?,
                quantity: order::number(envelope, "quantity")?,
            })
        })
        .collect();
    let skus: BTreeSet<&str> = takes
        .iter()
        .filter_map(|take| take.as_ref().ok().map(|take| take.sku.as_str()))
        .collect();
    let sku_rows: Vec<Value> = skus.iter().map(|sku| json!({ "sku": sku })).collect();
    // Sorted by sku: two batches lock their skus in one order.
    let read = format!(
        "SELECT sku, on_hand FROM inventory WHERE {} ORDER BY sku{}",
        DB::json_in("sku", "sku"),
        DB::FOR_UPDATE
    );
    let mut on_hand: HashMap<String, i64> = sqlx::query_as(AssertSqlSafe(read))
        .bind(Value::Array(sku_rows).to_string().as_str())
        .fetch_all(&mut *conn)
        .await
        .map_err(retryable)?
        .into_iter()
        .collect();
    let mut taken: BTreeMap<&str, i64> = BTreeMap::new();
    let mut moves = Vec::new();
    let answers = takes
        .iter()
        .map(|take| {
            let take = take.as_ref().map_err(Clone::clone)?;
            match on_hand.get_mut(&take.sku) {
                Some(left) if *left >= take.quantity => {
                    *left -= take.quantity;
                    *taken.entry(take.sku.as_str()).or_default() += take.quantity;
                    moves.push(json!({
                        "order_id": take.order_id, "sku": take.sku, "delta": -take.quantity,
                    }));
                    Ok(json!({ "sku": take.sku, "taken": take.quantity }))
                }
                _ => Err(StepError::Permanent(format!("out of stock: {}", take.sku))),
            }
        })
        .collect();
    let taken: Vec<Value> = taken
        .into_iter()
        .map(|(sku, quantity)| json!({ "sku": sku, "taken": quantity }))
        .collect();
    let update = format!(
        "UPDATE inventory SET on_hand = inventory.on_hand - x.taken FROM {} \
         WHERE inventory.sku = x.sku AND {}",
        DB::json_rows(&[("sku", "text"), ("taken", "bigint")]),
        DB::json_in("inventory.sku", "sku")
    );
    order::execute_rows::<DB>(conn, update, taken).await?;
    let insert = format!(
        "INSERT INTO inventory_moves (order_id, sku, delta, kind) \
         SELECT x.order_id, x.sku, x.delta, 'decrement' FROM {}",
        DB::json_rows(&[("order_id", "text"), ("sku", "text"), ("delta", "bigint")])
    );
    order::execute_rows::<DB>(conn, insert, moves).await?;
    Ok(answers)
}
