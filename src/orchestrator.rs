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
//! ([`SagaEvent`]), with the state. A saga runs on the definition version it started
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

use chrono::Utc;
use futures_util::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use tracing::Instrument;

use crate::clock::{Clock, SystemClock};
use crate::envelope::{ConsumerType, Envelope};
use crate::metrics::{self, CompensationTrigger, StepAttempt};
use crate::saga::versions::{Definitions, RegisterError, VersionError};
use crate::saga::{
    Direction, EventKind, SagaDefinition, SagaEvent, SagaInstance, SagaStatus, SagaStore,
    StartError,
};
use crate::step::{StepFailure, StepOutcome, StepPool, StepReply};
use crate::supervisor::panic_message;

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

/// Steps in this process: one [`StepPool`] per consumer type.
#[derive(Debug, Default)]
pub struct InProcess {
    pools: HashMap<ConsumerType, Arc<StepPool>>,
}

impl InProcess {
    /// No pools yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a pool, reached under its consumer type.
    pub fn with_pool(mut self, pool: StepPool) -> Self {
        self.pools
            .insert(pool.consumer_type().clone(), Arc::new(pool));
        self
    }

    /// Stops every pool after the commands in flight.
    pub async fn stop(self) {
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
        match self.pools.get(consumer_type) {
            Some(pool) => pool.deliver(envelope, timeout).await,
            None => Err(StepFailure::Rejected(format!(
                "no step pool for consumer type {consumer_type}: add one with InProcess::with_pool"
            ))),
        }
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
}

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
        }
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
            let ended = AssertUnwindSafe(driver.drive(&id).instrument(span))
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
        let id = started.saga.id;
        if !started.created {
            tracing::debug!(saga_id = %id, message_id = %start.id, "start message seen before; its saga goes on");
        }
        // A finished saga's driver loads it and ends at once: no need to tell it apart here.
        if !state.crashed.contains(&id) {
            Self::start(myself, state, id.clone(), None);
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
                Self::start(&myself, state, id, None);
            }
            OrchestratorMessage::Run(id, reply) => {
                state.crashed.remove(&id);
                Self::start(&myself, state, id, Some(reply));
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
                                Self::start(&myself, state, id, None);
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
    dispatch: Arc<D>,
    stats: Arc<DriveStats>,
    clock: Arc<dyn Clock>,
}

/// A saga's status and step: where it stands.
type Position = (SagaStatus, i32);

/// Whether parking a saga renews its step's command id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Renew {
    /// The inbox answered the command for good: the next one gets a new id.
    Command,
    /// The command may have applied, or was never sent: it keeps its id.
    Nothing,
}

/// How long to wait before trying a failed store operation again.
const STORE_RETRY: Duration = Duration::from_millis(200);

/// What one attempt of a step's command answered, for the saga's history.
fn answered(reply: &Result<StepReply, StepFailure>) -> (EventKind, Option<String>) {
    match reply {
        Ok(StepReply {
            outcome: StepOutcome::Done(_),
            duplicate,
        }) => (
            if *duplicate {
                EventKind::Duplicate
            } else {
                EventKind::Applied
            },
            None,
        ),
        Ok(StepReply {
            outcome: StepOutcome::Refused(reason),
            ..
        }) => (EventKind::Refused, Some(reason.clone())),
        Err(StepFailure::Rejected(reason)) => (EventKind::Rejected, Some(reason.clone())),
        Err(failure @ StepFailure::Timeout(_)) => (EventKind::TimedOut, Some(failure.to_string())),
        Err(failure @ StepFailure::Retryable(_)) => (EventKind::Failed, Some(failure.to_string())),
    }
}

impl<St: SagaStore, D: Dispatch> Driver<St, D> {
    async fn drive(&self, id: &str) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut rng = StdRng::seed_from_u64(seed_of(id));
        let Some(mut saga) = self.load(id).await else {
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
        while !saga.status.is_terminal() {
            if let Some(reason) = &saga.parked {
                tracing::info!(saga_id = %saga.id, %reason, "saga is parked; an operator retries or cancels it");
                return;
            }
            // Where the saga stands before this turn: a save that moves it elsewhere starts
            // the new step's command at round 0 again (see `SagaInstance::command_round`).
            let position = (saga.status, saga.current_step);
            let Some(definition) = self.definition_of(&mut saga).await else {
                return;
            };
            let steps = definition.steps();
            let now = self.clock.now();
            // A deadline stops a saga with a step left to run; one past its last step only
            // has its completion left to save.
            let step_left = usize::try_from(saga.current_step).is_ok_and(|i| i < steps.len());
            if saga.status == SagaStatus::Running
                && step_left
                && saga.deadline_at.is_some_and(|at| at <= now)
            {
                if !self
                    .deadline_passed(&mut saga, position, &definition, now)
                    .await
                {
                    return;
                }
                continue;
            }
            let index = usize::try_from(saga.current_step).ok();
            let (direction, step) = match (saga.status, index) {
                (SagaStatus::Running, Some(i)) if i < steps.len() => {
                    (Direction::Forward, &steps[i])
                }
                (SagaStatus::Running, _) => {
                    saga.status = SagaStatus::Completed;
                    if !self
                        .save(
                            &mut saga,
                            position,
                            vec![SagaEvent::new(EventKind::Completed, now)],
                        )
                        .await
                    {
                        return;
                    }
                    if saga.status.is_terminal() {
                        self.finished(&saga, name);
                    }
                    continue;
                }
                (SagaStatus::Compensating, Some(i)) if i < steps.len() => {
                    (Direction::Backward, &steps[i])
                }
                _ => {
                    saga.status = SagaStatus::Compensated;
                    if !self
                        .save(
                            &mut saga,
                            position,
                            vec![SagaEvent::new(EventKind::Compensated, now)],
                        )
                        .await
                    {
                        return;
                    }
                    if saga.status.is_terminal() {
                        self.finished(&saga, name);
                    }
                    continue;
                }
            };
            let Some(i) = index else { break };
            let kind = match direction {
                Direction::Forward => step.command(),
                Direction::Backward => match step.compensation() {
                    Some(kind) => kind,
                    None => {
                        // Nothing to undo for this step.
                        saga.current_step -= 1;
                        saga.attempts = 0;
                        let skipped = SagaEvent::new(EventKind::Skipped, now)
                            .step(step.name(), Direction::Backward);
                        if !self.save(&mut saga, position, vec![skipped]).await {
                            return;
                        }
                        continue;
                    }
                },
            };
            let envelope =
                match Envelope::new(saga.command_id(i, direction), kind, saga.data.clone()) {
                    Ok(envelope) => envelope.with_saga_id(saga.id.clone()),
                    Err(error) => unreachable!("kinds are validated with the definition: {error}"),
                };
            saga.attempts += 1;
            self.stats.deliveries.fetch_add(1, Relaxed);
            if saga.attempts > 1 {
                self.stats.retries.fetch_add(1, Relaxed);
            }
            let span = tracing::debug_span!(
                "saga.step",
                saga = name,
                saga_id = %saga.id,
                step = step.name(),
                direction = direction.as_str(),
                attempt = saga.attempts,
                outcome = tracing::field::Empty,
            );
            let sent = SagaEvent::new(EventKind::Sent, now)
                .step(step.name(), direction)
                .attempt(saga.attempts);
            let attempt_started = Instant::now();
            let reply = self
                .dispatch
                .dispatch(step.consumer_type(), envelope, step.timeout())
                .instrument(span.clone())
                .await;
            let waited = attempt_started.elapsed();
            let (answer, detail) = answered(&reply);
            let outcome = match answer {
                EventKind::Applied | EventKind::Duplicate => StepAttempt::Done,
                EventKind::Refused => StepAttempt::Refused,
                _ => StepAttempt::Failed,
            };
            span.record("outcome", outcome.as_str());
            // Closing the span here prints the attempt as one line, outcome included.
            drop(span);
            metrics::saga_step(
                name,
                step.name(),
                direction,
                outcome,
                waited,
                saga.attempts > 1,
            );
            let mut answer = SagaEvent::new(answer, self.clock.now())
                .step(step.name(), direction)
                .attempt(saga.attempts)
                .duration(waited);
            if let Some(detail) = detail {
                answer = answer.detail(detail);
            }
            let at = answer.at;
            let mut events = vec![sent, answer];
            match (direction, reply) {
                (_, Ok(reply)) => {
                    if reply.duplicate {
                        self.stats.duplicates.fetch_add(1, Relaxed);
                    }
                    match (direction, reply.outcome) {
                        (Direction::Forward, StepOutcome::Done(result)) => {
                            record_result(&mut saga.data, step.name(), result);
                            saga.current_step += 1;
                            // A transient failure of an earlier attempt no longer holds
                            // the saga up; the history keeps every attempt.
                            saga.last_error = None;
                        }
                        (Direction::Forward, StepOutcome::Refused(reason)) => {
                            // Refused for good: nothing applied here; undo the ones before.
                            metrics::saga_compensation(name, CompensationTrigger::Refused);
                            saga.status = SagaStatus::Compensating;
                            saga.current_step -= 1;
                            saga.last_error = Some(format!("{} refused: {reason}", step.name()));
                            events.push(compensating(CompensationTrigger::Refused, at));
                        }
                        (Direction::Backward, StepOutcome::Refused(reason)) => {
                            // Not undone: park the saga for an operator rather than call
                            // it compensated.
                            let why = format!("undo {} refused: {reason}", step.name());
                            tracing::error!(saga_id = %saga.id, step = step.name(), %reason, "compensation refused; saga parked");
                            self.park(&mut saga, position, events, why, at, Renew::Command)
                                .await;
                            return;
                        }
                        (Direction::Backward, StepOutcome::Done(_)) => {
                            saga.current_step -= 1;
                        }
                    }
                    saga.attempts = 0;
                    if !self.save(&mut saga, position, events).await {
                        return;
                    }
                }
                (Direction::Forward, Err(failure)) => {
                    let attempts = u32::try_from(saga.attempts).unwrap_or(u32::MAX);
                    saga.last_error = Some(format!("{}: {failure}", step.name()));
                    let rejected = matches!(failure, StepFailure::Rejected(_));
                    if rejected || !step.retry().allows(attempts.saturating_add(1)) {
                        // Out of attempts: it may have applied with its reply lost, so it
                        // is compensated too (compensations are idempotent per message id).
                        let trigger = if rejected {
                            CompensationTrigger::Rejected
                        } else {
                            CompensationTrigger::Exhausted
                        };
                        metrics::saga_compensation(name, trigger);
                        saga.status = SagaStatus::Compensating;
                        saga.attempts = 0;
                        events.push(compensating(trigger, at));
                        if !self.save(&mut saga, position, events).await {
                            return;
                        }
                    } else {
                        if !self.save(&mut saga, position, events).await {
                            return;
                        }
                        tokio::time::sleep(step.retry().delay(attempts, &mut rng)).await;
                    }
                }
                (Direction::Backward, Err(StepFailure::Rejected(reason))) => {
                    // Retrying cannot help (expired, no such step): park it for an
                    // operator, with its reason.
                    let why = format!("undo {}: {reason}", step.name());
                    tracing::error!(saga_id = %saga.id, step = step.name(), %reason, "compensation rejected; saga parked");
                    self.park(&mut saga, position, events, why, at, Renew::Command)
                        .await;
                    return;
                }
                (Direction::Backward, Err(failure)) => {
                    // Compensations run until they succeed.
                    let attempts = u32::try_from(saga.attempts).unwrap_or(u32::MAX);
                    saga.last_error = Some(format!("undo {}: {failure}", step.name()));
                    if !self.save(&mut saga, position, events).await {
                        return;
                    }
                    tokio::time::sleep(step.retry().delay(attempts, &mut rng)).await;
                }
            }
        }
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
                    tracing::error!(saga_id = %saga.id, %error, "saga parked");
                    let now = self.clock.now();
                    let position = (saga.status, saga.current_step);
                    self.park(
                        saga,
                        position,
                        Vec::new(),
                        error.to_string(),
                        now,
                        Renew::Nothing,
                    )
                    .await;
                    return None;
                }
            }
        }
    }

    /// The deadline of running `saga` passed while it is at a step (`current_step` is an
    /// index of `definition`'s steps): compensate it from that step (whose command may
    /// have gone out), or park it when that step has no compensation. Returns `false`
    /// when the driver must stop.
    async fn deadline_passed(
        &self,
        saga: &mut SagaInstance,
        position: Position,
        definition: &SagaDefinition,
        now: chrono::DateTime<Utc>,
    ) -> bool {
        let steps = definition.steps();
        let at = usize::try_from(saga.current_step).unwrap_or(0);
        let passed = SagaEvent::new(EventKind::DeadlinePassed, now);
        let step = &steps[at];
        if step.compensation().is_none() {
            let why = format!(
                "deadline passed at step `{}`, which has no compensation: the saga can only go \
                 forward; retry it to let it finish",
                step.name()
            );
            self.park(saga, position, vec![passed], why, now, Renew::Nothing)
                .await;
            return false;
        }
        metrics::saga_compensation(definition.name(), CompensationTrigger::Deadline);
        saga.status = SagaStatus::Compensating;
        saga.current_step = i32::try_from(at).unwrap_or(i32::MAX);
        saga.attempts = 0;
        saga.last_error = Some("deadline passed".to_owned());
        self.save(
            saga,
            position,
            vec![passed, compensating(CompensationTrigger::Deadline, now)],
        )
        .await
    }

    /// Parks `saga` with `reason`, after `events`: it waits for an operator. With
    /// [`Renew::Command`] (the step's inbox answered the command for good: refused or
    /// rejected, nothing applied), the step's next command gets a new id, so that once
    /// an operator has fixed the cause and retried the saga, the inbox does not answer
    /// with the recorded refusal again.
    async fn park(
        &self,
        saga: &mut SagaInstance,
        position: Position,
        mut events: Vec<SagaEvent>,
        reason: String,
        at: chrono::DateTime<Utc>,
        renew: Renew,
    ) {
        metrics::saga_parked(&saga.saga_name);
        events.push(SagaEvent::new(EventKind::Parked, at).detail(reason.clone()));
        saga.last_error = Some(reason.clone());
        saga.parked = Some(reason);
        saga.attempts = 0;
        if renew == Renew::Command {
            saga.command_round += 1;
        }
        self.save(saga, position, events).await;
    }

    /// Records a saga that reached its terminal state (saved).
    fn finished(&self, saga: &SagaInstance, name: &str) {
        let elapsed = (self.clock.now() - saga.created_at)
            .to_std()
            .unwrap_or_default();
        metrics::saga_finished(name, saga.status, elapsed);
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
    /// stored state, never from its stale copy. Returns `false` when the row is gone: the
    /// driver must stop.
    async fn save(&self, saga: &mut SagaInstance, from: Position, events: Vec<SagaEvent>) -> bool {
        saga.updated_at = self.clock.now();
        if (saga.status, saga.current_step) != from {
            saga.command_round = 0;
        }
        loop {
            match self.store.save(saga, &events).await {
                Ok(true) => return true,
                Ok(false) => {
                    tracing::info!(saga_id = %saga.id, "saga changed under this driver; reloading");
                    return match self.load(&saga.id).await {
                        Some(stored) => {
                            *saga = stored;
                            true
                        }
                        None => {
                            tracing::warn!(saga_id = %saga.id, "saga row is gone; driver stops");
                            false
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

/// The history's event of a saga turning to compensate, its trigger as the detail.
fn compensating(trigger: CompensationTrigger, at: chrono::DateTime<chrono::Utc>) -> SagaEvent {
    SagaEvent::new(EventKind::Compensating, at).detail(trigger.as_str())
}

fn record_result(data: &mut Value, step: &str, result: Value) {
    if !data.is_object() {
        *data = json!({ "input": data.take() });
    }
    if let Some(object) = data.as_object_mut() {
        let steps = object.entry("steps").or_insert_with(|| json!({}));
        if let Some(steps) = steps.as_object_mut() {
            steps.insert(step.to_owned(), result);
        }
    }
}

/// A per-saga seed for backoff jitter: FNV-1a of the id.
fn seed_of(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
