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
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::broker::{self, Publisher, Routing};
use super::codec;
use super::config::{AmqpConfig, AmqpError, QueueType};
use crate::consumer::{Received, Retried, Settler};
use crate::delivery::{
    ATTEMPTS_HEADER, ConsumerStats, DEAD_DETAIL_HEADER, DEAD_REASON_HEADER, DeliveryHandler,
};
use crate::envelope::{ConsumerType, Envelope, MessageId};
use crate::metrics::DeadReason;
use crate::wire::Malformed;

pub use crate::consumer::ConsumerHandle;

/// The header in which a quorum queue counts a message's earlier deliveries.
pub(crate) const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// How long deliveries in flight get to end after their connection was lost.
const IN_FLIGHT_GRACE: Duration = Duration::from_secs(5);

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
        let queue = declare_source(&channel, &config, &options).await?;
        let _ = channel.close(200, "declared".into()).await;
        // A private queue lives only as long as its connection: nothing to check.
        if let (None, Some(inbox)) = (&options.private_queue, &config.retention_check)
            && let Err(error) = super::management::check_retention(&config, &queue, inbox).await
        {
            let _ = first.close(200, "refused".into()).await;
            return Err(error);
        }
        let (stop, stopped) = watch::channel(false);
        let stats = Arc::new(ConsumerStats::default());
        let queue = options
            .private_queue
            .clone()
            .unwrap_or_else(|| config.queue(&options.consumer_type));
        let settler = Settler::new(
            options.consumer_type.clone(),
            options.kinds.clone(),
            handler,
            Arc::clone(&stats),
        );
        let session = Session {
            readiness: crate::health::global().consumer(format!("{queue} (RabbitMQ)")),
            config: Arc::new(config),
            options,
            settler: Arc::new(settler),
        };
        let task = tokio::spawn(session.run_forever(first, stopped));
        Ok(ConsumerHandle::new(stop, task, stats))
    }
}

struct Session<H> {
    /// Consuming while a subscription is open on a live connection.
    readiness: crate::health::ConsumerReadiness,
    config: Arc<AmqpConfig>,
    options: ConsumerOptions,
    settler: Arc<Settler<H>>,
}

impl<H: DeliveryHandler> Session<H> {
    async fn run_forever(self, first: lapin::Connection, mut stopped: watch::Receiver<bool>) {
        let mut connection = Some(first);
        let mut failures = 0u32;
        loop {
            let connected = match connection.take() {
                Some(connection) => Ok(connection),
                None => broker::connect(&self.config, &connection_role(&self.options)).await,
            };
            let result = match connected {
                Ok(connection) => self.consume(connection, &mut stopped).await,
                Err(error) => Err(error),
            };
            match result {
                Ok(()) => return,
                Err(error) => {
                    let wait = self.config.backoff(failures);
                    failures = failures.saturating_add(1);
                    tracing::warn!(
                        consumer_type = %self.options.consumer_type,
                        %error,
                        retry_in = ?wait,
                        "RabbitMQ consumer lost its connection; reconnecting"
                    );
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stopped.changed() => return,
                    }
                }
            }
            if *stopped.borrow() {
                return;
            }
        }
    }

    /// One connection's worth of consuming. `Ok` when stopped on request.
    async fn consume(
        &self,
        connection: lapin::Connection,
        stopped: &mut watch::Receiver<bool>,
    ) -> Result<(), AmqpError> {
        self.settler.stats().sessions.fetch_add(1, Relaxed);
        let publisher = Publisher::open(&connection).await?;
        let queue = declare_source(publisher.channel(), &self.config, &self.options).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(AmqpError::broker("open a channel"))?;
        channel
            .basic_qos(self.config.prefetch, BasicQosOptions::default())
            .await
            .map_err(AmqpError::broker("set the prefetch"))?;
        let tag = format!("{}-{}", self.options.consumer_type, uuid::Uuid::new_v4());
        let mut deliveries = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::broker("start consuming"))?;
        tracing::info!(%queue, prefetch = self.config.prefetch, "consuming");
        self.readiness.set_consuming(true);
        // What every delivery's settling needs, shared: one reference count per delivery.
        let link = Arc::new(Link {
            // A private queue is classic (exclusive): its retries republish.
            quorum: self.config.queue_type == QueueType::Quorum
                && self.options.private_queue.is_none(),
            dead_queue: self.config.dead_queue(&self.options.consumer_type),
            config: Arc::clone(&self.config),
            publisher,
            queue: queue.clone(),
        });
        let mut in_flight = JoinSet::new();
        // A subscription whose connection died without its stream ending would sit
        // idle forever: the connection's state is checked every second too.
        let mut health = tokio::time::interval(Duration::from_secs(1));
        let ended = loop {
            tokio::select! {
                _ = health.tick() => {
                    if !connection.status().connected() || !channel.status().connected() {
                        break Err(AmqpError::Config(format!(
                            "the connection or channel consuming {queue} is no longer open"
                        )));
                    }
                }
                changed = stopped.changed() => {
                    if changed.is_err() || *stopped.borrow() {
                        let _ = channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await;
                        break Ok(());
                    }
                }
                next = deliveries.next() => match next {
                    Some(Ok(delivery)) => {
                        let settler = Arc::clone(&self.settler);
                        let delivered = Delivered { delivery, link: Arc::clone(&link) };
                        in_flight.spawn(async move { settler.settle(delivered).await });
                    }
                    Some(Err(source)) => break Err(AmqpError::Broker { operation: "consume", source }),
                    None => break Err(AmqpError::Config(format!(
                        "the broker cancelled the subscription to {queue} (queue deleted?)"
                    ))),
                },
                Some(_) = in_flight.join_next(), if !in_flight.is_empty() => {}
            }
        };
        self.readiness.set_consuming(false);
        if ended.is_ok() {
            // Stopping: the deliveries in flight finish and are acked.
            while in_flight.join_next().await.is_some() {}
        } else {
            // The connection is gone: the deliveries in flight cannot be acked on it (the
            // broker redelivers them, the inbox absorbs those applied). Give their work a
            // moment to end, then abandon it rather than wait on a dead connection before
            // reconnecting.
            let drained = tokio::time::timeout(IN_FLIGHT_GRACE, async {
                while in_flight.join_next().await.is_some() {}
            })
            .await;
            if drained.is_err() {
                tracing::warn!(%queue, left = in_flight.len(), "abandoning deliveries still in flight on a lost connection");
                in_flight.shutdown().await;
            }
        }
        if ended.is_ok() {
            let _ = connection.close(200, "stopping".into()).await;
        }
        ended
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
    channel: &lapin::Channel,
    config: &AmqpConfig,
    options: &ConsumerOptions,
) -> Result<String, AmqpError> {
    match &options.private_queue {
        None => broker::declare(channel, config, &options.consumer_type).await,
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
        self.delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await
            .map_err(AmqpError::broker("nack"))?;
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
}

/// The wait before a retried delivery is requeued: 50 ms doubled per attempt, up to 3.2 s.
fn backoff(attempt: u32) -> Duration {
    crate::backoff::doubling(
        Duration::from_millis(50),
        attempt,
        Duration::from_millis(3200),
    )
}
