//! The payment participant: `charge` and its compensation `refund`, in
//! `payment_charges` (an append-only ledger: the inbox is what keeps it exact).

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::{Value, json};
use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Type};

use crate::order::{self, OrderDb, retryable};

/// The consumer type the payment step deduplicates as, and its queue's suffix.
pub const CONSUMER: &str = "payment";
/// The command that charges the order's `amount_cents`.
pub const CHARGE: &str = "charge";
/// The compensation that refunds what was charged.
pub const REFUND: &str = "refund";

/// Charges and refunds orders. A declined card (`"decline": true` in the payload) is a
/// permanent failure, which compensates the saga. Answers `{"charged_cents": n}` and
/// `{"refunded_cents": n}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Payment;

impl<DB: OrderDb> StepHandler<DB> for Payment
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
            CHARGE => {
                if envelope
                    .payload
                    .get("decline")
                    .and_then(serde_json::Value::as_bool)
                    == Some(true)
                {
                    return Err(StepError::Permanent("card declined".into()));
                }
                // A charge that arrives after its refund (a late retry) must not land.
                let refunded: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM payment_charges WHERE order_id = $1 AND kind = 'refund'",
                )
                .bind(order_id.as_str())
                .fetch_one(&mut *conn)
                .await
                .map_err(retryable)?;
                if refunded > 0 {
                    return Err(StepError::Permanent("order cancelled".into()));
                }
                let amount = order::number(envelope, "amount_cents")?;
                sqlx::query(
                    "INSERT INTO payment_charges (order_id, amount_cents, kind) VALUES ($1, $2, 'charge')",
                )
                .bind(order_id.as_str())
                .bind(amount)
                .execute(&mut *conn)
                .await
                .map_err(retryable)?;
                Ok(json!({ "charged_cents": amount }))
            }
            REFUND => {
                let charged: i64 = sqlx::query_scalar(
                    "SELECT CAST(COALESCE(SUM(amount_cents), 0) AS BIGINT) FROM payment_charges \
                     WHERE order_id = $1 AND kind = 'charge'",
                )
                .bind(order_id.as_str())
                .fetch_one(&mut *conn)
                .await
                .map_err(retryable)?;
                // Always leave a refund row (0 when nothing was charged): it also blocks a
                // charge that arrives late.
                sqlx::query(
                    "INSERT INTO payment_charges (order_id, amount_cents, kind) VALUES ($1, $2, 'refund')",
                )
                .bind(order_id.as_str())
                .bind(charged)
                .execute(&mut *conn)
                .await
                .map_err(retryable)?;
                Ok(json!({ "refunded_cents": charged }))
            }
            other => Err(order::unknown(CONSUMER, other)),
        }
    }

    /// A batch of charges with three statements, whatever its size: the orders locked,
    /// the refunds among them read, the charges inserted. A batch holding anything else
    /// goes one by one.
    async fn handle_batch(
        &self,
        conn: &mut DB::Connection,
        envelopes: &[&Envelope],
    ) -> Option<Vec<Result<Value, StepError>>> {
        order::as_set(envelopes, CHARGE, charge_all::<DB>(conn, envelopes)).await
    }
}

/// Charges a batch as [`Payment::handle`] charges each: a declined card or a refunded
/// order is refused, and writes nothing.
async fn charge_all<DB: OrderDb>(
    conn: &mut DB::Connection,
    envelopes: &[&Envelope],
) -> Result<Vec<Result<Value, StepError>>, StepError>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    let order_ids = order::order_ids(envelopes);
    order::lock_all::<DB>(conn, &order_ids).await?;
    let refunded = order::having::<DB>(conn, &order_ids, "payment_charges", "refund").await?;
    let mut charges = Vec::new();
    let answers = envelopes
        .iter()
        .zip(order_ids)
        .map(|(envelope, order_id)| {
            let order_id = order_id?;
            if envelope.payload.get("decline").and_then(Value::as_bool) == Some(true) {
                return Err(StepError::Permanent("card declined".into()));
            }
            if refunded.contains(&order_id) {
                return Err(StepError::Permanent("order cancelled".into()));
            }
            let amount = order::number(envelope, "amount_cents")?;
            charges.push(json!({ "order_id": order_id, "amount_cents": amount }));
            Ok(json!({ "charged_cents": amount }))
        })
        .collect();
    let insert = format!(
        "INSERT INTO payment_charges (order_id, amount_cents, kind) \
         SELECT x.order_id, x.amount_cents, 'charge' FROM {}",
        DB::json_rows(&[("order_id", "text"), ("amount_cents", "bigint")])
    );
    order::execute_rows::<DB>(conn, insert, charges).await?;
    Ok(answers)
}
