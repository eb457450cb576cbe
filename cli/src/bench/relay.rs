//! `sagabox bench-relay`: how long an outbox row waits before its broker has it. Rows
//! are committed one per transaction at `--rate` per second into a scratch schema's
//! outbox on PostgreSQL, and each mode's latency is measured from the writer's commit
//! to the broker's confirm:
//!
//! - `floor`: the writer publishes the message itself right after its commit, through
//!   the same [`Sender`] the relay uses, and waits for the confirm: what the broker
//!   costs alone, with no relay between (and none of the outbox's guarantee);
//! - `listen`: the [`Relay`], woken by PostgreSQL's `NOTIFY` when the rows commit;
//! - `poll`: the relay told not to listen, finding rows by its poll alone.
//!
//! The relay modes' confirm time is the row's `sent_at`, which the relay stamps once the
//! broker confirmed. Each mode runs `--warm-up` rows first (connections made, not
//! measured). The schema, and the queue or stream the rows went to, are removed
//! afterwards.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ractor::Actor;
use sagabox::outbox::OutboxWriter;
use sagabox::relay::{Relay, RelayArguments, RelayConfig};
use sagabox::transport::{Sender, Transport};
use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, PostgresStore, Schema};
use serde::Serialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgConnection};

use super::BoxError;

/// What to measure: `sagabox bench-relay`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RelayBenchArgs {
    /// postgres://user@host:port/db (a scratch schema in it is used and removed); the
    /// relay bench runs on PostgreSQL only.
    #[arg(long, env = "SAGABOX_DATABASE_URL", hide_env_values = true)]
    pub(crate) database_url: String,
    /// The broker: amqp://user:password@host:port/vhost (RabbitMQ) or nats://host:port
    /// (NATS JetStream)
    #[arg(long = "transport", value_name = "URL", value_parser = super::broker::broker_url)]
    pub(crate) broker_url: String,
    /// Rows measured per mode.
    #[arg(long, default_value_t = 500, value_parser = sagabox_cli::args::at_least_one)]
    pub(crate) rows: usize,
    /// Rows committed per second.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) rate: u32,
    /// Rows per mode before the measured ones.
    #[arg(long, default_value_t = 20)]
    pub(crate) warm_up: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// How a mode's rows reach the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Floor,
    Listen,
    Poll,
}

impl Mode {
    const ALL: [Mode; 3] = [Mode::Floor, Mode::Listen, Mode::Poll];

    fn name(self) -> &'static str {
        match self {
            Mode::Floor => "floor",
            Mode::Listen => "listen",
            Mode::Poll => "poll",
        }
    }
}

/// One mode's figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RelayModeReport {
    mode: &'static str,
    /// Rows measured.
    rows: usize,
    /// Commit to the broker's confirm, in ms.
    p50_ms: f64,
    p99_ms: f64,
    /// The p50 over the floor's.
    p50_vs_floor: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RelayBenchReport {
    database: String,
    broker: String,
    rate: u32,
    poll_ms: u128,
    modes: Vec<RelayModeReport>,
}

impl std::fmt::Display for RelayBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "database {}  broker {}  {} rows/s  relay poll {} ms",
            self.database, self.broker, self.rate, self.poll_ms
        )?;
        writeln!(
            f,
            "{:<8}{:>7}{:>10}{:>10}{:>9}",
            "mode", "rows", "p50 ms", "p99 ms", "× floor"
        )?;
        for mode in &self.modes {
            writeln!(
                f,
                "{:<8}{:>7}{:>10.2}{:>10.2}{:>9.2}",
                mode.mode, mode.rows, mode.p50_ms, mode.p99_ms, mode.p50_vs_floor
            )?;
        }
        Ok(())
    }
}

/// The consumer type the rows are sent to (names the queue or stream).
const DESTINATION: &str = "bench-relay";

/// Runs every mode on a scratch schema and a scratch queue or stream, removed afterwards.
pub(crate) async fn run(args: RelayBenchArgs) -> Result<RelayBenchReport, BoxError> {
    let scratch = super::ScratchSchema::create(
        &args.database_url,
        format!("sagabox_bench_relay_{}", std::process::id()),
    )
    .await?;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(scratch.options.clone())
        .await?;
    let prefix = format!("sagabox-bench-relay-{}", std::process::id());
    let outcome = async {
        let store = PostgresStore::new(pool.clone()).with_schema(Schema::new(&scratch.name)?);
        InboxGuard::new(store.clone(), InboxConfig::default())?
            .migrate()
            .await?;
        let transport = Transport::from_url(&args.broker_url, &prefix)?;
        let mut modes = Vec::new();
        for mode in Mode::ALL {
            let mut latencies = measure(mode, &store, &transport, &args).await?;
            latencies.sort();
            modes.push((mode, latencies));
        }
        Ok::<_, BoxError>(modes)
    }
    .await;
    pool.close().await;
    super::remove_queues(&args.broker_url, &prefix, &[DESTINATION], "bench-relay").await;
    scratch.drop().await?;
    let modes = outcome?;
    let ms = |sorted: &[Duration], p: f64| super::percentile(sorted, p) as f64 / 1000.0;
    let floor = ms(&modes[0].1, 0.5);
    Ok(RelayBenchReport {
        database: sagabox::logging::redact(&args.database_url),
        broker: sagabox::logging::redact(&args.broker_url),
        rate: args.rate,
        poll_ms: RelayConfig::default().poll_interval.as_millis(),
        modes: modes
            .iter()
            .map(|(mode, latencies)| {
                let p50_ms = ms(latencies, 0.5);
                RelayModeReport {
                    mode: mode.name(),
                    rows: latencies.len(),
                    p50_ms,
                    p99_ms: ms(latencies, 0.99),
                    p50_vs_floor: p50_ms / floor,
                }
            })
            .collect(),
    })
}

/// One mode: its warm-up rows, then its measured ones; returns each measured row's
/// wait from commit to confirm. Leaves the outbox empty.
async fn measure(
    mode: Mode,
    store: &PostgresStore,
    transport: &Transport,
    args: &RelayBenchArgs,
) -> Result<Vec<Duration>, BoxError> {
    let destination = ConsumerType::new(DESTINATION)?;
    let mut relay = None;
    let mut sender = None;
    match mode {
        Mode::Floor => sender = Some(Sender::connect(transport, "bench-relay-floor").await?),
        Mode::Listen | Mode::Poll => {
            let (actor, handle) = Actor::spawn(
                None,
                Relay::new(),
                RelayArguments {
                    source: store.clone(),
                    transport: transport.clone(),
                    config: RelayConfig {
                        listen: mode == Mode::Listen,
                        ..RelayConfig::default()
                    },
                },
            )
            .await?;
            relay = Some((actor, handle));
        }
    }
    let outcome = async {
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(args.rate)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut committed: Vec<(String, DateTime<Utc>)> = Vec::with_capacity(args.rows);
        let mut confirmed: Vec<DateTime<Utc>> = Vec::with_capacity(args.rows);
        for n in 0..args.warm_up + args.rows {
            tick.tick().await;
            let envelope = write_row(store, &destination, n).await?;
            let at = Utc::now();
            if let Some(sender) = sender.as_mut() {
                sender.send(&destination, &envelope).await?;
                if n >= args.warm_up {
                    confirmed.push(Utc::now());
                }
            }
            if n >= args.warm_up {
                committed.push((envelope.id.as_str().to_owned(), at));
            }
        }
        if sender.is_none() {
            until_sent(store).await?;
            confirmed = sent_at(store, &committed).await?;
        }
        Ok::<_, BoxError>(
            committed
                .iter()
                .zip(&confirmed)
                .map(|((_, at), sent)| (*sent - *at).to_std().unwrap_or_default())
                .collect(),
        )
    }
    .await;
    if let Some(sender) = sender {
        sender.close().await;
    }
    if let Some((actor, handle)) = relay {
        actor.stop(None);
        handle.await?;
    }
    sqlx::query(AssertSqlSafe(
        store.schema().sql("DELETE FROM {schema}.sagabox_outbox"),
    ))
    .execute(store.pool())
    .await?;
    outcome
}

/// Commits one outbox row (its own transaction, as a service's write would be) and
/// returns its message.
async fn write_row(
    store: &PostgresStore,
    destination: &ConsumerType,
    n: usize,
) -> Result<Envelope, BoxError> {
    let envelope =
        <PgConnection as OutboxWriter>::message("measured", serde_json::json!({ "n": n }))?;
    let mut tx = store.pool().begin().await?;
    (*tx)
        .publish_in(
            store.schema(),
            destination,
            &format!("a{}", n % 16),
            &envelope,
        )
        .await?;
    tx.commit().await?;
    Ok(envelope)
}

/// Waits until the relay has sent every row (a minute without any sent is an error).
async fn until_sent(store: &PostgresStore) -> Result<(), BoxError> {
    let mut last = (i64::MAX, std::time::Instant::now());
    let count = store
        .schema()
        .sql("SELECT COUNT(*) FROM {schema}.sagabox_outbox WHERE sent_at IS NULL");
    loop {
        let pending: i64 = sqlx::query_scalar(AssertSqlSafe(count.as_str()))
            .fetch_one(store.pool())
            .await?;
        if pending == 0 {
            return Ok(());
        }
        if pending < last.0 {
            last = (pending, std::time::Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(60) {
            return Err(format!("the relay sent nothing for a minute ({pending} pending)").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `sent_at` of each row of `committed`, in its order.
async fn sent_at(
    store: &PostgresStore,
    committed: &[(String, DateTime<Utc>)],
) -> Result<Vec<DateTime<Utc>>, BoxError> {
    let ids: Vec<&str> = committed.iter().map(|(id, _)| id.as_str()).collect();
    let rows: Vec<(String, DateTime<Utc>)> =
        sqlx::query_as(AssertSqlSafe(store.schema().sql(
            "SELECT id, sent_at FROM {schema}.sagabox_outbox WHERE id = ANY($1)",
        )))
        .bind(&ids)
        .fetch_all(store.pool())
        .await?;
    let sent: std::collections::HashMap<String, DateTime<Utc>> = rows.into_iter().collect();
    committed
        .iter()
        .map(|(id, _)| {
            sent.get(id)
                .copied()
                .ok_or_else(|| format!("row {id} has no sent_at").into())
        })
        .collect()
}
