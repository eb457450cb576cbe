//! Saga instances as the orchestrator persists them (`saga_instances`), the stable ids of
//! their commands, and [`SagaStore`], the SQL that reads and writes them.

use std::fmt;
use std::future::Future;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{Database, Row};

use crate::envelope::MessageId;

/// Where a saga instance stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SagaStatus {
    /// Running its steps forward.
    Running,
    /// Undoing its completed steps after a step failed for good.
    Compensating,
    /// Every step done.
    Completed,
    /// Every completed step undone.
    Compensated,
}

impl SagaStatus {
    /// The text stored in `saga_instances.status`.
    pub const fn as_str(self) -> &'static str {
        match self {
            SagaStatus::Running => "running",
            SagaStatus::Compensating => "compensating",
            SagaStatus::Completed => "completed",
            SagaStatus::Compensated => "compensated",
        }
    }

    /// Whether the saga is finished.
    pub fn is_terminal(self) -> bool {
        matches!(self, SagaStatus::Completed | SagaStatus::Compensated)
    }
}

impl fmt::Display for SagaStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A status text that is not one of the four.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown saga status {0:?}: expected running, compensating, completed or compensated")]
pub struct UnknownStatus(String);

impl FromStr for SagaStatus {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "running" => Ok(SagaStatus::Running),
            "compensating" => Ok(SagaStatus::Compensating),
            "completed" => Ok(SagaStatus::Completed),
            "compensated" => Ok(SagaStatus::Compensated),
            other => Err(UnknownStatus(other.to_owned())),
        }
    }
}

/// Which way a command goes: the step itself, or its compensation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The step's command.
    Forward,
    /// The step's compensation.
    Backward,
}

/// One saga instance, as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SagaInstance {
    /// The saga instance's id.
    pub id: String,
    /// The definition it runs.
    pub saga_name: String,
    /// Where it stands.
    pub status: SagaStatus,
    /// Running: the step being run. Compensating: the step being undone (−1 when none
    /// is left).
    pub current_step: i32,
    /// Attempts of the current step so far.
    pub attempts: i32,
    /// The saga's input and, under `"steps"`, each step's result.
    pub data: Value,
    /// When the instance was created; also the time inside its command ids.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// The last failure, for people.
    pub last_error: Option<String>,
    /// How many saves this copy has seen; a save from an older copy is refused.
    pub version: i64,
}

impl SagaInstance {
    /// A new running instance at its first step.
    pub fn new(
        id: impl Into<String>,
        saga_name: impl Into<String>,
        data: Value,
        now: DateTime<Utc>,
    ) -> Self {
        Self {
            id: id.into(),
            saga_name: saga_name.into(),
            status: SagaStatus::Running,
            current_step: 0,
            attempts: 0,
            data,
            created_at: now,
            updated_at: now,
            last_error: None,
            version: 0,
        }
    }

    /// The id of the command for `step` in `direction`: the same on every attempt, so a
    /// retry is the same message and the step's inbox applies it once.
    ///
    /// A UUIDv7 whose time is the saga's creation time (so the inbox files every command
    /// of a saga under one stable month, on its fast path) and whose other bits are a
    /// SHA-1 name hash of `(saga id, step, direction)`.
    pub fn command_id(&self, step: usize, direction: Direction) -> MessageId {
        let direction = match direction {
            Direction::Forward => "do",
            Direction::Backward => "undo",
        };
        let name = format!("{}\u{1f}{step}\u{1f}{direction}", self.id);
        MessageId::derive_v7(self.created_at, &name)
    }
}

/// Where saga instances are stored: the same database as the inbox, so the demo can
/// create an order and its saga in one transaction.
pub trait SagaStore: Clone + Send + Sync + 'static {
    /// The database.
    type SagaDb: Database;

    /// Inserts `instance` with the caller's connection (inside the caller's transaction).
    fn insert(
        conn: &mut <Self::SagaDb as Database>::Connection,
        instance: &SagaInstance,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The instance with `id`, if any.
    fn load(
        &self,
        id: &str,
    ) -> impl Future<Output = Result<Option<SagaInstance>, sqlx::Error>> + Send;

    /// Writes `instance`'s progress if the stored row is still at `instance.version`
    /// (and bumps both); returns `false`, writing nothing, when another driver saved
    /// since this copy was loaded — reload it then.
    fn save(
        &self,
        instance: &mut SagaInstance,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// The ids of every instance of `saga_name` not yet completed or compensated,
    /// oldest first.
    fn unfinished(
        &self,
        saga_name: &str,
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send;
}

const INSERT: &str = "INSERT INTO saga_instances \
    (id, saga_name, status, current_step, attempts, data, created_at, updated_at, last_error) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";
const SELECT: &str = "SELECT id, saga_name, status, current_step, attempts, data, created_at, \
    updated_at, last_error, version FROM saga_instances WHERE id = $1";
const UPDATE: &str = "UPDATE saga_instances SET status = $2, current_step = $3, attempts = $4, \
    data = $5, updated_at = $6, last_error = $7, version = version + 1 WHERE id = $1 AND version = $8";
const UNFINISHED: &str = "SELECT id FROM saga_instances \
    WHERE saga_name = $1 AND status IN ('running', 'compensating') ORDER BY created_at, id";

fn from_row<R: Row>(row: &R) -> Result<SagaInstance, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Json<Value>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> DateTime<Utc>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let status: String = row.try_get("status")?;
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
    })
}

macro_rules! saga_store {
    ($store:ty, $db:ty) => {
        impl SagaStore for $store {
            type SagaDb = $db;

            async fn insert(
                conn: &mut <$db as Database>::Connection,
                instance: &SagaInstance,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(INSERT)
                    .bind(&instance.id)
                    .bind(&instance.saga_name)
                    .bind(instance.status.as_str())
                    .bind(instance.current_step)
                    .bind(instance.attempts)
                    .bind(Json(&instance.data))
                    .bind(instance.created_at)
                    .bind(instance.updated_at)
                    .bind(&instance.last_error)
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            }

            async fn load(&self, id: &str) -> Result<Option<SagaInstance>, sqlx::Error> {
                let row = sqlx::query(SELECT)
                    .bind(id)
                    .fetch_optional(self.pool())
                    .await?;
                row.as_ref().map(from_row).transpose()
            }

            async fn save(&self, instance: &mut SagaInstance) -> Result<bool, sqlx::Error> {
                let saved = sqlx::query(UPDATE)
                    .bind(&instance.id)
                    .bind(instance.status.as_str())
                    .bind(instance.current_step)
                    .bind(instance.attempts)
                    .bind(Json(&instance.data))
                    .bind(instance.updated_at)
                    .bind(&instance.last_error)
                    .bind(instance.version)
                    .execute(self.pool())
                    .await?
                    .rows_affected()
                    == 1;
                if saved {
                    instance.version += 1;
                }
                Ok(saved)
            }

            async fn unfinished(&self, saga_name: &str) -> Result<Vec<String>, sqlx::Error> {
                sqlx::query_scalar(UNFINISHED)
                    .bind(saga_name)
                    .fetch_all(self.pool())
                    .await
            }
        }
    };
}

#[cfg(feature = "postgres")]
saga_store!(crate::PostgresStore, sqlx::Postgres);
#[cfg(feature = "sqlite")]
saga_store!(crate::SqliteStore, sqlx::Sqlite);

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn command_ids_are_stable_distinct_uuid_v7_at_the_saga_start() {
        let created = Utc.with_ymd_and_hms(2026, 11, 30, 23, 59, 59).unwrap();
        let saga = SagaInstance::new("saga-1", "checkout", Value::Null, created);
        let forward = saga.command_id(0, Direction::Forward);
        assert_eq!(forward, saga.command_id(0, Direction::Forward));
        assert_ne!(forward, saga.command_id(0, Direction::Backward));
        assert_ne!(forward, saga.command_id(1, Direction::Forward));
        let other = SagaInstance::new("saga-2", "checkout", Value::Null, created);
        assert_ne!(forward, other.command_id(0, Direction::Forward));
        assert_eq!(forward.uuid_v7_time(), Some(created));
    }

    #[test]
    fn statuses_round_trip() {
        for status in [
            SagaStatus::Running,
            SagaStatus::Compensating,
            SagaStatus::Completed,
            SagaStatus::Compensated,
        ] {
            assert_eq!(status.as_str().parse::<SagaStatus>(), Ok(status));
        }
        assert!("done".parse::<SagaStatus>().is_err());
    }
}
