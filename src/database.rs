//! Opening the right store from a database URL, for the CLI and quick starts
//! ([`migrate`], [`prune`]); and [`redact`], which keeps passwords out of logs and error
//! messages.

use crate::inbox::{InboxConfig, InboxError, InboxGuard};
use crate::month::Month;
use crate::pruner::{Maintenance, PrunePass};

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
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Backend::Postgres)
        } else if url.starts_with("sqlite:") {
            Ok(Backend::Sqlite)
        } else {
            Err(InboxError::UnsupportedUrl(redact(url)))
        }
    }
}

/// `url` with any password replaced by `***`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{path}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// Runs the migrations of the database at `url` and creates its current and upcoming
/// inbox partitions. Returns the months it created.
pub async fn migrate(url: &str, config: InboxConfig) -> Result<Vec<Month>, InboxError> {
    match Backend::of(url)? {
        #[cfg(feature = "postgres")]
        Backend::Postgres => {
            let store = crate::PostgresStore::connect(url, 2).await?;
            InboxGuard::new(store, config)?.migrate().await
        }
        #[cfg(feature = "sqlite")]
        Backend::Sqlite => {
            let store = crate::SqliteStore::connect(url, 2).await?;
            InboxGuard::new(store, config)?.migrate().await
        }
        #[allow(unreachable_patterns)]
        _ => Err(InboxError::UnsupportedUrl(redact(url))),
    }
}

/// Runs one pruner pass on the database at `url`: creates the partitions ahead and drops
/// the expired ones; with `dry_run`, only reports what it would do.
pub async fn prune(url: &str, config: InboxConfig, dry_run: bool) -> Result<PrunePass, InboxError> {
    match Backend::of(url)? {
        #[cfg(feature = "postgres")]
        Backend::Postgres => {
            let store = crate::PostgresStore::connect(url, 2).await?;
            InboxGuard::new(store, config)?.run_pass(dry_run).await
        }
        #[cfg(feature = "sqlite")]
        Backend::Sqlite => {
            let store = crate::SqliteStore::connect(url, 2).await?;
            InboxGuard::new(store, config)?.run_pass(dry_run).await
        }
        #[allow(unreachable_patterns)]
        _ => Err(InboxError::UnsupportedUrl(redact(url))),
    }
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
