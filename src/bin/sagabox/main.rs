//! The `sagabox` command line: `demo`, `migrate`, `prune`, `bench`.

mod bench;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use sagabox::InboxConfig;
use sagabox::database::{migrate, prune, redact};

/// Saga participants that process every message effectively exactly once.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
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
        /// Orders to place.
        #[arg(long, default_value_t = 1000)]
        orders: usize,
        /// Sagas in flight at once.
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// Share of step commands delivered twice, concurrently (0..=1).
        #[arg(long, default_value_t = 0.5)]
        duplicate_rate: f64,
        /// Share of replies lost after the step committed (0..1).
        #[arg(long, default_value_t = 0.1)]
        lost_reply_rate: f64,
        /// Share of handler runs failing after their write, before commit (0..1).
        #[arg(long, default_value_t = 0.1)]
        fail_rate: f64,
        /// Share of orders whose card is declined (0..=1).
        #[arg(long, default_value_t = 0.05)]
        decline_rate: f64,
        /// Seed of every random choice.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Bypass the inbox: the control that shows the damage.
        #[arg(long)]
        no_inbox: bool,
        /// Place no orders; finish every unfinished saga.
        #[arg(long)]
        resume: bool,
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
        #[arg(long, default_value_t = 0.0)]
        duplicate_rate: f64,
        /// Measure the claim alone: no business statements.
        #[arg(long)]
        claim_only: bool,
        /// Seed of the workload's random choices.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Only these modes (comma-separated: raw_sql, guard, actor, batched, no_inbox); all by default.
        #[arg(long, value_delimiter = ',')]
        modes: Vec<String>,
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

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
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
        } => {
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
            };
            report(
                "demo",
                sagabox::demo::run(&database_url, &config).await,
                json,
            )
        }
        Command::Prune {
            database_url,
            dry_run,
            ttl_days,
            broker_retention_days,
            partitions_ahead,
        } => {
            const DAY: u64 = 86_400;
            let config = InboxConfig::default()
                .with_ttl(Duration::from_secs(ttl_days.saturating_mul(DAY)))
                .with_broker_retention(Duration::from_secs(
                    broker_retention_days.saturating_mul(DAY),
                ))
                .with_partitions_ahead(partitions_ahead);
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
        Command::Bench {
            database_url,
            messages,
            concurrency,
            duplicate_rate,
            claim_only,
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
