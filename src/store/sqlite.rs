//! [`SqliteStore`]: the embedded default inbox, one table per month
//! (`sagabox_inbox_YYYY_MM`), pruned by dropping whole tables.
//!
//! SQLite has one writer at a time, and the guard's transaction starts with
//! `BEGIN IMMEDIATE`, which takes the write lock up front: a claim and everything after
//! it in the transaction run alone, so a racing delivery of the same key waits for the
//! first to commit and then sees its row. Partition choice mirrors the PostgreSQL store:
//! a message with a time is looked up in its own month's table, one without in all.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Row, Sqlite, SqliteConnection, Transaction};

use crate::connection::ConnectError;
use crate::month::Month;
use crate::schema::Schema;
use crate::store::{
    BatchClaim, ClaimKey, Claimed, FirstDelivery, InboxStore, PARTITION_PREFIX, PartitionCreation,
};

/// The SQLite migrations, embedded at build time.
pub(crate) static MIGRATOR: Migrator = sqlx::migrate!("migrations/sqlite");

/// The inbox in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    schema: Schema,
}

impl SqliteStore {
    /// A store on an existing pool. Give its connections a `busy_timeout`: writers queue
    /// on SQLite's single write lock.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            schema: Schema::sqlite(),
        }
    }

    /// The most connections worth pooling: SQLite writes one transaction at a time, and
    /// connections beyond these only queue on its lock.
    /// [`AnyStore::connect`](crate::database::AnyStore::connect) opens at most this many.
    pub const MAX_USEFUL_CONNECTIONS: u32 = 8;

    /// Opens (creating if missing) the database at `url` (`sqlite:path/to/file.db`) with
    /// up to `max_connections` connections, in WAL mode with full fsync on commit (an
    /// acknowledged message must survive a power cut) and a 30 s busy timeout.
    ///
    /// The error names the file, and the folder when that is what is missing.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, ConnectError> {
        crate::connection::check_sqlite_folder(url)?;
        let failed = |error| ConnectError::new(url, error);
        let options = SqliteConnectOptions::from_str(url)
            .map_err(failed)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(30))
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(max_connections.max(1))
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .map_err(failed)?;
        Ok(Self::new(pool))
    }

    /// The pool, for the caller's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The schema of the store's tables: always `main`, the file's own database.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }
}

fn table_name(month: Month) -> String {
    format!("{PARTITION_PREFIX}{}", month.suffix())
}

async fn list_tables(conn: &mut SqliteConnection) -> Result<Vec<Month>, sqlx::Error> {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' \
           AND name GLOB 'sagabox_inbox_[0-9][0-9][0-9][0-9]_[0-9][0-9]'",
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut months: Vec<Month> = names
        .iter()
        .filter_map(|name| Month::from_table_name(PARTITION_PREFIX, name))
        .collect();
    months.sort();
    Ok(months)
}

/// The columns a monthly table gained after it was first shipped, with their DDL.
/// Monthly tables are created at run time, so no static migration can reach the ones
/// that exist; [`SqliteStore::migrate`] adds what is missing to each.
const ADDED_COLUMNS: [(&str, &str); 2] = [
    ("duplicates", "duplicates INTEGER NOT NULL DEFAULT 0"),
    ("last_duplicate_at", "last_duplicate_at TEXT"),
];

/// Brings every existing monthly table to the current columns, in one write
/// transaction (idempotent: a table that has a column is left alone).
async fn upgrade_tables(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    for month in list_tables(&mut tx).await? {
        let table = table_name(month);
        let columns: Vec<String> = sqlx::query_scalar("SELECT name FROM pragma_table_info($1)")
            .bind(&table)
            .fetch_all(&mut *tx)
            .await?;
        for (column, ddl) in ADDED_COLUMNS {
            if !columns.iter().any(|name| name == column) {
                sqlx::query(AssertSqlSafe(format!(
                    "ALTER TABLE {table} ADD COLUMN {ddl}"
                )))
                .execute(&mut *tx)
                .await?;
            }
        }
    }
    tx.commit().await
}

/// The newest pruned month, if any.
async fn pruned_through(conn: &mut SqliteConnection) -> Result<Option<Month>, sqlx::Error> {
    let through: Option<String> =
        sqlx::query_scalar("SELECT pruned_through FROM sagabox_inbox_pruned")
            .fetch_optional(&mut *conn)
            .await?;
    through
        .map(|text| {
            text.parse::<Month>()
                .map_err(|error| sqlx::Error::Decode(Box::new(error)))
        })
        .transpose()
}

/// Looks up `key`'s first delivery inside the claim's write transaction: in its own
/// month's table, or in every monthly table (listed once per transaction, in `tables`)
/// when the message carries no stable time.
async fn lookup(
    conn: &mut SqliteConnection,
    key: &ClaimKey<'_>,
    tables: &mut Option<Vec<Month>>,
) -> Result<Option<FirstDelivery>, sqlx::Error> {
    let months = if key.probe_all {
        if tables.is_none() {
            *tables = Some(list_tables(&mut *conn).await?);
        }
        tables.as_deref().unwrap_or_default()
    } else {
        std::slice::from_ref(&key.bucket)
    };
    if months.is_empty() {
        return Ok(None);
    }
    // Table names come from validated Months only.
    let sql = months
        .iter()
        .map(|month| {
            format!(
                "SELECT processed_at, result FROM {} WHERE consumer_type = $1 AND message_id = $2",
                table_name(*month)
            )
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    let row = sqlx::query(AssertSqlSafe(format!(
        "{sql} ORDER BY processed_at LIMIT 1"
    )))
    .bind(key.consumer_type.as_str())
    .bind(key.message_id.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|row| {
        Ok(FirstDelivery {
            processed_at: row.try_get("processed_at")?,
            result: row.try_get::<Json<Value>, _>("result")?.0,
        })
    })
    .transpose()
}

impl InboxStore for SqliteStore {
    type Db = Sqlite;

    fn pool_size(&self) -> Option<u32> {
        Some(self.pool.options().get_max_connections())
    }

    async fn begin_claim(
        &self,
        key: &ClaimKey<'_>,
        _write_row_at: Option<DateTime<Utc>>,
    ) -> Result<(Transaction<'static, Sqlite>, Claimed), sqlx::Error> {
        // The write lock up front: the lookup and all that follows run alone. Statements
        // are in-process calls here, so the row is written after the handler, with its
        // result, rather than written now and updated.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut tables = None;
        let claimed = Claimed::found(lookup(&mut tx, key, &mut tables).await?);
        Ok((tx, claimed))
    }

    async fn begin_batch_claim(
        &self,
        keys: &[ClaimKey<'_>],
        _write_rows_at: Option<DateTime<Utc>>,
    ) -> Result<BatchClaim<Sqlite>, sqlx::Error> {
        // One write lock for the whole batch: no other claim runs until it commits, and
        // the lookups are in-process calls, so one per key costs no round trip. Rows are
        // written after the handler: writing them first saves no round trip here.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut tables = None;
        let mut claims = Vec::with_capacity(keys.len());
        for key in keys {
            claims.push(Claimed::found(lookup(&mut tx, key, &mut tables).await?));
        }
        Ok((tx, claims))
    }

    async fn record_batch_results(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        keys: &[ClaimKey<'_>],
        results: &[&Value],
    ) -> Result<u64, sqlx::Error> {
        let mut updated = 0;
        for (key, result) in keys.iter().zip(results) {
            let sql = format!(
                "UPDATE {} SET result = $3 WHERE consumer_type = $1 AND message_id = $2",
                table_name(key.bucket)
            );
            updated += sqlx::query(AssertSqlSafe(sql))
                .bind(key.consumer_type.as_str())
                .bind(key.message_id.as_str())
                .bind(Json(*result))
                .execute(&mut **tx)
                .await?
                .rows_affected();
        }
        Ok(updated)
    }

    async fn record_batch(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        keys: &[ClaimKey<'_>],
        processed_at: DateTime<Utc>,
        results: &[&Value],
    ) -> Result<u64, sqlx::Error> {
        let mut written = 0;
        for (key, result) in keys.iter().zip(results) {
            if self.record(tx, key, processed_at, result).await? {
                written += 1;
            }
        }
        Ok(written)
    }

    async fn record(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        key: &ClaimKey<'_>,
        processed_at: DateTime<Utc>,
        result: &Value,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "INSERT INTO {} (consumer_type, message_id, processed_at, result) \
             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            table_name(key.bucket)
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(key.consumer_type.as_str())
            .bind(key.message_id.as_str())
            .bind(processed_at)
            .bind(Json(result))
            .execute(&mut **tx)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn record_result(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        key: &ClaimKey<'_>,
        result: &Value,
    ) -> Result<(), sqlx::Error> {
        let sql = format!(
            "UPDATE {} SET result = $3 WHERE consumer_type = $1 AND message_id = $2",
            table_name(key.bucket)
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(key.consumer_type.as_str())
            .bind(key.message_id.as_str())
            .bind(Json(result))
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn record_duplicate(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        key: &ClaimKey<'_>,
        _first: &FirstDelivery,
        at: DateTime<Utc>,
    ) -> Result<(), sqlx::Error> {
        // A message without a stable time may have its first row in any live month.
        // Claims run one at a time under the write lock, so a key has one row at most
        // across the months: the first table that has it is the one.
        let months = if key.probe_all {
            list_tables(&mut *tx).await?
        } else {
            vec![key.bucket]
        };
        for month in months {
            let sql = format!(
                "UPDATE {} SET duplicates = duplicates + 1, \
                        last_duplicate_at = MAX(COALESCE(last_duplicate_at, ''), $3) \
                 WHERE consumer_type = $1 AND message_id = $2",
                table_name(month)
            );
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(key.consumer_type.as_str())
                .bind(key.message_id.as_str())
                .bind(at)
                .execute(&mut **tx)
                .await?;
            if done.rows_affected() > 0 {
                break;
            }
        }
        Ok(())
    }

    async fn create_partition(&self, month: Month) -> Result<PartitionCreation, sqlx::Error> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        if pruned_through(&mut tx)
            .await?
            .is_some_and(|through| month <= through)
        {
            tx.commit().await?;
            return Ok(PartitionCreation::Pruned);
        }
        if list_tables(&mut tx).await?.contains(&month) {
            tx.commit().await?;
            return Ok(PartitionCreation::Existed);
        }
        let ddl = format!(
            "CREATE TABLE {} (\
               consumer_type TEXT NOT NULL, \
               message_id TEXT NOT NULL, \
               processed_at TEXT NOT NULL, \
               result TEXT NOT NULL, \
               duplicates INTEGER NOT NULL DEFAULT 0, \
               last_duplicate_at TEXT, \
               PRIMARY KEY (consumer_type, message_id)\
             ) WITHOUT ROWID",
            table_name(month)
        );
        sqlx::query(AssertSqlSafe(ddl)).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(PartitionCreation::Created)
    }

    async fn partitions(&self) -> Result<Vec<Month>, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        list_tables(&mut conn).await
    }

    async fn drop_partition(&self, month: Month) -> Result<bool, sqlx::Error> {
        // Watermark and drop in one write transaction: no claim can recreate the month.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        if pruned_through(&mut tx)
            .await?
            .is_none_or(|through| through < month)
        {
            sqlx::query(
                "INSERT INTO sagabox_inbox_pruned (singleton, pruned_through) VALUES (1, $1) \
                 ON CONFLICT (singleton) DO UPDATE SET pruned_through = excluded.pruned_through",
            )
            .bind(month.to_string())
            .execute(&mut *tx)
            .await?;
        }
        let existed = list_tables(&mut tx).await?.contains(&month);
        if existed {
            sqlx::query(AssertSqlSafe(format!("DROP TABLE {}", table_name(month))))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(existed)
    }

    fn is_missing_partition(error: &sqlx::Error) -> bool {
        matches!(error, sqlx::Error::Database(e) if e.message().contains("no such table"))
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    async fn ping(&self) -> Result<(), sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        sqlx::Connection::ping(&mut *conn).await
    }

    async fn migrate(&self) -> Result<(), MigrateError> {
        let mut conn = self.pool.acquire().await?;
        super::layout::migrate_sqlite(&mut conn, &MIGRATOR).await?;
        drop(conn);
        upgrade_tables(&self.pool)
            .await
            .map_err(MigrateError::Execute)
    }
}
