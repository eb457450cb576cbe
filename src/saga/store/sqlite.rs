//! [`SagaStore`] on SQLite: a save writes the state and its events in one
//! `BEGIN IMMEDIATE` transaction; the history is one table, pruned row by row.

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Row, Sqlite};

use super::{
    CREATE_ATTEMPTS, FINISHED_HISTORY, FinishedMinute, HistoryPruned, SagaCount, SagaFilter,
    SagaInsert, SagaSave, SagaSql, SagaStore, Started, bind_instance, bind_progress, started,
};
use crate::month::Month;
use crate::saga::history::{self, HistoryEntry, SagaEvent};
use crate::saga::versions::RegisterError;
use crate::saga::{SagaDefinition, SagaInstance};
use crate::store::SqliteStore;

const INSERT: &str = insert_saga!();
const INSERT_IF_ABSENT: &str = concat!(insert_saga!(), " ON CONFLICT (id) DO NOTHING");
const STARTED: &str = "INSERT INTO {schema}.sagabox_saga_events \
    (saga_id, saga_created_at, version, ordinal, at, kind) VALUES ($1, $2, 0, 0, $3, 'started')";
const UPDATE: &str = concat!(save_progress!(), " RETURNING version");
/// Finished sagas per minute (as seconds since the epoch) and status: the stored
/// timestamps are RFC 3339 text, which `unixepoch` reads.
const FINISHED_PER_MINUTE: &str = "SELECT \
    (unixepoch(finished_at) / 60) * 60 AS minute, status, COUNT(*) AS sagas \
    FROM {schema}.sagabox_saga_instances WHERE finished_at >= $1 \
    GROUP BY 1, 2 ORDER BY 1, 2";
const EVENTS: &str = "INSERT INTO {schema}.sagabox_saga_events (saga_id, saga_created_at, \
    version, ordinal, at, kind, step, direction, attempt, duration_ms, detail) \
    SELECT $1, $2, $3, json_extract(value, '$.ordinal'), json_extract(value, '$.at'), \
        json_extract(value, '$.kind'), json_extract(value, '$.step'), \
        json_extract(value, '$.direction'), json_extract(value, '$.attempt'), \
        json_extract(value, '$.duration_ms'), json_extract(value, '$.detail') \
    FROM json_each($4)";

impl SagaInsert for SqliteStore {
    type SagaDb = sqlx::Sqlite;

    async fn insert(
        &self,
        conn: &mut sqlx::SqliteConnection,
        instance: &SagaInstance,
    ) -> Result<(), sqlx::Error> {
        use sqlx::Connection;
        // A savepoint inside the caller's transaction, a transaction of its own otherwise.
        let mut tx = conn.begin().await?;
        bind_instance(
            sqlx::query(AssertSqlSafe(self.schema().sql(INSERT))),
            instance,
        )
        .execute(&mut *tx)
        .await?;
        self.write_started(&mut tx, instance).await?;
        tx.commit().await
    }
}

impl SagaStore for SqliteStore {
    async fn create_if_absent(&self, instance: &SagaInstance) -> Result<Started, sqlx::Error> {
        for _ in 0..CREATE_ATTEMPTS {
            let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await?;
            let inserted = bind_instance(
                sqlx::query(AssertSqlSafe(self.schema().sql(INSERT_IF_ABSENT))),
                instance,
            )
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if inserted {
                self.write_started(&mut tx, instance).await?;
            }
            tx.commit().await?;
            if let Some(started) = started(self, instance, inserted).await? {
                return Ok(started);
            }
        }
        Err(sqlx::Error::RowNotFound)
    }

    async fn save(
        &self,
        instance: &mut SagaInstance,
        events: &[SagaEvent],
    ) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await?;
        let Some(version) = self.write_save(&mut tx, instance, events).await? else {
            return Ok(false);
        };
        tx.commit().await?;
        instance.version = version;
        Ok(true)
    }

    async fn save_batch(&self, batch: &mut [SagaSave]) -> Result<(), sqlx::Error> {
        batch.sort_by(|a, b| a.instance.id.cmp(&b.instance.id));
        let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await?;
        let mut versions = Vec::with_capacity(batch.len());
        for save in batch.iter() {
            versions.push(
                self.write_save(&mut tx, &save.instance, &save.events)
                    .await?,
            );
        }
        tx.commit().await?;
        for (save, version) in batch.iter_mut().zip(versions) {
            if let Some(version) = version {
                save.instance.version = version;
                save.written = true;
            }
        }
        Ok(())
    }

    async fn prepare_history(&self, _months: &[Month]) -> Result<Vec<Month>, sqlx::Error> {
        Ok(Vec::new())
    }

    async fn prune_history(
        &self,
        before: Month,
        dry_run: bool,
    ) -> Result<HistoryPruned, sqlx::Error> {
        Ok(HistoryPruned {
            months_dropped: Vec::new(),
            rows_deleted: self.delete_finished_history(before, dry_run).await?,
        })
    }

    async fn load(&self, id: &str) -> Result<Option<SagaInstance>, sqlx::Error> {
        self.saga_sql().load(id).await
    }

    async fn unfinished(&self, saga_name: &str) -> Result<Vec<String>, sqlx::Error> {
        self.saga_sql().unfinished(saga_name).await
    }

    async fn list(&self, filter: &SagaFilter) -> Result<Vec<SagaInstance>, sqlx::Error> {
        self.saga_sql().list(filter).await
    }

    async fn counts(&self) -> Result<Vec<SagaCount>, sqlx::Error> {
        self.saga_sql().counts().await
    }

    async fn finished_per_minute(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<FinishedMinute>, sqlx::Error> {
        self.saga_sql().finished_per_minute(since).await
    }

    async fn history(&self, id: &str) -> Result<Vec<HistoryEntry>, sqlx::Error> {
        self.saga_sql().history(id).await
    }

    async fn register_definition(&self, definition: &SagaDefinition) -> Result<(), RegisterError> {
        self.saga_sql().register_definition(definition).await
    }

    async fn stored_definition(
        &self,
        name: &str,
        version: u32,
    ) -> Result<Option<String>, sqlx::Error> {
        self.saga_sql().stored_definition(name, version).await
    }
}

impl SqliteStore {
    /// Writes the `started` event of `instance`, just inserted with `conn`.
    async fn write_started(
        &self,
        conn: &mut sqlx::SqliteConnection,
        instance: &SagaInstance,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(self.schema().sql(STARTED)))
            .bind(&instance.id)
            .bind(instance.created_at)
            .bind(instance.updated_at)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Writes `instance`'s progress and `events` with `conn` if the stored row is still at
    /// `instance.version`: the new version, or `None` when the row moved on (nothing
    /// written).
    async fn write_save(
        &self,
        conn: &mut sqlx::SqliteConnection,
        instance: &SagaInstance,
        events: &[SagaEvent],
    ) -> Result<Option<i64>, sqlx::Error> {
        let row = bind_progress(
            sqlx::query(AssertSqlSafe(self.schema().sql(UPDATE))),
            instance,
        )
        .fetch_optional(&mut *conn)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let version: i64 = row.try_get("version")?;
        if !events.is_empty() {
            sqlx::query(AssertSqlSafe(self.schema().sql(EVENTS)))
                .bind(&instance.id)
                .bind(instance.created_at)
                .bind(version)
                .bind(Json(history::rows(events)))
                .execute(&mut *conn)
                .await?;
        }
        Ok(Some(version))
    }

    /// The queries both databases run alike, on this store.
    fn saga_sql(&self) -> SagaSql<'_, Sqlite> {
        SagaSql {
            pool: self.pool(),
            schema: self.schema(),
            finished_per_minute: FINISHED_PER_MINUTE,
        }
    }
    /// Deletes (or, dry, counts) the history rows of finished sagas created before
    /// `before`.
    async fn delete_finished_history(
        &self,
        before: Month,
        dry_run: bool,
    ) -> Result<u64, sqlx::Error> {
        if dry_run {
            let rows: i64 = sqlx::query_scalar(AssertSqlSafe(
                self.schema()
                    .sql(&format!("SELECT COUNT(*) {FINISHED_HISTORY}")),
            ))
            .bind(before.start())
            .fetch_one(self.pool())
            .await?;
            return Ok(u64::try_from(rows).unwrap_or(0));
        }
        let deleted = sqlx::query(AssertSqlSafe(
            self.schema().sql(&format!("DELETE {FINISHED_HISTORY}")),
        ))
        .bind(before.start())
        .execute(self.pool())
        .await?;
        Ok(deleted.rows_affected())
    }
}
