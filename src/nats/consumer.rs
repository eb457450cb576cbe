//! [`Consumer`]: consumes one consumer type's work stream through its durable pull
//! consumer, hands each decoded [`Envelope`] to a [`DeliveryHandler`], and settles the
//! message by what the handler says — acknowledged only after the handler returned (for
//! a guarded step: after the guard's transaction committed, or after it found a
//! duplicate).
//!
//! - Bad input (no message id, an invalid id, a body that is not the envelope, an unknown
//!   kind) is dead-lettered at once into `<prefix>.<consumer_type>.dead` with the headers
//!   `x-sagabox-dead-reason` (the same codes as on RabbitMQ) and `x-sagabox-dead-detail`,
//!   then acked; the consumer goes on with the next message.
//! - A retryable failure is negatively acknowledged with a backoff, and JetStream
//!   redelivers it counting the deliveries; at [`NatsConfig::max_deliver`] it is
//!   dead-lettered (`retries_exhausted`). A message that arrives past that count (its
//!   earlier deliveries were never acked: the consumer died, or outran `ack_wait`, each
//!   time) is dead-lettered without running.
//! - A message not acked (the process died between commit and ack) comes back after
//!   `ack_wait`; the inbox absorbs it. The client reconnects by itself after a lost
//!   connection, and the pull subscription resumes.
//! - When started with the inbox's configuration ([`ConsumerOptions::inbox`]), the work
//!   stream's real `max_age` is checked against the inbox TTL first
//!   ([`retention::check`]), and a stream that keeps messages longer, or without limit,
//!   refuses the start.
//! - [`ConsumerHandle::stop`] stops pulling, lets the messages in flight finish and
//!   settle, then drains the connection.

use std::collections::BTreeSet;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Context, Message};
use futures_util::{FutureExt, StreamExt};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tracing::Instrument;

use super::codec::{self, CORRELATION_ID_HEADER, REPLY_TO_HEADER};
use super::config::{NatsConfig, NatsError};
use super::jetstream::{self, RETENTION_SETTING};
use crate::delivery::{
    ConsumerStats, DEAD_DETAIL_HEADER, DEAD_REASON_HEADER, DeliveryHandler, Disposition,
};
use crate::envelope::{ConsumerType, Envelope, MessageId};
use crate::inbox::InboxConfig;
use crate::metrics::DeadReason;
use crate::retention;
use crate::supervisor::panic_message;
use crate::trace;

/// How long a pull request waits on the server; the client sends a new one after.
const PULL_EXPIRY: Duration = Duration::from_secs(5);

/// Which stream a consumer reads, and what it checks first.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// The consumer type: names the subject, the streams and the durable consumer.
    pub consumer_type: ConsumerType,
    /// The message kinds it takes; any other is dead-lettered (`unknown_kind`). Empty
    /// takes every kind.
    pub kinds: BTreeSet<String>,
    /// The configuration of the inbox the messages pass: when given, the stream's
    /// retention is checked against its TTL before consuming.
    pub inbox: Option<InboxConfig>,
}

impl ConsumerOptions {
    /// The work stream of `consumer_type`, taking `kinds`.
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(
        consumer_type: ConsumerType,
        kinds: I,
    ) -> Self {
        Self {
            consumer_type,
            kinds: kinds.into_iter().map(Into::into).collect(),
            inbox: None,
        }
    }

    /// Checks the stream's retention against `inbox`'s TTL before consuming.
    pub fn checked_against(mut self, inbox: InboxConfig) -> Self {
        self.inbox = Some(inbox);
        self
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
    /// What it has done so far (`sessions` counts pull subscriptions started).
    pub fn stats(&self) -> &Arc<ConsumerStats> {
        &self.stats
    }

    /// Whether the consumer has ended without being stopped: only a bug (a panic
    /// outside the handler) ends it early.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops pulling, lets the messages in flight finish and settle, and drains the
    /// connection.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    /// Drops the consumer at once, without settling what is in flight: what a crash
    /// does. Unacknowledged messages come back after `ack_wait`.
    pub fn abort(self) {
        self.task.abort();
    }
}

/// Consumes one consumer type's work stream with a [`DeliveryHandler`].
#[derive(Debug)]
pub struct Consumer;

impl Consumer {
    /// Checks `config`, connects (so a wrong URL fails here, not in the background),
    /// creates the streams and the durable consumer, checks the stream's retention when
    /// `options.inbox` is set, and starts consuming.
    pub async fn spawn<H: DeliveryHandler>(
        config: NatsConfig,
        options: ConsumerOptions,
        handler: H,
    ) -> Result<ConsumerHandle, NatsError> {
        config.validate()?;
        let client =
            jetstream::connect(&config, &format!("consumer {}", options.consumer_type)).await?;
        let context = jetstream::context(&client);
        let mut stream = jetstream::declare(&context, &config, &options.consumer_type).await?;
        if let Some(inbox) = &options.inbox {
            let measured = jetstream::measured_retention(&mut stream).await?;
            retention::check(
                &config.stream(&options.consumer_type),
                measured,
                inbox,
                RETENTION_SETTING,
            )?;
        }
        let consumer =
            jetstream::durable_consumer(&stream, &config, &options.consumer_type).await?;
        let readiness = crate::health::global().consumer(format!(
            "{} (NATS JetStream)",
            config.stream(&options.consumer_type)
        ));
        let (stop, stopped) = watch::channel(false);
        let stats = Arc::new(ConsumerStats::default());
        let session = Session {
            shared: Arc::new(Shared {
                config,
                options,
                handler,
                stats: Arc::clone(&stats),
                client,
                context,
            }),
            consumer,
            readiness,
        };
        let task = tokio::spawn(session.run(stopped));
        Ok(ConsumerHandle { stop, task, stats })
    }
}

/// What every message's settling needs.
struct Shared<H> {
    config: NatsConfig,
    options: ConsumerOptions,
    handler: H,
    stats: Arc<ConsumerStats>,
    client: Client,
    context: Context,
}

struct Session<H> {
    shared: Arc<Shared<H>>,
    consumer: PullConsumer,
    /// Consuming while the pull subscription is open and the client connected.
    readiness: crate::health::ConsumerReadiness,
}

impl<H: DeliveryHandler> Session<H> {
    async fn run(self, mut stopped: watch::Receiver<bool>) {
        let mut in_flight = JoinSet::new();
        let mut failures = 0u32;
        'subscribe: loop {
            self.shared.stats.sessions.fetch_add(1, Relaxed);
            let subscribed = self
                .consumer
                .stream()
                .max_messages_per_batch(usize::from(self.shared.config.prefetch))
                .expires(PULL_EXPIRY)
                .heartbeat(PULL_EXPIRY / 2)
                .messages()
                .await;
            let mut messages = match subscribed {
                Ok(messages) => messages,
                Err(error) => {
                    self.readiness.set_consuming(false);
                    failures = failures.saturating_add(1);
                    if self.pause(&error.to_string(), failures, &mut stopped).await {
                        break 'subscribe;
                    }
                    continue 'subscribe;
                }
            };
            // The subscription outlives a lost connection (the client reconnects by
            // itself), so readiness follows the client's state, looked at every second.
            let mut health = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = health.tick() => {
                        let connected = self.shared.client.connection_state()
                            == async_nats::connection::State::Connected;
                        self.readiness.set_consuming(connected);
                    }
                    changed = stopped.changed() => {
                        if changed.is_err() || *stopped.borrow() {
                            break 'subscribe;
                        }
                    }
                    next = messages.next() => match next {
                        Some(Ok(message)) => {
                            failures = 0;
                            in_flight.spawn(Arc::clone(&self.shared).settle(message));
                        }
                        // Missed heartbeats and the like while the server is away: the
                        // subscription carries on once the client has reconnected.
                        Some(Err(error)) => {
                            tracing::debug!(
                                consumer_type = %self.shared.options.consumer_type,
                                %error,
                                "JetStream pull interrupted"
                            );
                        }
                        None => {
                            self.readiness.set_consuming(false);
                            failures = failures.saturating_add(1);
                            if self.pause("the pull subscription ended", failures, &mut stopped).await {
                                break 'subscribe;
                            }
                            continue 'subscribe;
                        }
                    },
                    Some(_) = in_flight.join_next(), if !in_flight.is_empty() => {}
                }
            }
        }
        // Stopping: the messages in flight finish, are acked, and the client flushes.
        while in_flight.join_next().await.is_some() {}
        let _ = self.shared.client.flush().await;
    }

    /// Waits before subscribing again; `true` when stopped meanwhile.
    async fn pause(
        &self,
        reason: &str,
        failures: u32,
        stopped: &mut watch::Receiver<bool>,
    ) -> bool {
        let wait = Duration::from_millis(100u64.saturating_mul(1 << failures.min(6)));
        tracing::warn!(
            consumer_type = %self.shared.options.consumer_type,
            reason,
            retry_in = ?wait,
            "JetStream consumer lost its subscription; subscribing again"
        );
        tokio::select! {
            _ = tokio::time::sleep(wait) => *stopped.borrow(),
            _ = stopped.changed() => true,
        }
    }
}

impl<H: DeliveryHandler> Shared<H> {
    async fn settle(self: Arc<Self>, message: Message) {
        let delivered = message
            .info()
            .map(|info| u32::try_from(info.delivered).unwrap_or(u32::MAX))
            .unwrap_or(1);
        let subject = message.subject.to_string();
        let settled = match codec::decode(
            message.headers.as_ref(),
            &message.payload,
            &self.options.kinds,
        ) {
            Err(malformed) => {
                self.dead_letter(&message, malformed.reason(), &malformed.to_string())
                    .await
            }
            Ok(_) if delivered > self.config.max_deliver => {
                let detail = format!(
                    "delivered {delivered} times without being settled (the consumer died or \
                     outran ack_wait each time); max_deliver is {}",
                    self.config.max_deliver
                );
                self.dead_letter(&message, DeadReason::RetriesExhausted, &detail)
                    .await
            }
            Ok(envelope) => {
                let span = tracing::debug_span!(
                    "nats.consume",
                    subject = %subject,
                    message_id = %envelope.id,
                    kind = %envelope.kind,
                    saga_id = envelope.saga_id.as_deref(),
                    delivered,
                );
                trace::continue_from(&span, &envelope.headers);
                self.handle(&message, envelope, delivered)
                    .instrument(span)
                    .await
            }
        };
        if let Err(error) = settled {
            // Not acked: JetStream redelivers it after ack_wait, and the inbox absorbs a
            // repeat.
            tracing::warn!(%subject, %error, "message not settled; it will be redelivered");
        }
    }

    /// Runs the handler on a decoded message and settles it as the handler says.
    async fn handle(
        &self,
        message: &Message,
        envelope: Envelope,
        delivered: u32,
    ) -> Result<(), NatsError> {
        let id = envelope.id.clone();
        // A handler that panics must still settle its message: left unacked, it would
        // hold one of max_ack_pending's slots until ack_wait. Boxed: a handler's future
        // (a guarded transaction's) runs to kilobytes, and this keeps it from being
        // copied with every future that wraps it.
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
            Disposition::Done { reply } => self.done(message, &id, reply).await,
            Disposition::Retry(reason) => self.retry(message, delivered, &reason).await,
            Disposition::Reject(reason) => {
                self.dead_letter(message, DeadReason::Rejected, &reason)
                    .await
            }
        }
    }

    async fn done(
        &self,
        message: &Message,
        id: &MessageId,
        reply: Option<Envelope>,
    ) -> Result<(), NatsError> {
        let reply_to = message
            .headers
            .as_ref()
            .and_then(|headers| codec::header(headers, REPLY_TO_HEADER));
        if let (Some(reply), Some(reply_to)) = (reply, reply_to) {
            // Replies go over core NATS, not stored: one lost with its orchestrator is
            // asked for again, and the step's inbox answers with the first result.
            let (body, mut headers) = codec::encode(&reply);
            headers.insert(CORRELATION_ID_HEADER, id.as_str());
            self.client
                .publish_with_headers(reply_to, headers, body.into())
                .await
                .map_err(NatsError::broker("publish the reply"))?;
        }
        self.ack(message, AckKind::Ack).await?;
        self.stats.acked.fetch_add(1, Relaxed);
        Ok(())
    }

    async fn retry(
        &self,
        message: &Message,
        delivered: u32,
        reason: &str,
    ) -> Result<(), NatsError> {
        if delivered >= self.config.max_deliver {
            let detail = format!("failed {delivered} times, last: {reason}");
            return self
                .dead_letter(message, DeadReason::RetriesExhausted, &detail)
                .await;
        }
        let backoff = Duration::from_millis(50u64.saturating_mul(1 << delivered.min(6)));
        self.ack(message, AckKind::Nak(Some(backoff))).await?;
        self.stats.requeued.fetch_add(1, Relaxed);
        Ok(())
    }

    async fn dead_letter(
        &self,
        message: &Message,
        reason: DeadReason,
        detail: &str,
    ) -> Result<(), NatsError> {
        let consumer_type = &self.options.consumer_type;
        tracing::warn!(%consumer_type, reason = reason.as_str(), detail, "dead-lettering a message");
        let mut headers = message.headers.clone().unwrap_or_default();
        headers.insert(DEAD_REASON_HEADER, reason.as_str());
        headers.insert(DEAD_DETAIL_HEADER, detail);
        jetstream::publish(
            &self.context,
            &self.config.dead_subject(consumer_type),
            headers,
            message.payload.to_vec(),
        )
        .await?;
        self.ack(message, AckKind::Ack).await?;
        self.stats.dead_lettered.fetch_add(1, Relaxed);
        crate::metrics::dead_lettered(consumer_type.as_str(), reason);
        Ok(())
    }

    async fn ack(&self, message: &Message, kind: AckKind) -> Result<(), NatsError> {
        message
            .ack_with(kind)
            .await
            .map_err(|error| NatsError::Broker {
                operation: "ack",
                reason: error.to_string(),
            })
    }
}
