//! The RabbitMQ transport (feature `rabbitmq`, through `lapin`).
//!
//! - [`Consumer`]: consume a queue, run each message through a handler (typically the
//!   [`InboxGuard`](crate::InboxGuard)), ack only after it committed; dead-letter bad
//!   input with a reason header; requeue retryable failures a bounded number of times.
//! - The outbox [`Relay`](crate::relay::Relay) publishes here with publisher confirms,
//!   in order per aggregate, marking rows sent only after the confirm.
//! - [`serve_step`] and [`AmqpDispatch`]: saga steps and their orchestrator in separate
//!   processes, talking through queues.
//! - [`orchestrate`](crate::orchestrate::orchestrate) runs the orchestrator as a service
//!   on this transport — any saga definitions, started by start messages on
//!   `<prefix>.<saga>.start`, resumed after a crash.
//! - [`serve_step_batched`]: the deliveries a consumer holds claimed in batches, one at a
//!   time ([`GroupCommit`](crate::batching::GroupCommit),
//!   [`InboxGuard::process_batch`](crate::InboxGuard::process_batch)).
//! - [`DeadLetterQueue`]: an operator's view of `<queue>.dead` — list the dead letters
//!   without taking them, replay them to their source queue under their own message id
//!   (through [`DeadLetters`](crate::dlq::DeadLetters), for either broker).
//! - [`check_retention`]: a queue's real retention (its `x-message-ttl` and policies,
//!   read through the management API) checked against the inbox TTL before a consumer
//!   takes a message.
//! - [`codec`]: the envelope on the wire; [`AmqpConfig`]: queues, their type
//!   ([`QueueType`]) and TTL, prefetch, backoff.
//!
//! Queues are `<prefix>.<consumer_type>` (durable; quorum by default, with
//! `x-message-ttl` and `x-delivery-limit`) with `<prefix>.<consumer_type>.dead` (classic,
//! no TTL) for dead letters; the prefix defaults to `sagabox`.

mod broker;
pub mod codec;
mod config;
mod consumer;
mod dispatch;
mod dlq;
mod link;
mod management;

pub use config::{AmqpConfig, AmqpError, QueueType};
pub use consumer::{Consumer, ConsumerOptions};
pub(crate) use dispatch::serve_step_in_batches;
pub use dispatch::{AmqpDispatch, serve_step, serve_step_batched};
pub use dlq::DeadLetterQueue;
pub(crate) use link::Link;
pub use management::{
    QueueRetention, RETENTION_SETTING, check_retention, measure_retention, prefixed_queues,
};
