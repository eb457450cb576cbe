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
//! - `no_inbox`: the business statements alone, the ceiling.
//!
//! Each mode runs on its own fresh tables and ids; a warm-up of 10 % is excluded.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sagabox::database::{Backend, redact};
use sagabox::{
    ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, PostgresStore, SqliteStore,
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
    pub(crate) seed: u64,
    pub(crate) modes: Vec<String>,
    pub(crate) timeless: bool,
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
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BenchReport {
    database: String,
    concurrency: usize,
    duplicate_rate: f64,
    claim_only: bool,
    timeless: bool,
    modes: Vec<ModeReport>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    RawSql,
    Guard,
    NoInbox,
}

impl Mode {
    const ALL: [Mode; 3] = [Mode::RawSql, Mode::Guard, Mode::NoInbox];
    fn name(self) -> &'static str {
        match self {
            Mode::RawSql => "raw_sql",
            Mode::Guard => "guard",
            Mode::NoInbox => "no_inbox",
        }
    }
}

const ACCOUNTS: i64 = 1000;

const PG_SETUP: &str = "
CREATE TABLE bench_accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL);
INSERT INTO bench_accounts SELECT g, 0 FROM generate_series(0, 999) g;
CREATE TABLE bench_outbox (message_id TEXT NOT NULL, payload TEXT NOT NULL);
CREATE TABLE bench_raw_inbox (consumer_type TEXT NOT NULL, message_id TEXT NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL, PRIMARY KEY (consumer_type, message_id));
";

const SQLITE_SETUP: &str = "
CREATE TABLE bench_accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
WITH RECURSIVE g(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n < 999)
    INSERT INTO bench_accounts SELECT n, 0 FROM g;
CREATE TABLE bench_outbox (message_id TEXT NOT NULL, payload TEXT NOT NULL);
CREATE TABLE bench_raw_inbox (consumer_type TEXT NOT NULL, message_id TEXT NOT NULL,
    processed_at TEXT NOT NULL, PRIMARY KEY (consumer_type, message_id)) WITHOUT ROWID;
";

const RAW_CLAIM: &str = "INSERT INTO bench_raw_inbox (consumer_type, message_id, processed_at) \
                         VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";
const BUSINESS_UPDATE: &str = "UPDATE bench_accounts SET balance = balance + 1 WHERE id = $1";
const OUTBOX_INSERT: &str = "INSERT INTO bench_outbox (message_id, payload) VALUES ($1, $2)";

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
        let envelope =
            match id.and_then(|id| Envelope::new(id, "deposit", serde_json::json!({"n": i}))) {
                Ok(envelope) => envelope,
                Err(error) => unreachable!("static kind is valid: {error}"),
            };
        messages.push((envelope, rng.random_range(0..ACCOUNTS)));
    }
    Arc::new(messages)
}

/// Runs `op` over every message from `concurrency` tasks; returns per-message latencies
/// and how many were applied.
async fn drive<F, Fut>(
    messages: Arc<Vec<(Envelope, i64)>>,
    concurrency: usize,
    op: F,
) -> Result<(Vec<Duration>, usize, Duration), Box<dyn std::error::Error + Send + Sync>>
where
    F: Fn(Arc<Vec<(Envelope, i64)>>, usize) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = Result<bool, Box<dyn std::error::Error + Send + Sync>>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (next, messages, op) = (next.clone(), messages.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut applied = 0;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= messages.len() {
                    break;
                }
                let t = Instant::now();
                if op(messages.clone(), i).await? {
                    applied += 1;
                }
                latencies.push(t.elapsed());
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((latencies, applied))
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

fn percentile(sorted: &[Duration], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank].as_micros() as u64
}

macro_rules! backend_runner {
    ($name:ident, $store:ty, $db:ty) => {
        async fn $name(
            pool: Pool<$db>,
            store: $store,
            args: &BenchArgs,
        ) -> Result<
            Vec<(Mode, Vec<Duration>, usize, Duration)>,
            Box<dyn std::error::Error + Send + Sync>,
        > {
            /// The business statements every mode runs, in the caller's transaction.
            async fn business(
                conn: &mut <$db as sqlx::Database>::Connection,
                envelope: &Envelope,
                account: i64,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(BUSINESS_UPDATE)
                    .bind(account)
                    .execute(&mut *conn)
                    .await?;
                sqlx::query(OUTBOX_INSERT)
                    .bind(envelope.id.as_str())
                    .bind(envelope.payload.to_string())
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            }

            let guard = InboxGuard::new(store, InboxConfig::default())?;
            guard.migrate().await?;
            let mut rng = StdRng::seed_from_u64(args.seed);
            let claim_only = args.claim_only;
            let mut results = Vec::new();
            // Every mode gets the same messages; its own consumer type (guard) or table
            // (raw_sql) keeps one mode's claims from meeting another's.
            let messages = workload(args, &mut rng);
            let warmup = workload(
                &BenchArgs {
                    messages: (args.messages / 10).max(1),
                    ..args.clone()
                },
                &mut rng,
            );
            for mode in Mode::ALL
                .into_iter()
                .filter(|m| args.modes.is_empty() || args.modes.iter().any(|n| n == m.name()))
            {
                let (messages, warmup) = (messages.clone(), warmup.clone());
                let consumer = ConsumerType::new(format!("bench-{}", mode.name()))?;
                let op = {
                    let (pool, guard, consumer) = (pool.clone(), guard.clone(), consumer.clone());
                    move |messages: Arc<Vec<(Envelope, i64)>>, i: usize| {
                        let (pool, guard, consumer) =
                            (pool.clone(), guard.clone(), consumer.clone());
                        async move {
                            let (envelope, account) = &messages[i];
                            let account = *account;
                            let applied = match mode {
                                Mode::RawSql => {
                                    let mut tx = pool.begin().await?;
                                    let fresh = sqlx::query(RAW_CLAIM)
                                        .bind(consumer.as_str())
                                        .bind(envelope.id.as_str())
                                        .bind(chrono::Utc::now())
                                        .execute(&mut *tx)
                                        .await?
                                        .rows_affected()
                                        == 1;
                                    if fresh && !claim_only {
                                        business(&mut tx, envelope, account).await?;
                                    }
                                    tx.commit().await?;
                                    fresh
                                }
                                Mode::NoInbox => {
                                    let mut tx = pool.begin().await?;
                                    if !claim_only {
                                        business(&mut tx, envelope, account).await?;
                                    }
                                    tx.commit().await?;
                                    true
                                }
                                Mode::Guard => {
                                    let outcome = guard
                                        .process(&consumer, envelope, async |conn, envelope| {
                                            if !claim_only {
                                                business(conn, envelope, account).await?;
                                            }
                                            Ok::<_, sqlx::Error>(serde_json::Value::Null)
                                        })
                                        .await?;
                                    !outcome.is_duplicate()
                                }
                            };
                            Ok::<bool, Box<dyn std::error::Error + Send + Sync>>(applied)
                        }
                    }
                };
                drive(warmup, args.concurrency, op.clone()).await?;
                let (latencies, applied, elapsed) = drive(messages, args.concurrency, op).await?;
                results.push((mode, latencies, applied, elapsed));
            }
            Ok(results)
        }
    };
}

backend_runner!(run_postgres, PostgresStore, sqlx::Postgres);
backend_runner!(run_sqlite, SqliteStore, sqlx::Sqlite);

/// Runs the benchmark on a scratch schema (PostgreSQL) or a scratch file (SQLite) that is
/// removed afterwards, so it never touches the data at `database_url`.
pub(crate) async fn run(
    args: BenchArgs,
) -> Result<BenchReport, Box<dyn std::error::Error + Send + Sync>> {
    if !(0.0..=1.0).contains(&args.duplicate_rate) {
        return Err(format!(
            "--duplicate-rate must be within 0..=1, got {}",
            args.duplicate_rate
        )
        .into());
    }
    if let Some(unknown) = args
        .modes
        .iter()
        .find(|n| Mode::ALL.iter().all(|m| m.name() != n.as_str()))
    {
        return Err(
            format!("unknown mode {unknown:?}: choose from raw_sql, guard, no_inbox").into(),
        );
    }
    if args.messages == 0 || args.concurrency == 0 {
        return Err("--messages and --concurrency must be at least 1".into());
    }
    let connections = u32::try_from(args.concurrency).unwrap_or(u32::MAX);
    let results = match Backend::of(&args.database_url)? {
        Backend::Postgres => {
            let schema = format!("sagabox_bench_{}", std::process::id());
            let admin = PgPoolOptions::new()
                .max_connections(1)
                .connect(&args.database_url)
                .await?;
            sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
            )))
            .execute(&admin)
            .await?;
            let options = PgConnectOptions::from_str(&args.database_url)?
                .options([("search_path", schema.as_str())]);
            let pool = PgPoolOptions::new()
                .max_connections(connections)
                .test_before_acquire(false)
                .connect_with(options)
                .await?;
            let outcome = async {
                sqlx::raw_sql(PG_SETUP).execute(&pool).await?;
                run_postgres(pool.clone(), PostgresStore::new(pool.clone()), &args).await
            }
            .await;
            pool.close().await;
            sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE"
            )))
            .execute(&admin)
            .await?;
            outcome?
        }
        Backend::Sqlite => {
            let path =
                std::env::temp_dir().join(format!("sagabox-bench-{}.db", std::process::id()));
            let url = format!("sqlite:{}", path.display());
            let store = SqliteStore::connect(&url, connections).await?;
            let pool = store.pool().clone();
            let outcome = async {
                sqlx::raw_sql(SQLITE_SETUP).execute(&pool).await?;
                run_sqlite(pool.clone(), store, &args).await
            }
            .await;
            pool.close().await;
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
            outcome?
        }
        _ => return Err(format!("unsupported database url {}", redact(&args.database_url)).into()),
    };

    let rate =
        |latencies: &[Duration], elapsed: Duration| latencies.len() as f64 / elapsed.as_secs_f64();
    let raw_rate = results
        .iter()
        .find(|(mode, ..)| *mode == Mode::RawSql)
        .map(|(_, latencies, _, elapsed)| rate(latencies, *elapsed));
    let mut modes = Vec::new();
    for (mode, mut latencies, applied, elapsed) in results {
        latencies.sort_unstable();
        let rate = rate(&latencies, elapsed);
        modes.push(ModeReport {
            mode: mode.name(),
            messages: latencies.len(),
            applied,
            msgs_per_sec: rate,
            p50_us: percentile(&latencies, 0.50),
            p99_us: percentile(&latencies, 0.99),
            ratio_to_raw: raw_rate.map_or(1.0, |raw| rate / raw),
        });
    }
    Ok(BenchReport {
        database: redact(&args.database_url),
        concurrency: args.concurrency,
        duplicate_rate: args.duplicate_rate,
        claim_only: args.claim_only,
        timeless: args.timeless,
        modes,
    })
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "database {}  concurrency {}  duplicate-rate {}{}",
            self.database,
            self.concurrency,
            self.duplicate_rate,
            if self.claim_only { "  claim-only" } else { "" },
        )?;
        if self.timeless {
            writeln!(
                f,
                "messages carry no time: every guard claim probes all partitions"
            )?;
        }
        writeln!(
            f,
            "{:<10} {:>9} {:>9} {:>11} {:>9} {:>9} {:>8}",
            "mode", "messages", "applied", "msgs/s", "p50 µs", "p99 µs", "× raw"
        )?;
        for m in &self.modes {
            writeln!(
                f,
                "{:<10} {:>9} {:>9} {:>11.0} {:>9} {:>9} {:>8.2}",
                m.mode, m.messages, m.applied, m.msgs_per_sec, m.p50_us, m.p99_us, m.ratio_to_raw
            )?;
        }
        Ok(())
    }
}
