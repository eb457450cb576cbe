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
use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Context, Message};
use futures_util::StreamExt;

use super::codec::{self, CORRELATION_ID_HEADER, REPLY_TO_HEADER};
use super::config::{NatsConfig, NatsError};
use super::jetstream::{self, RETENTION_SETTING};
use crate::consumer::{Health, Next, Received, Retried, Source, Subscription};
use crate::dead_reason::DeadReason;
use crate::dead_reason::{DEAD_DETAIL_HEADER, DEAD_REASON_HEADER};
use crate::delivery::DeliveryHandler;
use crate::envelope::{ConsumerType, Envelope, MessageId};
use crate::inbox::InboxConfig;
use crate::retention;
use crate::wire::Malformed;

use crate::consumer::ConsumerHandle;

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
        let stream_name = config.stream(&options.consumer_type);
        let source = StreamSource {
            link: Arc::new(Link {
                subject: config.subject(&options.consumer_type),
                dead_subject: config.dead_subject(&options.consumer_type),
                config,
                client,
                context,
            }),
            consumer,
            consumer_type: options.consumer_type.clone(),
        };
        Ok(crate::consumer::spawn(
            source,
            &stream_name,
            options.consumer_type,
            options.kinds,
            handler,
        ))
    }
}

/// What settling a message needs of its consumer, shared by its messages.
struct Link {
    config: NatsConfig,
    client: Client,
    context: Context,
    /// The subject consumed.
    subject: String,
    /// Where its dead letters go.
    dead_subject: String,
}

/// A consumer type's durable pull consumer, on a client that reconnects by itself.
struct StreamSource {
    link: Arc<Link>,
    consumer: PullConsumer,
    /// The consumer type: names the stream and the durable consumer.
    consumer_type: ConsumerType,
}

impl Source for StreamSource {
    type Message = Delivered;
    type Subscription = PullSubscription;
    type Error = NatsError;

    // The client reconnects underneath a subscription, and acknowledges through it.
    const SETTLES_AFTER_LOSS: bool = true;

    fn broker(&self) -> &'static str {
        "NATS JetStream"
    }

    async fn open(&mut self) -> Result<PullSubscription, NatsError> {
        let messages = self
            .consumer
            .stream()
            .max_messages_per_batch(usize::from(self.link.config.prefetch))
            .expires(PULL_EXPIRY)
            .heartbeat(PULL_EXPIRY / 2)
            .messages()
            .await
            .map_err(NatsError::broker("subscribe"))?;
        let stream = self.link.config.stream(&self.consumer_type);
        let watchdog = tokio::spawn(super::stall::watch(
            self.link.client.clone(),
            stream.clone(),
            stream,
        ));
        Ok(PullSubscription {
            messages,
            link: Arc::clone(&self.link),
            watchdog: watchdog.abort_handle(),
        })
    }

    fn backoff(&self, failures: u32) -> Duration {
        crate::backoff::doubling(
            Duration::from_millis(100),
            failures,
            Duration::from_millis(6400),
        )
    }
}

/// A pull subscription: batches of up to the prefetch, requested again as they drain;
/// watched for a stall of its consumer ([`super::stall`]) while it lives.
struct PullSubscription {
    messages: async_nats::jetstream::consumer::pull::Stream,
    link: Arc<Link>,
    watchdog: tokio::task::AbortHandle,
}

impl Drop for PullSubscription {
    fn drop(&mut self) {
        self.watchdog.abort();
    }
}

impl Subscription for PullSubscription {
    type Message = Delivered;

    async fn next(&mut self) -> Next<Delivered> {
        match self.messages.next().await {
            Some(Ok(message)) => Next::Message(Delivered::new(message, Arc::clone(&self.link))),
            // Missed heartbeats and the like while the server is away: the subscription
            // carries on once the client has reconnected.
            Some(Err(error)) => Next::Interrupted(error.to_string()),
            None => Next::Ended("the pull subscription ended".into()),
        }
    }

    // The subscription outlives a lost connection (the client reconnects by itself), so
    // readiness follows the client's state.
    fn health(&self) -> Health {
        if self.link.client.connection_state() == async_nats::connection::State::Connected {
            Health::Consuming
        } else {
            Health::Waiting
        }
    }

    async fn cancel(&mut self) {}

    async fn close(self) {
        let _ = self.link.client.flush().await;
    }
}

/// One message of a subscription, with how many times JetStream has delivered it.
struct Delivered {
    message: Message,
    delivered: u32,
    link: Arc<Link>,
}

impl Delivered {
    fn new(message: Message, link: Arc<Link>) -> Self {
        let delivered = message
            .info()
            .map(|info| u32::try_from(info.delivered).unwrap_or(u32::MAX))
            .unwrap_or(1);
        Self {
            message,
            delivered,
            link,
        }
    }

    async fn ack(&self, kind: AckKind) -> Result<(), NatsError> {
        self.message
            .ack_with(kind)
            .await
            .map_err(|error| NatsError::Broker {
                operation: "ack",
                reason: error.to_string(),
            })
    }
}

impl Received for Delivered {
    type Error = NatsError;

    fn source(&self) -> &str {
        &self.link.subject
    }

    fn decode(&self, kinds: &BTreeSet<String>) -> Result<Envelope, Malformed> {
        codec::decode(self.message.headers.as_ref(), &self.message.payload, kinds)
    }

    /// Delivered past `max_deliver`: its earlier deliveries were never settled (the
    /// consumer died, or outran `ack_wait`, each time).
    fn spent(&self) -> Option<String> {
        (self.delivered > self.link.config.max_deliver).then(|| {
            format!(
                "delivered {} times without being settled (the consumer died or outran \
                 ack_wait each time); max_deliver is {}",
                self.delivered, self.link.config.max_deliver
            )
        })
    }

    fn span(&self, envelope: &Envelope) -> tracing::Span {
        tracing::debug_span!(
            "nats.consume",
            subject = %self.message.subject,
            message_id = %envelope.id,
            kind = %envelope.kind,
            saga_id = envelope.saga_id.as_deref(),
            delivered = self.delivered,
        )
    }

    async fn reply_and_ack(
        &self,
        reply: Option<Envelope>,
        command: &MessageId,
    ) -> Result<(), NatsError> {
        let reply_to = self
            .message
            .headers
            .as_ref()
            .and_then(|headers| codec::header(headers, REPLY_TO_HEADER));
        if let (Some(reply), Some(reply_to)) = (reply, reply_to) {
            // Replies go over core NATS, not stored: one lost with its orchestrator is
            // asked for again, and the step's inbox answers with the first result.
            let (body, mut headers) = codec::encode(&reply);
            headers.insert(CORRELATION_ID_HEADER, command.as_str());
            self.link
                .client
                .publish_with_headers(reply_to, headers, body.into())
                .await
                .map_err(NatsError::broker("publish the reply"))?;
        }
        self.ack(AckKind::Ack).await
    }

    /// A negative acknowledgement with a backoff; JetStream counts the deliveries, and
    /// the last allowed one is dead-lettered instead.
    async fn retry(&self, reason: &str) -> Result<Retried, NatsError> {
        if self.delivered >= self.link.config.max_deliver {
            return Ok(Retried::Exhausted(format!(
                "failed {} times, last: {reason}",
                self.delivered
            )));
        }
        let backoff = crate::backoff::doubling(
            Duration::from_millis(50),
            self.delivered,
            Duration::from_millis(3200),
        );
        self.ack(AckKind::Nak(Some(backoff))).await?;
        Ok(Retried::Requeued)
    }

    async fn dead_letter(&self, reason: DeadReason, detail: &str) -> Result<(), NatsError> {
        let mut headers = self.message.headers.clone().unwrap_or_default();
        headers.insert(DEAD_REASON_HEADER, reason.as_str());
        headers.insert(DEAD_DETAIL_HEADER, detail);
        jetstream::publish(
            &self.link.context,
            &self.link.dead_subject,
            headers,
            self.message.payload.to_vec(),
        )
        .await?;
        self.ack(AckKind::Ack).await
    }

    /// A negative acknowledgement without a delay: delivered again now.
    async fn give_back(&self) -> Result<(), NatsError> {
        self.ack(AckKind::Nak(None)).await
    }
}
