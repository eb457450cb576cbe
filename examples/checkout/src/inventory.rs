//! The inventory participant: `decrement_stock` and its compensation `restock`, on the
//! `inventory` counter with every move in `inventory_moves` (neither is idempotent: the
//! inbox is what keeps them exact).

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::{Value, json};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Type};

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
}
