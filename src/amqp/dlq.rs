//! [`DeadLetterQueue`]: the dead letters of a RabbitMQ queue, `<queue>.dead`, behind
//! [`DeadLetters`](crate::dlq::DeadLetters).
//!
//! Both calls read with `basic.get` every message the queue held when the call started,
//! hold them unacked on one channel until the call ends, then give back what they did not
//! replay (nacked with requeue), however few the call showed or replayed: a classic queue
//! puts each back where it was, a quorum queue behind what it still holds, so giving back
//! all of them keeps their order on both. A call returns once the queue counts the
//! letters it gave back (a quorum queue applies them a moment after), so the next call
//! reads them all. A call considers only the messages in the queue when it starts, so a
//! replayed message that the consumer dead-letters again is not replayed a second time by
//! the same call. Two calls at once each see only the messages the other does not hold.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use lapin::message::{BasicGetMessage, Delivery};
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};

use super::broker::{self, Publisher, Routing};
use super::codec;
use super::config::{AmqpConfig, AmqpError};
use crate::dead_reason::DeadReason;
use crate::dead_reason::{DEAD_DETAIL_HEADER, DEAD_REASON_HEADER};
use crate::delivery::ATTEMPTS_HEADER;
use crate::dlq::{
    DeadLetter, DeadLetterList, DlqError, REPLAYED_HEADER, ReplayOptions, ReplayReport, queue_names,
};
use crate::logging::redact;

/// How long a call waits for the letters it gave back to count in the queue again.
const SETTLE_WAIT: Duration = Duration::from_secs(5);

/// How often the count is read while waiting for it to settle.
const SETTLE_POLL: Duration = Duration::from_millis(10);

impl DeadLetter {
    /// What `delivery` says about itself, its age measured at `now`.
    fn read(delivery: &Delivery, now: DateTime<Utc>) -> Self {
        let properties = &delivery.properties;
        let published_at = properties
            .timestamp()
            .and_then(|seconds| i64::try_from(seconds).ok())
            .and_then(|seconds| Utc.timestamp_opt(seconds, 0).single());
        Self {
            message_id: properties.message_id().as_ref().map(ToString::to_string),
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
            ..Self::from_body(&delivery.data)
        }
    }
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

    /// Shows up to `limit` dead letters (all of them with `None`), oldest first, and
    /// gives every one back: the queue holds the same messages, in the same order,
    /// afterwards. Every letter is read, whatever the limit (see the module's note).
    pub async fn list(&self, limit: Option<usize>) -> Result<DeadLetterList, DlqError> {
        let total = self.ready(&self.dead).await?;
        let channel = self.channel().await?;
        let now = Utc::now();
        let mut held = Vec::new();
        let read = async {
            // Every letter is held, however few are shown: see the module's note on order.
            let total = usize::try_from(total).unwrap_or(usize::MAX);
            while held.len() < total {
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
            .take(limit.unwrap_or(usize::MAX))
            .map(|message| DeadLetter::read(&message.delivery, now))
            .collect();
        let given_back = give_back(&channel, &held).await;
        read?;
        given_back?;
        self.settled(&self.dead, total).await?;
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
                let Some(message) = self.get(&channel).await? else {
                    break;
                };
                let letter = DeadLetter::read(&message.delivery, now);
                // Past the limit the rest is still held, to be given back in order.
                let full = options.limit.is_some_and(|limit| replayed.len() >= limit);
                if full || !options.matches(&letter) {
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
        run.map_err(|source| {
            DlqError::from(source).after_replaying(&self.dead, &self.source, replayed.len())
        })?;
        given_back?;
        let replayed_count = u32::try_from(replayed.len()).unwrap_or(u32::MAX);
        let left = self
            .settled(&self.dead, total.saturating_sub(replayed_count))
            .await?;
        Ok(ReplayReport {
            queue: self.dead.clone(),
            source_queue: self.source.clone(),
            reason: options.reason.map(|reason| reason.as_str().to_owned()),
            replayed: replayed.len(),
            left,
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

    /// Messages ready in `queue` once it counts at least `expected` again, or after
    /// [`SETTLE_WAIT`], whichever comes first. A quorum queue applies the give-backs of a
    /// closed channel through its log, after the channel is gone, so a count taken at
    /// once can miss them; the next call would then read fewer letters than there are.
    async fn settled(&self, queue: &str, expected: u32) -> Result<u32, DlqError> {
        let deadline = tokio::time::Instant::now() + SETTLE_WAIT;
        loop {
            let ready = self.ready(queue).await?;
            if ready >= expected || tokio::time::Instant::now() >= deadline {
                return Ok(ready);
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
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
                broker: "RabbitMQ",
                what: "queue",
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
