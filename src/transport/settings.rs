//! What the transport boundary reads and sets on a broker's configuration, whatever the
//! broker: [`BrokerSettings`], implemented here for each broker's configuration (the
//! transport sits above the brokers, which never import it), so [`Transport`](super::Transport) asks its broker once
//! ([`Transport::settings`](super::Transport)) instead of matching on it for every field.

use crate::envelope::ConsumerType;
use crate::inbox::InboxConfig;

use super::TransportError;

/// A broker's configuration, as the transport boundary sees it.
pub(crate) trait BrokerSettings {
    /// Checks every setting; the error says which and what to do.
    fn validate(&self) -> Result<(), TransportError>;
    /// The broker's name, for logs and reports.
    fn broker(&self) -> &'static str;
    /// The broker's URL, password included.
    fn url(&self) -> &str;
    /// The prefix of its queues or subjects.
    fn prefix(&self) -> &str;
    /// Unacknowledged messages a consumer holds at once.
    fn prefetch(&self) -> u16;
    /// Holds at most `prefetch` unacknowledged messages per consumer.
    fn set_prefetch(&mut self, prefetch: u16);
    /// Delivers one message at most `deliveries` times before it is dead-lettered.
    fn set_max_deliveries(&mut self, deliveries: u32);
    /// Sets the retention of what it declares from `inbox`'s broker retention (and, where
    /// the broker checks it on its consumers, the inbox it checks against).
    fn set_retention_of(&mut self, inbox: &InboxConfig);
    /// Keeps `replicas` copies of what it declares, on as many nodes of a cluster.
    fn set_replicas(&mut self, replicas: u8);
    /// Where `consumer_type`'s messages are sent: a queue or a subject.
    fn destination(&self, consumer_type: &ConsumerType) -> String;
}

#[cfg(feature = "rabbitmq")]
impl BrokerSettings for crate::amqp::AmqpConfig {
    fn validate(&self) -> Result<(), TransportError> {
        Ok(crate::amqp::AmqpConfig::validate(self)?)
    }

    fn broker(&self) -> &'static str {
        "RabbitMQ"
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn prefix(&self) -> &str {
        &self.queue_prefix
    }

    fn prefetch(&self) -> u16 {
        self.prefetch
    }

    fn set_prefetch(&mut self, prefetch: u16) {
        self.prefetch = prefetch;
    }

    fn set_max_deliveries(&mut self, deliveries: u32) {
        self.max_redeliveries = deliveries;
    }

    fn set_retention_of(&mut self, inbox: &InboxConfig) {
        self.set_inbox(inbox);
    }

    fn set_replicas(&mut self, replicas: u8) {
        self.replicas = Some(replicas);
    }

    fn destination(&self, consumer_type: &ConsumerType) -> String {
        self.queue(consumer_type)
    }
}

#[cfg(feature = "nats")]
impl BrokerSettings for crate::nats::NatsConfig {
    fn validate(&self) -> Result<(), TransportError> {
        Ok(crate::nats::NatsConfig::validate(self)?)
    }

    fn broker(&self) -> &'static str {
        "NATS JetStream"
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn prefix(&self) -> &str {
        &self.prefix
    }

    fn prefetch(&self) -> u16 {
        self.prefetch
    }

    fn set_prefetch(&mut self, prefetch: u16) {
        self.prefetch = prefetch;
    }

    fn set_max_deliveries(&mut self, deliveries: u32) {
        self.max_deliver = deliveries;
    }

    fn set_retention_of(&mut self, inbox: &InboxConfig) {
        self.retention = inbox.broker_retention;
    }

    fn set_replicas(&mut self, replicas: u8) {
        self.replicas = usize::from(replicas);
    }

    fn destination(&self, consumer_type: &ConsumerType) -> String {
        self.subject(consumer_type)
    }
}
