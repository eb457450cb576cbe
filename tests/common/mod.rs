//! Test databases: each test gets a fresh PostgreSQL database or SQLite file, created
//! with the migrations run and removed when the fixture drops (also after a panic).
//!
//! PostgreSQL is found at `DATABASE_URL`, else `postgres://postgres@127.0.0.1:5432/postgres`.
//! A test that cannot reach it fails with a message that says so; it never skips.

#![allow(dead_code, unreachable_pub)]

pub mod chaos;
pub mod children;
pub mod cluster_run;
pub mod effects;
pub mod invariants;
pub mod outbox;
pub mod pg_pair;
pub mod proxy;
pub mod rabbit;
pub mod scrape;
pub mod tls;

use std::path::PathBuf;

use sagabox::{InboxStore, PostgresStore, SqliteStore};
use sqlx::postgres::PgPool;
use sqlx::sqlite::SqlitePool;
use sqlx::{AssertSqlSafe, Connection, PgConnection};

/// Polls `done` every 20 ms until it holds; fails the test, naming `what`, after 30 s.
pub async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !done().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The `sagabox` binary with `args`, without the test's environment choosing its
/// database, broker or log output for it.
pub fn sagabox_command(args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(sagabox_bin());
    command
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("SAGABOX_DATABASE_URL")
        .env_remove("AMQP_URL")
        .env_remove("SAGABOX_AMQP_URL")
        .env_remove("RUST_LOG")
        .env_remove("SAGABOX_LOG_FORMAT");
    command
}

/// The `sagabox` binary, for the tests of the package that builds it (`cli/`): the
/// other packages' tests share these helpers but never start the binary.
pub fn sagabox_bin() -> PathBuf {
    match option_env!("CARGO_BIN_EXE_sagabox") {
        Some(path) => PathBuf::from(path),
        None => panic!("only the sagabox-cli package's tests start the sagabox binary"),
    }
}

/// The default server for tests.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The admin URL tests create their databases through.
pub fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// `url` naming `database` instead, its query (`sslmode`, …) kept.
fn with_database(url: &str, database: &str) -> String {
    let (path, query) = match url.split_once('?') {
        Some((path, query)) => (path, format!("?{query}")),
        None => (url, String::new()),
    };
    let (base, _) = path
        .rsplit_once('/')
        .expect("DATABASE_URL has a /database part");
    format!("{base}/{database}{query}")
}

fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// The test's own pool on `url`: its `search_path` also holds sagabox's schema, so a
/// test reads `sagabox_inbox` unqualified, while tables it creates still land in
/// `public`. Stores never get this pool: theirs are plain, so a statement of sagabox's
/// that did not name its schema would fail.
async fn verification_pool(url: &str) -> PgPool {
    let options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(url)
        .expect("test database url")
        .options([("search_path", "public,sagabox")]);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("connect test db")
}

/// A fresh PostgreSQL database, dropped on drop.
#[derive(Debug)]
pub struct Pg {
    pub url: String,
    pub pool: PgPool,
    name: String,
}

impl Pg {
    /// Creates the database and runs the migrations.
    pub async fn new() -> Self {
        let admin = admin_url();
        let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|error| {
            panic!(
                "cannot connect to PostgreSQL at {admin}: {error}\n\
                 start it (pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start) \
                 or point DATABASE_URL at a server"
            )
        });
        let name = unique_name("sagabox_test");
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create test database");
        conn.close().await.ok();
        let url = with_database(&admin, &name);
        let store = PostgresStore::connect(&url, 1)
            .await
            .expect("connect test db");
        store.migrate().await.expect("migrate");
        store.pool().close().await;
        let pool = verification_pool(&url).await;
        Self { url, pool, name }
    }

    /// Creates the database and leaves it empty: no migrations.
    pub async fn unmigrated() -> Self {
        let admin = admin_url();
        let mut conn = PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|error| panic!("cannot connect to PostgreSQL at {admin}: {error}"));
        let name = unique_name("sagabox_test");
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create test database");
        conn.close().await.ok();
        let url = with_database(&admin, &name);
        let pool = verification_pool(&url).await;
        Self { url, pool, name }
    }

    /// A new store with its own pool of `connections` connections.
    pub async fn store(&self, connections: u32) -> PostgresStore {
        PostgresStore::connect(&self.url, connections)
            .await
            .expect("connect store")
    }

    /// Runs one statement.
    pub async fn exec(&self, sql: &'static str) {
        sqlx::raw_sql(sql).execute(&self.pool).await.expect(sql);
    }

    /// Runs statements built at run time.
    pub async fn exec_owned(&self, sql: String) {
        sqlx::raw_sql(AssertSqlSafe(sql.clone()))
            .execute(&self.pool)
            .await
            .expect(&sql);
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs a query returning one integer.
    pub async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .expect(sql)
    }

    /// Rows in the inbox, all partitions.
    pub async fn inbox_rows(&self) -> i64 {
        self.scalar("SELECT COUNT(*) FROM sagabox_inbox").await
    }

    /// Duplicate deliveries counted on the inbox rows, all partitions.
    pub async fn duplicates_counted(&self) -> i64 {
        self.scalar("SELECT CAST(COALESCE(SUM(duplicates), 0) AS BIGINT) FROM sagabox_inbox")
            .await
    }

    /// A `FROM` item with every inbox row (`consumer_type`, `duplicates`), all months.
    pub async fn inbox_from(&self) -> String {
        "sagabox_inbox".to_owned()
    }

    /// Waits until a session is blocked on an advisory lock (a claim waiting for the
    /// holder of its key), polling `pg_locks`; panics after 10 s.
    pub async fn wait_for_blocked_claim(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let waiting = self
                .scalar("SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
                .await;
            if waiting > 0 {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no claim ever waited on the lock"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
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
    pub url: String,
    pub pool: SqlitePool,
    path: PathBuf,
}

impl Lite {
    /// Creates the file and runs the migrations.
    pub async fn new() -> Self {
        let path = std::env::temp_dir().join(format!("{}.db", unique_name("sagabox_test")));
        let url = format!("sqlite:{}", path.display());
        let store = SqliteStore::connect(&url, 4).await.expect("open sqlite");
        store.migrate().await.expect("migrate");
        let pool = store.pool().clone();
        Self { url, pool, path }
    }

    /// A new store with its own pool of `connections` connections.
    pub async fn store(&self, connections: u32) -> SqliteStore {
        SqliteStore::connect(&self.url, connections)
            .await
            .expect("open store")
    }

    /// Runs one statement.
    pub async fn exec(&self, sql: &'static str) {
        sqlx::raw_sql(sql).execute(&self.pool).await.expect(sql);
    }

    /// Runs a query returning one integer.
    pub async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .expect(sql)
    }

    /// SQLite's wait for the write lock is not visible from another connection: give the
    /// second claim time to reach `BEGIN IMMEDIATE`.
    pub async fn wait_for_blocked_claim(&self) {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }

    /// A `FROM` item with every inbox row (`consumer_type`, `duplicates`), all monthly
    /// tables.
    pub async fn inbox_from(&self) -> String {
        let union: Vec<String> = self
            .inbox_tables()
            .await
            .iter()
            .map(|table| format!("SELECT consumer_type, duplicates FROM {table}"))
            .collect();
        if union.is_empty() {
            "(SELECT '' AS consumer_type, 0 AS duplicates WHERE 0)".to_owned()
        } else {
            format!("({})", union.join(" UNION ALL "))
        }
    }

    async fn inbox_tables(&self) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name GLOB 'sagabox_inbox_[0-9][0-9][0-9][0-9]_[0-9][0-9]'",
        )
        .fetch_all(&self.pool)
        .await
        .expect("list tables")
    }

    /// Rows in the inbox, all monthly tables.
    pub async fn inbox_rows(&self) -> i64 {
        let tables = self.inbox_tables().await;
        let mut rows = 0;
        for table in tables {
            let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
                .fetch_one(&self.pool)
                .await
                .expect("count");
            rows += n;
        }
        rows
    }

    /// Duplicate deliveries counted on the inbox rows, all monthly tables.
    pub async fn duplicates_counted(&self) -> i64 {
        let mut counted = 0;
        for table in self.inbox_tables().await {
            let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT CAST(COALESCE(SUM(duplicates), 0) AS BIGINT) FROM {table}"
            )))
            .fetch_one(&self.pool)
            .await
            .expect("sum duplicates");
            counted += n;
        }
        counted
    }
}

impl Drop for Lite {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.path.display()));
        }
    }
}
