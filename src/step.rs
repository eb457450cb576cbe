//! Saga steps as actors: a [`StepHandler`] hosted by a [`StepPool`] of competing
//! workers, every message through the [`InboxGuard`].
//!
//! The pool is a ractor factory with queuer routing: a worker takes the next command
//! only when it is free, so one slow message does not stall the others. A handler that
//! panics takes its worker down; the factory starts a replacement, the transaction rolls
//! back (nothing recorded), and the sender sees [`StepFailure::Retryable`] — the message
//! is not lost, because the sender still holds it and retries (safe: the inbox).
//!
//! The pool's own queue (the factory's, where commands wait for a free worker) is
//! unbounded by default: callers that await each answer keep it as short as their own
//! number of calls in flight, but a caller that gives up on a timeout leaves its command
//! queued. [`StepPool::spawn_bounded`] caps it: a command arriving at a full queue is
//! answered at once with [`StepFailure::Retryable`] instead of waiting. The
//! `Participant` runtime (feature `rabbitmq`) caps it at the broker's prefetch, so the
//! broker's queue is the only one that grows.
//!
//! A [`StepError::Permanent`] refusal (card declined, out of stock) is recorded in the
//! inbox like a result, so a duplicate gets the same refusal; a
//! [`StepError::Retryable`] rolls back and leaves no row.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ractor::factory::queues::DefaultQueue;
use ractor::factory::routing::QueuerRouting;
use ractor::factory::{
    DiscardHandler, DiscardMode, DiscardReason, DiscardSettings, Factory, FactoryArguments,
    FactoryMessage, Job, Worker, WorkerId, worker_builder,
};
use ractor::rpc::CallResult;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SpawnErr};
use serde_json::{Value, json};
use sqlx::Database;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::envelope::{ConsumerType, Envelope};
use crate::inbox::{GuardError, InboxError, InboxGuard, Outcome};
use crate::store::InboxStore;
use crate::supervisor::Supervision;

/// Why a step handler did not succeed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StepError {
    /// A business refusal that will not change on retry (card declined, out of stock).
    /// Recorded in the inbox like a result, and committed with whatever the handler
    /// wrote: refuse before writing anything you would not keep.
    #[error("refused: {0}")]
    Permanent(String),
    /// A transient failure (a timeout, a lock conflict). Rolled back, nothing recorded;
    /// the sender retries.
    #[error("retryable: {0}")]
    Retryable(String),
}

/// The business logic of one saga step, run inside the inbox guard's transaction.
pub trait StepHandler<Db: Database>: Send + Sync + 'static {
    /// Applies `envelope`'s command with `conn`, the claim's transaction. Its writes
    /// commit with the inbox row or not at all.
    fn handle(
        &self,
        conn: &mut Db::Connection,
        envelope: &Envelope,
    ) -> impl Future<Output = Result<Value, StepError>> + Send;
}

/// What a step answered. A duplicate delivery gets exactly what the first one got.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    /// The command was applied; the handler's result.
    Done(Value),
    /// The command was refused for good; the reason.
    Refused(String),
}

impl StepOutcome {
    pub(crate) fn to_record(&self) -> Value {
        match self {
            // Nothing to record is recorded as nothing (`from_record` reads it back as
            // `Done(null)`): the inbox then writes no result after the handler.
            StepOutcome::Done(Value::Null) => Value::Null,
            StepOutcome::Done(value) => json!({ "done": value }),
            StepOutcome::Refused(reason) => json!({ "refused": reason }),
        }
    }

    pub(crate) fn from_record(record: &Value) -> Self {
        match (record.get("done"), record.get("refused")) {
            (Some(done), _) => StepOutcome::Done(done.clone()),
            (None, Some(reason)) => {
                StepOutcome::Refused(reason.as_str().unwrap_or_default().to_owned())
            }
            // Written by something other than a step: hand it over as it is.
            (None, None) => StepOutcome::Done(record.clone()),
        }
    }
}

/// A step's answer to one delivery.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReply {
    /// What the step did (the first delivery's answer, for a duplicate).
    pub outcome: StepOutcome,
    /// Whether this delivery was a duplicate.
    pub duplicate: bool,
}

/// Why a delivery got no answer. Nothing was recorded; the sender decides whether to
/// try again.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StepFailure {
    /// Try again later: the handler asked for it, the database failed, or the worker
    /// crashed before answering.
    #[error("step failed, retry: {0}")]
    Retryable(String),
    /// The inbox refused the message (expired, pruned month, clock too far ahead):
    /// retrying will not help; dead-letter it.
    #[error("step refused the message: {0}")]
    Rejected(String),
    /// No answer within the timeout. The step may still apply it: retry with the same
    /// message id, and the inbox will answer with the first result.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// One command for a step pool: a delivery, or a batch of them.
#[derive(Debug)]
pub struct StepCommand(Command);

#[derive(Debug)]
enum Command {
    One {
        envelope: Envelope,
        reply: RpcReplyPort<Result<StepReply, StepFailure>>,
    },
    Batch {
        envelopes: Vec<Envelope>,
        reply: RpcReplyPort<Vec<Result<StepReply, StepFailure>>>,
    },
    /// What is left of a command the factory discarded after answering it.
    Answered,
}

/// Answers a command the factory drops (a full queue, or the pool stopping) with why,
/// instead of letting its caller read a dropped reply port as a crashed worker.
#[derive(Debug)]
struct AnswerDiscarded {
    consumer_type: ConsumerType,
    queue_limit: Option<usize>,
}

impl DiscardHandler<(), StepCommand> for AnswerDiscarded {
    fn discard(&self, reason: DiscardReason, job: &mut Job<(), StepCommand>) {
        let why = match (reason, self.queue_limit) {
            (DiscardReason::Loadshed, Some(limit)) => format!(
                "the step pool {} has {limit} commands waiting already (its queue limit)",
                self.consumer_type
            ),
            (DiscardReason::Shutdown, _) => {
                format!("the step pool {} is stopping", self.consumer_type)
            }
            (reason, _) => format!(
                "the step pool {} dropped the command ({reason:?})",
                self.consumer_type
            ),
        };
        match std::mem::replace(&mut job.msg.0, Command::Answered) {
            Command::One { reply, .. } => {
                let _ = reply.send(Err(StepFailure::Retryable(why)));
            }
            Command::Batch { envelopes, reply } => {
                let _ = reply.send(
                    envelopes
                        .iter()
                        .map(|_| Err(StepFailure::Retryable(why.clone())))
                        .collect(),
                );
            }
            Command::Answered => {}
        }
    }
}

/// A step's answer to an envelope from what the inbox did with it.
fn reply_of(outcome: Outcome) -> StepReply {
    match outcome {
        Outcome::Applied(record) => StepReply {
            outcome: StepOutcome::from_record(&record),
            duplicate: false,
        },
        Outcome::Duplicate { result, .. } => StepReply {
            outcome: StepOutcome::from_record(&result),
            duplicate: true,
        },
    }
}

/// How a refusal or failure of the inbox reaches the sender.
fn failure_of(error: InboxError) -> StepFailure {
    if error.is_retryable() {
        StepFailure::Retryable(error.to_string())
    } else {
        StepFailure::Rejected(error.to_string())
    }
}

/// Runs `handler` and turns its answer into what the inbox records: a result or a
/// refusal (both committed), or the reason of a retryable failure (rolled back).
async fn record_of<Db: Database, H: StepHandler<Db>>(
    handler: &H,
    conn: &mut Db::Connection,
    envelope: &Envelope,
) -> Result<Value, String> {
    match handler.handle(conn, envelope).await {
        Ok(value) => Ok(StepOutcome::Done(value).to_record()),
        Err(StepError::Permanent(reason)) => Ok(StepOutcome::Refused(reason).to_record()),
        Err(StepError::Retryable(reason)) => Err(reason),
    }
}

/// A worker of a [`StepPool`].
#[derive(Debug)]
pub struct StepWorker<S, H> {
    guard: InboxGuard<S>,
    consumer_type: ConsumerType,
    handler: Arc<H>,
}

/// The span of one command in a step worker: a child of the span that delivered it
/// (its context travels in the envelope's headers, across the pool's mailbox).
fn step_span(consumer_type: &ConsumerType, envelope: &Envelope) -> tracing::Span {
    let span = tracing::debug_span!(
        "step.handle",
        consumer_type = %consumer_type,
        message_id = %envelope.id,
        kind = %envelope.kind,
        saga_id = envelope.saga_id.as_deref(),
    );
    crate::trace::continue_from(&span, &envelope.headers);
    span
}

impl<S: InboxStore, H: StepHandler<S::Db>> StepWorker<S, H> {
    async fn run(&self, envelope: &Envelope) -> Result<StepReply, StepFailure> {
        let handler = &self.handler;
        // Boxed: the guarded transaction's future runs to kilobytes, and the worker's
        // own future would otherwise carry (and move) it with every command.
        let processed = Box::pin(self.guard.process(
            &self.consumer_type,
            envelope,
            async |conn, envelope| record_of::<S::Db, H>(handler, conn, envelope).await,
        ))
        .instrument(step_span(&self.consumer_type, envelope))
        .await;
        match processed {
            Ok(outcome) => Ok(reply_of(outcome)),
            Err(GuardError::Handler(reason)) => Err(StepFailure::Retryable(reason)),
            Err(GuardError::Inbox(error)) => Err(failure_of(error)),
        }
    }

    /// A batch in one transaction ([`InboxGuard::process_batch`]). When the batch fails
    /// as a whole — a handler asked for a retry, the database failed — it was rolled
    /// back, and its envelopes are run one by one instead, so one bad message costs only
    /// its own answer.
    async fn run_batch(&self, envelopes: &[Envelope]) -> Vec<Result<StepReply, StepFailure>> {
        let (handler, consumer_type) = (&self.handler, &self.consumer_type);
        // One transaction for the batch, but each handler in the span of its own
        // command, so each stays in its own saga's trace.
        let processed = self
            .guard
            .process_batch(&self.consumer_type, envelopes, async |conn, envelope| {
                record_of::<S::Db, H>(handler, conn, envelope)
                    .instrument(step_span(consumer_type, envelope))
                    .await
            })
            .await;
        match processed {
            Ok(outcomes) => {
                return outcomes
                    .into_iter()
                    .map(|outcome| outcome.map(reply_of).map_err(failure_of))
                    .collect();
            }
            Err(GuardError::Inbox(error)) if !error.is_retryable() => {
                let reason = error.to_string();
                return envelopes
                    .iter()
                    .map(|_| Err(StepFailure::Rejected(reason.clone())))
                    .collect();
            }
            Err(error) => {
                tracing::debug!(
                    consumer_type = %self.consumer_type,
                    %error,
                    "batch rolled back; running its envelopes one by one"
                );
            }
        }
        let mut replies = Vec::with_capacity(envelopes.len());
        for envelope in envelopes {
            replies.push(self.run(envelope).await);
        }
        replies
    }
}

impl<S: InboxStore, H: StepHandler<S::Db>> Worker for StepWorker<S, H> {
    type Key = ();
    type Message = StepCommand;
    type Arguments = ();
    type State = ();

    async fn pre_start(
        &self,
        _wid: WorkerId,
        _factory: &ActorRef<FactoryMessage<(), StepCommand>>,
        _args: (),
    ) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _wid: WorkerId,
        _factory: &ActorRef<FactoryMessage<(), StepCommand>>,
        Job { msg, key, .. }: Job<(), StepCommand>,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        // The sender may have timed out and gone: its retry will get the recorded answer.
        match msg.0 {
            Command::One { envelope, reply } => {
                let _ = reply.send(self.run(&envelope).await);
            }
            Command::Batch { envelopes, reply } => {
                let _ = reply.send(self.run_batch(&envelopes).await);
            }
            Command::Answered => {}
        }
        Ok(key)
    }
}

/// How many workers and how long a caller waits.
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

type StepFactory<S, H> = Factory<
    (),
    StepCommand,
    (),
    StepWorker<S, H>,
    QueuerRouting<(), StepCommand>,
    DefaultQueue<(), StepCommand>,
>;

/// A pool of competing workers hosting one step.
#[derive(Debug)]
pub struct StepPool {
    consumer_type: ConsumerType,
    factory: ActorRef<FactoryMessage<(), StepCommand>>,
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
    /// being run by a worker do not count. With callers that await every answer (a
    /// broker consumer holding `prefetch` deliveries), a limit of the prefetch is never
    /// reached unless callers give up on a timeout and leave their commands behind.
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
        let handler = Arc::new(handler);
        let builder = {
            let consumer_type = consumer_type.clone();
            worker_builder(move |_wid| {
                let worker = StepWorker {
                    guard: guard.clone(),
                    consumer_type: consumer_type.clone(),
                    handler: Arc::clone(&handler),
                };
                (worker, ())
            })
        };
        // The newest is refused: it is the command the one whose sender is still waiting and
        // can requeue it, not an older one whose sender may have timed out already.
        let discard_settings = match queue_limit {
            Some(limit) => DiscardSettings::Static {
                limit,
                mode: DiscardMode::Newest,
            },
            None => DiscardSettings::None,
        };
        let arguments = FactoryArguments::builder()
            .worker_builder(Box::new(builder))
            .queue(Default::default())
            .router(Default::default())
            .num_initial_workers(config.workers.max(1))
            .discard_settings(discard_settings)
            .discard_handler(Arc::new(AnswerDiscarded {
                consumer_type: consumer_type.clone(),
                queue_limit,
            }))
            .build();
        let (factory, handle) = match supervision {
            Some(supervision) => {
                supervision
                    .spawn(
                        &format!("step pool {consumer_type}"),
                        StepFactory::<S, H>::default(),
                        arguments,
                    )
                    .await?
            }
            None => Actor::spawn(None, StepFactory::<S, H>::default(), arguments).await?,
        };
        Ok(Self {
            consumer_type,
            factory,
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
        let called = self
            .factory
            .call(
                |reply| {
                    FactoryMessage::Dispatch(Job::new(
                        (),
                        StepCommand(Command::One { envelope, reply }),
                    ))
                },
                Some(timeout),
            )
            .await;
        match called {
            Ok(CallResult::Success(answer)) => answer,
            Ok(CallResult::Timeout) => Err(StepFailure::Timeout(timeout)),
            Ok(CallResult::SenderError) => Err(StepFailure::Retryable(
                "the worker stopped before answering (it panicked or the pool is stopping)".into(),
            )),
            Err(error) => Err(StepFailure::Retryable(format!(
                "the step pool is not running: {error}"
            ))),
        }
    }

    /// Delivers a batch of envelopes — what a broker consumer with a prefetch above one
    /// holds — to one worker, which runs them in one transaction
    /// ([`InboxGuard::process_batch`]) and waits up to `timeout` for the answers: one
    /// per envelope, in order. If the batch fails as a whole it is rolled back and its
    /// envelopes run one by one, so a message that fails gets its own
    /// [`StepFailure`] and the others their answers. Safe to call again with the same
    /// envelopes at any time.
    ///
    /// `Err` when no answer came at all (timeout, pool stopped); an empty batch answers
    /// at once.
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

        let called = self
            .factory
            .call(
                |reply| {
                    FactoryMessage::Dispatch(Job::new(
                        (),
                        StepCommand(Command::Batch { envelopes, reply }),
                    ))
                },
                Some(timeout),
            )
            .await;
        match called {
            Ok(CallResult::Success(answers)) => Ok(answers),
            Ok(CallResult::Timeout) => Err(StepFailure::Timeout(timeout)),
            Ok(CallResult::SenderError) => Err(StepFailure::Retryable(
                "the worker stopped before answering (it panicked or the pool is stopping)".into(),
            )),
            Err(error) => Err(StepFailure::Retryable(format!(
                "the step pool is not running: {error}"
            ))),
        }
    }

    /// The pool's actor, for an operator's diagnostics (its supervision, its children).
    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    pub(crate) fn cell(&self) -> ractor::ActorCell {
        self.factory.get_cell()
    }

    /// Stops the pool after the commands in flight.
    pub async fn stop(self) {
        self.factory.stop(None);
        let _ = self.handle.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step with nothing to report records nothing (so the inbox can skip writing a
    /// result) and reads back as what it was; every other outcome keeps its wrapper.
    #[test]
    fn outcomes_round_trip_through_their_record_and_done_null_records_null() {
        assert_eq!(StepOutcome::Done(Value::Null).to_record(), Value::Null);
        for outcome in [
            StepOutcome::Done(Value::Null),
            StepOutcome::Done(json!({"charge_id": "c-1"})),
            StepOutcome::Done(json!({"refused": "not a refusal, a value"})),
            StepOutcome::Refused("card declined".into()),
        ] {
            assert_eq!(StepOutcome::from_record(&outcome.to_record()), outcome);
        }
    }
}
