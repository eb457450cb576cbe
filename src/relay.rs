//! The [`Relay`] actor: publishes committed outbox rows to the broker (RabbitMQ or NATS
//! JetStream, a [`Transport`]), at least once, in `seq` order per aggregate, and marks
//! them sent only after the broker confirmed them.
//!
//! A pass takes up to [`RelayConfig::batch`] rows in one transaction
//! ([`OutboxReader::claim`]: on PostgreSQL, aggregate locks plus `FOR UPDATE SKIP
//! LOCKED`, so several relays share the work without publishing a row twice), publishes
//! them in order (RabbitMQ: on one confirm-mode channel; JetStream: each under its
//! message id as `Nats-Msg-Id`, so the server's duplicate window drops a re-publish),
//! waits for every confirm, marks the confirmed prefix sent, and commits. A crash between publish and commit leaves the rows
//! pending: they are published again, with the same message id, and the consumer's inbox
//! absorbs the repeat.
//!
//! The relay passes on a poll ([`RelayConfig::poll_interval`]) and, on PostgreSQL, as
//! soon as a transaction that wrote outbox rows commits: it listens for the outbox's
//! `NOTIFY` ([`OutboxSource::listen`], [`RelayWaker`]), so a row's wait for the broker
//! is a pass, not half a poll.
//!
//! On a broker or database error the relay drops its connection and tries again at a
//! later tick with exponential backoff. Sent rows older than
//! [`RelayConfig::keep_sent`] are deleted on a timer.

use std::future::Future;
use std::time::{Duration, Instant};

use chrono::Utc;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use sqlx::Database;

mod listen;

pub use self::listen::RelayWaker;

use crate::outbox::{OutboxReader, OutboxRow};
use crate::schema::Schema;
use crate::transport::{Sender, Sent, Transport, TransportError};

/// How often and how much the relay publishes.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Rows per pass (one transaction). Defaults to 100.
    pub batch: i64,
    /// How often the relay looks for pending rows. Defaults to 50 ms. A relay that
    /// listens ([`RelayConfig::listen`]) is woken by commits; its poll is the fallback.
    pub poll_interval: Duration,
    /// Whether the relay listens for commits to the outbox where the database announces
    /// them ([`OutboxSource::listen`]: PostgreSQL). Defaults to true.
    pub listen: bool,
    /// How long sent rows are kept before they are deleted. Defaults to one day.
    pub keep_sent: Duration,
    /// How often sent rows are pruned. Defaults to one minute.
    pub prune_interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch: 100,
            poll_interval: Duration::from_millis(50),
            listen: true,
            keep_sent: Duration::from_secs(24 * 3600),
            prune_interval: Duration::from_secs(60),
        }
    }
}

/// Why a relay pass failed. The relay itself retries; [`RelayMessage::Flush`] reports it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The broker failed.
    #[error(transparent)]
    Broker(#[from] TransportError),
    /// The database failed.
    #[error("outbox database error: {}", crate::connection::describe(.0))]
    Database(#[from] sqlx::Error),
    /// The configuration was refused.
    #[error("invalid relay configuration: {0}")]
    Config(String),
}

/// A database the relay reads: a pool whose connections implement [`OutboxReader`].
pub trait OutboxSource: Clone + Send + Sync + 'static {
    /// The database.
    type Db: Database;
    /// The pool.
    fn pool(&self) -> &sqlx::Pool<Self::Db>;

    /// The schema of the outbox: the store's; a bare pool's outbox is in the default
    /// one (PostgreSQL's `sagabox`, SQLite's `main`).
    fn schema(&self) -> Schema;

    /// Begins a pass's transaction, which reads the pending rows and then marks them.
    /// Defaults to a plain `BEGIN`; SQLite takes its write lock up front
    /// (`BEGIN IMMEDIATE`, waiting out the busy timeout), because a deferred
    /// transaction that has read cannot start writing while another connection writes —
    /// the pass would fail after publishing, and publish its rows again.
    fn begin(
        &self,
    ) -> impl Future<Output = Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error>> + Send
    {
        self.pool().begin()
    }

    /// Starts a task that wakes the relay through `waker` whenever outbox rows commit,
    /// if the database announces commits; the relay aborts it when it stops. Defaults to
    /// none: the relay finds rows by its poll alone. PostgreSQL's listens for the
    /// outbox trigger's `NOTIFY` on a connection of its own.
    fn listen(&self, waker: RelayWaker) -> Option<tokio::task::JoinHandle<()>> {
        let _ = waker;
        None
    }
}

#[cfg(feature = "postgres")]
impl OutboxSource for sqlx::PgPool {
    type Db = sqlx::Postgres;
    fn pool(&self) -> &sqlx::Pool<Self::Db> {
        self
    }
    fn schema(&self) -> Schema {
        Schema::default()
    }
    fn listen(&self, waker: RelayWaker) -> Option<tokio::task::JoinHandle<()>> {
        Some(listen::listen(self, Schema::default(), waker))
    }
}

#[cfg(feature = "sqlite")]
impl OutboxSource for sqlx::SqlitePool {
    type Db = sqlx::Sqlite;
    fn pool(&self) -> &sqlx::Pool<Self::Db> {
        self
    }
    fn schema(&self) -> Schema {
        Schema::sqlite()
    }
    async fn begin(&self) -> Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error> {
        self.begin_with("BEGIN IMMEDIATE").await
    }
}

// The stores too: the outbox lives in the inbox's database (its rows commit in the
// guard's transaction), so a store is its own relay source.
#[cfg(feature = "postgres")]
impl OutboxSource for crate::PostgresStore {
    type Db = sqlx::Postgres;
    fn pool(&self) -> &sqlx::Pool<Self::Db> {
        crate::PostgresStore::pool(self)
    }
    fn schema(&self) -> Schema {
        crate::PostgresStore::schema(self).clone()
    }
    fn listen(&self, waker: RelayWaker) -> Option<tokio::task::JoinHandle<()>> {
        Some(listen::listen(
            crate::PostgresStore::pool(self),
            crate::PostgresStore::schema(self).clone(),
            waker,
        ))
    }
}

#[cfg(feature = "sqlite")]
impl OutboxSource for crate::SqliteStore {
    type Db = sqlx::Sqlite;
    fn pool(&self) -> &sqlx::Pool<Self::Db> {
        crate::SqliteStore::pool(self)
    }
    fn schema(&self) -> Schema {
        Schema::sqlite()
    }
    async fn begin(&self) -> Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error> {
        crate::SqliteStore::pool(self)
            .begin_with("BEGIN IMMEDIATE")
            .await
    }
}

/// Messages the [`Relay`] handles.
#[derive(Debug)]
pub enum RelayMessage {
    /// Publish what is pending (sent by the relay's own timer).
    Tick,
    /// Publish what is pending: rows committed ([`RelayWaker`]).
    Wake,
    /// Publish everything pending now; answers how many rows were published, or why not.
    Flush(RpcReplyPort<Result<usize, String>>),
}

/// What a relay runs with.
#[derive(Debug)]
pub struct RelayArguments<P> {
    /// The outbox's database.
    pub source: P,
    /// The broker.
    pub transport: Transport,
    /// Batching and timers.
    pub config: RelayConfig,
}

/// The relay's state.
#[derive(Debug)]
pub struct RelayState<P> {
    source: P,
    transport: Transport,
    config: RelayConfig,
    sender: Option<Sender>,
    waker: Option<RelayWaker>,
    listener: Option<tokio::task::JoinHandle<()>>,
    failures: u32,
    retry_at: Instant,
    pruned_at: Instant,
}

/// The outbox relay actor. Spawn with [`Actor::spawn`] and [`RelayArguments`].
#[derive(Debug)]
pub struct Relay<P>(std::marker::PhantomData<fn() -> P>);

impl<P> Default for Relay<P> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<P> Relay<P> {
    /// The relay.
    pub fn new() -> Self {
        Self::default()
    }
}

impl<P> Actor for Relay<P>
where
    P: OutboxSource,
    for<'c> &'c mut <P::Db as Database>::Connection: sqlx::Executor<'c, Database = P::Db>,
    <P::Db as Database>::Connection: OutboxReader,
{
    type Msg = RelayMessage;
    type State = RelayState<P>;
    type Arguments = RelayArguments<P>;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        args.transport.validate()?;
        if args.config.batch < 1 || args.config.poll_interval.is_zero() {
            return Err(RelayError::Config(
                "batch must be at least 1 and poll_interval above zero".into(),
            )
            .into());
        }
        myself.send_interval(args.config.poll_interval, || RelayMessage::Tick);
        let waker = args.config.listen.then(|| RelayWaker::new(myself.clone()));
        let listener = waker
            .as_ref()
            .and_then(|waker| args.source.listen(waker.clone()));
        let now = Instant::now();
        Ok(RelayState {
            source: args.source,
            transport: args.transport,
            config: args.config,
            sender: None,
            waker,
            listener,
            failures: 0,
            retry_at: now,
            pruned_at: now,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(listener) = state.listener.take() {
            listener.abort();
        }
        if let Some(sender) = state.sender.take() {
            sender.close().await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            RelayMessage::Tick => {
                state.drain_unless_backing_off().await;
                state.prune().await;
            }
            RelayMessage::Wake => {
                if let Some(waker) = &state.waker {
                    waker.taken();
                }
                state.drain_unless_backing_off().await;
            }
            RelayMessage::Flush(reply) => {
                let _ = reply.send(state.drain().await.map_err(|error| error.to_string()));
            }
        }
        Ok(())
    }
}

impl<P> RelayState<P>
where
    P: OutboxSource,
    for<'c> &'c mut <P::Db as Database>::Connection: sqlx::Executor<'c, Database = P::Db>,
    <P::Db as Database>::Connection: OutboxReader,
{
    /// [`drain`](Self::drain), unless a failed pass set a later time to try again.
    async fn drain_unless_backing_off(&mut self) {
        if Instant::now() >= self.retry_at {
            let _ = self.drain().await;
        }
    }

    /// Passes until nothing is pending; on failure, drops the connection and backs off.
    async fn drain(&mut self) -> Result<usize, RelayError> {
        let mut published = 0;
        loop {
            match self.pass().await {
                Ok(count) => {
                    self.failures = 0;
                    published += count;
                    if (count as i64) < self.config.batch {
                        return Ok(published);
                    }
                }
                Err(error) => {
                    let wait = backoff(self.failures);
                    self.failures = self.failures.saturating_add(1);
                    self.retry_at = Instant::now() + wait;
                    tracing::warn!(%error, retry_in = ?wait, "outbox relay pass failed");
                    // A database error leaves the broker connection as good as it was.
                    if matches!(error, RelayError::Broker(_))
                        && let Some(sender) = self.sender.take()
                    {
                        sender.close().await;
                    }
                    return Err(error);
                }
            }
        }
    }

    /// One transaction: claim, publish, confirm, mark, commit.
    async fn pass(&mut self) -> Result<usize, RelayError> {
        let batch = self.config.batch;
        let schema = self.source.schema();
        let mut tx = self.source.begin().await?;
        let rows: Vec<OutboxRow> = (*tx).claim(&schema, batch).await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let sender = match self.sender.take() {
            Some(sender) if sender.is_connected() => self.sender.insert(sender),
            _ => self
                .sender
                .insert(Sender::connect(&self.transport, "relay").await?),
        };
        let Sent { confirmed, failure } = sender
            .send_all(rows.iter().map(|row| (&row.destination, &row.envelope)))
            .await?;
        // Only the confirmed prefix is marked: a row after a refused one stays pending
        // and goes again (a repeat the inbox absorbs) rather than out of order.
        let now = Utc::now();
        for row in &rows[..confirmed] {
            (*tx).mark_sent(&schema, row.seq, now).await?;
        }
        tx.commit().await?;
        for row in &rows[..confirmed] {
            let lag = row
                .envelope
                .published_at
                .map(|at| (now - at).to_std().unwrap_or_default())
                .unwrap_or_default();
            crate::metrics::outbox_published(&row.destination, lag);
        }
        match failure {
            Some(error) => Err(error.into()),
            None => Ok(confirmed),
        }
    }

    async fn prune(&mut self) {
        if self.pruned_at.elapsed() < self.config.prune_interval {
            return;
        }
        self.pruned_at = Instant::now();
        let keep =
            chrono::Duration::from_std(self.config.keep_sent).unwrap_or(chrono::Duration::days(1));
        let before = Utc::now() - keep;
        let schema = self.source.schema();
        let pruned = match self.source.pool().acquire().await {
            Ok(mut conn) => (*conn).prune_sent(&schema, before).await,
            Err(error) => Err(error),
        };
        match pruned {
            Ok(count) if count > 0 => tracing::info!(count, "pruned sent outbox rows"),
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "pruning sent outbox rows failed"),
        }
        if let Ok(mut conn) = self.source.pool().acquire().await
            && let Ok(pending) = (*conn).pending_count(&schema).await
        {
            crate::metrics::outbox_pending(pending);
        }
    }
}

/// The wait before the pass after `failures` failed ones: 100 ms doubled up to 5 s.
fn backoff(failures: u32) -> Duration {
    crate::backoff::doubling(Duration::from_millis(100), failures, Duration::from_secs(5))
}
