//! The orchestrator as a service: [`orchestrate`] drives the sagas of any number of
//! [`SagaDefinition`]s whose steps run in other processes, over a broker (RabbitMQ or
//! NATS JetStream, a [`Transport`]), until a shutdown future resolves.
//! `sagabox orchestrate --saga FILE` is this function.
//!
//! - One [`Orchestrator`] actor per definition, all linked to one [`Supervision`]: an
//!   actor that dies ends the service with its cause.
//! - Step commands go to `<prefix>.<consumer_type>` and replies come back on a private
//!   queue or subject ([`Dispatcher`]), `<prefix>.orchestrator.replies.<uuid>`; each saga's
//!   row records the answers its driver took.
//! - Sagas start from **start messages** on `<prefix>.<saga>.start` (see
//!   [`start_queue`]): an envelope whose `kind` is the saga's name, whose `payload` is the
//!   saga's data, with no `saga_id`. The saga's id is derived from the message id, so a
//!   start message delivered twice starts one saga
//!   ([`SagaInstance::from_start`](crate::saga::SagaInstance::from_start)). When the
//!   message has a `reply_to`, the answer is a [`STARTED_KIND`] envelope whose
//!   `saga_id` (and `payload.saga_id`) is the saga's id, correlated by the start
//!   message's id — the same answer to every delivery of it.
//! - Every `resume_interval`, each orchestrator resumes the unfinished sagas of its
//!   definition: after a crash, a restart finishes what the last process left.
//! - The orchestrator writes no inbox rows: a start message is deduplicated by its saga's
//!   id, a reply by its saga's row. With a [`pruner`](OrchestrateConfig::pruner), the
//!   inbox table of the database it migrates is kept by the same [`Pruner`] a
//!   participant runs (months created ahead, months older than the inbox's TTL
//!   dropped), for the participants that share that database.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;
use serde_json::json;

use crate::consumer::ConsumerHandle;
use crate::delivery::Disposition;
use crate::envelope::{ConsumerType, Envelope, KeyError};
use crate::inbox::{InboxConfig, InboxError, InboxGuard};
use crate::orchestrator::{Orchestrator, OrchestratorArguments, OrchestratorMessage};
use crate::pruner::{Pruner, PrunerArguments, PrunerMessage, PrunerSettings};
use crate::saga::versions::RegisterError;
use crate::saga::{SagaDefinition, SagaStore, StartError, history_pass, start_consumer};
use crate::store::InboxStore;
use crate::supervisor::{ActorDied, Supervision};
use crate::transport::{self, Dispatcher, Transport, TransportError};

/// The kind of the answer to a start message.
pub const STARTED_KIND: &str = "saga_started";

/// The name the orchestrator's private reply queues and subjects carry.
pub const ORCHESTRATOR_CONSUMER: &str = "orchestrator";

/// How long a start message waits for its orchestrator before it is requeued.
const START_WITHIN_MS: u64 = 30_000;

/// What [`orchestrate`] runs.
#[derive(Debug, Clone)]
pub struct OrchestrateConfig {
    /// The sagas to drive, one orchestrator each; their names must differ.
    pub definitions: Vec<SagaDefinition>,
    /// The broker and its queue or subject settings (an
    /// [`AmqpConfig`](crate::amqp::AmqpConfig) or a
    /// `nats::NatsConfig` (feature `nats`), `.into()`).
    pub transport: Transport,
    /// How often each orchestrator looks for unfinished sagas to resume.
    pub resume_interval: Duration,
    /// How long the history of a finished saga is kept
    /// ([`DEFAULT_HISTORY_RETENTION`](crate::saga::DEFAULT_HISTORY_RETENTION) is a
    /// sensible value); `None` keeps it forever. When set, one orchestrator process at a
    /// time (the holder of the maintenance lock) prunes it every hour.
    pub history_retention: Option<Duration>,
    /// The inbox settings of the database the orchestrators migrate (they write no
    /// inbox rows themselves): the TTL its pruner drops months by, the months made
    /// ahead, and whether a broker that keeps start messages longer than the TTL may run
    /// anyway ([`InboxConfig::with_ttl_below_retention_allowed`]). A JetStream start
    /// stream's `max_age` is checked against it before consuming; a RabbitMQ queue's
    /// retention is checked against the inbox its
    /// [`AmqpConfig::retention_check`](crate::amqp::AmqpConfig::retention_check) names.
    /// [`InboxConfig::default`] suits most.
    pub inbox: InboxConfig,
    /// Runs a [`Pruner`] over the inbox table of the database, by `inbox`'s TTL and
    /// `partitions_ahead`, for the participants that share it; several processes take
    /// turns through the maintenance lock. `None` leaves it to another process.
    pub pruner: Option<PrunerSettings>,
}

/// Why [`orchestrate`] did not start or did not end cleanly.
#[derive(Debug, thiserror::Error)]
pub enum OrchestrateError {
    /// No definition was given.
    #[error("nothing to orchestrate: give at least one saga definition")]
    NoSagas,
    /// Two definitions have the same name.
    #[error(
        "saga `{0}` is defined twice: each saga name is driven by one definition; \
         rename one of them or give it once"
    )]
    DuplicateSaga(String),
    /// A saga's name cannot name its start queue.
    #[error("saga `{name}` cannot name its start queue: {source}")]
    SagaName {
        /// The saga's name.
        name: String,
        /// What is wrong with `<name>.start` as a consumer type.
        source: KeyError,
    },
    /// The resume interval is zero.
    #[error("the resume interval must be above zero")]
    ZeroResumeInterval,
    /// The broker refused or could not be reached.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The database refused or could not be reached.
    #[error(transparent)]
    Inbox(#[from] InboxError),
    /// A definition changed without a new version, or could not be stored.
    #[error(transparent)]
    Definition(#[from] RegisterError),
    /// An actor could not be started.
    #[error("could not start {what}: {reason}")]
    Spawn {
        /// Which actor.
        what: String,
        /// The spawn error.
        reason: String,
    },
    /// An actor died while serving: the service stopped.
    #[error(transparent)]
    Died(#[from] ActorDied),
}

/// The queue or subject that start messages of `saga` are sent to:
/// `<prefix>.<saga>.start`.
pub fn start_queue(transport: &Transport, saga: &str) -> Result<String, KeyError> {
    Ok(transport.destination(&start_consumer(saga)?))
}

/// Drives `config.definitions` on `store` over the broker until `shutdown` resolves,
/// then stops taking start messages, stops the orchestrators (a saga in flight is
/// resumed by the next process) and returns. Returns early, with the cause, when one of
/// its actors dies.
pub async fn orchestrate<S>(
    store: S,
    config: OrchestrateConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), OrchestrateError>
where
    S: InboxStore + SagaStore,
{
    check(&config)?;
    let guard = InboxGuard::new(store.clone(), config.inbox.clone()).map_err(InboxError::from)?;
    guard.migrate().await?;
    // The database's part in the process's readiness, for as long as this runs.
    let _database = crate::health::global().store(&store);
    let orchestrator =
        ConsumerType::new(ORCHESTRATOR_CONSUMER).map_err(|source| OrchestrateError::SagaName {
            name: ORCHESTRATOR_CONSUMER.into(),
            source,
        })?;
    let inbox = guard.config().clone();
    // The broker first: a broker out of reach then fails the start before any actor
    // exists that would have to be stopped.
    let dispatch = Arc::new(Dispatcher::connect(&config.transport, orchestrator).await?);
    let supervision = match Supervision::start().await {
        Ok(supervision) => supervision,
        Err(error) => {
            dispatch.stop().await;
            return Err(spawn_error("the supervisor", error));
        }
    };
    let mut running = Running::default();
    let started = async {
        if let Some(settings) = &config.pruner {
            running.pruner = Some(spawn_pruner(&supervision, guard, settings).await?);
        }
        start_all(
            &store,
            &config,
            &inbox,
            &dispatch,
            &supervision,
            &mut running,
        )
        .await
    }
    .await;
    let outcome = match started {
        Ok(()) => {
            tracing::info!(
                target: "sagabox::serve",
                sagas = %crate::logging::json_list(config.definitions.iter().map(SagaDefinition::name)),
                broker = %crate::logging::redact(config.transport.url()),
                "orchestrating"
            );
            let resume = resume_forever(&running.actors, config.resume_interval);
            let prune =
                prune_history_forever(&store, config.history_retention, inbox.partitions_ahead);
            tokio::select! {
                () = shutdown => Ok(()),
                () = resume => Ok(()),
                () = prune => Ok(()),
                died = supervision.died() => Err(OrchestrateError::Died(died)),
            }
        }
        Err(error) => Err(error),
    };
    for consumer in running.consumers {
        consumer.stop().await;
    }
    for actor in &running.actors {
        actor.stop(None);
    }
    if let Some(pruner) = &running.pruner {
        pruner.stop(None);
    }
    dispatch.stop().await;
    supervision.stop().await;
    tracing::info!(target: "sagabox::serve", "stopped orchestrating");
    outcome
}

fn check(config: &OrchestrateConfig) -> Result<(), OrchestrateError> {
    if config.definitions.is_empty() {
        return Err(OrchestrateError::NoSagas);
    }
    if config.resume_interval.is_zero() {
        return Err(OrchestrateError::ZeroResumeInterval);
    }
    let mut names = BTreeSet::new();
    for definition in &config.definitions {
        let name = definition.name();
        start_consumer(name).map_err(|source| OrchestrateError::SagaName {
            name: name.to_owned(),
            source,
        })?;
        if !names.insert(name) {
            return Err(OrchestrateError::DuplicateSaga(name.to_owned()));
        }
    }
    config.transport.validate()?;
    Ok(())
}

/// The actors and consumers started so far, stopped on the way out whatever happened.
#[derive(Default)]
struct Running {
    actors: Vec<ActorRef<OrchestratorMessage>>,
    consumers: Vec<ConsumerHandle>,
    pruner: Option<ActorRef<PrunerMessage>>,
}

async fn start_all<S>(
    store: &S,
    config: &OrchestrateConfig,
    inbox: &InboxConfig,
    dispatch: &Arc<Dispatcher>,
    supervision: &Supervision,
    running: &mut Running,
) -> Result<(), OrchestrateError>
where
    S: InboxStore + SagaStore,
{
    for definition in &config.definitions {
        // Each orchestrator registers its definition as it starts; registering them all
        // first refuses a changed definition before anything runs, with its own error.
        store.register_definition(definition).await?;
    }
    for definition in &config.definitions {
        let name = definition.name().to_owned();
        let label = format!("orchestrator of {name}");
        let (actor, _handle) = supervision
            .spawn(
                &label,
                Orchestrator::new(),
                OrchestratorArguments::new(
                    Arc::new(definition.clone()),
                    store.clone(),
                    Arc::clone(dispatch),
                ),
            )
            .await
            .map_err(|e| spawn_error(&label, e))?;
        running.actors.push(actor.clone());
        let start = start_consumer(&name).map_err(|source| OrchestrateError::SagaName {
            name: name.clone(),
            source,
        })?;
        let consumer = transport::consume(
            &config.transport,
            start,
            BTreeSet::from([name.clone()]),
            Some(inbox),
            move |envelope: Envelope| {
                let actor = actor.clone();
                async move { start_saga(&actor, envelope).await }
            },
        )
        .await?;
        running.consumers.push(consumer);
    }
    Ok(())
}

/// Starts the pruner of the database's inbox table under `supervision`.
async fn spawn_pruner<S: InboxStore>(
    supervision: &Supervision,
    guard: InboxGuard<S>,
    settings: &PrunerSettings,
) -> Result<ActorRef<PrunerMessage>, OrchestrateError> {
    let arguments = PrunerArguments {
        maintenance: guard,
        interval: settings.interval,
    };
    let (pruner, _) = supervision
        .spawn(crate::pruner::ACTOR, Pruner::new(), arguments)
        .await
        .map_err(|e| spawn_error(crate::pruner::ACTOR, e))?;
    Ok(pruner)
}

/// Hands a start message to its orchestrator and says how to settle it.
async fn start_saga(actor: &ActorRef<OrchestratorMessage>, start: Envelope) -> Disposition {
    let answer = ractor::call_t!(
        actor,
        OrchestratorMessage::Start,
        START_WITHIN_MS,
        start.clone()
    );
    match answer {
        Ok(Ok(saga_id)) => {
            let reply = Envelope::new(
                start.id.derived("started"),
                STARTED_KIND,
                json!({ "saga_id": saga_id, "saga": start.kind }),
            )
            .map(|reply| reply.with_saga_id(saga_id.as_str()));
            match reply {
                Ok(reply) => Disposition::Done { reply: Some(reply) },
                Err(error) => Disposition::Reject(error.to_string()),
            }
        }
        Ok(Err(error @ StartError::Store { .. })) => Disposition::Retry(error.to_string()),
        Ok(Err(error)) => Disposition::Reject(error.to_string()),
        Err(error) => Disposition::Retry(format!("the orchestrator did not answer: {error}")),
    }
}

async fn resume_forever(actors: &[ActorRef<OrchestratorMessage>], interval: Duration) {
    loop {
        for actor in actors {
            match ractor::call!(actor, OrchestratorMessage::ResumeAll) {
                Ok(Ok(started)) if started > 0 => tracing::debug!(started, "resumed sagas"),
                Ok(Ok(_)) => {}
                Ok(Err(error)) => tracing::warn!(%error, "resuming sagas failed"),
                Err(error) => tracing::warn!(%error, "the orchestrator did not answer"),
            }
        }
        tokio::time::sleep(interval).await;
    }
}

/// How often the saga history is pruned.
const HISTORY_PRUNE_INTERVAL: Duration = Duration::from_secs(3600);

/// Prunes the saga history at start and every [`HISTORY_PRUNE_INTERVAL`] (creating its
/// partitions `months_ahead`), under the history's maintenance lock so that one process
/// at a time does it (the inbox's pruner has a lock of its own); never returns.
/// Without a retention, waits forever.
async fn prune_history_forever<S: InboxStore + SagaStore>(
    store: &S,
    retention: Option<Duration>,
    months_ahead: u32,
) {
    let Some(retention) = retention else {
        return std::future::pending().await;
    };
    loop {
        match store.try_history_lock().await {
            Ok(Some(lock)) => {
                let pass =
                    history_pass(store, chrono::Utc::now(), retention, months_ahead, false).await;
                lock.release().await;
                match pass {
                    Ok(pruned) => tracing::info!(
                        target: "sagabox::serve",
                        months_dropped = %crate::logging::json_list(pruned.months_dropped.iter()),
                        rows_deleted = pruned.rows_deleted,
                        "saga history pruned"
                    ),
                    Err(error) => {
                        tracing::warn!(%error, "pruning the saga history failed; trying again in an hour")
                    }
                }
            }
            Ok(None) => tracing::debug!("another instance is pruning the saga history"),
            Err(error) => {
                tracing::warn!(%error, "cannot take the maintenance lock to prune the saga history")
            }
        }
        tokio::time::sleep(HISTORY_PRUNE_INTERVAL).await;
    }
}

fn spawn_error(what: &str, error: impl std::fmt::Display) -> OrchestrateError {
    OrchestrateError::Spawn {
        what: what.to_owned(),
        reason: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const ONE_STEP: &str = r#"
name = "ping"

[[steps]]
name = "ping"
consumer_type = "pong"
command = "ping"
timeout = "5s"
"#;

    fn config(definitions: Vec<SagaDefinition>, resume_interval: Duration) -> OrchestrateConfig {
        OrchestrateConfig {
            history_retention: None,
            inbox: InboxConfig::default(),
            pruner: None,
            definitions,
            transport: Transport::from_url("amqp://guest:guest@127.0.0.1:5672/%2f", "sagabox")
                .unwrap(),
            resume_interval,
        }
    }

    #[test]
    fn a_config_without_sagas_twice_the_same_saga_or_no_interval_is_refused() {
        let ping = SagaDefinition::from_toml_str(ONE_STEP).unwrap();
        let second = Duration::from_secs(1);
        assert!(matches!(
            check(&config(vec![], second)),
            Err(OrchestrateError::NoSagas)
        ));
        assert!(matches!(
            check(&config(vec![ping.clone(), ping.clone()], second)),
            Err(OrchestrateError::DuplicateSaga(name)) if name == "ping"
        ));
        assert!(matches!(
            check(&config(vec![ping.clone()], Duration::ZERO)),
            Err(OrchestrateError::ZeroResumeInterval)
        ));
        check(&config(vec![ping], second)).unwrap();
    }

    #[test]
    fn start_messages_have_a_queue_per_saga() {
        let amqp = Transport::from_url("amqp://localhost", "shop").unwrap();
        assert_eq!(start_queue(&amqp, "trip").unwrap(), "shop.trip.start");
    }
}
