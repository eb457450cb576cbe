//! `sagabox bench`: the inbox's cost against hand-written SQL doing the same work, in
//! one run on one database.
//!
//! Every mode runs the same workload per message — a claim (except `no_inbox`), one
//! business `UPDATE` and one outbox `INSERT` (both skipped with `--claim-only`) — in one
//! transaction per message, from `--concurrency` tasks:
//!
//! - `raw_sql`: the baseline, by hand: `INSERT … ON CONFLICT DO NOTHING` into an
//!   unpartitioned inbox, then the business statements if the claim was fresh;
//! - `guard`: [`InboxGuard::process`] (partitioned inbox, cross-partition uniqueness,
//!   result recorded);
//! - `actor`: the full path — each message sent to a [`StepPool`](sagabox::step::StepPool) of `--concurrency`
//!   worker actors and its reply awaited;
//! - `batched`: [`InboxGuard::process_batch`] over batches of `--batch` messages, one
//!   transaction per batch (a message's latency is its batch's), the business statements
//!   per message;
//! - `raw_batch_set`: `batched_set`'s baseline, by hand: per batch one `INSERT … SELECT
//!   FROM unnest … ON CONFLICT DO NOTHING RETURNING message_id` into the unpartitioned
//!   inbox, then the set-based business statements for the ids it returned (per message
//!   on SQLite);
//! - `batched_set`: [`InboxGuard::process_batch_set`], the same batches with the
//!   business statements set-based (one `UPDATE … FROM unnest`, one `INSERT … SELECT
//!   FROM unnest` per batch on PostgreSQL; per message on SQLite, where a statement is
//!   an in-process call);
//! - `set_no_inbox`: the `batched_set` batches' business statements alone, without the
//!   inbox: that mode's ceiling;
//! - `no_inbox`: the business statements alone, the ceiling.
//!
//! Each mode runs on its own consumer type (or table), with the same messages; a warm-up
//! of 10 % is excluded. `--prefill` and `--prune-rows` (PostgreSQL) add the table-scale
//! and pruning measurements of [`scale`].

pub(crate) mod broker;
mod modes;
mod options;
pub(crate) mod relay;
pub(crate) mod saga;
mod scale;

pub(crate) use options::{BenchOptions, run_command};

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::RngExt;
use rand::rngs::StdRng;
use sagabox::Schema;
use sagabox::database::Backend;
use sagabox::logging::redact;
use sagabox::transport::{Sender, Transport};
use sagabox::{
    ConsumerType, Envelope, InboxConfig, InboxGuard, MAX_BATCH, MessageId, PostgresStore,
    SqliteStore,
};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Pool};

/// What to measure.
#[derive(Debug, Clone)]
pub(crate) struct BenchArgs {
    pub(crate) database_url: String,
    pub(crate) messages: usize,
    pub(crate) concurrency: usize,
    pub(crate) duplicate_rate: f64,
    pub(crate) claim_only: bool,
    pub(crate) with_result: bool,
    pub(crate) rounds: usize,
    pub(crate) seed: u64,
    pub(crate) modes: Vec<Mode>,
    pub(crate) timeless: bool,
    pub(crate) batch: usize,
    pub(crate) prefill: u64,
    pub(crate) prune_rows: u64,
}

/// Figures for one mode.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ModeReport {
    mode: &'static str,
    messages: usize,
    applied: usize,
    msgs_per_sec: f64,
    p50_us: u64,
    p99_us: u64,
    ratio_to_raw: f64,
    /// Resident memory of the bench process after the warm-up and at the end, in MiB.
    rss_mb_after_warmup: f64,
    rss_mb_end: f64,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BenchReport {
    database: String,
    concurrency: usize,
    duplicate_rate: f64,
    claim_only: bool,
    with_result: bool,
    timeless: bool,
    batch: usize,
    rounds: usize,
    modes: Vec<ModeReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scale: Option<scale::ScaleReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pruning: Option<scale::PruneReport>,
}

/// What `--modes` takes, in the order the modes run: `--help` and the error for an
/// unknown mode both list these variants.
#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub(crate) enum Mode {
    /// The baseline: hand-written `INSERT … ON CONFLICT DO NOTHING` into an unpartitioned inbox.
    RawSql,
    /// The inbox guard, one transaction per message.
    Guard,
    /// Each message through a step pool of worker actors, reply awaited.
    Actor,
    /// The guard over batches of `--batch` messages, business statements per message.
    Batched,
    /// `batched_set` by hand: one `INSERT … ON CONFLICT … RETURNING` per batch, then the
    /// set-based business statements for the fresh ones.
    RawBatchSet,
    /// The same batches with set-based business statements.
    BatchedSet,
    /// The `batched_set` batches' business statements alone, no inbox: its ceiling.
    SetNoInbox,
    /// The business statements alone, no inbox: the ceiling.
    NoInbox,
}

impl Mode {
    /// Every mode, in the order they run.
    fn all() -> &'static [Mode] {
        <Mode as clap::ValueEnum>::value_variants()
    }

    fn name(self) -> &'static str {
        match self {
            Mode::RawSql => "raw_sql",
            Mode::Guard => "guard",
            Mode::Actor => "actor",
            Mode::Batched => "batched",
            Mode::RawBatchSet => "raw_batch_set",
            Mode::BatchedSet => "batched_set",
            Mode::SetNoInbox => "set_no_inbox",
            Mode::NoInbox => "no_inbox",
        }
    }
}

/// Resident memory of this process in MiB (Linux `/proc`; 0 elsewhere).
fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<f64>()
                        .ok()
                })
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One mode set up and warmed up, with its figures so far.
struct Prepared<U> {
    mode: Mode,
    /// What runs one unit of the mode's work.
    unit: Arc<U>,
    rss_after_warmup: f64,
    latencies: Vec<Duration>,
    applied: usize,
    elapsed: Duration,
}

/// One mode's raw figures.
struct ModeRun {
    mode: Mode,
    latencies: Vec<Duration>,
    applied: usize,
    elapsed: Duration,
    rss_after_warmup: f64,
    rss_end: f64,
}

const ACCOUNTS: i64 = 1000;

const PG_SETUP: &str = "
CREATE TABLE bench_accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL);
INSERT INTO bench_accounts SELECT g, 0 FROM generate_series(0, 999) g;
CREATE TABLE bench_outbox (message_id TEXT NOT NULL, payload TEXT NOT NULL);
CREATE TABLE bench_raw_inbox (consumer_type TEXT NOT NULL, message_id TEXT NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL, result JSONB, PRIMARY KEY (consumer_type, message_id));
";

const SQLITE_SETUP: &str = "
CREATE TABLE bench_accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
WITH RECURSIVE g(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n < 999)
    INSERT INTO bench_accounts SELECT n, 0 FROM g;
CREATE TABLE bench_outbox (message_id TEXT NOT NULL, payload TEXT NOT NULL);
CREATE TABLE bench_raw_inbox (consumer_type TEXT NOT NULL, message_id TEXT NOT NULL,
    processed_at TEXT NOT NULL, result TEXT, PRIMARY KEY (consumer_type, message_id)) WITHOUT ROWID;
";

/// The result a handler records with `--with-result` (else none): small, like a charge id.
fn handler_result(with_result: bool, account: i64) -> serde_json::Value {
    if with_result {
        serde_json::json!({ "account": account })
    } else {
        serde_json::Value::Null
    }
}

/// The messages of one mode: fresh UUIDv7 ids, some repeated per `--duplicate-rate`.
fn workload(args: &BenchArgs, rng: &mut StdRng) -> Arc<Vec<(Envelope, i64)>> {
    let mut messages: Vec<(Envelope, i64)> = Vec::with_capacity(args.messages);
    for i in 0..args.messages {
        if i > 0 && rng.random_bool(args.duplicate_rate) {
            let earlier = messages[rng.random_range(0..i)].clone();
            messages.push(earlier);
            continue;
        }
        // UUIDv4 ids carry no time: with `--timeless` every claim takes the slow path.
        let id = if args.timeless {
            MessageId::new(uuid::Uuid::new_v4().to_string())
        } else {
            Ok(MessageId::new_v7())
        };
        let account = rng.random_range(0..ACCOUNTS);
        // The account rides in the payload too: the `actor` mode's step reads it there.
        let payload = serde_json::json!({"n": i, "account": account});
        let envelope = match id.and_then(|id| Envelope::new(id, "deposit", payload)) {
            Ok(envelope) => envelope,
            Err(error) => unreachable!("static kind is valid: {error}"),
        };
        messages.push((envelope, account));
    }
    Arc::new(messages)
}

/// Runs `op` over units `0..units` (a message, or a batch) from `concurrency` tasks.
/// `op` returns how many messages the unit held and how many it applied; each message
/// is given its unit's latency. Returns the latencies, the applied count and the time.
async fn drive<F, Fut>(
    units: usize,
    concurrency: usize,
    op: F,
) -> Result<(Vec<Duration>, usize, Duration), BoxError>
where
    F: Fn(usize) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = Result<(usize, usize), BoxError>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    let tasks_n = concurrency.max(1);
    for _ in 0..tasks_n {
        let (next, op) = (next.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(units / tasks_n + 1);
            let mut applied = 0;
            loop {
                let unit = next.fetch_add(1, Ordering::Relaxed);
                if unit >= units {
                    break;
                }
                let t = Instant::now();
                let (messages, unit_applied) = op(unit).await?;
                let latency = t.elapsed();
                latencies.extend(std::iter::repeat_n(latency, messages));
                applied += unit_applied;
            }
            Ok::<_, BoxError>((latencies, applied))
        }));
    }
    let mut latencies = Vec::new();
    let mut applied = 0;
    for task in tasks {
        let (l, a) = task.await??;
        latencies.extend(l);
        applied += a;
    }
    Ok((latencies, applied, started.elapsed()))
}

/// Removes the queues or streams, with their dead-letter ones, that a bench's run on
/// the broker at `url` declared under `prefix` for `consumers`; `role` names its
/// connection. What cannot be removed is left (a scratch name, harmless).
pub(crate) async fn remove_queues(url: &str, prefix: &str, consumers: &[&str], role: &str) {
    let Ok(transport) = Transport::from_url(url, prefix) else {
        return;
    };
    let Ok(mut sender) = Sender::connect(&transport, role).await else {
        return;
    };
    for consumer in consumers
        .iter()
        .filter_map(|name| ConsumerType::new(*name).ok())
    {
        let _ = sender.remove(&consumer).await;
    }
    sender.close().await;
}

fn percentile(sorted: &[Duration], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank].as_micros() as u64
}

/// The account a workload message deposits to (set by [`workload`]).
fn account_of(envelope: &Envelope) -> i64 {
    envelope.payload["account"].as_i64().unwrap_or_default()
}

/// The scratch file of a run on SQLite: beside the file `url` names, so that the disk
/// measured is the one the given database is on.
fn scratch_file(url: &str) -> Result<std::path::PathBuf, BoxError> {
    let given = sqlx::sqlite::SqliteConnectOptions::from_str(url)?;
    let given = given.get_filename();
    let name = given
        .file_name()
        .map_or_else(|| "sagabox".into(), |name| name.to_string_lossy());
    Ok(given.with_file_name(format!("{name}.bench-{}", std::process::id())))
}

/// Runs the benchmark on a scratch schema (PostgreSQL) or a scratch file (SQLite) that is
/// removed afterwards, so it never touches the data at `database_url`.
pub(crate) async fn run(args: BenchArgs) -> Result<BenchReport, BoxError> {
    let backend = validate(&args)?;
    let connections = u32::try_from(args.concurrency).unwrap_or(u32::MAX);
    let (results, scale, pruning) = match backend {
        Backend::Postgres => on_postgres(&args, connections).await?,
        Backend::Sqlite => (on_sqlite(&args, connections).await?, None, None),
        _ => return Err(format!("unsupported database url {}", redact(&args.database_url)).into()),
    };
    Ok(report(&args, results, scale, pruning))
}

/// Refuses arguments the benchmark cannot run with; the backend the URL names.
fn validate(args: &BenchArgs) -> Result<Backend, BoxError> {
    if !(0.0..=1.0).contains(&args.duplicate_rate) {
        return Err(format!(
            "--duplicate-rate must be within 0..=1, got {}",
            args.duplicate_rate
        )
        .into());
    }
    if args.messages == 0 || args.concurrency == 0 {
        return Err("--messages and --concurrency must be at least 1".into());
    }
    if !(1..=MAX_BATCH).contains(&args.batch) {
        return Err(format!("--batch must be within 1..={MAX_BATCH}, got {}", args.batch).into());
    }
    let backend = Backend::of(&args.database_url)?;
    if (args.prefill > 0 || args.prune_rows > 0) && backend != Backend::Postgres {
        return Err("--prefill and --prune-rows run on PostgreSQL only".into());
    }
    if args.prefill > 0 && !(args.modes.is_empty() || args.modes.contains(&Mode::Guard)) {
        return Err(
            "--prefill compares with the guard mode on the empty inbox: include it in --modes"
                .into(),
        );
    }
    Ok(backend)
}

/// The runs on a scratch schema of the PostgreSQL database, dropped afterwards, with the
/// prefilled-inbox and pruning measures when asked for.
async fn on_postgres(
    args: &BenchArgs,
    connections: u32,
) -> Result<
    (
        Vec<ModeRun>,
        Option<scale::ScaleReport>,
        Option<scale::PruneReport>,
    ),
    BoxError,
> {
    let mut scale = None;
    let mut pruning = None;
    let scratch = ScratchSchema::create(
        &args.database_url,
        format!("sagabox_bench_{}", std::process::id()),
    )
    .await?;
    let (schema, options) = (&scratch.name, &scratch.options);
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .test_before_acquire(false)
        .connect_with(options.clone())
        .await?;
    let outcome = async {
        sqlx::raw_sql(PG_SETUP).execute(&pool).await?;
        // sagabox's tables in the scratch schema too, beside the baseline's.
        let store = PostgresStore::new(pool.clone()).with_schema(Schema::new(schema)?);
        let guard = InboxGuard::new(store, InboxConfig::default())?;
        guard.migrate().await?;
        let results = modes::run_modes(pool.clone(), guard.clone(), args).await?;
        if args.prefill > 0 {
            let empty = results
                .iter()
                .find(|run| run.mode == Mode::Guard)
                .map(|run| run.latencies.len() as f64 / run.elapsed.as_secs_f64())
                .ok_or("no guard run to compare the prefilled inbox with")?;
            scale = Some(scale::prefill(&pool, &guard, args, empty).await?);
        }
        if args.prune_rows > 0 {
            pruning = Some(scale::prune(options, &guard, args).await?);
        }
        Ok::<_, BoxError>(results)
    }
    .await;
    pool.close().await;
    scratch.drop().await?;
    Ok((outcome?, scale, pruning))
}

/// A schema of its own in the PostgreSQL database a bench runs on, created afresh and
/// dropped afterwards, so that a bench never touches the data at the URL.
pub(crate) struct ScratchSchema {
    /// A connection of its own, which creates and drops the schema.
    admin: Pool<sqlx::Postgres>,
    /// The schema's name.
    pub(crate) name: String,
    /// Connection options whose `search_path` is the schema.
    pub(crate) options: PgConnectOptions,
}

impl ScratchSchema {
    /// Creates schema `name` in the database at `url`, dropping one left by an earlier
    /// run first.
    pub(crate) async fn create(url: &str, name: String) -> Result<Self, BoxError> {
        // Through the store's connect, whose error names the host and port.
        let admin = PostgresStore::connect(url, 1).await?.pool().clone();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {name} CASCADE; CREATE SCHEMA {name}"
        )))
        .execute(&admin)
        .await?;
        let options = PgConnectOptions::from_str(url)?.options([("search_path", name.as_str())]);
        Ok(Self {
            admin,
            name,
            options,
        })
    }

    /// Drops the schema and everything in it.
    pub(crate) async fn drop(self) -> Result<(), BoxError> {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {} CASCADE",
            self.name
        )))
        .execute(&self.admin)
        .await?;
        self.admin.close().await;
        Ok(())
    }
}

/// The runs on a scratch SQLite file beside the one named, removed afterwards.
async fn on_sqlite(args: &BenchArgs, connections: u32) -> Result<Vec<ModeRun>, BoxError> {
    let path = scratch_file(&args.database_url)?;
    let url = format!("sqlite:{}", path.display());
    let store = SqliteStore::connect(&url, connections).await?;
    let pool = store.pool().clone();
    let outcome = async {
        sqlx::raw_sql(SQLITE_SETUP).execute(&pool).await?;
        let guard = InboxGuard::new(store, InboxConfig::default())?;
        guard.migrate().await?;
        modes::run_modes(pool.clone(), guard, args).await
    }
    .await;
    pool.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    outcome
}

/// The report of `results`: each mode's rate, latencies and ratio to raw SQL.
fn report(
    args: &BenchArgs,
    results: Vec<ModeRun>,
    scale: Option<scale::ScaleReport>,
    pruning: Option<scale::PruneReport>,
) -> BenchReport {
    let rate =
        |latencies: &[Duration], elapsed: Duration| latencies.len() as f64 / elapsed.as_secs_f64();
    let raw_rate = results
        .iter()
        .find(|run| run.mode == Mode::RawSql)
        .map(|run| rate(&run.latencies, run.elapsed));
    let mut modes = Vec::new();
    for mut run in results {
        run.latencies.sort_unstable();
        let rate = rate(&run.latencies, run.elapsed);
        modes.push(ModeReport {
            mode: run.mode.name(),
            messages: run.latencies.len(),
            applied: run.applied,
            msgs_per_sec: rate,
            p50_us: percentile(&run.latencies, 0.50),
            p99_us: percentile(&run.latencies, 0.99),
            ratio_to_raw: raw_rate.map_or(1.0, |raw| rate / raw),
            rss_mb_after_warmup: run.rss_after_warmup,
            rss_mb_end: run.rss_end,
        });
    }
    BenchReport {
        database: redact(&args.database_url),
        concurrency: args.concurrency,
        duplicate_rate: args.duplicate_rate,
        claim_only: args.claim_only,
        with_result: args.with_result,
        timeless: args.timeless,
        batch: args.batch,
        rounds: args.rounds,
        modes,
        scale,
        pruning,
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "database {}  concurrency {}  duplicate-rate {}  rounds {}{}{}",
            self.database,
            self.concurrency,
            self.duplicate_rate,
            self.rounds,
            if self.claim_only { "  claim-only" } else { "" },
            if self.with_result {
                "  with-result"
            } else {
                ""
            },
        )?;
        if self.timeless {
            writeln!(
                f,
                "messages carry no time: every guard claim probes all partitions"
            )?;
        }
        writeln!(
            f,
            "{:<13} {:>9} {:>9} {:>11} {:>9} {:>9} {:>8} {:>12}",
            "mode", "messages", "applied", "msgs/s", "p50 µs", "p99 µs", "× raw", "RSS MiB"
        )?;
        for m in &self.modes {
            writeln!(
                f,
                "{:<13} {:>9} {:>9} {:>11.0} {:>9} {:>9} {:>8.2} {:>5.0} → {:<4.0}",
                m.mode,
                m.messages,
                m.applied,
                m.msgs_per_sec,
                m.p50_us,
                m.p99_us,
                m.ratio_to_raw,
                m.rss_mb_after_warmup,
                m.rss_mb_end
            )?;
        }
        if self.modes.iter().any(|m| m.mode == "batched") {
            writeln!(f, "batched: {} messages per transaction", self.batch)?;
        }
        if let Some(scale) = &self.scale {
            write!(f, "{scale}")?;
        }
        if let Some(pruning) = &self.pruning {
            write!(f, "{pruning}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_mode_reports_under_the_name_it_is_chosen_by() {
        for mode in Mode::all() {
            let value = clap::ValueEnum::to_possible_value(mode).expect("no mode is hidden");
            assert_eq!(value.get_name(), mode.name());
        }
    }
}
