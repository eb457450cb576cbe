//! The [`Orchestrator`] actor: drives saga instances from their persisted state.
//!
//! For each instance it sends the current step's command (with the step's stable
//! message id, so every retry is the same message), waits for the reply up to the step's
//! timeout, and writes the outcome to `saga_instances` before moving on. It **retries
//! freely** — on a timeout, a retryable failure or a lost reply it sends the same command
//! again after a backoff with jitter; the step's inbox makes that safe. When a step
//! refuses for good, or runs out of attempts, it runs the compensations of the steps
//! before it in reverse order, through the same inboxes (a step that ran out of attempts
//! may have applied without its reply arriving, so it is compensated too). Compensations
//! are retried until they succeed.
//!
//! One driver task per instance at a time: the actor keeps the set of instances in
//! flight, so two `Drive` messages for one saga never run it twice at once.
//! [`OrchestratorMessage::ResumeAll`] drives every unfinished instance of its saga — what
//! a restarted process does first. [`OrchestratorMessage::Start`] starts a saga from a
//! start message, idempotently: the same message, delivered twice or to two
//! orchestrators at once, starts one saga and answers every sender with its id.
//!
//! Every save writes what happened since the last one to the saga's history
//! ([`SagaEvent`]), with the state. The saves of many sagas share commits: those asked
//! for while one batch is written go together in the next, one transaction
//! ([`OrchestratorArguments::save_batch`]); a save alone waits for nobody. A saga runs on the definition version it started
//! under ([`Definitions`]); past its deadline a running saga is compensated. When going
//! on cannot help — a compensation the step refuses or the inbox rejects (a saga older
//! than the inbox TTL, a consumer type with no step), a deadline past a step without
//! compensation, an unknown definition version — the driver **parks** the saga for an
//! operator ([`crate::saga::operator`]) and resume passes leave it alone; a saga row that
//! vanished stops its driver. A driver that panics fails the callers waiting on its saga with
//! [`DriveError::Panicked`]; that saga is then left out of `ResumeAll` until driven again
//! by id. Stopping the actor, or its death, aborts its drivers; their sagas resume from
//! the database.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tracing::Instrument;

use crate::clock::{Clock, SystemClock};
use crate::envelope::{ConsumerType, Envelope};
use crate::gather::Gather;
use crate::metrics::{self, StepAttempt};
use crate::saga::machine;
use crate::saga::versions::{Definitions, RegisterError, VersionError};
use crate::saga::{EventKind, SagaDefinition, SagaEvent, SagaInstance, SagaStore, StartError};
use crate::step::{StepFailure, StepOutcome, StepPool, StepReply};
use crate::supervisor::panic_message;

mod saves;

use saves::Saves;

/// How the orchestrator reaches the steps: in process (a [`StepPool`] per consumer type)
/// or through a broker.
pub trait Dispatch: Send + Sync + 'static {
    /// Sends `envelope` to the step consumed as `consumer_type` and waits up to
    /// `timeout` for its answer.
    fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        envelope: Envelope,
        timeout: Duration,
    ) -> impl Future<Output = Result<StepReply, StepFailure>> + Send;
}

/// Steps in this process: one [`StepPool`] per consumer type, each command delivered
/// alone, or claimed in batches ([`with_batched_pool`](Self::with_batched_pool)).
#[derive(Debug, Default)]
pub struct InProcess {
    pools: HashMap<ConsumerType, Arc<StepPool>>,
    batches: HashMap<ConsumerType, Claims>,
}

/// A pool's commands gathered into batches: each with the time its sender waits.
type Claims = Gather<(Envelope, Duration), Result<StepReply, StepFailure>>;

impl InProcess {
    /// No pools yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a pool, reached under its consumer type.
    pub fn with_pool(mut self, pool: StepPool) -> Self {
        self.batches.remove(pool.consumer_type());
        self.pools
            .insert(pool.consumer_type().clone(), Arc::new(pool));
        self
    }

    /// Adds a pool whose commands are claimed in batches of up to `max`: the commands
    /// sent while its batch runs go together in the next, one transaction and one commit
    /// ([`StepPool::deliver_batch`]; a batch that fails runs its commands one by one). A
    /// command sent while no batch runs goes at once, alone. One batch runs at a time,
    /// so two batches of the step never wait for each other's rows; a step whose
    /// handler waits on something slow (a remote call) is better served by
    /// [`with_pool`](Self::with_pool), whose workers run commands side by side.
    pub fn with_batched_pool(mut self, pool: StepPool, max: usize) -> Self {
        let consumer_type = pool.consumer_type().clone();
        let pool = Arc::new(pool);
        let batches = {
            let pool = Arc::clone(&pool);
            Gather::new(1, max, move |commands: Vec<(Envelope, Duration)>| {
                let pool = Arc::clone(&pool);
                async move { claim_batch(&pool, commands).await }
            })
        };
        self.batches.insert(consumer_type.clone(), batches);
        self.pools.insert(consumer_type, pool);
        self
    }

    /// Stops every pool after the commands in flight.
    pub async fn stop(self) {
        // A batched pool is held by its lane too: the lane ends first, after the batches
        // queued.
        for (_, batches) in self.batches {
            batches.close().await;
        }
        for (_, pool) in self.pools {
            if let Ok(pool) = Arc::try_unwrap(pool) {
                pool.stop().await;
            }
        }
    }
}

impl Dispatch for InProcess {
    async fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        envelope: Envelope,
        timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        if let Some(batches) = self.batches.get(consumer_type) {
            let mut envelope = envelope;
            // The batch runs in its lane's task: the command carries this span's context.
            crate::trace::inject_current(&mut envelope.headers);
            return match tokio::time::timeout(timeout, batches.submit((envelope, timeout))).await {
                Ok(Some(answer)) => answer,
                Ok(None) => Err(StepFailure::Retryable(
                    "the step's batch ended without answering this command".into(),
                )),
                Err(_) => Err(StepFailure::Timeout(timeout)),
            };
        }
        match self.pools.get(consumer_type) {
            Some(pool) => pool.deliver(envelope, timeout).await,
            None => Err(StepFailure::Rejected(format!(
                "no step pool for consumer type {consumer_type}: add one with InProcess::with_pool"
            ))),
        }
    }
}

/// Runs `commands` through `pool`: one alone, several as one batch, waiting as long as
/// the most patient sender; a batch that got no answer at all fails every command.
async fn claim_batch(
    pool: &StepPool,
    commands: Vec<(Envelope, Duration)>,
) -> Vec<Result<StepReply, StepFailure>> {
    let timeout = commands
        .iter()
        .map(|(_, timeout)| *timeout)
        .max()
        .unwrap_or_default();
    let mut envelopes: Vec<Envelope> = commands.into_iter().map(|(envelope, _)| envelope).collect();
    if envelopes.len() == 1
        && let Some(envelope) = envelopes.pop()
    {
        return vec![pool.deliver(envelope, timeout).await];
    }
    let count = envelopes.len();
    match pool.deliver_batch(envelopes, timeout).await {
        Ok(answers) => answers,
        Err(failure) => vec![Err(failure); count],
    }
}

impl<D: Dispatch> Dispatch for Arc<D> {
    fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        envelope: Envelope,
        timeout: Duration,
    ) -> impl Future<Output = Result<StepReply, StepFailure>> + Send {
        (**self).dispatch(consumer_type, envelope, timeout)
    }
}

/// Counters of what the drivers did, for summaries and tests.
#[derive(Debug, Default)]
pub struct DriveStats {
    /// Commands sent, retries included.
    pub deliveries: std::sync::atomic::AtomicU64,
    /// Commands sent again after a failure or timeout.
    pub retries: std::sync::atomic::AtomicU64,
    /// Replies that said the step had already handled the message.
    pub duplicates: std::sync::atomic::AtomicU64,
}

/// Messages the [`Orchestrator`] handles.
#[derive(Debug)]
pub enum OrchestratorMessage {
    /// Drive this instance (its row must exist) to a terminal state.
    Drive(String),
    /// Drive this instance and answer when its driver has finished: `Ok` once the saga
    /// reached a terminal state or was left for an operator, `Err` if its driver crashed.
    Run(String, RpcReplyPort<Result<(), DriveError>>),
    /// [`Run`](Self::Run) for a saga the caller has just stored (with
    /// [`SagaInsert::insert`](crate::saga::SagaInsert::insert), in its own transaction):
    /// the driver starts from this copy instead of reading the row back, a database
    /// round trip less per saga. The copy must be the row as stored, version included;
    /// one that another driver has moved on from since is caught by the first save's
    /// version check and reloaded (the command it sent again is answered by the step's
    /// inbox).
    RunStored(Box<SagaInstance>, RpcReplyPort<Result<(), DriveError>>),
    /// Start the saga that the start message asks for unless it was started already
    /// (the message's id decides; [`SagaInstance::from_start`] gives the envelope's
    /// shape), drive it, and answer its id once it is stored. Send the same message again
    /// after an error or a lost answer: it never starts a second saga. To wait for the
    /// saga to finish, follow with [`Run`](Self::Run) of the id.
    Start(Envelope, RpcReplyPort<Result<String, StartError>>),
    /// Drive every unfinished instance, except those whose driver crashed in this
    /// orchestrator (until driven again by id); answers how many were started.
    ResumeAll(RpcReplyPort<Result<usize, String>>),
    /// Answer once no instance is in flight.
    WhenIdle(RpcReplyPort<()>),
    /// A driver ended (sent by the driver task), or crashed.
    Finished(String, Result<(), DriveError>),
}

/// Why a saga's driver ended without finishing its work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DriveError {
    /// The driver panicked (a bug in a [`Dispatch`] or in the orchestrator). The saga
    /// keeps its last stored state; a new `Run` or `Drive` of its id drives it again from
    /// there (`ResumeAll` leaves it alone until then, and a new orchestrator resumes it).
    #[error("the driver of saga {saga_id} panicked: {message}")]
    Panicked {
        /// The saga it was driving.
        saga_id: String,
        /// The panic's message.
        message: String,
    },
}

/// What the orchestrator runs with.
#[derive(Debug)]
pub struct OrchestratorArguments<St, D> {
    /// The saga it drives: new sagas start on this version of it, and it is stored
    /// ([`SagaStore::register_definition`]) when the orchestrator starts, which refuses
    /// to start when another definition is stored under its name and version.
    pub definition: Arc<SagaDefinition>,
    /// Where instances are stored.
    pub store: St,
    /// How commands reach the steps.
    pub dispatch: Arc<D>,
    /// Shared counters.
    pub stats: Arc<DriveStats>,
    /// The time of new sagas, of history events, and against which deadlines pass.
    pub clock: Arc<dyn Clock>,
    /// The most saga saves written in one transaction: the saves that queue while one
    /// is written go together in the next ([`DEFAULT_SAVE_BATCH`]); 1 writes each alone.
    pub save_batch: usize,
}

/// How many saga saves an orchestrator writes in one transaction at most, by default.
pub const DEFAULT_SAVE_BATCH: usize = 64;

impl<St, D> OrchestratorArguments<St, D> {
    /// Drives `definition`'s sagas stored in `store` through `dispatch`, on the system
    /// clock, with counters of its own.
    pub fn new(definition: Arc<SagaDefinition>, store: St, dispatch: Arc<D>) -> Self {
        Self {
            definition,
            store,
            dispatch,
            stats: Arc::default(),
            clock: Arc::new(SystemClock),
            save_batch: DEFAULT_SAVE_BATCH,
        }
    }

    /// With at most `max` saga saves per transaction (1: each save alone).
    pub fn with_save_batch(mut self, max: usize) -> Self {
        self.save_batch = max;
        self
    }

    /// With counters shared with the caller.
    pub fn with_stats(mut self, stats: Arc<DriveStats>) -> Self {
        self.stats = stats;
        self
    }

    /// With another clock (a fast one, in tests and soak runs).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }
}

/// The orchestrator's state: configuration plus the instances in flight.
#[derive(Debug)]
pub struct OrchestratorState<St, D> {
    definitions: Arc<Definitions>,
    store: St,
    /// The drivers' saves, in batches; its writers end with the state.
    saves: Saves<St>,
    dispatch: Arc<D>,
    stats: Arc<DriveStats>,
    clock: Arc<dyn Clock>,
    /// Instances being driven, with whoever waits for each to finish.
    in_flight: HashMap<String, Vec<RpcReplyPort<Result<(), DriveError>>>>,
    /// The driver tasks, aborted when the actor ends however it ends: dropping the state
    /// (which ractor does without `post_stop` when the actor is killed or fails) aborts
    /// them too, so a restarted orchestrator never races a stale driver.
    drivers: HashMap<String, AbortOnDrop>,
    /// Sagas whose driver panicked: `ResumeAll` leaves them for an operator (or an
    /// explicit `Run`/`Drive`) instead of crashing their driver again on every pass.
    crashed: HashSet<String>,
    idle_waiters: Vec<RpcReplyPort<()>>,
}

/// A task handle that aborts its task when dropped (a plain `AbortHandle` does not).
#[derive(Debug)]
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The saga orchestrator actor. Spawn with [`Actor::spawn`] and
/// [`OrchestratorArguments`].
#[derive(Debug)]
pub struct Orchestrator<St, D>(PhantomData<fn() -> (St, D)>);

impl<St, D> Default for Orchestrator<St, D> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<St: SagaStore, D: Dispatch> Orchestrator<St, D> {
    /// The orchestrator.
    pub fn new() -> Self {
        Self::default()
    }

    fn start(
        myself: &ActorRef<OrchestratorMessage>,
        state: &mut OrchestratorState<St, D>,
        id: String,
        waiter: Option<RpcReplyPort<Result<(), DriveError>>>,
        stored: Option<SagaInstance>,
    ) {
        if let Some(waiters) = state.in_flight.get_mut(&id) {
            // Already being driven: never two drivers for one saga.
            waiters.extend(waiter);
            return;
        }
        state
            .in_flight
            .insert(id.clone(), waiter.into_iter().collect());
        let driver = Driver {
            definitions: Arc::clone(&state.definitions),
            store: state.store.clone(),
            saves: state.saves.clone(),
            dispatch: Arc::clone(&state.dispatch),
            stats: Arc::clone(&state.stats),
            clock: Arc::clone(&state.clock),
        };
        let myself = myself.clone();
        let key = id.clone();
        let span = crate::trace::saga_span(state.definitions.current().name(), &id);
        let task = tokio::spawn(async move {
            // A driver that panics must still end its saga's entry: otherwise whoever
            // waits on the saga (`Run`, `WhenIdle`) would wait forever.
            let ended = AssertUnwindSafe(driver.drive(&id, stored).instrument(span))
                .catch_unwind()
                .await
                .map_err(|panic| DriveError::Panicked {
                    saga_id: id.clone(),
                    message: panic_message(panic.as_ref()),
                });
            // The actor may be stopping; then nobody is waiting for this.
            let _ = myself.send_message(OrchestratorMessage::Finished(id, ended));
        });
        state.drivers.insert(key, AbortOnDrop(task.abort_handle()));
    }

    /// Stores the saga `start` asks for unless it is stored already, and drives it. A
    /// saga whose driver crashed is not driven again by a redelivered start (as by
    /// `ResumeAll`): only an explicit `Run` or `Drive` of its id does that.
    async fn start_saga(
        myself: &ActorRef<OrchestratorMessage>,
        state: &mut OrchestratorState<St, D>,
        start: &Envelope,
    ) -> Result<String, StartError> {
        let instance =
            SagaInstance::from_start(state.definitions.current(), start, state.clock.now())?;
        let started = state
            .store
            .create_if_absent(&instance)
            .await
            .map_err(|source| StartError::Store {
                message_id: start.id.clone(),
                source,
            })?;
        let id = started.saga.id.clone();
        if !started.created {
            tracing::debug!(saga_id = %id, message_id = %start.id, "start message seen before; its saga goes on");
        }
        // A finished saga's driver ends at once: no need to tell it apart here. The
        // saga as the store just wrote or read it is where its driver starts.
        if !state.crashed.contains(&id) {
            Self::start(myself, state, id.clone(), None, Some(started.saga));
        }
        Ok(id)
    }
}

impl<St: SagaStore, D: Dispatch> Actor for Orchestrator<St, D> {
    type Msg = OrchestratorMessage;
    type State = OrchestratorState<St, D>;
    type Arguments = OrchestratorArguments<St, D>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        // Every version an orchestrator runs is stored before any saga starts on it, so
        // that its sagas can be driven on it after the definition changed.
        args.store
            .register_definition(&args.definition)
            .await
            .map_err(|error: RegisterError| Box::new(error) as ActorProcessingErr)?;
        Ok(OrchestratorState {
            definitions: Arc::new(Definitions::new(args.definition)),
            saves: Saves::new(args.store.clone(), args.save_batch),
            store: args.store,
            dispatch: args.dispatch,
            stats: args.stats,
            clock: args.clock,
            in_flight: HashMap::new(),
            drivers: HashMap::new(),
            crashed: HashSet::new(),
            idle_waiters: Vec::new(),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Drivers keep their progress in the database; a new orchestrator resumes them.
        state.drivers.clear();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            OrchestratorMessage::Drive(id) => {
                state.crashed.remove(&id);
                Self::start(&myself, state, id, None, None);
            }
            OrchestratorMessage::Run(id, reply) => {
                state.crashed.remove(&id);
                Self::start(&myself, state, id, Some(reply), None);
            }
            OrchestratorMessage::RunStored(saga, reply) => {
                state.crashed.remove(&saga.id);
                Self::start(&myself, state, saga.id.clone(), Some(reply), Some(*saga));
            }
            OrchestratorMessage::Start(start, reply) => {
                let started = Self::start_saga(&myself, state, &start).await;
                let _ = reply.send(started);
            }
            OrchestratorMessage::ResumeAll(reply) => {
                let name = state.definitions.current().name();
                let answer = match state.store.unfinished(name).await {
                    Ok(ids) => {
                        let mut count = 0;
                        for id in ids {
                            if !state.crashed.contains(&id) {
                                Self::start(&myself, state, id, None, None);
                                count += 1;
                            }
                        }
                        Ok(count)
                    }
                    Err(error) => Err(format!("cannot list unfinished sagas: {error}")),
                };
                let _ = reply.send(answer);
            }
            OrchestratorMessage::WhenIdle(reply) => {
                if state.in_flight.is_empty() {
                    let _ = reply.send(());
                } else {
                    state.idle_waiters.push(reply);
                }
            }
            OrchestratorMessage::Finished(id, ended) => {
                if let Err(error) = &ended {
                    tracing::error!(
                        saga_id = %id,
                        %error,
                        "saga driver crashed; the saga stays as last stored and is not resumed \
                         until driven again by id (Run or Drive)"
                    );
                    state.crashed.insert(id.clone());
                }
                state.drivers.remove(&id);
                for waiter in state.in_flight.remove(&id).into_iter().flatten() {
                    let _ = waiter.send(ended.clone());
                }
                if state.in_flight.is_empty() {
                    for waiter in state.idle_waiters.drain(..) {
                        let _ = waiter.send(());
                    }
                }
            }
        }
        Ok(())
    }
}

/// Drives one instance; everything it needs, cloned out of the actor's state.
struct Driver<St, D> {
    definitions: Arc<Definitions>,
    store: St,
    saves: Saves<St>,
    dispatch: Arc<D>,
    stats: Arc<DriveStats>,
    clock: Arc<dyn Clock>,
}

/// How long to wait before trying a failed store operation again.
const STORE_RETRY: Duration = Duration::from_millis(200);

/// What became of a save.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Saved {
    /// The change is stored.
    Written,
    /// Another driver or an operator saved first: the saga was reloaded, the change
    /// dropped.
    Reloaded,
    /// The saga's row is gone: the driver stops.
    Gone,
}

impl<St: SagaStore, D: Dispatch> Driver<St, D> {
    /// Drives saga `id` until it is finished, parked or gone: performs what the state
    /// machine ([`machine`]) decides. Starts from `stored` when given (the row as its
    /// caller just stored it), else from the row read now.
    async fn drive(&self, id: &str, stored: Option<SagaInstance>) {
        let mut rng = StdRng::seed_from_u64(seed_of(id));
        let stored = match stored {
            Some(saga) => Some(saga),
            None => self.load(id).await,
        };
        let Some(mut saga) = stored else {
            tracing::warn!(saga_id = id, "no such saga instance; nothing to drive");
            return;
        };
        let name = self.definitions.current().name();
        if saga.saga_name != name {
            tracing::warn!(
                saga_id = id,
                saga = %saga.saga_name,
                driver = name,
                "saga instance belongs to another definition; not driving it"
            );
            return;
        }
        if let Some(reason) = &saga.parked {
            tracing::info!(saga_id = %saga.id, %reason, "saga is parked; an operator retries or cancels it");
            return;
        }
        loop {
            // Checked before the definition lookup too, which parks a saga whose version
            // is unknown: a saga another driver finished or parked meanwhile (reloaded by
            // a save) must be left as it is.
            if saga.status.is_terminal() || saga.parked.is_some() {
                return;
            }
            let Some(definition) = self.definition_of(&mut saga).await else {
                return;
            };
            let change = match machine::next(&mut saga, &definition, self.clock.now()) {
                machine::Next::Idle => return,
                machine::Next::Save(change) => change,
                machine::Next::Send(command) => {
                    let (reply, waited) = self.send(&saga, &command).await;
                    let now = self.clock.now();
                    let answered =
                        machine::answer(&mut saga, &command, reply, now, waited, &mut rng);
                    machine::settle(&mut saga, &definition, answered, now)
                }
            };
            if !self.apply(&mut saga, change).await {
                return;
            }
        }
    }

    /// Sends one attempt of `command` and waits for its reply (up to the step's
    /// timeout), with its span, counters and metrics. Returns the reply and how long it
    /// took.
    async fn send(
        &self,
        saga: &SagaInstance,
        command: &machine::Command<'_>,
    ) -> (Result<StepReply, StepFailure>, Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let step = command.step;
        let retry = command.attempt > 1;
        self.stats.deliveries.fetch_add(1, Relaxed);
        if retry {
            self.stats.retries.fetch_add(1, Relaxed);
        }
        let span = tracing::debug_span!(
            "saga.step",
            saga = %saga.saga_name,
            saga_id = %saga.id,
            step = step.name(),
            direction = command.direction.as_str(),
            attempt = command.attempt,
            outcome = tracing::field::Empty,
        );
        let started = Instant::now();
        let reply = self
            .dispatch
            .dispatch(step.consumer_type(), command.envelope(saga), step.timeout())
            .instrument(span.clone())
            .await;
        let waited = started.elapsed();
        let outcome = match &reply {
            Ok(StepReply {
                outcome: StepOutcome::Done(_),
                duplicate,
            }) => {
                if *duplicate {
                    self.stats.duplicates.fetch_add(1, Relaxed);
                }
                StepAttempt::Done
            }
            Ok(StepReply {
                outcome: StepOutcome::Refused(_),
                ..
            }) => StepAttempt::Refused,
            Err(_) => StepAttempt::Failed,
        };
        span.record("outcome", outcome.as_str());
        // Closing the span here prints the attempt as one line, outcome included.
        drop(span);
        metrics::saga_step(
            &saga.saga_name,
            step.name(),
            command.direction,
            outcome,
            waited,
            retry,
        );
        (reply, waited)
    }

    /// Saves `change` (the state machine already applied it to `saga`), records what it
    /// means in the metrics and the log, and waits out its backoff. Returns `false` when
    /// the driver must stop.
    async fn apply(&self, saga: &mut SagaInstance, change: machine::Change) -> bool {
        let parked = change
            .events
            .iter()
            .any(|event| event.kind == EventKind::Parked);
        match self.save(saga, &change.events).await {
            Saved::Gone => return false,
            Saved::Reloaded => {}
            Saved::Written => {
                if let Some(trigger) = change.compensating {
                    metrics::saga_compensation(&saga.saga_name, trigger);
                }
                if parked {
                    metrics::saga_parked(&saga.saga_name);
                    let reason = saga.parked.as_deref().unwrap_or_default();
                    tracing::error!(saga_id = %saga.id, %reason, "saga parked; an operator retries or cancels it");
                }
                if saga.status.is_terminal() {
                    self.finished(saga);
                }
            }
        }
        if let Some(backoff) = change.backoff {
            tokio::time::sleep(backoff).await;
        }
        true
    }

    /// The definition version `saga` runs on. A version no orchestrator stored (or one
    /// stored unreadable) parks the saga: `None`, and the driver stops.
    async fn definition_of(&self, saga: &mut SagaInstance) -> Option<Arc<SagaDefinition>> {
        loop {
            match self
                .definitions
                .version(&self.store, saga.definition_version)
                .await
            {
                Ok(definition) => return Some(definition),
                Err(VersionError::Store(error)) => {
                    tracing::warn!(saga_id = %saga.id, %error, "cannot read the saga's definition version; retrying");
                    tokio::time::sleep(STORE_RETRY).await;
                }
                Err(error) => {
                    let events = machine::park(
                        saga,
                        Vec::new(),
                        error.to_string(),
                        self.clock.now(),
                        machine::Renew::Nothing,
                    );
                    self.apply(saga, machine::Change::of(events)).await;
                    return None;
                }
            }
        }
    }

    /// Records a saga that reached its terminal state (saved).
    fn finished(&self, saga: &SagaInstance) {
        let elapsed = (self.clock.now() - saga.created_at)
            .to_std()
            .unwrap_or_default();
        metrics::saga_finished(&saga.saga_name, saga.status, elapsed);
    }

    async fn load(&self, id: &str) -> Option<SagaInstance> {
        loop {
            match self.store.load(id).await {
                Ok(saga) => return saga,
                Err(error) => {
                    tracing::warn!(saga_id = id, %error, "cannot load saga; retrying");
                    tokio::time::sleep(STORE_RETRY).await;
                }
            }
        }
    }

    /// Persists progress with the `events` that led to it, retrying until the database
    /// takes it: the next command must not go out before the state that led to it is
    /// stored. If another driver (a second process, or a stale one) or an operator saved
    /// in between, nothing is written and `saga` is reloaded: the driver goes on from the
    /// stored state, never from its stale copy.
    async fn save(&self, saga: &mut SagaInstance, events: &[SagaEvent]) -> Saved {
        saga.updated_at = self.clock.now();
        loop {
            match self.saves.save(saga, events).await {
                Ok(true) => return Saved::Written,
                Ok(false) => {
                    tracing::info!(saga_id = %saga.id, "saga changed under this driver; reloading");
                    return match self.load(&saga.id).await {
                        Some(stored) => {
                            *saga = stored;
                            Saved::Reloaded
                        }
                        None => {
                            tracing::warn!(saga_id = %saga.id, "saga row is gone; driver stops");
                            Saved::Gone
                        }
                    };
                }
                Err(error) => {
                    tracing::warn!(saga_id = %saga.id, %error, "cannot save saga; retrying");
                    tokio::time::sleep(STORE_RETRY).await;
                }
            }
        }
    }
}

/// A per-saga seed for backoff jitter: FNV-1a of the id.
fn seed_of(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
