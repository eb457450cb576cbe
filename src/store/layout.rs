//! Running sagabox's migrations in its own place, and moving an installation of the
//! first release there.
//!
//! The first release put its tables where the connection's `search_path` pointed
//! (`public`, as a rule), called the saga table `saga_instances`, and recorded its
//! versions in `_sqlx_migrations`, the table a team's own sqlx migrations use. Now the
//! tables live in sagabox's [`Schema`] (PostgreSQL) or carry the `sagabox_` prefix
//! throughout (SQLite), and the versions are recorded in
//! [`MIGRATIONS_TABLE`](crate::schema::MIGRATIONS_TABLE). [`postgres`] and [`sqlite`]
//! move such an installation in one transaction, rows untouched, before the migrations
//! run: the tables (with their partitions, indexes, constraints and sequences) go to the
//! schema, `saga_instances` and its indexes take their prefixed names, and sagabox's
//! rows leave `_sqlx_migrations` for the new table, with the checksums of the migrations
//! as they are now written (they name `sagabox_saga_instances`). A
//! `_sqlx_migrations` left empty is dropped; one holding the team's versions stays.
//!
//! An upgrade is recognised by sagabox's versions in `_sqlx_migrations` while the new
//! migrations table does not exist yet, so it runs at most once, and an installation
//! that is already moved (or new) is never touched.

use sqlx::AssertSqlSafe;
#[cfg(feature = "postgres")]
use sqlx::Connection;
use sqlx::migrate::{Migrate, MigrateError, Migrator};

use crate::schema::{MIGRATIONS_TABLE, Schema};

/// The migrations table of the first release.
const LEGACY_MIGRATIONS_TABLE: &str = "_sqlx_migrations";

/// The saga table's name in the first release; its indexes and constraints were named
/// after it (`saga_instances_…`).
const LEGACY_SAGA_TABLE: &str = "saga_instances";

/// The saga table's name now.
const SAGA_TABLE: &str = "sagabox_saga_instances";

/// Advisory lock (class 'Sagc', object 0) held while an installation is moved, so two
/// processes starting at once do not both move it.
#[cfg(feature = "postgres")]
const UPGRADE_LOCK: (i32, i32) = (1_398_892_387, 0);

/// `migrations` recording their versions in `table` (and creating `schema` first, on
/// PostgreSQL).
fn migrator(migrations: &'static Migrator, table: String, schema: Option<&Schema>) -> Migrator {
    Migrator {
        migrations: migrations.migrations.clone(),
        table_name: table.into(),
        create_schemas: schema
            .map(|schema| vec![schema.quoted().to_owned().into()])
            .unwrap_or_default()
            .into(),
        ..Migrator::DEFAULT
    }
}

/// Each of `versions` that `migrations` has, with the checksum its migration has now.
fn current_checksums(migrations: &Migrator, versions: &[i64]) -> Vec<(i64, Vec<u8>)> {
    versions
        .iter()
        .filter_map(|version| {
            migrations
                .iter()
                .find(|migration| {
                    migration.version == *version && !migration.migration_type.is_down_migration()
                })
                .map(|migration| (*version, migration.checksum.to_vec()))
        })
        .collect()
}

/// Moves a first-release installation whose tables are in the connection's current
/// schema into `schema` (see the module docs). Returns whether it moved one.
#[cfg(feature = "postgres")]
pub(crate) async fn postgres(
    conn: &mut sqlx::PgConnection,
    schema: &Schema,
    migrations: &'static Migrator,
) -> Result<bool, MigrateError> {
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(UPGRADE_LOCK.0)
        .bind(UPGRADE_LOCK.1)
        .execute(&mut *tx)
        .await?;
    let (old_schema, old, legacy, moved): (String, String, bool, bool) = sqlx::query_as(
        "SELECT current_schema()::text, quote_ident(current_schema()), \
                to_regclass(quote_ident(current_schema()) || '.' || $1) IS NOT NULL \
                  AND to_regclass(quote_ident(current_schema()) || '.sagabox_inbox') IS NOT NULL, \
                to_regclass($2) IS NOT NULL",
    )
    .bind(LEGACY_MIGRATIONS_TABLE)
    .bind(schema.table(MIGRATIONS_TABLE))
    .fetch_one(&mut *tx)
    .await?;
    if !legacy || moved {
        tx.commit().await?;
        return Ok(false);
    }
    let ours: Vec<i64> = migrations
        .iter()
        .map(|migration| migration.version)
        .collect();
    let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {old}.{LEGACY_MIGRATIONS_TABLE} WHERE version = ANY($1) ORDER BY version"
    )))
    .bind(&ours)
    .fetch_all(&mut *tx)
    .await?;
    if applied.is_empty() {
        // A sagabox_inbox beside a migrations table that never recorded sagabox's
        // versions is not an installation of ours to move.
        tx.commit().await?;
        return Ok(false);
    }
    sqlx::query(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS {}",
        schema.quoted()
    )))
    .execute(&mut *tx)
    .await?;
    // The tables and every partition of the partitioned ones (`SET SCHEMA` moves a table
    // with its indexes, constraints and owned sequences, but not its partitions), by the
    // names the first release gave them: nothing else of the schema's.
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
          WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') \
            AND (c.relname = $2 OR c.relname ~ '^sagabox_(inbox(_pruned|_[0-9]{4}_[0-9]{2})?\
|outbox|saga_definitions|saga_events(_default|_[0-9]{4}_[0-9]{2})?)$')",
    )
    .bind(&old_schema)
    .bind(LEGACY_SAGA_TABLE)
    .fetch_all(&mut *tx)
    .await?;
    // A schema set to where the first release's tables already are keeps them there.
    if old_schema != schema.name() {
        for table in &tables {
            sqlx::query(AssertSqlSafe(format!(
                "ALTER TABLE {old}.{table} SET SCHEMA {}",
                schema.quoted()
            )))
            .execute(&mut *tx)
            .await?;
        }
    }
    if tables.iter().any(|table| table == LEGACY_SAGA_TABLE) {
        rename_saga_table(&mut tx, schema).await?;
    }
    move_migration_records(&mut tx, schema, &old, migrations, &applied).await?;
    tx.commit().await?;
    Ok(true)
}

/// Gives the first release's saga table, its constraints and its indexes (already in
/// `schema`) the names of this one.
#[cfg(feature = "postgres")]
async fn rename_saga_table(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    schema: &Schema,
) -> Result<(), MigrateError> {
    let saga_table = schema.table(LEGACY_SAGA_TABLE);
    let constraints: Vec<String> = sqlx::query_scalar(
        "SELECT conname::text FROM pg_constraint WHERE conrelid = to_regclass($1) \
          AND conname LIKE 'saga\\_instances\\_%'",
    )
    .bind(&saga_table)
    .fetch_all(&mut **tx)
    .await?;
    for constraint in constraints {
        sqlx::query(AssertSqlSafe(format!(
            "ALTER TABLE {saga_table} RENAME CONSTRAINT {constraint} TO sagabox_{constraint}"
        )))
        .execute(&mut **tx)
        .await?;
    }
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 \
          AND indexname LIKE 'saga\\_instances\\_%'",
    )
    .bind(schema.name())
    .bind(LEGACY_SAGA_TABLE)
    .fetch_all(&mut **tx)
    .await?;
    for index in indexes {
        sqlx::query(AssertSqlSafe(format!(
            "ALTER INDEX {} RENAME TO sagabox_{index}",
            schema.table(&index)
        )))
        .execute(&mut **tx)
        .await?;
    }
    sqlx::query(AssertSqlSafe(format!(
        "ALTER TABLE {saga_table} RENAME TO {SAGA_TABLE}"
    )))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Moves the records of the migrations `applied` from the first release's migrations
/// table in schema `old` to `schema`'s, with the checksums of `migrations`; drops the old
/// table when nothing else is left in it.
#[cfg(feature = "postgres")]
async fn move_migration_records(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    schema: &Schema,
    old: &str,
    migrations: &'static Migrator,
    applied: &[i64],
) -> Result<(), MigrateError> {
    let table = schema.table(MIGRATIONS_TABLE);
    tx.ensure_migrations_table(&table).await?;
    let checksums = current_checksums(migrations, applied);
    let (versions, sums): (Vec<i64>, Vec<Vec<u8>>) = checksums.into_iter().unzip();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (version, description, installed_on, success, checksum, execution_time) \
         SELECT l.version, l.description, l.installed_on, l.success, c.checksum, l.execution_time \
           FROM {old}.{LEGACY_MIGRATIONS_TABLE} l \
           JOIN unnest($1::bigint[], $2::bytea[]) AS c(version, checksum) ON c.version = l.version"
    )))
    .bind(&versions)
    .bind(&sums)
    .execute(&mut **tx)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {old}.{LEGACY_MIGRATIONS_TABLE} WHERE version = ANY($1)"
    )))
    .bind(&versions)
    .execute(&mut **tx)
    .await?;
    let left: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {old}.{LEGACY_MIGRATIONS_TABLE}"
    )))
    .fetch_one(&mut **tx)
    .await?;
    if left == 0 {
        sqlx::query(AssertSqlSafe(format!(
            "DROP TABLE {old}.{LEGACY_MIGRATIONS_TABLE}"
        )))
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// Runs `migrations` into `schema` on `conn`, a connection of its own: moves a
/// first-release installation first, then runs the migrations with `search_path` set to
/// the schema, so that their unqualified DDL lands there. The caller closes `conn`
/// afterwards, setting and all.
#[cfg(feature = "postgres")]
pub(crate) async fn migrate_postgres(
    conn: &mut sqlx::PgConnection,
    schema: &Schema,
    migrations: &'static Migrator,
) -> Result<(), MigrateError> {
    if postgres(conn, schema, migrations).await? {
        tracing::info!(%schema, "moved the first release's tables into sagabox's schema");
    }
    sqlx::query(AssertSqlSafe(format!(
        "SET search_path TO {}",
        schema.quoted()
    )))
    .execute(&mut *conn)
    .await?;
    // `run_direct` is `run` on a bare connection (`run` takes any `Acquire`, which a
    // `&mut PgConnection` inside a `Send` future cannot satisfy for every lifetime).
    migrator(migrations, schema.table(MIGRATIONS_TABLE), Some(schema))
        .run_direct(None, conn, false)
        .await
}

/// Moves a first-release SQLite installation to the prefixed layout (see the module
/// docs). Returns whether it moved one.
#[cfg(feature = "sqlite")]
pub(crate) async fn sqlite(
    conn: &mut sqlx::SqliteConnection,
    migrations: &'static Migrator,
) -> Result<bool, MigrateError> {
    let mut tx = sqlx::Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE").await?;
    let exists = |name: &'static str| {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = $1)",
        )
        .bind(name)
    };
    let legacy = exists(LEGACY_MIGRATIONS_TABLE).fetch_one(&mut *tx).await?
        && exists("sagabox_inbox_pruned").fetch_one(&mut *tx).await?;
    let moved = exists(MIGRATIONS_TABLE).fetch_one(&mut *tx).await?;
    if !legacy || moved {
        tx.commit().await?;
        return Ok(false);
    }
    let ours: Vec<i64> = migrations
        .iter()
        .map(|migration| migration.version)
        .collect();
    let recorded: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {LEGACY_MIGRATIONS_TABLE} ORDER BY version"
    )))
    .fetch_all(&mut *tx)
    .await?;
    let applied: Vec<i64> = recorded.into_iter().filter(|v| ours.contains(v)).collect();
    if applied.is_empty() {
        tx.commit().await?;
        return Ok(false);
    }
    if exists(LEGACY_SAGA_TABLE).fetch_one(&mut *tx).await? {
        // SQLite renames a table's indexes along with it but keeps their names: each is
        // made again under its prefixed name, from its own definition.
        sqlx::query(AssertSqlSafe(format!(
            "ALTER TABLE {LEGACY_SAGA_TABLE} RENAME TO {SAGA_TABLE}"
        )))
        .execute(&mut *tx)
        .await?;
        let indexes: Vec<(String, String)> = sqlx::query_as(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = $1 \
              AND sql IS NOT NULL AND name LIKE 'saga\\_instances\\_%' ESCAPE '\\'",
        )
        .bind(SAGA_TABLE)
        .fetch_all(&mut *tx)
        .await?;
        for (name, sql) in indexes {
            sqlx::query(AssertSqlSafe(format!("DROP INDEX {name}")))
                .execute(&mut *tx)
                .await?;
            let renamed = sql.replacen(&name, &format!("sagabox_{name}"), 1);
            sqlx::query(AssertSqlSafe(renamed))
                .execute(&mut *tx)
                .await?;
        }
    }
    tx.ensure_migrations_table(MIGRATIONS_TABLE).await?;
    for (version, checksum) in current_checksums(migrations, &applied) {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {MIGRATIONS_TABLE} (version, description, installed_on, success, checksum, execution_time) \
             SELECT version, description, installed_on, success, $2, execution_time \
               FROM {LEGACY_MIGRATIONS_TABLE} WHERE version = $1"
        )))
        .bind(version)
        .bind(checksum)
        .execute(&mut *tx)
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {LEGACY_MIGRATIONS_TABLE} WHERE version = $1"
        )))
        .bind(version)
        .execute(&mut *tx)
        .await?;
    }
    let left: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {LEGACY_MIGRATIONS_TABLE}"
    )))
    .fetch_one(&mut *tx)
    .await?;
    if left == 0 {
        sqlx::query(AssertSqlSafe(format!(
            "DROP TABLE {LEGACY_MIGRATIONS_TABLE}"
        )))
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// Runs `migrations` on SQLite, recording them in sagabox's own table, after moving a
/// first-release installation.
#[cfg(feature = "sqlite")]
pub(crate) async fn migrate_sqlite(
    conn: &mut sqlx::SqliteConnection,
    migrations: &'static Migrator,
) -> Result<(), MigrateError> {
    if sqlite(conn, migrations).await? {
        tracing::info!("renamed the first release's tables to sagabox's prefixed names");
    }
    migrator(migrations, MIGRATIONS_TABLE.to_owned(), None)
        .run_direct(None, conn, false)
        .await
}
