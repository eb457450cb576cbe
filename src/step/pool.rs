//! [`StepPool`]: competing workers hosting one step, fed by one queue.
//!
//! A caller puts its command on the pool's queue and awaits the answer on a oneshot;
//! whichever worker is free takes it. The pool itself is an actor too, the workers'
//! supervisor: it starts them linked to itself, replaces one that dies, and on stop
//! closes the queue, answers what still waits in it, and stops them.

use std::sync::Arc;
use std::time::Duration;

use async_channel::TrySendError;
use ractor::{Actor, ActorProcessingErr, ActorRef, SpawnErr, SupervisionEvent};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::worker::{Command, StepWorker};
use super::{StepFailure, StepHandler, StepReply};
use crate::envelope::{ConsumerType, Envelope};
use crate::inbox::InboxGuard;
use crate::store::InboxStore;
use crate::supervisor::Supervision;

/// How long a stopping pool waits for its workers to finish the commands they run.
const STOP_WORKERS_WITHIN: Duration = Duration::from_secs(10);

/// How many workers a pool runs.
#[derive(Debug, Clone)]
pub struct StepPoolConfig {
    /// Competing workers. Defaults to 4.
    pub workers: usize,
}

impl Default for StepPoolConfig {
    fn default() -> Self {
        Self { workers: 4 }
    }
}

/// The pool's actor takes no messages: it only supervises.
#[derive(Debug)]
enum PoolMessage {}

/// The pool's actor: the supervisor of its workers.
struct Pool<S, H> {
    guard: InboxGuard<S>,
    consumer_type: ConsumerType,
    handler: Arc<H>,
    /// The queue's receiving end, handed to every worker it starts.
    queue: async_channel::Receiver<Command>,
}

impl<S: InboxStore, H: StepHandler<S::Db>> Pool<S, H> {
    async fn start_worker(&self, pool: &ActorRef<PoolMessage>) -> Result<(), SpawnErr> {
        let worker = StepWorker {
            guard: self.guard.clone(),
            consumer_type: self.consumer_type.clone(),
            handler: Arc::clone(&self.handler),
        };
        Actor::spawn_linked(None, worker, self.queue.clone(), pool.get_cell()).await?;
        Ok(())
    }
}

impl<S: InboxStore, H: StepHandler<S::Db>> Actor for Pool<S, H> {
    type Msg = PoolMessage;
    type State = ();
    /// How many workers to start.
    type Arguments = usize;

    async fn pre_start(
        &self,
        myself: ActorRef<PoolMessage>,
        workers: usize,
    ) -> Result<(), ActorProcessingErr> {
        for _ in 0..workers {
            self.start_worker(&myself).await?;
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<PoolMessage>,
        message: PoolMessage,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match message {}
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<PoolMessage>,
        event: SupervisionEvent,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        // A worker that panicked took its command's answer down with it (the sender
        // reads that as retryable) and rolled its transaction back. One that stopped
        // did so because the queue closed: nothing to replace.
        if let SupervisionEvent::ActorFailed(_, error) = event
            && !self.queue.is_closed()
        {
            tracing::warn!(
                consumer_type = %self.consumer_type,
                %error,
                "a step worker died; starting a replacement"
            );
            self.start_worker(&myself).await?;
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<PoolMessage>,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        self.queue.close();
        let why = format!("the step pool {} is stopping", self.consumer_type);
        while let Ok(command) = self.queue.try_recv() {
            command.refuse(&why);
        }
        // Workers finish the command they run, then find the queue closed.
        myself
            .stop_children_and_wait(None, Some(STOP_WORKERS_WITHIN))
            .await;
        Ok(())
    }
}

/// A pool of competing workers hosting one step.
#[derive(Debug)]
pub struct StepPool {
    consumer_type: ConsumerType,
    queue: async_channel::Sender<Command>,
    pool: ActorRef<PoolMessage>,
    handle: JoinHandle<()>,
}

impl StepPool {
    /// Starts `config.workers` workers running `handler` behind `guard` as
    /// `consumer_type`.
    pub async fn spawn<S, H>(
        guard: InboxGuard<S>,
        consumer_type: ConsumerType,
        handler: H,
        config: StepPoolConfig,
    ) -> Result<Self, SpawnErr>
    where
        S: InboxStore,
        H: StepHandler<S::Db>,
    {
        Self::spawn_under(guard, consumer_type, handler, config, None, None).await
    }

    /// [`StepPool::spawn`], with the pool linked to `supervision`: if the pool itself
    /// dies (its workers are replaced by the pool), the process learns it from
    /// [`Supervision::died`]. Labelled `step pool <consumer_type>`.
    pub async fn spawn_supervised<S, H>(
        guard: InboxGuard<S>,
        consumer_type: ConsumerType,
        handler: H,
        config: StepPoolConfig,
        supervision: &Supervision,
    ) -> Result<Self, SpawnErr>
    where
        S: InboxStore,
        H: StepHandler<S::Db>,
    {
        Self::spawn_under(
            guard,
            consumer_type,
            handler,
            config,
            Some(supervision),
            None,
        )
        .await
    }

    /// [`StepPool::spawn_supervised`], with at most `queue_limit` commands waiting for a
    /// free worker: a command arriving when that many wait is answered at once with
    /// [`StepFailure::Retryable`] (its sender requeues it) rather than queued. Commands
    /// being run by a worker do not count; a limit of 0 is taken as 1. With callers
    /// that await every answer (a broker consumer holding `prefetch` deliveries), a
    /// limit of the prefetch is never reached unless callers give up on a timeout and
    /// leave their commands behind.
    pub async fn spawn_bounded<S, H>(
        guard: InboxGuard<S>,
        consumer_type: ConsumerType,
        handler: H,
        config: StepPoolConfig,
        queue_limit: usize,
        supervision: &Supervision,
    ) -> Result<Self, SpawnErr>
    where
        S: InboxStore,
        H: StepHandler<S::Db>,
    {
        Self::spawn_under(
            guard,
            consumer_type,
            handler,
            config,
            Some(supervision),
            Some(queue_limit),
        )
        .await
    }

    async fn spawn_under<S, H>(
        guard: InboxGuard<S>,
        consumer_type: ConsumerType,
        handler: H,
        config: StepPoolConfig,
        supervision: Option<&Supervision>,
        queue_limit: Option<usize>,
    ) -> Result<Self, SpawnErr>
    where
        S: InboxStore,
        H: StepHandler<S::Db>,
    {
        let (queue, receiver) = match queue_limit {
            Some(limit) => async_channel::bounded(limit.max(1)),
            None => async_channel::unbounded(),
        };
        let pool = Pool {
            guard,
            consumer_type: consumer_type.clone(),
            handler: Arc::new(handler),
            queue: receiver,
        };
        let workers = config.workers.max(1);
        let (pool, handle) = match supervision {
            Some(supervision) => {
                supervision
                    .spawn(&format!("step pool {consumer_type}"), pool, workers)
                    .await?
            }
            None => Actor::spawn(None, pool, workers).await?,
        };
        Ok(Self {
            consumer_type,
            queue,
            pool,
            handle,
        })
    }

    /// The consumer type the pool deduplicates as.
    pub fn consumer_type(&self) -> &ConsumerType {
        &self.consumer_type
    }

    /// Delivers `envelope` and waits up to `timeout` for the step's answer. Safe to call
    /// again with the same envelope at any time, also while the first call runs.
    ///
    /// The envelope takes the caller's trace context (see [`crate::trace`]): the worker's
    /// `step.handle` span is a child of the span that delivered it.
    pub async fn deliver(
        &self,
        mut envelope: Envelope,
        timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        crate::trace::inject_current(&mut envelope.headers);
        let (reply, answer) = oneshot::channel();
        self.enqueue(Command::One { envelope, reply });
        answer_within(answer, timeout).await?
    }

    /// Delivers a batch of envelopes — what a broker consumer with a prefetch above one
    /// holds — to one worker, which runs them in one transaction
    /// ([`InboxGuard::process_batch`]) and waits up to `timeout` for the answers: one
    /// per envelope, in order. If the batch fails as a whole it is rolled back and its
    /// envelopes run one by one, so a message that fails gets its own
    /// [`StepFailure`] and the others their answers. Safe to call again with the same
    /// envelopes at any time.
    ///
    /// `Err` when no answer came at all (a timeout, or the worker died with the batch);
    /// a full queue or a stopped pool answers every envelope with
    /// [`StepFailure::Retryable`] at once, and an empty batch answers at once.
    ///
    /// Unlike [`StepPool::deliver`], the caller's trace context is not added: a batch
    /// gathers commands of several senders, and each worker span continues the context
    /// its own envelope carries.
    pub async fn deliver_batch(
        &self,
        envelopes: Vec<Envelope>,
        timeout: Duration,
    ) -> Result<Vec<Result<StepReply, StepFailure>>, StepFailure> {
        if envelopes.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, answer) = oneshot::channel();
        self.enqueue(Command::Batch { envelopes, reply });
        answer_within(answer, timeout).await
    }

    /// How many commands wait in the queue for a free worker now (those being run do
    /// not count). With the `testing` feature.
    #[cfg(feature = "testing")]
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Puts `command` on the queue, or answers it at once with why it cannot wait
    /// there.
    fn enqueue(&self, command: Command) {
        match self.queue.try_send(command) {
            Ok(()) => {}
            Err(TrySendError::Full(command)) => command.refuse(&format!(
                "the step pool {} has {} commands waiting already (its queue limit)",
                self.consumer_type,
                self.queue.capacity().unwrap_or_default()
            )),
            Err(TrySendError::Closed(command)) => command.refuse(&format!(
                "the step pool {} is not running (stopped or stopping)",
                self.consumer_type
            )),
        }
    }

    /// The pool's actor, for an operator's diagnostics (its supervision, its workers).
    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    pub(crate) fn cell(&self) -> ractor::ActorCell {
        self.pool.get_cell()
    }

    /// Stops the pool after the commands its workers run; commands still waiting in
    /// its queue are answered with [`StepFailure::Retryable`].
    pub async fn stop(self) {
        self.pool.stop(None);
        let _ = self.handle.await;
    }
}

/// The answer on `answer` within `timeout`.
async fn answer_within<T>(
    answer: oneshot::Receiver<T>,
    timeout: Duration,
) -> Result<T, StepFailure> {
    match tokio::time::timeout(timeout, answer).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(_)) => Err(StepFailure::Retryable(
            "the worker stopped before answering (it panicked or the pool is stopping)".into(),
        )),
        Err(_) => Err(StepFailure::Timeout(timeout)),
    }
}
