//! The `sagabox` command line: `demo`, `serve`, `migrate`, `prune`, `inspect`, `bench`.

mod bench;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use sagabox::InboxConfig;
use sagabox::args;
use sagabox::database::{migrate, prune, redact};
use sagabox::inspect::{InspectOptions, inspect};
use sagabox::telemetry::{LogFormat, init_tracing};

/// Starts the Prometheus endpoint, or says why the build has none.
fn start_metrics(addr: &str) -> Result<(), String> {
    #[cfg(feature = "prometheus")]
    {
        let listening = sagabox::metrics::install_prometheus(addr).map_err(|e| e.to_string())?;
        eprintln!("metrics at http://{listening}/metrics");
        Ok(())
    }
    #[cfg(not(feature = "prometheus"))]
    {
        Err(format!(
            "--metrics-addr {addr}: this build has no Prometheus endpoint; rebuild with the `prometheus` feature"
        ))
    }
}

/// Saga participants that process every message effectively exactly once.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Log lines on stderr: human or json (one object per line). RUST_LOG filters them
    /// (default: warn; RUST_LOG=sagabox=debug shows a line per message and step attempt).
    #[arg(long, global = true, default_value_t = LogFormat::Human, env = "SAGABOX_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the checkout saga (payment → inventory → email) under injected faults and
    /// report, from the tables, whether anything was charged, decremented or sent twice.
    Demo {
        /// sqlite:file.db (default: sagabox-demo.db here) or postgres://user@host:port/db
        #[arg(long, env = "DATABASE_URL", default_value = "sqlite:sagabox-demo.db")]
        database_url: String,
        /// Orders to place (with --resume: the resumed run's number is kept).
        #[arg(long, default_value_t = 1000)]
        orders: usize,
        /// Sagas in flight at once.
        #[arg(long, default_value_t = 32)]
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
        /// Seed of every random choice.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Bypass the inbox: the control that shows the damage.
        #[arg(long)]
        no_inbox: bool,
        /// Resume a killed run: finish its unfinished sagas, then place the orders it had
        /// not placed yet (its --orders, not this one's).
        #[arg(long)]
        resume: bool,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Send commands and replies through RabbitMQ at this URL
        /// (amqp://guest:guest@127.0.0.1:5672/%2f) instead of in process.
        #[arg(long, env = "AMQP_URL")]
        transport: Option<String>,
        /// Queue names are <prefix>.<consumer_type> (with --transport).
        #[arg(long, default_value = "sagabox")]
        queue_prefix: String,
        /// The participants run as `sagabox serve` processes; this one only places
        /// orders and orchestrates (with --transport).
        #[arg(long, requires = "transport")]
        external_participants: bool,
        /// Serve Prometheus metrics at HOST:PORT while the demo runs (e.g. 127.0.0.1:9464).
        #[arg(long, value_name = "HOST:PORT")]
        metrics_addr: Option<String>,
        /// Soak test mode: run the clock this many times faster than real time (43200: a
        /// month a minute), so the pruner creates and drops inbox months during the run.
        /// Use a scratch database: months pruned stay pruned. Not with --resume.
        #[arg(long, default_value_t = 1.0, value_parser = args::clock_speed)]
        clock_speed: f64,
    },
    /// Run checkout participants over RabbitMQ until interrupted (Ctrl-C or SIGTERM):
    /// each role consumes sagabox.<role> through its inbox and replies.
    Serve {
        /// Roles to serve: payment, inventory, email, orchestrator (resumes unfinished
        /// sagas), or all. Repeat or comma-separate.
        #[arg(long, value_delimiter = ',', required = true)]
        role: Vec<String>,
        /// amqp://user:password@host:port/vhost
        #[arg(
            long,
            env = "AMQP_URL",
            default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
        )]
        amqp_url: String,
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "DATABASE_URL", default_value = "sqlite:sagabox-demo.db")]
        database_url: String,
        /// Queue names are <prefix>.<consumer_type>.
        #[arg(long, default_value = "sagabox")]
        queue_prefix: String,
        /// Unacknowledged messages per consumer (AMQP prefetch).
        #[arg(long, default_value_t = 32)]
        prefetch: u16,
        /// Workers per step pool.
        #[arg(long, default_value_t = 4)]
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
        /// Serve Prometheus metrics at HOST:PORT while the demo runs (e.g. 127.0.0.1:9464).
        #[arg(long, value_name = "HOST:PORT")]
        metrics_addr: Option<String>,
    },
    /// Show the inbox's partitions and reach, duplicate deliveries, sagas by status and
    /// the outbox's backlog, counted from the tables, with warnings for what needs a person.
    Inspect {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "DATABASE_URL", default_value = "sqlite:sagabox.db")]
        database_url: String,
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
    },
    /// Run the migrations and create the current and upcoming inbox partitions.
    Migrate {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "DATABASE_URL", default_value = "sqlite:sagabox.db")]
        database_url: String,
        /// Months ahead of the current one to create partitions for.
        #[arg(long, default_value_t = 2)]
        partitions_ahead: u32,
    },
    /// Run one pruner pass: create the partitions ahead, drop the expired ones.
    Prune {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "DATABASE_URL", default_value = "sqlite:sagabox.db")]
        database_url: String,
        /// Only report what the pass would do.
        #[arg(long)]
        dry_run: bool,
        /// Days a message stays deduplicated; at least the broker's redelivery window.
        #[arg(long, default_value_t = 30)]
        ttl_days: u64,
        /// The broker's maximum redelivery window, in days (SQS: 14).
        #[arg(long, default_value_t = 14)]
        broker_retention_days: u64,
        /// Months ahead of the current one to create partitions for.
        #[arg(long, default_value_t = 2)]
        partitions_ahead: u32,
        /// Prune with a TTL shorter than the broker retention anyway (logged as a
        /// warning): a redelivery later than the TTL is then refused, or applied twice if
        /// it carries no time.
        #[arg(long)]
        force_short_ttl: bool,
    },
    /// Measure the inbox against hand-written SQL doing the same work, in one run.
    Bench {
        /// postgres://user@host:port/db or sqlite:… (a scratch schema or file is used and removed)
        #[arg(
            long,
            env = "DATABASE_URL",
            default_value = "postgres://postgres@127.0.0.1:5432/postgres"
        )]
        database_url: String,
        /// Messages per mode (a further 10 % warm up first, unmeasured).
        #[arg(long, default_value_t = 20_000)]
        messages: usize,
        /// Concurrent tasks (and pool connections).
        #[arg(long, default_value_t = 8)]
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
        #[arg(long, default_value_t = 100)]
        batch: usize,
        /// PostgreSQL: afterwards, fill the inbox with this many rows over 12 months and
        /// run the guard mode again (claim cost as the table grows).
        #[arg(long, default_value_t = 0)]
        prefill: u64,
        /// PostgreSQL: afterwards, retire months of this many rows by DELETE and by
        /// dropping the partition, idle and under a claim load.
        #[arg(long, default_value_t = 0)]
        prune_rows: u64,
    },
}

/// Prints `result`: a table, or one JSON object with `json`; an error on stderr.
fn report<T, E>(command: &str, result: Result<T, E>, json: bool) -> ExitCode
where
    T: serde::Serialize + std::fmt::Display,
    E: std::fmt::Display,
{
    let printed = result.map_err(|e| e.to_string()).and_then(|value| {
        if json {
            let text = serde_json::to_string(&value).map_err(|e| e.to_string())?;
            println!("{text}");
        } else {
            print!("{value}");
        }
        Ok(())
    });
    match printed {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("sagabox {command}: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM.
async fn interrupted() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    roles: Vec<String>,
    amqp_url: String,
    database_url: &str,
    queue_prefix: String,
    prefetch: u16,
    workers: usize,
    batch: u16,
    fail_rate: f64,
    seed: u64,
) -> Result<(), String> {
    const STEPS: [&str; 3] = ["payment", "inventory", "email"];
    let mut steps = Vec::new();
    let mut orchestrator = false;
    for role in roles {
        match role.as_str() {
            "all" => {
                steps.extend(STEPS.map(str::to_owned));
                orchestrator = true;
            }
            "orchestrator" => orchestrator = true,
            step if STEPS.contains(&step) => steps.push(role),
            other => {
                return Err(format!(
                    "unknown role {other:?}: use payment, inventory, email, orchestrator or all"
                ));
            }
        }
    }
    steps.sort();
    steps.dedup();
    let roles = steps
        .into_iter()
        .map(sagabox::ConsumerType::new)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    if batch > prefetch {
        return Err(format!(
            "--batch {batch} is above --prefetch {prefetch}: a consumer holds at most the prefetch at once"
        ));
    }
    let mut amqp = sagabox::amqp::AmqpConfig::new(amqp_url).with_queue_prefix(queue_prefix);
    amqp.prefetch = prefetch;
    let config = sagabox::demo::ServeConfig {
        roles,
        orchestrator,
        amqp,
        workers,
        fail_rate,
        seed,
        resume_interval: Duration::from_secs(1),
        batch: usize::from(batch),
    };
    sagabox::demo::serve(database_url, config, interrupted())
        .await
        .map_err(|e| e.to_string())
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

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(error) = init_tracing(cli.log_format) {
        eprintln!("sagabox: {error}");
        return ExitCode::FAILURE;
    }
    // Checked here rather than by clap, whose message would quote the URL unredacted.
    let url = match &cli.command {
        Command::Demo { database_url, .. }
        | Command::Serve { database_url, .. }
        | Command::Migrate { database_url, .. }
        | Command::Prune { database_url, .. }
        | Command::Inspect { database_url, .. }
        | Command::Bench { database_url, .. } => database_url,
    };
    if let Err(error) = args::database_url(url) {
        eprintln!("sagabox: --database-url: {error}");
        return ExitCode::FAILURE;
    }
    match cli.command {
        Command::Demo {
            database_url,
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
            metrics_addr,
            clock_speed,
        } => {
            if let Some(addr) = metrics_addr
                && let Err(error) = start_metrics(&addr)
            {
                eprintln!("sagabox demo: {error}");
                return ExitCode::FAILURE;
            }
            let config = sagabox::demo::DemoConfig {
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
                transport: transport.map(|url| sagabox::demo::DemoTransport {
                    url,
                    queue_prefix,
                    external_participants,
                }),
                clock_speed,
                clock_start: None,
            };
            report(
                "demo",
                sagabox::demo::run(&database_url, &config).await,
                json,
            )
        }
        Command::Serve {
            role,
            amqp_url,
            database_url,
            queue_prefix,
            prefetch,
            workers,
            batch,
            fail_rate,
            seed,
            metrics_addr,
        } => {
            if let Some(addr) = metrics_addr
                && let Err(error) = start_metrics(&addr)
            {
                eprintln!("sagabox serve: {error}");
                return ExitCode::FAILURE;
            }
            let served = serve(
                role,
                amqp_url,
                &database_url,
                queue_prefix,
                prefetch,
                workers,
                batch,
                fail_rate,
                seed,
            )
            .await;
            match served {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("sagabox serve: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Prune {
            database_url,
            dry_run,
            ttl_days,
            broker_retention_days,
            partitions_ahead,
            force_short_ttl,
        } => {
            let config = match args::retention_config(
                ttl_days,
                broker_retention_days,
                partitions_ahead,
                force_short_ttl,
            ) {
                Ok(config) => config,
                Err(error) => {
                    eprintln!("sagabox prune: {error}");
                    return ExitCode::FAILURE;
                }
            };
            match prune(&database_url, config, dry_run).await {
                Ok(pass) => {
                    let list = |months: &[sagabox::Month]| {
                        if months.is_empty() {
                            "none".to_owned()
                        } else {
                            months
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join(", ")
                        }
                    };
                    let verb = if dry_run { "would be " } else { "" };
                    println!(
                        "{}: partitions {verb}created: {}",
                        redact(&database_url),
                        list(&pass.created)
                    );
                    println!(
                        "{}: partitions {verb}dropped: {}",
                        redact(&database_url),
                        list(&pass.dropped)
                    );
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("sagabox prune: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Inspect {
            database_url,
            ttl_days,
            broker_retention_days,
            partitions_ahead,
            json,
        } => {
            let options = InspectOptions {
                config: inbox_config(ttl_days, broker_retention_days, partitions_ahead),
                ..InspectOptions::default()
            };
            report("inspect", inspect(&database_url, &options).await, json)
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
                batch,
                prefill,
                prune_rows,
            };
            report("bench", bench::run(args).await, json)
        }
        Command::Migrate {
            database_url,
            partitions_ahead,
        } => {
            let config = InboxConfig::default().with_partitions_ahead(partitions_ahead);
            match migrate(&database_url, config).await {
                Ok(created) => {
                    let created: Vec<String> = created.iter().map(ToString::to_string).collect();
                    println!(
                        "migrated {}; partitions created: {}",
                        redact(&database_url),
                        if created.is_empty() {
                            "none (all present)".to_owned()
                        } else {
                            created.join(", ")
                        }
                    );
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("sagabox migrate: {error}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
