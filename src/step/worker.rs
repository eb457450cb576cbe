//! A step pool's worker: an actor that takes the next command from its pool's queue
//! whenever it is free, runs it behind the inbox guard, and answers it.
//!
//! Workers pull: a command goes from the caller straight to whichever worker is free,
//! with no dispatcher between them. Between two commands a worker passes through its
//! mailbox (it sends itself [`Pull`]), so a stop from its pool is seen there.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::Value;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::{StepError, StepFailure, StepHandler, StepOutcome, StepReply};
use crate::envelope::{ConsumerType, Envelope};
use crate::inbox::{GuardError, InboxError, InboxGuard, Outcome};
use crate::store::InboxStore;

/// One command in a pool's queue: a delivery or a batch, and where its answer goes.
#[derive(Debug)]
pub(super) enum Command {
    One {
        envelope: Envelope,
        reply: oneshot::Sender<Result<StepReply, StepFailure>>,
    },
    Batch {
        envelopes: Vec<Envelope>,
        reply: oneshot::Sender<Vec<Result<StepReply, StepFailure>>>,
    },
}

impl Command {
    /// Answers the command, unrun, with a retryable failure saying `why`: its sender
    /// still holds the message and can try again.
    pub(super) fn refuse(self, why: &str) {
        match self {
            Command::One { reply, .. } => {
                let _ = reply.send(Err(StepFailure::Retryable(why.to_owned())));
            }
            Command::Batch { envelopes, reply } => {
                let _ = reply.send(
                    envelopes
                        .iter()
                        .map(|_| Err(StepFailure::Retryable(why.to_owned())))
                        .collect(),
                );
            }
        }
    }
}

/// Take the next command from the pool's queue.
#[derive(Debug)]
pub(super) struct Pull;

/// A worker of a [`StepPool`](super::StepPool).
pub(super) struct StepWorker<S, H> {
    pub(super) guard: InboxGuard<S>,
    pub(super) consumer_type: ConsumerType,
    pub(super) handler: Arc<H>,
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

/// Runs `handler` and turns its answer into what the inbox records
/// ([`record_of_answer`]).
async fn record_of<Db: sqlx::Database, H: StepHandler<Db>>(
    handler: &H,
    conn: &mut Db::Connection,
    envelope: &Envelope,
) -> Result<Value, String> {
    record_of_answer(handler.handle(conn, envelope).await)
}

/// What the inbox records of a handler's answer: a result or a refusal (both
/// committed), or the reason of a retryable failure (rolled back).
fn record_of_answer(answer: Result<Value, StepError>) -> Result<Value, String> {
    match answer {
        Ok(value) => Ok(StepOutcome::Done(value).to_record()),
        Err(StepError::Permanent(reason)) => Ok(StepOutcome::Refused(reason).to_record()),
        Err(StepError::Retryable(reason)) => Err(reason),
    }
}

/// The span of one command in a step worker: a child of the span that delivered it
/// (its context travels in the envelope's headers, across the pool's queue).
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

    /// A batch in one transaction ([`InboxGuard::process_batch_set`]): its fresh commands
    /// applied together when the handler can ([`StepHandler::handle_batch`]), one by one
    /// otherwise. When the batch fails
    /// as a whole — a handler asked for a retry, the database failed — it was rolled
    /// back, and its envelopes are run one by one instead, so one bad message costs only
    /// its own answer.
    async fn run_batch(&self, envelopes: &[Envelope]) -> Vec<Result<StepReply, StepFailure>> {
        let (handler, consumer_type) = (&self.handler, &self.consumer_type);
        let processed = self
            .guard
            .process_batch_set(&self.consumer_type, envelopes, async |conn, fresh| {
                let span = tracing::debug_span!(
                    "step.handle_batch",
                    consumer_type = %consumer_type,
                    commands = fresh.len(),
                );
                if let Some(answers) = handler.handle_batch(conn, fresh).instrument(span).await {
                    return answers.into_iter().map(record_of_answer).collect();
                }
                // One by one in the batch's transaction, each handler in the span of its
                // own command, so each stays in its own saga's trace.
                let mut records = Vec::with_capacity(fresh.len());
                for envelope in fresh {
                    records.push(
                        record_of::<S::Db, H>(handler, conn, envelope)
                            .instrument(step_span(consumer_type, envelope))
                            .await?,
                    );
                }
                Ok(records)
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

impl<S: InboxStore, H: StepHandler<S::Db>> Actor for StepWorker<S, H> {
    type Msg = Pull;
    /// The pool's queue.
    type State = async_channel::Receiver<Command>;
    type Arguments = async_channel::Receiver<Command>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Pull>,
        queue: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(queue)
    }

    async fn post_start(
        &self,
        myself: ActorRef<Pull>,
        _queue: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        myself.send_message(Pull)?;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Pull>,
        Pull: Pull,
        queue: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let Ok(command) = queue.recv().await else {
            // Closed and empty: the pool is stopping, or was dropped. Nothing more
            // will come.
            myself.stop(None);
            return Ok(());
        };
        // The sender may have timed out and gone: its retry will get the recorded answer.
        match command {
            Command::One { envelope, reply } => {
                let _ = reply.send(self.run(&envelope).await);
            }
            Command::Batch { envelopes, reply } => {
                let _ = reply.send(self.run_batch(&envelopes).await);
            }
        }
        // Fails only when the worker is stopping already.
        let _ = myself.send_message(Pull);
        Ok(())
    }
}
