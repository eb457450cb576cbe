//! `sagabox bench-broker`: the broker path against a hand-written consumer. Messages go
//! through RabbitMQ into PostgreSQL, consumed on one broker and one database in one run
//!
//! - `handwritten`: a `lapin` consumer running the SQL a team writes by hand —
//!   `INSERT … ON CONFLICT DO NOTHING` into an inbox table, the business statements if
//!   the insert was fresh, `COMMIT`, then the ack — on `--workers` tasks under the same
//!   prefetch;
//! - `consumer`: sagabox's RabbitMQ [`Consumer`] with [`InboxGuard::process`] called in
//!   each delivery's task, no step pool: what the guard and the consumer cost without
//!   the actor hop;
//! - `sagabox`: the [`Participant`] runtime with a step handler running the same business
//!   statements, `--workers` workers.
//!
//! Each mode gets its own queue (declared the same way: a quorum queue) and the same
//! messages: `--messages` published before its consumer starts (the backlog, drained as
//! fast as the consumer goes: messages/s), then `--paced` more published at `--rate` per
//! second while it runs (latency from publish to the business write, read from the
//! database: p50, p99). A share `--duplicate-rate` of each phase repeats an earlier
//! message id. Afterwards every message id must have been applied exactly once. The
//! bench process's own CPU time per backlog message is reported beside (Linux `/proc`).

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sagabox::amqp::{AmqpConfig, Consumer, ConsumerOptions, Publisher, Routing};
use sagabox::delivery::Disposition;
use sagabox::step::{StepError, StepHandler};
use sagabox::transport::Transport;
use sagabox::{
    ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, Participant, PostgresStore,
};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::BoxError;

/// What to measure: `sagabox bench-broker`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BrokerBenchArgs {
    /// postgres://user@host:port/db (a scratch schema in it is used and removed)
    #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = sagabox_cli::args::DEFAULT_DATABASE_URL,
          value_parser = postgres_url)]
    pub(crate) database_url: String,
    /// The RabbitMQ broker: amqp://user:password@host:port/vhost
    #[arg(long = "transport", value_name = "URL", value_parser = amqp_url)]
    pub(crate) amqp_url: String,
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
    /// Unacknowledged messages per consumer (AMQP prefetch), 1 to 65535.
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

/// Parses `--database-url`: the broker bench runs on PostgreSQL.
fn postgres_url(url: &str) -> Result<String, String> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(url.to_owned())
    } else {
        Err("the broker bench runs on PostgreSQL (postgres://…)".into())
    }
}

/// Parses `--transport`: the broker bench speaks RabbitMQ.
fn amqp_url(url: &str) -> Result<String, String> {
    if url.starts_with("amqp://") || url.starts_with("amqps://") {
        Ok(url.to_owned())
    } else {
        Err("the broker bench speaks RabbitMQ (amqp://user:password@host:port/vhost)".into())
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
/// consumer type (which names its queue).
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

async fn publish(
    publisher: &Publisher,
    queue: &str,
    (id, account): &Message,
    paced: bool,
) -> Result<(), BoxError> {
    let sent_us = chrono::Utc::now().timestamp_micros();
    let payload = serde_json::json!({"account": account, "sent_us": sent_us, "paced": paced});
    let envelope = Envelope::new(id.clone(), "deposit", payload)?;
    publisher
        .publish(queue, &envelope, None, None, Routing::Required)
        .await?;
    Ok(())
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

/// The hand-written consumer: its connection and the count of its acks.
struct Handwritten {
    acked: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Result<(), BoxError>>,
    connection: Connection,
}

impl Running for Handwritten {
    fn acked(&self) -> u64 {
        self.acked.load(Ordering::Relaxed)
    }

    async fn failure(&mut self) -> Option<BoxError> {
        if !self.task.is_finished() {
            return None;
        }
        Some(match (&mut self.task).await {
            Ok(Ok(())) => "its deliveries ended".into(),
            Ok(Err(error)) => error,
            Err(panicked) => panicked.into(),
        })
    }
}

impl Handwritten {
    async fn start(args: &BrokerBenchArgs, pool: PgPool, queue: &str) -> Result<Self, BoxError> {
        let connection =
            Connection::connect(&args.amqp_url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(args.prefetch, BasicQosOptions::default())
            .await?;
        let mut deliveries = channel
            .basic_consume(
                queue.into(),
                "bench-handwritten".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let acked = Arc::new(AtomicU64::new(0));
        let workers = Arc::new(Semaphore::new(args.workers));
        let task = tokio::spawn({
            let acked = acked.clone();
            async move {
                let mut running = JoinSet::new();
                while let Some(delivery) = deliveries.next().await {
                    let delivery = delivery?;
                    let permit = workers.clone().acquire_owned().await?;
                    let (pool, acked) = (pool.clone(), acked.clone());
                    running.spawn(async move {
                        let id = delivery
                            .properties
                            .message_id()
                            .as_ref()
                            .ok_or("a delivery without message_id")?
                            .to_string();
                        let body: serde_json::Value = serde_json::from_slice(&delivery.data)?;
                        let fields = fields(&body["payload"]).ok_or("payload lacks its fields")?;
                        let mut tx = pool.begin().await?;
                        let fresh = sqlx::query(RAW_CLAIM)
                            .bind(id.as_str())
                            .execute(&mut *tx)
                            .await?
                            .rows_affected()
                            == 1;
                        if fresh {
                            business(&mut tx, "handwritten", &id, &fields).await?;
                        }
                        tx.commit().await?;
                        delivery.acker.ack(BasicAckOptions::default()).await?;
                        acked.fetch_add(1, Ordering::Relaxed);
                        drop(permit);
                        Ok::<_, BoxError>(())
                    });
                    while let Some(done) = running.try_join_next() {
                        done??;
                    }
                }
                while let Some(done) = running.join_next().await {
                    done??;
                }
                Ok(())
            }
        });
        Ok(Self {
            acked,
            task,
            connection,
        })
    }

    /// Closes the connection once every delivery is acked; the consumer's loop ends
    /// with it (the error of a stream cut by its own close says nothing).
    async fn stop(self) -> Result<(), BoxError> {
        self.connection.close(200, "bench done".into()).await?;
        self.task.abort();
        Ok(())
    }
}

/// The `consumer` mode: sagabox's consumer calling the guard itself.
struct Direct {
    handle: sagabox::amqp::ConsumerHandle,
}

impl Running for Direct {
    fn acked(&self) -> u64 {
        self.handle.stats().acked.load(Ordering::Relaxed)
    }

    async fn failure(&mut self) -> Option<BoxError> {
        self.handle
            .is_finished()
            .then(|| "the consumer ended".into())
    }
}

impl Direct {
    async fn start(
        config: &AmqpConfig,
        guard: InboxGuard<PostgresStore>,
        consumer_type: ConsumerType,
        workers: usize,
    ) -> Result<Self, BoxError> {
        let options = ConsumerOptions::new(consumer_type.clone(), ["deposit"]);
        // As many deliveries in the guard at once as the other modes have workers.
        let workers = Arc::new(Semaphore::new(workers));
        let handle = Consumer::spawn(config.clone(), options, move |envelope: Envelope| {
            let (guard, consumer_type) = (guard.clone(), consumer_type.clone());
            let workers = workers.clone();
            async move {
                let Ok(_permit) = workers.acquire().await else {
                    return Disposition::Retry("the bench is stopping".into());
                };
                let processed = guard
                    .process(&consumer_type, &envelope, async |conn, envelope| {
                        Deposit(MODES[1].0).apply(conn, envelope).await
                    })
                    .await;
                match processed {
                    Ok(_) => Disposition::Done { reply: None },
                    Err(error) => Disposition::Retry(error.to_string()),
                }
            }
        })
        .await?;
        Ok(Self { handle })
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

/// Publishes the backlog, starts the consumer, measures the drain; then the paced phase.
async fn measure<R: Running>(
    publisher: &Publisher,
    queue: &str,
    (backlog, paced): (&[Message], &[Message]),
    rate: u32,
    start: impl Future<Output = Result<R, BoxError>>,
) -> Result<(R, Drain), BoxError> {
    for id in backlog {
        publish(publisher, queue, id, false).await?;
    }
    let mut running = start.await?;
    let (started, cpu) = (Instant::now(), process_cpu());
    until_acked(&mut running, backlog.len() as u64).await?;
    let drain = Drain {
        msgs_per_sec: backlog.len() as f64 / started.elapsed().as_secs_f64(),
        cpu_us: process_cpu().saturating_sub(cpu).as_secs_f64() * 1e6 / backlog.len() as f64,
    };
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    for id in paced {
        tick.tick().await;
        publish(publisher, queue, id, true).await?;
    }
    until_acked(&mut running, (backlog.len() + paced.len()) as u64).await?;
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

/// Runs both consumers on a scratch schema and scratch queues, removed afterwards.
pub(crate) async fn run(args: BrokerBenchArgs) -> Result<BrokerBenchReport, BoxError> {
    if !(0.0..=1.0).contains(&args.duplicate_rate) {
        return Err(format!(
            "--duplicate-rate must be within 0..=1, got {}",
            args.duplicate_rate
        )
        .into());
    }
    let prefix = format!("sagabox-bench-{}", std::process::id());
    let mut config = AmqpConfig::new(args.amqp_url.clone())
        .with_queue_prefix(prefix)
        .with_inbox(&InboxConfig::default());
    config.prefetch = args.prefetch;
    config.validate()?;
    let schema = format!("sagabox_bench_broker_{}", std::process::id());
    let admin = PostgresStore::connect(&args.database_url, 1)
        .await?
        .pool()
        .clone();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
    )))
    .execute(&admin)
    .await?;
    let options =
        PgConnectOptions::from_str(&args.database_url)?.options([("search_path", schema.as_str())]);
    let connections = u32::try_from(args.workers + 4).unwrap_or(u32::MAX);
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await?;
    let broker = sagabox::amqp::connect(&config, "bench").await?;
    let publisher = Publisher::open(&broker).await?;
    let queues: Vec<String> = MODES
        .iter()
        .map(|(_, name)| Ok::<_, BoxError>(config.queue(&ConsumerType::new(*name)?)))
        .collect::<Result<_, _>>()?;
    let outcome = async {
        sqlx::raw_sql(SETUP).execute(&pool).await?;
        let store = PostgresStore::new(pool.clone());
        sagabox::InboxGuard::new(store.clone(), InboxConfig::default())?
            .migrate()
            .await?;
        for (_, name) in MODES {
            sagabox::amqp::declare(publisher.channel(), &config, &ConsumerType::new(name)?).await?;
        }
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
        let phases = (&backlog[..], &paced[..]);

        let (handwritten, hand) = measure(
            &publisher,
            &queues[0],
            phases,
            args.rate,
            Handwritten::start(&args, pool.clone(), &queues[0]),
        )
        .await?;
        handwritten.stop().await?;

        let guard = InboxGuard::new(store.clone(), InboxConfig::default())?;
        let consumer_type = ConsumerType::new(MODES[1].1)?;
        let (direct, consumer) = measure(
            &publisher,
            &queues[1],
            phases,
            args.rate,
            Direct::start(&config, guard, consumer_type, args.workers),
        )
        .await?;
        direct.handle.stop().await;

        let transport = Transport::Amqp(config.clone());
        let participant = Participant::new(store, transport)
            .workers(args.workers)
            .skip_migrations()
            .step(MODES[2].1, Deposit(MODES[2].0));
        let (runtime, sagabox) = measure(&publisher, &queues[2], phases, args.rate, async {
            Ok(Runtime {
                handle: participant.start().await?,
            })
        })
        .await?;
        runtime.handle.stop().await?;

        let mut modes = Vec::new();
        for ((mode, _), drain) in MODES.iter().zip([&hand, &consumer, &sagabox]) {
            let (p50_us, p99_us, applied, exactly_once) = verdict(&pool, mode, distinct).await?;
            modes.push(BrokerModeReport {
                mode,
                backlog: backlog.len(),
                msgs_per_sec: drain.msgs_per_sec,
                vs_handwritten: drain.msgs_per_sec / hand.msgs_per_sec,
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
    for queue in &queues {
        for name in [queue.clone(), format!("{queue}.dead")] {
            let _ = publisher
                .channel()
                .queue_delete(
                    name.as_str().into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await;
        }
    }
    let _ = broker.close(200, "bench done".into()).await;
    pool.close().await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(&admin)
    .await?;
    Ok(BrokerBenchReport {
        database: sagabox::database::redact(&args.database_url),
        broker: sagabox::database::redact(&args.amqp_url),
        prefetch: args.prefetch,
        workers: args.workers,
        duplicate_rate: args.duplicate_rate,
        paced_rate: args.rate,
        modes: outcome?,
    })
}
