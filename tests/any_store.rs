//! [`AnyStore`]: the store a URL names, on a real PostgreSQL database and a real SQLite
//! file. A job given to [`AnyStore::run`] gets the concrete store of that database: it
//! inserts a saga inside its own transaction with [`SagaInsert`], and the same saga is
//! then read back through the `AnyStore` itself, so both reach one database.

#![allow(clippy::unwrap_used)]

mod common;

use chrono::Utc;
use sagabox::database::{AnyStore, OnStore, Store};
use sagabox::saga::{SagaDefinition, SagaInstance, SagaStore};
use sagabox::{InboxError, Schema};
use serde_json::json;
use sqlx::Database;

const SAGA: &str = r#"
name = "any"
[[steps]]
name = "only"
consumer_type = "only"
command = "do_it"
timeout = "5s"
"#;

/// Inserts `saga` with the store's own connection in a transaction, and says which
/// database it ran on.
struct InsertIn {
    saga: SagaInstance,
}

impl<S: Store> OnStore<S> for InsertIn {
    type Output = &'static str;

    async fn run(self, store: S) -> &'static str {
        let mut tx = Store::pool(&store).begin().await.unwrap();
        store.insert(&mut tx, &self.saga).await.unwrap();
        tx.commit().await.unwrap();
        <S::Db as Database>::NAME
    }
}

async fn inserted_by_a_job_and_read_through_any_store(url: &str, database: &str) {
    let definition = SagaDefinition::from_toml_str(SAGA).unwrap();
    let saga = SagaInstance::under(&definition, "any-1", json!({"n": 1}), Utc::now());
    let store = AnyStore::connect(url, 2, &Schema::default()).await.unwrap();
    let ran_on = store.clone().run(InsertIn { saga: saga.clone() }).await;
    assert_eq!(ran_on, database);
    let loaded = store.load("any-1").await.unwrap().expect("the job's saga");
    assert_eq!((loaded.id, loaded.data), (saga.id, saga.data));
}

#[tokio::test]
async fn a_job_runs_on_the_postgres_store_the_url_names() {
    let fx = common::Pg::new().await;
    inserted_by_a_job_and_read_through_any_store(&fx.url, "PostgreSQL").await;
}

#[tokio::test]
async fn a_job_runs_on_the_sqlite_store_the_url_names() {
    let fx = common::Lite::new().await;
    inserted_by_a_job_and_read_through_any_store(&fx.url, "SQLite").await;
}

#[tokio::test]
async fn a_url_of_no_supported_database_is_refused_with_the_password_hidden() {
    let error = AnyStore::connect("mysql://u:hunter2@h/x", 2, &Schema::default())
        .await
        .unwrap_err();
    assert!(matches!(error, InboxError::UnsupportedUrl(_)), "{error}");
    assert!(!error.to_string().contains("hunter2"), "{error}");
}

/// SQLite writes one transaction at a time: the pool the chooser opens holds no more
/// connections than are worth having, however many are asked for.
#[tokio::test]
async fn an_sqlite_pool_is_capped_at_the_connections_worth_having() {
    let fx = common::Lite::new().await;
    let store = AnyStore::connect(&fx.url, 64, &Schema::default())
        .await
        .unwrap();
    let AnyStore::Sqlite(store) = store else {
        panic!("an sqlite: URL opens the SQLite store");
    };
    assert_eq!(
        store.pool().options().get_max_connections(),
        sagabox::SqliteStore::MAX_USEFUL_CONNECTIONS
    );
}
