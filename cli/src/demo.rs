//! `sagabox demo`: the checkout saga under injected faults, in process or over a broker,
//! and the verdict read from the tables (exit status 3 on damage).

use std::process::ExitCode;

use sagabox_cli::args::{self, DEFAULT_DATABASE_URL};

use crate::{EXIT_DAMAGE, failed, report, start_metrics, usage_error};

/// The options of `sagabox demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// sqlite:path/to/file.db or postgres://user@host:port/db
    #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub(crate) database_url: String,
    /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
    /// installation sharing a database its own.
    #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
    pub(crate) db_schema: sagabox::Schema,
    /// Orders to place (with --resume: the resumed run's number is kept).
    #[arg(long, default_value_t = 1000, value_parser = args::count)]
    pub(crate) orders: usize,
    /// Sagas in flight at once (1 to 10000).
    #[arg(long, default_value_t = 32, value_parser = args::parallel)]
    pub(crate) concurrency: usize,
    /// Share of step commands delivered twice, concurrently (0..=1).
    #[arg(long, default_value_t = 0.5, value_parser = args::rate)]
    pub(crate) duplicate_rate: f64,
    /// Share of replies lost after the step committed (0..1).
    #[arg(long, default_value_t = 0.1, value_parser = args::rate_below_one)]
    pub(crate) lost_reply_rate: f64,
    /// Share of handler runs failing after their write, before commit (0..1).
    #[arg(long, default_value_t = 0.1, value_parser = args::rate_below_one)]
    pub(crate) fail_rate: f64,
    /// Share of orders whose card is declined (0..=1).
    #[arg(long, default_value_t = 0.05, value_parser = args::rate)]
    pub(crate) decline_rate: f64,
    /// The most step commands one transaction claims, in process or in the participants
    /// this process runs behind a broker: the commands that arrive while a step's batch
    /// runs go together in its next (1 to 10000). A failing handler (--fail-rate) rolls
    /// back its whole batch, which then runs one by one.
    #[arg(long, default_value_t = 1, value_parser = args::parallel)]
    pub(crate) claim_batch: usize,
    /// Seed of the orders and of the fault draws. The order in which concurrent
    /// deliveries and retries meet is the scheduler's, so counts vary between runs.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Defeat the inbox (every delivery under a new message id): the control that
    /// shows the damage.
    #[arg(long)]
    pub(crate) no_inbox: bool,
    /// Resume a killed run: finish its unfinished sagas, then place the orders it had
    /// not placed yet (its --orders, not this one's).
    #[arg(long, conflicts_with = "clock_speed")]
    pub(crate) resume: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Send commands and replies through a broker instead of in process: RabbitMQ
    /// (amqp://guest:guest@127.0.0.1:5672/%2f, amqps://… for TLS) or NATS JetStream
    /// (nats://127.0.0.1:4222, tls://… for TLS).
    #[arg(long, value_name = "URL")]
    pub(crate) transport: Option<String>,
    /// Queue names are <prefix>.<consumer_type> (with --transport).
    #[arg(long, default_value = "sagabox")]
    pub(crate) queue_prefix: String,
    /// The participants run as `sagabox serve` processes; this one only places
    /// orders and orchestrates (with --transport).
    #[arg(long, requires = "transport", conflicts_with = "clock_speed")]
    pub(crate) external_participants: bool,
    /// Deliveries of one message before it is dead-lettered (with --transport; the
    /// same number as the participants' `serve --max-deliveries`).
    #[arg(long, default_value_t = 5, requires = "transport",
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) max_deliveries: u32,
    /// Copies of each queue or stream the demo creates, on as many nodes of a cluster
    /// (with --transport; the same number as the participants' `serve --replicas`).
    #[arg(long, requires = "transport", value_parser = clap::value_parser!(u8).range(1..=5))]
    pub(crate) replicas: Option<u8>,
    /// The RabbitMQ management API, where the queues' real retention is read (with
    /// --transport; default: `http://BROKER-HOST:15672`).
    #[arg(long, value_name = "URL", requires = "transport")]
    pub(crate) amqp_management_url: Option<String>,
    /// Serve Prometheus metrics at HOST:PORT while the demo runs (e.g. 127.0.0.1:9464).
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics_addr: Option<String>,
    /// Soak test mode: run the clock this many times faster than real time (43200: a
    /// month a minute), so the pruner creates and drops inbox months during the run.
    /// Use a scratch database: months pruned stay pruned. Not with --resume.
    #[arg(long, default_value_t = 1.0, value_parser = args::clock_speed)]
    pub(crate) clock_speed: f64,
}

/// Runs `sagabox demo`; `Err` carries the exit status of a failure already reported.
pub(crate) async fn run(args: DemoArgs) -> Result<ExitCode, ExitCode> {
    let DemoArgs {
        database_url,
        db_schema,
        orders,
        concurrency,
        duplicate_rate,
        lost_reply_rate,
        fail_rate,
        decline_rate,
        claim_batch,
        seed,
        no_inbox,
        resume,
        json,
        transport,
        queue_prefix,
        external_participants,
        max_deliveries,
        replicas,
        amqp_management_url,
        metrics_addr,
        clock_speed,
    } = args;
    let config = sagabox_checkout::DemoConfig {
        orders,
        concurrency,
        pace: None,
        duplicate_rate,
        lost_reply_rate,
        fail_rate,
        decline_rate,
        claim_batch,
        seed,
        no_inbox,
        resume,
        progress: true,
        transport: transport.map(|url| sagabox_checkout::DemoTransport {
            url,
            queue_prefix,
            external_participants,
            max_deliveries,
            replicas,
            amqp_management_url,
        }),
        clock_speed,
        clock_start: None,
        schema: db_schema,
    };
    if let Err(error) = config.validate() {
        usage_error("demo", error);
    }
    if let Some(addr) = metrics_addr {
        start_metrics(&addr).map_err(|error| failed("demo", error, json))?;
    }
    let summary = sagabox_checkout::run(&database_url, &config).await;
    let verdict = summary.as_ref().ok().map(|summary| summary.verdict);
    report("demo", summary, json)?;
    Ok(match verdict {
        Some(sagabox_checkout::Verdict::Ok) => ExitCode::SUCCESS,
        _ => ExitCode::from(EXIT_DAMAGE),
    })
}
