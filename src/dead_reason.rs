//! Why a message was dead-lettered, on any broker: [`DeadReason`], the complete list of
//! reasons, and the headers a dead-lettered message carries them in. The codes are the
//! values of a header and of a metric label, so they are stable and parsed back
//! ([`DeadReason::from_str`](std::str::FromStr::from_str)) by the dead-letter tools.

use std::fmt;

/// The header with a dead-lettered message's reason code.
pub const DEAD_REASON_HEADER: &str = "x-sagabox-dead-reason";
/// The header with a dead-lettered message's explanation.
pub const DEAD_DETAIL_HEADER: &str = "x-sagabox-dead-detail";
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
