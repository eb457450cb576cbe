//! What the three participants share: reading the order from a command's payload, the
//! per-order lock, and [`on_both_databases!`], which writes a handler once for
//! PostgreSQL and SQLite.

use sagabox::Envelope;
use sagabox::step::StepError;
use serde_json::Value;

/// One order's commands run one at a time on PostgreSQL: a charge still running when
/// the orchestrator gave up on it must not interleave with its refund (each would miss
/// the other's uncommitted row). They have different message ids, so the inbox's per-key
/// lock does not order them. On SQLite every claim already holds the single write lock
/// (`BEGIN IMMEDIATE`) until it commits.
pub(crate) const LOCK_ORDER_POSTGRES: &str = "SELECT 1 FROM demo_orders WHERE id = $1 FOR UPDATE";

/// The payload's field `name`, refused for good when missing: sending the command again
/// cannot add it.
pub(crate) fn field<'a>(envelope: &'a Envelope, name: &str) -> Result<&'a Value, StepError> {
    envelope
        .payload
        .get(name)
        .ok_or_else(|| StepError::Permanent(format!("order payload has no {name:?}")))
}

/// The payload's text field `name`.
pub(crate) fn text(envelope: &Envelope, name: &str) -> Result<String, StepError> {
    field(envelope, name)?
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| StepError::Permanent(format!("{name} is not text")))
}

/// The payload's integer field `name`.
pub(crate) fn number(envelope: &Envelope, name: &str) -> Result<i64, StepError> {
    field(envelope, name)?
        .as_i64()
        .ok_or_else(|| StepError::Permanent(format!("{name} is not an integer")))
}

/// A database failure is transient as far as the step knows: the transaction rolls
/// back, nothing is recorded, and the command is sent again.
pub(crate) fn retryable(error: sqlx::Error) -> StepError {
    StepError::Retryable(error.to_string())
}

/// The refusal of a command kind a participant does not handle.
pub(crate) fn unknown(participant: &str, kind: &str) -> StepError {
    StepError::Permanent(format!(
        "the {participant} participant does not handle {kind:?}"
    ))
}

/// Implements [`StepHandler`](sagabox::step::StepHandler) for `$handler` on PostgreSQL
/// and SQLite with one body: `$conn` is the guard's transaction, `$envelope` the command,
/// `$order_id` its order, already locked on PostgreSQL. The statements use `$n`
/// placeholders, which both databases take.
macro_rules! on_both_databases {
    ($handler:ty, |$conn:ident, $envelope:ident, $order_id:ident| $body:block) => {
        $crate::order::on_both_databases!(@one $handler, sqlx::Postgres, Some($crate::order::LOCK_ORDER_POSTGRES),
            |$conn, $envelope, $order_id| $body);
        $crate::order::on_both_databases!(@one $handler, sqlx::Sqlite, None::<&'static str>,
            |$conn, $envelope, $order_id| $body);
    };
    (@one $handler:ty, $db:ty, $lock:expr, |$conn:ident, $envelope:ident, $order_id:ident| $body:block) => {
        impl sagabox::step::StepHandler<$db> for $handler {
            async fn handle(
                &self,
                $conn: &mut <$db as sqlx::Database>::Connection,
                $envelope: &sagabox::Envelope,
            ) -> Result<serde_json::Value, sagabox::step::StepError> {
                let $order_id = $crate::order::text($envelope, "order_id")?;
                if let Some(lock) = $lock {
                    sqlx::query(lock)
                        .bind(&$order_id)
                        .execute(&mut *$conn)
                        .await
                        .map_err($crate::order::retryable)?;
                }
                $body
            }
        }
    };
}

pub(crate) use on_both_databases;
