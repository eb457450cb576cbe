//! The figures of `inspect` from SQLite, in one read transaction (a WAL snapshot).

use std::str::FromStr;

use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::{AssertSqlSafe, Connection, Row, Sqlite, Transaction};

use super::{DuplicateReport, Facts, InspectError, SagaRow, database_error, merge_duplicates};
use crate::database::{ConnectError, missing_sqlite_file};
use crate::logging::redact;
use crate::month::Month;
use crate::store::PARTITION_PREFIX;

/// Reads every figure; `windows` are the starts of the last hour and the last day.
pub(super) async fn facts(url: &str, windows: [DateTime<Utc>; 2]) -> Result<Facts, InspectError> {
    let failed = database_error(url);
    let mut conn = open(url).await?;
    // A deferred transaction that only reads: one snapshot for every figure.
    let mut tx = conn.begin().await.map_err(&failed)?;
    let mut facts = Facts::default();
    inbox_facts(&mut tx, windows, &mut facts)
        .await
        .map_err(&failed)?;
    saga_facts(&mut tx, &mut facts).await.map_err(&failed)?;
    outbox_facts(&mut tx, &mut facts).await.map_err(&failed)?;
    tx.rollback().await.map_err(&failed)?;
    Ok(facts)
}

/// The connection to the migrated database at `url`; never creates a file.
async fn open(url: &str) -> Result<SqliteConnection, InspectError> {
    // Never create a file: inspecting a mistyped path must fail, not make an empty db.
    if let Some(what) = missing_sqlite_file(url)? {
        return Err(InspectError::NotMigrated {
            url: redact(url),
            what,
        });
    }
    let options = SqliteConnectOptions::from_str(url)
        .map_err(|error| ConnectError::new(url, error))?
        .create_if_missing(false)
        .busy_timeout(std::time::Duration::from_secs(30));
    let mut conn = SqliteConnection::connect_with(&options)
        .await
        .map_err(|error| ConnectError::new(url, error))?;
    check_migrated(url, &mut conn).await?;
    Ok(conn)
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

/// Sagas by state, and the oldest unfinished one that is not parked.
async fn saga_facts(
    tx: &mut Transaction<'_, Sqlite>,
    facts: &mut Facts,
) -> Result<(), sqlx::Error> {
    let statuses = sqlx::query(
        "SELECT CASE WHEN parked_reason IS NULL THEN status ELSE 'parked' END AS state, \
                COUNT(*) AS n FROM sagabox_saga_instances GROUP BY 1",
    )
    .fetch_all(&mut **tx)
    .await?;
    for row in statuses {
        facts
            .sagas_by_status
            .insert(row.try_get("state")?, row.try_get("n")?);
    }
    // Timestamps are RFC 3339 text in UTC, which sorts in time order.
    let oldest = sqlx::query(
        "SELECT id, saga_name, status, current_step, attempts, created_at, updated_at, last_error \
         FROM sagabox_saga_instances WHERE status IN ('running', 'compensating') AND parked_reason IS NULL \
         ORDER BY created_at LIMIT 1",
    )
    .fetch_optional(&mut **tx)
    .await
    ?;
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
        .transpose()?;

    Ok(())
}

/// The outbox's pending rows and the oldest one's time.
async fn outbox_facts(
    tx: &mut Transaction<'_, Sqlite>,
    facts: &mut Facts,
) -> Result<(), sqlx::Error> {
    facts.outbox_pending =
        sqlx::query_scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NULL")
            .fetch_one(&mut **tx)
            .await?;
    facts.oldest_pending_at = sqlx::query_scalar(
        "SELECT created_at FROM sagabox_outbox WHERE sent_at IS NULL ORDER BY created_at LIMIT 1",
    )
    .fetch_optional(&mut **tx)
    .await?;
    Ok(())
}

/// Refuses a database where any of this version's migrations has not run.
async fn check_migrated(url: &str, conn: &mut SqliteConnection) -> Result<(), InspectError> {
    match crate::database::unapplied_sqlite(conn)
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
