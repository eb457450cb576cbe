//! The `sagabox` command line: `demo`, `serve`, `orchestrate`, `migrate`, `prune`,
//! `inspect`, `saga`, `dlq`, `bench`, `bench-broker`, `console`.
//!
//! Exit status: 0 done; 1 the run failed (the cause on stderr, and with `--json` also as
//! `{"error": "…"}` on stdout); 2 a usage error (clap's, or a value refused after
//! parsing, with the same shape); 3 `demo` ran and found damage (its verdict).

mod bench;
mod console;
mod dlq;
mod environment;
mod orchestrate;
mod saga;

use std::fmt::Display;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use sagabox::InboxConfig;
use sagabox::database::{migrate, prune, prune_history, redact};
use sagabox::inspect::{InspectOptions, inspect};
use sagabox_cli::args::{self, DEFAULT_DATABASE_URL};
use sagabox_cli::telemetry::{LogFormat, init_tracing};

/// Starts the Prometheus endpoint, or says why the build has none.
fn start_metrics(addr: &str) -> Result<(), String> {
    {
        let listening = sagabox::metrics::install_prometheus(addr).map_err(|e| e.to_string())?;
        say(format_args!(
            "metrics at http://{listening}/metrics, health at /healthz and /readyz"
        ));
        Ok(())
    }
}

/// The exit status of a `demo` whose verdict is damage: it ran to the end, and found side
/// effects applied twice or not undone.
const EXIT_DAMAGE: u8 = 3;

const EXIT_STATUS: &str = "Exit status: 0 done; 1 the run failed (with --json also {\"error\": …} \
    on stdout); 2 usage error; 3 demo found damage.";

/// Saga participants that process every message effectively exactly once.
#[derive(Debug, Parser)]
#[command(name = "sagabox", version, about, after_help = EXIT_STATUS)]
struct Cli {
    /// Log lines on stderr: human or json (one object per line). RUST_LOG filters them
    /// (default: warnings, and serve's up and stop lines; RUST_LOG=sagabox=debug shows a
    /// line per message and step attempt).
    #[arg(long, global = true, default_value_t = LogFormat::Human, env = "SAGABOX_LOG_FORMAT")]
    log_format: LogFormat,
    /// Export spans over OTLP/HTTP to this collector (a base URL, e.g.
    /// http://localhost:4318; /v1/traces is appended). A saga is one trace across the
    /// orchestrator and its participants. Unset: nothing is exported.
    #[arg(
        long,
        global = true,
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        value_name = "URL"
    )]
    otlp_endpoint: Option<String>,
    #[command(subcommand)]
    command: Command,
}

/// A role `serve` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
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

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the checkout saga (payment → inventory → email) under injected faults and
    /// report, from the tables, whether anything was charged, decremented or sent twice
    /// (exit status 3 if so).
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Demo {
        /// sqlite:path/to/file.db or postgres://user@host:port/db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// Orders to place (with --resume: the resumed run's number is kept).
        #[arg(long, default_value_t = 1000, value_parser = args::count)]
        orders: usize,
        /// Sagas in flight at once (1 to 10000).
        #[arg(long, default_value_t = 32, value_parser = args::parallel)]
        concurrency: usize,
        /// Share of step commands delivered twice, concurrently (0..=1).
        #[arg(long, default_value_t = 0.5, value_parser = args::rate)]
        duplicate_rate: f64,
        /// Share of replies lost after the step committed (0..1).
        #[arg(long, default_value_t = 0.1, value_parser = args::rate_below_one)]
        lost_reply_rate: f64,
        /// Share of handler runs failing after their write, before commit (0..1).
        #[arg(long, default_value_t = 0.1, value_parser = args::rate_below_one)]
        fail_rate: f64,
        /// Share of orders whose card is declined (0..=1).
        #[arg(long, default_value_t = 0.05, value_parser = args::rate)]
        decline_rate: f64,
        /// Seed of the orders and of the fault draws. The order in which concurrent
        /// deliveries and retries meet is the scheduler's, so counts vary between runs.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Defeat the inbox (every delivery under a new message id): the control that
        /// shows the damage.
        #[arg(long)]
        no_inbox: bool,
        /// Resume a killed run: finish its unfinished sagas, then place the orders it had
        /// not placed yet (its --orders, not this one's).
        #[arg(long, conflicts_with = "clock_speed")]
        resume: bool,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Send commands and replies through a broker instead of in process: RabbitMQ
        /// (amqp://guest:guest@127.0.0.1:5672/%2f, amqps://… for TLS) or NATS JetStream
        /// (nats://127.0.0.1:4222, tls://… for TLS).
        #[arg(long, value_name = "URL")]
        transport: Option<String>,
        /// Queue names are <prefix>.<consumer_type> (with --transport).
        #[arg(long, default_value = "sagabox")]
        queue_prefix: String,
        /// The participants run as `sagabox serve` processes; this one only places
        /// orders and orchestrates (with --transport).
        #[arg(long, requires = "transport", conflicts_with = "clock_speed")]
        external_participants: bool,
        /// Deliveries of one message before it is dead-lettered (with --transport; the
        /// same number as the participants' `serve --max-deliveries`).
        #[arg(long, default_value_t = 5, requires = "transport",
              value_parser = clap::value_parser!(u32).range(1..=1000))]
        max_deliveries: u32,
        /// Serve Prometheus metrics at HOST:PORT while the demo runs (e.g. 127.0.0.1:9464).
        #[arg(long, value_name = "HOST:PORT")]
        metrics_addr: Option<String>,
        /// Soak test mode: run the clock this many times faster than real time (43200: a
        /// month a minute), so the pruner creates and drops inbox months during the run.
        /// Use a scratch database: months pruned stay pruned. Not with --resume.
        #[arg(long, default_value_t = 1.0, value_parser = args::clock_speed)]
        clock_speed: f64,
    },
    /// Run checkout participants over RabbitMQ or NATS JetStream until interrupted (Ctrl-C
    /// or SIGTERM): each role consumes <prefix>.<role> through its inbox and replies; the
    /// outbox relay and the pruner run beside them.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Serve {
        /// Roles to serve. Repeat or comma-separate.
        #[arg(long, value_delimiter = ',', required = true)]
        role: Vec<Role>,
        /// The broker (the same flag as demo's): amqp://user@host:port/vhost or amqps://…
        /// (RabbitMQ), nats://host:port or tls://… (NATS JetStream).
        #[arg(long, value_name = "URL")]
        transport: String,
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// Queue names are <prefix>.<consumer_type>.
        #[arg(long, default_value = "sagabox")]
        queue_prefix: String,
        /// Unacknowledged messages per consumer (AMQP prefetch), 1 to 65535.
        #[arg(long, default_value_t = 32, value_parser = args::prefetch)]
        prefetch: u16,
        /// Workers per step pool (1 to 10000).
        #[arg(long, default_value_t = 4, value_parser = args::parallel)]
        workers: usize,
        /// Commands claimed per batch, in one transaction (1: one at a time; at most
        /// the prefetch).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
        batch: u16,
        /// Share of handler runs failing after their write, before commit (0..1).
        #[arg(long, default_value_t = 0.0, value_parser = args::rate_below_one)]
        fail_rate: f64,
        /// Seed of the injected failures.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Serve Prometheus metrics at HOST:PORT while serving (e.g. 127.0.0.1:9464), with
        /// /healthz and /readyz beside them.
        #[arg(long, value_name = "HOST:PORT")]
        metrics_addr: Option<String>,
        /// Database connections this process holds at most (default: one per step worker,
        /// plus 4 for the relay, the pruner and setup, plus 16 with the orchestrator role;
        /// at most 64). Every process counts against the server's max_connections.
        #[arg(long, value_parser = args::pool_size)]
        db_pool_size: Option<u32>,
        // The pruner runs a pass at start, then hourly (one instance at a time).
        #[command(flatten)]
        retention: args::RetentionArgs,
        // Queue type, TTL and where the queues' retention is read.
        #[command(flatten)]
        broker: args::BrokerArgs,
    },
    /// Drive the sagas defined in TOML files, over RabbitMQ or NATS JetStream, with their steps served by
    /// other processes. A saga starts from a start message on <prefix>.<saga>.start: an
    /// envelope whose kind is the saga's name and whose payload is its data; the same
    /// message delivered twice starts one saga. Stops on SIGINT or SIGTERM.
    Orchestrate {
        /// A saga definition (TOML). Repeat for several sagas.
        #[arg(long = "saga", value_name = "FILE", required = true)]
        sagas: Vec<std::path::PathBuf>,
        /// The broker: amqp://user@host:port/vhost or amqps://… (RabbitMQ), nats://host:port
        /// or tls://… (NATS JetStream).
        #[arg(long, value_name = "URL")]
        transport: String,
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// Queue names are <prefix>.<consumer_type>; start messages go to
        /// <prefix>.<saga>.start.
        #[arg(long, default_value = "sagabox")]
        queue_prefix: String,
        /// How often unfinished sagas are looked for and resumed, in milliseconds.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
        resume_interval_ms: u64,
        /// Days the history of a finished saga is kept (in whole months); one process at a
        /// time prunes it every hour. 0 keeps it forever.
        #[arg(long, default_value_t = 90)]
        history_retention_days: u64,
        /// Serve Prometheus metrics at HOST:PORT while running (e.g. 127.0.0.1:9464), with
        /// /healthz and /readyz beside them.
        #[arg(long, value_name = "HOST:PORT")]
        metrics_addr: Option<String>,
        /// Database connections this process holds at most: the sagas' drivers, the start
        /// consumers and setup share them.
        #[arg(long, default_value_t = 16, value_parser = args::pool_size)]
        db_pool_size: u32,
        // The orchestrators' inbox (start messages and replies): its TTL, checked
        // against what the broker keeps; its pruner runs a pass at start, then hourly
        // (one instance at a time).
        #[command(flatten)]
        retention: args::RetentionArgs,
        // Queue type, TTL and where the queues' retention is read.
        #[command(flatten)]
        broker: args::BrokerArgs,
    },
    /// Show the inbox's partitions and reach, duplicate deliveries, sagas by status and
    /// the outbox's backlog, counted from the tables, with warnings for what needs a person.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Inspect {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// Days a message stays deduplicated (as the inbox is configured).
        #[arg(long, default_value_t = 30)]
        ttl_days: u64,
        /// The broker's maximum redelivery window, in days (SQS: 14).
        #[arg(long, default_value_t = 14)]
        broker_retention_days: u64,
        /// Months ahead of the current one that should have partitions.
        #[arg(long, default_value_t = 2)]
        partitions_ahead: u32,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Also report the retention of the broker's queues (<prefix>.*), measured
        /// through its management API: amqp://user:password@host:port/vhost.
        #[arg(long, value_name = "URL")]
        amqp_url: Option<String>,
        /// Also report the retention (max_age) of the NATS JetStream work streams of the
        /// prefix, measured on the server: nats://host:port.
        #[arg(long, value_name = "URL")]
        nats_url: Option<String>,
        /// The queues reported with --amqp-url are <prefix>.<consumer_type> (the streams
        /// with --nats-url, <prefix>_<consumer_type>).
        #[arg(long, default_value = "sagabox")]
        queue_prefix: String,
        /// The RabbitMQ management API (default: http://<broker host>:15672, or
        /// https://<broker host>:15671 for an amqps:// URL).
        #[arg(long, value_name = "URL")]
        amqp_management_url: Option<String>,
    },
    /// List sagas, show one's timeline, retry or cancel a stuck one (safe while
    /// orchestrators run).
    #[command(after_help = EXIT_STATUS)]
    Saga {
        #[command(subcommand)]
        command: saga::SagaCommand,
    },
    /// Run the migrations and create the current and upcoming inbox partitions.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Migrate {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// Months ahead of the current one to create partitions for.
        #[arg(long, default_value_t = 2)]
        partitions_ahead: u32,
    },
    /// Run one pruner pass: create the partitions ahead, drop the expired ones.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Prune {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// Only report what the pass would do.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        retention: args::RetentionArgs,
        /// Days the history of a finished saga is kept (counted in whole months: a month
        /// of history goes once all of it is older than this). 0 keeps it forever.
        #[arg(long, default_value_t = 90)]
        history_retention_days: u64,
    },
    /// Measure the inbox against hand-written SQL doing the same work, in one run.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Bench {
        /// postgres://user@host:port/db or sqlite:path/to/file.db (a scratch schema in that
        /// database, or a scratch file beside that one, is used and removed)
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// Messages per mode (a further 10 % warm up first, unmeasured).
        #[arg(long, default_value_t = 20_000, value_parser = args::at_least_one)]
        messages: usize,
        /// Concurrent tasks (and pool connections), 1 to 10000.
        #[arg(long, default_value_t = 8, value_parser = args::parallel)]
        concurrency: usize,
        /// Share of messages that repeat an earlier id, 0..=1.
        #[arg(long, default_value_t = 0.0, value_parser = args::rate)]
        duplicate_rate: f64,
        /// Measure the claim alone: no business statements.
        #[arg(long)]
        claim_only: bool,
        /// Handlers return a small result that the inbox records (the raw baseline then
        /// stores it too, with an UPDATE of its inbox row); by default they return none.
        #[arg(long)]
        with_result: bool,
        /// Measure in this many rounds, every mode taking its turn in each, so that a
        /// checkpoint or autovacuum slows all modes alike.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=1000))]
        rounds: u16,
        /// Seed of the workload's random choices.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Only these modes (comma-separated); all by default.
        #[arg(long, value_delimiter = ',')]
        modes: Vec<bench::Mode>,
        /// Messages with UUIDv4 ids and no publish time: the guard's slow path.
        #[arg(long)]
        timeless: bool,
        /// Messages per transaction in the `batched` mode (1..=10000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=10_000))]
        batch: u16,
        /// PostgreSQL: afterwards, fill the inbox with this many rows over 12 months and
        /// run the guard mode again (claim cost as the table grows).
        #[arg(long, default_value_t = 0)]
        prefill: u64,
        /// PostgreSQL: afterwards, retire months of this many rows by DELETE and by
        /// dropping the partition, idle and under a claim load.
        #[arg(long, default_value_t = 0)]
        prune_rows: u64,
    },
    /// Measure the broker path: messages through RabbitMQ or NATS JetStream into
    /// PostgreSQL, consumed by a hand-written consumer (INSERT … ON CONFLICT DO NOTHING,
    /// the business statements, commit, ack), by sagabox's consumer with the inbox guard,
    /// and by sagabox's Participant runtime, on one broker and one database in one run.
    /// Scratch queues or streams and a scratch schema, removed afterwards.
    #[command(name = "bench-broker")]
    BenchBroker(bench::broker::BrokerBenchArgs),
    /// Read and replay a RabbitMQ dead-letter queue (<queue>.dead): `list` shows the dead
    /// letters without taking them, `replay` sends them back to their queue.
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
    /// Serve a web page for operators until interrupted: sagas by state and definition,
    /// each saga's timeline and data, the inbox against its TTL, the dead letters; with
    /// --allow-actions, retry, cancel and replay (the same code as `saga` and `dlq`).
    #[command(after_help = EXIT_STATUS)]
    Console(console::ConsoleArgs),
}

/// Prints `result`: a table, or one JSON object with `json`; a failure through
/// [`failed`].
fn report<T, E>(command: &str, result: Result<T, E>, json: bool) -> Result<(), ExitCode>
where
    T: serde::Serialize + Display,
    E: Display,
{
    let value = result.map_err(|error| failed(command, error, json))?;
    if json {
        let text = serde_json::to_string(&value).map_err(|error| failed(command, error, json))?;
        emit(command, format_args!("{text}\n"))
    } else {
        emit(command, value)
    }
}

/// Writes a line to stderr. Unlike `eprintln!`, which panics when stderr cannot be
/// written (closed, full, a log shipper gone), a line that cannot be written is dropped:
/// the exit status still tells the outcome.
fn say(line: impl Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Writes `text` to stdout. A reader that went away (`sagabox demo | head -1`) ends the
/// command with a failure instead of a panic.
fn emit(command: &str, text: impl Display) -> Result<(), ExitCode> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{text}")
        .and_then(|()| stdout.flush())
        .map_err(|error| {
            say(format_args!(
                "sagabox {command}: cannot write the report to stdout: {error}"
            ));
            ExitCode::FAILURE
        })
}

/// Reports a failed run: `sagabox <command>: <error>` on stderr and, with `json`, one
/// object `{"error": "<error>"}` on stdout, so a script reading stdout sees it too.
fn failed(command: &str, error: impl Display, json: bool) -> ExitCode {
    let message = error.to_string();
    if json {
        // Best effort: the error goes to stderr below whether or not stdout takes it.
        let _ = emit(
            command,
            format_args!("{}\n", serde_json::json!({ "error": message })),
        );
    }
    say(format_args!("sagabox {command}: {message}"));
    ExitCode::FAILURE
}

/// Ends the process as clap does for a usage error (exit status 2): for the values
/// checked after parsing, whose own messages say what is wrong (and quote URLs redacted,
/// which clap's would not).
/// The command line, with the options of [`environment`] read from the environment.
fn parse() -> Cli {
    use clap::FromArgMatches;
    let command = environment::apply(Cli::command(), &|name| std::env::var_os(name))
        .unwrap_or_else(|error| {
            Cli::command()
                .error(ErrorKind::ValueValidation, error)
                .exit()
        });
    let mut matches = command.get_matches();
    Cli::from_arg_matches_mut(&mut matches).unwrap_or_else(|error| error.exit())
}

fn usage_error(subcommand: &str, message: impl Display) -> ! {
    let mut cli = Cli::command();
    cli.build();
    let mut command = cli
        .find_subcommand(subcommand)
        .cloned()
        .unwrap_or_else(Cli::command);
    command.error(ErrorKind::ValueValidation, message).exit()
}

/// Resolves on Ctrl-C or SIGTERM. The handlers are installed when this is called, not
/// when it is first awaited: `serve` says it is up before it awaits, and a SIGTERM sent
/// right after that line must stop it gracefully rather than kill it.
fn interrupted() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let handlers = [SignalKind::interrupt(), SignalKind::terminate()].map(signal);
    async move {
        let [interrupt, terminate] = handlers.map(|handler| async move {
            match handler {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                // Without a handler the signal keeps its default action.
                Err(_) => std::future::pending::<()>().await,
            }
        });
        tokio::select! {
            _ = interrupt => {}
            _ = terminate => {}
        }
    }
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

/// The inbox configuration the `prune` and `inspect` flags describe.
fn inbox_config(ttl_days: u64, broker_retention_days: u64, partitions_ahead: u32) -> InboxConfig {
    const DAY: u64 = 86_400;
    InboxConfig::default()
        .with_ttl(Duration::from_secs(ttl_days.saturating_mul(DAY)))
        .with_broker_retention(Duration::from_secs(
            broker_retention_days.saturating_mul(DAY),
        ))
        .with_partitions_ahead(partitions_ahead)
}

/// `months` as a list for people: `2026-01, 2026-02`, or `none`.
fn list(months: &[sagabox::Month]) -> String {
    if months.is_empty() {
        "none".to_owned()
    } else {
        months
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = parse();
    // Checked here rather than by clap, whose message would quote the URL unredacted.
    let database = match &cli.command {
        Command::Demo { database_url, .. } => Some(("demo", database_url)),
        Command::Serve { database_url, .. } => Some(("serve", database_url)),
        Command::Orchestrate { database_url, .. } => Some(("orchestrate", database_url)),
        Command::Migrate { database_url, .. } => Some(("migrate", database_url)),
        Command::Prune { database_url, .. } => Some(("prune", database_url)),
        Command::Inspect { database_url, .. } => Some(("inspect", database_url)),
        Command::Bench { database_url, .. } => Some(("bench", database_url)),
        Command::BenchBroker(args) => Some(("bench-broker", &args.database_url)),
        Command::Saga { command } => Some(("saga", command.database_url())),
        Command::Console(args) => Some(("console", &args.database_url)),
        // The broker only.
        Command::Dlq(_) => None,
    };
    if let Some((name, url)) = database
        && let Err(error) = args::database_url(url)
    {
        usage_error(name, format_args!("--database-url: {error}"));
    }
    let name = database.map_or("dlq", |(name, _)| name);
    // Held to the end of `main`: dropping it sends the last spans.
    let _tracing = match init_tracing(
        cli.log_format,
        cli.otlp_endpoint.as_deref(),
        &format!("sagabox-{name}"),
    ) {
        Ok(guard) => guard,
        Err(error) => {
            say(format_args!("sagabox: {error}"));
            return ExitCode::FAILURE;
        }
    };
    match run(cli.command).await {
        Ok(code) => code,
        Err(code) => {
            // A run that failed may have stopped actors just now (a participant whose
            // start failed stops what it started). ractor drains their supervision
            // notices in tasks of its own and panics on one the runtime's shutdown
            // cancels ("task N was cancelled"), which would print a backtrace after the
            // one line that says what failed. Let those tasks finish first.
            tokio::time::sleep(SETTLE).await;
            code
        }
    }
}

/// How long a failed run waits for the actors' last supervision notices before the
/// runtime shuts down.
const SETTLE: Duration = Duration::from_millis(200);

/// Runs one subcommand; `Err` carries the exit status of a failure already reported.
async fn run(command: Command) -> Result<ExitCode, ExitCode> {
    match command {
        Command::Dlq(command) => dlq::run(command).await,
        Command::Console(args) => console::run(args, interrupted()).await,
        Command::Demo {
            database_url,
            db_schema,
            orders,
            concurrency,
            duplicate_rate,
            lost_reply_rate,
            fail_rate,
            decline_rate,
            seed,
            no_inbox,
            resume,
            json,
            transport,
            queue_prefix,
            external_participants,
            max_deliveries,
            metrics_addr,
            clock_speed,
        } => {
            let config = sagabox_checkout::DemoConfig {
                orders,
                concurrency,
                duplicate_rate,
                lost_reply_rate,
                fail_rate,
                decline_rate,
                seed,
                no_inbox,
                resume,
                progress: true,
                transport: transport.map(|url| sagabox_checkout::DemoTransport {
                    url,
                    queue_prefix,
                    external_participants,
                    max_deliveries,
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
        Command::Serve {
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
        } => {
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
        Command::Orchestrate {
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
        } => {
            let inbox = retention
                .config()
                .unwrap_or_else(|error| usage_error("orchestrate", error));
            let mut definitions = Vec::with_capacity(sagas.len());
            for path in &sagas {
                let definition =
                    sagabox::saga::SagaDefinition::load(path).unwrap_or_else(|error| {
                        usage_error(
                            "orchestrate",
                            format_args!("--saga {}: {error}", path.display()),
                        )
                    });
                definitions.push(definition);
            }
            let transport = sagabox::transport::Transport::from_url(&transport, &queue_prefix)
                .unwrap_or_else(|error| {
                    usage_error("orchestrate", format_args!("--transport: {error}"))
                });
            // Over RabbitMQ the start queues' measured retention is checked against the
            // orchestrators' inbox; over JetStream the streams' max_age is.
            let transport = broker.apply(transport).with_retention_of(&inbox);
            if let Err(error) = transport.validate() {
                usage_error("orchestrate", format_args!("--transport: {error}"));
            }
            if let Some(addr) = metrics_addr {
                start_metrics(&addr).map_err(|error| failed("orchestrate", error, false))?;
            }
            let config = sagabox::amqp::OrchestrateConfig {
                definitions,
                transport,
                resume_interval: Duration::from_millis(resume_interval_ms),
                history_retention: (history_retention_days > 0)
                    .then(|| Duration::from_secs(history_retention_days.saturating_mul(86_400))),
                inbox,
                pruner: Some(sagabox::pruner::PrunerSettings::default()),
            };
            orchestrate::run(
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
        Command::Prune {
            database_url,
            db_schema,
            dry_run,
            retention,
            history_retention_days,
        } => {
            let config = retention
                .config()
                .unwrap_or_else(|error| usage_error("prune", error));
            let pass = prune(&database_url, &db_schema, config.clone(), dry_run)
                .await
                .map_err(|error| failed("prune", error, false))?;
            let verb = if dry_run { "would be " } else { "" };
            let database = redact(&database_url);
            if pass.skipped {
                return emit(
                    "prune",
                    format_args!(
                        "{database}: another instance is running a pruner pass; nothing done (try again later)\n"
                    ),
                )
                .map(|()| ExitCode::SUCCESS);
            }
            emit(
                "prune",
                format_args!(
                    "{database}: partitions {verb}created: {}\n{database}: partitions {verb}dropped: {}\n",
                    list(&pass.created),
                    list(&pass.dropped)
                ),
            )?;
            if history_retention_days > 0 {
                let retention = Duration::from_secs(history_retention_days.saturating_mul(86_400));
                let history = prune_history(&database_url, &db_schema, config, retention, dry_run)
                    .await
                    .map_err(|error| failed("prune", error, false))?;
                emit(
                    "prune",
                    format_args!(
                        "{database}: saga history months {verb}dropped: {}; rows {verb}deleted: {}\n",
                        list(&history.months_dropped),
                        history.rows_deleted
                    ),
                )?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect {
            database_url,
            db_schema,
            ttl_days,
            broker_retention_days,
            partitions_ahead,
            json,
            amqp_url,
            nats_url,
            queue_prefix,
            amqp_management_url,
        } => {
            let config = inbox_config(ttl_days, broker_retention_days, partitions_ahead);
            if let Err(error) = config.validate() {
                usage_error("inspect", error);
            }
            let options = InspectOptions {
                config: config.clone(),
                schema: db_schema,
                ..InspectOptions::default()
            };
            let mut inspected = inspect(&database_url, &options)
                .await
                .map_err(|error| failed("inspect", error, json))?;
            if let Some(url) = amqp_url {
                let mut amqp =
                    sagabox::amqp::AmqpConfig::new(url).with_queue_prefix(queue_prefix.clone());
                amqp.management_url = amqp_management_url;
                if let Err(error) = amqp.validate() {
                    usage_error("inspect", format_args!("--amqp-url: {error}"));
                }
                inspected = inspected
                    .with_broker(&amqp, &config)
                    .await
                    .map_err(|error| failed("inspect", error, json))?;
            }
            if let Some(url) = nats_url {
                let nats = sagabox::nats::NatsConfig::new(url).with_prefix(queue_prefix);
                if let Err(error) = nats.validate() {
                    usage_error("inspect", format_args!("--nats-url: {error}"));
                }
                inspected = inspected
                    .with_streams(&nats, &config)
                    .await
                    .map_err(|error| failed("inspect", error, json))?;
            }
            report(
                "inspect",
                Ok::<_, std::convert::Infallible>(inspected),
                json,
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchBroker(args) => {
            // Checked here rather than by clap, whose message would quote the URL unredacted.
            if !matches!(
                sagabox::database::Backend::of(&args.database_url),
                Ok(sagabox::database::Backend::Postgres)
            ) {
                usage_error(
                    "bench-broker",
                    format_args!(
                        "--database-url {}: the broker bench runs on PostgreSQL (postgres://…)",
                        redact(&args.database_url)
                    ),
                );
            }
            let json = args.json;
            report("bench-broker", bench::broker::run(args).await, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            database_url,
            messages,
            concurrency,
            duplicate_rate,
            claim_only,
            with_result,
            rounds,
            seed,
            json,
            modes,
            timeless,
            batch,
            prefill,
            prune_rows,
        } => {
            let args = bench::BenchArgs {
                database_url,
                messages,
                concurrency,
                duplicate_rate,
                claim_only,
                with_result,
                rounds: usize::from(rounds),
                seed,
                modes,
                timeless,
                batch: usize::from(batch),
                prefill,
                prune_rows,
            };
            report("bench", bench::run(args).await, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Saga { command } => {
            let json = command.json();
            report("saga", saga::run(command).await, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate {
            database_url,
            db_schema,
            partitions_ahead,
        } => {
            let config = InboxConfig::default().with_partitions_ahead(partitions_ahead);
            if let Err(error) = config.validate() {
                usage_error("migrate", error);
            }
            let created = migrate(&database_url, &db_schema, config)
                .await
                .map_err(|error| failed("migrate", error, false))?;
            let created: Vec<String> = created.iter().map(ToString::to_string).collect();
            emit(
                "migrate",
                format_args!(
                    "migrated {}; partitions created: {}\n",
                    redact(&database_url),
                    if created.is_empty() {
                        "none (all present)".to_owned()
                    } else {
                        created.join(", ")
                    }
                ),
            )?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_option_of_the_service_and_operator_commands_reads_a_variable() {
        let mut command = environment::apply(Cli::command(), &|_| None).expect("no files");
        command.build();
        for name in environment::FROM_ENVIRONMENT {
            let sub = command.find_subcommand(name).expect("subcommand");
            let mut options = 0;
            for arg in sub.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if matches!(long, "help" | "version") {
                    continue;
                }
                options += 1;
                assert!(
                    arg.get_env().is_some(),
                    "sagabox {name} --{long} reads no variable"
                );
            }
            assert!(options > 0, "{name}");
        }
        let help = command
            .find_subcommand_mut("serve")
            .expect("serve")
            .render_long_help()
            .to_string();
        assert!(help.contains("SAGABOX_QUEUE_PREFIX"), "{help}");
        assert!(help.contains("SAGABOX_TRANSPORT"), "{help}");
    }
}
