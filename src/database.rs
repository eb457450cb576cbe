//! Opening the right store from a database URL: [`AnyStore`], the one place that
//! picks the database at run time, for the CLI, `inspect` and code that works on sagas
//! on either database; migrating and pruning by URL ([`migrate`], [`prune`]);
//! [`ConnectError`], which says what could not be opened and where; and [`describe`],
//! the driver's error without its server-side source line.

#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod any;

pub use crate::connection::{ConnectError, describe, missing_sqlite_file};
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use any::{AnyStore, OnAnyStore, OnStore, Store};

use crate::inbox::{InboxConfig, InboxError, InboxGuard};
use crate::logging::redact;
use crate::month::Month;
use crate::pruner::{Maintenance, PrunePass};
use crate::saga::history_months;
use crate::saga::{HistoryPruned, history_pass};
use crate::schema::{MIGRATIONS_TABLE, Schema};
#[cfg(any(feature = "postgres", feature = "sqlite"))]
use sqlx::AssertSqlSafe;

/// Which database a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// `postgres://…` or `postgresql://…`.
    Postgres,
    /// `sqlite:…`.
    Sqlite,
}

impl Backend {
    /// The backend `url` names, or [`InboxError::UnsupportedUrl`].
    pub fn of(url: &str) -> Result<Self, InboxError> {
        if crate::connection::names_postgres(url) {
            Ok(Backend::Postgres)
        } else if crate::connection::names_sqlite(url) {
            Ok(Backend::Sqlite)
        } else {
            Err(InboxError::UnsupportedUrl(redact(url)))
        }
    }

    /// The backend `url` names, with the URL checked as far as it can be without
    /// connecting: a PostgreSQL URL must parse (host, port, `sslmode` and the other
    /// options); its TLS files are read when connecting. A URL the driver refuses is
    /// [`ConnectError::InvalidUrl`] (inside [`InboxError::Connect`]).
    pub fn parse(url: &str) -> Result<Self, InboxError> {
        let backend = Self::of(url)?;
        #[cfg(feature = "postgres")]
        if backend == Backend::Postgres {
            use std::str::FromStr;
            sqlx::postgres::PgConnectOptions::from_str(url)
                .map_err(|error| ConnectError::new(url, error))?;
        }
        Ok(backend)
    }
}

/// Runs the migrations of the database at `url` and creates its current and upcoming
/// inbox partitions (and saga history partitions, on PostgreSQL). Returns the inbox months
/// it created.
///
/// On PostgreSQL the tables go to `schema` (SQLite has none and ignores it); an
/// installation of the first release is moved there first.
pub async fn migrate(
    url: &str,
    schema: &Schema,
    config: InboxConfig,
) -> Result<Vec<Month>, InboxError> {
    AnyStore::connect(url, 2, schema)
        .await?
        .run(Migrate { config })
        .await
}

/// [`migrate`]'s work on the store the URL named.
struct Migrate {
    config: InboxConfig,
}

impl<S: Store> OnStore<S> for Migrate {
    type Output = Result<Vec<Month>, InboxError>;

    async fn run(self, store: S) -> Self::Output {
        let guard = InboxGuard::new(store, self.config)?;
        let created = guard.migrate().await?;
        let months = history_months(guard.now(), guard.config().partitions_ahead)?;
        guard.store().prepare_history(&months).await?;
        Ok(created)
    }
}

/// Prunes the saga history of the database at `url` ([`history_pass`]): drops
/// (PostgreSQL) or deletes the history of finished sagas created in months wholly older
/// than `retention`, and creates the history partitions of the months ahead
/// (`config.partitions_ahead`). With `dry_run`, only reports what it would do.
/// Unfinished sagas keep their history.
pub async fn prune_history(
    url: &str,
    schema: &Schema,
    config: InboxConfig,
    retention: std::time::Duration,
    dry_run: bool,
) -> Result<HistoryPruned, InboxError> {
    let ahead = config.partitions_ahead;
    let now = chrono::Utc::now();
    let store = open_migrated(url, schema, 2).await?;
    Ok(history_pass(&store, now, retention, ahead, dry_run).await?)
}

/// Runs one pruner pass on the database at `url`: creates the partitions ahead and drops
/// the expired ones; with `dry_run`, only reports what it would do.
///
/// The database must exist and be migrated ([`InboxError::NotMigrated`] otherwise): a
/// pass never creates an SQLite file, nor partitions of tables that are not there.
pub async fn prune(
    url: &str,
    schema: &Schema,
    config: InboxConfig,
    dry_run: bool,
) -> Result<PrunePass, InboxError> {
    open_migrated(url, schema, 2)
        .await?
        .run(Prune { config, dry_run })
        .await
}

/// [`prune`]'s work on the store the URL named.
struct Prune {
    config: InboxConfig,
    dry_run: bool,
}

impl<S: Store> OnStore<S> for Prune {
    type Output = Result<PrunePass, InboxError>;

    async fn run(self, store: S) -> Self::Output {
        InboxGuard::new(store, self.config)?
            .run_pass(self.dry_run)
            .await
    }
}

/// Opens the database at `url`, with up to `connections` connections, for a command that
/// works on what is there (pruning, operator commands): it never creates an SQLite file,
/// and refuses a database without this version's migrations
/// ([`InboxError::NotMigrated`], which says to run `sagabox migrate`). On PostgreSQL
/// sagabox's tables are looked for in `schema`; SQLite ignores it.
pub async fn open_migrated(
    url: &str,
    schema: &Schema,
    connections: u32,
) -> Result<AnyStore, InboxError> {
    let not_migrated = |what: String| InboxError::NotMigrated {
        url: redact(url),
        what,
    };
    // Checked before connecting: connecting creates a missing SQLite file.
    if let Some(what) = missing_sqlite_file(url)? {
        return Err(not_migrated(what));
    }
    let store = AnyStore::connect(url, connections, schema).await?;
    if let Some(what) = store.unapplied_migrations().await? {
        return Err(not_migrated(what));
    }
    Ok(store)
}

/// What keeps the PostgreSQL database behind `conn` from being at this version's
/// migrations, or `None` when every one has run.
#[cfg(feature = "postgres")]
pub(crate) async fn unapplied_postgres(
    conn: &mut sqlx::PgConnection,
    schema: &Schema,
) -> Result<Option<String>, sqlx::Error> {
    let table = schema.table(MIGRATIONS_TABLE);
    let (has_table, first_release): (bool, bool) = sqlx::query_as(
        "SELECT to_regclass($1) IS NOT NULL, \
                to_regclass('_sqlx_migrations') IS NOT NULL AND to_regclass('sagabox_inbox') IS NOT NULL",
    )
    .bind(&table)
    .fetch_one(&mut *conn)
    .await?;
    if !has_table {
        return Ok(Some(if first_release {
            format!(
                "its tables are laid out by sagabox's first release, beside the application's; \
                 `sagabox migrate` moves them into schema {schema}"
            )
        } else {
            format!("{NO_MIGRATIONS} in schema {schema}")
        }));
    }
    let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {table} WHERE success"
    )))
    .fetch_all(&mut *conn)
    .await?;
    Ok(unapplied(&crate::store::POSTGRES_MIGRATOR, &applied))
}

/// What keeps the SQLite database behind `conn` from being at this version's
/// migrations, or `None` when every one has run.
#[cfg(feature = "sqlite")]
pub(crate) async fn unapplied_sqlite(
    conn: &mut sqlx::SqliteConnection,
) -> Result<Option<String>, sqlx::Error> {
    let (has_table, first_release): (bool, bool) = sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = $1), \
                EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'saga_instances')",
    )
    .bind(MIGRATIONS_TABLE)
    .fetch_one(&mut *conn)
    .await?;
    if !has_table {
        return Ok(Some(if first_release {
            "its tables are laid out by sagabox's first release; `sagabox migrate` renames them"
                .to_owned()
        } else {
            NO_MIGRATIONS.to_owned()
        }));
    }
    let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {MIGRATIONS_TABLE} WHERE success"
    )))
    .fetch_all(&mut *conn)
    .await?;
    Ok(unapplied(&crate::store::SQLITE_MIGRATOR, &applied))
}

const NO_MIGRATIONS: &str = "no migrations have run";

/// The migrations of `migrator` missing from `applied`, named, or `None`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn unapplied(migrator: &sqlx::migrate::Migrator, applied: &[i64]) -> Option<String> {
    let missing: Vec<String> = migrator
        .iter()
        .filter(|m| !applied.contains(&m.version))
        .map(|m| format!("{}_{}", m.version, m.description))
        .collect();
    (!missing.is_empty()).then(|| format!("migrations not applied: {}", missing.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://app:s3cret@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(redact("postgres://app@db/x"), "postgres://app@db/x");
        assert_eq!(redact("sqlite:a.db"), "sqlite:a.db");
        assert!(matches!(
            Backend::of("mysql://u:pw@h/x"),
            Err(InboxError::UnsupportedUrl(u)) if !u.contains("pw")
        ));
    }
}
