//! A store chosen at run time from a database URL: [`AnyStore`], what a command that
//! works on any database holds once it has opened one. It implements [`SagaStore`] by
//! handing each call to the store of the database the URL named, so the code that
//! lists, shows, retries or cancels sagas is written once and never asks which database
//! it runs on. What needs one database type — the inbox's transactions, a saga inserted
//! beside the caller's writes — takes the concrete store ([`PostgresStore`],
//! [`SqliteStore`]): code of that kind is written once as an [`OnStore`] job, generic
//! over the store, and [`AnyStore::run`] runs it on the store the URL named. This file
//! is the one place that matches on the database.

use std::future::Future;

use chrono::{DateTime, Utc};

use crate::inbox::InboxError;
use crate::month::Month;
use crate::saga::versions::RegisterError;
use crate::saga::{
    FinishedMinute, HistoryEntry, HistoryPruned, SagaCount, SagaDefinition, SagaEvent, SagaFilter,
    SagaInsert, SagaInstance, SagaSave, SagaStore, Started,
};
use crate::store::InboxStore;
#[cfg(feature = "postgres")]
use crate::store::PostgresStore;
#[cfg(feature = "sqlite")]
use crate::store::SqliteStore;

/// The store of the database a URL names, opened by
/// [`open_migrated`](crate::database::open_migrated).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyStore {
    /// A PostgreSQL database.
    #[cfg(feature = "postgres")]
    Postgres(PostgresStore),
    /// An SQLite file.
    #[cfg(feature = "sqlite")]
    Sqlite(SqliteStore),
}

/// A store of one database type, as a job given to [`AnyStore::run`] receives it:
/// the inbox's store and the saga store over one database, and its pool for the job's
/// own transactions. Implemented by [`PostgresStore`] and [`SqliteStore`].
pub trait Store: InboxStore + SagaInsert<SagaDb = <Self as InboxStore>::Db> + Clone {
    /// The store's connection pool: begin a transaction on it to write beside the
    /// store's rows ([`SagaInsert::insert`]).
    fn pool(&self) -> &sqlx::Pool<<Self as InboxStore>::Db>;
}

#[cfg(feature = "postgres")]
impl Store for PostgresStore {
    fn pool(&self) -> &sqlx::Pool<sqlx::Postgres> {
        PostgresStore::pool(self)
    }
}

#[cfg(feature = "sqlite")]
impl Store for SqliteStore {
    fn pool(&self) -> &sqlx::Pool<sqlx::Sqlite> {
        SqliteStore::pool(self)
    }
}

/// Work on a store of type `S`, for [`AnyStore::run`] to run on the store of whichever
/// database a URL named: the code that needs one database type (a guard, a transaction)
/// without choosing it. Written once as `impl<S: Store> OnStore<S> for Job`; a job whose
/// own SQL needs more of the database than [`Store`] says (the types it binds and
/// decodes) states it in that `impl`'s `where` clause, which both databases meet.
pub trait OnStore<S: Store>: Send {
    /// What the work returns.
    type Output: Send;

    /// Runs the work on `store`.
    fn run(self, store: S) -> impl Future<Output = Self::Output> + Send;
}

/// A job [`AnyStore::run`] can run: an [`OnStore`] for the store of every database this
/// build has, returning `O` on each. Implemented for every such job.
#[cfg(all(feature = "postgres", feature = "sqlite"))]
pub trait OnAnyStore<O>:
    OnStore<PostgresStore, Output = O> + OnStore<SqliteStore, Output = O>
{
}

#[cfg(all(feature = "postgres", feature = "sqlite"))]
impl<O, J> OnAnyStore<O> for J where
    J: OnStore<PostgresStore, Output = O> + OnStore<SqliteStore, Output = O>
{
}

/// A job [`AnyStore::run`] can run: an [`OnStore`] for the store of every database this
/// build has, returning `O` on each. Implemented for every such job.
#[cfg(all(feature = "postgres", not(feature = "sqlite")))]
pub trait OnAnyStore<O>: OnStore<PostgresStore, Output = O> {}

#[cfg(all(feature = "postgres", not(feature = "sqlite")))]
impl<O, J: OnStore<PostgresStore, Output = O>> OnAnyStore<O> for J {}

/// A job [`AnyStore::run`] can run: an [`OnStore`] for the store of every database this
/// build has, returning `O` on each. Implemented for every such job.
#[cfg(all(feature = "sqlite", not(feature = "postgres")))]
pub trait OnAnyStore<O>: OnStore<SqliteStore, Output = O> {}

#[cfg(all(feature = "sqlite", not(feature = "postgres")))]
impl<O, J: OnStore<SqliteStore, Output = O>> OnAnyStore<O> for J {}

impl AnyStore {
    /// Opens the store of the database `url` names, with up to `connections`
    /// connections (at most [`SqliteStore::MAX_USEFUL_CONNECTIONS`] on SQLite); on
    /// PostgreSQL sagabox's tables are in `schema` (SQLite has none and ignores it). The file an `sqlite:` URL names is created if missing; for a command
    /// that must find a migrated database, use
    /// [`open_migrated`](crate::database::open_migrated).
    pub async fn connect(
        url: &str,
        connections: u32,
        schema: &crate::schema::Schema,
    ) -> Result<Self, InboxError> {
        match super::Backend::of(url)? {
            #[cfg(feature = "postgres")]
            super::Backend::Postgres => Ok(PostgresStore::connect(url, connections)
                .await?
                .with_schema(schema.clone())
                .into()),
            #[cfg(feature = "sqlite")]
            super::Backend::Sqlite => {
                let _ = schema;
                let connections = connections.min(SqliteStore::MAX_USEFUL_CONNECTIONS);
                Ok(SqliteStore::connect(url, connections).await?.into())
            }
            #[allow(unreachable_patterns)]
            _ => Err(InboxError::UnsupportedUrl(crate::logging::redact(url))),
        }
    }

    /// Runs `job` on the store of the database this one is.
    pub async fn run<O, J: OnAnyStore<O>>(self, job: J) -> O {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => job.run(store).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => job.run(store).await,
        }
    }

    /// What keeps the database from being at this version's migrations, or `None` when
    /// every one has run.
    pub(crate) async fn unapplied_migrations(&self) -> Result<Option<String>, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => {
                let mut conn = store.pool().acquire().await?;
                super::unapplied_postgres(&mut conn, store.schema()).await
            }
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => {
                let mut conn = store.pool().acquire().await?;
                super::unapplied_sqlite(&mut conn).await
            }
        }
    }

    /// `postgres` or `sqlite`: the database behind the store.
    pub fn backend(&self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(_) => "postgres",
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(_) => "sqlite",
        }
    }
}

#[cfg(feature = "postgres")]
impl From<PostgresStore> for AnyStore {
    fn from(store: PostgresStore) -> Self {
        AnyStore::Postgres(store)
    }
}

#[cfg(feature = "sqlite")]
impl From<SqliteStore> for AnyStore {
    fn from(store: SqliteStore) -> Self {
        AnyStore::Sqlite(store)
    }
}

impl SagaStore for AnyStore {
    async fn create_if_absent(&self, instance: &SagaInstance) -> Result<Started, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.create_if_absent(instance).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.create_if_absent(instance).await,
        }
    }

    async fn load(&self, id: &str) -> Result<Option<SagaInstance>, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.load(id).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.load(id).await,
        }
    }

    async fn save(
        &self,
        instance: &mut SagaInstance,
        events: &[SagaEvent],
    ) -> Result<bool, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.save(instance, events).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.save(instance, events).await,
        }
    }

    async fn save_batch(&self, batch: &mut [SagaSave]) -> Result<(), sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.save_batch(batch).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.save_batch(batch).await,
        }
    }

    async fn unfinished(&self, saga_name: &str) -> Result<Vec<String>, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.unfinished(saga_name).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.unfinished(saga_name).await,
        }
    }

    async fn list(&self, filter: &SagaFilter) -> Result<Vec<SagaInstance>, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.list(filter).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.list(filter).await,
        }
    }

    async fn counts(&self) -> Result<Vec<SagaCount>, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.counts().await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.counts().await,
        }
    }

    async fn finished_per_minute(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<FinishedMinute>, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.finished_per_minute(since).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.finished_per_minute(since).await,
        }
    }

    async fn history(&self, id: &str) -> Result<Vec<HistoryEntry>, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.history(id).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.history(id).await,
        }
    }

    async fn register_definition(&self, definition: &SagaDefinition) -> Result<(), RegisterError> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.register_definition(definition).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.register_definition(definition).await,
        }
    }

    async fn prepare_history(&self, months: &[Month]) -> Result<Vec<Month>, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.prepare_history(months).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.prepare_history(months).await,
        }
    }

    async fn prune_history(
        &self,
        before: Month,
        dry_run: bool,
    ) -> Result<HistoryPruned, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.prune_history(before, dry_run).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.prune_history(before, dry_run).await,
        }
    }

    async fn stored_definition(
        &self,
        name: &str,
        version: u32,
    ) -> Result<Option<String>, sqlx::Error> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.stored_definition(name, version).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(store) => store.stored_definition(name, version).await,
        }
    }
}
