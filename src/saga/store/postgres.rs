//! [`SagaStore`] on PostgreSQL: a save writes the state and its events in one statement,
//! the state's `UPDATE` in a common table expression feeding the events' `INSERT`, and a
//! batch of saves is one such statement over arrays of every save's columns; the
//! history is partitioned by month, and pruning drops whole months.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Postgres};

use super::{
    BoundQuery, CREATE_ATTEMPTS, FINISHED_HISTORY, FinishedMinute, HISTORY_PARTITION_PREFIX,
    HistoryPruned, SagaCount, SagaFilter, SagaInsert, SagaSave, SagaSql, SagaStore, Started,
    bind_instance, bind_progress, command_round, definition_version, started,
};
use crate::month::Month;
use crate::saga::history::{self, HistoryEntry, SagaEvent};
use crate::saga::versions::RegisterError;
use crate::saga::{SagaDefinition, SagaInstance};
use crate::store::PostgresStore;

/// The `started` event of the saga a PostgreSQL insert's `saga` CTE returned.
macro_rules! pg_started_event {
    () => {
        "INSERT INTO {schema}.sagabox_saga_events (saga_id, saga_created_at, version, ordinal, at, kind) \
         SELECT id, created_at, 0, 0, $8, 'started' FROM saga"
    };
}

/// Inserts the saga and its `started` event in one statement.
const INSERT: &str = concat!(
    "WITH saga AS (",
    insert_saga!(),
    " RETURNING id, created_at) ",
    pg_started_event!()
);
/// [`INSERT`] for many sagas at once, from arrays of each column in `saga_columns!`'s
/// order.
const INSERT_ALL: &str = concat!(
    "WITH saga AS (INSERT INTO {schema}.sagabox_saga_instances (",
    saga_columns!(),
    ", finished_at) SELECT i.*, ",
    finished_at!("i.status", "i.updated_at"),
    " FROM unnest($1::text[], $2::text[], $3::text[], $4::integer[], $5::integer[], \
        $6::jsonb[], $7::timestamptz[], $8::timestamptz[], $9::text[], $10::integer[], \
        $11::text[], $12::timestamptz[], $13::integer[]) AS i(",
    saga_columns!(),
    ") RETURNING id, created_at, updated_at) \
    INSERT INTO {schema}.sagabox_saga_events (saga_id, saga_created_at, version, ordinal, at, kind) \
    SELECT id, created_at, 0, 0, updated_at, 'started' FROM saga"
);
/// [`INSERT`], unless a saga with the id is stored: then neither row is written.
const INSERT_IF_ABSENT: &str = concat!(
    "WITH saga AS (",
    insert_saga!(),
    " ON CONFLICT (id) DO NOTHING RETURNING id, created_at) ",
    pg_started_event!()
);
/// Saves the state alone, for a save without events.
const UPDATE: &str = save_progress!();
/// Finished sagas per minute (as seconds since the epoch) and status.
const FINISHED_PER_MINUTE: &str = "SELECT \
    CAST(floor(extract(epoch FROM finished_at) / 60) * 60 AS BIGINT) AS minute, status, \
    COUNT(*) AS sagas FROM {schema}.sagabox_saga_instances \
    WHERE finished_at >= $1 \
    GROUP BY 1, 2 ORDER BY 1, 2";
/// Saves the state and its events in one statement: no event row without the state's
/// update, which the version fence may refuse.
const SAVE: &str = concat!(
    "WITH saga AS (",
    save_progress!(),
    " RETURNING id, created_at, version) \
    INSERT INTO {schema}.sagabox_saga_events (saga_id, saga_created_at, version, ordinal, at, kind, \
        step, direction, attempt, duration_ms, detail) \
    SELECT saga.id, saga.created_at, saga.version, e.ordinal, e.at, e.kind, e.step, \
        e.direction, e.attempt, e.duration_ms, e.detail \
    FROM saga CROSS JOIN jsonb_to_recordset($12) AS e(ordinal integer, at timestamptz, \
        kind text, step text, direction text, attempt integer, duration_ms bigint, detail text)"
);

/// Saves a batch of sagas in one statement: each row's state fenced by its version, as
/// [`SAVE`] fences one, and each written row's events inserted with it; returns the ids
/// of the rows written.
const SAVE_BATCH: &str = concat!(
    "WITH input AS (\
    SELECT * FROM unnest($1::text[], $2::text[], $3::integer[], $4::integer[], $5::jsonb[], \
        $6::timestamptz[], $7::text[], $8::bigint[], $9::text[], $10::timestamptz[], \
        $11::integer[], $12::jsonb[]) \
    AS i(id, status, current_step, attempts, data, updated_at, last_error, version, \
        parked_reason, deadline_at, command_round, events)), \
saga AS (UPDATE {schema}.sagabox_saga_instances s SET status = i.status, \
    current_step = i.current_step, attempts = i.attempts, data = i.data, \
    updated_at = i.updated_at, last_error = i.last_error, parked_reason = i.parked_reason, \
    deadline_at = i.deadline_at, command_round = i.command_round, finished_at = ",
    finished_at!("i.status", "i.updated_at"),
    ", version = s.version + 1 \
    FROM input i WHERE s.id = i.id AND s.version = i.version \
    RETURNING s.id, s.created_at, s.version, i.events), \
history AS (INSERT INTO {schema}.sagabox_saga_events (saga_id, saga_created_at, version, \
        ordinal, at, kind, step, direction, attempt, duration_ms, detail) \
    SELECT saga.id, saga.created_at, saga.version, e.ordinal, e.at, e.kind, e.step, \
        e.direction, e.attempt, e.duration_ms, e.detail \
    FROM saga CROSS JOIN jsonb_to_recordset(saga.events) AS e(ordinal integer, \
        at timestamptz, kind text, step text, direction text, attempt integer, \
        duration_ms bigint, detail text)) \
SELECT id FROM saga"
);

impl SagaInsert for PostgresStore {
    type SagaDb = sqlx::Postgres;

    async fn insert(
        &self,
        conn: &mut sqlx::PgConnection,
        instance: &SagaInstance,
    ) -> Result<(), sqlx::Error> {
        bind_instance(
            sqlx::query(AssertSqlSafe(self.schema().sql(INSERT))),
            instance,
        )
        .execute(&mut *conn)
        .await?;
        Ok(())
    }

    async fn insert_all(
        &self,
        conn: &mut sqlx::PgConnection,
        instances: &[SagaInstance],
    ) -> Result<(), sqlx::Error> {
        if instances.is_empty() {
            return Ok(());
        }
        let rows = instances;
        sqlx::query(AssertSqlSafe(self.schema().sql(INSERT_ALL)))
            .bind(rows.iter().map(|i| i.id.as_str()).collect::<Vec<_>>())
            .bind(
                rows.iter()
                    .map(|i| i.saga_name.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(rows.iter().map(|i| i.status.as_str()).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.current_step).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.attempts).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| Json(&i.data)).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.created_at).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.updated_at).collect::<Vec<_>>())
            .bind(
                rows.iter()
                    .map(|i| i.last_error.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(rows.iter().map(definition_version).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.parked.as_deref()).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.deadline_at).collect::<Vec<_>>())
            .bind(rows.iter().map(command_round).collect::<Vec<_>>())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// The statement that writes one save: `instance`'s progress fenced by its version, and
/// `events` with it ([`SAVE`]), or the progress alone ([`UPDATE`]). It touches one row
/// when the save is written, none when the version moved on.
fn save_statement<'q>(
    store: &PostgresStore,
    instance: &'q SagaInstance,
    events: &[SagaEvent],
) -> BoundQuery<'q, Postgres> {
    let sql = if events.is_empty() { UPDATE } else { SAVE };
    let query = bind_progress(
        sqlx::query(AssertSqlSafe(store.schema().sql(sql))),
        instance,
    );
    if events.is_empty() {
        query
    } else {
        query.bind(Json(history::rows(events)))
    }
}

/// Writes each save of `batch` (sorted by saga id) with its own statement, in one
/// transaction.
async fn save_each(store: &PostgresStore, batch: &mut [SagaSave]) -> Result<(), sqlx::Error> {
    let mut tx = store.pool().begin().await?;
    let mut written = Vec::with_capacity(batch.len());
    for save in batch.iter() {
        let statement = save_statement(store, &save.instance, &save.events);
        written.push(statement.execute(&mut *tx).await?.rows_affected() > 0);
    }
    tx.commit().await?;
    for (save, written) in batch.iter_mut().zip(written) {
        save.written = written;
        if written {
            save.instance.version += 1;
        }
    }
    Ok(())
}

impl SagaStore for PostgresStore {
    async fn create_if_absent(&self, instance: &SagaInstance) -> Result<Started, sqlx::Error> {
        for _ in 0..CREATE_ATTEMPTS {
            let inserted = bind_instance(
                sqlx::query(AssertSqlSafe(self.schema().sql(INSERT_IF_ABSENT))),
                instance,
            )
            .execute(self.pool())
            .await?
            .rows_affected()
                == 1;
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
        let written = save_statement(self, instance, events)
            .execute(self.pool())
            .await?
            .rows_affected();
        let saved = written > 0;
        if saved {
            instance.version += 1;
        }
        Ok(saved)
    }

    async fn save_batch(&self, batch: &mut [SagaSave]) -> Result<(), sqlx::Error> {
        batch.sort_by(|a, b| a.instance.id.cmp(&b.instance.id));
        if batch
            .windows(2)
            .any(|pair| pair[0].instance.id == pair[1].instance.id)
        {
            // Two saves of one saga: the second is fenced by the first's version, which
            // one statement cannot see. A driver saves one at a time, so this is rare.
            return save_each(self, batch).await;
        }
        // One statement for the batch: one round trip, one plan, one commit.
        let rows: Vec<_> = batch.iter().map(|save| &save.instance).collect();
        let events: Vec<_> = batch
            .iter()
            .map(|save| Json(history::rows(&save.events)))
            .collect();
        let written: Vec<String> = sqlx::query_scalar(AssertSqlSafe(self.schema().sql(SAVE_BATCH)))
            .bind(rows.iter().map(|i| i.id.as_str()).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.status.as_str()).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.current_step).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.attempts).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| Json(&i.data)).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.updated_at).collect::<Vec<_>>())
            .bind(
                rows.iter()
                    .map(|i| i.last_error.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(rows.iter().map(|i| i.version).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.parked.as_deref()).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| i.deadline_at).collect::<Vec<_>>())
            .bind(rows.iter().map(|i| command_round(i)).collect::<Vec<_>>())
            .bind(events)
            .fetch_all(self.pool())
            .await?;
        let written: HashSet<String> = written.into_iter().collect();
        for save in batch.iter_mut() {
            save.written = written.contains(save.instance.id.as_str());
            if save.written {
                save.instance.version += 1;
            }
        }
        Ok(())
    }

    async fn prepare_history(&self, months: &[Month]) -> Result<Vec<Month>, sqlx::Error> {
        let mut created = Vec::new();
        for &month in months {
            let name = self
                .schema()
                .table(&format!("{HISTORY_PARTITION_PREFIX}{}", month.suffix()));
            let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(&name)
                .fetch_one(self.pool())
                .await?;
            if exists {
                continue;
            }
            let Some(next) = month.next() else { continue };
            // The bounds are dates the program formats, never input.
            let create = format!(
                "CREATE TABLE {name} PARTITION OF {} \
                 FOR VALUES FROM ('{}') TO ('{}')",
                self.schema().table("sagabox_saga_events"),
                month.start().format("%Y-%m-%d %H:%M:%S+00"),
                next.start().format("%Y-%m-%d %H:%M:%S+00"),
            );
            match sqlx::raw_sql(sqlx::AssertSqlSafe(create))
                .execute(self.pool())
                .await
            {
                Ok(_) => created.push(month),
                // Rows of the month are in the default partition already (a saga created
                // with a clock ahead), or another instance created it just now: either
                // way the month's rows have a home.
                Err(error) => {
                    tracing::debug!(%month, %error, "saga history partition not created");
                }
            }
        }
        Ok(created)
    }

    async fn prune_history(
        &self,
        before: Month,
        dry_run: bool,
    ) -> Result<HistoryPruned, sqlx::Error> {
        let partitions: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = to_regclass($1) ORDER BY 1",
        )
        .bind(self.schema().table("sagabox_saga_events"))
        .fetch_all(self.pool())
        .await?;
        let mut pruned = HistoryPruned::default();
        let mut in_dropped = 0;
        for name in partitions {
            let Some(month) = Month::from_table_name(HISTORY_PARTITION_PREFIX, &name) else {
                continue;
            };
            if month >= before {
                continue;
            }
            let unfinished: bool = sqlx::query_scalar(AssertSqlSafe(self.schema().sql(
                "SELECT EXISTS (SELECT 1 FROM {schema}.sagabox_saga_instances WHERE created_at >= $1 \
                 AND created_at < $2 AND status IN ('running', 'compensating'))",
            )))
            .bind(month.start())
            .bind(month.end())
            .fetch_one(self.pool())
            .await?;
            if unfinished {
                continue;
            }
            if dry_run {
                // Counted below with the rows a real pass deletes one by one.
                let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM {}",
                    self.schema().table(&name)
                )))
                .fetch_one(self.pool())
                .await?;
                in_dropped += u64::try_from(rows).unwrap_or(0);
            } else {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP TABLE {}",
                    self.schema().table(&name)
                )))
                .execute(self.pool())
                .await?;
            }
            pruned.months_dropped.push(month);
        }
        pruned.rows_deleted = self
            .delete_finished_history(before, dry_run)
            .await?
            .saturating_sub(in_dropped);
        Ok(pruned)
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

impl PostgresStore {
    /// The queries both databases run alike, on this store.
    fn saga_sql(&self) -> SagaSql<'_, Postgres> {
        SagaSql {
            pool: self.pool(),
            schema: self.schema(),
            finished_per_minute: FINISHED_PER_MINUTE,
        }
    }
    /// Deletes (or, dry, counts) the history rows of finished sagas created before
    /// `before` that the partitions dropped whole did not take: the default partition's,
    /// and months with an unfinished saga.
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
