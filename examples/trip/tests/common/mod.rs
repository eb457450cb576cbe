//! Test databases for the trip: a fresh PostgreSQL database or SQLite file per test,
//! migrated (sagabox's tables and the trip's), removed when the fixture drops (also
//! after a panic). [`Backend`] lets one test body run on both.
//!
//! The database part is the minimal copy of the root package's `tests/common/mod.rs`:
//! including that file by `#[path]` would bring its submodules, which need the root
//! package's binary (`CARGO_BIN_EXE_sagabox`) and so do not compile here.
//!
//! PostgreSQL is found at `DATABASE_URL`, else `postgres://postgres@127.0.0.1:5432/postgres`.
//! A test that cannot reach it fails with a message that says so; it never skips.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::future::Future;
use std::path::PathBuf;

use sagabox::saga::SagaStore;
use sagabox::{InboxStore, PostgresStore, SqliteStore};
use sagabox_trip::TripDb;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Postgres, Sqlite, SqlitePool};

/// The default server for tests.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The admin URL tests create their databases through.
pub fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

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

/// A fresh PostgreSQL database, dropped on drop.
#[derive(Debug)]
pub struct Pg {
    url: String,
    pool: PgPool,
    name: String,
}

impl Backend for Pg {
    type Db = Postgres;
    type Store = PostgresStore;

    async fn create() -> Self {
        let admin = admin_url();
        let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|error| {
            panic!(
                "cannot connect to PostgreSQL at {admin}: {error}\n\
                 start it or point DATABASE_URL at a server"
            )
        });
        let name = unique_name("sagabox_trip_test");
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create test database");
        conn.close().await.ok();
        let (base, _) = admin
            .rsplit_once('/')
            .expect("DATABASE_URL has a /database part");
        let url = format!("{base}/{name}");
        let store = PostgresStore::connect(&url, 4)
            .await
            .expect("connect test db");
        store.migrate().await.expect("migrate");
        <Postgres as TripDb>::install(store.pool())
            .await
            .expect("trip schema");
        let pool = store.pool().clone();
        Self { url, pool, name }
    }

    async fn store(&self, connections: u32) -> PostgresStore {
        PostgresStore::connect(&self.url, connections)
            .await
            .expect("connect store")
    }

    async fn scalar(&self, sql: String) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.clone()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    }

    async fn inbox(&self) -> String {
        "sagabox_inbox".to_owned()
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        let admin = admin_url();
        let name = self.name.clone();
        // Drop runs outside any runtime we may block: a thread with its own.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let mut conn = PgConnection::connect(&admin).await?;
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                )))
                .execute(&mut conn)
                .await?;
                conn.close().await
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!(
                "warning: could not drop test database {}: {dropped:?}",
                self.name
            );
        }
    }
}

/// A fresh SQLite file, deleted on drop.
#[derive(Debug)]
pub struct Lite {
    url: String,
    pool: SqlitePool,
    path: PathBuf,
}

impl Backend for Lite {
    type Db = Sqlite;
    type Store = SqliteStore;

    async fn create() -> Self {
        let path = std::env::temp_dir().join(format!("{}.db", unique_name("sagabox_trip_test")));
        let url = format!("sqlite:{}", path.display());
        let store = SqliteStore::connect(&url, 4).await.expect("open sqlite");
        store.migrate().await.expect("migrate");
        <Sqlite as TripDb>::install(store.pool())
            .await
            .expect("trip schema");
        let pool = store.pool().clone();
        Self { url, pool, path }
    }

    async fn store(&self, connections: u32) -> SqliteStore {
        SqliteStore::connect(&self.url, connections)
            .await
            .expect("open store")
    }

    async fn scalar(&self, sql: String) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.clone()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    }

    async fn inbox(&self) -> String {
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'table' \
             AND name GLOB 'sagabox_inbox_[0-9][0-9][0-9][0-9]_[0-9][0-9]'",
        )
        .fetch_all(&self.pool)
        .await
        .expect("list inbox tables");
        let union: Vec<String> = tables
            .iter()
            .map(|table| format!("SELECT consumer_type, duplicates FROM {table}"))
            .collect();
        if union.is_empty() {
            "(SELECT '' AS consumer_type, 0 AS duplicates WHERE 0)".to_owned()
        } else {
            format!("({})", union.join(" UNION ALL "))
        }
    }
}

impl Drop for Lite {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.path.display()));
        }
    }
}
