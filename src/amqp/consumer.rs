//! [`Consumer`]: consumes one queue, hands each decoded [`Envelope`] to a
//! [`DeliveryHandler`], and settles the delivery by what the handler says — acknowledged
//! only after the handler returned (for a guarded step: after the guard's transaction
//! committed, or after it found a duplicate).
//!
//! - Bad input (no `message_id`, an invalid id, a body that is not the envelope, an
//!   unknown kind) is dead-lettered at once into `<prefix>.<consumer_type>.dead` with
//!   the headers `x-sagabox-dead-reason` (a stable code) and `x-sagabox-dead-detail`
//!   (what was wrong); the consumer goes on with the next message.
//! - A retryable failure is requeued, after a short backoff. On a quorum queue
//!   ([`QueueType::Quorum`]) it is a `basic.nack` with requeue: the broker counts the
//!   deliveries (`x-delivery-count`) and dead-letters the message itself at the queue's
//!   `x-delivery-limit` (`sagabox dlq list` shows it as `retries_exhausted`; the
//!   consumer counts it in `sagabox_dead_letters_total` as it nacks the last time). Classic
//!   queues count nothing, so there the message is published again to the back of its
//!   queue with `x-sagabox-attempts` incremented and the original acked; after
//!   [`AmqpConfig::max_redeliveries`] attempts it is dead-lettered (`retries_exhausted`).
//! - Before the first message, the retention of a durable queue is checked against the
//!   inbox TTL ([`AmqpConfig::retention_check`], [`check_retention`](super::check_retention)):
//!   a queue that may redeliver after the inbox forgot is refused.
//! - A lost connection ends the session: deliveries not yet acked come back from the
//!   broker (the inbox absorbs those already applied), and the consumer reconnects with
//!   backoff.
//! - [`ConsumerHandle::stop`] cancels the subscription, lets the deliveries in flight
//!   finish and settle, then closes the connection.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::{AMQPValue, FieldTable};

use super::broker::{self, Publisher, Routing};
use super::codec;
use super::config::{AmqpConfig, AmqpError, QueueType};
use crate::consumer::{Health, Next, Received, Retried, Source, Subscription};
use crate::dead_reason::DeadReason;
use crate::dead_reason::{DEAD_DETAIL_HEADER, DEAD_REASON_HEADER};
use crate::delivery::{ATTEMPTS_HEADER, DeliveryHandler};
use crate::envelope::{ConsumerType, Envelope, MessageId};
use crate::wire::Malformed;

use crate::consumer::ConsumerHandle;

/// The header in which a quorum queue counts a message's earlier deliveries.
pub(crate) const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// Which queue a consumer reads, and how it is declared.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// The consumer type: names the queue and the dead-letter queue.
    pub consumer_type: ConsumerType,
    /// The message kinds it takes; any other is dead-lettered (`unknown_kind`). Empty
    /// takes every kind.
    pub kinds: BTreeSet<String>,
    /// Consume from this queue instead of `<prefix>.<consumer_type>`: a private,
    /// exclusive queue deleted with the connection (an orchestrator's reply queue).
    pub private_queue: Option<String>,
}

impl ConsumerOptions {
    /// The durable queue of `consumer_type`, taking `kinds`.
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(
        consumer_type: ConsumerType,
        kinds: I,
    ) -> Self {
        Self {
            consumer_type,
            kinds: kinds.into_iter().map(Into::into).collect(),
            private_queue: None,
        }
    }
}

/// Consumes one queue with a [`DeliveryHandler`].
#[derive(Debug)]
pub struct Consumer;

impl Consumer {
    /// Checks `config`, connects once (so a wrong URL fails here, not in the
    /// background), declares the queues, checks a durable queue's retention against
    /// [`AmqpConfig::retention_check`] (an error, before any message is taken, when the
    /// inbox TTL does not cover it), and starts consuming.
    pub async fn spawn<H: DeliveryHandler>(
        config: AmqpConfig,
        options: ConsumerOptions,
        handler: H,
    ) -> Result<ConsumerHandle, AmqpError> {
        config.validate()?;
        let first = broker::connect(&config, &connection_role(&options)).await?;
        // Declared before returning, so a message published after `spawn` has a queue
        // (a private queue belongs to this first connection, which the session uses).
        let channel = first
            .create_channel()
            .await
            .map_err(AmqpError::broker("open a channel"))?;
        let queue = declare_source(&first, &channel, &config, &options).await?;
        let _ = channel.close(200, "declared".into()).await;
        // A private queue lives only as long as its connection: nothing to check.
        if let (None, Some(inbox)) = (&options.private_queue, &config.retention_check)
            && let Err(error) = super::management::check_retention(&config, &queue, inbox).await
        {
            let _ = first.close(200, "refused".into()).await;
            return Err(error);
        }
        let (consumer_type, kinds) = (options.consumer_type.clone(), options.kinds.clone());
        let source = QueueSource {
            config: Arc::new(config),
            options,
            first: Some(first),
        };
        Ok(crate::consumer::spawn(
            source,
            &queue,
            consumer_type,
            kinds,
            handler,
        ))
    }
}

/// A consumer's queue, and the connection it is read on.
struct QueueSource {
    config: Arc<AmqpConfig>,
    options: ConsumerOptions,
    /// The connection `spawn` opened, which the first subscription uses (a private queue
    /// belongs to it); every later subscription opens its own.
    first: Option<lapin::Connection>,
}

impl Source for QueueSource {
    type Message = Delivered;
    type Subscription = QueueSubscription;
    type Error = AmqpError;

    // The deliveries of a lost connection cannot be acknowledged on another one.
    const SETTLES_AFTER_LOSS: bool = false;

    fn broker(&self) -> &'static str {
        "RabbitMQ"
    }

    async fn open(&mut self) -> Result<QueueSubscription, AmqpError> {
        let connection = match self.first.take() {
            Some(connection) => connection,
            None => broker::connect(&self.config, &connection_role(&self.options)).await?,
        };
        let publisher = Publisher::open(&connection).await?;
        let queue = declare_source(
            &connection,
            publisher.channel(),
            &self.config,
            &self.options,
        )
        .await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(AmqpError::broker("open a channel"))?;
        channel
            .basic_qos(self.config.prefetch, BasicQosOptions::default())
            .await
            .map_err(AmqpError::broker("set the prefetch"))?;
        let tag = format!("{}-{}", self.options.consumer_type, uuid::Uuid::new_v4());
        let deliveries = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::broker("start consuming"))?;
        tracing::info!(%queue, prefetch = self.config.prefetch, "consuming");
        let link = Arc::new(Link {
            // A private queue is classic (exclusive): its retries republish.
            quorum: self.config.queue_type == QueueType::Quorum
                && self.options.private_queue.is_none(),
            dead_queue: self.config.dead_queue(&self.options.consumer_type),
            config: Arc::clone(&self.config),
            publisher,
            queue: queue.clone(),
        });
        Ok(QueueSubscription {
            connection,
            channel,
            tag,
            queue,
            deliveries,
            link,
        })
    }

    fn backoff(&self, failures: u32) -> Duration {
        self.config.backoff(failures)
    }
}

/// A `basic.consume` on its own connection.
struct QueueSubscription {
    connection: lapin::Connection,
    channel: lapin::Channel,
    tag: String,
    queue: String,
    deliveries: lapin::Consumer,
    /// What settling its deliveries needs, shared by them.
    link: Arc<Link>,
}

impl Subscription for QueueSubscription {
    type Message = Delivered;

    async fn next(&mut self) -> Next<Delivered> {
        match self.deliveries.next().await {
            Some(Ok(delivery)) => Next::Message(Delivered {
                delivery,
                link: Arc::clone(&self.link),
            }),
            Some(Err(source)) => Next::Ended(
                AmqpError::Broker {
                    operation: "consume",
                    source,
                }
                .to_string(),
            ),
            None => Next::Ended(format!(
                "the broker cancelled the subscription to {} (queue deleted?)",
                self.queue
            )),
        }
    }

    fn health(&self) -> Health {
        if self.connection.status().connected() && self.channel.status().connected() {
            Health::Consuming
        } else {
            Health::Lost(format!(
                "the connection or channel consuming {} is no longer open",
                self.queue
            ))
        }
    }

    async fn cancel(&mut self) {
        let _ = self
            .channel
            .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default())
            .await;
    }

    async fn close(self) {
        let _ = self.connection.close(200, "stopping".into()).await;
    }
}

/// How a consumer's connection is named: `consumer <queue>`.
fn connection_role(options: &ConsumerOptions) -> String {
    match &options.private_queue {
        Some(queue) => format!("consumer {queue}"),
        None => format!("consumer {}", options.consumer_type),
    }
}

/// Declares the queue a consumer reads; returns its name.
async fn declare_source(
    connection: &lapin::Connection,
    channel: &lapin::Channel,
    config: &AmqpConfig,
    options: &ConsumerOptions,
) -> Result<String, AmqpError> {
    match &options.private_queue {
        None => broker::declare(connection, config, &options.consumer_type).await,
        Some(queue) => {
            channel
                .queue_declare(
                    queue.as_str().into(),
                    lapin::options::QueueDeclareOptions {
                        exclusive: true,
                        auto_delete: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(AmqpError::broker("declare the private queue"))?;
            Ok(queue.clone())
        }
    }
}

/// What settling a delivery needs of its session, shared by its deliveries.
struct Link {
    config: Arc<AmqpConfig>,
    publisher: Publisher,
    /// The queue consumed.
    queue: String,
    /// Where its dead letters go.
    dead_queue: String,
    /// A retry is a `basic.nack` the broker counts (a durable quorum queue).
    quorum: bool,
}

/// One delivery of a session.
struct Delivered {
    delivery: Delivery,
    link: Arc<Link>,
}

impl Delivered {
    async fn ack(&self) -> Result<(), AmqpError> {
        self.delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(AmqpError::broker("ack"))?;
        Ok(())
    }

    /// `basic.nack` with requeue: back to the queue now (a quorum queue counts it).
    async fn requeue(&self) -> Result<(), AmqpError> {
        self.delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await
            .map(drop)
            .map_err(AmqpError::broker("nack"))
    }

    /// A quorum queue's retry: back to the queue with `basic.nack`, which counts the
    /// delivery; the broker dead-letters the message past its delivery limit.
    async fn nack(&self, reason: &str) -> Result<Retried, AmqpError> {
        // x-delivery-count is 0 (or absent) on a first delivery, 1 on the second, ...
        let attempts = codec::count_header(&self.delivery.properties, DELIVERY_COUNT_HEADER)
            .unwrap_or(0)
            .saturating_add(1);
        let last = attempts >= self.link.config.max_redeliveries;
        if last {
            tracing::warn!(
                queue = %self.link.queue,
                attempts,
                reason,
                "last retry failed; the broker dead-letters the message at its delivery limit"
            );
        }
        // The requeued message comes back at once: wait first, as the classic path does.
        tokio::time::sleep(backoff(attempts)).await;
        self.requeue().await?;
        Ok(if last {
            Retried::RequeuedLast
        } else {
            Retried::Requeued
        })
    }
}

impl Received for Delivered {
    type Error = AmqpError;

    fn source(&self) -> &str {
        &self.link.queue
    }

    fn decode(&self, kinds: &BTreeSet<String>) -> Result<Envelope, Malformed> {
        codec::decode(&self.delivery.properties, &self.delivery.data, kinds)
    }

    fn span(&self, envelope: &Envelope) -> tracing::Span {
        tracing::debug_span!(
            "amqp.consume",
            queue = %self.link.queue,
            message_id = %envelope.id,
            kind = %envelope.kind,
            saga_id = envelope.saga_id.as_deref(),
        )
    }

    async fn reply_and_ack(
        &self,
        reply: Option<Envelope>,
        command: &MessageId,
    ) -> Result<(), AmqpError> {
        if let (Some(reply), Some(reply_to)) = (reply, self.delivery.properties.reply_to()) {
            self.link
                .publisher
                .publish(
                    reply_to.as_str(),
                    &reply,
                    None,
                    Some(command.as_str()),
                    Routing::BestEffort,
                )
                .await?;
        }
        self.ack().await
    }

    /// On a quorum queue, a nack the broker counts; on a classic queue, which counts
    /// nothing, the message published again to the back of its queue with
    /// `x-sagabox-attempts` incremented and the original acked.
    async fn retry(&self, reason: &str) -> Result<Retried, AmqpError> {
        if self.link.quorum {
            return self.nack(reason).await;
        }
        let attempts = codec::count_header(&self.delivery.properties, ATTEMPTS_HEADER)
            .unwrap_or(0)
            .saturating_add(1);
        if attempts >= self.link.config.max_redeliveries {
            return Ok(Retried::Exhausted(format!(
                "failed {attempts} times, last: {reason}"
            )));
        }
        tokio::time::sleep(backoff(attempts)).await;
        let properties = codec::with_headers(
            self.delivery.properties.clone(),
            [(ATTEMPTS_HEADER, AMQPValue::LongLongInt(i64::from(attempts)))],
        );
        self.link
            .publisher
            .publish_raw(
                &self.link.queue,
                &self.delivery.data,
                properties,
                Routing::Required,
            )
            .await?;
        self.ack().await?;
        Ok(Retried::Requeued)
    }

    async fn dead_letter(&self, reason: DeadReason, detail: &str) -> Result<(), AmqpError> {
        let properties = codec::with_headers(
            self.delivery.properties.clone(),
            [
                (
                    DEAD_REASON_HEADER,
                    AMQPValue::LongString(reason.as_str().into()),
                ),
                (DEAD_DETAIL_HEADER, AMQPValue::LongString(detail.into())),
            ],
        );
        self.link
            .publisher
            .publish_raw(
                &self.link.dead_queue,
                &self.delivery.data,
                properties,
                Routing::Required,
            )
            .await?;
        self.ack().await
    }

    async fn give_back(&self) -> Result<(), AmqpError> {
        self.requeue().await
    }
}

/// The wait before a retried delivery is requeued: 50 ms doubled per attempt, up to 3.2 s.
fn backoff(attempt: u32) -> Duration {
    crate::backoff::doubling(
        Duration::from_millis(50),
        attempt,
        Duration::from_millis(3200),
    )
}
