//! The SQL side of the inbox, one backend per database: [`InboxStore`] is what the
//! [`InboxGuard`](crate::InboxGuard) needs from a database, implemented by
//! [`PostgresStore`] (production) and [`SqliteStore`] (the embedded default).
//!
//! The store a URL names, chosen at run time, is
//! [`database::AnyStore`](crate::database::AnyStore).
//!
//! A store does no policy: it claims, records and manages partitions exactly where the
//! guard tells it to. Deciding the month, the TTL and the metrics is the guard's job.

use std::fmt::Debug;
use std::future::Future;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::Transaction;

use crate::envelope::{ConsumerType, MessageId};
use crate::month::Month;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod layout;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "postgres")]
pub(crate) use postgres::MIGRATOR as POSTGRES_MIGRATOR;
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
#[cfg(feature = "sqlite")]
pub(crate) use sqlite::MIGRATOR as SQLITE_MIGRATOR;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;

/// The prefix of every monthly inbox table: `sagabox_inbox_YYYY_MM`.
pub const PARTITION_PREFIX: &str = "sagabox_inbox_";

/// Where one claim looks and where its row goes.
#[derive(Debug, Clone, Copy)]
pub struct ClaimKey<'a> {
    /// Who consumes the message.
    pub consumer_type: &'a ConsumerType,
    /// The message's stable id.
    pub message_id: &'a MessageId,
    /// The monthly partition the row is written to.
    pub bucket: Month,
    /// `false` when [`bucket`](Self::bucket) is derived from the message itself (every
    /// delivery files it there, so probing that one partition suffices); `true` when the
    /// message carries no time and earlier deliveries may sit in any live partition.
    pub probe_all: bool,
}

/// Held by the one instance that runs a maintenance pass ([`InboxStore::try_maintenance_lock`]);
/// [`MaintenanceLock::release`] gives it up. On PostgreSQL it holds the database session
/// that owns the lock, outside any pool: release unlocks and closes it, and a lock
/// dropped without release (a panic, a killed task) closes the session, which frees the
/// lock too — a lock is never left behind in a pool, and an instance that dies releases
/// it with its connection.
pub struct MaintenanceLock {
    session: Session,
}

enum Session {
    NotNeeded,
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgConnection),
}

impl MaintenanceLock {
    /// For a store that needs no lock: its own locking already serialises the passes.
    pub fn not_needed() -> Self {
        Self {
            session: Session::NotNeeded,
        }
    }

    /// The lock held by `session` (a connection outside any pool).
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres(session: sqlx::PgConnection) -> Self {
        Self {
            session: Session::Postgres(session),
        }
    }

    /// Gives the lock up now, so that the next pass of any instance can take it (a
    /// dropped session frees it only once the server has noticed the closed socket).
    pub async fn release(self) {
        match self.session {
            Session::NotNeeded => {}
            #[cfg(feature = "postgres")]
            Session::Postgres(mut session) => {
                use sqlx::Connection;
                let _ = sqlx::query("SELECT pg_advisory_unlock_all()")
                    .execute(&mut session)
                    .await;
                let _ = session.close().await;
            }
        }
    }
}

impl Debug for MaintenanceLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MaintenanceLock")
            .field("session", &!matches!(self.session, Session::NotNeeded))
            .finish()
    }
}

/// What [`InboxStore::create_partition`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionCreation {
    /// The partition was created.
    Created,
    /// It already existed.
    Existed,
    /// The month was already pruned; it is not created again.
    Pruned,
}

/// What the first delivery of a message left in the inbox.
#[derive(Debug, Clone, PartialEq)]
pub struct FirstDelivery {
    /// When it was processed.
    pub processed_at: DateTime<Utc>,
    /// The handler result it recorded.
    pub result: Value,
}

/// What a single claim found.
#[derive(Debug, Clone, PartialEq)]
pub enum Claimed {
    /// No delivery of the key is recorded: the handler runs.
    Fresh {
        /// The claim already wrote the key's row, with a null result, in its own
        /// statement (saving the guard an `INSERT` after the handler).
        row_written: bool,
    },
    /// The key's first delivery is recorded: the handler must not run.
    Duplicate {
        /// The first delivery, whose result answers this one.
        first: FirstDelivery,
        /// The claim already added this delivery to the first one's duplicate count
        /// ([`InboxStore::record_duplicate`]), in its own statement.
        counted: bool,
    },
}

impl Claimed {
    /// What a lookup found: the first delivery, not yet counted, or nothing (the claim
    /// is fresh and its row is still to be written).
    pub fn found(first: Option<FirstDelivery>) -> Self {
        match first {
            Some(first) => Self::Duplicate {
                first,
                counted: false,
            },
            None => Self::Fresh { row_written: false },
        }
    }
}

/// A batch claim: the guard's open transaction and, per key, what its claim found.
pub type BatchClaim<Db> = (Transaction<'static, Db>, Vec<Claimed>);

/// A database the inbox can live in.
///
/// All methods that take a transaction run inside the guard's one transaction; the
/// others run on their own connection.
pub trait InboxStore: Debug + Send + Sync + 'static {
    /// The sqlx database this store talks to; handlers get a transaction of it.
    type Db: sqlx::Database;

    /// The most connections the store's pool holds, for the error that says a claim
    /// found none free. Defaults to `None` (unknown).
    fn pool_size(&self) -> Option<u32> {
        None
    }

    /// Begins the guard's transaction and claims `key` in it: until the transaction
    /// ends no other transaction can claim the key (a racing claim waits). Returns what
    /// the key's first delivery left, or that this delivery is the first.
    ///
    /// With `write_row_at`, a store may write the key's row already (processed at that
    /// time, with a null result) when it can do so in the claim's own statement; it says
    /// so with [`Claimed::Fresh`]`{ row_written: true }`, and the guard then only fills
    /// in a non-null result ([`record_result`](Self::record_result)) instead of
    /// inserting the row after the handler.
    fn begin_claim(
        &self,
        key: &ClaimKey<'_>,
        write_row_at: Option<DateTime<Utc>>,
    ) -> impl Future<Output = Result<(Transaction<'static, Self::Db>, Claimed), sqlx::Error>> + Send;

    /// Records the claimed key with the handler's result. Returns `false` when a row for
    /// the key already exists in the bucket (nothing was written).
    fn record(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        key: &ClaimKey<'_>,
        processed_at: DateTime<Utc>,
        result: &Value,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Sets the handler's result on the row the claim wrote
    /// ([`Claimed::Fresh`]`{ row_written: true }`), inside the claim's transaction.
    fn record_result(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        key: &ClaimKey<'_>,
        result: &Value,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Counts one more duplicate on the row `first` was read from (the key's first
    /// delivery), with `at` as its latest duplicate's time, inside the claim's
    /// transaction. Touches no other row; a row that is gone changes nothing.
    fn record_duplicate(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        key: &ClaimKey<'_>,
        first: &FirstDelivery,
        at: DateTime<Utc>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Begins the guard's transaction for a batch and claims every key in it, waiting for
    /// racing claims of any of them to end. Every key has the same consumer type and
    /// appears once. Returns, in the order of `keys`, what each key's claim found.
    ///
    /// With `write_rows_at`, as in [`begin_claim`](Self::begin_claim), a store may write
    /// fresh keys' rows already (processed at that time, with a null result) and say so
    /// per key with [`Claimed::Fresh`]`{ row_written: true }`; the guard then only fills
    /// in non-null results ([`record_batch_results`](Self::record_batch_results)) and
    /// inserts the rows of the other fresh keys ([`record_batch`](Self::record_batch)).
    ///
    /// Overlapping batches must not deadlock: a store takes the keys' locks in one fixed
    /// order, or only tries them and starts over in that order when one is taken.
    fn begin_batch_claim(
        &self,
        keys: &[ClaimKey<'_>],
        write_rows_at: Option<DateTime<Utc>>,
    ) -> impl Future<Output = Result<BatchClaim<Self::Db>, sqlx::Error>> + Send;

    /// Sets the handler results (`results[i]` for `keys[i]`) on rows the batch's claim
    /// wrote ([`Claimed::Fresh`]`{ row_written: true }`), inside its transaction. Returns
    /// how many rows were updated: fewer than `keys.len()` means a row was not there.
    fn record_batch_results(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        keys: &[ClaimKey<'_>],
        results: &[&Value],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Records every key of a batch claimed by
    /// [`begin_batch_claim`](Self::begin_batch_claim) with its handler result
    /// (`results[i]` for `keys[i]`). Returns how many rows were written: fewer than
    /// `keys.len()` means some key was already recorded.
    fn record_batch(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        keys: &[ClaimKey<'_>],
        processed_at: DateTime<Utc>,
        results: &[&Value],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Creates the partition for `month` unless it exists or the month was already
    /// pruned (a pruned month is never created again).
    fn create_partition(
        &self,
        month: Month,
    ) -> impl Future<Output = Result<PartitionCreation, sqlx::Error>> + Send;

    /// The months that have a partition, oldest first.
    fn partitions(&self) -> impl Future<Output = Result<Vec<Month>, sqlx::Error>> + Send;

    /// Takes the lock that lets one instance at a time run a maintenance pass, without
    /// waiting: `None` when another instance holds it. Several instances of a service
    /// each run a pruner; only the one holding this lock does the pass's work. The
    /// default needs no lock (a store whose own locking serialises the passes, such as
    /// SQLite's single writer).
    fn try_maintenance_lock(
        &self,
    ) -> impl Future<Output = Result<Option<MaintenanceLock>, sqlx::Error>> + Send {
        async { Ok(Some(MaintenanceLock::not_needed())) }
    }

    /// The same as [`try_maintenance_lock`](Self::try_maintenance_lock) for the saga
    /// history's pass, under a lock of its own: an inbox pass and a history pass do
    /// different work, so neither skips because the other holds its lock, in one process
    /// or across instances.
    fn try_history_lock(
        &self,
    ) -> impl Future<Output = Result<Option<MaintenanceLock>, sqlx::Error>> + Send {
        async { Ok(Some(MaintenanceLock::not_needed())) }
    }

    /// Records `month` as pruned, then drops its whole partition (never row by row).
    /// Returns whether it existed.
    fn drop_partition(
        &self,
        month: Month,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Whether `error` says a partition table does not exist (dropped under a claim).
    fn is_missing_partition(error: &sqlx::Error) -> bool;

    /// Runs this backend's embedded migrations into [`schema`](Self::schema), recording
    /// them in [`MIGRATIONS_TABLE`](crate::schema::MIGRATIONS_TABLE) there; moves an
    /// installation of the first release (tables beside the application's, versions in
    /// `_sqlx_migrations`) into that layout first.
    fn migrate(&self) -> impl Future<Output = Result<(), sqlx::migrate::MigrateError>> + Send;

    /// Takes a connection and pings the server: the readiness check
    /// ([`crate::health`]).
    fn ping(&self) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The schema that holds sagabox's tables (PostgreSQL's `sagabox` unless set;
    /// SQLite's `main`). Every statement of the store names it.
    fn schema(&self) -> &crate::schema::Schema;
}
