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
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use futures_lite::StreamExt;
use futures_util::FutureExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tracing::Instrument;

use super::broker::{self, Publisher, Routing};
use super::codec;
use super::config::{AmqpConfig, AmqpError, QueueType};
use crate::delivery::{
    ATTEMPTS_HEADER, ConsumerStats, DEAD_DETAIL_HEADER, DEAD_REASON_HEADER, DeliveryHandler,
    Disposition,
};
use crate::envelope::{ConsumerType, Envelope};
use crate::metrics::DeadReason;
use crate::supervisor::panic_message;
use crate::trace;

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

/// A running consumer.
#[derive(Debug)]
pub struct ConsumerHandle {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    stats: Arc<ConsumerStats>,
}

impl ConsumerHandle {
    /// What it has done so far.
    pub fn stats(&self) -> &Arc<ConsumerStats> {
        &self.stats
    }

    /// Whether the consumer has ended without being stopped: it reconnects after every
    /// broker failure, so only a bug (a panic outside the handler) ends it early.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops consuming, lets the deliveries in flight finish and settle, and closes the
    /// connection.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    /// Drops the consumer at once, without settling what is in flight: what a crash
    /// does. Unacknowledged deliveries return to the queue.
    pub fn abort(self) {
        self.task.abort();
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
        let session = Session {
            readiness: crate::health::global().consumer(format!("{queue} (RabbitMQ)")),
            config: Arc::new(config),
            options: Arc::new(options),
            handler: Arc::new(handler),
            stats: Arc::clone(&stats),
        };
        let task = tokio::spawn(session.run_forever(first, stopped));
        Ok(ConsumerHandle { stop, task, stats })
    }
}

struct Session<H> {
    /// Consuming while a subscription is open on a live connection.
    readiness: crate::health::ConsumerReadiness,
    config: Arc<AmqpConfig>,
    options: Arc<ConsumerOptions>,
    handler: Arc<H>,
    stats: Arc<ConsumerStats>,
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
        self.stats.sessions.fetch_add(1, Relaxed);
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
        // What every delivery's task needs, shared: one reference count per delivery.
        let work = Arc::new(Work {
            config: Arc::clone(&self.config),
            options: Arc::clone(&self.options),
            handler: Arc::clone(&self.handler),
            stats: Arc::clone(&self.stats),
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
                        in_flight.spawn(Arc::clone(&work).settle(delivery));
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

/// Settling deliveries: what each delivery's task shares with the others of its session.
struct Work<H> {
    config: Arc<AmqpConfig>,
    options: Arc<ConsumerOptions>,
    handler: Arc<H>,
    stats: Arc<ConsumerStats>,
    publisher: Publisher,
    queue: String,
}

impl<H: DeliveryHandler> Work<H> {
    async fn settle(self: Arc<Self>, delivery: Delivery) {
        let settled = match codec::decode(&delivery.properties, &delivery.data, &self.options.kinds)
        {
            Err(malformed) => {
                self.dead_letter(&delivery, malformed.reason(), &malformed.to_string())
                    .await
            }
            Ok(envelope) => {
                // The sender's span (its context in the envelope) is this one's parent;
                // the handler, its reply and what it publishes run inside it.
                let span = tracing::debug_span!(
                    "amqp.consume",
                    queue = %self.queue,
                    message_id = %envelope.id,
                    kind = %envelope.kind,
                    saga_id = envelope.saga_id.as_deref(),
                );
                trace::continue_from(&span, &envelope.headers);
                self.handle(&delivery, envelope).instrument(span).await
            }
        };
        if let Err(error) = settled {
            // Not acked: the broker redelivers it, and the inbox absorbs a repeat.
            tracing::warn!(queue = %self.queue, %error, "delivery not settled; it will be redelivered");
        }
    }

    /// Runs the handler on a decoded delivery and settles it as the handler says.
    async fn handle(&self, delivery: &Delivery, envelope: Envelope) -> Result<(), AmqpError> {
        let id = envelope.id.clone();
        // A handler that panics must still settle its delivery: left unacked, it
        // would hold one of the prefetch's slots until the connection closed. Boxed: a
        // handler's future (a guarded transaction's) runs to kilobytes, and this keeps
        // it from being copied with every future that wraps it.
        let disposition = AssertUnwindSafe(Box::pin(self.handler.handle(envelope)))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                Disposition::Retry(format!(
                    "the handler panicked: {}",
                    panic_message(panic.as_ref())
                ))
            });
        match disposition {
            Disposition::Done { reply } => self.done(delivery, &id, reply).await,
            Disposition::Retry(reason) => self.retry(delivery, &reason).await,
            Disposition::Reject(reason) => {
                self.dead_letter(delivery, DeadReason::Rejected, &reason)
                    .await
            }
        }
    }

    async fn done(
        &self,
        delivery: &Delivery,
        id: &crate::envelope::MessageId,
        reply: Option<Envelope>,
    ) -> Result<(), AmqpError> {
        if let (Some(reply), Some(reply_to)) = (reply, delivery.properties.reply_to()) {
            self.publisher
                .publish(
                    reply_to.as_str(),
                    &reply,
                    None,
                    Some(id.as_str()),
                    Routing::BestEffort,
                )
                .await?;
        }
        self.ack(delivery).await?;
        self.stats.acked.fetch_add(1, Relaxed);
        Ok(())
    }

    async fn retry(&self, delivery: &Delivery, reason: &str) -> Result<(), AmqpError> {
        if self.config.queue_type == QueueType::Quorum && self.options.private_queue.is_none() {
            return self.nack(delivery, reason).await;
        }
        let attempts = codec::count_header(&delivery.properties, ATTEMPTS_HEADER)
            .unwrap_or(0)
            .saturating_add(1);
        if attempts >= self.config.max_redeliveries {
            let detail = format!("failed {attempts} times, last: {reason}");
            return self
                .dead_letter(delivery, DeadReason::RetriesExhausted, &detail)
                .await;
        }
        tokio::time::sleep(backoff(attempts)).await;
        let properties = codec::with_headers(
            delivery.properties.clone(),
            [(ATTEMPTS_HEADER, AMQPValue::LongLongInt(i64::from(attempts)))],
        );
        self.publisher
            .publish_raw(&self.queue, &delivery.data, properties, Routing::Required)
            .await?;
        self.ack(delivery).await?;
        self.stats.requeued.fetch_add(1, Relaxed);
        Ok(())
    }

    /// A quorum queue's retry: back to the queue with `basic.nack`, which counts the
    /// delivery; the broker dead-letters the message past its delivery limit.
    async fn nack(&self, delivery: &Delivery, reason: &str) -> Result<(), AmqpError> {
        // x-delivery-count is 0 (or absent) on a first delivery, 1 on the second, ...
        let attempts = codec::count_header(&delivery.properties, DELIVERY_COUNT_HEADER)
            .unwrap_or(0)
            .saturating_add(1);
        let last = attempts >= self.config.max_redeliveries;
        if last {
            tracing::warn!(
                queue = %self.queue,
                attempts,
                reason,
                "last retry failed; the broker dead-letters the message at its delivery limit"
            );
        }
        // The requeued message comes back at once: wait first, as the classic path does.
        tokio::time::sleep(backoff(attempts)).await;
        delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await
            .map_err(AmqpError::broker("nack"))?;
        self.stats.requeued.fetch_add(1, Relaxed);
        if last {
            // The broker dead-letters it without telling anyone: this nack is the only
            // place that knows, so the dead-letter counter counts it here.
            crate::metrics::dead_lettered(
                self.options.consumer_type.as_str(),
                DeadReason::RetriesExhausted,
            );
        }
        Ok(())
    }

    async fn dead_letter(
        &self,
        delivery: &Delivery,
        reason: DeadReason,
        detail: &str,
    ) -> Result<(), AmqpError> {
        tracing::warn!(queue = %self.queue, reason = reason.as_str(), detail, "dead-lettering a message");
        let properties = codec::with_headers(
            delivery.properties.clone(),
            [
                (
                    DEAD_REASON_HEADER,
                    AMQPValue::LongString(reason.as_str().into()),
                ),
                (DEAD_DETAIL_HEADER, AMQPValue::LongString(detail.into())),
            ],
        );
        let dead = self.config.dead_queue(&self.options.consumer_type);
        self.publisher
            .publish_raw(&dead, &delivery.data, properties, Routing::Required)
            .await?;
        self.ack(delivery).await?;
        self.stats.dead_lettered.fetch_add(1, Relaxed);
        crate::metrics::dead_lettered(self.options.consumer_type.as_str(), reason);
        Ok(())
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), AmqpError> {
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(AmqpError::broker("ack"))?;
        Ok(())
    }
}

fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(50u64.saturating_mul(1 << attempt.min(6)))
}
