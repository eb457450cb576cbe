//! What a transport's consumer hands each decoded message to, and how the answer settles
//! the delivery: [`DeliveryHandler`] and [`Disposition`], shared by every transport, with
//! the reasons a message is dead-lettered for ([`DeadReason`]) and the header names a
//! dead-lettered or retried message carries on any broker.

use std::fmt;
use std::future::Future;
use std::sync::atomic::AtomicU64;

use crate::envelope::Envelope;

/// The header with a dead-lettered message's reason code.
pub const DEAD_REASON_HEADER: &str = "x-sagabox-dead-reason";
/// The header with a dead-lettered message's explanation.
pub const DEAD_DETAIL_HEADER: &str = "x-sagabox-dead-detail";
/// The header counting a message's retryable failures.
pub const ATTEMPTS_HEADER: &str = "x-sagabox-attempts";

/// Why a message was dead-lettered: the `reason` label of [`DEAD_LETTERS_TOTAL`](crate::metrics::DEAD_LETTERS_TOTAL) and the
/// value of the RabbitMQ transport's `x-sagabox-dead-reason` header. [`DeadReason::ALL`]
/// is the complete list, and the only values either carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadReason {
    /// The delivery had no message id, so the inbox had nothing stable to deduplicate on.
    MissingMessageId,
    /// The message id was empty, too long or held control characters.
    InvalidMessageId,
    /// The body was not the JSON envelope (`kind`, `saga_id`, `payload`).
    NotAnEnvelope,
    /// The message kind is not one the consumer takes.
    UnknownKind,
    /// The handler refused it for good: for a guarded step, the inbox refused it
    /// (older than the TTL, filed under a pruned month, published too far ahead).
    Rejected,
    /// It failed with a retryable error on every allowed attempt.
    RetriesExhausted,
}

impl DeadReason {
    /// Every reason, in the order the operations guide lists them.
    pub const ALL: [DeadReason; 6] = [
        DeadReason::MissingMessageId,
        DeadReason::InvalidMessageId,
        DeadReason::NotAnEnvelope,
        DeadReason::UnknownKind,
        DeadReason::Rejected,
        DeadReason::RetriesExhausted,
    ];

    /// The short, stable code written to the header and the metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            DeadReason::MissingMessageId => "missing_message_id",
            DeadReason::InvalidMessageId => "invalid_message_id",
            DeadReason::NotAnEnvelope => "not_an_envelope",
            DeadReason::UnknownKind => "unknown_kind",
            DeadReason::Rejected => "rejected",
            DeadReason::RetriesExhausted => "retries_exhausted",
        }
    }
}

impl fmt::Display for DeadReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reason code that is not one of [`DeadReason::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dead-letter reason {0:?}; the reasons are {list}", list = DeadReason::codes())]
pub struct UnknownDeadReason(pub String);

impl DeadReason {
    /// Every code, comma-separated, for messages that list what is accepted.
    fn codes() -> String {
        DeadReason::ALL.map(DeadReason::as_str).join(", ")
    }
}

impl std::str::FromStr for DeadReason {
    type Err = UnknownDeadReason;

    /// Parses a code as [`DeadReason::as_str`] writes it.
    fn from_str(code: &str) -> Result<Self, Self::Err> {
        DeadReason::ALL
            .into_iter()
            .find(|reason| reason.as_str() == code)
            .ok_or_else(|| UnknownDeadReason(code.to_owned()))
    }
}

/// What to do with a delivery, as the handler decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// Handled (applied, or found to be a duplicate): acknowledge. A `reply` is published
    /// first to the delivery's `reply_to` queue, correlated by the message id.
    Done {
        /// The answer to send back, if the sender asked for one.
        reply: Option<Envelope>,
    },
    /// Failed for now (the database is down, a lock timed out): requeue, up to the limit.
    Retry(String),
    /// Will never succeed (the inbox refused it): dead-letter with this reason.
    Reject(String),
}

/// What handles each decoded message. Implemented for async closures
/// `Fn(Envelope) -> impl Future<Output = Disposition>`.
pub trait DeliveryHandler: Send + Sync + 'static {
    /// Handles one message.
    fn handle(&self, envelope: Envelope) -> impl Future<Output = Disposition> + Send;
}

impl<F, Fut> DeliveryHandler for F
where
    F: Fn(Envelope) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Disposition> + Send,
{
    fn handle(&self, envelope: Envelope) -> impl Future<Output = Disposition> + Send {
        self(envelope)
    }
}

/// Counters of what a consumer did, for tests and summaries.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    /// Deliveries acknowledged after the handler said done.
    pub acked: AtomicU64,
    /// Deliveries dead-lettered (bad input, rejected, out of attempts).
    pub dead_lettered: AtomicU64,
    /// Deliveries published again after a retryable failure.
    pub requeued: AtomicU64,
    /// Sessions started (1 + reconnections).
    pub sessions: AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dead_reason_parses_back_from_its_code() {
        for reason in DeadReason::ALL {
            assert_eq!(reason.as_str().parse::<DeadReason>(), Ok(reason));
        }
        let error = "oops".parse::<DeadReason>().unwrap_err();
        assert!(error.to_string().contains("retries_exhausted"), "{error}");
    }
}
