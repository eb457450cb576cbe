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

/// `url` with every password replaced by `***`: the one in the user info
/// (`postgres://user:secret@host/db`, `amqp://user:secret@host/vhost`) and the value of
/// any query parameter whose name ends in `password` (`?password=secret`).
///
/// Meant for text that reaches logs, errors and reports, so it errs on the side of hiding
/// (it never fails, whatever the input): the user info runs to the **last** `@`, which
/// also covers a password with an unescaped `/`, `?`, `@` or `:` in it, and a query
/// password runs to the next `&`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return redact_query(url);
    };
    if let Some((userinfo, host)) = rest.rsplit_once('@')
        && let Some((user, _password)) = userinfo.split_once(':')
        && !user.contains(['/', '?', '#'])
    {
        return format!("{scheme}://{user}:***@{}", redact_query(host));
    }
    format!("{scheme}://{}", redact_query(rest))
}

/// `…?a=1&password=x` → `…?a=1&password=***`.
fn redact_query(text: &str) -> String {
    let Some((path, query)) = text.split_once('?') else {
        return text.to_owned();
    };
    let params: Vec<String> = query
        .split('&')
        .map(|param| match param.split_once('=') {
            Some((name, _)) if name.to_ascii_lowercase().ends_with("password") => {
                format!("{name}=***")
            }
            _ => param.to_owned(),
        })
        .collect();
    format!("{path}?{}", params.join("&"))
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

    #[test]
    fn amqp_urls_and_awkward_passwords_are_redacted() {
        let cases = [
            (
                "amqp://guest:guest-pw@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            (
                "amqps://u:p@rabbit/vhost?heartbeat=10",
                "amqps://u:***@rabbit/vhost?heartbeat=10",
            ),
            // Unescaped `/`, `@` and `:` in the password.
            ("postgres://u:pa/ss@db/x", "postgres://u:***@db/x"),
            (
                "postgres://u:p@ss:w@db:5432/x",
                "postgres://u:***@db:5432/x",
            ),
            // A password in the query string.
            (
                "postgres://u@db/x?sslmode=disable&password=qwerty&application_name=a",
                "postgres://u@db/x?sslmode=disable&password=***&application_name=a",
            ),
            ("postgres://u:pa?ss@db/x", "postgres://u:***@db/x"),
            (
                "postgres://db/x?PassWord=qwerty",
                "postgres://db/x?PassWord=***",
            ),
        ];
        for (url, redacted) in cases {
            assert_eq!(redact(url), redacted, "{url}");
        }
    }
}
