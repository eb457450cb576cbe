//! What a transport's consumer hands each decoded message to, and how the answer settles
//! the delivery: [`DeliveryHandler`] and [`Disposition`], shared by every transport, and
//! the header counting a retried message's attempts on any broker. Why a message is
//! dead-lettered is [`dead_reason`](crate::dead_reason)'s.

use std::future::Future;
use std::sync::atomic::AtomicU64;

use crate::envelope::Envelope;

/// The header counting a message's retryable failures.
pub const ATTEMPTS_HEADER: &str = "x-sagabox-attempts";

/// What to do with a delivery, as the handler decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// Handled (applied, or found to be a duplicate): acknowledge. A `reply` is published
    /// first to the delivery's `reply_to` queue, correlated by the message id.
    Done {
        /// The answer to send back, if the sender asked for one.
        reply: Option<Envelope>,
    },
    /// Failed for now (the database is down, a lock timed out): requeue, up to the limit.
    Retry(String),
    /// Will never succeed (the inbox refused it): dead-letter with this reason.
    Reject(String),
}

/// What handles each decoded message. Implemented for async closures
/// `Fn(Envelope) -> impl Future<Output = Disposition>`.
pub trait DeliveryHandler: Send + Sync + 'static {
    /// Handles one message.
    fn handle(&self, envelope: Envelope) -> impl Future<Output = Disposition> + Send;
}

impl<F, Fut> DeliveryHandler for F
where
    F: Fn(Envelope) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Disposition> + Send,
{
    fn handle(&self, envelope: Envelope) -> impl Future<Output = Disposition> + Send {
        self(envelope)
    }
}

/// Counters of what a consumer did, for tests and summaries.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    /// Deliveries acknowledged after the handler said done.
    pub acked: AtomicU64,
    /// Deliveries dead-lettered (bad input, rejected, out of attempts).
    pub dead_lettered: AtomicU64,
    /// Deliveries published again after a retryable failure.
    pub requeued: AtomicU64,
    /// Sessions started (1 + reconnections).
    pub sessions: AtomicU64,
}
