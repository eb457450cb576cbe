//! [`SagaStore`]: the SQL that reads and writes saga instances (`sagabox_saga_instances`), their
//! history (`sagabox_saga_events`) and the definition versions the orchestrators have run
//! (`sagabox_saga_definitions`), on PostgreSQL and SQLite.
//!
//! Every write of a saga's state writes its events with it, atomically: on PostgreSQL in
//! one statement (the state's `UPDATE` in a common table expression feeding the events'
//! `INSERT`), on SQLite in one `BEGIN IMMEDIATE` transaction.

use std::future::Future;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::query::Query;
use sqlx::types::Json;
use sqlx::{
    AssertSqlSafe, ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool,
    QueryBuilder, Row, Type,
};

use crate::month::Month;
use crate::saga::history::{HistoryEntry, SagaEvent};
use crate::saga::versions::RegisterError;
use crate::saga::{Direction, EventKind, SagaDefinition, SagaInstance, SagaState, SagaStatus};
use crate::schema::Schema;

/// What [`SagaStore::create_if_absent`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct Started {
    /// The stored saga: the one this call inserted, or the one an earlier start stored.
    pub saga: SagaInstance,
    /// Whether this call inserted it.
    pub created: bool,
}

/// One saga's save in a [`SagaStore::save_batch`].
#[derive(Debug, Clone, PartialEq)]
pub struct SagaSave {
    /// The copy to write, at the version it was read at; its version is bumped when the
    /// batch commits with it written.
    pub instance: SagaInstance,
    /// The events that led to it, stored under its new version (give at least one).
    pub events: Vec<SagaEvent>,
    /// Whether it was written: `false` when another driver or an operator saved the saga
    /// since this copy was read (reload it then), or when the batch failed.
    pub written: bool,
}

impl SagaSave {
    /// `instance` and `events`, not written yet.
    pub fn new(instance: SagaInstance, events: Vec<SagaEvent>) -> Self {
        Self {
            instance,
            events,
            written: false,
        }
    }
}

/// What [`SagaStore::prune_history`] did (or, dry, would do).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HistoryPruned {
    /// Months whose partition was dropped whole.
    pub months_dropped: Vec<Month>,
    /// Rows deleted one by one (SQLite; PostgreSQL's default partition and months with an
    /// unfinished saga).
    pub rows_deleted: u64,
}

/// How long the history of a finished saga is kept by default: 90 days.
pub const DEFAULT_HISTORY_RETENTION: std::time::Duration =
    std::time::Duration::from_secs(90 * 24 * 3600);

/// One pass over the saga history as of `now`: creates the partitions of the current
/// month and `months_ahead` more ([`SagaStore::prepare_history`], not when `dry_run`),
/// then prunes the history of finished sagas created in months wholly older than
/// `retention` ([`SagaStore::prune_history`]): a month goes once all of it is older.
pub async fn history_pass<St: SagaStore>(
    store: &St,
    now: DateTime<Utc>,
    retention: std::time::Duration,
    months_ahead: u32,
    dry_run: bool,
) -> Result<HistoryPruned, sqlx::Error> {
    let bad_time = |error: crate::month::MonthError| sqlx::Error::Decode(Box::new(error));
    if !dry_run {
        let months = history_months(now, months_ahead).map_err(bad_time)?;
        store.prepare_history(&months).await?;
    }
    let retention = chrono::TimeDelta::from_std(retention).unwrap_or(chrono::TimeDelta::MAX);
    let oldest_kept = now
        .checked_sub_signed(retention)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let before = Month::of(oldest_kept).map_err(bad_time)?;
    store.prune_history(before, dry_run).await
}

/// The months whose history partitions should exist at `now`: the current one and
/// `months_ahead` more.
pub(crate) fn history_months(
    now: DateTime<Utc>,
    months_ahead: u32,
) -> Result<Vec<Month>, crate::month::MonthError> {
    let current = Month::of(now)?;
    Ok(current.through(current.plus(months_ahead)).collect())
}

/// The prefix of the history's monthly partitions: `sagabox_saga_events_YYYY_MM`.
pub const HISTORY_PARTITION_PREFIX: &str = "sagabox_saga_events_";

/// Which sagas [`SagaStore::list`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SagaFilter {
    /// Only sagas in this state; `None` for all. Defaults to `None`.
    pub state: Option<SagaState>,
    /// Only sagas of this definition; `None` for all. Defaults to `None`.
    pub saga_name: Option<String>,
    /// Only sagas created at or after this instant; `None` for any age. Defaults to `None`.
    pub created_since: Option<DateTime<Utc>>,
    /// Only sagas listed after this one, newest first: the next page of a listing whose
    /// last saga this was. A cursor rather than an offset, so that a page deep into a
    /// large table costs what the first one does. Defaults to `None`.
    pub after: Option<SagaCursor>,
    /// At most this many, newest first. Defaults to 100.
    pub limit: u32,
}

impl Default for SagaFilter {
    fn default() -> Self {
        Self {
            state: None,
            saga_name: None,
            created_since: None,
            after: None,
            limit: 100,
        }
    }
}

/// Where a page of [`SagaStore::list`] ended: the last saga it listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SagaCursor {
    /// The saga's creation time.
    pub created_at: DateTime<Utc>,
    /// The saga's id, which orders sagas created at the same instant.
    pub id: String,
}

impl SagaCursor {
    /// The cursor just past `saga`.
    pub fn of(saga: &SagaInstance) -> Self {
        Self {
            created_at: saga.created_at,
            id: saga.id.clone(),
        }
    }
}

/// How many sagas of one definition are in one state ([`SagaStore::counts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SagaCount {
    /// The definition's name.
    pub saga_name: String,
    /// The state; parked sagas are counted apart from their status.
    pub state: SagaState,
    /// How many.
    pub sagas: i64,
}

/// How many sagas ended in one status within one minute
/// ([`SagaStore::finished_per_minute`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedMinute {
    /// The minute's first instant.
    pub minute: DateTime<Utc>,
    /// `completed` or `compensated`.
    pub status: SagaStatus,
    /// Sagas whose last change, the one that finished them, fell in that minute.
    pub sagas: i64,
}

/// Where saga instances, their history and their definitions are stored: the same
/// database as the inbox, so the demo can create an order and its saga in one
/// transaction.
pub trait SagaStore: Clone + Send + Sync + 'static {
    /// Inserts `instance` unless a saga with its id is stored already, and returns the
    /// stored one either way: the idempotent start ([`SagaInstance::from_start`]).
    ///
    /// Atomic under any number of concurrent callers, in one process or many: the
    /// insert is an `INSERT … ON CONFLICT (id) DO NOTHING`, which waits for a racing
    /// insert of the same id to commit (or roll back) before it decides, and only when
    /// it inserted nothing is the row read back. Exactly one caller gets
    /// `created: true` (and writes the `started` event); every caller gets the same
    /// saga. Fails with [`sqlx::Error::RowNotFound`] only if the saga it lost to is
    /// deleted before it can be read, again and again.
    fn create_if_absent(
        &self,
        instance: &SagaInstance,
    ) -> impl Future<Output = Result<Started, sqlx::Error>> + Send;

    /// The instance with `id`, if any.
    fn load(
        &self,
        id: &str,
    ) -> impl Future<Output = Result<Option<SagaInstance>, sqlx::Error>> + Send;

    /// Writes `instance`'s progress and `events` if the stored row is still at
    /// `instance.version`, and bumps both; returns `false`, writing nothing, when another
    /// driver or an operator saved since this copy was loaded — reload it then. The
    /// events are stored under the new version, atomically with the state: give at
    /// least one, so that every version of the saga has its entry in the history.
    fn save(
        &self,
        instance: &mut SagaInstance,
        events: &[SagaEvent],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Writes every save of `batch` as [`save`](Self::save) would — each checked against
    /// its own saga's version, a refused one left unwritten — in one transaction: one
    /// commit for them all. The batch is sorted by saga id; SQLite writes it save by save
    /// in that order, PostgreSQL in one statement over it. A failure (a deadlock with
    /// another writer included) rolls the whole batch back: nothing is written, every
    /// `written` stays `false`, no version moves.
    fn save_batch(
        &self,
        batch: &mut [SagaSave],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The ids of every instance of `saga_name` not yet completed or compensated, and
    /// not parked, oldest first.
    fn unfinished(
        &self,
        saga_name: &str,
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send;

    /// Sagas matching `filter`, newest first.
    fn list(
        &self,
        filter: &SagaFilter,
    ) -> impl Future<Output = Result<Vec<SagaInstance>, sqlx::Error>> + Send;

    /// How many sagas there are, per definition and state: one row per pair that has any.
    fn counts(&self) -> impl Future<Output = Result<Vec<SagaCount>, sqlx::Error>> + Send;

    /// Sagas finished (completed or compensated) since `since`, per minute of their
    /// finish and status (set by the save that finished each), oldest first: minutes with
    /// none are left out.
    fn finished_per_minute(
        &self,
        since: DateTime<Utc>,
    ) -> impl Future<Output = Result<Vec<FinishedMinute>, sqlx::Error>> + Send;

    /// The history of saga `id`, oldest first: empty for an unknown id.
    fn history(
        &self,
        id: &str,
    ) -> impl Future<Output = Result<Vec<HistoryEntry>, sqlx::Error>> + Send;

    /// Stores `definition` under its name and version unless stored already. Refuses a
    /// definition whose name and version are stored with other content.
    fn register_definition(
        &self,
        definition: &SagaDefinition,
    ) -> impl Future<Output = Result<(), RegisterError>> + Send;

    /// Creates the history's partitions for `months` that do not exist yet (PostgreSQL;
    /// SQLite keeps its history in one table and creates nothing). A month whose rows
    /// already sit in the default partition is left to it. Returns the months created.
    fn prepare_history(
        &self,
        months: &[Month],
    ) -> impl Future<Output = Result<Vec<Month>, sqlx::Error>> + Send;

    /// Prunes the history of sagas created before `before` (the start of a month) that
    /// are finished: whole monthly partitions dropped where every saga of the month is
    /// finished (PostgreSQL), the rest deleted. With `dry_run`, only counts. Unfinished
    /// sagas keep their history, however old.
    fn prune_history(
        &self,
        before: Month,
        dry_run: bool,
    ) -> impl Future<Output = Result<HistoryPruned, sqlx::Error>> + Send;

    /// The canonical TOML stored for `name`'s version `version`, if any.
    fn stored_definition(
        &self,
        name: &str,
        version: u32,
    ) -> impl Future<Output = Result<Option<String>, sqlx::Error>> + Send;
}

/// A saga store of one database type, whose sagas can be inserted with the caller's
/// connection: inside the caller's transaction, beside the caller's own writes (an order
/// and the saga that handles it, committed together). [`SagaStore`] holds what needs no
/// connection of the caller's, so a store chosen at run time ([`AnyStore`]) implements
/// it too.
///
/// [`AnyStore`]: crate::database::AnyStore
pub trait SagaInsert: SagaStore {
    /// The database.
    type SagaDb: Database;

    /// Inserts `instance`, and its `started` event, with the caller's connection (inside
    /// the caller's transaction, if it has one).
    fn insert(
        &self,
        conn: &mut <Self::SagaDb as Database>::Connection,
        instance: &SagaInstance,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Inserts every saga of `instances` as [`insert`](Self::insert) inserts one, with
    /// the caller's connection: for a caller that places many sagas in one transaction
    /// (a group commit of starts). PostgreSQL writes them with one statement; the
    /// default inserts them one by one.
    fn insert_all(
        &self,
        conn: &mut <Self::SagaDb as Database>::Connection,
        instances: &[SagaInstance],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
        async move {
            for instance in instances {
                self.insert(&mut *conn, instance).await?;
            }
            Ok(())
        }
    }
}

/// The columns of a saga row, in the order every read and insert names them.
macro_rules! saga_columns {
    () => {
        "id, saga_name, status, current_step, attempts, data, created_at, updated_at, \
         last_error, definition_version, parked_reason, deadline_at, command_round"
    };
}

/// `finished_at` as every write of a saga row sets it from the row's `status` and
/// `at` (its `updated_at`): the time of the write that finished the saga, NULL while it
/// runs. Only the write that finishes a saga changes it, so an index on it keeps no
/// other save out of PostgreSQL's heap-only updates.
macro_rules! finished_at {
    ($status:literal, $at:literal) => {
        concat!(
            "CASE WHEN ",
            $status,
            " IN ('completed', 'compensated') THEN ",
            $at,
            " END"
        )
    };
}

/// Inserts a saga row; binds in `bind_instance`'s order.
macro_rules! insert_saga {
    () => {
        concat!(
            "INSERT INTO {schema}.sagabox_saga_instances (",
            saga_columns!(),
            ", finished_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, ",
            finished_at!("$3", "$8"),
            ")"
        )
    };
}

/// Writes a save's progress behind the version fence (`$8`, the version it read).
macro_rules! save_progress {
    () => {
        concat!(
            "UPDATE {schema}.sagabox_saga_instances SET status = $2, current_step = $3, attempts = $4, data = $5, \
             updated_at = $6, last_error = $7, parked_reason = $9, deadline_at = $10, \
             command_round = $11, finished_at = ",
            finished_at!("$2", "$6"),
            ", version = version + 1 WHERE id = $1 AND version = $8"
        )
    };
}

/// How many times [`SagaStore::create_if_absent`] inserts again when the saga it lost to
/// was deleted before it could read it back.
const CREATE_ATTEMPTS: usize = 3;
const SELECT: &str = concat!(
    "SELECT ",
    saga_columns!(),
    ", version FROM {schema}.sagabox_saga_instances WHERE id = $1"
);
const UNFINISHED: &str = "SELECT id FROM {schema}.sagabox_saga_instances WHERE saga_name = $1 \
    AND status IN ('running', 'compensating') AND parked_reason IS NULL ORDER BY created_at, id";
/// The start of [`SagaStore::list`]'s query, to which it adds only the filters given
/// (each an `AND …`), so each filter is an index condition and the page cursor a range
/// on `(created_at, id)`, however deep the page.
const LIST_SELECT: &str = concat!(
    "SELECT ",
    saga_columns!(),
    ", version FROM {schema}.sagabox_saga_instances WHERE TRUE"
);
/// Sagas per definition and state.
const COUNTS: &str = "SELECT saga_name, status, parked_reason IS NOT NULL AS parked, \
    COUNT(*) AS sagas FROM {schema}.sagabox_saga_instances GROUP BY saga_name, status, parked_reason IS NOT NULL";
const HISTORY: &str = "SELECT version, at, kind, step, direction, attempt, duration_ms, detail \
    FROM {schema}.sagabox_saga_events WHERE saga_id = $1 ORDER BY version, ordinal";
const REGISTER: &str = "INSERT INTO {schema}.sagabox_saga_definitions \
    (name, version, fingerprint, definition, first_seen) VALUES ($1, $2, $3, $4, $5) \
    ON CONFLICT (name, version) DO NOTHING";
const STORED_FINGERPRINT: &str =
    "SELECT fingerprint FROM {schema}.sagabox_saga_definitions WHERE name = $1 AND version = $2";
const STORED_DEFINITION: &str =
    "SELECT definition FROM {schema}.sagabox_saga_definitions WHERE name = $1 AND version = $2";

fn from_row<R: Row>(row: &R) -> Result<SagaInstance, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Json<Value>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> DateTime<Utc>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<DateTime<Utc>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let status: String = row.try_get("status")?;
    let definition_version: i32 = row.try_get("definition_version")?;
    let command_round: i32 = row.try_get("command_round")?;
    Ok(SagaInstance {
        id: row.try_get("id")?,
        saga_name: row.try_get("saga_name")?,
        status: status
            .parse()
            .map_err(|error| sqlx::Error::Decode(Box::new(error)))?,
        current_step: row.try_get("current_step")?,
        attempts: row.try_get("attempts")?,
        data: row.try_get::<Json<Value>, _>("data")?.0,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        last_error: row.try_get("last_error")?,
        version: row.try_get("version")?,
        definition_version: u32::try_from(definition_version)
            .map_err(|error| sqlx::Error::Decode(Box::new(error)))?,
        parked: row.try_get("parked_reason")?,
        deadline_at: row.try_get("deadline_at")?,
        command_round: u32::try_from(command_round)
            .map_err(|error| sqlx::Error::Decode(Box::new(error)))?,
    })
}

fn entry_from_row<R: Row>(row: &R) -> Result<HistoryEntry, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i32>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> DateTime<Utc>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let decode = |error: Box<dyn std::error::Error + Send + Sync>| sqlx::Error::Decode(error);
    let kind: String = row.try_get("kind")?;
    let direction: Option<String> = row.try_get("direction")?;
    let duration_ms: Option<i64> = row.try_get("duration_ms")?;
    Ok(HistoryEntry {
        version: row.try_get("version")?,
        event: SagaEvent {
            at: row.try_get("at")?,
            kind: kind
                .parse::<EventKind>()
                .map_err(|error| decode(Box::new(error)))?,
            step: row.try_get("step")?,
            direction: direction
                .map(|text| text.parse::<Direction>())
                .transpose()
                .map_err(|error| decode(Box::new(error)))?,
            attempt: row.try_get("attempt")?,
            duration: duration_ms
                .map(|ms| std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
            detail: row.try_get("detail")?,
        },
    })
}

/// The list filter's status and parked parameters.
fn state_params(filter: &SagaFilter) -> (Option<&'static str>, Option<bool>) {
    match filter.state {
        None => (None, None),
        Some(SagaState::Parked) => (None, Some(true)),
        Some(SagaState::Status(status)) if status.is_terminal() => (Some(status.as_str()), None),
        Some(SagaState::Status(status)) => (Some(status.as_str()), Some(false)),
    }
}

fn definition_version(instance: &SagaInstance) -> i32 {
    i32::try_from(instance.definition_version).unwrap_or(i32::MAX)
}

fn command_round(instance: &SagaInstance) -> i32 {
    i32::try_from(instance.command_round).unwrap_or(i32::MAX)
}

/// The history rows of finished sagas created before a month's start.
const FINISHED_HISTORY: &str = "FROM {schema}.sagabox_saga_events WHERE saga_created_at < $1 \
    AND NOT EXISTS (SELECT 1 FROM {schema}.sagabox_saga_instances s \
    WHERE s.id = sagabox_saga_events.saga_id AND s.status IN ('running', 'compensating'))";

/// The queries both databases run alike, on a store's pool and tables: written once,
/// generic over the database, with what sqlx needs of the database said once, here.
/// Each store's [`SagaStore`] methods hand these to it.
struct SagaSql<'a, DB: Database> {
    pool: &'a Pool<DB>,
    schema: &'a Schema,
    /// The database's query of finished sagas per minute, the one that differs.
    finished_per_minute: &'static str,
}

impl<DB> SagaSql<'_, DB>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    usize: ColumnIndex<DB::Row>,
    for<'r> &'r str: ColumnIndex<DB::Row>,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> String: Encode<'t, DB> + Decode<'t, DB> + Type<DB>,
    for<'t> i32: Encode<'t, DB> + Decode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Decode<'t, DB> + Type<DB>,
    for<'t> bool: Decode<'t, DB> + Type<DB>,
    for<'t> DateTime<Utc>: Encode<'t, DB> + Decode<'t, DB> + Type<DB>,
    for<'t> Option<DateTime<Utc>>: Decode<'t, DB> + Type<DB>,
    for<'t> Option<String>: Decode<'t, DB> + Type<DB>,
    for<'t> Option<i32>: Decode<'t, DB> + Type<DB>,
    for<'t> Option<i64>: Decode<'t, DB> + Type<DB>,
    for<'t> Json<Value>: Decode<'t, DB> + Type<DB>,
{
    async fn load(&self, id: &str) -> Result<Option<SagaInstance>, sqlx::Error> {
        let row = sqlx::query(AssertSqlSafe(self.schema.sql(SELECT)))
            .bind(id)
            .fetch_optional(self.pool)
            .await?;
        row.as_ref().map(from_row).transpose()
    }

    async fn unfinished(&self, saga_name: &str) -> Result<Vec<String>, sqlx::Error> {
        sqlx::query_scalar(AssertSqlSafe(self.schema.sql(UNFINISHED)))
            .bind(saga_name)
            .fetch_all(self.pool)
            .await
    }

    async fn list(&self, filter: &SagaFilter) -> Result<Vec<SagaInstance>, sqlx::Error> {
        let mut query = QueryBuilder::<DB>::new(self.schema.sql(LIST_SELECT));
        push_list_filters(&mut query, filter);
        let rows = query.build().fetch_all(self.pool).await?;
        rows.iter().map(from_row).collect()
    }

    async fn counts(&self) -> Result<Vec<SagaCount>, sqlx::Error> {
        let rows = sqlx::query(AssertSqlSafe(self.schema.sql(COUNTS)))
            .fetch_all(self.pool)
            .await?;
        rows.iter().map(count_from_row).collect()
    }

    async fn finished_per_minute(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<FinishedMinute>, sqlx::Error> {
        let rows = sqlx::query(AssertSqlSafe(self.schema.sql(self.finished_per_minute)))
            .bind(since)
            .fetch_all(self.pool)
            .await?;
        rows.iter().map(minute_from_row).collect()
    }

    async fn history(&self, id: &str) -> Result<Vec<HistoryEntry>, sqlx::Error> {
        let rows = sqlx::query(AssertSqlSafe(self.schema.sql(HISTORY)))
            .bind(id)
            .fetch_all(self.pool)
            .await?;
        rows.iter().map(entry_from_row).collect()
    }

    async fn register_definition(&self, definition: &SagaDefinition) -> Result<(), RegisterError> {
        let version = stored_version(definition.version());
        sqlx::query(AssertSqlSafe(self.schema.sql(REGISTER)))
            .bind(definition.name())
            .bind(version)
            .bind(definition.fingerprint())
            .bind(definition.to_canonical_toml())
            .bind(Utc::now())
            .execute(self.pool)
            .await?;
        let stored: String = sqlx::query_scalar(AssertSqlSafe(self.schema.sql(STORED_FINGERPRINT)))
            .bind(definition.name())
            .bind(version)
            .fetch_one(self.pool)
            .await?;
        check_registered(&stored, definition)
    }

    async fn stored_definition(
        &self,
        name: &str,
        version: u32,
    ) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar(AssertSqlSafe(self.schema.sql(STORED_DEFINITION)))
            .bind(name)
            .bind(stored_version(version))
            .fetch_optional(self.pool)
            .await
    }
}

/// A query of database `DB` whose arguments are bound as it is built.
pub(super) type BoundQuery<'q, DB> = Query<'q, DB, <DB as Database>::Arguments>;

/// Binds an instance's columns to an insert, in the order [`insert_saga!`] names them.
fn bind_instance<'q, DB: Database>(
    query: BoundQuery<'q, DB>,
    instance: &SagaInstance,
) -> BoundQuery<'q, DB>
where
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> Option<&'t str>: Encode<'t, DB> + Type<DB>,
    for<'t> i32: Encode<'t, DB> + Type<DB>,
    for<'t> Json<&'t Value>: Encode<'t, DB> + Type<DB>,
    for<'t> DateTime<Utc>: Encode<'t, DB> + Type<DB>,
    for<'t> Option<DateTime<Utc>>: Encode<'t, DB> + Type<DB>,
{
    query
        .bind(instance.id.as_str())
        .bind(instance.saga_name.as_str())
        .bind(instance.status.as_str())
        .bind(instance.current_step)
        .bind(instance.attempts)
        .bind(Json(&instance.data))
        .bind(instance.created_at)
        .bind(instance.updated_at)
        .bind(instance.last_error.as_deref())
        .bind(definition_version(instance))
        .bind(instance.parked.as_deref())
        .bind(instance.deadline_at)
        .bind(command_round(instance))
}

/// Binds a save's parameters, `$1` to `$11` of [`save_progress!`].
fn bind_progress<'q, DB: Database>(
    query: BoundQuery<'q, DB>,
    instance: &SagaInstance,
) -> BoundQuery<'q, DB>
where
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> Option<&'t str>: Encode<'t, DB> + Type<DB>,
    for<'t> i32: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Type<DB>,
    for<'t> Json<&'t Value>: Encode<'t, DB> + Type<DB>,
    for<'t> DateTime<Utc>: Encode<'t, DB> + Type<DB>,
    for<'t> Option<DateTime<Utc>>: Encode<'t, DB> + Type<DB>,
{
    query
        .bind(instance.id.as_str())
        .bind(instance.status.as_str())
        .bind(instance.current_step)
        .bind(instance.attempts)
        .bind(Json(&instance.data))
        .bind(instance.updated_at)
        .bind(instance.last_error.as_deref())
        .bind(instance.version)
        .bind(instance.parked.as_deref())
        .bind(instance.deadline_at)
        .bind(command_round(instance))
}

/// Adds [`SagaStore::list`]'s filters, order and limit to [`LIST_SELECT`]: only the
/// filters given, each an `AND …`, so each is an index condition and the page cursor a
/// range on `(created_at, id)`, however deep the page.
fn push_list_filters<DB: Database>(query: &mut QueryBuilder<DB>, filter: &SagaFilter)
where
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Type<DB>,
    for<'t> DateTime<Utc>: Encode<'t, DB> + Type<DB>,
{
    let (status, parked) = state_params(filter);
    if let Some(status) = status {
        query.push(" AND status = ").push_bind(status);
    }
    match parked {
        Some(true) => _ = query.push(" AND parked_reason IS NOT NULL"),
        Some(false) => _ = query.push(" AND parked_reason IS NULL"),
        None => {}
    }
    if let Some(name) = &filter.saga_name {
        query.push(" AND saga_name = ").push_bind(name.as_str());
    }
    if let Some(since) = filter.created_since {
        query.push(" AND created_at >= ").push_bind(since);
    }
    if let Some(cursor) = &filter.after {
        query
            .push(" AND (created_at, id) < (")
            .push_bind(cursor.created_at)
            .push(", ")
            .push_bind(cursor.id.as_str())
            .push(")");
    }
    query
        .push(" ORDER BY created_at DESC, id DESC LIMIT ")
        .push_bind(i64::from(filter.limit));
}

/// One row of [`COUNTS`].
fn count_from_row<R: Row>(row: &R) -> Result<SagaCount, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let status: String = row.try_get("status")?;
    let status: SagaStatus = status
        .parse()
        .map_err(|error| sqlx::Error::Decode(Box::new(error)))?;
    let parked: bool = row.try_get("parked")?;
    Ok(SagaCount {
        saga_name: row.try_get("saga_name")?,
        state: if parked {
            SagaState::Parked
        } else {
            SagaState::Status(status)
        },
        sagas: row.try_get("sagas")?,
    })
}

/// One row of a backend's finished-per-minute query: the minute as seconds since the
/// epoch, the status, the count.
fn minute_from_row<R: Row>(row: &R) -> Result<FinishedMinute, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let minute: i64 = row.try_get("minute")?;
    let status: String = row.try_get("status")?;
    Ok(FinishedMinute {
        minute: DateTime::from_timestamp(minute, 0)
            .ok_or_else(|| sqlx::Error::Decode(format!("minute {minute} out of range").into()))?,
        status: status
            .parse()
            .map_err(|error| sqlx::Error::Decode(Box::new(error)))?,
        sagas: row.try_get("sagas")?,
    })
}

/// Whether the fingerprint stored for `definition`'s name and version is its own: a
/// definition changed under an unchanged version is refused.
fn check_registered(stored: &str, definition: &SagaDefinition) -> Result<(), RegisterError> {
    if stored == definition.fingerprint() {
        Ok(())
    } else {
        Err(RegisterError::Changed {
            name: definition.name().to_owned(),
            version: definition.version(),
        })
    }
}

/// A definition's version as stored.
fn stored_version(version: u32) -> i32 {
    i32::try_from(version).unwrap_or(i32::MAX)
}

/// The saga `instance` started: itself when `inserted`, else the stored one read back
/// (`None` when it was deleted since, so the caller inserts again).
async fn started<S: SagaStore>(
    store: &S,
    instance: &SagaInstance,
    inserted: bool,
) -> Result<Option<Started>, sqlx::Error> {
    if inserted {
        return Ok(Some(Started {
            saga: SagaInstance {
                version: 0,
                ..instance.clone()
            },
            created: true,
        }));
    }
    // The conflicting row committed before `DO NOTHING` decided, so a new statement sees
    // it — unless it was deleted since.
    Ok(store.load(&instance.id).await?.map(|saga| Started {
        saga,
        created: false,
    }))
}

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
