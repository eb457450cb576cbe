//! [`ParticipantHandle`]: a started participant — watch it, report on it, stop it.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::future::join_all;
use ractor::{ActorCell, ActorRef};

use super::report::{ParticipantReport, PrunerReport, StepReport};
use super::{PRUNER, ParticipantError, RELAY};
use crate::consumer::ConsumerHandle;
use crate::delivery::ConsumerStats;
use crate::envelope::ConsumerType;
use crate::pruner::PrunerMessage;
use crate::relay::RelayMessage;
use crate::supervisor::Supervision;

/// How often the consumers' tasks are checked for an unexpected end.
const CONSUMER_CHECK: Duration = Duration::from_secs(1);
/// How long the last publish of the outbox at shutdown may take; what is left is
/// published after the next start.
const LAST_FLUSH_WITHIN: Duration = Duration::from_secs(10);

/// A running participant, from [`Participant::start`](super::Participant::start).
///
/// Dropping it stops everything too (the consumers settle what they hold, the actors
/// stop), but without waiting: call [`ParticipantHandle::stop`] to wait and get the
/// report.
#[derive(Debug)]
pub struct ParticipantHandle {
    supervision: Supervision,
    consumers: Vec<Hosted>,
    actors: Vec<(String, ActorCell)>,
    relay: Option<ActorRef<RelayMessage>>,
    pruner: Option<Arc<Mutex<PrunerReport>>>,
    metrics_addr: Option<SocketAddr>,
    /// The store's part in the process's readiness, while the participant runs.
    database: Option<crate::health::DatabaseCheck>,
}

/// One step's consumer.
#[derive(Debug)]
struct Hosted {
    consumer_type: ConsumerType,
    queue: String,
    workers: usize,
    stats: Arc<ConsumerStats>,
    /// `None` once stopped.
    consumer: Option<ConsumerHandle>,
}

impl Hosted {
    fn report(&self) -> StepReport {
        StepReport {
            consumer_type: self.consumer_type.clone(),
            queue: self.queue.clone(),
            workers: self.workers,
            acked: self.stats.acked.load(Relaxed),
            dead_lettered: self.stats.dead_lettered.load(Relaxed),
            requeued: self.stats.requeued.load(Relaxed),
            sessions: self.stats.sessions.load(Relaxed),
        }
    }
}

impl ParticipantHandle {
    pub(super) fn new(supervision: Supervision, metrics_addr: Option<SocketAddr>) -> Self {
        Self {
            supervision,
            consumers: Vec::new(),
            actors: Vec::new(),
            relay: None,
            pruner: None,
            metrics_addr,
            database: None,
        }
    }

    pub(super) fn watch_database(&mut self, check: crate::health::DatabaseCheck) {
        self.database = Some(check);
    }

    pub(super) fn supervision(&self) -> &Supervision {
        &self.supervision
    }

    pub(super) fn add_step(
        &mut self,
        consumer_type: ConsumerType,
        queue: String,
        workers: usize,
        pool: (String, ActorCell),
        consumer: ConsumerHandle,
    ) {
        self.actors.push(pool);
        self.consumers.push(Hosted {
            consumer_type,
            queue,
            workers,
            stats: Arc::clone(consumer.stats()),
            consumer: Some(consumer),
        });
    }

    pub(super) fn set_relay(&mut self, relay: ActorRef<RelayMessage>) {
        self.actors.push((RELAY.to_owned(), relay.get_cell()));
        self.relay = Some(relay);
    }

    pub(super) fn set_pruner(
        &mut self,
        pruner: ActorRef<PrunerMessage>,
        tally: Arc<Mutex<PrunerReport>>,
    ) {
        self.actors.push((PRUNER.to_owned(), pruner.get_cell()));
        self.pruner = Some(tally);
    }

    pub(super) fn log_started(&self) {
        let queues: Vec<&str> = self
            .consumers
            .iter()
            .map(|hosted| hosted.queue.as_str())
            .collect();
        tracing::info!(
            queues = ?queues,
            relay = self.relay.is_some(),
            pruner = self.pruner.is_some(),
            metrics = self.metrics_addr.map(|addr| addr.to_string()).as_deref().unwrap_or("off"),
            "participant up"
        );
    }

    /// Where the Prometheus endpoint listens, if one was asked for.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The supervised actors, by the label a death would be reported under
    /// (`step pool <consumer_type>`, `relay`, `pruner`): for an operator's diagnostics.
    pub fn actors(&self) -> &[(String, ActorCell)] {
        &self.actors
    }

    /// What the participant has done so far.
    pub fn report(&self) -> ParticipantReport {
        ParticipantReport {
            steps: self.consumers.iter().map(Hosted::report).collect(),
            pruner: self
                .pruner
                .as_ref()
                .map(|tally| tally.lock().unwrap_or_else(PoisonError::into_inner).clone()),
        }
    }

    /// Resolves when a part of the participant dies: a supervised actor
    /// ([`ParticipantError::ActorDied`]) or a consumer's task
    /// ([`ParticipantError::ConsumerEnded`]). Never resolves while all is well.
    pub async fn failed(&self) -> ParticipantError {
        let consumer_ended = async {
            let mut check = tokio::time::interval(CONSUMER_CHECK);
            loop {
                check.tick().await;
                if let Some(ended) = self.consumers.iter().find(|hosted| {
                    hosted
                        .consumer
                        .as_ref()
                        .is_some_and(ConsumerHandle::is_finished)
                }) {
                    return ParticipantError::ConsumerEnded {
                        consumer_type: ended.consumer_type.clone(),
                    };
                }
            }
        };
        tokio::select! {
            died = self.supervision.died() => died.into(),
            ended = consumer_ended => ended,
        }
    }

    /// Runs until `shutdown` resolves or a part dies, then stops in order
    /// ([`ParticipantHandle::stop`]). A death ends it with that death as the error, after
    /// the same orderly stop.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<ParticipantReport, ParticipantError> {
        let failure = tokio::select! {
            () = shutdown => None,
            failure = self.failed() => Some(failure),
        };
        if let Some(failure) = &failure {
            tracing::error!(%failure, "a part of the participant died; stopping");
        }
        let stopped = self.stop().await;
        match failure {
            Some(failure) => Err(failure),
            None => stopped,
        }
    }

    /// Stops in order: the consumers stop taking deliveries and finish, reply to and ack
    /// those in flight; the relay publishes the outbox once more (bounded: what it
    /// cannot publish waits for the next start); then the pruner, the relay and the
    /// pools stop. Returns the report, or the death of an actor seen during the run.
    pub async fn stop(self) -> Result<ParticipantReport, ParticipantError> {
        tracing::info!("participant stopping: finishing the deliveries in flight");
        let (report, died) = self.shutdown().await;
        match died {
            Some(died) => Err(died),
            None => {
                tracing::info!("participant stopped");
                Ok(report)
            }
        }
    }

    /// The orderly stop, also after a failed start; the death of an actor before the
    /// stop began, if any.
    pub(super) async fn shutdown(mut self) -> (ParticipantReport, Option<ParticipantError>) {
        // Concurrently: each consumer waits for its own deliveries in flight, which are
        // bounded by the step's timeout.
        join_all(
            self.consumers
                .iter_mut()
                .filter_map(|hosted| hosted.consumer.take())
                .map(ConsumerHandle::stop),
        )
        .await;
        let died = self.supervision.check_now().await.err();
        if died.is_none()
            && let Some(relay) = &self.relay
        {
            match ractor::call_t!(
                relay,
                RelayMessage::Flush,
                LAST_FLUSH_WITHIN.as_millis() as u64
            ) {
                Ok(Ok(published)) if published > 0 => {
                    tracing::info!(published, "outbox published before stopping");
                }
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%error, "the outbox's last publish failed; the next start publishes it");
                }
                Err(error) => {
                    tracing::warn!(%error, "the relay did not answer its last publish; the next start publishes the outbox");
                }
            }
        }
        let report = self.report();
        let Self { supervision, .. } = self;
        supervision.stop().await;
        (report, died.map(ParticipantError::from))
    }
}
