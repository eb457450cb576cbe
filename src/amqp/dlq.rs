//! The dead-letter queue, for an operator: [`DeadLetterQueue::list`] reads what is in
//! `<queue>.dead` without taking it; [`DeadLetterQueue::replay`] republishes dead letters
//! to their source queue under their original message id. `sagabox dlq list` and
//! `sagabox dlq replay` are these two calls.
//!
//! A replay is safe because the consumer's inbox deduplicates on the message id: a dead
//! letter that had in fact been applied, or one replayed twice, is answered as a
//! duplicate and applied no second time. Each dead letter is acked only after the broker
//! confirmed its republished copy, so a crash between the two leaves the message in both
//! queues (the inbox absorbs the second), never in neither.
//!
//! Both read with `basic.get` and hold what they read unacked on one channel until the
//! call ends, then give back what they did not replay (nacked with requeue: a classic
//! queue puts each back where it was). A call considers only the messages in the queue
//! when it starts, so a replayed message that the consumer dead-letters again is not
//! replayed a second time by the same call. Two calls at once each see only the messages
//! the other does not hold.

use std::fmt;

use chrono::{DateTime, TimeZone, Utc};
use lapin::message::{BasicGetMessage, Delivery};
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;

use super::broker::{self, Publisher, Routing};
use super::codec;
use super::config::{AmqpConfig, AmqpError};
use crate::delivery::DeadReason;
use crate::delivery::{ATTEMPTS_HEADER, DEAD_DETAIL_HEADER, DEAD_REASON_HEADER};
use crate::logging::redact;

/// How the name of a dead-letter queue ends: `<source queue>.dead`.
pub const DEAD_SUFFIX: &str = ".dead";

/// The header counting how many times a message was replayed from a dead-letter queue.
pub const REPLAYED_HEADER: &str = "x-sagabox-replayed";

/// The longest queue name RabbitMQ accepts, in bytes.
const MAX_QUEUE_BYTES: usize = 255;

/// The source queue and the dead-letter queue `queue` names: `sagabox.payment` names
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
    /// A queue the call needs does not exist on the broker; nothing was read or changed.
    #[error("queue {queue} does not exist on RabbitMQ at {url}; nothing was changed")]
    QueueNotFound {
        /// The missing queue.
        queue: String,
        /// The broker's URL, password redacted.
        url: String,
    },
    /// The broker could not be reached, or an operation failed before any message was
    /// replayed: nothing was changed (what was read returns to the queue with its
    /// channel).
    #[error(transparent)]
    Amqp(#[from] AmqpError),
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
        /// Messages republished, confirmed and acked before the failure.
        replayed: usize,
        /// The failure.
        source: Box<AmqpError>,
    },
}

/// One dead letter as read from the queue. Every field is optional because a dead
/// letter is exactly the message that may lack what a good one carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// The AMQP `message_id` property: the inbox's key.
    pub message_id: Option<String>,
    /// The envelope's `kind`, when the body is JSON with a string `kind`.
    pub kind: Option<String>,
    /// The envelope's `saga_id`, when there is one.
    pub saga_id: Option<String>,
    /// The `x-sagabox-dead-reason` header: one of [`DeadReason::ALL`]'s codes for a
    /// message sagabox dead-lettered. For one the broker dead-lettered, from its
    /// `x-death` reason: `retries_exhausted` when a quorum queue's delivery limit was
    /// reached; `None` for the others (a reject without requeue by another client, a
    /// message past the queue's `x-message-ttl`).
    pub reason: Option<String>,
    /// The `x-sagabox-dead-detail` header: what exactly was wrong; for a letter the
    /// broker dead-lettered, the broker's reason and queue.
    pub detail: Option<String>,
    /// The `x-sagabox-attempts` header: retryable failures before it was dead-lettered.
    pub attempts: Option<u32>,
    /// The `x-sagabox-replayed` header: how many times it was replayed before.
    pub replayed: Option<u32>,
    /// The AMQP `timestamp` property: when it was first published.
    pub published_at: Option<DateTime<Utc>>,
    /// Seconds from `published_at` to when it was read.
    pub age_seconds: Option<u64>,
    /// Size of the body in bytes.
    pub bytes: usize,
}

impl DeadLetter {
    /// What `delivery` says about itself, its age measured at `now`.
    fn read(delivery: &Delivery, now: DateTime<Utc>) -> Self {
        let properties = &delivery.properties;
        let body: Option<serde_json::Value> = serde_json::from_slice(&delivery.data).ok();
        let field = |name: &str| {
            body.as_ref()
                .and_then(|body| body.get(name))
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
        };
        let published_at = properties
            .timestamp()
            .and_then(|seconds| i64::try_from(seconds).ok())
            .and_then(|seconds| Utc.timestamp_opt(seconds, 0).single());
        Self {
            message_id: properties.message_id().as_ref().map(ToString::to_string),
            kind: field("kind"),
            saga_id: field("saga_id"),
            reason: codec::header(properties, DEAD_REASON_HEADER).or_else(|| {
                broker_death(properties)
                    .filter(|(reason, _)| reason == BROKER_DELIVERY_LIMIT)
                    .map(|_| DeadReason::RetriesExhausted.as_str().to_owned())
            }),
            detail: codec::header(properties, DEAD_DETAIL_HEADER).or_else(|| {
                broker_death(properties).map(|(reason, queue)| {
                    format!("dead-lettered by RabbitMQ from {queue}: {reason}")
                })
            }),
            attempts: codec::count_header(properties, ATTEMPTS_HEADER),
            replayed: codec::count_header(properties, REPLAYED_HEADER),
            published_at,
            age_seconds: published_at
                .map(|at| u64::try_from((now - at).num_seconds()).unwrap_or(0)),
            bytes: delivery.data.len(),
        }
    }
}

/// What [`DeadLetterQueue::list`] read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetterList {
    /// The dead-letter queue.
    pub queue: String,
    /// The queue its messages came from.
    pub source_queue: String,
    /// Messages ready in the dead-letter queue when the listing started.
    pub total: u32,
    /// The messages read, oldest first, at most the limit asked for.
    pub messages: Vec<DeadLetter>,
}

/// Which dead letters [`DeadLetterQueue::replay`] republishes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Only dead letters with this reason; the others stay where they are. Defaults to
    /// `None`: every dead letter, whatever its reason (or none).
    pub reason: Option<DeadReason>,
    /// Replay at most this many. Defaults to `None`: every one that matches.
    pub limit: Option<usize>,
}

impl ReplayOptions {
    fn matches(&self, letter: &DeadLetter) -> bool {
        self.reason
            .is_none_or(|reason| letter.reason.as_deref() == Some(reason.as_str()))
    }
}

/// What [`DeadLetterQueue::replay`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplayReport {
    /// The dead-letter queue.
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

/// The `x-death` reason of a message a quorum queue dead-lettered at its delivery limit.
const BROKER_DELIVERY_LIMIT: &str = "delivery_limit";

/// The reason and source queue of the broker's latest dead-lettering of a message (the
/// first entry of its `x-death` header), if the broker dead-lettered it.
fn broker_death(properties: &BasicProperties) -> Option<(String, String)> {
    let headers = properties.headers().as_ref()?;
    let AMQPValue::FieldArray(deaths) = headers.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(death) = deaths.as_slice().first()? else {
        return None;
    };
    let text = |name: &str| match death.inner().get(name) {
        Some(AMQPValue::LongString(value)) => Some(value.to_string()),
        Some(AMQPValue::ShortString(value)) => Some(value.as_str().to_owned()),
        _ => None,
    };
    Some((
        text("reason")?,
        text("queue").unwrap_or_else(|| "?".to_owned()),
    ))
}

/// A connection to the broker, for reading and replaying one dead-letter queue.
#[derive(Debug)]
pub struct DeadLetterQueue {
    connection: Connection,
    url: String,
    source: String,
    dead: String,
}

impl DeadLetterQueue {
    /// Connects to the broker in `config` (only its URL and, to name the connection, its
    /// prefix matter) and checks that the dead-letter queue of `queue` exists.
    /// `queue` is the source queue, or the dead-letter queue (see [`queue_names`]).
    pub async fn open(config: &AmqpConfig, queue: &str) -> Result<Self, DlqError> {
        let (source, dead) = queue_names(queue)?;
        config.validate()?;
        let connection = broker::connect(config, &format!("dlq {source}")).await?;
        let opened = Self {
            connection,
            url: redact(&config.url),
            source,
            dead,
        };
        if let Err(error) = opened.ready(&opened.dead).await {
            opened.close().await;
            return Err(error);
        }
        Ok(opened)
    }

    /// The queue the dead letters came from, and where a replay sends them.
    pub fn source_queue(&self) -> &str {
        &self.source
    }

    /// The dead-letter queue.
    pub fn dead_queue(&self) -> &str {
        &self.dead
    }

    /// Messages ready in the dead-letter queue.
    pub async fn count(&self) -> Result<u32, DlqError> {
        self.ready(&self.dead).await
    }

    /// Reads up to `limit` dead letters (all of them with `None`), oldest first, and
    /// gives every one back: the queue holds the same messages afterwards.
    pub async fn list(&self, limit: Option<usize>) -> Result<DeadLetterList, DlqError> {
        let total = self.ready(&self.dead).await?;
        let channel = self.channel().await?;
        let now = Utc::now();
        let mut held = Vec::new();
        let read = async {
            let total = usize::try_from(total).unwrap_or(usize::MAX);
            let wanted = limit.map_or(total, |limit| limit.min(total));
            while held.len() < wanted {
                match self.get(&channel).await? {
                    Some(message) => held.push(message),
                    None => break,
                }
            }
            Ok::<_, AmqpError>(())
        }
        .await;
        let messages = held
            .iter()
            .map(|message| DeadLetter::read(&message.delivery, now))
            .collect();
        let given_back = give_back(&channel, &held).await;
        read?;
        given_back?;
        Ok(DeadLetterList {
            queue: self.dead.clone(),
            source_queue: self.source.clone(),
            total,
            messages,
        })
    }

    /// Republishes the dead letters `options` selects to the source queue: the body and
    /// properties unchanged (the message id above all), without the dead-letter reason,
    /// detail and attempt count (so the consumer counts its attempts afresh), with
    /// `x-sagabox-replayed` counting the replays. Each is acked from the dead-letter queue
    /// once the broker confirmed its copy; the others are given back untouched.
    ///
    /// The source queue must exist ([`DlqError::QueueNotFound`] otherwise, before
    /// anything is read).
    pub async fn replay(&self, options: &ReplayOptions) -> Result<ReplayReport, DlqError> {
        self.ready(&self.source).await?;
        let total = self.ready(&self.dead).await?;
        let publisher = Publisher::open(&self.connection).await?;
        let channel = self.channel().await?;
        let now = Utc::now();
        let mut held = Vec::new();
        let mut replayed = Vec::new();
        let run = async {
            // Bounded by what was there at the start: a copy the consumer dead-letters
            // again lands behind it and must not be replayed round and round.
            for _ in 0..total {
                if options.limit.is_some_and(|limit| replayed.len() >= limit) {
                    break;
                }
                let Some(message) = self.get(&channel).await? else {
                    break;
                };
                let letter = DeadLetter::read(&message.delivery, now);
                if !options.matches(&letter) {
                    held.push(message);
                    continue;
                }
                // A failure from here leaves this message unacked: it returns to the dead
                // queue when the channel closes below.
                publisher
                    .publish_raw(
                        &self.source,
                        &message.delivery.data,
                        replay_properties(&message.delivery.properties),
                        Routing::Required,
                    )
                    .await?;
                message
                    .delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .map_err(AmqpError::broker("ack the dead letter"))?;
                replayed.push(letter);
            }
            Ok::<_, AmqpError>(())
        }
        .await;
        let given_back = give_back(&channel, &held).await;
        let _ = publisher.channel().close(200, "replayed".into()).await;
        match run {
            Err(source) if !replayed.is_empty() => {
                return Err(DlqError::ReplayInterrupted {
                    queue: self.dead.clone(),
                    source_queue: self.source.clone(),
                    replayed: replayed.len(),
                    source: Box::new(source),
                });
            }
            Err(source) => return Err(source.into()),
            Ok(()) => {}
        }
        given_back?;
        Ok(ReplayReport {
            queue: self.dead.clone(),
            source_queue: self.source.clone(),
            reason: options.reason.map(|reason| reason.as_str().to_owned()),
            replayed: replayed.len(),
            left: self.ready(&self.dead).await?,
            messages: replayed,
        })
    }

    /// Closes the connection.
    pub async fn close(self) {
        let _ = self.connection.close(200, "done".into()).await;
    }

    async fn channel(&self) -> Result<Channel, AmqpError> {
        self.connection
            .create_channel()
            .await
            .map_err(AmqpError::broker("open a channel"))
    }

    /// The next dead letter, held unacked on `channel`.
    async fn get(&self, channel: &Channel) -> Result<Option<BasicGetMessage>, AmqpError> {
        channel
            .basic_get(self.dead.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .map_err(AmqpError::broker("read the dead-letter queue"))
    }

    /// Messages ready in `queue`, or [`DlqError::QueueNotFound`].
    async fn ready(&self, queue: &str) -> Result<u32, DlqError> {
        // A passive declare of a missing queue closes its channel: a channel of its own.
        let channel = self.channel().await?;
        let declared = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        match declared {
            Ok(declared) => {
                let _ = channel.close(200, "counted".into()).await;
                Ok(declared.message_count())
            }
            Err(error) if is_not_found(&error) => Err(DlqError::QueueNotFound {
                queue: queue.to_owned(),
                url: self.url.clone(),
            }),
            Err(source) => Err(AmqpError::Broker {
                operation: "look up the queue",
                source,
            }
            .into()),
        }
    }
}

/// Whether the broker answered 404 NOT_FOUND.
fn is_not_found(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
    )
}

/// Returns the messages `held` to their queue and closes `channel`. Closing alone would
/// return them too; the explicit requeue says so, and a failure of either still returns
/// them (the broker requeues what a dead channel held).
async fn give_back(channel: &Channel, held: &[BasicGetMessage]) -> Result<(), AmqpError> {
    let mut result = Ok(());
    for message in held {
        let nacked = message
            .delivery
            .acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await;
        if let Err(source) = nacked {
            result = Err(AmqpError::Broker {
                operation: "give back the dead letters read",
                source,
            });
            break;
        }
    }
    let closed = channel
        .close(200, "given back".into())
        .await
        .map_err(AmqpError::broker("close the reading channel"));
    result.and(closed)
}

/// The properties a dead letter is replayed with: its own, minus what the dead-lettering
/// added and the attempt count, plus one more replay.
fn replay_properties(properties: &BasicProperties) -> BasicProperties {
    const DROPPED: [&str; 4] = [
        DEAD_REASON_HEADER,
        DEAD_DETAIL_HEADER,
        ATTEMPTS_HEADER,
        REPLAYED_HEADER,
    ];
    let replays = codec::count_header(properties, REPLAYED_HEADER)
        .unwrap_or(0)
        .saturating_add(1);
    let mut headers = FieldTable::default();
    if let Some(old) = properties.headers() {
        for (name, value) in old.inner() {
            if !DROPPED.contains(&name.as_str()) {
                headers.insert(name.clone(), value.clone());
            }
        }
    }
    headers.insert(
        REPLAYED_HEADER.into(),
        AMQPValue::LongLongInt(i64::from(replays)),
    );
    properties.clone().with_headers(headers)
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

fn header(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    writeln!(
        f,
        "  {:<38} {:<20} {:<20} {:>8} {:>9}  detail",
        "message id", "kind", "reason", "attempts", "age"
    )
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
        if self.messages.is_empty() {
            return Ok(());
        }
        header(f)?;
        for message in &self.messages {
            writeln!(f, "  {message}")?;
        }
        Ok(())
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
        if self.messages.is_empty() {
            return Ok(());
        }
        header(f)?;
        for message in &self.messages {
            writeln!(f, "  {message}")?;
        }
        Ok(())
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
    fn a_replay_drops_the_dead_letter_headers_and_counts_the_replays() {
        let properties = codec::with_headers(
            BasicProperties::default().with_message_id("m-1".into()),
            [
                (DEAD_REASON_HEADER, AMQPValue::LongString("rejected".into())),
                (DEAD_DETAIL_HEADER, AMQPValue::LongString("too old".into())),
                (ATTEMPTS_HEADER, AMQPValue::LongLongInt(5)),
                ("traceparent", AMQPValue::LongString("00-abc".into())),
            ],
        );
        let first = replay_properties(&properties);
        assert_eq!(first.message_id().as_ref().unwrap().as_str(), "m-1");
        assert_eq!(codec::header(&first, DEAD_REASON_HEADER), None);
        assert_eq!(codec::header(&first, DEAD_DETAIL_HEADER), None);
        assert_eq!(codec::count_header(&first, ATTEMPTS_HEADER), None);
        assert_eq!(
            codec::header(&first, "traceparent").as_deref(),
            Some("00-abc")
        );
        assert_eq!(codec::count_header(&first, REPLAYED_HEADER), Some(1));
        let second = replay_properties(&first);
        assert_eq!(codec::count_header(&second, REPLAYED_HEADER), Some(2));
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
