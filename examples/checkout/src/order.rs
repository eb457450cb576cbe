//! What the three participants share: reading the order from a command's payload, and
//! the per-order lock of the databases that need one ([`OrderDb`]), so that each
//! handler is written once, generic over the database.

use sagabox::Envelope;
use sagabox::step::StepError;
use serde_json::Value;
use sqlx::{Encode, Executor, IntoArguments, Type};

/// One order's commands run one at a time on PostgreSQL: a charge still running when
/// the orchestrator gave up on it must not interleave with its refund (each would miss
/// the other's uncommitted row). They have different message ids, so the inbox's per-key
/// lock does not order them. On SQLite every claim already holds the single write lock
/// (`BEGIN IMMEDIATE`) until it commits.
pub(crate) const LOCK_ORDER_POSTGRES: &str = "SELECT 1 FROM demo_orders WHERE id = $1 FOR UPDATE";

/// A database the participants run on: the statement that locks an order, if it needs
/// one.
pub trait OrderDb: sqlx::Database {
    /// The statement that locks order `$1` until the transaction ends, where
    /// commands of one order could otherwise interleave.
    const LOCK_ORDER: Option<&'static str>;
}

impl OrderDb for sqlx::Postgres {
    const LOCK_ORDER: Option<&'static str> = Some(LOCK_ORDER_POSTGRES);
}

impl OrderDb for sqlx::Sqlite {
    const LOCK_ORDER: Option<&'static str> = None;
}

/// Reads the command's order and, where the database needs it, locks the order until
/// the transaction ends. Returns the order's id.
pub(crate) async fn lock<DB>(
    conn: &mut DB::Connection,
    envelope: &Envelope,
) -> Result<String, StepError>
where
    DB: OrderDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
{
    let order_id = text(envelope, "order_id")?;
    if let Some(lock) = DB::LOCK_ORDER {
        sqlx::query(lock)
            .bind(order_id.as_str())
            .execute(&mut *conn)
            .await
            .map_err(retryable)?;
    }
    Ok(order_id)
}

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
