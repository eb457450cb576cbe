//! `sagabox bench-saga`: whole checkout sagas on PostgreSQL against a hand-written saga
//! on the same tables, in one run.
//!
//! Modes, each run on a scratch database of its own (created, migrated, dropped):
//! - `floor`: the checkout saga by hand in plain SQL ([`sagabox_checkout::run_floor`]):
//!   per step one participant transaction and one orchestrator `UPDATE`, no actor, no
//!   broker;
//! - `in-process`: the demo's saga without faults, the orchestrator and the step pools in
//!   this process, each pool claiming in batches of up to `--claim-batch`;
//! - one mode per `--transport`: the same over RabbitMQ or NATS JetStream, the
//!   participants in this process behind the broker, each step's consumer claiming in
//!   batches of up to `--claim-batch` too.
//!
//! Each mode runs at full load (`--orders` at `--concurrency`) and paced (`--paced-orders`
//! at `--paced-rate` sagas/s, for a saga's time without queueing). Per run: sagas/s, the
//! p50/p99 from a saga's start to its end (its row's `updated_at - created_at`), the
//! commits per saga (the scratch database's `xact_commit` in `pg_stat_database`, read
//! once its connections are closed) and the WAL bytes per saga (`pg_current_wal_lsn()`:
//! the server's, so a quiet server reads true), and the CPU time per saga of this process,
//! of the server's `postgres` processes and of the broker (`beam.smp`, `nats-server`) when
//! they run on this machine. The counts include each run's set-up (a few dozen
//! commits).

use std::fmt;
use std::time::{Duration, Instant};

use sagabox::InboxConfig;
use sagabox::Schema;
use sagabox::logging::redact;
use sagabox::transport::Transport;
use sagabox_checkout::{DemoConfig, DemoTransport};
use serde::Serialize;
use sqlx::{PgPool, Row};

use super::BoxError;
use sagabox_cli::args;

/// The options of `sagabox bench-saga`.
#[derive(Debug, clap::Args)]
pub(crate) struct SagaBenchArgs {
    /// A PostgreSQL database whose role may create databases: every run gets a scratch
    /// database of its own beside it, dropped afterwards.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    pub(crate) database_url: String,
    /// Sagas of each full-load run.
    #[arg(long, default_value_t = 3000, value_parser = args::count)]
    orders: usize,
    /// Sagas in flight at once in the full-load runs (1 to 10000).
    #[arg(long, default_value_t = 64, value_parser = args::parallel)]
    concurrency: usize,
    /// Run the saga over this broker too, as a mode of its own: RabbitMQ (amqp://…) or
    /// NATS JetStream (nats://…). Repeat for both.
    #[arg(long = "transport", value_name = "URL")]
    transports: Vec<String>,
    /// Sagas started per second in the paced runs (0: no paced run).
    #[arg(long, default_value_t = 50.0, value_parser = paced_rate)]
    paced_rate: f64,
    /// Sagas of each paced run.
    #[arg(long, default_value_t = 500, value_parser = args::count)]
    paced_orders: usize,
    /// The most step commands one transaction claims, in process and behind each
    /// broker: the commands that arrive while a step's batch runs go together in its
    /// next (1 to 10000; 1 claims each alone).
    #[arg(long, default_value_t = 16, value_parser = args::parallel)]
    claim_batch: usize,
    /// Runs of every mode and load, interleaved (1 to 20).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    runs: u32,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `--paced-rate`: a finite rate of 0 (off) or more.
fn paced_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if rate.is_finite() && (0.0..=100_000.0).contains(&rate) => Ok(rate),
        _ => Err(format!(
            "{text:?} is not a rate: give sagas per second from 0 (no paced run) to 100000"
        )),
    }
}

/// How a mode runs the saga.
#[derive(Debug, Clone)]
enum Mode {
    Floor,
    InProcess,
    /// Over the broker at the URL, named after its transport.
    Broker {
        name: &'static str,
        url: String,
    },
}

impl Mode {
    fn name(&self) -> &'static str {
        match self {
            Self::Floor => "floor",
            Self::InProcess => "in-process",
            Self::Broker { name, .. } => name,
        }
    }
}

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SagaRun {
    mode: String,
    /// `full`, or `paced N/s`.
    load: String,
    run: u32,
    sagas: usize,
    compensated: usize,
    sagas_per_sec: f64,
    /// `sagas_per_sec` over the floor's in the same run and load.
    ratio_to_floor: Option<f64>,
    p50_ms: f64,
    p99_ms: f64,
    commits_per_saga: f64,
    wal_bytes_per_saga: f64,
    /// CPU milliseconds per saga: this process, the `postgres` processes, the broker's.
    cpu_ms_per_saga: Cpu,
}

/// CPU time, split by process.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct Cpu {
    sagabox: f64,
    postgres: f64,
    broker: f64,
}

/// What `sagabox bench-saga` measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SagaBenchReport {
    database: String,
    orders: usize,
    concurrency: usize,
    paced_rate: f64,
    paced_orders: usize,
    claim_batch: usize,
    runs: Vec<SagaRun>,
}

impl fmt::Display for SagaBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "checkout sagas on {}: {} at concurrency {} (full), {} at {}/s (paced); in process \
             claims in batches of up to {}",
            self.database,
            self.orders,
            self.concurrency,
            self.paced_orders,
            self.paced_rate,
            self.claim_batch
        )?;
        writeln!(
            f,
            "{:<11} {:<11} {:>3} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>22}",
            "mode",
            "load",
            "run",
            "sagas/s",
            "×floor",
            "p50 ms",
            "p99 ms",
            "commits",
            "WAL B",
            "CPU ms sagabox/pg/mq"
        )?;
        for run in &self.runs {
            let ratio = run
                .ratio_to_floor
                .map_or_else(|| "-".to_owned(), |ratio| format!("{ratio:.2}"));
            let cpu = run.cpu_ms_per_saga;
            writeln!(
                f,
                "{:<11} {:<11} {:>3} {:>9.0} {:>7} {:>8.1} {:>8.1} {:>8.2} {:>8.0} {:>22}",
                run.mode,
                run.load,
                run.run,
                run.sagas_per_sec,
                ratio,
                run.p50_ms,
                run.p99_ms,
                run.commits_per_saga,
                run.wal_bytes_per_saga,
                format!("{:.2}/{:.2}/{:.2}", cpu.sagabox, cpu.postgres, cpu.broker)
            )?;
        }
        Ok(())
    }
}

/// Runs `sagabox bench-saga`.
pub(crate) async fn run(args: SagaBenchArgs) -> Result<SagaBenchReport, BoxError> {
    let admin = sagabox::PostgresStore::connect(&args.database_url, 2)
        .await?
        .pool()
        .clone();
    let mut modes = vec![Mode::Floor, Mode::InProcess];
    for url in &args.transports {
        let transport = Transport::from_url(url, "sagabox")?;
        transport.validate()?;
        let name = match transport {
            Transport::Amqp(_) => "rabbitmq",
            Transport::Nats(_) => "nats",
            _ => transport.broker(),
        };
        modes.push(Mode::Broker {
            name,
            url: url.clone(),
        });
    }
    let mut loads = vec![(args.orders, args.concurrency, None)];
    if args.paced_rate > 0.0 {
        loads.push((args.paced_orders, args.concurrency, Some(args.paced_rate)));
    }
    let mut runs = Vec::new();
    let mut scratch = 0;
    for run in 1..=args.runs {
        for &(orders, concurrency, pace) in &loads {
            let mut floor_rate = None;
            for mode in &modes {
                scratch += 1;
                let name = format!("sagabox_bench_saga_{}_{scratch}", std::process::id());
                let config = DemoConfig {
                    orders,
                    concurrency,
                    pace,
                    duplicate_rate: 0.0,
                    lost_reply_rate: 0.0,
                    fail_rate: 0.0,
                    decline_rate: 0.0,
                    claim_batch: args.claim_batch,
                    transport: match mode {
                        Mode::Broker { url, .. } => Some(DemoTransport {
                            queue_prefix: format!(
                                "sagabox-bench-saga-{}-{scratch}",
                                std::process::id()
                            ),
                            ..DemoTransport::new(url.clone())
                        }),
                        _ => None,
                    },
                    ..DemoConfig::default()
                };
                let load = pace.map_or_else(|| "full".to_owned(), |pace| format!("paced {pace}/s"));
                let measured = measure(
                    &admin,
                    (&args.database_url, &name),
                    mode,
                    &config,
                    (run, load),
                )
                .await;
                if let Some(transport) = &config.transport {
                    super::remove_queues(
                        &transport.url,
                        &transport.queue_prefix,
                        &[
                            "payment",
                            "inventory",
                            "email",
                            sagabox_checkout::ORCHESTRATOR,
                        ],
                        "bench-saga",
                    )
                    .await;
                }
                drop_database(&admin, &name).await;
                let mut figures = measured?;
                match mode {
                    Mode::Floor => floor_rate = Some(figures.sagas_per_sec),
                    _ => {
                        figures.ratio_to_floor =
                            floor_rate.map(|floor| figures.sagas_per_sec / floor)
                    }
                }
                runs.push(figures);
            }
        }
    }
    admin.close().await;
    Ok(SagaBenchReport {
        database: redact(&args.database_url),
        orders: args.orders,
        concurrency: args.concurrency,
        paced_rate: args.paced_rate,
        paced_orders: args.paced_orders,
        claim_batch: args.claim_batch,
        runs,
    })
}

/// Runs one mode on a new scratch database `name` beside `url`'s and reads the figures
/// of run number `run` under `load`.
async fn measure(
    admin: &PgPool,
    (url, name): (&str, &str),
    mode: &Mode,
    config: &DemoConfig,
    (run, load): (u32, String),
) -> Result<SagaRun, BoxError> {
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(admin)
        .await
        .map_err(|error| {
            format!(
                "create the scratch database {name}: {}; give the role of --database-url \
                 CREATEDB",
                sagabox::database::describe(&error)
            )
        })?;
    let scratch_url = with_database(url, name)?;
    sagabox::database::migrate(&scratch_url, &Schema::default(), InboxConfig::default()).await?;
    let before = Counters::read(admin, name).await?;
    let (sagas, compensated, sagas_per_sec) = match mode {
        Mode::Floor => {
            let summary = sagabox_checkout::run_floor(&scratch_url, config).await?;
            (summary.sagas, summary.compensated, summary.sagas_per_sec)
        }
        Mode::InProcess | Mode::Broker { .. } => {
            let summary = sagabox_checkout::run(&scratch_url, config).await?;
            if summary.damage() != 0 || summary.unfinished != 0 {
                return Err(format!(
                    "{}: the run was not clean ({} unfinished, damage {}): not a measurement",
                    mode.name(),
                    summary.unfinished,
                    summary.damage()
                )
                .into());
            }
            (
                usize::try_from(summary.completed + summary.compensated).unwrap_or(0),
                usize::try_from(summary.compensated).unwrap_or(0),
                summary.sagas_per_sec,
            )
        }
    };
    let after = Counters::read(admin, name).await?;
    let latency = Latency::read(&scratch_url).await?;
    let per_saga = |value: f64| value / sagas.max(1) as f64;
    Ok(SagaRun {
        mode: mode.name().to_owned(),
        load,
        run,
        sagas,
        compensated,
        sagas_per_sec,
        ratio_to_floor: None,
        p50_ms: latency.p50_ms,
        p99_ms: latency.p99_ms,
        commits_per_saga: per_saga((after.commits - before.commits) as f64),
        wal_bytes_per_saga: per_saga(after.wal_bytes - before.wal_bytes),
        // A process that exited between the readings (a broker's helper) takes its time
        // with it: a share is never below 0.
        cpu_ms_per_saga: Cpu {
            sagabox: per_saga(after.cpu.sagabox - before.cpu.sagabox).max(0.0) * 1000.0,
            postgres: per_saga(after.cpu.postgres - before.cpu.postgres).max(0.0) * 1000.0,
            broker: per_saga(after.cpu.broker - before.cpu.broker).max(0.0) * 1000.0,
        },
    })
}

/// The server's counters at one moment.
struct Counters {
    commits: i64,
    /// The WAL position, in bytes from its start.
    wal_bytes: f64,
    /// CPU seconds.
    cpu: Cpu,
}

impl Counters {
    /// Waits until the scratch database has no connection left (a closing backend
    /// reports its commits as it exits), then reads its commits, the WAL position and
    /// the CPU times.
    async fn read(admin: &PgPool, database: &str) -> Result<Self, BoxError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let open: i64 =
                sqlx::query_scalar("SELECT COUNT(*) FROM pg_stat_activity WHERE datname = $1")
                    .bind(database)
                    .fetch_one(admin)
                    .await?;
            if open == 0 {
                break;
            }
            if Instant::now() > deadline {
                let held: Vec<(Option<String>, Option<String>, Option<String>)> = sqlx::query_as(
                    "SELECT application_name, state, left(query, 80) FROM pg_stat_activity \
                     WHERE datname = $1",
                )
                .bind(database)
                .fetch_all(admin)
                .await?;
                return Err(format!(
                    "{database} still has {open} connections 30 s after its run: {held:?}"
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let row = sqlx::query(
            "SELECT pg_stat_clear_snapshot()::text AS cleared, \
                    (SELECT xact_commit FROM pg_stat_database WHERE datname = $1) AS commits, \
                    pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 AS bytes",
        )
        .bind(database)
        .fetch_one(admin)
        .await?;
        Ok(Self {
            commits: row.try_get::<Option<i64>, _>("commits")?.unwrap_or(0),
            wal_bytes: row.try_get("bytes")?,
            cpu: Cpu {
                sagabox: cpu_seconds(|pid, _| pid == "self"),
                postgres: cpu_seconds(|_, comm| comm == "postgres"),
                broker: cpu_seconds(|_, comm| comm == "beam.smp" || comm == "nats-server"),
            },
        })
    }
}

/// Start-to-end times of the finished sagas, from their rows.
struct Latency {
    p50_ms: f64,
    p99_ms: f64,
}

impl Latency {
    async fn read(url: &str) -> Result<Self, BoxError> {
        let store = sagabox::PostgresStore::connect(url, 1).await?;
        let table = Schema::default().table("sagabox_saga_instances");
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT \
               percentile_cont(0.5) WITHIN GROUP (ORDER BY d) AS p50, \
               percentile_cont(0.99) WITHIN GROUP (ORDER BY d) AS p99 \
             FROM (SELECT EXTRACT(EPOCH FROM updated_at - created_at)::float8 * 1000 AS d \
                   FROM {table} WHERE status IN ('completed', 'compensated')) finished"
        )))
        .fetch_one(store.pool())
        .await?;
        store.pool().close().await;
        Ok(Self {
            p50_ms: row.try_get::<Option<f64>, _>("p50")?.unwrap_or(0.0),
            p99_ms: row.try_get::<Option<f64>, _>("p99")?.unwrap_or(0.0),
        })
    }
}

/// CPU seconds (user and system, with those of exited children) of the processes of
/// this machine that `wanted(pid, command name)` picks; `"self"` is this process.
fn cpu_seconds(wanted: impl Fn(&str, &str) -> bool) -> f64 {
    // Linux counts in clock ticks of 1/100 s (USER_HZ) on every architecture it runs on.
    const TICKS_PER_SECOND: f64 = 100.0;
    let mut ticks = 0u64;
    let mut add = |pid: &str| {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return;
        };
        // The command name sits in parentheses and may hold spaces; the fields after it
        // are numbered from 3 (state): utime, stime, cutime and cstime are 14 to 17.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            return;
        };
        if !wanted(pid, &stat[open + 1..close]) {
            return;
        }
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        ticks += fields
            .get(11..15)
            .unwrap_or_default()
            .iter()
            .filter_map(|field| field.parse::<u64>().ok())
            .sum::<u64>();
    };
    add("self");
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            if let Some(pid) = entry.file_name().to_str()
                && pid.bytes().all(|b| b.is_ascii_digit())
                && pid != std::process::id().to_string()
            {
                add(pid);
            }
        }
    }
    ticks as f64 / TICKS_PER_SECOND
}

/// `url` with its database replaced by `database` (its parameters kept).
fn with_database(url: &str, database: &str) -> Result<String, BoxError> {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let host_start = base
        .find("://")
        .map(|i| i + 3)
        .ok_or_else(|| format!("{}: not a postgres:// URL", redact(url)))?;
    let host_end = base[host_start..]
        .find('/')
        .map_or(base.len(), |i| host_start + i);
    Ok(format!(
        "{}/{database}{}",
        &base[..host_end],
        query.map(|q| format!("?{q}")).unwrap_or_default()
    ))
}

/// Drops a scratch database, whoever is still connected.
async fn drop_database(admin: &PgPool, name: &str) {
    let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(admin)
    .await;
    if let Err(error) = dropped {
        tracing::warn!(database = name, %error, "the scratch database was not dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_url_keeps_the_host_and_parameters() {
        assert_eq!(
            with_database("postgres://u:p@h:5432/postgres?sslmode=require", "x").unwrap(),
            "postgres://u:p@h:5432/x?sslmode=require"
        );
        assert_eq!(
            with_database("postgres://h", "x").unwrap(),
            "postgres://h/x"
        );
        assert!(with_database("h/db", "x").is_err());
    }

    #[test]
    fn this_process_has_cpu_time() {
        let spin = Instant::now();
        while spin.elapsed() < Duration::from_millis(50) {
            std::hint::black_box(spin.elapsed());
        }
        assert!(cpu_seconds(|pid, _| pid == "self") > 0.0);
    }
}
