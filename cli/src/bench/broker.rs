//! `sagabox bench-broker`: the broker path against a hand-written consumer. Messages go
//! through RabbitMQ or NATS JetStream (`--transport`'s scheme) into PostgreSQL, consumed on
//! one broker and one database in one run:
//!
//! - `handwritten`: a consumer written against the broker's client alone (`lapin`,
//!   `async-nats`) running the SQL a team writes by hand — `INSERT … ON CONFLICT DO
//!   NOTHING` into an inbox table, the business statements if the insert was fresh,
//!   `COMMIT`, then the ack — on `--workers` tasks under the same prefetch;
//! - `consumer`: sagabox's consumer for the broker with [`InboxGuard::process`] called in
//!   each delivery's task, no step pool: what the guard and the consumer cost without
//!   the actor hop;
//! - `sagabox`: the [`Participant`] runtime with a step handler running the same business
//!   statements, `--workers` workers.
//!
//! Each mode gets its own queue or stream (declared the same way, by sagabox: a quorum
//! queue; a work-queue stream with its durable pull consumer) and the same messages:
//! `--messages` published before its consumer starts (the backlog, drained as fast as the
//! consumer goes: messages/s), then `--paced` more published at `--rate` per second while
//! it runs (latency from publish to the business write, read from the database: p50,
//! p99). A share `--duplicate-rate` of each phase repeats an earlier message id; on
//! JetStream the repeats are published without `Nats-Msg-Id`, so that the server's
//! duplicate window lets them through to the consumer as a redelivery past that window
//! would. Afterwards every message id must have been applied exactly once. The bench
//! process's own CPU time per backlog message is reported beside (Linux `/proc`).

mod amqp;
mod handwritten;
mod nats;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sagabox::delivery::{DeliveryHandler, Disposition};
use sagabox::step::{StepError, StepHandler};
use sagabox::transport::Transport;
use sagabox::{
    ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, Participant, PostgresStore,
};
use serde::Serialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio::sync::Semaphore;

use super::BoxError;

/// What to measure: `sagabox bench-broker`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BrokerBenchArgs {
    /// postgres://user@host:port/db (a scratch schema in it is used and removed); the
    /// broker bench runs on PostgreSQL only.
    #[arg(long, env = "SAGABOX_DATABASE_URL", hide_env_values = true)]
    pub(crate) database_url: String,
    /// The broker: amqp://user:password@host:port/vhost (RabbitMQ) or nats://host:port
    /// (NATS JetStream)
    #[arg(long = "transport", value_name = "URL", value_parser = broker_url)]
    pub(crate) broker_url: String,
    /// Messages published before each consumer starts (its backlog: messages/s).
    #[arg(long, default_value_t = 20_000, value_parser = sagabox_cli::args::at_least_one)]
    pub(crate) messages: usize,
    /// Messages published at --rate while each consumer runs (latency: p50, p99).
    #[arg(long, default_value_t = 2_000, value_parser = sagabox_cli::args::at_least_one)]
    pub(crate) paced: usize,
    /// Messages per second in the paced phase.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) rate: u32,
    /// Share of messages that repeat an earlier id, 0..=1.
    #[arg(long, default_value_t = 0.2, value_parser = sagabox_cli::args::rate)]
    pub(crate) duplicate_rate: f64,
    /// Unacknowledged messages per consumer (AMQP prefetch, JetStream max_ack_pending),
    /// 1 to 65535.
    #[arg(long, default_value_t = 32, value_parser = sagabox_cli::args::prefetch)]
    pub(crate) prefetch: u16,
    /// Concurrent handlers (and database connections) per consumer, 1 to 10000.
    #[arg(long, default_value_t = 8, value_parser = sagabox_cli::args::parallel)]
    pub(crate) workers: usize,
    /// Seed of the workload's random choices.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Parses `--transport`: RabbitMQ or NATS JetStream.
pub(super) fn broker_url(url: &str) -> Result<String, String> {
    if ["amqp://", "amqps://", "nats://"]
        .iter()
        .any(|scheme| url.starts_with(scheme))
    {
        Ok(url.to_owned())
    } else {
        Err(
            "the broker bench speaks RabbitMQ (amqp://user:password@host:port/vhost) or NATS \
             JetStream (nats://host:port)"
                .into(),
        )
    }
}

/// One consumer's figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BrokerModeReport {
    mode: &'static str,
    /// Deliveries in the backlog (duplicates included).
    backlog: usize,
    /// Backlog deliveries acknowledged per second.
    msgs_per_sec: f64,
    /// Against the hand-written consumer's messages/s.
    vs_handwritten: f64,
    /// This process's CPU time (user + system) per backlog delivery, in µs.
    client_cpu_us: f64,
    /// Publish to business write, paced phase, in µs.
    p50_us: u64,
    p99_us: u64,
    /// Distinct messages applied, and whether each was applied exactly once.
    applied: i64,
    exactly_once: bool,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BrokerBenchReport {
    database: String,
    broker: String,
    prefetch: u16,
    workers: usize,
    duplicate_rate: f64,
    paced_rate: u32,
    modes: Vec<BrokerModeReport>,
}

impl std::fmt::Display for BrokerBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "database {}  broker {}  prefetch {}  workers {}  duplicate-rate {}  paced {}/s",
            self.database,
            self.broker,
            self.prefetch,
            self.workers,
            self.duplicate_rate,
            self.paced_rate
        )?;
        writeln!(
            f,
            "{:<12}{:>9}{:>11}{:>8}{:>12}{:>10}{:>10}{:>9}  exactly once",
            "mode", "backlog", "msgs/s", "× hand", "cpu µs/msg", "p50 µs", "p99 µs", "applied"
        )?;
        for mode in &self.modes {
            writeln!(
                f,
                "{:<12}{:>9}{:>11.0}{:>8.2}{:>12.0}{:>10}{:>10}{:>9}  {}",
                mode.mode,
                mode.backlog,
                mode.msgs_per_sec,
                mode.vs_handwritten,
                mode.client_cpu_us,
                mode.p50_us,
                mode.p99_us,
                mode.applied,
                if mode.exactly_once { "yes" } else { "NO" }
            )?;
        }
        Ok(())
    }
}

const SETUP: &str = "
CREATE TABLE bench_accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL);
INSERT INTO bench_accounts SELECT g, 0 FROM generate_series(0, 999) g;
CREATE TABLE bench_effects (mode TEXT NOT NULL, message_id TEXT NOT NULL,
    sent_at TIMESTAMPTZ NOT NULL, paced BOOLEAN NOT NULL,
    written_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp());
CREATE TABLE bench_raw_inbox (message_id TEXT PRIMARY KEY, processed_at TIMESTAMPTZ NOT NULL);
";
const ACCOUNTS: i64 = 1000;
/// The consumers, in the order they run: the mode each writes its effects as, and its
/// consumer type (which names its queue or stream).
const MODES: [(&str, &str); 3] = [
    ("handwritten", "bench-handwritten"),
    ("consumer", "bench-consumer"),
    ("sagabox", "bench-sagabox"),
];
const BUSINESS_UPDATE: &str = "UPDATE bench_accounts SET balance = balance + 1 WHERE id = $1";
const EFFECT_INSERT: &str =
    "INSERT INTO bench_effects (mode, message_id, sent_at, paced) VALUES ($1, $2, $3, $4)";
const RAW_CLAIM: &str = "INSERT INTO bench_raw_inbox (message_id, processed_at) \
                         VALUES ($1, now()) ON CONFLICT DO NOTHING";

/// A message of the workload: its id and the account it credits.
type Message = (MessageId, i64);

/// What a message carries for the business statements.
struct Fields {
    account: i64,
    sent_at: chrono::DateTime<chrono::Utc>,
    paced: bool,
}

fn fields(payload: &serde_json::Value) -> Option<Fields> {
    Some(Fields {
        account: payload["account"].as_i64()?,
        sent_at: chrono::DateTime::from_timestamp_micros(payload["sent_us"].as_i64()?)?,
        paced: payload["paced"].as_bool()?,
    })
}

/// The business statements both consumers run, in the claim's transaction.
async fn business(
    conn: &mut PgConnection,
    mode: &str,
    message_id: &str,
    fields: &Fields,
) -> Result<(), sqlx::Error> {
    sqlx::query(BUSINESS_UPDATE)
        .bind(fields.account)
        .execute(&mut *conn)
        .await?;
    sqlx::query(EFFECT_INSERT)
        .bind(mode)
        .bind(message_id)
        .bind(fields.sent_at)
        .bind(fields.paced)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The business statements as a step: what the `consumer` and `sagabox` modes run
/// behind the inbox, writing their effects as the mode it names.
struct Deposit(&'static str);

impl Deposit {
    async fn apply(
        &self,
        conn: &mut PgConnection,
        envelope: &Envelope,
    ) -> Result<serde_json::Value, StepError> {
        let fields = fields(&envelope.payload)
            .ok_or_else(|| StepError::Permanent("payload lacks account, sent_us, paced".into()))?;
        business(conn, self.0, envelope.id.as_str(), &fields)
            .await
            .map_err(|error| StepError::Retryable(error.to_string()))?;
        Ok(serde_json::Value::Null)
    }
}

impl StepHandler<sqlx::Postgres> for Deposit {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        envelope: &Envelope,
    ) -> Result<serde_json::Value, StepError> {
        self.apply(conn, envelope).await
    }
}

/// Message ids of one phase: fresh UUIDv7 ids, a share repeating an earlier one.
fn ids(count: usize, duplicate_rate: f64, rng: &mut StdRng) -> Vec<Message> {
    let mut ids: Vec<Message> = Vec::with_capacity(count);
    for i in 0..count {
        if i > 0 && rng.random_bool(duplicate_rate) {
            let earlier = ids[rng.random_range(0..i)].clone();
            ids.push(earlier);
        } else {
            ids.push((MessageId::new_v7(), rng.random_range(0..ACCOUNTS)));
        }
    }
    ids
}

/// The envelope a message of the workload travels in.
fn envelope((id, account): &Message, paced: bool) -> Result<Envelope, BoxError> {
    let sent_us = chrono::Utc::now().timestamp_micros();
    let payload = serde_json::json!({"account": account, "sent_us": sent_us, "paced": paced});
    Ok(Envelope::new(id.clone(), "deposit", payload)?)
}

/// A broker's side of the bench: publishing a message to one mode's queue or stream.
trait Publish {
    /// Publishes `message` to the queue or stream of `MODES[mode]`.
    async fn publish(&self, mode: usize, message: &Message, paced: bool) -> Result<(), BoxError>;
}

/// A consumer running, and how many deliveries it acknowledged.
trait Running {
    fn acked(&self) -> u64;

    /// Why the consumer stopped on its own, if it did.
    async fn failure(&mut self) -> Option<BoxError> {
        None
    }
}

/// Waits until `running` acknowledged `count` deliveries (a consumer that stopped, or a
/// minute without progress, is an error).
async fn until_acked(running: &mut impl Running, count: u64) -> Result<(), BoxError> {
    let mut last = (running.acked(), Instant::now());
    loop {
        let acked = running.acked();
        if acked >= count {
            return Ok(());
        }
        if let Some(failure) = running.failure().await {
            return Err(
                format!("the consumer stopped ({acked} of {count} acked): {failure}").into(),
            );
        }
        if acked > last.0 {
            last = (acked, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(60) {
            return Err(
                format!("no delivery acknowledged for a minute ({acked} of {count})").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The `consumer` mode's handler: sagabox's guard called in the delivery's task, at most
/// `--workers` at once.
#[derive(Clone)]
struct Guarded {
    guard: InboxGuard<PostgresStore>,
    consumer_type: ConsumerType,
    workers: Arc<Semaphore>,
}

impl Guarded {
    fn new(store: PostgresStore, workers: usize) -> Result<Self, BoxError> {
        Ok(Self {
            guard: InboxGuard::new(store, InboxConfig::default())?,
            consumer_type: ConsumerType::new(MODES[1].1)?,
            workers: Arc::new(Semaphore::new(workers)),
        })
    }
}

impl DeliveryHandler for Guarded {
    async fn handle(&self, envelope: Envelope) -> Disposition {
        let Ok(_permit) = self.workers.acquire().await else {
            return Disposition::Retry("the bench is stopping".into());
        };
        let processed = self
            .guard
            .process(&self.consumer_type, &envelope, async |conn, envelope| {
                Deposit(MODES[1].0).apply(conn, envelope).await
            })
            .await;
        match processed {
            Ok(_) => Disposition::Done { reply: None },
            Err(error) => Disposition::Retry(error.to_string()),
        }
    }
}

/// The `sagabox` mode's participant.
struct Runtime {
    handle: sagabox::participant::ParticipantHandle,
}

impl Running for Runtime {
    fn acked(&self) -> u64 {
        self.handle
            .report()
            .step(MODES[2].1)
            .map_or(0, |step| step.acked)
    }
}

/// Measures the `sagabox` mode: the participant runtime on `transport`.
async fn participant_drain(
    target: &impl Publish,
    transport: Transport,
    store: PostgresStore,
    workload: &Workload<'_>,
    workers: usize,
) -> Result<Drain, BoxError> {
    let participant = Participant::new(store, transport)
        .workers(workers)
        .skip_migrations()
        .step(MODES[2].1, Deposit(MODES[2].0));
    let (runtime, drain) = measure(target, 2, workload, async {
        Ok(Runtime {
            handle: participant.start().await?,
        })
    })
    .await?;
    runtime.handle.stop().await?;
    Ok(drain)
}

/// CPU time this process has used, user and system (Linux `/proc`; zero elsewhere).
fn process_cpu() -> Duration {
    // Fields 14 and 15 of /proc/self/stat, in clock ticks of 1/100 s (USER_HZ); the
    // command name before them is in parentheses and may hold spaces.
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            let fields: Vec<u64> = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .skip(11)
                .take(2)
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?;
            Some(fields.iter().sum::<u64>())
        })
        .unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// One consumer's drain: messages/s and the client's CPU µs per message.
struct Drain {
    msgs_per_sec: f64,
    cpu_us: f64,
}

/// The messages every mode gets, and the paced phase's rate.
struct Workload<'a> {
    backlog: &'a [Message],
    paced: &'a [Message],
    rate: u32,
}

/// Publishes the backlog, starts the consumer, measures the drain; then the paced phase.
async fn measure<R: Running>(
    target: &impl Publish,
    mode: usize,
    workload: &Workload<'_>,
    start: impl Future<Output = Result<R, BoxError>>,
) -> Result<(R, Drain), BoxError> {
    for message in workload.backlog {
        target.publish(mode, message, false).await?;
    }
    let mut running = start.await?;
    let backlog = workload.backlog.len();
    let (started, cpu) = (Instant::now(), process_cpu());
    until_acked(&mut running, backlog as u64).await?;
    let drain = Drain {
        msgs_per_sec: backlog as f64 / started.elapsed().as_secs_f64(),
        cpu_us: process_cpu().saturating_sub(cpu).as_secs_f64() * 1e6 / backlog as f64,
    };
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(workload.rate)));
    for message in workload.paced {
        tick.tick().await;
        target.publish(mode, message, true).await?;
    }
    until_acked(&mut running, (backlog + workload.paced.len()) as u64).await?;
    Ok((running, drain))
}

/// Latency percentiles of `mode`'s paced phase, and its exactly-once check.
async fn verdict(
    pool: &PgPool,
    mode: &str,
    distinct: i64,
) -> Result<(u64, u64, i64, bool), BoxError> {
    let (p50, p99): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d), \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY d) \
         FROM (SELECT extract(epoch FROM written_at - sent_at) * 1e6 AS d \
               FROM bench_effects WHERE mode = $1 AND paced) t",
    )
    .bind(mode)
    .fetch_one(pool)
    .await?;
    let (applied, ids): (i64, i64) = sqlx::query_as(
        "SELECT COUNT(*), COUNT(DISTINCT message_id) FROM bench_effects WHERE mode = $1",
    )
    .bind(mode)
    .fetch_one(pool)
    .await?;
    let micros = |value: Option<f64>| value.map_or(0, |v| v.max(0.0) as u64);
    Ok((
        micros(p50),
        micros(p99),
        applied,
        applied == ids && ids == distinct,
    ))
}

/// Runs the three consumers on a scratch schema and scratch queues or streams, removed
/// afterwards.
pub(crate) async fn run(args: BrokerBenchArgs) -> Result<BrokerBenchReport, BoxError> {
    if !(0.0..=1.0).contains(&args.duplicate_rate) {
        return Err(format!(
            "--duplicate-rate must be within 0..=1, got {}",
            args.duplicate_rate
        )
        .into());
    }
    let scratch = super::ScratchSchema::create(
        &args.database_url,
        format!("sagabox_bench_broker_{}", std::process::id()),
    )
    .await?;
    let connections = u32::try_from(args.workers + 4).unwrap_or(u32::MAX);
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .connect_with(scratch.options.clone())
        .await?;
    let outcome = async {
        sqlx::raw_sql(SETUP).execute(&pool).await?;
        let store =
            PostgresStore::new(pool.clone()).with_schema(sagabox::Schema::new(&scratch.name)?);
        InboxGuard::new(store.clone(), InboxConfig::default())?
            .migrate()
            .await?;
        let mut rng = StdRng::seed_from_u64(args.seed);
        let backlog = ids(args.messages, args.duplicate_rate, &mut rng);
        let paced = ids(args.paced, args.duplicate_rate, &mut rng);
        let distinct = {
            let all: std::collections::HashSet<&str> = backlog
                .iter()
                .chain(&paced)
                .map(|(id, _)| id.as_str())
                .collect();
            i64::try_from(all.len())?
        };
        let workload = Workload {
            backlog: &backlog,
            paced: &paced,
            rate: args.rate,
        };
        let drains = if args.broker_url.starts_with("nats://") {
            nats::drains(&args, &pool, store, &workload).await?
        } else {
            amqp::drains(&args, &pool, store, &workload).await?
        };
        let hand = drains[0].msgs_per_sec;
        let mut modes = Vec::new();
        for ((mode, _), drain) in MODES.iter().zip(&drains) {
            let (p50_us, p99_us, applied, exactly_once) = verdict(&pool, mode, distinct).await?;
            modes.push(BrokerModeReport {
                mode,
                backlog: backlog.len(),
                msgs_per_sec: drain.msgs_per_sec,
                vs_handwritten: drain.msgs_per_sec / hand,
                client_cpu_us: drain.cpu_us,
                p50_us,
                p99_us,
                applied,
                exactly_once,
            });
        }
        Ok::<_, BoxError>(modes)
    }
    .await;
    pool.close().await;
    scratch.drop().await?;
    Ok(BrokerBenchReport {
        database: sagabox::logging::redact(&args.database_url),
        broker: sagabox::logging::redact(&args.broker_url),
        prefetch: args.prefetch,
        workers: args.workers,
        duplicate_rate: args.duplicate_rate,
        paced_rate: args.rate,
        modes: outcome?,
    })
}
