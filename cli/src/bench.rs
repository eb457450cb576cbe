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
//! - `actor`: the full path — each message sent to a [`StepPool`] of `--concurrency`
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
mod options;
mod scale;

pub(crate) use options::{BenchOptions, run_command};

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sagabox::Schema;
use sagabox::database::Backend;
use sagabox::logging::redact;
use sagabox::step::{StepError, StepHandler, StepPool, StepPoolConfig};
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
struct Prepared<P, O> {
    mode: Mode,
    steps: Option<Arc<P>>,
    op: O,
    /// Messages per unit of work: 1, or a batch.
    unit_size: usize,
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

const RAW_CLAIM: &str = "INSERT INTO bench_raw_inbox (consumer_type, message_id, processed_at) \
                         VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";
const RAW_RESULT: &str =
    "UPDATE bench_raw_inbox SET result = $3 WHERE consumer_type = $1 AND message_id = $2";
const BUSINESS_UPDATE: &str = "UPDATE bench_accounts SET balance = balance + 1 WHERE id = $1";
const OUTBOX_INSERT: &str = "INSERT INTO bench_outbox (message_id, payload) VALUES ($1, $2)";

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

fn percentile(sorted: &[Duration], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank].as_micros() as u64
}

macro_rules! backend_runner {
    ($name:ident, $business:ident, $business_set:ident, $raw_batch:ident, $step:ident, $store:ty, $db:ty) => {
        /// The business statements every mode runs, in the caller's transaction.
        async fn $business(
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

        /// The `actor` mode's step: the same business statements, the account read from
        /// the payload.
        #[derive(Debug)]
        struct $step {
            claim_only: bool,
            with_result: bool,
        }

        impl StepHandler<$db> for $step {
            async fn handle(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                envelope: &Envelope,
            ) -> Result<serde_json::Value, StepError> {
                let account = envelope.payload["account"]
                    .as_i64()
                    .ok_or_else(|| StepError::Permanent("payload has no integer account".into()))?;
                if !self.claim_only {
                    $business(conn, envelope, account)
                        .await
                        .map_err(|error| StepError::Retryable(error.to_string()))?;
                }
                Ok(handler_result(self.with_result, account))
            }
        }

        async fn $name(
            pool: Pool<$db>,
            guard: InboxGuard<$store>,
            args: &BenchArgs,
        ) -> Result<Vec<ModeRun>, BoxError> {
            let mut rng = StdRng::seed_from_u64(args.seed);
            let claim_only = args.claim_only;
            let with_result = args.with_result;
            let batch = args.batch;
            let mut results = Vec::new();
            let mut prepared = Vec::new();
            // Every mode gets the same messages; its own consumer type (guard, actor,
            // batched) or table (raw_sql) keeps one mode's claims from meeting another's.
            let messages = workload(args, &mut rng);
            let warmup = workload(
                &BenchArgs {
                    messages: (args.messages / 10).max(1),
                    ..args.clone()
                },
                &mut rng,
            );
            for &mode in Mode::all()
                .iter()
                .filter(|m| args.modes.is_empty() || args.modes.contains(m))
            {
                let consumer = ConsumerType::new(format!("bench-{}", mode.name()))?;
                let steps = if mode == Mode::Actor {
                    let config = StepPoolConfig {
                        workers: args.concurrency,
                    };
                    Some(Arc::new(
                        StepPool::spawn(
                            guard.clone(),
                            consumer.clone(),
                            $step {
                                claim_only,
                                with_result,
                            },
                            config,
                        )
                        .await?,
                    ))
                } else {
                    None
                };
                let unit_size = if matches!(
                    mode,
                    Mode::Batched | Mode::RawBatchSet | Mode::BatchedSet | Mode::SetNoInbox
                ) {
                    batch
                } else {
                    1
                };
                let op = {
                    let (pool, guard, consumer, steps) =
                        (pool.clone(), guard.clone(), consumer.clone(), steps.clone());
                    move |messages: Arc<Vec<(Envelope, i64)>>, unit: usize| {
                        let (pool, guard, consumer, steps) =
                            (pool.clone(), guard.clone(), consumer.clone(), steps.clone());
                        async move {
                            let start = unit * unit_size;
                            let end = (start + unit_size).min(messages.len());
                            let (envelope, account) = &messages[start];
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
                                        $business(&mut tx, envelope, account).await?;
                                    }
                                    if fresh && with_result {
                                        sqlx::query(RAW_RESULT)
                                            .bind(consumer.as_str())
                                            .bind(envelope.id.as_str())
                                            .bind(sqlx::types::Json(handler_result(true, account)))
                                            .execute(&mut *tx)
                                            .await?;
                                    }
                                    tx.commit().await?;
                                    usize::from(fresh)
                                }
                                Mode::NoInbox => {
                                    let mut tx = pool.begin().await?;
                                    if !claim_only {
                                        $business(&mut tx, envelope, account).await?;
                                    }
                                    tx.commit().await?;
                                    1
                                }
                                Mode::Guard => {
                                    let outcome = guard
                                        .process(&consumer, envelope, async |conn, envelope| {
                                            if !claim_only {
                                                $business(conn, envelope, account).await?;
                                            }
                                            Ok::<_, sqlx::Error>(handler_result(
                                                with_result,
                                                account,
                                            ))
                                        })
                                        .await?;
                                    usize::from(!outcome.is_duplicate())
                                }
                                Mode::Actor => {
                                    let steps =
                                        steps.as_ref().ok_or("actor mode without a pool")?;
                                    let reply = steps
                                        .deliver(envelope.clone(), Duration::from_secs(60))
                                        .await?;
                                    usize::from(!reply.duplicate)
                                }
                                Mode::SetNoInbox => {
                                    let mut chunk: Vec<&(Envelope, i64)> =
                                        messages[start..end].iter().collect();
                                    chunk.sort_by_key(|(_, account)| *account);
                                    let envelopes: Vec<&Envelope> =
                                        chunk.into_iter().map(|(envelope, _)| envelope).collect();
                                    let mut tx = pool.begin().await?;
                                    if !claim_only {
                                        $business_set(&mut tx, &envelopes).await?;
                                    }
                                    tx.commit().await?;
                                    envelopes.len()
                                }
                                Mode::RawBatchSet => {
                                    let mut chunk: Vec<&(Envelope, i64)> =
                                        messages[start..end].iter().collect();
                                    chunk.sort_by_key(|(_, account)| *account);
                                    let envelopes: Vec<&Envelope> =
                                        chunk.into_iter().map(|(envelope, _)| envelope).collect();
                                    let mut tx = pool.begin().await?;
                                    let fresh = $raw_batch(
                                        &mut tx,
                                        &consumer,
                                        &envelopes,
                                        claim_only,
                                        with_result,
                                    )
                                    .await?;
                                    tx.commit().await?;
                                    fresh
                                }
                                Mode::BatchedSet => {
                                    let mut chunk: Vec<&(Envelope, i64)> =
                                        messages[start..end].iter().collect();
                                    chunk.sort_by_key(|(_, account)| *account);
                                    let envelopes: Vec<Envelope> = chunk
                                        .into_iter()
                                        .map(|(envelope, _)| envelope.clone())
                                        .collect();
                                    let outcomes = guard
                                        .process_batch_set(
                                            &consumer,
                                            &envelopes,
                                            async |conn, fresh| {
                                                if !claim_only {
                                                    $business_set(conn, fresh).await?;
                                                }
                                                Ok::<_, sqlx::Error>(
                                                    fresh
                                                        .iter()
                                                        .map(|envelope| {
                                                            handler_result(
                                                                with_result,
                                                                account_of(envelope),
                                                            )
                                                        })
                                                        .collect(),
                                                )
                                            },
                                        )
                                        .await?;
                                    let mut applied = 0;
                                    for outcome in outcomes {
                                        applied += usize::from(!outcome?.is_duplicate());
                                    }
                                    applied
                                }
                                Mode::Batched => {
                                    // Ordered by account: handlers take their row locks in
                                    // input order, and two batches locking shared rows in
                                    // opposite orders deadlock (PostgreSQL aborts one).
                                    let mut chunk: Vec<&(Envelope, i64)> =
                                        messages[start..end].iter().collect();
                                    chunk.sort_by_key(|(_, account)| *account);
                                    let envelopes: Vec<Envelope> = chunk
                                        .into_iter()
                                        .map(|(envelope, _)| envelope.clone())
                                        .collect();
                                    let outcomes = guard
                                        .process_batch(
                                            &consumer,
                                            &envelopes,
                                            async |conn, envelope| {
                                                let account = account_of(envelope);
                                                if !claim_only {
                                                    $business(conn, envelope, account).await?;
                                                }
                                                Ok::<_, sqlx::Error>(handler_result(
                                                    with_result,
                                                    account,
                                                ))
                                            },
                                        )
                                        .await?;
                                    let mut applied = 0;
                                    for outcome in outcomes {
                                        applied += usize::from(!outcome?.is_duplicate());
                                    }
                                    applied
                                }
                            };
                            Ok::<(usize, usize), BoxError>((end - start, applied))
                        }
                    }
                };
                let warm = warmup.clone();
                let warm_op = {
                    let op = op.clone();
                    move |unit| op(warm.clone(), unit)
                };
                drive(warmup.len().div_ceil(unit_size), args.concurrency, warm_op).await?;
                prepared.push(Prepared {
                    mode,
                    steps,
                    op,
                    unit_size,
                    rss_after_warmup: rss_mb(),
                    latencies: Vec::with_capacity(messages.len()),
                    applied: 0,
                    elapsed: Duration::ZERO,
                });
            }
            // The measured messages in rounds, every mode taking its turn in each round:
            // a checkpoint or an autovacuum run then slows every mode alike instead of
            // whichever happened to be running, which would skew that mode's ratio.
            // Round boundaries fall on batches.
            let rounds = args.rounds.max(1);
            let step = batch.max(1);
            let chunk = (messages.len().div_ceil(rounds).div_ceil(step) * step).max(1);
            for first in (0..messages.len()).step_by(chunk) {
                let len = chunk.min(messages.len() - first);
                for run in &mut prepared {
                    // Units of this round: the mode's units are 1 or `batch` messages, and
                    // rounds start on a multiple of `batch`.
                    let unit_size = run.unit_size.max(1);
                    let first_unit = first / unit_size;
                    let measured_op = {
                        let (op, messages) = (run.op.clone(), messages.clone());
                        move |unit| op(messages.clone(), first_unit + unit)
                    };
                    let (latencies, applied, elapsed) =
                        drive(len.div_ceil(unit_size), args.concurrency, measured_op).await?;
                    run.latencies.extend(latencies);
                    run.applied += applied;
                    run.elapsed += elapsed;
                }
            }
            for run in prepared {
                let rss_end = rss_mb();
                drop(run.op);
                if let Some(steps) = run.steps.and_then(|steps| Arc::into_inner(steps)) {
                    steps.stop().await;
                }
                results.push(ModeRun {
                    mode: run.mode,
                    latencies: run.latencies,
                    applied: run.applied,
                    elapsed: run.elapsed,
                    rss_after_warmup: run.rss_after_warmup,
                    rss_end,
                });
            }
            Ok(results)
        }
    };
}

/// The business statements of a batch, set-based: one `UPDATE` and one `INSERT`.
async fn business_set_pg(
    conn: &mut sqlx::PgConnection,
    envelopes: &[&Envelope],
) -> Result<(), sqlx::Error> {
    let accounts: Vec<i64> = envelopes.iter().map(|e| account_of(e)).collect();
    let ids: Vec<&str> = envelopes.iter().map(|e| e.id.as_str()).collect();
    let payloads: Vec<String> = envelopes.iter().map(|e| e.payload.to_string()).collect();
    // Rows locked in id order first: the UPDATE's join locks them in plan order, and two
    // batches locking shared rows in different orders deadlock.
    sqlx::query("SELECT 1 FROM bench_accounts WHERE id = ANY($1) ORDER BY id FOR UPDATE")
        .bind(&accounts)
        .execute(&mut *conn)
        .await?;
    sqlx::query(
        "UPDATE bench_accounts a SET balance = balance + d.n \
           FROM (SELECT id, count(*) AS n FROM unnest($1::int8[]) AS u(id) GROUP BY id) d \
          WHERE a.id = d.id",
    )
    .bind(&accounts)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO bench_outbox (message_id, payload) SELECT * FROM unnest($1::text[], $2::text[])",
    )
    .bind(&ids)
    .bind(&payloads)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// `raw_batch_set` on PostgreSQL, the hand-written batched inbox: claim the batch's ids
/// in one statement, apply the fresh ones set-based, store their results (with
/// `--with-result`) in one more. Returns how many were fresh.
async fn raw_batch_pg(
    conn: &mut sqlx::PgConnection,
    consumer: &ConsumerType,
    envelopes: &[&Envelope],
    claim_only: bool,
    with_result: bool,
) -> Result<usize, sqlx::Error> {
    let ids: Vec<&str> = envelopes.iter().map(|e| e.id.as_str()).collect();
    let inserted: Vec<String> = sqlx::query_scalar(
        "INSERT INTO bench_raw_inbox (consumer_type, message_id, processed_at) \
         SELECT $1, u.id, $3 FROM unnest($2::text[]) AS u(id) \
         ON CONFLICT DO NOTHING RETURNING message_id",
    )
    .bind(consumer.as_str())
    .bind(&ids)
    .bind(chrono::Utc::now())
    .fetch_all(&mut *conn)
    .await?;
    // A repeat inside the batch was inserted once: only its first copy is fresh.
    let mut inserted: std::collections::HashSet<String> = inserted.into_iter().collect();
    let fresh: Vec<&Envelope> = envelopes
        .iter()
        .copied()
        .filter(|e| inserted.remove(e.id.as_str()))
        .collect();
    if !claim_only && !fresh.is_empty() {
        business_set_pg(conn, &fresh).await?;
    }
    if with_result && !fresh.is_empty() {
        let ids: Vec<&str> = fresh.iter().map(|e| e.id.as_str()).collect();
        let results: Vec<sqlx::types::Json<serde_json::Value>> = fresh
            .iter()
            .map(|e| sqlx::types::Json(handler_result(true, account_of(e))))
            .collect();
        sqlx::query(
            "UPDATE bench_raw_inbox i SET result = u.result \
               FROM unnest($2::text[], $3::jsonb[]) AS u(message_id, result) \
              WHERE i.consumer_type = $1 AND i.message_id = u.message_id",
        )
        .bind(consumer.as_str())
        .bind(&ids)
        .bind(&results)
        .execute(&mut *conn)
        .await?;
    }
    Ok(fresh.len())
}

/// `raw_batch_set` on SQLite, where a statement is an in-process call: the raw claim
/// and the business statements per message, in the batch's one transaction.
async fn raw_batch_lite(
    conn: &mut sqlx::SqliteConnection,
    consumer: &ConsumerType,
    envelopes: &[&Envelope],
    claim_only: bool,
    with_result: bool,
) -> Result<usize, sqlx::Error> {
    let mut fresh = 0;
    for envelope in envelopes {
        let claimed = sqlx::query(RAW_CLAIM)
            .bind(consumer.as_str())
            .bind(envelope.id.as_str())
            .bind(chrono::Utc::now())
            .execute(&mut *conn)
            .await?
            .rows_affected()
            == 1;
        if !claimed {
            continue;
        }
        fresh += 1;
        let account = account_of(envelope);
        if !claim_only {
            business_lite(conn, envelope, account).await?;
        }
        if with_result {
            sqlx::query(RAW_RESULT)
                .bind(consumer.as_str())
                .bind(envelope.id.as_str())
                .bind(sqlx::types::Json(handler_result(true, account)))
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(fresh)
}

/// On SQLite a statement is an in-process call: the same statements per message.
async fn business_set_lite(
    conn: &mut sqlx::SqliteConnection,
    envelopes: &[&Envelope],
) -> Result<(), sqlx::Error> {
    for envelope in envelopes {
        business_lite(conn, envelope, account_of(envelope)).await?;
    }
    Ok(())
}

/// The account a workload message deposits to (set by [`workload`]).
fn account_of(envelope: &Envelope) -> i64 {
    envelope.payload["account"].as_i64().unwrap_or_default()
}

backend_runner!(
    run_postgres,
    business_pg,
    business_set_pg,
    raw_batch_pg,
    PgStep,
    PostgresStore,
    sqlx::Postgres
);
backend_runner!(
    run_sqlite,
    business_lite,
    business_set_lite,
    raw_batch_lite,
    LiteStep,
    SqliteStore,
    sqlx::Sqlite
);

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
        let results = run_postgres(pool.clone(), guard.clone(), args).await?;
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
        run_sqlite(pool.clone(), guard, args).await
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
