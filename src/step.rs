//! Saga steps as actors: a [`StepHandler`] hosted by a [`StepPool`] of competing
//! workers, every message through the [`InboxGuard`](crate::InboxGuard).
//!
//! The pool's workers are actors that take the next command from the pool's queue only
//! when they are free, so one slow message does not stall the others. A handler that
//! panics takes its worker down; the pool starts a replacement, the transaction rolls
//! back (nothing recorded), and the sender sees [`StepFailure::Retryable`] — the message
//! is not lost, because the sender still holds it and retries (safe: the inbox).
//!
//! The pool's queue (where commands wait for a free worker) is unbounded by default:
//! callers that await each answer keep it as short as their own number of calls in
//! flight, but a caller that gives up on a timeout leaves its command queued.
//! [`StepPool::spawn_bounded`] caps it: a command arriving at a full queue is answered
//! at once with [`StepFailure::Retryable`] instead of waiting. The `Participant`
//! runtime (feature `rabbitmq` or `nats`) caps it at the broker's prefetch, so the
//! broker's queue is the only one that grows.
//!
//! A [`StepError::Permanent`] refusal (card declined, out of stock) is recorded in the
//! inbox like a result, so a duplicate gets the same refusal; a
//! [`StepError::Retryable`] rolls back and leaves no row.

mod pool;
mod worker;

use std::future::Future;
use std::time::Duration;

use serde_json::{Value, json};
use sqlx::Database;

pub use pool::{StepPool, StepPoolConfig};

use crate::envelope::Envelope;

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

    /// Applies a batch's fresh commands (in the order they were claimed) together, with
    /// a few set-based statements instead of a few per command, and answers each, in
    /// the same order; or returns `None` to have them applied one by one with
    /// [`handle`](Self::handle), in the batch's transaction (the default).
    ///
    /// Only a pool whose commands are claimed in batches calls it. The answers mean what
    /// `handle`'s do: a [`StepError::Permanent`] refusal is recorded, so a command refused
    /// must leave no write of its own behind; a [`StepError::Retryable`] in any answer
    /// rolls the whole batch back, and its commands are then run one by one with
    /// `handle`. Answering a different number of commands than given is a bug, not
    /// retried: the batch rolls back and every command of it is answered
    /// [`StepFailure::Rejected`] ([`InboxError::BatchResultCount`](crate::InboxError)).
    /// Take row locks in one order (sorted by key) so that batches never deadlock. A
    /// handler that wraps another passes this on too, or the wrapped one's sets are lost.
    fn handle_batch(
        &self,
        conn: &mut Db::Connection,
        envelopes: &[&Envelope],
    ) -> impl Future<Output = Option<Vec<Result<Value, StepError>>>> + Send {
        let _ = (conn, envelopes);
        async { None }
    }
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
