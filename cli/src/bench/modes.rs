//! The modes of `sagabox bench`, written once for both databases: what a database brings
//! is [`BenchDb`] (the business statements and the hand-written inbox, in its dialect),
//! and [`run_modes`] runs every mode asked for on it.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;
use sagabox::step::{StepError, StepHandler, StepPool, StepPoolConfig};
use sagabox::store::InboxStore;
use sagabox::{ConsumerType, Envelope, InboxGuard, PostgresStore, SqliteStore};
use sqlx::{Database, Pool};

use super::{
    BenchArgs, BoxError, Mode, ModeRun, Prepared, account_of, drive, handler_result, rss_mb,
    workload,
};

const RAW_CLAIM: &str = "INSERT INTO bench_raw_inbox (consumer_type, message_id, processed_at) \
                         VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";
const RAW_RESULT: &str =
    "UPDATE bench_raw_inbox SET result = $3 WHERE consumer_type = $1 AND message_id = $2";
const BUSINESS_UPDATE: &str = "UPDATE bench_accounts SET balance = balance + 1 WHERE id = $1";
const OUTBOX_INSERT: &str = "INSERT INTO bench_outbox (message_id, payload) VALUES ($1, $2)";

/// A connection of store `S`'s database.
type Conn<S> = <<S as InboxStore>::Db as Database>::Connection;

/// What one database brings to the bench, in its dialect: the business statements every
/// mode runs and the hand-written inbox of the baselines.
pub(super) trait BenchDb: InboxStore + Clone {
    /// One message's business statements, in the caller's transaction.
    fn business(
        conn: &mut Conn<Self>,
        envelope: &Envelope,
        account: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// A batch's business statements, set-based where the database gains by it.
    fn business_set(
        conn: &mut Conn<Self>,
        envelopes: &[&Envelope],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The hand-written claim of one message: whether it was fresh.
    fn raw_claim(
        conn: &mut Conn<Self>,
        consumer: &ConsumerType,
        envelope: &Envelope,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// The hand-written record of one message's result.
    fn raw_result(
        conn: &mut Conn<Self>,
        consumer: &ConsumerType,
        envelope: &Envelope,
        account: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// `raw_batch_set`'s body: the batch claimed by hand, the fresh messages applied.
    /// Returns how many were fresh.
    fn raw_batch(
        conn: &mut Conn<Self>,
        consumer: &ConsumerType,
        envelopes: &[&Envelope],
        claim_only: bool,
        with_result: bool,
    ) -> impl Future<Output = Result<usize, sqlx::Error>> + Send;
}

/// `raw_sql`'s body: one message claimed by hand and, when fresh, applied and its result
/// recorded. Returns whether it was fresh.
async fn raw_one<S: BenchDb>(
    conn: &mut Conn<S>,
    consumer: &ConsumerType,
    envelope: &Envelope,
    account: i64,
    claim_only: bool,
    with_result: bool,
) -> Result<bool, sqlx::Error> {
    if !S::raw_claim(conn, consumer, envelope).await? {
        return Ok(false);
    }
    if !claim_only {
        S::business(conn, envelope, account).await?;
    }
    if with_result {
        S::raw_result(conn, consumer, envelope, account).await?;
    }
    Ok(true)
}

impl BenchDb for PostgresStore {
    async fn business(
        conn: &mut sqlx::PgConnection,
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

    async fn business_set(
        conn: &mut sqlx::PgConnection,
        envelopes: &[&Envelope],
    ) -> Result<(), sqlx::Error> {
        let accounts: Vec<i64> = envelopes.iter().map(|e| account_of(e)).collect();
        let ids: Vec<&str> = envelopes.iter().map(|e| e.id.as_str()).collect();
        let payloads: Vec<String> = envelopes.iter().map(|e| e.payload.to_string()).collect();
        // Rows locked in id order first: the UPDATE's join locks them in plan order, and
        // two batches locking shared rows in different orders deadlock.
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

    async fn raw_claim(
        conn: &mut sqlx::PgConnection,
        consumer: &ConsumerType,
        envelope: &Envelope,
    ) -> Result<bool, sqlx::Error> {
        let claimed = sqlx::query(RAW_CLAIM)
            .bind(consumer.as_str())
            .bind(envelope.id.as_str())
            .bind(chrono::Utc::now())
            .execute(&mut *conn)
            .await?;
        Ok(claimed.rows_affected() == 1)
    }

    async fn raw_result(
        conn: &mut sqlx::PgConnection,
        consumer: &ConsumerType,
        envelope: &Envelope,
        account: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(RAW_RESULT)
            .bind(consumer.as_str())
            .bind(envelope.id.as_str())
            .bind(sqlx::types::Json(handler_result(true, account)))
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// The hand-written batched inbox: the batch's ids claimed in one statement, the
    /// fresh ones applied set-based, their results (with `--with-result`) stored in one
    /// more.
    async fn raw_batch(
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
            Self::business_set(conn, &fresh).await?;
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
}

/// On SQLite a statement is an in-process call: the batches run the same statements per
/// message.
impl BenchDb for SqliteStore {
    async fn business(
        conn: &mut sqlx::SqliteConnection,
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

    async fn business_set(
        conn: &mut sqlx::SqliteConnection,
        envelopes: &[&Envelope],
    ) -> Result<(), sqlx::Error> {
        for envelope in envelopes {
            Self::business(conn, envelope, account_of(envelope)).await?;
        }
        Ok(())
    }

    async fn raw_claim(
        conn: &mut sqlx::SqliteConnection,
        consumer: &ConsumerType,
        envelope: &Envelope,
    ) -> Result<bool, sqlx::Error> {
        let claimed = sqlx::query(RAW_CLAIM)
            .bind(consumer.as_str())
            .bind(envelope.id.as_str())
            .bind(chrono::Utc::now())
            .execute(&mut *conn)
            .await?;
        Ok(claimed.rows_affected() == 1)
    }

    async fn raw_result(
        conn: &mut sqlx::SqliteConnection,
        consumer: &ConsumerType,
        envelope: &Envelope,
        account: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(RAW_RESULT)
            .bind(consumer.as_str())
            .bind(envelope.id.as_str())
            .bind(sqlx::types::Json(handler_result(true, account)))
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn raw_batch(
        conn: &mut sqlx::SqliteConnection,
        consumer: &ConsumerType,
        envelopes: &[&Envelope],
        claim_only: bool,
        with_result: bool,
    ) -> Result<usize, sqlx::Error> {
        let mut fresh = 0;
        for envelope in envelopes {
            let account = account_of(envelope);
            let applied =
                raw_one::<Self>(conn, consumer, envelope, account, claim_only, with_result).await?;
            fresh += usize::from(applied);
        }
        Ok(fresh)
    }
}

/// The `actor` mode's step: the business statements, the account read from the payload.
struct BenchStep<S> {
    claim_only: bool,
    with_result: bool,
    store: PhantomData<fn() -> S>,
}

impl<S: BenchDb> StepHandler<S::Db> for BenchStep<S> {
    async fn handle(
        &self,
        conn: &mut Conn<S>,
        envelope: &Envelope,
    ) -> Result<serde_json::Value, StepError> {
        let account = envelope.payload["account"]
            .as_i64()
            .ok_or_else(|| StepError::Permanent("payload has no integer account".into()))?;
        if !self.claim_only {
            S::business(conn, envelope, account)
                .await
                .map_err(|error| StepError::Retryable(error.to_string()))?;
        }
        Ok(handler_result(self.with_result, account))
    }
}

/// What one unit of work (a message, or a batch) needs, whatever its mode.
struct Unit<S: BenchDb> {
    mode: Mode,
    pool: Pool<S::Db>,
    guard: InboxGuard<S>,
    consumer: ConsumerType,
    steps: Option<Arc<StepPool>>,
    claim_only: bool,
    with_result: bool,
    /// Messages per unit: 1, or a batch.
    size: usize,
}

impl<S: BenchDb> Unit<S> {
    /// Runs unit `unit` of `messages`: how many messages it held and how many it applied.
    async fn run(
        &self,
        messages: &[(Envelope, i64)],
        unit: usize,
    ) -> Result<(usize, usize), BoxError> {
        let start = unit * self.size;
        let end = (start + self.size).min(messages.len());
        let (envelope, account) = &messages[start];
        let applied = match self.mode {
            Mode::RawSql => {
                let mut tx = self.pool.begin().await?;
                let fresh = raw_one::<S>(
                    &mut tx,
                    &self.consumer,
                    envelope,
                    *account,
                    self.claim_only,
                    self.with_result,
                )
                .await?;
                tx.commit().await?;
                usize::from(fresh)
            }
            Mode::NoInbox => {
                let mut tx = self.pool.begin().await?;
                if !self.claim_only {
                    S::business(&mut tx, envelope, *account).await?;
                }
                tx.commit().await?;
                1
            }
            Mode::Guard => self.guard_one(envelope, *account).await?,
            Mode::Actor => {
                let steps = self.steps.as_ref().ok_or("actor mode without a pool")?;
                let reply = steps
                    .deliver(envelope.clone(), Duration::from_secs(60))
                    .await?;
                usize::from(!reply.duplicate)
            }
            Mode::SetNoInbox => {
                let envelopes = by_account(&messages[start..end]);
                let mut tx = self.pool.begin().await?;
                if !self.claim_only {
                    S::business_set(&mut tx, &envelopes).await?;
                }
                tx.commit().await?;
                envelopes.len()
            }
            Mode::RawBatchSet => {
                let envelopes = by_account(&messages[start..end]);
                let mut tx = self.pool.begin().await?;
                let fresh = S::raw_batch(
                    &mut tx,
                    &self.consumer,
                    &envelopes,
                    self.claim_only,
                    self.with_result,
                )
                .await?;
                tx.commit().await?;
                fresh
            }
            Mode::BatchedSet => self.batched_set(&messages[start..end]).await?,
            Mode::Batched => self.batched(&messages[start..end]).await?,
        };
        Ok((end - start, applied))
    }

    /// `guard`: one message through [`InboxGuard::process`].
    async fn guard_one(&self, envelope: &Envelope, account: i64) -> Result<usize, BoxError> {
        let (claim_only, with_result) = (self.claim_only, self.with_result);
        let outcome = self
            .guard
            .process(&self.consumer, envelope, async |conn, envelope| {
                if !claim_only {
                    S::business(conn, envelope, account).await?;
                }
                Ok::<_, sqlx::Error>(handler_result(with_result, account))
            })
            .await?;
        Ok(usize::from(!outcome.is_duplicate()))
    }

    /// `batched_set`: a batch through [`InboxGuard::process_batch_set`].
    async fn batched_set(&self, messages: &[(Envelope, i64)]) -> Result<usize, BoxError> {
        let (claim_only, with_result) = (self.claim_only, self.with_result);
        let envelopes: Vec<Envelope> = by_account(messages).into_iter().cloned().collect();
        let outcomes = self
            .guard
            .process_batch_set(&self.consumer, &envelopes, async |conn, fresh| {
                if !claim_only {
                    S::business_set(conn, fresh).await?;
                }
                Ok::<_, sqlx::Error>(
                    fresh
                        .iter()
                        .map(|envelope| handler_result(with_result, account_of(envelope)))
                        .collect(),
                )
            })
            .await?;
        let mut applied = 0;
        for outcome in outcomes {
            applied += usize::from(!outcome?.is_duplicate());
        }
        Ok(applied)
    }

    /// `batched`: a batch through [`InboxGuard::process_batch`], the business statements
    /// per message.
    async fn batched(&self, messages: &[(Envelope, i64)]) -> Result<usize, BoxError> {
        let (claim_only, with_result) = (self.claim_only, self.with_result);
        let envelopes: Vec<Envelope> = by_account(messages).into_iter().cloned().collect();
        let outcomes = self
            .guard
            .process_batch(&self.consumer, &envelopes, async |conn, envelope| {
                let account = account_of(envelope);
                if !claim_only {
                    S::business(conn, envelope, account).await?;
                }
                Ok::<_, sqlx::Error>(handler_result(with_result, account))
            })
            .await?;
        let mut applied = 0;
        for outcome in outcomes {
            applied += usize::from(!outcome?.is_duplicate());
        }
        Ok(applied)
    }
}

/// A batch's envelopes ordered by account: handlers take their row locks in input order,
/// and two batches locking shared rows in opposite orders deadlock (PostgreSQL aborts one).
fn by_account(messages: &[(Envelope, i64)]) -> Vec<&Envelope> {
    let mut chunk: Vec<&(Envelope, i64)> = messages.iter().collect();
    chunk.sort_by_key(|(_, account)| *account);
    chunk.into_iter().map(|(envelope, _)| envelope).collect()
}

/// Runs every mode `args` asks for on `pool`'s database: each set up and warmed up, then
/// the measured messages in rounds.
pub(super) async fn run_modes<S: BenchDb>(
    pool: Pool<S::Db>,
    guard: InboxGuard<S>,
    args: &BenchArgs,
) -> Result<Vec<ModeRun>, BoxError> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    // Every mode gets the same messages; its own consumer type (guard, actor, batched) or
    // table (raw_sql) keeps one mode's claims from meeting another's.
    let messages = workload(args, &mut rng);
    let warmup = workload(
        &BenchArgs {
            messages: (args.messages / 10).max(1),
            ..args.clone()
        },
        &mut rng,
    );
    let mut prepared = Vec::new();
    for &mode in Mode::all()
        .iter()
        .filter(|m| args.modes.is_empty() || args.modes.contains(m))
    {
        let unit = Arc::new(prepare::<S>(mode, &pool, &guard, args).await?);
        let warm_op = {
            let (unit, warmup) = (unit.clone(), warmup.clone());
            move |n| {
                let (unit, warmup) = (unit.clone(), warmup.clone());
                async move { unit.run(&warmup, n).await }
            }
        };
        drive(warmup.len().div_ceil(unit.size), args.concurrency, warm_op).await?;
        prepared.push(Prepared {
            mode,
            unit,
            rss_after_warmup: rss_mb(),
            latencies: Vec::with_capacity(messages.len()),
            applied: 0,
            elapsed: Duration::ZERO,
        });
    }
    measure_in_rounds(&mut prepared, &messages, args).await?;
    let mut results = Vec::new();
    for run in prepared {
        let rss_end = rss_mb();
        let steps = Arc::into_inner(run.unit).and_then(|unit| unit.steps);
        if let Some(steps) = steps.and_then(Arc::into_inner) {
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

/// Mode `mode` set up: its consumer type, and for `actor` its pool of steps.
async fn prepare<S: BenchDb>(
    mode: Mode,
    pool: &Pool<S::Db>,
    guard: &InboxGuard<S>,
    args: &BenchArgs,
) -> Result<Unit<S>, BoxError> {
    let consumer = ConsumerType::new(format!("bench-{}", mode.name()))?;
    let steps = if mode == Mode::Actor {
        let step = BenchStep::<S> {
            claim_only: args.claim_only,
            with_result: args.with_result,
            store: PhantomData,
        };
        let config = StepPoolConfig {
            workers: args.concurrency,
        };
        Some(Arc::new(
            StepPool::spawn(guard.clone(), consumer.clone(), step, config).await?,
        ))
    } else {
        None
    };
    let batched = matches!(
        mode,
        Mode::Batched | Mode::RawBatchSet | Mode::BatchedSet | Mode::SetNoInbox
    );
    Ok(Unit {
        mode,
        pool: pool.clone(),
        guard: guard.clone(),
        consumer,
        steps,
        claim_only: args.claim_only,
        with_result: args.with_result,
        size: if batched { args.batch.max(1) } else { 1 },
    })
}

/// The measured messages in rounds, every mode taking its turn in each round: a
/// checkpoint or an autovacuum run then slows every mode alike instead of whichever
/// happened to be running, which would skew that mode's ratio. Round boundaries fall on
/// batches.
async fn measure_in_rounds<S: BenchDb>(
    prepared: &mut [Prepared<Unit<S>>],
    messages: &Arc<Vec<(Envelope, i64)>>,
    args: &BenchArgs,
) -> Result<(), BoxError> {
    let rounds = args.rounds.max(1);
    let step = args.batch.max(1);
    let chunk = (messages.len().div_ceil(rounds).div_ceil(step) * step).max(1);
    for first in (0..messages.len()).step_by(chunk) {
        let len = chunk.min(messages.len() - first);
        for run in prepared.iter_mut() {
            // The mode's units are 1 or `batch` messages, and rounds start on a multiple
            // of `batch`.
            let first_unit = first / run.unit.size;
            let measured_op = {
                let (unit, messages) = (run.unit.clone(), messages.clone());
                move |n| {
                    let (unit, messages) = (unit.clone(), messages.clone());
                    async move { unit.run(&messages, first_unit + n).await }
                }
            };
            let (latencies, applied, elapsed) =
                drive(len.div_ceil(run.unit.size), args.concurrency, measured_op).await?;
            run.latencies.extend(latencies);
            run.applied += applied;
            run.elapsed += elapsed;
        }
    }
    Ok(())
}
