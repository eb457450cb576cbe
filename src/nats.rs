//! The NATS JetStream transport (feature `nats`, through `async-nats`), with the same
//! guarantees as the RabbitMQ one:
//!
//! - [`Consumer`]: a durable pull consumer with explicit acks per consumer type, acking
//!   only after the handler (typically the [`InboxGuard`](crate::InboxGuard)) committed;
//!   bad input and messages out of deliveries dead-lettered with their reason; the
//!   stream's real `max_age` checked against the inbox TTL before consuming.
//! - [`serve_step`] and [`NatsDispatch`]: saga steps and their orchestrator in separate
//!   processes, commands over JetStream and replies over core NATS.
//! - [`DeadLetterStream`]: an operator's view of a subject's dead letters — list them
//!   without taking them, replay them to their source subject under their own message
//!   id (through [`DeadLetters`](crate::dlq::DeadLetters), for either broker).
//! - [`codec`]: the envelope on JetStream, its id in `Nats-Msg-Id` so the server's
//!   duplicate window drops a re-publish (and the inbox absorbs what the window misses);
//!   [`NatsConfig`]: subjects, streams, prefetch, `ack_wait`, `max_deliver`, retention.
//!
//! Subjects are `<prefix>.<consumer_type>` (work-queue stream `<prefix>_<consumer_type>`,
//! dots made underscores) with `<prefix>.<consumer_type>.dead` for dead letters; the
//! prefix defaults to `sagabox`.

pub mod codec;
mod config;
mod consumer;
mod dispatch;
mod dlq;
mod jetstream;
mod link;
mod stall;

pub use config::{NatsConfig, NatsError};
pub use consumer::{Consumer, ConsumerOptions};
pub use dispatch::{NatsDispatch, serve_step};
pub use dlq::DeadLetterStream;
pub use jetstream::{RETENTION_SETTING, measured_retention, prefixed_streams};
pub(crate) use link::Link;
