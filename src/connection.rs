//! Connecting to a database: the connection options a URL gives (its TLS files read and
//! checked first), the checks made before an SQLite file would be created,
//! [`ConnectError`], which says what could not be opened and where, and [`describe`],
//! the driver's error without its server-side source line. The stores connect through
//! it; [`database`](crate::database) opens the store a URL names and re-exports what is
//! public here.

use std::path::PathBuf;

use crate::logging::redact;

/// Whether `url` names a PostgreSQL database: `postgres://…` or `postgresql://…`.
pub(crate) fn names_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// Whether `url` names an SQLite database: `sqlite:…`.
pub(crate) fn names_sqlite(url: &str) -> bool {
    url.starts_with("sqlite:")
}

/// Why a database could not be opened: what was wrong and where, password redacted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL does not parse.
    #[error("invalid database url {url}: {reason}")]
    InvalidUrl {
        /// The URL, password redacted.
        url: String,
        /// What the driver said.
        reason: String,
    },
    /// The folder an SQLite file would be in does not exist.
    #[error(
        "cannot open the SQLite database {path}: the folder {folder} does not exist; create it \
         or give a path in an existing folder"
    )]
    SqliteFolderMissing {
        /// The file.
        path: String,
        /// Its folder.
        folder: String,
    },
    /// SQLite could not open the file.
    #[error("cannot open the SQLite database {path}: {reason}")]
    Sqlite {
        /// The file.
        path: String,
        /// Why, in the driver's words.
        reason: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// A TLS file named in the URL (`sslrootcert`, `sslcert`, `sslkey`) or by `PGSSL…`
    /// cannot be used.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// The TLS session with PostgreSQL could not be set up: the server's certificate was
    /// refused, or the server does not speak TLS where `sslmode` requires it.
    #[error("TLS to PostgreSQL at {host}:{port} ({url}) failed: {reason}")]
    PostgresTls {
        /// The URL, password redacted.
        url: String,
        /// The host connected to.
        host: String,
        /// The port.
        port: u16,
        /// What was refused, and what to change.
        reason: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// PostgreSQL did not finish the connection's opening in time.
    #[error(
        "cannot connect to PostgreSQL at {host}:{port} ({url}): no answer within {after:?}; is \
         the host right, and does a PostgreSQL server (not another service) listen there?"
    )]
    PostgresTimeout {
        /// The URL, password redacted.
        url: String,
        /// The host connected to.
        host: String,
        /// The port.
        port: u16,
        /// How long it waited.
        after: std::time::Duration,
    },
    /// PostgreSQL could not be reached, or refused the connection.
    #[error("cannot connect to PostgreSQL at {host}:{port} ({url}): {reason}")]
    Postgres {
        /// The URL, password redacted.
        url: String,
        /// The host (or socket folder) connected to.
        host: String,
        /// The port.
        port: u16,
        /// Why, and what to check.
        reason: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

impl ConnectError {
    /// The error of opening the database at `url`, from the driver's `error`.
    pub(crate) fn new(url: &str, error: sqlx::Error) -> Self {
        if let sqlx::Error::Configuration(reason) = &error {
            let mut reason = reason.to_string();
            if reason.contains("ssl_mode") {
                reason.push_str(
                    ": sslmode is one of disable, allow, prefer, require, verify-ca, verify-full",
                );
            }
            return ConnectError::InvalidUrl {
                url: redact(url),
                reason: crate::logging::scrub(&reason, url),
            };
        }
        #[cfg(feature = "postgres")]
        if names_postgres(url) {
            use std::str::FromStr;
            let (host, port) = sqlx::postgres::PgConnectOptions::from_str(url).map_or_else(
                |_| (String::from("?"), 0),
                |options| (options.get_host().to_owned(), options.get_port()),
            );
            // rustls's refusals reach sqlx as TLS errors, or (during the handshake) as
            // I/O errors of kind InvalidData.
            let tls_words = match &error {
                sqlx::Error::Tls(tls) => Some(tls.to_string()),
                sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::InvalidData => {
                    Some(io.to_string())
                }
                _ => None,
            };
            if let Some(words) = tls_words {
                let advice = crate::tls::handshake_advice(
                    &words,
                    &host,
                    "sslrootcert",
                    Some("sslmode=verify-ca"),
                );
                return ConnectError::PostgresTls {
                    url: redact(url),
                    reason: advice.unwrap_or_else(|| {
                        format!("{words}; check sslmode, sslrootcert, sslcert and sslkey")
                    }),
                    host,
                    port,
                    source: error,
                };
            }
            let reason = match &error {
                sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
                    "connection refused: is PostgreSQL running there, and are the host and port right?"
                        .to_owned()
                }
                sqlx::Error::Io(io) => format!("{io}: is the host right and reachable?"),
                other => describe(other),
            };
            return ConnectError::Postgres {
                url: redact(url),
                host,
                port,
                reason,
                source: error,
            };
        }
        ConnectError::Sqlite {
            path: sqlite_file(url).map_or_else(|| redact(url), |path| path.display().to_string()),
            reason: describe(&error),
            source: error,
        }
    }
}

/// The connection options a `postgres://` URL gives, its TLS files (`sslrootcert`,
/// `sslcert`, `sslkey`, or `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY`) read and checked
/// first, so a missing or malformed file is named before anything connects.
#[cfg(feature = "postgres")]
pub(crate) fn postgres_options(
    url: &str,
) -> Result<sqlx::postgres::PgConnectOptions, ConnectError> {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(url)
        .map_err(|error| ConnectError::new(url, error))?;
    let files = postgres_tls_files(url);
    if !files.is_empty() {
        let server = format!(
            "PostgreSQL at {}:{}",
            options.get_host(),
            options.get_port()
        );
        files.load(&server, ("sslcert", "sslkey"))?;
    }
    Ok(options)
}

/// How long opening one PostgreSQL connection (TCP, TLS, authentication) may take.
#[cfg(feature = "postgres")]
const POSTGRES_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// Opens one connection with `options` (from `url`), or says why not within
/// [`POSTGRES_CONNECT_TIMEOUT`]: a server that accepts the TCP connection and never
/// answers (another service on the port, a firewall that swallows packets) is an error,
/// not a hang.
#[cfg(feature = "postgres")]
pub(crate) async fn connect_postgres(
    url: &str,
    options: &sqlx::postgres::PgConnectOptions,
) -> Result<sqlx::PgConnection, ConnectError> {
    use sqlx::Connection;
    match tokio::time::timeout(
        POSTGRES_CONNECT_TIMEOUT,
        sqlx::PgConnection::connect_with(options),
    )
    .await
    {
        Ok(opened) => opened.map_err(|error| ConnectError::new(url, error)),
        Err(_) => Err(ConnectError::PostgresTimeout {
            url: redact(url),
            host: options.get_host().to_owned(),
            port: options.get_port(),
            after: POSTGRES_CONNECT_TIMEOUT,
        }),
    }
}

/// The TLS files a PostgreSQL URL names, in libpq's names and sqlx's aliases, else in
/// libpq's environment variables, as sqlx reads them.
#[cfg(feature = "postgres")]
fn postgres_tls_files(url: &str) -> crate::tls::TlsFiles {
    let mut files = crate::tls::TlsFiles {
        ca_file: std::env::var_os("PGSSLROOTCERT").map(PathBuf::from),
        cert_file: std::env::var_os("PGSSLCERT").map(PathBuf::from),
        key_file: std::env::var_os("PGSSLKEY").map(PathBuf::from),
    };
    let query = url.split_once('?').map_or("", |(_, query)| query);
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let path = || Some(PathBuf::from(crate::tls::percent_decode(value)));
        match name {
            "sslrootcert" | "ssl-root-cert" | "ssl-ca" => files.ca_file = path(),
            "sslcert" | "ssl-cert" => files.cert_file = path(),
            "sslkey" | "ssl-key" => files.key_file = path(),
            _ => {}
        }
    }
    files
}

/// The file an `sqlite:` URL names; `None` for an in-memory database, a URL of another
/// database, or one that does not parse.
pub(crate) fn sqlite_file(url: &str) -> Option<PathBuf> {
    #[cfg(feature = "sqlite")]
    {
        use std::str::FromStr;
        if !names_sqlite(url) || url.contains(":memory:") || url.contains("mode=memory") {
            return None;
        }
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(url).ok()?;
        Some(options.get_filename().to_path_buf())
    }
    #[cfg(not(feature = "sqlite"))]
    {
        let _ = url;
        None
    }
}

/// Refuses an `sqlite:` URL whose file would be in a folder that does not exist: SQLite
/// itself only says "unable to open database file", without the path.
pub(crate) fn check_sqlite_folder(url: &str) -> Result<(), ConnectError> {
    let Some(path) = sqlite_file(url) else {
        return Ok(());
    };
    match path.parent() {
        Some(folder) if !folder.as_os_str().is_empty() && !folder.is_dir() => {
            Err(ConnectError::SqliteFolderMissing {
                path: path.display().to_string(),
                folder: folder.display().to_string(),
            })
        }
        _ => Ok(()),
    }
}

/// The driver's `error` as a sentence for people: a database's own message without the
/// PostgreSQL server's source line (`… at line 948`), which names a line of the server's
/// C code, not of anything the user wrote.
pub fn describe(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(database) => database.message().to_owned(),
        other => other.to_string(),
    }
}

/// For commands that must not create a database: `Some(what)` when the file an `sqlite:`
/// URL names does not exist; [`ConnectError::SqliteFolderMissing`] when its folder does
/// not either.
pub fn missing_sqlite_file(url: &str) -> Result<Option<String>, ConnectError> {
    check_sqlite_folder(url)?;
    Ok(sqlite_file(url)
        .filter(|path| !path.exists())
        .map(|path| format!("there is no file {}", path.display())))
}
