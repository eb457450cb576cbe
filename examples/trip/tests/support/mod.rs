//! [`Backend`]: one trip test body on PostgreSQL and SQLite, over the shared fixtures of
//! the root package's `tests/common` (a fresh database or file per test, migrated,
//! removed on drop) with the trip's tables installed.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;

use sagabox::saga::SagaStore;
use sagabox::{InboxStore, PostgresStore, SqliteStore};
use sagabox_trip::TripDb;
use sqlx::{AssertSqlSafe, Postgres, Sqlite};

use crate::common::{Lite, Pg};

/// One test's database, on either backend.
pub trait Backend: Sized + Send + Sync + 'static {
    /// The database.
    type Db: TripDb;
    /// Its store: the inbox and the sagas.
    type Store: InboxStore<Db = Self::Db> + SagaStore + Clone;
    /// A fresh database with sagabox's migrations and the trip's tables.
    fn create() -> impl Future<Output = Self> + Send;
    /// A new store with a pool of its own.
    fn store(&self, connections: u32) -> impl Future<Output = Self::Store> + Send;
    /// Runs a query returning one integer.
    fn scalar(&self, sql: String) -> impl Future<Output = i64> + Send;
    /// A `FROM` item with every inbox row (`consumer_type`, `duplicates`), all months.
    fn inbox(&self) -> impl Future<Output = String> + Send;
}

impl Backend for Pg {
    type Db = Postgres;
    type Store = PostgresStore;

    async fn create() -> Self {
        let fx = Pg::new().await;
        <Postgres as TripDb>::install(&fx.pool)
            .await
            .expect("trip schema");
        fx
    }

    async fn store(&self, connections: u32) -> PostgresStore {
        Pg::store(self, connections).await
    }

    async fn scalar(&self, sql: String) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.clone()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    }

    async fn inbox(&self) -> String {
        self.inbox_from().await
    }
}

impl Backend for Lite {
    type Db = Sqlite;
    type Store = SqliteStore;

    async fn create() -> Self {
        let fx = Lite::new().await;
        <Sqlite as TripDb>::install(&fx.pool)
            .await
            .expect("trip schema");
        fx
    }

    async fn store(&self, connections: u32) -> SqliteStore {
        Lite::store(self, connections).await
    }

    async fn scalar(&self, sql: String) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.clone()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    }

    async fn inbox(&self) -> String {
        self.inbox_from().await
    }
}
