//! The figures of `inspect` from SQLite, in one read transaction (a WAL snapshot).

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Row, Sqlite, Transaction};

use super::sql::saga_and_outbox_facts;
use super::{DuplicateReport, Facts, ReadFacts, merge_duplicates};
use crate::month::Month;
use crate::store::{PARTITION_PREFIX, SqliteStore};

impl ReadFacts for SqliteStore {
    async fn facts(&self, windows: [DateTime<Utc>; 2]) -> Result<Facts, sqlx::Error> {
        // A deferred transaction that only reads: one snapshot for every figure.
        let mut tx = self.pool().begin().await?;
        let mut facts = Facts::default();
        inbox_facts(&mut tx, windows, &mut facts).await?;
        saga_and_outbox_facts::<Sqlite>(&mut tx, self.schema(), &mut facts).await?;
        tx.rollback().await?;
        Ok(facts)
    }
}

/// The inbox's monthly tables: rows, size, the span of their times, duplicates.
async fn inbox_facts(
    tx: &mut Transaction<'_, Sqlite>,
    windows: [DateTime<Utc>; 2],
    facts: &mut Facts,
) -> Result<(), sqlx::Error> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' \
           AND name GLOB 'sagabox_inbox_[0-9][0-9][0-9][0-9]_[0-9][0-9]'",
    )
    .fetch_all(&mut **tx)
    .await?;
    for table in tables {
        // Only names that parse as a month go into SQL text.
        let Some(month) = Month::from_table_name(PARTITION_PREFIX, &table) else {
            continue;
        };
        let table = format!("{PARTITION_PREFIX}{}", month.suffix());
        let (rows, oldest, newest): (i64, Option<DateTime<Utc>>, Option<DateTime<Utc>>) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT COUNT(*), MIN(processed_at), MAX(processed_at) FROM {table}"
            )))
            .fetch_one(&mut **tx)
            .await?;
        if let (Some(oldest), Some(newest)) = (oldest, newest) {
            facts.spans.push((month, oldest, newest));
        }
        // dbstat is compiled into the bundled SQLite; a system library may lack it, and
        // then the size is unknown rather than guessed.
        let bytes: Option<i64> =
            sqlx::query_scalar("SELECT SUM(pgsize) FROM dbstat WHERE name = $1")
                .bind(&table)
                .fetch_one(&mut **tx)
                .await
                .ok()
                .flatten();
        facts.partitions.push((month, rows, bytes));

        let duplicates = sqlx::query(AssertSqlSafe(format!(
            "SELECT consumer_type, \
                    SUM(CASE WHEN last_duplicate_at >= $1 THEN duplicates ELSE 0 END) AS last_hour, \
                    SUM(CASE WHEN last_duplicate_at >= $2 THEN duplicates ELSE 0 END) AS last_day, \
                    SUM(duplicates) AS in_inbox \
             FROM {table} WHERE duplicates > 0 GROUP BY consumer_type"
        )))
        .bind(windows[0])
        .bind(windows[1])
        .fetch_all(&mut **tx)
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
    }
    facts.partitions.sort_by_key(|(month, ..)| *month);

    let pruned: Option<String> =
        sqlx::query_scalar("SELECT pruned_through FROM sagabox_inbox_pruned")
            .fetch_optional(&mut **tx)
            .await?;
    facts.pruned_through = pruned.and_then(|text| text.parse().ok());

    Ok(())
}
