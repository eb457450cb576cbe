//! [`Sender`]: sends envelopes to consumer types over either broker, each confirmed by
//! the broker before the send returns — how a producer outside any handler (a web
//! request, a script, a test) hands a command to a step or a start message to a saga.
//! The outbox [`Relay`](crate::relay::Relay) publishes through it too.
//!
//! A destination is declared the first time it is sent to, with the transport's
//! settings (RabbitMQ: the durable queue and its dead-letter queue, of the configured
//! type and TTL; JetStream: the work stream), so a send never waits for the consumer to
//! have started. Declaring is idempotent when every process gives the same settings,
//! which is why the sender takes the same [`Transport`] as the consumers.
//!
//! A send is at least once: a producer that retries after an error sends **the same
//! message id** again ([`MessageId::new`](crate::MessageId::new) from something stable,
//! such as the request's id), and the consumer's inbox applies it once.

use std::collections::HashSet;
use std::fmt::Debug;

use futures_util::future::BoxFuture;

use crate::envelope::{ConsumerType, Envelope};
use crate::publish::{Confirmed, Publish};

use super::{Transport, TransportError};

/// A connection to the broker that sends envelopes with the broker's confirm.
///
/// ```no_run
/// use sagabox::transport::{Sender, Transport};
/// use sagabox::{ConsumerType, Envelope, MessageId};
/// use serde_json::json;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let transport = Transport::from_url("amqp://guest:guest@127.0.0.1:5672/%2f", "bank")?;
/// let mut sender = Sender::connect(&transport, "billing").await?;
/// // The id comes from the request: a retry of this request sends the same command.
/// let credit = Envelope::new(
///     MessageId::new("invoice-2041-credit")?,
///     "credit",
///     json!({"account": "alice", "cents": 500}),
/// )?;
/// sender.send(&ConsumerType::new("ledger")?, &credit).await?;
/// sender.close().await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Sender {
    transport: Transport,
    link: Box<dyn Link>,
    /// The destinations declared on this connection.
    declared: HashSet<String>,
}

/// A broker's [`Publish`], its futures boxed and its errors made [`TransportError`]s,
/// so that a [`Sender`] holds either broker's connection as one type.
trait Link: Debug + Send + Sync {
    fn is_connected(&self) -> bool;
    fn declare<'a>(
        &'a self,
        destination: &'a ConsumerType,
    ) -> BoxFuture<'a, Result<(), TransportError>>;
    fn send_all<'a>(
        &'a self,
        messages: &'a [(&'a ConsumerType, &'a Envelope)],
    ) -> BoxFuture<'a, Result<Sent, TransportError>>;
    fn remove<'a>(
        &'a self,
        consumer_type: &'a ConsumerType,
    ) -> BoxFuture<'a, Result<(), TransportError>>;
    fn close(self: Box<Self>) -> BoxFuture<'static, ()>;
}

impl<P: Publish> Link for P
where
    TransportError: From<P::Error>,
{
    fn is_connected(&self) -> bool {
        Publish::is_connected(self)
    }

    fn declare<'a>(
        &'a self,
        destination: &'a ConsumerType,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { Ok(Publish::declare(self, destination).await?) })
    }

    fn send_all<'a>(
        &'a self,
        messages: &'a [(&'a ConsumerType, &'a Envelope)],
    ) -> BoxFuture<'a, Result<Sent, TransportError>> {
        Box::pin(async move {
            let Confirmed { count, failure } = Publish::send_all(self, messages).await?;
            Ok(Sent {
                confirmed: count,
                failure: failure.map(TransportError::from),
            })
        })
    }

    fn remove<'a>(
        &'a self,
        consumer_type: &'a ConsumerType,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { Ok(Publish::remove(self, consumer_type).await?) })
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(Publish::close(*self))
    }
}

/// What [`Sender::send_all`] got confirmed.
#[derive(Debug)]
pub struct Sent {
    /// How many messages, from the first, the broker confirmed.
    pub confirmed: usize,
    /// The first failure after them; the messages from there on may or may not have
    /// reached the broker, and are to be sent again.
    pub failure: Option<TransportError>,
}

impl Sender {
    /// Connects to `transport`'s broker; `role` names the connection on the broker
    /// (`<prefix>/<role>`, as the management UI and `/connz` show it).
    pub async fn connect(transport: &Transport, role: &str) -> Result<Self, TransportError> {
        transport.validate()?;
        let link: Box<dyn Link> = match transport {
            #[cfg(feature = "rabbitmq")]
            Transport::Amqp(config) => Box::new(crate::amqp::Link::connect(config, role).await?),
            #[cfg(feature = "nats")]
            Transport::Nats(config) => Box::new(crate::nats::Link::connect(config, role).await?),
        };
        Ok(Self {
            transport: transport.clone(),
            link,
            declared: HashSet::new(),
        })
    }

    /// The broker this sender sends to.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// Whether the connection still stands. A RabbitMQ connection that was lost stays
    /// lost: connect a new sender. The NATS client reconnects by itself; a send while it
    /// is away fails.
    pub fn is_connected(&self) -> bool {
        self.link.is_connected()
    }

    /// Sends `envelope` to `consumer_type`'s queue or stream and returns once the broker
    /// has stored it.
    pub async fn send(
        &mut self,
        consumer_type: &ConsumerType,
        envelope: &Envelope,
    ) -> Result<(), TransportError> {
        let sent = self.send_all([(consumer_type, envelope)]).await?;
        match sent.failure {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Sends a start message to its saga's orchestrators: to `<prefix>.<saga>.start`,
    /// where the saga is the envelope's `kind` and its data the `payload`. The saga's id
    /// is derived from the message id, so sending it again starts no second saga.
    pub async fn start_saga(&mut self, start: &Envelope) -> Result<(), TransportError> {
        let destination = crate::saga::start_consumer(&start.kind)?;
        self.send(&destination, start).await
    }

    /// Sends `messages` in order and waits for the broker's confirms: how many of them,
    /// from the first, were confirmed, and the first failure after them. `Err` is a
    /// failure before anything was sent (a destination that could not be declared).
    pub async fn send_all<'a, I>(&mut self, messages: I) -> Result<Sent, TransportError>
    where
        I: IntoIterator<Item = (&'a ConsumerType, &'a Envelope)>,
    {
        let messages: Vec<_> = messages.into_iter().collect();
        for (destination, _) in &messages {
            self.declare(destination).await?;
        }
        self.link.send_all(&messages).await
    }

    /// Creates `destination`'s queue or stream and its dead letters' as its consumers
    /// would, with the transport's settings; once per connection (a send declares its
    /// destination itself). For a producer that fills a queue before any consumer runs.
    pub async fn declare(&mut self, destination: &ConsumerType) -> Result<(), TransportError> {
        if self.declared.contains(destination.as_str()) {
            return Ok(());
        }
        self.link.declare(destination).await?;
        self.declared.insert(destination.as_str().to_owned());
        Ok(())
    }

    /// Deletes `consumer_type`'s queue or stream and its dead letters', with whatever
    /// they hold; what does not exist is skipped. For scratch consumer types (a bench's,
    /// a test's): a live consumer type loses its messages.
    pub async fn remove(&mut self, consumer_type: &ConsumerType) -> Result<(), TransportError> {
        self.declared.remove(consumer_type.as_str());
        self.link.remove(consumer_type).await
    }

    /// Closes the connection (NATS: after flushing what was sent).
    pub async fn close(self) {
        self.link.close().await;
    }
}
