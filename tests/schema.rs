//! sagabox's tables keep to themselves, on real PostgreSQL and SQLite: every table lives
//! in sagabox's schema (settable, so two installations share a database), its versions
//! in a migrations table of its own; a team's `_sqlx_migrations`, `saga_instances`,
//! `inbox` and `outbox` are left as they were, and the team's next migration still
//! runs; an installation of the first release (tables in `public`, versions in
//! `_sqlx_migrations`, built here from that release's migrations, checked in under
//! `tests/fixtures/release-0.1`) is moved in place with every row, and ends up laid out
//! exactly as a new installation.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use chrono::Utc;
use sagabox::database::migrate;
use sagabox::inspect::{InspectOptions, inspect};
use sagabox::outbox::{OutboxReader, OutboxWriter};
use sagabox::pruner::Maintenance;
use sagabox::saga::{SagaDefinition, SagaEvent, SagaFilter, SagaInsert, SagaInstance, SagaStore};
use sagabox::store::InboxStore;
use sagabox::{
    ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, Outcome, PostgresStore, Schema,
    SqliteStore,
};
use serde_json::json;
use sqlx::migrate::Migrator;
use sqlx::{AssertSqlSafe, PgPool, SqlitePool};

const ORDER: &str = r#"
name = "order"
[[steps]]
name = "pay"
consumer_type = "payment"
command = "charge"
compensation = "refund"
timeout = "5s"
"#;

/// The relations (and their kind) of `schema`, by name.
async fn relations(pool: &PgPool, schema: &str) -> BTreeSet<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text || ':' || c.relkind::text FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1",
    )
    .bind(schema)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// Every column, index and constraint of `schema`, as PostgreSQL spells them, minus the
/// monthly partitions (which depend on the day the test runs).
async fn layout(pool: &PgPool, schema: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT 'column ' || table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable \
                || ' ' || COALESCE(column_default, '-') \
           FROM information_schema.columns WHERE table_schema = $1 \
            AND table_name !~ '_[0-9]{4}_[0-9]{2}$' \
         UNION ALL \
         SELECT 'index ' || indexname || ' ' || replace(indexdef, quote_ident($1) || '.', '') \
           FROM pg_indexes WHERE schemaname = $1 AND tablename !~ '_[0-9]{4}_[0-9]{2}$' \
         UNION ALL \
         SELECT 'constraint ' || conname || ' ' || pg_get_constraintdef(c.oid) \
           FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace \
          WHERE n.nspname = $1 AND conrelid::regclass::text !~ '_[0-9]{4}_[0-9]{2}$' \
         ORDER BY 1",
    )
    .bind(schema)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Everything a participant, an orchestrator, the relay, the pruner and `inspect` do,
/// on `store`: one pass over every statement sagabox runs.
async fn exercise_postgres(url: &str, store: PostgresStore) {
    let guard = InboxGuard::new(store.clone(), InboxConfig::default()).unwrap();
    let payment = ConsumerType::new("payment").unwrap();
    let email = ConsumerType::new("email").unwrap();
    let schema = store.schema().clone();

    // Claims with a time (insert first, then the counted duplicate), without one (probe
    // every partition), with a recorded result, and a batch.
    let timed = Envelope::new(MessageId::new_v7(), "charge", json!({"cents": 5})).unwrap();
    let untimed = Envelope::new(MessageId::new("order-7").unwrap(), "charge", json!({})).unwrap();
    for envelope in [&timed, &timed, &untimed, &untimed] {
        let (email, schema) = (email.clone(), schema.clone());
        guard
            .process(&payment, envelope, async move |conn, envelope| {
                let out = Envelope::new(MessageId::new_v7(), "charged", envelope.payload.clone())
                    .unwrap()
                    .with_published_at(Utc::now());
                conn.publish_in(&schema, &email, "order-7", &out).await?;
                Ok::<_, sqlx::Error>(json!({"charged": envelope.id.as_str()}))
            })
            .await
            .unwrap();
    }
    let batch: Vec<Envelope> = (0..3)
        .map(|n| Envelope::new(MessageId::new_v7(), "charge", json!({ "n": n })).unwrap())
        .collect();
    for _ in 0..2 {
        let outcomes = guard
            .process_batch(&payment, &batch, async |_, envelope| {
                Ok::<_, sqlx::Error>(json!({"n": envelope.payload["n"]}))
            })
            .await
            .unwrap();
        assert_eq!(outcomes.len(), 3);
    }
    let again = guard
        .process(&payment, &timed, async |_, _| {
            Ok::<_, sqlx::Error>(json!(null))
        })
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Duplicate { .. }), "{again:?}");

    // The relay's side of the outbox.
    let mut tx = store.pool().begin().await.unwrap();
    let claimed = (*tx).claim(&schema, 10).await.unwrap();
    assert_eq!(claimed.len(), 2, "one row per applied delivery");
    for row in &claimed {
        assert!((*tx).mark_sent(&schema, row.seq, Utc::now()).await.unwrap());
    }
    tx.commit().await.unwrap();
    let mut conn = store.pool().acquire().await.unwrap();
    assert_eq!((*conn).pending_count(&schema).await.unwrap(), 0);
    (*conn).prune_sent(&schema, Utc::now()).await.unwrap();
    drop(conn);

    // Sagas: definitions, an insert in the caller's transaction, the idempotent start,
    // saves with events, every read, and the history's partitions.
    let definition = SagaDefinition::from_toml_str(ORDER).unwrap();
    store.register_definition(&definition).await.unwrap();
    assert!(store.stored_definition("order", 1).await.unwrap().is_some());
    let saga = SagaInstance::under(&definition, "saga-1", json!({}), Utc::now());
    let mut tx = store.pool().begin().await.unwrap();
    store.insert(&mut tx, &saga).await.unwrap();
    tx.commit().await.unwrap();
    let started = SagaInstance::under(&definition, "saga-2", json!({}), Utc::now());
    assert!(store.create_if_absent(&started).await.unwrap().created);
    assert!(!store.create_if_absent(&started).await.unwrap().created);
    let mut loaded = store.load("saga-1").await.unwrap().unwrap();
    loaded.status = sagabox::saga::SagaStatus::Completed;
    let event = SagaEvent::new(sagabox::saga::EventKind::Completed, Utc::now());
    assert!(store.save(&mut loaded, &[event]).await.unwrap());
    assert!(store.save(&mut loaded, &[]).await.unwrap());
    assert_eq!(store.unfinished("order").await.unwrap(), vec!["saga-2"]);
    assert_eq!(store.list(&SagaFilter::default()).await.unwrap().len(), 2);
    assert!(!store.counts().await.unwrap().is_empty());
    assert_eq!(
        store
            .finished_per_minute(Utc::now() - chrono::TimeDelta::hours(1))
            .await
            .unwrap()
            .len(),
        1
    );
    assert!(store.history("saga-1").await.unwrap().len() >= 2);
    sagabox::saga::history_pass(&store, Utc::now(), std::time::Duration::ZERO, 1, false)
        .await
        .unwrap();

    // The pruner and inspect.
    guard.run_pass(false).await.unwrap();
    assert!(!guard.partitions().await.unwrap().is_empty());
    let options = InspectOptions {
        schema: schema.clone(),
        ..InspectOptions::default()
    };
    let report = inspect(url, &options).await.unwrap();
    assert_eq!(
        report.sagas.by_status.values().sum::<i64>(),
        2,
        "{report:?}"
    );
    assert!(report.partitions.iter().map(|p| p.rows).sum::<i64>() >= 5);
}

#[tokio::test]
async fn postgres_tables_live_in_a_schema_of_their_own_named_by_every_statement() {
    let pg = common::Pg::unmigrated().await;
    let schema = Schema::new("team_sagabox").unwrap();
    let store = PostgresStore::connect(&pg.url, 4)
        .await
        .unwrap()
        .with_schema(schema.clone());
    store.migrate().await.unwrap();
    // The store's connections have the server's default search_path (public): a
    // statement that did not name the schema would not find its table.
    exercise_postgres(&pg.url, store.clone()).await;

    let ours = relations(&pg.pool, "team_sagabox").await;
    assert!(
        ours.iter().all(|relation| relation.starts_with("sagabox_")),
        "{ours:?}"
    );
    for table in [
        "sagabox_inbox:p",
        "sagabox_saga_instances:r",
        "sagabox_migrations:r",
    ] {
        assert!(ours.contains(table), "{table} missing from {ours:?}");
    }
    assert!(
        relations(&pg.pool, "public").await.is_empty(),
        "nothing in public"
    );
    assert!(
        relations(&pg.pool, "sagabox").await.is_empty(),
        "nothing in the default schema"
    );
}

#[tokio::test]
async fn two_installations_share_a_database_without_seeing_each_other() {
    let pg = common::Pg::unmigrated().await;
    let first = PostgresStore::connect(&pg.url, 2).await.unwrap();
    let second = PostgresStore::connect(&pg.url, 2)
        .await
        .unwrap()
        .with_schema(Schema::new("second").unwrap());
    // Concurrently: each migrator takes sqlx's database-wide lock in turn.
    let (a, b) = tokio::join!(first.migrate(), second.migrate());
    a.unwrap();
    b.unwrap();
    let payment = ConsumerType::new("payment").unwrap();
    let message = Envelope::new(MessageId::new_v7(), "charge", json!({})).unwrap();
    for store in [&first, &second] {
        let guard = InboxGuard::new(store.clone(), InboxConfig::default()).unwrap();
        guard.prepare_partitions().await.unwrap();
        let outcome = guard
            .process(&payment, &message, async |_, _| {
                Ok::<_, sqlx::Error>(json!(1))
            })
            .await
            .unwrap();
        assert!(matches!(outcome, Outcome::Applied(_)), "{outcome:?}");
    }
    for schema in ["sagabox", "second"] {
        let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {schema}.sagabox_inbox"
        )))
        .fetch_one(&pg.pool)
        .await
        .unwrap();
        assert_eq!(rows, 1, "{schema}");
    }
    assert_eq!(layout(&pg.pool, "sagabox").await.len(), {
        let second = layout(&pg.pool, "second").await;
        second.len()
    });
}

/// A team's own migrations: the tables sagabox once could have collided with.
const TEAM_MIGRATIONS: &str = "tests/fixtures/team/migrations";

/// The team's next migration, applied after sagabox's.
const TEAM_NEXT: &str = "tests/fixtures/team/next";

async fn team_state(pool: &PgPool) -> Vec<String> {
    let mut state: Vec<String> = sqlx::query_scalar(
        "SELECT format('%s %s %s', version, description, encode(checksum, 'hex')) \
         FROM public._sqlx_migrations ORDER BY version",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    for table in ["saga_instances", "inbox", "outbox"] {
        let rows: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT t::text FROM public.{table} t ORDER BY 1"
        )))
        .fetch_all(pool)
        .await
        .unwrap();
        state.extend(rows.into_iter().map(|row| format!("{table} {row}")));
    }
    state.extend(layout(pool, "public").await);
    state
}

#[tokio::test]
async fn migrate_leaves_a_teams_own_migrations_and_tables_as_they_were() {
    let pg = common::Pg::unmigrated().await;
    let team = Migrator::new(Path::new(TEAM_MIGRATIONS)).await.unwrap();
    team.run(&pg.pool).await.unwrap();
    let before = team_state(&pg.pool).await;
    assert!(
        before.iter().any(|line| line.starts_with("inbox ")),
        "{before:?}"
    );

    migrate(&pg.url, &Schema::default(), InboxConfig::default())
        .await
        .unwrap();
    migrate(&pg.url, &Schema::default(), InboxConfig::default())
        .await
        .unwrap();
    assert_eq!(
        team_state(&pg.pool).await,
        before,
        "the team's tables changed"
    );

    // The team's migrator sees only its own versions, and applies its next one.
    let next = Migrator::new(Path::new(TEAM_NEXT)).await.unwrap();
    next.run(&pg.pool).await.unwrap();
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM public._sqlx_migrations ORDER BY version")
            .fetch_all(&pg.pool)
            .await
            .unwrap();
    assert_eq!(versions, vec![1, 2, 3]);
    exercise_postgres(&pg.url, PostgresStore::connect(&pg.url, 4).await.unwrap()).await;
}

/// The first release's PostgreSQL migrations, as it ran them: into the connection's
/// schema, recorded in `_sqlx_migrations`.
async fn first_release_postgres(pool: &PgPool) {
    let release = Migrator::new(Path::new("tests/fixtures/release-0.1/postgres"))
        .await
        .unwrap();
    release.run(pool).await.unwrap();
}

/// Rows of every kind, written as the first release wrote them.
const FIRST_RELEASE_ROWS: &str = "
CREATE TABLE public.sagabox_inbox_2026_11 (LIKE public.sagabox_inbox INCLUDING ALL);
ALTER TABLE public.sagabox_inbox ATTACH PARTITION public.sagabox_inbox_2026_11
    FOR VALUES FROM ('2026-11-01') TO ('2026-12-01');
INSERT INTO public.sagabox_inbox (consumer_type, message_id, bucket, processed_at, result, duplicates)
    VALUES ('payment', '01a1f866-0d00-7000-8000-000000000001', '2026-11-01', '2026-11-20T10:00:00Z', '{\"charged\": 5}', 2);
INSERT INTO public.sagabox_inbox_pruned (pruned_through) VALUES ('2026-08-01');
CREATE TABLE public.sagabox_saga_events_2026_11 PARTITION OF public.sagabox_saga_events
    FOR VALUES FROM ('2026-11-01 00:00:00+00') TO ('2026-12-01 00:00:00+00');
INSERT INTO public.saga_instances (id, saga_name, status, current_step, attempts, data, created_at, updated_at, version)
    VALUES ('s-old', 'order', 'running', 0, 1, '{\"order\": 7}', '2026-11-20T10:00:00Z', '2026-11-20T10:00:01Z', 1);
INSERT INTO public.sagabox_saga_events (saga_id, saga_created_at, version, ordinal, at, kind)
    VALUES ('s-old', '2026-11-20T10:00:00Z', 0, 0, '2026-11-20T10:00:00Z', 'started');
INSERT INTO public.sagabox_saga_definitions (name, version, fingerprint, definition, first_seen)
    VALUES ('order', 1, 'f', 'name = \"order\"', '2026-11-20T10:00:00Z');
INSERT INTO public.sagabox_outbox (id, aggregate, destination, kind, payload, headers, created_at)
    VALUES ('01a1f866-0d00-7000-8000-000000000002', 'order-7', 'email', 'charged', '{}', '{}', '2026-11-20T10:00:00Z');
";

#[tokio::test]
async fn a_first_release_postgres_installation_is_moved_in_place_with_every_row() {
    let pg = common::Pg::unmigrated().await;
    first_release_postgres(&pg.pool).await;
    // A version of the team's, in the same `_sqlx_migrations` (the first release's and
    // the team's migrators each had to ignore the other's versions).
    sqlx::raw_sql(
        "INSERT INTO public._sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (1, 'team orders', true, '\\x00', 0)",
    )
    .execute(&pg.pool)
    .await
    .unwrap();
    sqlx::raw_sql(FIRST_RELEASE_ROWS)
        .execute(&pg.pool)
        .await
        .unwrap();
    // A table of the team's whose name merely starts like one of sagabox's.
    sqlx::raw_sql("CREATE TABLE public.sagabox_outbox_archive (id text PRIMARY KEY)")
        .execute(&pg.pool)
        .await
        .unwrap();
    let store = PostgresStore::connect(&pg.url, 4).await.unwrap();
    let refused = sagabox::database::open_migrated(&pg.url, &Schema::default(), 2)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("`sagabox migrate` moves them"),
        "{refused}"
    );

    // Two processes starting at once: one moves it, the other finds it moved.
    let (a, b) = tokio::join!(store.migrate(), store.migrate());
    a.unwrap();
    b.unwrap();

    // Nothing of sagabox's is left beside the application's; the team's table and
    // versions stay.
    let public = relations(&pg.pool, "public").await;
    let sagabox_like: Vec<&String> = public
        .iter()
        .filter(|relation| {
            relation.starts_with("sagabox_") || relation.starts_with("saga_instances")
        })
        .collect();
    assert_eq!(
        sagabox_like,
        ["sagabox_outbox_archive:r", "sagabox_outbox_archive_pkey:i"],
        "{public:?}"
    );
    let left: Vec<i64> = sqlx::query_scalar("SELECT version FROM public._sqlx_migrations")
        .fetch_all(&pg.pool)
        .await
        .unwrap();
    assert_eq!(left, vec![1], "the team's version stays, sagabox's leave");

    // Every row, where the new layout keeps it, and in use: the old delivery is a
    // duplicate with its first result, the saga resumes, the outbox row is pending.
    let guard = InboxGuard::new(store.clone(), InboxConfig::default()).unwrap();
    let old = Envelope::new(
        MessageId::new("01a1f866-0d00-7000-8000-000000000001").unwrap(),
        "charge",
        json!({}),
    )
    .unwrap()
    .with_published_at("2026-11-20T10:00:00Z".parse().unwrap());
    let payment = ConsumerType::new("payment").unwrap();
    let config = InboxConfig::default().with_ttl(std::time::Duration::from_secs(3650 * 86_400));
    let guard = InboxGuard::new(guard.store().clone(), config).unwrap();
    let outcome = guard
        .process(&payment, &old, async |_, _| {
            Ok::<_, sqlx::Error>(json!("again"))
        })
        .await
        .unwrap();
    assert_eq!(outcome.result(), &json!({"charged": 5}), "{outcome:?}");
    assert!(outcome.is_duplicate());
    let saga = store.load("s-old").await.unwrap().unwrap();
    assert_eq!((saga.data, saga.version), (json!({"order": 7}), 1));
    assert_eq!(store.history("s-old").await.unwrap().len(), 1);
    assert!(store.stored_definition("order", 1).await.unwrap().is_some());
    let mut conn = store.pool().acquire().await.unwrap();
    assert_eq!(
        (*conn).pending_count(store.schema()).await.unwrap(),
        1,
        "the outbox row"
    );
    drop(conn);
    let pruned: chrono::NaiveDate =
        sqlx::query_scalar("SELECT pruned_through FROM sagabox.sagabox_inbox_pruned")
            .fetch_one(&pg.pool)
            .await
            .unwrap();
    assert_eq!(pruned.to_string(), "2026-08-01");

    // Laid out exactly as a new installation is.
    let fresh = common::Pg::new().await;
    let upgraded = layout(&pg.pool, "sagabox").await;
    assert!(upgraded.len() > 60, "{upgraded:?}");
    assert_eq!(upgraded, layout(&fresh.pool, "sagabox").await);
    assert!(
        sagabox::database::open_migrated(&pg.url, &Schema::default(), 2)
            .await
            .is_ok()
    );
}

#[tokio::test]
async fn a_first_release_installation_given_its_own_schema_stays_there_renamed() {
    let pg = common::Pg::unmigrated().await;
    first_release_postgres(&pg.pool).await;
    sqlx::raw_sql(FIRST_RELEASE_ROWS)
        .execute(&pg.pool)
        .await
        .unwrap();
    let public = Schema::new("public").unwrap();
    migrate(&pg.url, &public, InboxConfig::default())
        .await
        .unwrap();
    let store = PostgresStore::connect(&pg.url, 2)
        .await
        .unwrap()
        .with_schema(public.clone());
    assert_eq!(
        store.load("s-old").await.unwrap().unwrap().data,
        json!({"order": 7})
    );
    let relations = relations(&pg.pool, "public").await;
    assert!(
        relations.contains("sagabox_migrations:r") && !relations.contains("_sqlx_migrations:r"),
        "{relations:?}"
    );
    assert!(
        sagabox::database::open_migrated(&pg.url, &public, 2)
            .await
            .is_ok()
    );
    // Laid out as a new installation in a schema of that name would be.
    let fresh = common::Pg::unmigrated().await;
    migrate(&fresh.url, &public, InboxConfig::default())
        .await
        .unwrap();
    assert_eq!(
        layout(&pg.pool, "public").await,
        layout(&fresh.pool, "public").await
    );
}

/// Tables, indexes and their definitions in an SQLite file, as `sqlite_master` has them.
async fn sqlite_layout(pool: &SqlitePool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT type || ' ' || name || ' ' || COALESCE(replace(replace(sql, '\"', ''), char(10), ' '), '') \
         FROM sqlite_master WHERE name NOT GLOB '*_[0-9][0-9][0-9][0-9]_[0-9][0-9]' \
           AND name NOT LIKE 'sqlite_%' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_first_release_sqlite_file_is_renamed_in_place_with_every_row() {
    let old = common::Lite::new().await;
    // Rebuilt as the first release left it.
    for table in sqlx::query_scalar::<_, String>(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'",
    )
    .fetch_all(&old.pool)
    .await
    .unwrap()
    {
        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&old.pool)
            .await
            .unwrap();
    }
    Migrator::new(Path::new("tests/fixtures/release-0.1/sqlite"))
        .await
        .unwrap()
        .run(&old.pool)
        .await
        .unwrap();
    sqlx::raw_sql(
        "INSERT INTO saga_instances (id, saga_name, status, current_step, attempts, data, created_at, updated_at) \
         VALUES ('s-old', 'order', 'running', 0, 1, '{\"order\": 7}', '2026-11-20T10:00:00Z', '2026-11-20T10:00:01Z'); \
         INSERT INTO sagabox_outbox (id, aggregate, destination, kind, payload, headers, created_at) \
         VALUES ('m-1', 'order-7', 'email', 'charged', '{}', '{}', '2026-11-20T10:00:00Z');",
    )
    .execute(&old.pool)
    .await
    .unwrap();

    let store = SqliteStore::connect(&old.url, 2).await.unwrap();
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let saga = store.load("s-old").await.unwrap().unwrap();
    assert_eq!(saga.data, json!({"order": 7}));
    let mut conn = store.pool().acquire().await.unwrap();
    assert_eq!((*conn).pending_count(&Schema::sqlite()).await.unwrap(), 1);
    drop(conn);
    let fresh = common::Lite::new().await;
    assert_eq!(
        sqlite_layout(&old.pool).await,
        sqlite_layout(&fresh.pool).await
    );
    assert!(
        sqlite_layout(&old.pool).await.iter().all(|line| line
            .split(' ')
            .nth(1)
            .is_some_and(|name| name.starts_with("sagabox_"))),
        "{:?}",
        sqlite_layout(&old.pool).await
    );
}

/// A save between a saga's start and its end changes no indexed column of the saga
/// table, so PostgreSQL writes it as a heap-only update, adding no index entry: every
/// such save is counted as one (`n_tup_hot_upd`); the save that finishes a saga changes
/// its status, which is indexed, and sets `finished_at`, which the finished sagas per
/// minute are read by.
#[tokio::test]
async fn a_save_between_a_sagas_start_and_end_is_a_heap_only_update() {
    let pg = common::Pg::new().await;
    // One connection: its statistics are flushed, below, before they are read.
    let store = pg.store(1).await;
    let definition = SagaDefinition::from_toml_str(ORDER).unwrap();
    let sagas: Vec<SagaInstance> = (0..8)
        .map(|n| SagaInstance::under(&definition, format!("hot-{n}"), json!({"n": n}), Utc::now()))
        .collect();
    let mut conn = store.pool().acquire().await.unwrap();
    for saga in &sagas {
        store.insert(&mut conn, saga).await.unwrap();
    }
    drop(conn);
    let mut middle_saves = 0;
    for mut saga in sagas {
        for attempt in 1..=3 {
            saga.attempts = attempt;
            saga.data = json!({"attempt": attempt});
            saga.updated_at = Utc::now();
            let event = SagaEvent::new(sagabox::saga::EventKind::Sent, saga.updated_at);
            assert!(store.save(&mut saga, &[event]).await.unwrap());
            middle_saves += 1;
        }
        saga.status = sagabox::saga::SagaStatus::Completed;
        let event = SagaEvent::new(sagabox::saga::EventKind::Completed, Utc::now());
        assert!(store.save(&mut saga, &[event]).await.unwrap());
    }
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(store.pool())
        .await
        .unwrap();
    let (updates, heap_only): (i64, i64) = sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables \
         WHERE schemaname = 'sagabox' AND relname = 'sagabox_saga_instances'",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(updates, middle_saves + 8, "every save counted");
    assert_eq!(
        heap_only, middle_saves,
        "the saves between start and end, and only those"
    );
    let finished = store
        .finished_per_minute(Utc::now() - chrono::TimeDelta::hours(1))
        .await
        .unwrap();
    assert_eq!(finished.iter().map(|minute| minute.sagas).sum::<i64>(), 8);
}
