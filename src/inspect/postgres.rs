//! The figures of `inspect` from PostgreSQL, in one read-only snapshot.

use chrono::{DateTime, Datelike, NaiveDate, Utc};
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Postgres, Row};

use super::sql::saga_and_outbox_facts;
use super::{DuplicateReport, Facts, ReadFacts, merge_duplicates};
use crate::month::Month;
use crate::schema::Schema;
use crate::store::{PARTITION_PREFIX, PostgresStore};

impl ReadFacts for PostgresStore {
    async fn facts(&self, windows: [DateTime<Utc>; 2]) -> Result<Facts, sqlx::Error> {
        // One snapshot: the partitions, their rows and the sagas all agree with each
        // other.
        let mut tx = self
            .pool()
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await?;
        let mut facts = Facts::default();
        inbox_facts(&mut tx, self.schema(), windows, &mut facts).await?;
        saga_and_outbox_facts::<Postgres>(&mut tx, self.schema(), &mut facts).await?;
        tx.rollback().await?;
        Ok(facts)
    }
}

/// The inbox's partitions: rows, size, the span of their times, duplicates, and the
/// month pruned through.
async fn inbox_facts(
    tx: &mut PgConnection,
    schema: &Schema,
    windows: [DateTime<Utc>; 2],
    facts: &mut Facts,
) -> Result<(), sqlx::Error> {
    let sizes = sqlx::query(
        "SELECT c.relname::text AS name, pg_total_relation_size(c.oid) AS bytes \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass($1)",
    )
    .bind(schema.table("sagabox_inbox"))
    .fetch_all(&mut *tx)
    .await?;
    let rows = sqlx::query(AssertSqlSafe(schema.sql(
        "SELECT bucket, COUNT(*) AS n, MIN(processed_at) AS oldest, MAX(processed_at) AS newest \
         FROM {schema}.sagabox_inbox GROUP BY bucket",
    )))
    .fetch_all(&mut *tx)
    .await?;
    let mut rows_by_month = Vec::new();
    for row in rows {
        let bucket: NaiveDate = row.try_get("bucket")?;
        if let Ok(month) = Month::new(bucket.year(), bucket.month()) {
            rows_by_month.push((month, row.try_get::<i64, _>("n")?));
            facts
                .spans
                .push((month, row.try_get("oldest")?, row.try_get("newest")?));
        }
    }
    for row in sizes {
        let name: String = row.try_get("name")?;
        let Some(month) = Month::from_table_name(PARTITION_PREFIX, &name) else {
            continue;
        };
        let count = rows_by_month
            .iter()
            .find(|(m, _)| *m == month)
            .map_or(0, |(_, n)| *n);
        let bytes: i64 = row.try_get("bytes")?;
        facts.partitions.push((month, count, Some(bytes)));
    }
    facts.partitions.sort_by_key(|(month, ..)| *month);

    let pruned: Option<NaiveDate> = sqlx::query_scalar(AssertSqlSafe(
        schema.sql("SELECT pruned_through FROM {schema}.sagabox_inbox_pruned"),
    ))
    .fetch_optional(&mut *tx)
    .await?;
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
    ?;
    for row in duplicates {
        merge_duplicates(
            &mut facts.duplicates,
            DuplicateReport {
                consumer_type: row.try_get("consumer_type")?,
                last_hour: row.try_get("last_hour")?,
                last_day: row.try_get("last_day")?,
                in_inbox: row.try_get("in_inbox")?,
            },
        );
    }

    Ok(())
}
