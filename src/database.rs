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
/// and never fails, whatever the input: the user info runs to the **last** `@` (a
/// password may hold an unescaped `/`, `?`, `@` or `:`), a query password runs to the
/// next `&`, and where the two readings overlap both are hidden.
pub fn redact(url: &str) -> String {
    let mut hidden: Vec<(usize, usize)> = Vec::new();
    // The user info's password: between the first `:` after the scheme and the last `@`.
    if let Some(scheme_end) = url.find("://") {
        let start = scheme_end + 3;
        let rest = &url[start..];
        if let Some(at) = rest.rfind('@')
            && let Some(colon) = rest[..at].find(':')
            && !rest[..colon].contains(['/', '?', '#'])
        {
            hidden.push((start + colon + 1, start + at));
        }
    }
    // Query passwords: after any `?` or `&`, `…password=` up to the next `&`.
    for (delimiter, _) in url.match_indices(['?', '&']) {
        let param_start = delimiter + 1;
        let param_end = url[param_start..]
            .find('&')
            .map_or(url.len(), |i| param_start + i);
        let param = &url[param_start..param_end];
        if let Some(eq) = param.find('=')
            && param[..eq].to_ascii_lowercase().ends_with("password")
        {
            hidden.push((param_start + eq + 1, param_end));
        }
    }
    hidden.sort_unstable();
    let mut out = String::with_capacity(url.len());
    let mut shown_from = 0;
    for (start, end) in hidden {
        if end <= shown_from {
            continue;
        }
        if start >= shown_from {
            out.push_str(&url[shown_from..start]);
            out.push_str("***");
        }
        shown_from = end;
    }
    out.push_str(&url[shown_from..]);
    out
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
            // Both readings overlap: both hidden.
            ("postgres://u:pw?password=z@h/p?x=1", "postgres://u:***"),
            ("postgres://u@h:5432/d?password=a@b", "postgres://u@h:***"),
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
