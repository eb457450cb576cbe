//! Table scale and pruning on PostgreSQL, for `sagabox bench --prefill N --prune-rows R`.
//!
//! - `--prefill N`: fills the inbox with `N` rows spread evenly over the 12 months up to
//!   the current one (so the month claims write to holds `N / 12` of them), then runs the
//!   `guard` workload again with fresh messages and compares it with the same run's
//!   `guard` figure on the empty inbox.
//! - `--prune-rows R`: fills four old months with `R` rows each, then retires a month of
//!   `R` rows both ways — `DELETE` of its rows (+ the `VACUUM` that returns the space)
//!   against [`InboxStore::drop_partition`] (detach concurrently + drop, what the pruner
//!   does) — first on an idle database (time and WAL), then while `--concurrency` tasks
//!   keep claiming, comparing the p99 of the claims that overlapped each operation with
//!   the p99 of those that did not.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sagabox::{ConsumerType, Envelope, InboxGuard, InboxStore, MessageId, Month, PostgresStore};
use serde::Serialize;
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use super::modes::BenchDb;
use super::{BenchArgs, BoxError, ModeRun, drive, percentile, workload};

/// `--prefill` figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ScaleReport {
    rows: u64,
    months: u32,
    fill_seconds: f64,
    rows_in_claimed_month: u64,
    guard_empty_msgs_per_sec: f64,
    guard_prefilled_msgs_per_sec: f64,
    guard_prefilled_p50_us: u64,
    guard_prefilled_p99_us: u64,
    ratio_to_empty: f64,
}

/// One way of retiring a month of rows.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Retire {
    seconds: f64,
    wal_mb: f64,
}

/// `--prune-rows` figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PruneReport {
    rows: u64,
    /// On an idle database.
    delete: Retire,
    vacuum: Retire,
    drop: Retire,
    delete_over_drop: f64,
    delete_and_vacuum_over_drop: f64,
    /// Under a concurrent claim load.
    loaded_delete_seconds: f64,
    loaded_drop_seconds: f64,
    claims_outside: usize,
    claims_during_delete: usize,
    claims_during_drop: usize,
    p99_us_outside: u64,
    p99_us_during_delete: u64,
    p99_us_during_drop: u64,
}

const PREFILL_MONTHS: u32 = 12;

async fn wal_lsn(pool: &PgPool) -> Result<String, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await
}

async fn wal_mb_since(pool: &PgPool, since: &str) -> Result<f64, sqlx::Error> {
    let bytes: f64 = sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
    )
    .bind(since)
    .fetch_one(pool)
    .await?;
    Ok(bytes / (1024.0 * 1024.0))
}

/// Fills `month`'s partition with `rows` rows for `consumer`, ids ascending like UUIDv7
/// ids of that month would be.
async fn fill_month(
    pool: &PgPool,
    consumer: &str,
    month: Month,
    rows: u64,
) -> Result<(), BoxError> {
    let table = format!("sagabox_inbox_{}", month.suffix());
    // `table` is built from a validated Month; the rest is bound.
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (consumer_type, message_id, bucket, processed_at, result) \
         SELECT $1, $2 || lpad(g::text, 10, '0'), $3, $3::timestamptz + (g % 2419200) * interval '1 second', \
                '{{\"prefilled\": true}}'::jsonb \
           FROM generate_series(1, $4::bigint) g"
    )))
    .bind(consumer)
    .bind(format!("prefill-{}-", month.suffix()))
    .bind(month.first_day())
    .bind(i64::try_from(rows)?)
    .execute(pool)
    .await?;
    Ok(())
}

fn months_back(current: Month, back: u32) -> Result<Month, BoxError> {
    let index = current.year() * 12 + i32::try_from(current.month())? - 1 - i32::try_from(back)?;
    Ok(Month::new(
        index.div_euclid(12),
        u32::try_from(index.rem_euclid(12) + 1)?,
    )?)
}

/// The `guard` workload on fresh messages, after a 10 % warm-up: the figures of the run.
async fn guard_run(
    guard: &InboxGuard<PostgresStore>,
    args: &BenchArgs,
    seed: u64,
) -> Result<ModeRun, BoxError> {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let consumer = ConsumerType::new("bench-guard")?;
    let messages = workload(args, &mut rng);
    let warmup = workload(
        &BenchArgs {
            messages: (args.messages / 10).max(1),
            ..args.clone()
        },
        &mut rng,
    );
    let op = |messages: Arc<Vec<(Envelope, i64)>>| {
        let (guard, consumer, claim_only) = (guard.clone(), consumer.clone(), args.claim_only);
        move |i: usize| {
            let (guard, consumer, messages) = (guard.clone(), consumer.clone(), messages.clone());
            async move {
                let (envelope, account) = &messages[i];
                let account = *account;
                let outcome = guard
                    .process(&consumer, envelope, async |conn, envelope| {
                        if !claim_only {
                            PostgresStore::business(conn, envelope, account).await?;
                        }
                        Ok::<_, sqlx::Error>(serde_json::Value::Null)
                    })
                    .await?;
                Ok::<_, BoxError>((1, usize::from(!outcome.is_duplicate())))
            }
        }
    };
    drive(warmup.len(), args.concurrency, op(warmup.clone())).await?;
    let rss_after_warmup = super::rss_mb();
    let (latencies, applied, elapsed) =
        drive(messages.len(), args.concurrency, op(messages.clone())).await?;
    Ok(ModeRun {
        mode: super::Mode::Guard,
        latencies,
        applied,
        elapsed,
        rss_after_warmup,
        rss_end: super::rss_mb(),
    })
}

/// `--prefill`: fill, then the guard workload again.
pub(super) async fn prefill(
    pool: &PgPool,
    guard: &InboxGuard<PostgresStore>,
    args: &BenchArgs,
    guard_empty_msgs_per_sec: f64,
) -> Result<ScaleReport, BoxError> {
    let current = Month::of(guard.now())?;
    let first = months_back(current, PREFILL_MONTHS - 1)?;
    guard.create_partitions(first, current).await?;
    let per_month = args.prefill / u64::from(PREFILL_MONTHS);
    let started = Instant::now();
    let mut rows_in_claimed_month = 0;
    for back in (0..PREFILL_MONTHS).rev() {
        let month = months_back(current, back)?;
        // The remainder goes to the current month, the one claims write to.
        let rows = if back == 0 {
            args.prefill - per_month * u64::from(PREFILL_MONTHS - 1)
        } else {
            per_month
        };
        fill_month(pool, "bench-guard", month, rows).await?;
        if back == 0 {
            rows_in_claimed_month = rows;
        }
        eprintln!("prefill: {month} filled with {rows} rows");
    }
    sqlx::raw_sql("VACUUM ANALYZE sagabox_inbox")
        .execute(pool)
        .await?;
    let fill_seconds = started.elapsed().as_secs_f64();
    let mut run = guard_run(guard, args, args.seed.wrapping_add(1)).await?;
    run.latencies.sort_unstable();
    let rate = run.latencies.len() as f64 / run.elapsed.as_secs_f64();
    Ok(ScaleReport {
        rows: args.prefill,
        months: PREFILL_MONTHS,
        fill_seconds,
        rows_in_claimed_month,
        guard_empty_msgs_per_sec,
        guard_prefilled_msgs_per_sec: rate,
        guard_prefilled_p50_us: percentile(&run.latencies, 0.50),
        guard_prefilled_p99_us: percentile(&run.latencies, 0.99),
        ratio_to_empty: rate / guard_empty_msgs_per_sec,
    })
}

/// One load task's claims: `(start since t0, latency)` each.
type LoadTask = tokio::task::JoinHandle<Result<Vec<(Duration, Duration)>, BoxError>>;

/// A claim load running until stopped: `(start since t0, latency)` per claim.
fn claim_load(
    guard: &InboxGuard<PostgresStore>,
    concurrency: usize,
    t0: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<LoadTask> {
    (0..concurrency.max(1))
        .map(|task| {
            let (guard, stop) = (guard.clone(), stop.clone());
            tokio::spawn(async move {
                let consumer = ConsumerType::new("bench-prune")?;
                let mut samples = Vec::new();
                let mut n: i64 = 0;
                while !stop.load(Ordering::Relaxed) {
                    let envelope = Envelope::new(
                        MessageId::new_v7(),
                        "deposit",
                        serde_json::json!({"task": task, "n": n}),
                    )?;
                    let account = (n * 7 + task as i64) % super::ACCOUNTS;
                    n += 1;
                    let start = Instant::now();
                    guard
                        .process(&consumer, &envelope, async |conn, envelope| {
                            PostgresStore::business(conn, envelope, account).await?;
                            Ok::<_, sqlx::Error>(serde_json::Value::Null)
                        })
                        .await?;
                    samples.push((start - t0, start.elapsed()));
                }
                Ok(samples)
            })
        })
        .collect()
}

/// Runs `op`, measuring its time and the WAL written meanwhile.
async fn timed<F: Future<Output = Result<(), BoxError>>>(
    pool: &PgPool,
    op: F,
) -> Result<Retire, BoxError> {
    let lsn = wal_lsn(pool).await?;
    let began = Instant::now();
    op.await?;
    let seconds = began.elapsed().as_secs_f64();
    let wal_mb = wal_mb_since(pool, &lsn).await?;
    Ok(Retire { seconds, wal_mb })
}

/// `--prune-rows`: retire a month by `DELETE` and by dropping its partition, idle and
/// under load.
pub(super) async fn prune(
    options: &PgConnectOptions,
    guard: &InboxGuard<PostgresStore>,
    args: &BenchArgs,
) -> Result<PruneReport, BoxError> {
    let rows = args.prune_rows;
    // Its own connections: the claim load has the bench pool's.
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.clone())
        .await?;
    let pruner = PostgresStore::new(admin.clone());
    let current = Month::of(guard.now())?;
    // Older than any `--prefill` month; the oldest are retired first, because a dropped
    // month marks every month up to it as pruned.
    let [idle_delete, idle_drop, load_delete, load_drop] = [
        months_back(current, PREFILL_MONTHS + 4)?,
        months_back(current, PREFILL_MONTHS + 3)?,
        months_back(current, PREFILL_MONTHS + 2)?,
        months_back(current, PREFILL_MONTHS + 1)?,
    ];
    guard.create_partitions(idle_delete, load_drop).await?;
    for month in [idle_delete, idle_drop, load_delete, load_drop] {
        fill_month(&admin, "bench-prune", month, rows).await?;
        eprintln!("prune: {month} filled with {rows} rows");
    }
    // One statement each: VACUUM refuses to run in the implicit transaction of a
    // multi-statement query.
    sqlx::raw_sql("VACUUM ANALYZE sagabox_inbox")
        .execute(&admin)
        .await?;
    sqlx::raw_sql("CHECKPOINT").execute(&admin).await?;

    let delete = |month: Month| {
        let admin = admin.clone();
        async move {
            sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM sagabox_inbox_{}",
                month.suffix()
            )))
            .execute(&admin)
            .await?;
            Ok::<_, BoxError>(())
        }
    };
    let drop_month = |month: Month| {
        let pruner = pruner.clone();
        async move {
            pruner.drop_partition(month).await?;
            Ok::<_, BoxError>(())
        }
    };

    // Idle: time and WAL.
    let delete_idle = timed(&admin, delete(idle_delete)).await?;
    let vacuum_idle = timed(&admin, async {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "VACUUM sagabox_inbox_{}",
            idle_delete.suffix()
        )))
        .execute(&admin)
        .await?;
        Ok(())
    })
    .await?;
    let drop_idle = timed(&admin, drop_month(idle_drop)).await?;
    sqlx::raw_sql("CHECKPOINT").execute(&admin).await?;

    // Under load: which claims overlapped each operation.
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let tasks = claim_load(guard, args.concurrency, t0, stop.clone());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let delete_from = t0.elapsed();
    let began = Instant::now();
    delete(load_delete).await?;
    let delete_window = (delete_from, delete_from + began.elapsed());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let drop_from = t0.elapsed();
    let began = Instant::now();
    drop_month(load_drop).await?;
    let drop_window = (drop_from, drop_from + began.elapsed());
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await??);
    }
    let [outside, during_delete, during_drop] =
        split_by_window(samples, delete_window, drop_window);
    admin.close().await;
    Ok(PruneReport {
        rows,
        delete_over_drop: delete_idle.seconds / drop_idle.seconds,
        delete_and_vacuum_over_drop: (delete_idle.seconds + vacuum_idle.seconds)
            / drop_idle.seconds,
        delete: delete_idle,
        vacuum: vacuum_idle,
        drop: drop_idle,
        loaded_delete_seconds: (delete_window.1 - delete_window.0).as_secs_f64(),
        loaded_drop_seconds: (drop_window.1 - drop_window.0).as_secs_f64(),
        claims_outside: outside.len(),
        claims_during_delete: during_delete.len(),
        claims_during_drop: during_drop.len(),
        p99_us_outside: percentile(&outside, 0.99),
        p99_us_during_delete: percentile(&during_delete, 0.99),
        p99_us_during_drop: percentile(&during_drop, 0.99),
    })
}

/// The latencies of claim `samples` (start, latency) that overlapped no window, the
/// delete's window and the drop's, each sorted.
fn split_by_window(
    samples: Vec<(Duration, Duration)>,
    delete_window: (Duration, Duration),
    drop_window: (Duration, Duration),
) -> [Vec<Duration>; 3] {
    let overlaps = |(start, latency): (Duration, Duration), (from, to): (Duration, Duration)| {
        start <= to && start + latency >= from
    };
    let (mut outside, mut during_delete, mut during_drop) = (Vec::new(), Vec::new(), Vec::new());
    for sample in samples {
        if overlaps(sample, delete_window) {
            during_delete.push(sample.1);
        } else if overlaps(sample, drop_window) {
            during_drop.push(sample.1);
        } else {
            outside.push(sample.1);
        }
    }
    for list in [&mut outside, &mut during_delete, &mut during_drop] {
        list.sort_unstable();
    }
    [outside, during_delete, during_drop]
}

impl std::fmt::Display for ScaleReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "prefill: {} rows over {} months ({} in the month claims write to), filled in {:.0} s",
            self.rows, self.months, self.rows_in_claimed_month, self.fill_seconds
        )?;
        writeln!(
            f,
            "  guard empty {:.0} msgs/s, prefilled {:.0} msgs/s (p50 {} µs, p99 {} µs): {:.2} × empty",
            self.guard_empty_msgs_per_sec,
            self.guard_prefilled_msgs_per_sec,
            self.guard_prefilled_p50_us,
            self.guard_prefilled_p99_us,
            self.ratio_to_empty
        )
    }
}

impl std::fmt::Display for PruneReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "pruning a month of {} rows, idle:", self.rows)?;
        for (what, retire) in [
            ("DELETE", &self.delete),
            ("VACUUM", &self.vacuum),
            ("drop partition", &self.drop),
        ] {
            writeln!(
                f,
                "  {what:<15} {:>9.3} s {:>9.1} MiB WAL",
                retire.seconds, retire.wal_mb
            )?;
        }
        writeln!(
            f,
            "  DELETE ÷ drop {:.0} ×, DELETE + VACUUM ÷ drop {:.0} ×",
            self.delete_over_drop, self.delete_and_vacuum_over_drop
        )?;
        writeln!(
            f,
            "under load: DELETE {:.3} s, drop {:.3} s; claim p99 outside {} µs ({} claims), \
             during DELETE {} µs ({}), during drop {} µs ({})",
            self.loaded_delete_seconds,
            self.loaded_drop_seconds,
            self.p99_us_outside,
            self.claims_outside,
            self.p99_us_during_delete,
            self.claims_during_delete,
            self.p99_us_during_drop,
            self.claims_during_drop
        )
    }
}
