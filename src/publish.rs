//! The producer's side of a broker: [`Publish`], what a broker's connection does to
//! send envelopes with the broker's confirm — declare a consumer type's queues or
//! streams, send in order and say how many were confirmed, remove what was declared,
//! close. Each broker implements it in its own module (`amqp::Link`, `nats::Link`);
//! [`Sender`](crate::transport::Sender), and through it the outbox relay, sends through
//! it without knowing which broker is behind. The consumer's side is the consumer
//! core's ([`consumer`](crate::consumer)).

use std::fmt::Debug;
use std::future::Future;

use crate::envelope::{ConsumerType, Envelope};

/// What a broker's sending connection does.
pub(crate) trait Publish: Debug + Send + Sync + 'static {
    /// The broker's own error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Whether the connection still stands.
    fn is_connected(&self) -> bool;

    /// Creates `destination`'s queue or stream and its dead letters' as its consumers
    /// would, with the connection's settings. Idempotent for the same settings.
    fn declare(
        &self,
        destination: &ConsumerType,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Sends `messages` in order, each to its destination, and waits for the broker's
    /// confirms: how many, from the first, were confirmed, and the first failure after
    /// them. `Err` is a failure before any message could have been stored.
    fn send_all(
        &self,
        messages: &[(&ConsumerType, &Envelope)],
    ) -> impl Future<Output = Result<Confirmed<Self::Error>, Self::Error>> + Send;

    /// Deletes `consumer_type`'s queue or stream and its dead letters', skipping what
    /// does not exist.
    fn remove(
        &self,
        consumer_type: &ConsumerType,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Closes the connection, after flushing what was sent.
    fn close(self) -> impl Future<Output = ()> + Send;
}

/// What [`Publish::send_all`] got confirmed.
#[derive(Debug)]
pub(crate) struct Confirmed<E> {
    /// How many messages, from the first, the broker confirmed.
    pub(crate) count: usize,
    /// The first failure after them.
    pub(crate) failure: Option<E>,
}
