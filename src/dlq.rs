//! Dead letters, for an operator, on either broker: [`DeadLetters::list`] reads what is
//! in a queue's dead letters without taking them; [`DeadLetters::replay`] republishes
//! them to their source queue under their original message id. `sagabox dlq list`,
//! `sagabox dlq replay` and the console's dead-letter page are these calls.
//!
//! A replay is safe because the consumer's inbox deduplicates on the message id: a dead
//! letter that had in fact been applied, or one replayed twice, is answered as a
//! duplicate and applied no second time. Each dead letter leaves the dead letters only
//! after the broker confirmed its republished copy, so a crash between the two leaves the
//! message in both places (the inbox absorbs the second), never in neither.
//!
//! On RabbitMQ the dead letters of `<prefix>.<step>` are the queue `<prefix>.<step>.dead`
//! ([`DeadLetterQueue`](crate::amqp::DeadLetterQueue)); on NATS JetStream the stream
//! on the subject `<prefix>.<step>.dead`
//! ([`DeadLetterStream`](crate::nats::DeadLetterStream)). Both are named here by the
//! source queue or subject, `sagabox.payment`, or by the dead one.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::dead_reason::DeadReason;

mod letters;

pub use letters::DeadLetters;

/// How the name of a dead-letter queue ends: `<source queue>.dead`.
pub const DEAD_SUFFIX: &str = ".dead";

/// The header counting how many times a message was replayed from a dead-letter queue.
pub const REPLAYED_HEADER: &str = "x-sagabox-replayed";

/// The longest queue name RabbitMQ accepts, in bytes (a NATS subject has no shorter limit).
const MAX_QUEUE_BYTES: usize = 255;

/// The source queue and the dead-letter queue `queue` names (on NATS JetStream, the
/// source subject and the dead-letter subject): `sagabox.payment` names
/// `sagabox.payment` and `sagabox.payment.dead`; a name ending in `.dead` is taken as the
/// dead-letter queue itself (`sagabox.payment.dead` names the same pair).
pub fn queue_names(queue: &str) -> Result<(String, String), DlqError> {
    let invalid = |reason: &str| DlqError::InvalidQueue {
        name: queue.to_owned(),
        reason: reason.to_owned(),
    };
    let source = queue.strip_suffix(DEAD_SUFFIX).unwrap_or(queue);
    if source.is_empty() {
        return Err(invalid("give the source queue, such as sagabox.payment"));
    }
    if source.chars().any(char::is_control) {
        return Err(invalid("it contains a control character"));
    }
    if source.len() + DEAD_SUFFIX.len() > MAX_QUEUE_BYTES {
        return Err(invalid(
            "its dead-letter queue's name would be over 255 bytes",
        ));
    }
    Ok((source.to_owned(), format!("{source}{DEAD_SUFFIX}")))
}

/// What went wrong reading or replaying a dead-letter queue.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DlqError {
    /// The queue name given cannot name a queue.
    #[error("invalid queue name {name:?}: {reason}")]
    InvalidQueue {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A queue (or, on NATS JetStream, a stream) the call needs does not exist on the
    /// broker; nothing was read or changed.
    #[error("{what} {queue} does not exist on {broker} at {url}; nothing was changed")]
    QueueNotFound {
        /// The broker: `RabbitMQ` or `NATS JetStream`.
        broker: &'static str,
        /// What is missing: `queue` (RabbitMQ) or `stream` (JetStream).
        what: &'static str,
        /// The missing queue or stream.
        queue: String,
        /// The broker's URL, password redacted.
        url: String,
    },
    /// RabbitMQ could not be reached, or an operation failed before any message was
    /// replayed: nothing was changed (what was read returns to the queue with its
    /// channel).
    #[cfg(feature = "rabbitmq")]
    #[error(transparent)]
    Amqp(#[from] crate::amqp::AmqpError),
    /// NATS could not be reached, or an operation failed before any message was
    /// replayed: nothing was changed.
    #[cfg(feature = "nats")]
    #[error(transparent)]
    Nats(#[from] crate::nats::NatsError),
    /// A replay failed part of the way. The messages replayed are in the source queue
    /// and gone from the dead-letter queue; every other one is still in the dead-letter
    /// queue, so running the replay again is safe.
    #[error(
        "the replay stopped after {replayed} message(s) were replayed from {queue} to {source_queue}: {source}; the rest are still in {queue}, and replaying again is safe"
    )]
    ReplayInterrupted {
        /// The dead-letter queue.
        queue: String,
        /// Where the replayed messages went.
        source_queue: String,
        /// Messages republished, confirmed and taken from the dead letters before the
        /// failure.
        replayed: usize,
        /// The failure.
        source: Box<DlqError>,
    },
}

impl DlqError {
    /// This failure of a replay from `queue` to `source_queue` after `replayed` letters
    /// had gone: [`DlqError::ReplayInterrupted`] when any had, else the failure itself
    /// (nothing was changed).
    pub(crate) fn after_replaying(self, queue: &str, source_queue: &str, replayed: usize) -> Self {
        if replayed == 0 {
            return self;
        }
        DlqError::ReplayInterrupted {
            queue: queue.to_owned(),
            source_queue: source_queue.to_owned(),
            replayed,
            source: Box::new(self),
        }
    }
}

/// One dead letter as read from its queue or stream. Every field is optional because a dead
/// letter is exactly the message that may lack what a good one carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// The inbox's key: the AMQP `message_id` property; on JetStream the
    /// `x-sagabox-message-id` header, else `Nats-Msg-Id`.
    pub message_id: Option<String>,
    /// The envelope's `kind`, when the body is JSON with a string `kind`.
    pub kind: Option<String>,
    /// The envelope's `saga_id`, when there is one.
    pub saga_id: Option<String>,
    /// The `x-sagabox-dead-reason` header: one of [`DeadReason::ALL`]'s codes for a
    /// message sagabox dead-lettered. For one RabbitMQ dead-lettered, from its
    /// `x-death` reason: `retries_exhausted` when a quorum queue's delivery limit was
    /// reached; `None` for the others (a reject without requeue by another client, a
    /// message past the queue's `x-message-ttl`).
    pub reason: Option<String>,
    /// The `x-sagabox-dead-detail` header: what exactly was wrong; for a letter the
    /// broker dead-lettered, the broker's reason and queue.
    pub detail: Option<String>,
    /// The `x-sagabox-attempts` header (classic RabbitMQ queues): retryable failures
    /// before it was dead-lettered.
    pub attempts: Option<u32>,
    /// The `x-sagabox-replayed` header: how many times it was replayed before.
    pub replayed: Option<u32>,
    /// When it was first published: the AMQP `timestamp` property, on JetStream the
    /// `x-sagabox-published-at` header.
    pub published_at: Option<DateTime<Utc>>,
    /// Seconds from `published_at` to when it was read.
    pub age_seconds: Option<u64>,
    /// Size of the body in bytes.
    pub bytes: usize,
}

impl DeadLetter {
    /// A letter with what its body says (the envelope's `kind` and `saga_id`, when it is
    /// JSON) and its size; the broker's reader fills in the rest.
    pub(crate) fn from_body(body: &[u8]) -> Self {
        let json: Option<serde_json::Value> = serde_json::from_slice(body).ok();
        let field = |name: &str| {
            json.as_ref()
                .and_then(|json| json.get(name))
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
        };
        Self {
            message_id: None,
            kind: field("kind"),
            saga_id: field("saga_id"),
            reason: None,
            detail: None,
            attempts: None,
            replayed: None,
            published_at: None,
            age_seconds: None,
            bytes: body.len(),
        }
    }
}

/// What [`DeadLetters::list`] read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetterList {
    /// The dead-letter queue (or subject).
    pub queue: String,
    /// The queue its messages came from.
    pub source_queue: String,
    /// Messages ready in the dead-letter queue when the listing started.
    pub total: u32,
    /// The messages read, oldest first, at most the limit asked for.
    pub messages: Vec<DeadLetter>,
}

/// Which dead letters [`DeadLetters::replay`] republishes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Only dead letters with this reason; the others stay where they are. Defaults to
    /// `None`: every dead letter, whatever its reason (or none).
    pub reason: Option<DeadReason>,
    /// Replay at most this many. Defaults to `None`: every one that matches.
    pub limit: Option<usize>,
}

impl ReplayOptions {
    /// Whether `letter` is one to replay.
    pub(crate) fn matches(&self, letter: &DeadLetter) -> bool {
        self.reason
            .is_none_or(|reason| letter.reason.as_deref() == Some(reason.as_str()))
    }
}

/// What [`DeadLetters::replay`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplayReport {
    /// The dead-letter queue (or subject).
    pub queue: String,
    /// Where the replayed messages went.
    pub source_queue: String,
    /// The reason replayed, if only one was.
    pub reason: Option<String>,
    /// Messages republished (confirmed) and removed from the dead-letter queue.
    pub replayed: usize,
    /// Messages ready in the dead-letter queue afterwards.
    pub left: u32,
    /// The messages replayed, in order, as they were before the replay.
    pub messages: Vec<DeadLetter>,
}

/// `seconds` for people: `42 s`, `5 min`, `3 h`, `2 days`.
fn age(seconds: u64) -> String {
    match seconds {
        s if s < 120 => format!("{s} s"),
        s if s < 7_200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{} h", s / 3_600),
        s => format!("{} days", s / 86_400),
    }
}

fn or_dash(value: Option<&str>) -> &str {
    value.unwrap_or("-")
}

impl fmt::Display for DeadLetter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let attempts = self.attempts.map_or("-".to_owned(), |n| n.to_string());
        let age = self.age_seconds.map_or("-".to_owned(), age);
        write!(
            f,
            "{:<38} {:<20} {:<20} {:>8} {:>9}  {}",
            or_dash(self.message_id.as_deref()),
            or_dash(self.kind.as_deref()),
            or_dash(self.reason.as_deref()),
            attempts,
            age,
            or_dash(self.detail.as_deref()),
        )
    }
}

/// `letters` as a table under a header line, or nothing when there are none.
fn table(f: &mut fmt::Formatter<'_>, letters: &[DeadLetter]) -> fmt::Result {
    if letters.is_empty() {
        return Ok(());
    }
    writeln!(
        f,
        "  {:<38} {:<20} {:<20} {:>8} {:>9}  detail",
        "message id", "kind", "reason", "attempts", "age"
    )?;
    for letter in letters {
        writeln!(f, "  {letter}")?;
    }
    Ok(())
}

impl fmt::Display for DeadLetterList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} dead letter(s) from {}; showing {} (left in the queue)",
            self.queue,
            self.total,
            self.source_queue,
            self.messages.len()
        )?;
        table(f, &self.messages)
    }
}

impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let which = self
            .reason
            .as_ref()
            .map_or(String::new(), |reason| format!(" with reason {reason}"));
        writeln!(
            f,
            "replayed {} dead letter(s){which} from {} to {}; {} left in {}",
            self.replayed, self.queue, self.source_queue, self.left, self.queue
        )?;
        table(f, &self.messages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_is_named_by_its_source_or_its_dead_letter_queue() {
        let pair = (
            "sagabox.payment".to_owned(),
            "sagabox.payment.dead".to_owned(),
        );
        assert_eq!(queue_names("sagabox.payment").unwrap(), pair);
        assert_eq!(queue_names("sagabox.payment.dead").unwrap(), pair);
        for bad in ["", ".dead", "a\nb", &"q".repeat(251)] {
            let error = queue_names(bad).unwrap_err();
            assert!(matches!(error, DlqError::InvalidQueue { .. }), "{error}");
        }
        assert!(queue_names(&"q".repeat(250)).is_ok());
    }

    #[test]
    fn a_filter_by_reason_takes_only_that_reason() {
        let letter = |reason: Option<&str>| DeadLetter {
            message_id: None,
            kind: None,
            saga_id: None,
            reason: reason.map(str::to_owned),
            detail: None,
            attempts: None,
            replayed: None,
            published_at: None,
            age_seconds: None,
            bytes: 0,
        };
        let all = ReplayOptions::default();
        let rejected = ReplayOptions {
            reason: Some(DeadReason::Rejected),
            limit: None,
        };
        assert!(all.matches(&letter(None)));
        assert!(rejected.matches(&letter(Some("rejected"))));
        assert!(!rejected.matches(&letter(Some("unknown_kind"))));
        assert!(!rejected.matches(&letter(None)));
    }

    #[test]
    fn ages_read_in_the_largest_whole_unit() {
        assert_eq!(age(42), "42 s");
        assert_eq!(age(600), "10 min");
        assert_eq!(age(3 * 3600), "3 h");
        assert_eq!(age(5 * 86_400), "5 days");
    }
}
