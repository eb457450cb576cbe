//! The figures of `inspect` both databases read alike: sagas by state, the oldest
//! unfinished saga, the outbox's pending rows. Written once, over the snapshot
//! transaction the database's own file opened.

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, ColumnIndex, Database, Decode, Executor, IntoArguments, Row, Type};

use super::{Facts, SagaRow};
use crate::schema::Schema;

const STATES: &str = "SELECT CASE WHEN parked_reason IS NULL THEN status ELSE 'parked' END AS state, \
                      COUNT(*) AS n FROM {schema}.sagabox_saga_instances GROUP BY 1";

const OLDEST_UNFINISHED: &str = "SELECT id, saga_name, status, current_step, attempts, \
                                 created_at, updated_at, last_error \
                                 FROM {schema}.sagabox_saga_instances \
                                 WHERE status IN ('running', 'compensating') AND parked_reason IS NULL \
                                 ORDER BY created_at LIMIT 1";

const PENDING: &str = "SELECT COUNT(*) FROM {schema}.sagabox_outbox WHERE sent_at IS NULL";

// An ordered column rather than MIN(): SQLite decodes a time only from a column it
// knows the type of.
const OLDEST_PENDING: &str = "SELECT created_at FROM {schema}.sagabox_outbox \
                              WHERE sent_at IS NULL ORDER BY created_at LIMIT 1";

/// Reads the saga and outbox figures into `facts` through `conn`.
pub(super) async fn saga_and_outbox_facts<DB>(
    conn: &mut DB::Connection,
    schema: &Schema,
    facts: &mut Facts,
) -> Result<(), sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    usize: ColumnIndex<DB::Row>,
    for<'r> &'r str: ColumnIndex<DB::Row>,
    for<'t> String: Decode<'t, DB> + Type<DB>,
    for<'t> i32: Decode<'t, DB> + Type<DB>,
    for<'t> i64: Decode<'t, DB> + Type<DB>,
    for<'t> DateTime<Utc>: Decode<'t, DB> + Type<DB>,
    for<'t> Option<String>: Decode<'t, DB> + Type<DB>,
{
    for row in sqlx::query(AssertSqlSafe(schema.sql(STATES)))
        .fetch_all(&mut *conn)
        .await?
    {
        facts
            .sagas_by_status
            .insert(row.try_get("state")?, row.try_get("n")?);
    }
    let oldest = sqlx::query(AssertSqlSafe(schema.sql(OLDEST_UNFINISHED)))
        .fetch_optional(&mut *conn)
        .await?;
    facts.oldest_unfinished = oldest
        .map(|row| {
            Ok::<_, sqlx::Error>(SagaRow {
                id: row.try_get("id")?,
                saga_name: row.try_get("saga_name")?,
                status: row.try_get("status")?,
                current_step: i64::from(row.try_get::<i32, _>("current_step")?),
                attempts: i64::from(row.try_get::<i32, _>("attempts")?),
                created_at: row.try_get("created_at")?,
                updated_at: row.try_get("updated_at")?,
                last_error: row.try_get("last_error")?,
            })
        })
        .transpose()?;
    facts.outbox_pending = sqlx::query_scalar(AssertSqlSafe(schema.sql(PENDING)))
        .fetch_one(&mut *conn)
        .await?;
    facts.oldest_pending_at = sqlx::query_scalar(AssertSqlSafe(schema.sql(OLDEST_PENDING)))
        .fetch_optional(&mut *conn)
        .await?;
    Ok(())
}
