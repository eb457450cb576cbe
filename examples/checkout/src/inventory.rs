//! The inventory participant: `decrement_stock` and its compensation `restock`, on the
//! `inventory` counter with every move in `inventory_moves` (neither is idempotent: the
//! inbox is what keeps them exact).

use sagabox::step::StepError;
use serde_json::json;

use crate::order::{self, on_both_databases, retryable};

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

on_both_databases!(Inventory, |conn, envelope, order_id| {
    match envelope.kind.as_str() {
        DECREMENT => {
            // A decrement that arrives after its restock (a late retry) must not land.
            let restocked: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM inventory_moves WHERE order_id = $1 AND kind = 'restock'",
            )
            .bind(&order_id)
            .fetch_one(&mut *conn)
            .await
            .map_err(retryable)?;
            if restocked > 0 {
                return Err(StepError::Permanent("order cancelled".into()));
            }
            let sku = order::text(envelope, "sku")?;
            let quantity = order::number(envelope, "quantity")?;
            let taken = sqlx::query(
                "UPDATE inventory SET on_hand = on_hand - $1 WHERE sku = $2 AND on_hand >= $1",
            )
            .bind(quantity)
            .bind(&sku)
            .execute(&mut *conn)
            .await
            .map_err(retryable)?
            .rows_affected();
            if taken == 0 {
                return Err(StepError::Permanent(format!("out of stock: {sku}")));
            }
            sqlx::query(
                "INSERT INTO inventory_moves (order_id, sku, delta, kind) VALUES ($1, $2, $3, 'decrement')",
            )
            .bind(&order_id)
            .bind(&sku)
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
            .bind(&order_id)
            .fetch_one(&mut *conn)
            .await
            .map_err(retryable)?;
            sqlx::query("UPDATE inventory SET on_hand = on_hand + $1 WHERE sku = $2")
                .bind(taken)
                .bind(&sku)
                .execute(&mut *conn)
                .await
                .map_err(retryable)?;
            // Always leave a restock row: it also blocks a late decrement.
            sqlx::query(
                "INSERT INTO inventory_moves (order_id, sku, delta, kind) VALUES ($1, $2, $3, 'restock')",
            )
            .bind(&order_id)
            .bind(&sku)
            .bind(taken)
            .execute(&mut *conn)
            .await
            .map_err(retryable)?;
            Ok(json!({ "sku": sku, "returned": taken }))
        }
        other => Err(order::unknown(CONSUMER, other)),
    }
});
