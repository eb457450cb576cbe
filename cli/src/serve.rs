//! `sagabox serve`: the checkout participants (and, with the `orchestrator` role, its
//! orchestrator) over RabbitMQ or NATS JetStream until interrupted.

use std::process::ExitCode;
use std::time::Duration;

use clap::ValueEnum;
use sagabox_cli::args::{self, DEFAULT_DATABASE_URL};

use crate::{failed, interrupted, start_metrics, usage_error};

/// The options of `sagabox serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Roles to serve. Repeat or comma-separate.
    #[arg(long, value_delimiter = ',', required = true)]
    pub(crate) role: Vec<Role>,
    /// The broker (the same flag as demo's): amqp://user@host:port/vhost or amqps://…
    /// (RabbitMQ), nats://host:port or tls://… (NATS JetStream); for a cluster, every
    /// node's URL, comma-separated.
    #[arg(long, value_name = "URL")]
    pub(crate) transport: String,
    /// postgres://user@host:port/db or sqlite:path/to/file.db
    #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub(crate) database_url: String,
    /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
    /// installation sharing a database its own.
    #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
    pub(crate) db_schema: sagabox::Schema,
    /// Queue names are <prefix>.<consumer_type>.
    #[arg(long, default_value = "sagabox")]
    pub(crate) queue_prefix: String,
    /// Unacknowledged messages per consumer (AMQP prefetch), 1 to 65535.
    #[arg(long, default_value_t = 32, value_parser = args::prefetch)]
    pub(crate) prefetch: u16,
    /// Workers per step pool (1 to 10000).
    #[arg(long, default_value_t = 4, value_parser = args::parallel)]
    pub(crate) workers: usize,
    /// Commands claimed per batch, in one transaction, one batch at a time per step: the
    /// commands that arrive while a batch runs go in the next (1: one at a time, on the
    /// workers side by side; at most the prefetch).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) batch: u16,
    /// Share of handler runs failing after their write, before commit (0..1).
    #[arg(long, default_value_t = 0.0, value_parser = args::rate_below_one)]
    pub(crate) fail_rate: f64,
    /// Seed of the injected failures.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Serve Prometheus metrics at HOST:PORT while serving (e.g. 127.0.0.1:9464), with
    /// /healthz and /readyz beside them.
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics_addr: Option<String>,
    /// Database connections this process holds at most (default: one per step worker,
    /// plus 4 for the relay, the pruner and setup, plus 16 with the orchestrator role;
    /// at most 64). Every process counts against the server's max_connections.
    #[arg(long, value_parser = args::pool_size)]
    pub(crate) db_pool_size: Option<u32>,
    // The pruner runs a pass at start, then hourly (one instance at a time).
    #[command(flatten)]
    pub(crate) retention: args::RetentionArgs,
    // Queue type, TTL and where the queues' retention is read.
    #[command(flatten)]
    pub(crate) broker: args::BrokerArgs,
}

/// Runs `sagabox serve`; `Err` carries the exit status of a failure already reported.
pub(crate) async fn run(args: ServeArgs) -> Result<ExitCode, ExitCode> {
    let ServeArgs {
        role,
        transport,
        database_url,
        db_schema,
        queue_prefix,
        prefetch,
        workers,
        batch,
        fail_rate,
        seed,
        metrics_addr,
        db_pool_size,
        retention,
        broker,
    } = args;
    let inbox = retention
        .config()
        .unwrap_or_else(|error| usage_error("serve", error));
    if batch > prefetch {
        usage_error(
            "serve",
            format_args!(
                "--batch {batch} is above --prefetch {prefetch}: a consumer holds at most the prefetch at once"
            ),
        );
    }
    let (roles, orchestrator) = split_roles(&role);
    let transport = sagabox::transport::Transport::from_url(&transport, &queue_prefix)
        .unwrap_or_else(|error| usage_error("serve", format_args!("--transport: {error}")))
        .with_prefetch(prefetch);
    let transport = broker.apply(transport).with_retention_of(&inbox);
    if let Err(error) = transport.validate() {
        usage_error("serve", format_args!("--transport: {error}"));
    }
    if let Some(addr) = metrics_addr {
        start_metrics(&addr).map_err(|error| failed("serve", error, false))?;
    }
    let config = sagabox_checkout::ServeConfig {
        roles,
        orchestrator,
        transport,
        workers,
        fail_rate,
        seed,
        resume_interval: Duration::from_secs(1),
        batch: usize::from(batch),
        inbox,
        prune_interval: Duration::from_secs(3600),
        pool_size: db_pool_size,
        schema: db_schema,
    };
    sagabox_checkout::serve(&database_url, config, interrupted())
        .await
        .map_err(|error| failed("serve", error, false))?;
    Ok(ExitCode::SUCCESS)
}

/// A role `serve` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Role {
    /// Charges and refunds (consumes <prefix>.payment).
    Payment,
    /// Decrements and restocks (consumes <prefix>.inventory).
    Inventory,
    /// Sends confirmations (consumes <prefix>.email).
    Email,
    /// Resumes unfinished checkout sagas.
    Orchestrator,
    /// Every role above.
    All,
}

/// The step roles and whether to run an orchestrator, from `--role`.
fn split_roles(roles: &[Role]) -> (Vec<sagabox::ConsumerType>, bool) {
    let mut steps = Vec::new();
    let mut orchestrator = false;
    for role in roles {
        use sagabox_checkout::names::{EMAIL, INVENTORY, PAYMENT};
        let names: &[&str] = match role {
            Role::Payment => &[PAYMENT],
            Role::Inventory => &[INVENTORY],
            Role::Email => &[EMAIL],
            Role::Orchestrator => &[],
            Role::All => &[PAYMENT, INVENTORY, EMAIL],
        };
        orchestrator |= matches!(role, Role::Orchestrator | Role::All);
        steps.extend(names.iter().copied());
    }
    steps.sort_unstable();
    steps.dedup();
    let steps = steps
        .into_iter()
        .filter_map(|name| sagabox::ConsumerType::new(name).ok())
        .collect();
    (steps, orchestrator)
}
