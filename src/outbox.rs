//! The transactional outbox, write side: a message written with
//! [`OutboxWriter::publish`] inside the guard's (or any) transaction commits with the
//! change that causes it, or not at all. A relay (the RabbitMQ transport's `Relay`) publishes
//! pending rows at least once, in `seq` order per aggregate, and marks them sent; the consumer's inbox
//! absorbs a second publish, since the row's UUIDv7 is the message id downstream.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::future::Future;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{
    AssertSqlSafe, ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Row, Type,
};

use crate::envelope::{ConsumerType, Envelope, KeyError, MessageId};
use crate::schema::Schema;

/// One row of the outbox, as the relay reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRow {
    /// Publish order.
    pub seq: i64,
    /// The ordering key: rows of one aggregate are published in `seq` order.
    pub aggregate: String,
    /// Who the message is for (its queue is `sagabox.<destination>`).
    pub destination: ConsumerType,
    /// The message, with its id.
    pub envelope: Envelope,
}

/// Writing to the outbox with a connection inside the caller's transaction.
pub trait OutboxWriter {
    /// Writes `envelope` for `destination`, ordered within `aggregate`. Its id must be
    /// unique (use [`OutboxWriter::message`]); a second row with the same id fails.
    ///
    /// Unless the envelope names a `traceparent` of its own, the row takes the current
    /// span's trace context (the handler's, in a step), so its consumer continues the
    /// trace ([`crate::trace`]).
    ///
    /// Writes to the outbox in the default schema: PostgreSQL's `sagabox`, SQLite's
    /// `main`. With tables in another schema
    /// ([`PostgresStore::with_schema`](crate::PostgresStore::with_schema)), use
    /// [`publish_in`](Self::publish_in).
    fn publish(
        &mut self,
        destination: &ConsumerType,
        aggregate: &str,
        envelope: &Envelope,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// [`publish`](Self::publish) to the outbox in `schema` (the store's
    /// [`schema`](crate::store::InboxStore::schema)).
    fn publish_in(
        &mut self,
        schema: &Schema,
        destination: &ConsumerType,
        aggregate: &str,
        envelope: &Envelope,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// A new message for the outbox: a fresh UUIDv7 id and the current time as its
    /// publish time.
    fn message(kind: &str, payload: Value) -> Result<Envelope, KeyError>
    where
        Self: Sized,
    {
        Ok(Envelope::new(MessageId::new_v7(), kind, payload)?.with_published_at(Utc::now()))
    }
}

/// Reading and settling the outbox, for the relay.
///
/// Every method works on the outbox in `schema` (the store's
/// [`schema`](crate::store::InboxStore::schema)).
pub trait OutboxReader {
    /// Up to `limit` rows not yet sent, oldest first.
    fn pending(
        &mut self,
        schema: &Schema,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<OutboxRow>, sqlx::Error>> + Send;

    /// Up to `limit` pending rows for a relay to publish, oldest first, taken for this
    /// transaction. On PostgreSQL each row's aggregate is locked for the transaction
    /// (`pg_try_advisory_xact_lock`) and the rows `FOR UPDATE SKIP LOCKED`: another
    /// relay skips every aggregate this one holds, so rows of one aggregate are never
    /// published by two relays at once, nor out of order. On SQLite (one writer) it is
    /// [`OutboxReader::pending`]. Call inside a transaction and mark before commit.
    fn claim(
        &mut self,
        schema: &Schema,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<OutboxRow>, sqlx::Error>> + Send;

    /// How many rows are not yet sent.
    fn pending_count(
        &mut self,
        schema: &Schema,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Deletes rows sent before `before`; returns how many. The relay calls it on a
    /// timer: a sent row is only kept for an operator's eyes.
    fn prune_sent(
        &mut self,
        schema: &Schema,
        before: DateTime<Utc>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Marks the row `seq` sent at `now`. Returns whether it was pending.
    fn mark_sent(
        &mut self,
        schema: &Schema,
        seq: i64,
        now: DateTime<Utc>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
}

/// One outbox row from a query selecting every column.
fn decode_row<R: Row>(row: &R) -> Result<OutboxRow, sqlx::Error>
where
    usize: ColumnIndex<R>,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> DateTime<Utc>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Json<Value>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Json<BTreeMap<String, String>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let id: String = row.try_get("id")?;
    let kind: String = row.try_get("kind")?;
    let destination: String = row.try_get("destination")?;
    let payload: Json<Value> = row.try_get("payload")?;
    let headers: Json<BTreeMap<String, String>> = row.try_get("headers")?;
    let mut envelope = Envelope::new(MessageId::new(id).map_err(decode_error)?, kind, payload.0)
        .map_err(decode_error)?
        .with_published_at(row.try_get("created_at")?);
    envelope.saga_id = row.try_get("saga_id")?;
    envelope.headers = headers.0;
    Ok(OutboxRow {
        seq: row.try_get("seq")?,
        aggregate: row.try_get("aggregate")?,
        destination: ConsumerType::new(destination).map_err(decode_error)?,
        envelope,
    })
}

const INSERT: &str = "INSERT INTO {schema}.sagabox_outbox \
    (id, aggregate, destination, kind, saga_id, payload, headers, created_at) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";
const PENDING: &str = "SELECT seq, id, aggregate, destination, kind, saga_id, payload, headers, created_at \
    FROM {schema}.sagabox_outbox WHERE sent_at IS NULL ORDER BY seq LIMIT $1";
const MARK_SENT: &str =
    "UPDATE {schema}.sagabox_outbox SET sent_at = $2 WHERE seq = $1 AND sent_at IS NULL";

const PENDING_COUNT: &str = "SELECT COUNT(*) FROM {schema}.sagabox_outbox WHERE sent_at IS NULL";
const PRUNE_SENT: &str =
    "DELETE FROM {schema}.sagabox_outbox WHERE sent_at IS NOT NULL AND sent_at < $1";

fn decode_error(error: KeyError) -> sqlx::Error {
    sqlx::Error::Decode(Box::new(error))
}

/// Writes one outbox row with `conn`: the body of both backends' [`OutboxWriter::publish_in`].
async fn insert_row<DB: Database>(
    conn: &mut DB::Connection,
    schema: &Schema,
    destination: &ConsumerType,
    aggregate: &str,
    envelope: &Envelope,
) -> Result<(), sqlx::Error>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> Option<&'t str>: Encode<'t, DB> + Type<DB>,
    for<'t> Json<&'t Value>: Encode<'t, DB> + Type<DB>,
    for<'t> Json<Cow<'t, BTreeMap<String, String>>>: Encode<'t, DB> + Type<DB>,
    for<'t> DateTime<Utc>: Encode<'t, DB> + Type<DB>,
{
    sqlx::query(AssertSqlSafe(schema.sql(INSERT)))
        .bind(envelope.id.as_str())
        .bind(aggregate)
        .bind(destination.as_str())
        .bind(envelope.kind.as_str())
        .bind(envelope.saga_id.as_deref())
        .bind(Json(&envelope.payload))
        .bind(Json(crate::trace::with_current(&envelope.headers)))
        .bind(envelope.published_at.unwrap_or_else(Utc::now))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Reads the rows `sql` selects, every column, with `$1` the limit.
async fn select_rows<DB: Database>(
    conn: &mut DB::Connection,
    sql: String,
    limit: i64,
) -> Result<Vec<OutboxRow>, sqlx::Error>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'t> i64: Encode<'t, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
    for<'r> &'r str: ColumnIndex<DB::Row>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
    for<'r> DateTime<Utc>: Decode<'r, DB> + Type<DB>,
    for<'r> Json<Value>: Decode<'r, DB> + Type<DB>,
    for<'r> Json<BTreeMap<String, String>>: Decode<'r, DB> + Type<DB>,
{
    let rows = sqlx::query(AssertSqlSafe(sql))
        .bind(limit)
        .fetch_all(&mut *conn)
        .await?;
    rows.iter().map(decode_row).collect()
}

/// How many rows are not yet sent.
async fn count_pending<DB: Database>(
    conn: &mut DB::Connection,
    schema: &Schema,
) -> Result<u64, sqlx::Error>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let count: i64 = sqlx::query_scalar(AssertSqlSafe(schema.sql(PENDING_COUNT)))
        .fetch_one(&mut *conn)
        .await?;
    Ok(u64::try_from(count).unwrap_or(0))
}

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
