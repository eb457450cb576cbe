//! What the three participants share: reading the order from a command's payload, and
//! the per-order lock of the databases that need one ([`OrderDb`]), so that each
//! handler is written once, generic over the database.

use std::collections::{BTreeSet, HashSet};
use std::future::Future;

use sagabox::Envelope;
use sagabox::step::StepError;
use serde_json::Value;
use sqlx::{AssertSqlSafe, ColumnIndex, Decode, Encode, Executor, IntoArguments, Type};

/// One order's commands run one at a time on PostgreSQL: a charge still running when
/// the orchestrator gave up on it must not interleave with its refund (each would miss
/// the other's uncommitted row). They have different message ids, so the inbox's per-key
/// lock does not order them. On SQLite every claim already holds the single write lock
/// (`BEGIN IMMEDIATE`) until it commits.
pub(crate) const LOCK_ORDER_POSTGRES: &str = "SELECT 1 FROM demo_orders WHERE id = $1 FOR UPDATE";

/// A database the participants run on: the statement that locks an order, if it needs
/// one, and how a batch's rows reach a statement (a JSON array bound as `$1`).
pub trait OrderDb: sqlx::Database {
    /// The statement that locks order `$1` until the transaction ends, where
    /// commands of one order could otherwise interleave.
    const LOCK_ORDER: Option<&'static str>;
    /// What a `SELECT` adds to lock the rows it reads until the transaction ends, where
    /// they could otherwise change under it.
    const FOR_UPDATE: &'static str;

    /// `$1`, a JSON array of objects, as a table `x` of `columns` (name, SQL type).
    fn json_rows(columns: &[(&str, &str)]) -> String;

    /// The condition that `column` is one of the text fields `field` of `$1`'s objects,
    /// in a form the planner takes through `column`'s index.
    fn json_in(column: &str, field: &str) -> String;
}

impl OrderDb for sqlx::Postgres {
    const LOCK_ORDER: Option<&'static str> = Some(LOCK_ORDER_POSTGRES);
    const FOR_UPDATE: &'static str = " FOR UPDATE";

    fn json_rows(columns: &[(&str, &str)]) -> String {
        let columns: Vec<String> = columns
            .iter()
            .map(|(name, sql_type)| format!("{name} {sql_type}"))
            .collect();
        format!(
            "jsonb_to_recordset(CAST($1 AS jsonb)) AS x({})",
            columns.join(", ")
        )
    }

    // `= ANY` of an array, not `IN` of the rows: the planner guesses a hundred rows for
    // a set-returning function and, on a table of a few thousand rows, reads all of
    // them (a hash join) rather than the index.
    fn json_in(column: &str, field: &str) -> String {
        format!(
            "{column} = ANY(ARRAY(SELECT x.{field} FROM \
             jsonb_to_recordset(CAST($1 AS jsonb)) AS x({field} text)))"
        )
    }
}

impl OrderDb for sqlx::Sqlite {
    const LOCK_ORDER: Option<&'static str> = None;
    // Every claim holds the database's one write lock until it commits.
    const FOR_UPDATE: &'static str = "";

    fn json_rows(columns: &[(&str, &str)]) -> String {
        let columns: Vec<String> = columns
            .iter()
            .map(|(name, _)| format!("json_extract(value, '$.{name}') AS {name}"))
            .collect();
        format!("(SELECT {} FROM json_each($1)) AS x", columns.join(", "))
    }

    fn json_in(column: &str, field: &str) -> String {
        format!("{column} IN (SELECT json_extract(value, '$.{field}') FROM json_each($1))")
    }
}

/// Each command's order id, or the refusal of a command without one.
pub(crate) fn order_ids(envelopes: &[&Envelope]) -> Vec<Result<String, StepError>> {
    envelopes
        .iter()
        .map(|envelope| text(envelope, "order_id"))
        .collect()
}

/// The ids among `order_ids`, as the JSON rows of a batch statement (`{"order_id": …}`),
/// sorted and without repeats: locks taken in one order never deadlock.
fn id_rows(order_ids: &[Result<String, StepError>]) -> String {
    let ids: BTreeSet<&str> = order_ids
        .iter()
        .filter_map(|id| id.as_ref().ok().map(String::as_str))
        .collect();
    let rows: Vec<Value> = ids
        .into_iter()
        .map(|id| serde_json::json!({ "order_id": id }))
        .collect();
    Value::Array(rows).to_string()
}

/// [`lock`] for a batch: where the database needs it, locks every order of
/// `order_ids`, in id order, until the transaction ends.
pub(crate) async fn lock_all<DB>(
    conn: &mut DB::Connection,
    order_ids: &[Result<String, StepError>],
) -> Result<(), StepError>
where
    DB: OrderDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
{
    if DB::LOCK_ORDER.is_none() {
        return Ok(());
    }
    let lock = format!(
        "SELECT 1 FROM demo_orders WHERE {} ORDER BY id{}",
        DB::json_in("id", "order_id"),
        DB::FOR_UPDATE
    );
    sqlx::query(AssertSqlSafe(lock))
        .bind(id_rows(order_ids).as_str())
        .execute(&mut *conn)
        .await
        .map_err(retryable)?;
    Ok(())
}

/// The orders of `order_ids` that have a row of `kind` in `table` already (a
/// compensation that came first).
pub(crate) async fn having<DB>(
    conn: &mut DB::Connection,
    order_ids: &[Result<String, StepError>],
    table: &'static str,
    kind: &'static str,
) -> Result<HashSet<String>, StepError>
where
    DB: OrderDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    let found = format!(
        "SELECT DISTINCT order_id FROM {table} WHERE kind = $2 AND {}",
        DB::json_in("order_id", "order_id")
    );
    let found: Vec<String> = sqlx::query_scalar(AssertSqlSafe(found))
        .bind(id_rows(order_ids).as_str())
        .bind(kind)
        .fetch_all(&mut *conn)
        .await
        .map_err(retryable)?;
    Ok(found.into_iter().collect())
}

/// A handler's batch taken as a set by `apply` when every command is `kind`, and `None`
/// (one by one) when the batch holds anything else. A batch whose `apply` failed is
/// answered with that error for every command: a retryable one rolls the batch back.
pub(crate) async fn as_set(
    envelopes: &[&Envelope],
    kind: &str,
    apply: impl Future<Output = Result<Vec<Result<Value, StepError>>, StepError>>,
) -> Option<Vec<Result<Value, StepError>>> {
    if envelopes.iter().any(|envelope| envelope.kind != kind) {
        return None;
    }
    Some(
        apply
            .await
            .unwrap_or_else(|error| vec![Err(error); envelopes.len()]),
    )
}

/// Runs `sql` with `rows` bound as `$1`, the JSON array it reads through
/// [`OrderDb::json_rows`]; runs nothing when there are no rows.
pub(crate) async fn execute_rows<DB>(
    conn: &mut DB::Connection,
    sql: String,
    rows: Vec<Value>,
) -> Result<(), StepError>
where
    DB: OrderDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
{
    if rows.is_empty() {
        return Ok(());
    }
    sqlx::query(AssertSqlSafe(sql))
        .bind(Value::Array(rows).to_string().as_str())
        .execute(&mut *conn)
        .await
        .map_err(retryable)?;
    Ok(())
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
