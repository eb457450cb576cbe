//! `sagabox orchestrate`: the library's orchestrator service
//! ([`sagabox::orchestrate::orchestrate`]) on the store a database URL names, driving the
//! sagas of the TOML files it is given.

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use sagabox::database::{AnyStore, OnStore, Store};
use sagabox::orchestrate::{OrchestrateConfig, OrchestrateError, orchestrate};
use sagabox_cli::args::{self, DEFAULT_DATABASE_URL};

use crate::{failed, interrupted, start_metrics, usage_error};

/// Opens the store at `url` (sagabox's tables in `schema`, on PostgreSQL) with a pool of
/// up to `connections` (the orchestrators' drivers, the start consumers and setup share
/// them) and drives `config`'s sagas until `shutdown` resolves.
async fn drive(
    url: &str,
    schema: &sagabox::Schema,
    connections: u32,
    config: OrchestrateConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), OrchestrateError> {
    AnyStore::connect(url, connections, schema)
        .await?
        .run(Drive { config, shutdown })
        .await
}

/// [`drive`]'s work on the store the URL named.
struct Drive<F> {
    config: OrchestrateConfig,
    shutdown: F,
}

impl<S: Store, F: Future<Output = ()> + Send> OnStore<S> for Drive<F> {
    type Output = Result<(), OrchestrateError>;

    async fn run(self, store: S) -> Self::Output {
        orchestrate(store, self.config, self.shutdown).await
    }
}

/// The options of `sagabox orchestrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct OrchestrateArgs {
    /// A saga definition (TOML). Repeat for several sagas.
    #[arg(long = "saga", value_name = "FILE", required = true)]
    pub(crate) sagas: Vec<std::path::PathBuf>,
    /// The broker: amqp://user@host:port/vhost or amqps://… (RabbitMQ), nats://host:port
    /// or tls://… (NATS JetStream); for a cluster, every node's URL, comma-separated.
    #[arg(long, value_name = "URL")]
    pub(crate) transport: String,
    /// postgres://user@host:port/db or sqlite:path/to/file.db
    #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub(crate) database_url: String,
    /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
    /// installation sharing a database its own.
    #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
    pub(crate) db_schema: sagabox::Schema,
    /// Queue names are <prefix>.<consumer_type>; start messages go to
    /// <prefix>.<saga>.start.
    #[arg(long, default_value = "sagabox")]
    pub(crate) queue_prefix: String,
    /// How often unfinished sagas are looked for and resumed, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) resume_interval_ms: u64,
    /// Days the history of a finished saga is kept (in whole months); one process at a
    /// time prunes it every hour. 0 keeps it forever.
    #[arg(long, default_value_t = 90)]
    pub(crate) history_retention_days: u64,
    /// Serve Prometheus metrics at HOST:PORT while running (e.g. 127.0.0.1:9464), with
    /// /healthz and /readyz beside them.
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics_addr: Option<String>,
    /// Database connections this process holds at most: the sagas' drivers, the start
    /// consumers and setup share them.
    #[arg(long, default_value_t = 16, value_parser = args::pool_size)]
    pub(crate) db_pool_size: u32,
    // The inbox table of the database (the orchestrators write none of it; the
    // participants sharing the database do): its TTL, checked against what the
    // broker keeps; its pruner runs a pass at start, then hourly (one at a time).
    #[command(flatten)]
    pub(crate) retention: args::RetentionArgs,
    // Queue type, TTL and where the queues' retention is read.
    #[command(flatten)]
    pub(crate) broker: args::BrokerArgs,
}

/// Runs `sagabox orchestrate`; `Err` carries the exit status of a failure already reported.
pub(crate) async fn run(args: OrchestrateArgs) -> Result<ExitCode, ExitCode> {
    let OrchestrateArgs {
        sagas,
        transport,
        database_url,
        db_schema,
        queue_prefix,
        resume_interval_ms,
        history_retention_days,
        metrics_addr,
        db_pool_size,
        retention,
        broker,
    } = args;
    let inbox = retention
        .config()
        .unwrap_or_else(|error| usage_error("orchestrate", error));
    let mut definitions = Vec::with_capacity(sagas.len());
    for path in &sagas {
        let definition = sagabox::saga::SagaDefinition::load(path).unwrap_or_else(|error| {
            usage_error(
                "orchestrate",
                format_args!("--saga {}: {error}", path.display()),
            )
        });
        definitions.push(definition);
    }
    let transport = sagabox::transport::Transport::from_url(&transport, &queue_prefix)
        .unwrap_or_else(|error| usage_error("orchestrate", format_args!("--transport: {error}")));
    // Over RabbitMQ the start queues' measured retention is checked against the
    // inbox TTL; over JetStream the streams' max_age is.
    let transport = broker.apply(transport).with_retention_of(&inbox);
    if let Err(error) = transport.validate() {
        usage_error("orchestrate", format_args!("--transport: {error}"));
    }
    if let Some(addr) = metrics_addr {
        start_metrics(&addr).map_err(|error| failed("orchestrate", error, false))?;
    }
    let config = OrchestrateConfig {
        definitions,
        transport,
        resume_interval: Duration::from_millis(resume_interval_ms),
        history_retention: (history_retention_days > 0)
            .then(|| Duration::from_secs(history_retention_days.saturating_mul(86_400))),
        inbox,
        pruner: Some(sagabox::pruner::PrunerSettings::default()),
    };
    drive(
        &database_url,
        &db_schema,
        db_pool_size,
        config,
        interrupted(),
    )
    .await
    .map_err(|error| failed("orchestrate", error, false))?;
    Ok(ExitCode::SUCCESS)
}
