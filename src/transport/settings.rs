//! What the transport boundary reads and sets on a broker's configuration, whatever the
//! broker: [`BrokerSettings`], implemented by each broker's configuration in its own
//! module, so [`Transport`](super::Transport) asks its broker once
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
