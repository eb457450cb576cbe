//! `sagabox console`: a web page for operators — the sagas by status and definition, one
//! saga's timeline and data, the inbox's partitions against its TTL, the dead letters —
//! served by axum as HTML rendered on the server (maud, which escapes every value it
//! writes). Everything is read through the same library functions as the other
//! commands ([`SagaStore`], [`sagabox::inspect`], [`DeadLetters`]), and the actions
//! (retry, cancel, replay) call the same code as `sagabox saga` and `sagabox dlq`.
//!
//! Layout: [`security`] (the token and CSRF checks), [`pages`] (the frame every page
//! shares and small formatting helpers), [`chart`] (the SVG charts), one module per page
//! ([`overview`], [`sagas`], [`inbox`], [`dead`]) and [`actions`] (the POSTs).
//!
//! [`DeadLetters`]: sagabox::dlq::DeadLetters

mod actions;
mod chart;
mod dead;
mod inbox;
mod overview;
mod pages;
mod sagas;
mod security;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sagabox::InboxError;
use sagabox::database::AnyStore;
use sagabox::database::open_migrated;
use sagabox::inspect::InspectOptions;
use sagabox::transport::Transport;

/// Database connections the console holds: a page runs its queries one after another,
/// and a few operators at once is the expected load.
const CONNECTIONS: u32 = 4;

/// How the console is run.
#[derive(Debug, Clone)]
pub(crate) struct ConsoleConfig {
    /// The database, as every subcommand takes it.
    pub(crate) database_url: String,
    /// The schema of sagabox's tables in it.
    pub(crate) schema: sagabox::Schema,
    /// The broker whose dead letters are shown; `None`: the page says how to add it.
    pub(crate) broker: Option<Transport>,
    /// The source queues whose dead letters are shown.
    pub(crate) dead_letter_queues: Vec<String>,
    /// Where to listen.
    pub(crate) listen: SocketAddr,
    /// Whether retry, cancel and replay are offered.
    pub(crate) allow_actions: bool,
    /// The secret every request must carry; required off loopback.
    pub(crate) token: Option<String>,
    /// The inbox settings the inbox page compares the partitions against.
    pub(crate) inspect: InspectOptions,
    /// The database connections it holds at most.
    pub(crate) pool_size: u32,
}

/// Why the console stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConsoleError {
    /// The database could not be opened.
    #[error(transparent)]
    Open(#[from] InboxError),
    /// The address cannot be listened on.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The server failed.
    #[error("the console's server failed: {0}")]
    Serve(std::io::Error),
}

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct Console {
    /// The database, opened once.
    pub(crate) db: AnyStore,
    pub(crate) config: ConsoleConfig,
    /// The CSRF token of this process: every form carries it, every POST must.
    pub(crate) csrf: String,
}

/// The shared state of the handlers.
pub(crate) type Shared = Arc<Console>;

/// A page that could not be made: its status and a sentence for the operator.
#[derive(Debug)]
pub(crate) struct PageError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl PageError {
    /// A failure to read (the database or the broker): 500 with the cause.
    pub(crate) fn read(error: impl std::fmt::Display) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: error.to_string(),
        }
    }

    /// A request the console refuses or cannot answer.
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let body = pages::frame(
            "Error",
            "",
            maud::html! {
                h1 { (self.status) }
                p.error { (self.message) }
            },
        );
        (self.status, body).into_response()
    }
}

/// Opens the database and serves the console until `stop` resolves; `ready` is told
/// the address once it listens (for tests and the line on stderr).
pub(crate) async fn serve(
    config: ConsoleConfig,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), ConsoleError> {
    let db = open_migrated(&config.database_url, &config.schema, config.pool_size).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ConsoleError::Listen {
            addr: config.listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| ConsoleError::Listen {
            addr: config.listen,
            source,
        })?;
    let console = Arc::new(Console {
        db,
        config,
        csrf: security::new_secret(),
    });
    let app = router(console);
    ready(addr);
    axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
        .map_err(ConsoleError::Serve)
}

/// Every page and action, behind the token check.
fn router(console: Shared) -> Router {
    Router::new()
        .route("/", get(overview::page))
        .route("/sagas", get(sagas::list))
        .route("/sagas/{id}", get(sagas::show))
        .route("/sagas/{id}/retry", post(actions::retry))
        .route("/sagas/{id}/cancel", post(actions::cancel))
        .route("/inbox", get(inbox::page))
        .route("/dead", get(dead::page))
        .route("/dead/replay", post(actions::replay))
        .route("/assets/console.css", get(pages::stylesheet))
        .fallback(|| async { PageError::new(StatusCode::NOT_FOUND, "no such page") })
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            security::check_token,
        ))
        .with_state(console)
}

/// `sagabox console`'s flags.
#[derive(Debug, clap::Args)]
pub(crate) struct ConsoleArgs {
    /// postgres://user@host:port/db or sqlite:path/to/file.db
    #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = crate::args::DEFAULT_DATABASE_URL)]
    pub(crate) database_url: String,
    /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
    /// installation sharing a database its own.
    #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
    pub(crate) db_schema: sagabox::Schema,
    /// The RabbitMQ broker whose dead letters to show (amqp://user:password@host:port/vhost);
    /// without it or --nats-url the dead-letter page says how to add one.
    // The value from the environment stays out of `--help`: it may hold a password.
    #[arg(
        long,
        value_name = "URL",
        env = "SAGABOX_AMQP_URL",
        hide_env_values = true
    )]
    pub(crate) amqp_url: Option<String>,
    /// A NATS JetStream server whose dead letters to show instead (nats://host:port).
    #[arg(
        long,
        value_name = "URL",
        env = "SAGABOX_NATS_URL",
        hide_env_values = true,
        conflicts_with = "amqp_url"
    )]
    pub(crate) nats_url: Option<String>,
    /// Source queues (or NATS subjects) whose dead letters (<queue>.dead) to show.
    /// Repeat or comma-separate.
    #[arg(
        long = "dead-letter-queue",
        value_name = "NAME",
        value_delimiter = ',',
        default_value = "sagabox.payment,sagabox.inventory,sagabox.email"
    )]
    pub(crate) dead_letter_queues: Vec<String>,
    /// Where to listen, HOST:PORT. Anything but a loopback address needs --token.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub(crate) listen: SocketAddr,
    /// Offer retry, cancel and replay (POSTs carrying a CSRF token); off by default, the
    /// console only reads.
    #[arg(long)]
    pub(crate) allow_actions: bool,
    /// A secret (16 characters or more) every request must carry: open the console with
    /// ?token=SECRET once, or send Authorization: Bearer SECRET. Required off loopback.
    #[arg(long, env = "SAGABOX_CONSOLE_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// Days a message stays deduplicated (as the inbox is configured).
    #[arg(long, default_value_t = 30)]
    pub(crate) ttl_days: u64,
    /// The broker's maximum redelivery window, in days (SQS: 14).
    #[arg(long, default_value_t = 14)]
    pub(crate) broker_retention_days: u64,
    /// Database connections the console holds at most (a page runs its queries one
    /// after another; several readers at once each take one).
    #[arg(long, default_value_t = CONNECTIONS, value_parser = crate::args::pool_size)]
    pub(crate) db_pool_size: u32,
}

/// Runs `sagabox console` until `stop`.
pub(crate) async fn run(
    args: ConsoleArgs,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<std::process::ExitCode, std::process::ExitCode> {
    if let Err(error) = security::check_listen(args.listen, args.token.as_deref()) {
        crate::usage_error("console", format_args!("--listen: {error}"));
    }
    let broker =
        sagabox_cli::args::dead_letter_broker(args.amqp_url.as_deref(), args.nats_url.as_deref())
            .unwrap_or_else(|message| crate::usage_error("console", message));
    const DAY: u64 = 86_400;
    let inbox = sagabox::InboxConfig::default()
        .with_ttl(std::time::Duration::from_secs(
            args.ttl_days.saturating_mul(DAY),
        ))
        .with_broker_retention(std::time::Duration::from_secs(
            args.broker_retention_days.saturating_mul(DAY),
        ));
    if let Err(error) = inbox.validate() {
        crate::usage_error("console", error);
    }
    let config = ConsoleConfig {
        database_url: args.database_url,
        schema: args.db_schema.clone(),
        broker,
        dead_letter_queues: args.dead_letter_queues,
        listen: args.listen,
        allow_actions: args.allow_actions,
        token: args.token,
        inspect: InspectOptions {
            config: inbox,
            schema: args.db_schema,
            ..InspectOptions::default()
        },
        pool_size: args.db_pool_size,
    };
    let ready = |addr: SocketAddr| crate::say(format_args!("console at http://{addr}/"));
    serve(config, stop, ready)
        .await
        .map_err(|error| crate::failed("console", error, false))?;
    Ok(std::process::ExitCode::SUCCESS)
}
