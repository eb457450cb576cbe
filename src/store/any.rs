//! A store chosen at run time from a database URL: [`AnyStore`], what a command that
//! works on any database holds once it has opened one. It implements [`SagaStore`] by
//! handing each call to the store of the database the URL named, so the code that
//! lists, shows, retries or cancels sagas is written once and never asks which database
//! it runs on. What needs one database type — the inbox's transactions, a saga inserted
//! beside the caller's writes — takes the concrete store ([`PostgresStore`],
//! [`SqliteStore`]).

use chrono::{DateTime, Utc};

use crate::month::Month;
use crate::saga::versions::RegisterError;
use crate::saga::{
    FinishedMinute, HistoryEntry, HistoryPruned, SagaCount, SagaDefinition, SagaEvent, SagaFilter,
    SagaInstance, SagaStore, Started,
};
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

impl AnyStore {
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
