//! How the demo's orchestrator reaches its steps: step pools in this process, or
//! RabbitMQ ([`DemoDispatch`]); and [`serve`], the participants (and an orchestrator
//! that resumes unfinished sagas) as a long-running process behind `sagabox serve`.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::{Checkout, DemoError};
use sagabox::Envelope;
use sagabox::envelope::ConsumerType;
use sagabox::inbox::InboxGuard;
use sagabox::orchestrator::{Dispatch, InProcess};
use sagabox::saga::SagaDefinition;
use sagabox::step::{StepFailure, StepHandler, StepPool, StepPoolConfig, StepReply};
use sagabox::store::InboxStore;
use sagabox::supervisor::Supervision;

use sagabox::amqp::{AmqpConfig, AmqpDispatch, ConsumerHandle, serve_step, serve_step_batched};

/// The log target of `serve`'s lifecycle lines (up, stopping, stopped), which
/// the default log filter of the `sagabox` command shows at `info`.
pub const SERVE_TARGET: &str = "sagabox::serve";

/// The consumer type the orchestrator's replies are deduplicated as.
pub const ORCHESTRATOR: &str = "orchestrator";

/// The message kinds `consumer_type` takes in `definition`: its steps' commands and
/// compensations.
pub fn kinds_of(definition: &SagaDefinition, consumer_type: &ConsumerType) -> BTreeSet<String> {
    definition
        .steps()
        .iter()
        .filter(|step| step.consumer_type() == consumer_type)
        .flat_map(|step| {
            std::iter::once(step.command().to_owned()).chain(step.compensation().map(str::to_owned))
        })
        .collect()
}

/// The longest timeout of `consumer_type`'s steps: how long a served command may take.
fn timeout_of(definition: &SagaDefinition, consumer_type: &ConsumerType) -> Duration {
    definition
        .steps()
        .iter()
        .filter(|step| step.consumer_type() == consumer_type)
        .map(|step| step.timeout())
        .max()
        .unwrap_or(Duration::from_secs(5))
}

/// Step pools in this process, one per role in `roles`.
async fn spawn_pools<S>(
    guard: &InboxGuard<S>,
    roles: &[ConsumerType],
    handler: &Checkout,
    pool_config: &StepPoolConfig,
    supervision: &Supervision,
) -> Result<Vec<StepPool>, DemoError>
where
    S: InboxStore,
    Checkout: StepHandler<S::Db>,
{
    let mut pools = Vec::with_capacity(roles.len());
    for role in roles {
        let pool = StepPool::spawn_supervised(
            guard.clone(),
            role.clone(),
            handler.clone(),
            pool_config.clone(),
            supervision,
        )
        .await
        .map_err(|e| DemoError::Actor(e.to_string()))?;
        pools.push(pool);
    }
    Ok(pools)
}

/// Participants served over RabbitMQ: each role's step pool behind its queue.
#[derive(Debug)]
pub struct Participants {
    consumers: Vec<ConsumerHandle>,
    pools: Vec<Arc<StepPool>>,
}

impl Participants {
    /// Starts a step pool and a consumer of its queue for every role; with `batch` > 1,
    /// the commands a consumer holds at once are claimed in batches of up to `batch`.
    #[allow(clippy::too_many_arguments)]
    pub async fn start<S>(
        guard: &InboxGuard<S>,
        definition: &SagaDefinition,
        roles: &[ConsumerType],
        handler: &Checkout,
        pool_config: &StepPoolConfig,
        amqp: &AmqpConfig,
        batch: usize,
        supervision: &Supervision,
    ) -> Result<Self, DemoError>
    where
        S: InboxStore,
        Checkout: StepHandler<S::Db>,
    {
        let mut participants = Self {
            consumers: Vec::new(),
            pools: Vec::new(),
        };
        for pool in spawn_pools(guard, roles, handler, pool_config, supervision).await? {
            let role = pool.consumer_type().clone();
            let pool = Arc::new(pool);
            let (kinds, timeout) = (kinds_of(definition, &role), timeout_of(definition, &role));
            let consumer = if batch > 1 {
                serve_step_batched(
                    amqp.clone(),
                    Arc::clone(&pool),
                    kinds,
                    timeout,
                    batch,
                    Duration::from_millis(2),
                )
                .await?
            } else {
                serve_step(amqp.clone(), Arc::clone(&pool), kinds, timeout).await?
            };
            participants.consumers.push(consumer);
            participants.pools.push(pool);
        }
        Ok(participants)
    }

    /// Stops consuming (in-flight commands finish and are acked), then the pools.
    pub async fn stop(self) {
        for consumer in self.consumers {
            consumer.stop().await;
        }
        for pool in self.pools {
            if let Ok(pool) = Arc::try_unwrap(pool) {
                pool.stop().await;
            }
        }
    }
}

/// The demo's [`Dispatch`]: step pools in process, or RabbitMQ.
#[derive(Debug)]
#[non_exhaustive]
pub enum DemoDispatch {
    /// Step pools in this process.
    InProcess(InProcess),
    /// Commands and replies through RabbitMQ; participants in this process too unless
    /// they run elsewhere (`sagabox serve`).
    Amqp {
        /// The orchestrator's side.
        dispatch: Box<AmqpDispatch>,
        /// Participants served from this process, if any.
        participants: Option<Participants>,
    },
}

impl DemoDispatch {
    /// Builds the dispatch `transport` asks for. `None` is in process.
    pub(super) async fn start<S>(
        guard: &InboxGuard<S>,
        definition: &SagaDefinition,
        handler: &Checkout,
        pool_config: &StepPoolConfig,
        transport: Option<&crate::DemoTransport>,
        supervision: &Supervision,
    ) -> Result<Self, DemoError>
    where
        S: InboxStore,
        Checkout: StepHandler<S::Db>,
    {
        let roles: Vec<ConsumerType> = definition
            .steps()
            .iter()
            .map(|step| step.consumer_type().clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        match transport {
            None => {
                let mut dispatch = InProcess::new();
                for pool in spawn_pools(guard, &roles, handler, pool_config, supervision).await? {
                    dispatch = dispatch.with_pool(pool);
                }
                Ok(DemoDispatch::InProcess(dispatch))
            }
            Some(transport) => {
                let amqp = transport.amqp();
                let participants = if transport.external_participants {
                    None
                } else {
                    Some(
                        Participants::start(
                            guard,
                            definition,
                            &roles,
                            handler,
                            pool_config,
                            &amqp,
                            1,
                            supervision,
                        )
                        .await?,
                    )
                };
                let dispatch = AmqpDispatch::connect(
                    amqp,
                    guard.clone(),
                    ConsumerType::new(ORCHESTRATOR)
                        .map_err(|e| DemoError::Config(e.to_string()))?,
                )
                .await?;
                Ok(DemoDispatch::Amqp {
                    dispatch: Box::new(dispatch),
                    participants,
                })
            }
        }
    }

    /// Stops whatever this process runs.
    pub async fn stop(self) {
        match self {
            DemoDispatch::InProcess(dispatch) => dispatch.stop().await,
            DemoDispatch::Amqp {
                dispatch,
                participants,
            } => {
                dispatch.stop().await;
                if let Some(participants) = participants {
                    participants.stop().await;
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
            DemoDispatch::Amqp { dispatch, .. } => {
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
    /// Also run an orchestrator that resumes unfinished checkout sagas.
    pub orchestrator: bool,
    /// The broker and queue settings.
    pub amqp: AmqpConfig,
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
}

/// Serves `config.roles` (and an orchestrator, if asked) on the database at `url` until
/// `shutdown` resolves; then stops consuming, lets in-flight messages finish, and
/// returns.
pub async fn serve(
    url: &str,
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), DemoError> {
    use sagabox::database::{Backend, redact};
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
    config.amqp.validate()?;
    // One connection per step worker, a few for setup, and the orchestrator's drivers.
    let orchestrator_connections = if config.orchestrator { 16 } else { 0 };
    let connections = u32::try_from(
        config.workers.saturating_mul(config.roles.len()) + 2 + orchestrator_connections,
    )
    .unwrap_or(32)
    .min(64);
    match Backend::of(url)? {
        Backend::Postgres => {
            let store = sagabox::PostgresStore::connect(url, connections).await?;
            sqlx::raw_sql(crate::POSTGRES_TABLES)
                .execute(store.pool())
                .await?;
            serve_on(store, &redact(url), config, shutdown).await
        }
        Backend::Sqlite => {
            let store = sagabox::SqliteStore::connect(url, connections.min(8)).await?;
            sqlx::raw_sql(crate::SQLITE_TABLES)
                .execute(store.pool())
                .await?;
            serve_on(store, &redact(url), config, shutdown).await
        }
        #[allow(unreachable_patterns)]
        _ => Err(sagabox::InboxError::UnsupportedUrl(redact(url)).into()),
    }
}

async fn serve_on<S>(
    store: S,
    database: &str,
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), DemoError>
where
    S: InboxStore + sagabox::saga::SagaStore,
    Checkout: StepHandler<<S as InboxStore>::Db>,
{
    use sagabox::inbox::{InboxConfig, InboxError};
    use sagabox::orchestrator::{
        DriveStats, Orchestrator, OrchestratorArguments, OrchestratorMessage,
    };

    let definition = Arc::new(SagaDefinition::from_toml_str(crate::CHECKOUT_TOML)?);
    let guard = InboxGuard::new(store.clone(), InboxConfig::default()).map_err(InboxError::from)?;
    guard.migrate().await?;
    let handler = Checkout::new(config.fail_rate, config.seed);
    // Every actor of the process is linked to one supervisor: if one dies, `serve`
    // ends with its cause rather than go on half-working.
    let supervision = Supervision::start()
        .await
        .map_err(|e| DemoError::Actor(e.to_string()))?;
    let pool_config = StepPoolConfig {
        workers: config.workers.max(1),
    };
    let participants = Participants::start(
        &guard,
        &definition,
        &config.roles,
        &handler,
        &pool_config,
        &config.amqp,
        config.batch,
        &supervision,
    )
    .await?;
    let orchestrator = if config.orchestrator {
        let dispatch = AmqpDispatch::connect(
            config.amqp.clone(),
            guard.clone(),
            ConsumerType::new(ORCHESTRATOR).map_err(|e| DemoError::Config(e.to_string()))?,
        )
        .await?;
        let dispatch = Arc::new(dispatch);
        let (actor, handle) = supervision
            .spawn(
                "orchestrator",
                Orchestrator::new(),
                OrchestratorArguments {
                    definition: Arc::clone(&definition),
                    store: store.clone(),
                    dispatch: Arc::clone(&dispatch),
                    stats: Arc::new(DriveStats::default()),
                },
            )
            .await
            .map_err(|e| DemoError::Actor(e.to_string()))?;
        Some((actor, handle, dispatch))
    } else {
        None
    };
    // The lifecycle lines have a target of their own, which the default log filter lets
    // through: an operator sees that the process is up, and on what, without RUST_LOG.
    let queues: Vec<String> = config
        .roles
        .iter()
        .map(|role| config.amqp.queue(role))
        .collect();
    tracing::info!(
        target: SERVE_TARGET,
        version = env!("CARGO_PKG_VERSION"),
        database,
        broker = %sagabox::database::redact(&config.amqp.url),
        queues = %sagabox::logging::json_list(&queues),
        orchestrator = config.orchestrator,
        workers = config.workers,
        prefetch = config.amqp.prefetch,
        batch = config.batch,
        "serving"
    );
    let resume = async {
        let Some((actor, _, _)) = &orchestrator else {
            return std::future::pending::<()>().await;
        };
        loop {
            match ractor::call!(actor, OrchestratorMessage::ResumeAll) {
                Ok(Ok(started)) if started > 0 => tracing::debug!(started, "resumed sagas"),
                Ok(Ok(_)) => {}
                Ok(Err(error)) => tracing::warn!(%error, "resuming sagas failed"),
                Err(error) => tracing::warn!(%error, "the orchestrator did not answer"),
            }
            tokio::time::sleep(config.resume_interval).await;
        }
    };
    let died = tokio::select! {
        _ = shutdown => None,
        _ = resume => None,
        died = supervision.died() => Some(died),
    };
    tracing::info!(
        target: SERVE_TARGET,
        "stopping: finishing the messages in flight"
    );
    if let Some((actor, handle, dispatch)) = orchestrator {
        actor.stop(None);
        let _ = handle.await;
        dispatch.stop().await;
    }
    participants.stop().await;
    supervision.stop().await;
    match died {
        Some(died) => {
            tracing::error!(target: SERVE_TARGET, %database, %died, "stopped");
            Err(died.into())
        }
        None => {
            tracing::info!(target: SERVE_TARGET, %database, "stopped");
            Ok(())
        }
    }
}
