//! How the demo's orchestrator reaches its steps: step pools in this process, or a
//! broker — RabbitMQ or NATS JetStream ([`DemoDispatch`]); and [`serve`], the participants (and an orchestrator
//! for checkout sagas) as a long-running service behind `sagabox serve`, on the
//! library's [`Participant`] runtime and [`orchestrate`].

use std::future::Future;
use std::time::Duration;

use sagabox::clock::Clock;
use sagabox::database::{AnyStore, OnStore, Store};
use sagabox::envelope::ConsumerType;
use sagabox::inbox::{InboxConfig, InboxGuard};
use sagabox::logging::redact;
use sagabox::orchestrate::{OrchestrateConfig, orchestrate};
use sagabox::orchestrator::{Dispatch, InProcess};
use sagabox::participant::{PrunerSettings, StepOptions};
use sagabox::relay::{OutboxSource, Relay, RelayArguments, RelayConfig, RelayMessage};
use sagabox::saga::{SagaDefinition, SagaStore};
use sagabox::step::{StepFailure, StepHandler, StepPool, StepPoolConfig, StepReply};
use sagabox::store::InboxStore;
use sagabox::supervisor::Supervision;
use sagabox::transport::{Dispatcher, Transport};
use sagabox::{Envelope, Participant, ParticipantHandle};

use crate::{CheckoutStep, CheckoutTables, DemoError, FailAfterWrite};

/// The log target of `serve`'s lifecycle lines (up, stopping, stopped), which
/// the default log filter of the `sagabox` command shows at `info`.
pub const SERVE_TARGET: &str = "sagabox::serve";

/// The consumer type the orchestrator's replies are deduplicated as.
pub const ORCHESTRATOR: &str = sagabox::orchestrate::ORCHESTRATOR_CONSUMER;

/// The handler of `role`, failing `fail_rate` of its runs after the write. Each role
/// draws its failures from a seed of its own.
fn handler_of(
    role: &ConsumerType,
    fail_rate: f64,
    seed: u64,
) -> Result<FailAfterWrite<CheckoutStep>, DemoError> {
    let step = CheckoutStep::of(role.as_str()).ok_or_else(|| {
        DemoError::Config(format!(
            "no checkout participant is called {role}: the roles are payment, inventory and email"
        ))
    })?;
    let salt = role
        .as_str()
        .bytes()
        .fold(0u64, |hash, byte| hash.rotate_left(5) ^ u64::from(byte));
    Ok(FailAfterWrite::new(step, fail_rate, seed ^ salt))
}

/// The checkout participants on the [`Participant`] runtime: `roles`, each behind its
/// queue, taking the kinds `definition` gives it.
fn participant<S>(
    store: S,
    transport: Transport,
    definition: &SagaDefinition,
    roles: &[ConsumerType],
    fail_rate: f64,
    seed: u64,
    batch: usize,
) -> Result<Participant<S>, DemoError>
where
    S: InboxStore + Clone,
    CheckoutStep: StepHandler<S::Db>,
{
    let mut participant = Participant::new(store, transport);
    for role in roles {
        let options = StepOptions::default()
            .kinds(definition.kinds_for(role))
            .timeout(
                definition
                    .timeout_for(role)
                    .unwrap_or(Duration::from_secs(5)),
            )
            .batch(batch);
        participant =
            participant.step_with(role.as_str(), handler_of(role, fail_rate, seed)?, options);
    }
    Ok(participant)
}

/// The demo's [`Dispatch`]: step pools in process, or a broker.
#[derive(Debug)]
#[non_exhaustive]
pub enum DemoDispatch {
    /// Step pools in this process.
    InProcess(InProcess),
    /// Commands and replies through a broker; participants in this process too unless
    /// they run elsewhere (`sagabox serve`).
    Broker {
        /// The orchestrator's side.
        dispatch: Box<Dispatcher>,
        /// The participants served from this process, if any.
        participants: Option<ParticipantHandle>,
    },
}

impl DemoDispatch {
    /// Builds the dispatch `transport` asks for (`None`: in process), each step claiming
    /// in batches of up to `claim_batch` (the participants behind a broker too, when
    /// this process runs them), with the step handlers failing `fail_rate` of their runs
    /// after the write.
    pub(crate) async fn start<S>(
        guard: &InboxGuard<S>,
        clock: impl Clock,
        definition: &SagaDefinition,
        (fail_rate, seed): (f64, u64),
        claim_batch: usize,
        transport: Option<&crate::DemoTransport>,
        supervision: &Supervision,
    ) -> Result<Self, DemoError>
    where
        S: InboxStore + Clone,
        CheckoutStep: StepHandler<S::Db>,
    {
        let roles = definition.consumer_types();
        let Some(transport) = transport else {
            let mut dispatch = InProcess::new();
            for role in &roles {
                let pool = StepPool::spawn_supervised(
                    guard.clone(),
                    role.clone(),
                    handler_of(role, fail_rate, seed)?,
                    StepPoolConfig { workers: 4 },
                    supervision,
                )
                .await
                .map_err(|e| DemoError::Actor(e.to_string()))?;
                dispatch = if claim_batch > 1 {
                    dispatch.with_batched_pool(pool, claim_batch)
                } else {
                    dispatch.with_pool(pool)
                };
            }
            return Ok(DemoDispatch::InProcess(dispatch));
        };
        let broker = transport.transport()?;
        let participants = if transport.external_participants {
            None
        } else {
            let participant = participant(
                guard.store().clone(),
                broker.clone(),
                definition,
                &roles,
                fail_rate,
                seed,
                claim_batch,
            )?
            .clock(clock)
            .workers(4)
            .skip_migrations();
            Some(participant.start().await?)
        };
        let dispatch = Dispatcher::connect(
            &broker,
            ConsumerType::new(ORCHESTRATOR).map_err(|e| DemoError::Config(e.to_string()))?,
        )
        .await?;
        Ok(DemoDispatch::Broker {
            dispatch: Box::new(dispatch),
            participants,
        })
    }

    /// Resolves when the participants this process serves fail (never for step pools in
    /// process, which report to the run's supervision).
    pub(crate) async fn failed(&self) -> DemoError {
        match self {
            DemoDispatch::Broker {
                participants: Some(participants),
                ..
            } => participants.failed().await.into(),
            _ => std::future::pending().await,
        }
    }

    /// Stops whatever this process runs.
    pub async fn stop(self) {
        match self {
            DemoDispatch::InProcess(dispatch) => dispatch.stop().await,
            DemoDispatch::Broker {
                dispatch,
                participants,
            } => {
                dispatch.stop().await;
                if let Some(participants) = participants
                    && let Err(error) = participants.stop().await
                {
                    tracing::warn!(%error, "the demo's participants did not stop cleanly");
                }
            }
        }
    }
}

impl Dispatch for DemoDispatch {
    async fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        envelope: Envelope,
        timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        match self {
            DemoDispatch::InProcess(dispatch) => {
                dispatch.dispatch(consumer_type, envelope, timeout).await
            }
            DemoDispatch::Broker { dispatch, .. } => {
                dispatch.dispatch(consumer_type, envelope, timeout).await
            }
        }
    }
}

/// What `sagabox serve` runs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The step roles to serve (`payment`, `inventory`, `email`).
    pub roles: Vec<ConsumerType>,
    /// Also run an orchestrator for checkout sagas: it takes start messages on
    /// `<prefix>.checkout.start` and resumes unfinished sagas.
    pub orchestrator: bool,
    /// The broker and its queue or subject settings.
    pub transport: Transport,
    /// Workers per step pool.
    pub workers: usize,
    /// Share of handler runs failing after their write, before commit (fault injection).
    pub fail_rate: f64,
    /// Seed of the injected failures.
    pub seed: u64,
    /// How often the orchestrator looks for unfinished sagas.
    pub resume_interval: Duration,
    /// Commands claimed per batch (1: one at a time). Raise the prefetch with it.
    pub batch: usize,
    /// The inbox's TTL, the broker's retention it is checked against, and the months
    /// the pruner creates ahead.
    pub inbox: InboxConfig,
    /// Time between the pruner's passes (the first runs at start; one instance at a
    /// time does the work).
    pub prune_interval: Duration,
    /// The database pool's size; `None`: one connection per step worker, 4 for the
    /// relay, the pruner and setup, and 16 for the orchestrator's drivers, at most 64.
    pub pool_size: Option<u32>,
    /// The PostgreSQL schema of sagabox's tables (SQLite has none).
    pub schema: sagabox::Schema,
}

/// Serves `config.roles` (and an orchestrator, if asked) on the database at `url` until
/// `shutdown` resolves: the participants with the outbox relay and the elected pruner.
/// Then it stops consuming, lets in-flight messages finish, and returns.
pub async fn serve(
    url: &str,
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), DemoError> {
    if !(0.0..1.0).contains(&config.fail_rate) {
        return Err(DemoError::Config(format!(
            "--fail-rate must be within 0..1, got {}",
            config.fail_rate
        )));
    }
    if config.roles.is_empty() && !config.orchestrator {
        return Err(DemoError::Config(
            "nothing to serve: give --role payment, inventory, email, orchestrator or all".into(),
        ));
    }
    config.transport.validate()?;
    // One connection per step worker, the relay's and the pruner's, a few for setup,
    // and the orchestrator's drivers.
    let orchestrator_connections = if config.orchestrator { 16 } else { 0 };
    let connections = config.pool_size.unwrap_or_else(|| {
        u32::try_from(
            config.workers.saturating_mul(config.roles.len()) + 4 + orchestrator_connections,
        )
        .unwrap_or(32)
        .min(64)
    });
    AnyStore::connect(url, connections, &config.schema)
        .await?
        .run(Serve {
            database: redact(url),
            config,
            shutdown,
        })
        .await
}

/// [`serve`]'s work on the store the URL named.
struct Serve<F> {
    database: String,
    config: ServeConfig,
    shutdown: F,
}

impl<S, F> OnStore<S> for Serve<F>
where
    S: Store + OutboxSource<Db = <S as InboxStore>::Db>,
    <S as InboxStore>::Db: CheckoutTables,
    for<'c> &'c mut <<S as InboxStore>::Db as sqlx::Database>::Connection:
        sqlx::Executor<'c, Database = <S as InboxStore>::Db>,
    Relay<S>: ractor::Actor<Msg = RelayMessage, Arguments = RelayArguments<S>>,
    CheckoutStep: StepHandler<<S as InboxStore>::Db>,
    F: Future<Output = ()> + Send,
{
    type Output = Result<(), DemoError>;

    async fn run(self, store: S) -> Self::Output {
        sqlx::raw_sql(<<S as InboxStore>::Db as CheckoutTables>::TABLES)
            .execute(Store::pool(&store))
            .await?;
        serve_on(store, &self.database, self.config, self.shutdown).await
    }
}

/// Why `serve` stops.
enum StopCause {
    /// The shutdown signal.
    Asked,
    /// A part of the participants died.
    Participants(sagabox::ParticipantError),
    /// The orchestrator ended by itself (an actor of it died, or the broker failed).
    Orchestrator(Result<(), sagabox::orchestrate::OrchestrateError>),
}

/// A future that resolves once `stop` says so.
async fn stopped(mut stop: tokio::sync::watch::Receiver<bool>) {
    // An error means the sender is gone, which is a stop too.
    let _ = stop.wait_for(|stop| *stop).await;
}

/// The line that says the process is up, and on what. The lifecycle lines have a target
/// of their own, which the default log filter lets through: an operator sees them
/// without RUST_LOG.
fn log_serving(database: &str, config: &ServeConfig) {
    let queues: Vec<String> = config
        .roles
        .iter()
        .map(|role| config.transport.destination(role))
        .collect();
    tracing::info!(
        target: SERVE_TARGET,
        version = env!("CARGO_PKG_VERSION"),
        database,
        broker = %sagabox::logging::redact(config.transport.url()),
        queues = %sagabox::logging::json_list(&queues),
        orchestrator = config.orchestrator,
        workers = config.workers,
        prefetch = config.transport.prefetch(),
        batch = config.batch,
        ttl_days = config.inbox.ttl.as_secs() / 86_400,
        "serving"
    );
}

async fn serve_on<S>(
    store: S,
    database: &str,
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), DemoError>
where
    S: InboxStore + SagaStore + OutboxSource + Clone,
    Relay<S>: ractor::Actor<Msg = RelayMessage, Arguments = RelayArguments<S>>,
    CheckoutStep: StepHandler<<S as InboxStore>::Db>,
{
    let definition = SagaDefinition::from_toml_str(crate::CHECKOUT_TOML)?;
    // The participant prepares the inbox; with no step to host, it is prepared here.
    let guard =
        InboxGuard::new(store.clone(), config.inbox.clone()).map_err(sagabox::InboxError::from)?;
    guard.migrate().await?;
    let participants = if config.roles.is_empty() {
        None
    } else {
        let participant = participant(
            store.clone(),
            config.transport.clone(),
            &definition,
            &config.roles,
            config.fail_rate,
            config.seed,
            config.batch,
        )?
        .workers(config.workers.max(1))
        .inbox(config.inbox.clone())
        .skip_migrations()
        .relay(RelayConfig::default())
        .pruner(PrunerSettings {
            interval: config.prune_interval,
        });
        Some(participant.start().await?)
    };
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    // Without an orchestrator role this resolves at the stop, like one that stopped.
    let orchestrating = async {
        if !config.orchestrator {
            stopped(stop_rx).await;
            return Ok(());
        }
        let orchestrate_config = OrchestrateConfig {
            definitions: vec![definition.clone()],
            transport: config.transport.clone(),
            resume_interval: config.resume_interval,
            history_retention: Some(sagabox::saga::DEFAULT_HISTORY_RETENTION),
            inbox: config.inbox.clone(),
            // The participants' pruner keeps the same inbox when they run here.
            pruner: config.roles.is_empty().then_some(PrunerSettings {
                interval: config.prune_interval,
            }),
        };
        orchestrate(store.clone(), orchestrate_config, stopped(stop_rx)).await
    };
    tokio::pin!(orchestrating);

    log_serving(database, &config);
    let participants_failed = async {
        match &participants {
            Some(participants) => participants.failed().await,
            None => std::future::pending().await,
        }
    };
    let stop_cause = tokio::select! {
        () = shutdown => StopCause::Asked,
        failed = participants_failed => StopCause::Participants(failed),
        ended = &mut orchestrating => StopCause::Orchestrator(ended),
    };
    tracing::info!(
        target: SERVE_TARGET,
        "stopping: finishing the messages in flight"
    );
    let _ = stop.send(true);
    let (failure, orchestrated) = match stop_cause {
        StopCause::Asked => (None, orchestrating.await),
        StopCause::Participants(failed) => (Some(failed.into()), orchestrating.await),
        StopCause::Orchestrator(Ok(())) => (
            Some(DemoError::Actor("the orchestrator stopped unasked".into())),
            Ok(()),
        ),
        StopCause::Orchestrator(Err(error)) => (Some(error.into()), Ok(())),
    };
    let served = match participants {
        Some(participants) => participants.stop().await.map(|_| ()),
        None => Ok(()),
    };
    // The first failure is the cause; what failed while stopping comes after it.
    let outcome = match failure {
        Some(failure) => Err(failure),
        None => orchestrated
            .map_err(DemoError::from)
            .and(served.map_err(DemoError::from)),
    };
    match &outcome {
        Ok(()) => tracing::info!(target: SERVE_TARGET, %database, "stopped"),
        Err(error) => tracing::error!(target: SERVE_TARGET, %database, %error, "stopped"),
    }
    outcome
}
