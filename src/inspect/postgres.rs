//! The figures of `inspect` from PostgreSQL, in one read-only snapshot.

use chrono::{DateTime, Datelike, NaiveDate, Utc};
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection, Row};

use super::{DuplicateReport, Facts, InspectError, SagaRow, database_error, merge_duplicates};
use crate::logging::redact;
use crate::month::Month;
use crate::schema::Schema;
use crate::store::PARTITION_PREFIX;

/// Reads every figure; `windows` are the starts of the last hour and the last day.
pub(super) async fn facts(
    url: &str,
    schema: &Schema,
    windows: [DateTime<Utc>; 2],
) -> Result<Facts, InspectError> {
    let failed = database_error(url);
    let options = crate::database::postgres_options(url)?.application_name("sagabox-inspect");
    let mut conn = crate::database::connect_postgres(url, &options).await?;
    check_migrated(url, schema, &mut conn).await?;
    // One snapshot: the partitions, their rows and the sagas all agree with each other.
    let mut tx = conn
        .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await
        .map_err(&failed)?;
    let mut facts = Facts::default();

    let sizes = sqlx::query(
        "SELECT c.relname::text AS name, pg_total_relation_size(c.oid) AS bytes \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass($1)",
    )
    .bind(schema.table("sagabox_inbox"))
    .fetch_all(&mut *tx)
    .await
    .map_err(&failed)?;
    let rows = sqlx::query(AssertSqlSafe(schema.sql(
        "SELECT bucket, COUNT(*) AS n, MIN(processed_at) AS oldest, MAX(processed_at) AS newest \
         FROM {schema}.sagabox_inbox GROUP BY bucket",
    )))
    .fetch_all(&mut *tx)
    .await
    .map_err(&failed)?;
    let mut rows_by_month = Vec::new();
    for row in rows {
        let bucket: NaiveDate = row.try_get("bucket").map_err(&failed)?;
        if let Ok(month) = Month::new(bucket.year(), bucket.month()) {
            rows_by_month.push((month, row.try_get::<i64, _>("n").map_err(&failed)?));
            facts.spans.push((
                month,
                row.try_get("oldest").map_err(&failed)?,
                row.try_get("newest").map_err(&failed)?,
            ));
        }
    }
    for row in sizes {
        let name: String = row.try_get("name").map_err(&failed)?;
        let Some(month) = Month::from_table_name(PARTITION_PREFIX, &name) else {
            continue;
        };
        let count = rows_by_month
            .iter()
            .find(|(m, _)| *m == month)
            .map_or(0, |(_, n)| *n);
        let bytes: i64 = row.try_get("bytes").map_err(&failed)?;
        facts.partitions.push((month, count, Some(bytes)));
    }
    facts.partitions.sort_by_key(|(month, ..)| *month);

    let pruned: Option<NaiveDate> = sqlx::query_scalar(AssertSqlSafe(
        schema.sql("SELECT pruned_through FROM {schema}.sagabox_inbox_pruned"),
    ))
    .fetch_optional(&mut *tx)
    .await
    .map_err(&failed)?;
    facts.pruned_through = pruned.and_then(|day| Month::new(day.year(), day.month()).ok());

    let duplicates = sqlx::query(AssertSqlSafe(schema.sql(
        "SELECT consumer_type, \
                COALESCE(SUM(duplicates) FILTER (WHERE last_duplicate_at >= $1), 0)::bigint AS last_hour, \
                COALESCE(SUM(duplicates) FILTER (WHERE last_duplicate_at >= $2), 0)::bigint AS last_day, \
                SUM(duplicates)::bigint AS in_inbox \
         FROM {schema}.sagabox_inbox WHERE duplicates > 0 GROUP BY consumer_type",
    )))
    .bind(windows[0])
    .bind(windows[1])
    .fetch_all(&mut *tx)
    .await
    .map_err(&failed)?;
    for row in duplicates {
        merge_duplicates(
            &mut facts.duplicates,
            DuplicateReport {
                consumer_type: row.try_get("consumer_type").map_err(&failed)?,
                last_hour: row.try_get("last_hour").map_err(&failed)?,
                last_day: row.try_get("last_day").map_err(&failed)?,
                in_inbox: row.try_get("in_inbox").map_err(&failed)?,
            },
        );
    }

    let statuses = sqlx::query(AssertSqlSafe(schema.sql(
        "SELECT CASE WHEN parked_reason IS NULL THEN status ELSE 'parked' END AS state, \
                COUNT(*) AS n FROM {schema}.sagabox_saga_instances GROUP BY 1",
    )))
    .fetch_all(&mut *tx)
    .await
    .map_err(&failed)?;
    for row in statuses {
        facts.sagas_by_status.insert(
            row.try_get("state").map_err(&failed)?,
            row.try_get("n").map_err(&failed)?,
        );
    }
    let oldest = sqlx::query(AssertSqlSafe(schema.sql(
        "SELECT id, saga_name, status, current_step::bigint AS current_step, \
                attempts::bigint AS attempts, created_at, updated_at, last_error \
         FROM {schema}.sagabox_saga_instances \
         WHERE status IN ('running', 'compensating') AND parked_reason IS NULL \
         ORDER BY created_at LIMIT 1",
    )))
    .fetch_optional(&mut *tx)
    .await
    .map_err(&failed)?;
    facts.oldest_unfinished = oldest
        .map(|row| {
            Ok::<_, sqlx::Error>(SagaRow {
                id: row.try_get("id")?,
                saga_name: row.try_get("saga_name")?,
                status: row.try_get("status")?,
                current_step: row.try_get("current_step")?,
                attempts: row.try_get("attempts")?,
                created_at: row.try_get("created_at")?,
                updated_at: row.try_get("updated_at")?,
                last_error: row.try_get("last_error")?,
            })
        })
        .transpose()
        .map_err(&failed)?;

    let (pending, oldest_pending): (i64, Option<DateTime<Utc>>) =
        sqlx::query_as(AssertSqlSafe(schema.sql(
            "SELECT COUNT(*), MIN(created_at) FROM {schema}.sagabox_outbox WHERE sent_at IS NULL",
        )))
        .fetch_one(&mut *tx)
        .await
        .map_err(&failed)?;
    facts.outbox_pending = pending;
    facts.oldest_pending_at = oldest_pending;
    tx.rollback().await.map_err(&failed)?;
    Ok(facts)
}

/// Refuses a database where any of this version's migrations has not run.
async fn check_migrated(
    url: &str,
    schema: &Schema,
    conn: &mut PgConnection,
) -> Result<(), InspectError> {
    match crate::database::unapplied_postgres(conn, schema)
        .await
        .map_err(database_error(url))?
    {
        None => Ok(()),
        Some(what) => Err(InspectError::NotMigrated {
            url: redact(url),
            what,
        }),
    }
}
