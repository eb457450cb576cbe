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

#[cfg(feature = "rabbitmq")]
use crate::amqp::{self, AmqpConfig, Publisher, Routing, codec};
use crate::envelope::{ConsumerType, Envelope};
#[cfg(feature = "nats")]
use crate::nats::{self, NatsConfig};

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
    link: Link,
    /// The destinations declared on this connection.
    declared: HashSet<String>,
}

/// The broker connection behind a [`Sender`].
#[derive(Debug)]
enum Link {
    #[cfg(feature = "rabbitmq")]
    Amqp {
        config: AmqpConfig,
        connection: lapin::Connection,
        publisher: Publisher,
    },
    #[cfg(feature = "nats")]
    Nats {
        config: NatsConfig,
        client: async_nats::Client,
        context: async_nats::jetstream::Context,
    },
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
        let link = match transport {
            #[cfg(feature = "rabbitmq")]
            Transport::Amqp(config) => {
                let connection = amqp::connect(config, role).await?;
                let publisher = Publisher::open(&connection).await?;
                Link::Amqp {
                    config: config.clone(),
                    connection,
                    publisher,
                }
            }
            #[cfg(feature = "nats")]
            Transport::Nats(config) => {
                let client = nats::connect(config, role).await?;
                let context = async_nats::jetstream::new(client.clone());
                Link::Nats {
                    config: config.clone(),
                    client,
                    context,
                }
            }
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
        match &self.link {
            #[cfg(feature = "rabbitmq")]
            Link::Amqp { connection, .. } => connection.status().connected(),
            #[cfg(feature = "nats")]
            Link::Nats { .. } => true,
        }
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
        match &self.link {
            #[cfg(feature = "rabbitmq")]
            Link::Amqp {
                config, publisher, ..
            } => {
                // Published in order on one channel (the broker keeps that order per
                // queue), then every confirm awaited.
                let mut confirms = Vec::with_capacity(messages.len());
                for (destination, envelope) in &messages {
                    let (body, properties) = codec::encode(envelope);
                    let queue = config.queue(destination);
                    let confirm = publisher
                        .start_publish(&queue, &body, properties, Routing::Required)
                        .await?;
                    confirms.push((queue, confirm));
                }
                let mut confirmed = 0;
                let mut failure = None;
                for (queue, confirm) in confirms {
                    match Publisher::confirmed(&queue, confirm).await {
                        Ok(()) if failure.is_none() => confirmed += 1,
                        Ok(()) => {}
                        Err(error) => {
                            failure.get_or_insert(error.into());
                        }
                    }
                }
                Ok(Sent { confirmed, failure })
            }
            #[cfg(feature = "nats")]
            Link::Nats {
                config, context, ..
            } => {
                // One at a time: JetStream stores each before the next is sent, so a
                // failure leaves only what follows it unsent, in order. Each goes under
                // its message id as `Nats-Msg-Id`: the server's duplicate window drops a
                // second send of it.
                let mut confirmed = 0;
                for (destination, envelope) in &messages {
                    let (body, headers) = nats::codec::encode(envelope);
                    let subject = config.subject(destination);
                    if let Err(error) = nats::publish(context, &subject, headers, body).await {
                        return Ok(Sent {
                            confirmed,
                            failure: Some(error.into()),
                        });
                    }
                    confirmed += 1;
                }
                Ok(Sent {
                    confirmed,
                    failure: None,
                })
            }
        }
    }

    /// Creates `destination`'s queue or stream and its dead letters' as its consumers
    /// would, with the transport's settings; once per connection (a send declares its
    /// destination itself). For a producer that fills a queue before any consumer runs.
    pub async fn declare(&mut self, destination: &ConsumerType) -> Result<(), TransportError> {
        if self.declared.contains(destination.as_str()) {
            return Ok(());
        }
        match &self.link {
            #[cfg(feature = "rabbitmq")]
            Link::Amqp {
                config, connection, ..
            } => {
                amqp::declare(connection, config, destination).await?;
            }
            #[cfg(feature = "nats")]
            Link::Nats {
                config, context, ..
            } => {
                nats::declare(context, config, destination).await?;
            }
        }
        self.declared.insert(destination.as_str().to_owned());
        Ok(())
    }

    /// Deletes `consumer_type`'s queue or stream and its dead letters', with whatever
    /// they hold; what does not exist is skipped. For scratch consumer types (a bench's,
    /// a test's): a live consumer type loses its messages.
    pub async fn remove(&mut self, consumer_type: &ConsumerType) -> Result<(), TransportError> {
        self.declared.remove(consumer_type.as_str());
        match &self.link {
            #[cfg(feature = "rabbitmq")]
            Link::Amqp {
                config, connection, ..
            } => {
                for queue in [
                    config.queue(consumer_type),
                    config.dead_queue(consumer_type),
                ] {
                    amqp::delete_queue(connection, &queue).await?;
                }
            }
            #[cfg(feature = "nats")]
            Link::Nats {
                config, context, ..
            } => {
                for stream in [
                    config.stream(consumer_type),
                    config.dead_stream(consumer_type),
                ] {
                    nats::delete_stream(context, &stream).await?;
                }
            }
        }
        Ok(())
    }

    /// Closes the connection (NATS: after flushing what was sent).
    pub async fn close(self) {
        match self.link {
            #[cfg(feature = "rabbitmq")]
            Link::Amqp { connection, .. } => {
                let _ = connection.close(200, "sender closing".into()).await;
            }
            #[cfg(feature = "nats")]
            Link::Nats { client, .. } => {
                let _ = client.drain().await;
            }
        }
    }
}
