//! One broker under test, RabbitMQ or NATS JetStream, as the broker suite written once
//! (`tests/broker.rs`) sees it: a namespace of the test's own (a queue or subject
//! prefix) deleted when the fixture drops, the [`Transport`] the library is given, and
//! what a test does behind the library's back — publishing as a plain client would,
//! malformed messages included, and reading what a work queue and its dead letters hold.

use std::fmt;

use async_nats::HeaderMap;
use lapin::BasicProperties;
use sagabox::dlq::DeadLetters;
use sagabox::transport::Transport;
use sagabox::{ConsumerType, Envelope};

use crate::common::rabbit::Rabbit;
use crate::jetstream::Js;

/// Which broker a test of the suite runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// RabbitMQ, quorum queues (the default).
    Amqp,
    /// NATS JetStream.
    Nats,
}

/// A namespace on the broker a test runs on.
pub enum Broker {
    Amqp(Rabbit),
    Nats(Js),
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} under {}", self.kind(), self.transport().prefix())
    }
}

impl Broker {
    /// A fresh namespace on `kind`'s test server; the queues or streams of
    /// `consumer_types` are deleted when it drops.
    pub async fn new(kind: Kind, consumer_types: &[&str]) -> Self {
        match kind {
            Kind::Amqp => Broker::Amqp(Rabbit::new(consumer_types).await),
            Kind::Nats => Broker::Nats(Js::new(consumer_types).await),
        }
    }

    /// Which broker this is.
    pub fn kind(&self) -> Kind {
        match self {
            Broker::Amqp(_) => Kind::Amqp,
            Broker::Nats(_) => Kind::Nats,
        }
    }

    /// The transport the library is given for this namespace.
    pub fn transport(&self) -> Transport {
        match self {
            Broker::Amqp(rabbit) => rabbit.config.clone().into(),
            Broker::Nats(js) => js.config.clone().into(),
        }
    }

    /// Creates `consumer_type`'s queues or streams as the library does.
    pub async fn declare(&self, consumer_type: &str) {
        match self {
            Broker::Amqp(rabbit) => rabbit.declare(consumer_type).await,
            Broker::Nats(js) => js.declare(consumer_type).await,
        }
    }

    /// Publishes `envelope` to `consumer_type` as a plain client would, with the
    /// library's encoding. On JetStream under a `Nats-Msg-Id` of its own (the real id in
    /// sagabox's header), as a publisher past the duplicate window: a repeat is stored
    /// again, so the consumer meets it.
    pub async fn publish(&self, consumer_type: &str, envelope: &Envelope) {
        match self {
            Broker::Amqp(rabbit) => {
                let (body, properties) = sagabox::amqp::codec::encode(envelope);
                rabbit
                    .publish_raw(&rabbit.queue(consumer_type), &body, properties)
                    .await;
            }
            Broker::Nats(js) => {
                let (body, mut headers) = sagabox::nats::codec::encode(envelope);
                headers.insert(
                    sagabox::nats::codec::MESSAGE_ID_HEADER,
                    envelope.id.as_str(),
                );
                headers.insert("Nats-Msg-Id", uuid::Uuid::new_v4().to_string());
                assert!(
                    !js.publish_raw(&js.subject(consumer_type), headers, body)
                        .await
                );
            }
        }
    }

    /// Publishes `body` as it is, under `message_id` (or none) in the broker's own place
    /// for it: an AMQP `message-id`, a `Nats-Msg-Id` header.
    pub async fn publish_bytes(&self, consumer_type: &str, message_id: Option<&str>, body: &[u8]) {
        match self {
            Broker::Amqp(rabbit) => {
                let mut properties = BasicProperties::default();
                if let Some(id) = message_id {
                    properties = properties.with_message_id(id.into());
                }
                rabbit
                    .publish_raw(&rabbit.queue(consumer_type), body, properties)
                    .await;
            }
            Broker::Nats(js) => {
                let mut headers = HeaderMap::new();
                if let Some(id) = message_id {
                    headers.insert("Nats-Msg-Id", id);
                }
                js.publish_raw(&js.subject(consumer_type), headers, body.to_vec())
                    .await;
            }
        }
    }

    /// Messages left in `consumer_type`'s work queue or stream (not yet acknowledged).
    pub async fn pending(&self, consumer_type: &str) -> u64 {
        match self {
            Broker::Amqp(rabbit) => u64::from(rabbit.ready(&rabbit.queue(consumer_type)).await),
            Broker::Nats(js) => js.pending(consumer_type).await,
        }
    }

    /// Waits until `consumer_type`'s work queue or stream holds `count` messages.
    pub async fn wait_pending(&self, consumer_type: &str, count: u64) {
        crate::common::wait_for(&format!("{count} messages stored"), async || {
            self.pending(consumer_type).await == count
        })
        .await;
    }

    /// The envelopes in `consumer_type`'s work queue or stream, in the broker's order
    /// (RabbitMQ's are taken off the queue).
    pub async fn stored(&self, consumer_type: &str) -> Vec<Envelope> {
        let any = Default::default();
        match self {
            Broker::Amqp(rabbit) => rabbit
                .drain(&rabbit.queue(consumer_type))
                .await
                .iter()
                .map(|message| {
                    let delivery = &message.delivery;
                    sagabox::amqp::codec::decode(&delivery.properties, &delivery.data, &any)
                        .expect("an envelope")
                })
                .collect(),
            Broker::Nats(js) => js
                .stored(&js.config.stream(&Js::consumer_type(consumer_type)))
                .await
                .iter()
                .map(|message| {
                    sagabox::nats::codec::decode(Some(&message.headers), &message.payload, &any)
                        .expect("an envelope")
                })
                .collect(),
        }
    }

    /// The reason of each dead letter of `consumer_type`, oldest first, as `sagabox dlq
    /// list` reads it (the header sagabox wrote, or for a message RabbitMQ dead-lettered
    /// at a quorum queue's delivery limit, its `x-death`); left in place.
    pub async fn dead_reasons(&self, consumer_type: &str) -> Vec<String> {
        let source = match self {
            Broker::Amqp(rabbit) => rabbit.queue(consumer_type),
            Broker::Nats(js) => js.subject(consumer_type),
        };
        let dead = DeadLetters::open(&self.transport(), &source)
            .await
            .expect("the dead letters");
        let listed = dead.list(None).await.expect("a listing");
        dead.close().await;
        listed
            .messages
            .into_iter()
            .map(|letter| letter.reason.expect("a reason"))
            .collect()
    }

    /// Dead letters of `consumer_type` (left in place).
    pub async fn dead(&self, consumer_type: &str) -> u64 {
        match self {
            Broker::Amqp(rabbit) => {
                u64::from(rabbit.ready(&rabbit.dead_queue(consumer_type)).await)
            }
            Broker::Nats(js) => js.dead(consumer_type).await,
        }
    }

    /// Whether `consumer_type`'s work queue or stream, and its dead letters', exist.
    pub async fn exists(&self, consumer_type: &str) -> (bool, bool) {
        let typed = Self::consumer_type(consumer_type);
        match self {
            Broker::Amqp(rabbit) => (
                rabbit.exists(&rabbit.config.queue(&typed)).await,
                rabbit.exists(&rabbit.config.dead_queue(&typed)).await,
            ),
            Broker::Nats(js) => (
                js.context
                    .get_stream(js.config.stream(&typed))
                    .await
                    .is_ok(),
                js.context
                    .get_stream(js.config.dead_stream(&typed))
                    .await
                    .is_ok(),
            ),
        }
    }

    /// `name` as a consumer type.
    pub fn consumer_type(name: &str) -> ConsumerType {
        ConsumerType::new(name).expect("consumer type")
    }
}
