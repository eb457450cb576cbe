//! The [`Participant`] runtime (feature `rabbitmq` or `nats`): a team's own step
//! handlers behind a broker — RabbitMQ or NATS JetStream, a [`Transport`] — with
//! everything a participant service runs around them, until a shutdown signal.
//!
//! For each hosted step, under its consumer type:
//!
//! - its queue or stream `<prefix>.<consumer_type>` is consumed
//!   ([`transport::serve_step`]: acks after commit, bad
//!   input dead-lettered, retryable failures redelivered; a JetStream stream's retention
//!   checked against the inbox TTL first);
//! - every delivery is handed to the step's [`StepPool`] — competing worker actors
//!   pulling from one queue, their pool linked to one [`Supervision`] — and the
//!   consumer awaits the pool's answer before it acks and replies to `reply_to`.
//!   In-flight work is therefore bounded by the broker's prefetch
//!   ([`Transport::prefetch`]): the broker's queue is the one queue. The pool's own
//!   queue, unbounded in a plain [`StepPool`], is capped at the prefetch
//!   ([`StepPool::spawn_bounded`]), so commands left behind by deliveries that timed out
//!   cannot pile up in it either.
//!
//! And, when configured: the outbox [`Relay`] ([`Participant::relay`]), the
//! [`Pruner`] ([`Participant::pruner`]; several instances elect
//! one pass at a time through [`InboxStore::try_maintenance_lock`]), and the Prometheus
//! endpoint ([`Participant::metrics_addr`], feature `prometheus`).
//!
//! On shutdown it stops taking deliveries, lets those in flight finish and be acked,
//! publishes what the outbox holds once more, then stops the pruner, the relay and the
//! pools. An actor that dies (a pool, the relay, the pruner) ends the run with
//! [`ParticipantError::ActorDied`] naming it, after the same orderly stop: never a hang.
//!
//! ```no_run
//! use sagabox::amqp::AmqpConfig;
//! use sagabox::relay::RelayConfig;
//! use sagabox::participant::PrunerSettings;
//! use sagabox::step::{StepError, StepHandler};
//! use sagabox::{Envelope, Participant, PostgresStore};
//! use serde_json::{Value, json};
//!
//! struct Credit;
//!
//! impl StepHandler<sqlx::Postgres> for Credit {
//!     async fn handle(&self, conn: &mut sqlx::PgConnection, envelope: &Envelope) -> Result<Value, StepError> {
//!         sqlx::query("INSERT INTO ledger (account, cents) VALUES ($1, $2)")
//!             .bind(envelope.payload["account"].as_str())
//!             .bind(envelope.payload["cents"].as_i64())
//!             .execute(&mut *conn)
//!             .await
//!             .map_err(|error| StepError::Retryable(error.to_string()))?;
//!         Ok(json!({"credited": envelope.payload["cents"]}))
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::connect("postgres://localhost/ledger", 8).await?;
//! let report = Participant::new(store, AmqpConfig::new("amqp://guest:guest@localhost:5672/%2f"))
//!     .step("ledger", Credit)
//!     .workers(4)
//!     .relay(RelayConfig::default())
//!     .pruner(PrunerSettings::default())
//!     .run(async { tokio::signal::ctrl_c().await.unwrap_or_default() })
//!     .await?;
//! println!("{report:?}");
//! # Ok(())
//! # }
//! ```

mod error;
mod handle;
mod report;

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use ractor::{Actor, ActorRef, SpawnErr};

/// Kept here too, where the participant's builder takes it.
pub use crate::pruner::PrunerSettings;
pub use error::ParticipantError;
pub use handle::ParticipantHandle;
pub use report::{ParticipantReport, PrunerReport, StepReport};

use crate::clock::Clock;
use crate::envelope::ConsumerType;
use crate::inbox::{InboxConfig, InboxGuard};
use crate::pruner::{Pruner, PrunerArguments};
use crate::relay::{OutboxSource, Relay, RelayArguments, RelayConfig, RelayMessage};
use crate::step::{StepHandler, StepPool, StepPoolConfig};
use crate::store::InboxStore;
use crate::supervisor::Supervision;
use crate::transport::{self, Transport};
use report::Tallied;

/// The label of the relay actor in [`ParticipantError::ActorDied`] reports.
pub const RELAY: &str = "relay";
/// The label of the pruner actor in [`ParticipantError::ActorDied`] reports.
pub const PRUNER: &str = crate::pruner::ACTOR;

/// How one hosted step differs from the participant's defaults.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOptions {
    /// The message kinds the step takes; a message of another kind is dead-lettered
    /// (`unknown_kind`). Empty takes every kind. Defaults to empty.
    pub kinds: Vec<String>,
    /// Workers in this step's pool, instead of the participant's
    /// ([`Participant::workers`]). Defaults to `None`.
    pub workers: Option<usize>,
    /// How long a delivery waits for the handler's answer before it is requeued, instead
    /// of the participant's ([`Participant::timeout`]). Defaults to `None`.
    pub timeout: Option<Duration>,
    /// Claims the deliveries the consumer holds at once in batches of up to this many,
    /// one transaction and one commit per batch, one batch at a time: a command that
    /// arrives while no batch runs goes at once, alone; those that arrive while one runs
    /// go together in the next ([`GroupCommit`](crate::batching::GroupCommit)). Each
    /// command still gets its own reply and ack. At most the prefetch. Defaults to
    /// `None`: one at a time, on the step's workers side by side.
    pub batch: Option<usize>,
}

impl StepOptions {
    /// Takes only these message kinds.
    pub fn kinds<I: IntoIterator<Item = K>, K: Into<String>>(mut self, kinds: I) -> Self {
        self.kinds = kinds.into_iter().map(Into::into).collect();
        self
    }

    /// Runs `workers` workers for this step.
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = Some(workers);
        self
    }

    /// Waits up to `timeout` for this step's answers.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Claims up to `max` commands per transaction (1: one at a time).
    pub fn batch(mut self, max: usize) -> Self {
        self.batch = Some(max);
        self
    }
}

/// The default number of workers per step pool.
pub const DEFAULT_WORKERS: usize = 4;
/// The default time a delivery waits for its handler's answer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A participant service: step handlers behind RabbitMQ, the outbox relay, the pruner
/// and the metrics endpoint, configured with the builder methods and run with
/// [`Participant::run`] (or [`Participant::start`] and a [`ParticipantHandle`]).
///
/// Generic over the store: [`PostgresStore`](crate::PostgresStore),
/// [`SqliteStore`](crate::SqliteStore) or any [`InboxStore`]. Nothing is checked or
/// connected before `start`; then every setting is checked first, with a typed
/// [`ParticipantError`] naming what is wrong.
pub struct Participant<S: InboxStore> {
    store: S,
    transport: Transport,
    inbox: InboxConfig,
    clock: Option<SharedClock>,
    steps: Vec<Step<S>>,
    workers: usize,
    timeout: Duration,
    relay: Option<(RelayConfig, SpawnRelay<S>)>,
    pruner: Option<PrunerSettings>,
    metrics_addr: Option<String>,
    migrate: bool,
}

/// A hosted step as configured: its name not yet checked.
struct Step<S> {
    name: String,
    options: StepOptions,
    host: Box<dyn HostStep<S>>,
}

/// A step handler of any type, to be started as a pool: erases the handler's type so
/// that one participant hosts handlers of different types.
trait HostStep<S>: Send {
    fn spawn<'a>(
        self: Box<Self>,
        guard: InboxGuard<S>,
        consumer_type: ConsumerType,
        workers: usize,
        queue_limit: usize,
        supervision: &'a Supervision,
    ) -> BoxFuture<'a, Result<StepPool, SpawnErr>>;
}

struct Hosted<H>(H);

impl<S: InboxStore, H: StepHandler<S::Db>> HostStep<S> for Hosted<H> {
    fn spawn<'a>(
        self: Box<Self>,
        guard: InboxGuard<S>,
        consumer_type: ConsumerType,
        workers: usize,
        queue_limit: usize,
        supervision: &'a Supervision,
    ) -> BoxFuture<'a, Result<StepPool, SpawnErr>> {
        let config = StepPoolConfig { workers };
        Box::pin(StepPool::spawn_bounded(
            guard,
            consumer_type,
            self.0,
            config,
            queue_limit,
            supervision,
        ))
    }
}

/// Starts the relay over the participant's store: set by [`Participant::relay`], where
/// the store is known to be an outbox source, so that the participant itself needs no
/// such bound.
type SpawnRelay<S> = for<'a> fn(
    S,
    Transport,
    RelayConfig,
    &'a Supervision,
) -> BoxFuture<'a, Result<ActorRef<RelayMessage>, SpawnErr>>;

fn spawn_relay<'a, P>(
    source: P,
    transport: Transport,
    config: RelayConfig,
    supervision: &'a Supervision,
) -> BoxFuture<'a, Result<ActorRef<RelayMessage>, SpawnErr>>
where
    P: OutboxSource,
    Relay<P>: Actor<Msg = RelayMessage, Arguments = RelayArguments<P>>,
{
    Box::pin(async move {
        let arguments = RelayArguments {
            source,
            transport,
            config,
        };
        let (relay, _) = supervision.spawn(RELAY, Relay::new(), arguments).await?;
        Ok(relay)
    })
}

/// A clock given to [`Participant::clock`], shared by every guard the participant makes.
#[derive(Debug, Clone)]
struct SharedClock(Arc<dyn Clock>);

impl Clock for SharedClock {
    fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.0.now()
    }
}

impl<S: InboxStore> fmt::Debug for Participant<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Participant")
            .field("store", &self.store)
            .field("broker", &self.transport.broker())
            .field("prefix", &self.transport.prefix())
            .field(
                "steps",
                &self
                    .steps
                    .iter()
                    .map(|step| (&step.name, &step.options))
                    .collect::<Vec<_>>(),
            )
            .field("workers", &self.workers)
            .field("timeout", &self.timeout)
            .field("relay", &self.relay.as_ref().map(|(config, _)| config))
            .field("pruner", &self.pruner)
            .field("metrics_addr", &self.metrics_addr)
            .field("migrate", &self.migrate)
            .finish_non_exhaustive()
    }
}

/// A step's settings once checked.
struct Checked {
    consumer_type: ConsumerType,
    workers: usize,
    timeout: Duration,
    batch: usize,
}

impl<S: InboxStore + Clone> Participant<S> {
    /// A participant on `store` (the inbox, the handlers' tables and the outbox live in
    /// its database) and the broker in `transport` (an
    /// [`AmqpConfig`](crate::amqp::AmqpConfig), a `nats::NatsConfig` (feature `nats`)
    /// or [`Transport::from_url`]: its URL, prefix, prefetch).
    pub fn new(store: S, transport: impl Into<Transport>) -> Self {
        Self {
            store,
            transport: transport.into(),
            inbox: InboxConfig::default(),
            clock: None,
            steps: Vec::new(),
            workers: DEFAULT_WORKERS,
            timeout: DEFAULT_TIMEOUT,
            relay: None,
            pruner: None,
            metrics_addr: None,
            migrate: true,
        }
    }

    /// Hosts `handler` as `consumer_type`: consumes `<prefix>.<consumer_type>`, every
    /// kind of message, and deduplicates under that consumer type.
    pub fn step<H: StepHandler<S::Db>>(self, consumer_type: impl Into<String>, handler: H) -> Self {
        self.step_with(consumer_type, handler, StepOptions::default())
    }

    /// [`Participant::step`] with options: the kinds it takes, its own workers or
    /// timeout.
    pub fn step_with<H: StepHandler<S::Db>>(
        mut self,
        consumer_type: impl Into<String>,
        handler: H,
        options: StepOptions,
    ) -> Self {
        self.steps.push(Step {
            name: consumer_type.into(),
            options,
            host: Box::new(Hosted(handler)),
        });
        self
    }

    /// Workers per step pool (a step's [`StepOptions::workers`] overrides it). Each
    /// worker holds a database connection while it runs a handler: size the store's pool
    /// for the workers of every step. Defaults to [`DEFAULT_WORKERS`].
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// How long a delivery waits for its handler's answer before it is requeued (the
    /// handler may still finish; the redelivery then finds its result in the inbox).
    /// Defaults to [`DEFAULT_TIMEOUT`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The inbox's settings: TTL, broker retention, partitions ahead. Defaults to
    /// [`InboxConfig::default`].
    pub fn inbox(mut self, config: InboxConfig) -> Self {
        self.inbox = config;
        self
    }

    /// Uses `clock` for processing times, expiry and pruning (a
    /// [`ManualClock`](crate::ManualClock) or [`ScaledClock`](crate::ScaledClock) in
    /// tests and soak runs). Defaults to the system clock.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(SharedClock(Arc::new(clock)));
        self
    }

    /// Runs the outbox relay: rows the handlers write with
    /// [`OutboxWriter`](crate::outbox::OutboxWriter) are published to
    /// `<prefix>.<destination>` with confirms. Off by default.
    pub fn relay(mut self, config: RelayConfig) -> Self
    where
        S: OutboxSource,
        Relay<S>: Actor<Msg = RelayMessage, Arguments = RelayArguments<S>>,
    {
        self.relay = Some((config, spawn_relay::<S>));
        self
    }

    /// Runs the pruner: the coming months' partitions created ahead, the expired ones
    /// dropped whole. Off by default (another process may prune).
    pub fn pruner(mut self, settings: PrunerSettings) -> Self {
        self.pruner = Some(settings);
        self
    }

    /// Serves the metrics as Prometheus text at `http://ADDR/metrics` (`HOST:PORT`).
    /// The recorder is global: one endpoint per process, and it stays up after the
    /// participant stops. Off by default.
    #[cfg(feature = "prometheus")]
    #[cfg_attr(docsrs, doc(cfg(feature = "prometheus")))]
    pub fn metrics_addr(mut self, addr: impl Into<String>) -> Self {
        self.metrics_addr = Some(addr.into());
        self
    }

    /// Does not run the inbox's migrations and partition creation at start (they run
    /// elsewhere, e.g. `sagabox migrate` in a deploy step). They run by default.
    pub fn skip_migrations(mut self) -> Self {
        self.migrate = false;
        self
    }

    /// Checks every setting without connecting to anything.
    pub fn validate(&self) -> Result<(), ParticipantError> {
        self.check().map(|_| ())
    }

    fn check(&self) -> Result<Vec<Checked>, ParticipantError> {
        if self.steps.is_empty() {
            return Err(ParticipantError::NoSteps);
        }
        self.inbox.validate()?;
        // Queues and streams are declared with the inbox's broker retention, and checked
        // against its TTL.
        self.transport
            .clone()
            .with_retention_of(&self.inbox)
            .validate()?;
        let mut seen = HashSet::new();
        let mut checked = Vec::with_capacity(self.steps.len());
        for step in &self.steps {
            let consumer_type = ConsumerType::new(step.name.clone()).map_err(|source| {
                ParticipantError::InvalidConsumerType {
                    name: step.name.clone(),
                    source,
                }
            })?;
            if !seen.insert(consumer_type.clone()) {
                return Err(ParticipantError::DuplicateConsumerType(consumer_type));
            }
            let workers = step.options.workers.unwrap_or(self.workers);
            if workers == 0 {
                return Err(ParticipantError::ZeroWorkers { consumer_type });
            }
            let timeout = step.options.timeout.unwrap_or(self.timeout);
            if timeout.is_zero() {
                return Err(ParticipantError::ZeroTimeout { consumer_type });
            }
            if step.options.kinds.iter().any(|kind| kind.trim().is_empty()) {
                return Err(ParticipantError::EmptyKind { consumer_type });
            }
            let batch = step.options.batch.unwrap_or(1);
            let prefetch = usize::from(self.transport.prefetch());
            if batch == 0 || batch > prefetch {
                return Err(ParticipantError::InvalidBatch {
                    consumer_type,
                    batch,
                    prefetch,
                });
            }
            checked.push(Checked {
                consumer_type,
                workers,
                timeout,
                batch,
            });
        }
        if let Some((config, _)) = &self.relay
            && (config.batch < 1 || config.poll_interval.is_zero())
        {
            return Err(ParticipantError::InvalidRelay(format!(
                "batch is {} and poll_interval {:?}: the batch must be at least 1 and the \
                 interval above zero",
                config.batch, config.poll_interval
            )));
        }
        if self
            .pruner
            .as_ref()
            .is_some_and(|pruner| pruner.interval.is_zero())
        {
            return Err(ParticipantError::ZeroPrunerInterval);
        }
        Ok(checked)
    }

    /// Checks the settings, prepares the inbox, starts every part and returns at once
    /// with a handle to stop it. On an error nothing is left running.
    pub async fn start(self) -> Result<ParticipantHandle, ParticipantError> {
        let checked = self.check()?;
        let prefetch = usize::from(self.transport.prefetch());
        for step in &checked {
            if step.workers > prefetch {
                tracing::warn!(
                    consumer_type = %step.consumer_type,
                    workers = step.workers,
                    prefetch,
                    "more workers than the prefetch: the broker never hands this step enough \
                     deliveries to keep them all busy"
                );
            }
        }
        #[cfg(feature = "prometheus")]
        let metrics_addr = match &self.metrics_addr {
            Some(addr) => Some(crate::metrics::install_prometheus(addr)?),
            None => None,
        };
        #[cfg(not(feature = "prometheus"))]
        let metrics_addr = None;

        let inbox = self.inbox.clone();
        let mut guard = InboxGuard::new(self.store.clone(), self.inbox)?;
        if let Some(clock) = self.clock {
            guard = guard.with_clock(clock);
        }
        if self.migrate {
            guard.migrate().await?;
        }
        // The broker before any actor: one out of reach fails the start with nothing to
        // stop (actors stopped right before the process exits race the runtime's shutdown).
        let transport = self.transport.with_retention_of(&inbox);
        crate::transport::Sender::connect(&transport, "participant start")
            .await?
            .close()
            .await;
        let supervision = Supervision::start()
            .await
            .map_err(|source| ParticipantError::Spawn {
                actor: "supervisor".into(),
                source,
            })?;
        let mut handle = ParticipantHandle::new(supervision, metrics_addr);
        handle.watch_database(crate::health::global().store(&self.store));
        match Self::start_parts(
            &mut handle,
            guard,
            self.store,
            transport,
            self.steps,
            checked,
            self.relay,
            self.pruner,
        )
        .await
        {
            Ok(()) => {
                handle.log_started();
                Ok(handle)
            }
            Err(error) => {
                // Whatever started goes again: no consumer or actor outlives a failed start.
                let _ = handle.shutdown().await;
                Err(error)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn start_parts(
        handle: &mut ParticipantHandle,
        guard: InboxGuard<S>,
        store: S,
        transport: Transport,
        steps: Vec<Step<S>>,
        checked: Vec<Checked>,
        relay: Option<(RelayConfig, SpawnRelay<S>)>,
        pruner: Option<PrunerSettings>,
    ) -> Result<(), ParticipantError> {
        // The pools' queues hold at most what the broker lets the consumer hold.
        let queue_limit = usize::from(transport.prefetch());
        for (step, checked) in steps.into_iter().zip(checked) {
            let label = format!("step pool {}", checked.consumer_type);
            let pool = step
                .host
                .spawn(
                    guard.clone(),
                    checked.consumer_type.clone(),
                    checked.workers,
                    queue_limit,
                    handle.supervision(),
                )
                .await
                .map_err(|source| ParticipantError::Spawn {
                    actor: label.clone(),
                    source,
                })?;
            let cell = pool.cell();
            let queue = transport.destination(pool.consumer_type());
            let consumer = transport::serve_step(
                &transport,
                Arc::new(pool),
                step.options.kinds.into_iter().collect(),
                checked.timeout,
                checked.batch,
                guard.config(),
            )
            .await?;
            handle.add_step(
                checked.consumer_type,
                queue,
                checked.workers,
                (label, cell),
                consumer,
            );
        }
        if let Some((config, spawn)) = relay {
            let relay = spawn(store, transport, config, handle.supervision())
                .await
                .map_err(|source| ParticipantError::Spawn {
                    actor: RELAY.into(),
                    source,
                })?;
            handle.set_relay(relay);
        }
        if let Some(settings) = pruner {
            let tally = Arc::new(Mutex::new(PrunerReport::default()));
            let arguments = PrunerArguments {
                maintenance: Tallied::new(guard, Arc::clone(&tally)),
                interval: settings.interval,
            };
            let (pruner, _) = handle
                .supervision()
                .spawn(PRUNER, Pruner::new(), arguments)
                .await
                .map_err(|source| ParticipantError::Spawn {
                    actor: PRUNER.into(),
                    source,
                })?;
            handle.set_pruner(pruner, tally);
        }
        Ok(())
    }

    /// Starts the participant and runs it until `shutdown` resolves, then stops it in
    /// order (see [`ParticipantHandle::stop`]) and reports what it did. Ends early with
    /// [`ParticipantError::ActorDied`] (or
    /// [`ConsumerEnded`](ParticipantError::ConsumerEnded)) if a part dies.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<ParticipantReport, ParticipantError> {
        self.start().await?.run_until(shutdown).await
    }
}
