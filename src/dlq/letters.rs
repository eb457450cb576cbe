//! [`DeadLetters`]: the dead letters of one queue or subject on the broker a
//! [`Transport`] names, handed to that broker's own dead-letter code.

use super::{DeadLetterList, DlqError, ReplayOptions, ReplayReport};
#[cfg(doc)]
use super::{REPLAYED_HEADER, queue_names};
use crate::transport::Transport;

/// The dead letters of one queue (RabbitMQ) or subject (NATS JetStream), on the broker
/// a [`Transport`] names.
#[derive(Debug)]
#[non_exhaustive]
pub enum DeadLetters {
    /// `<queue>.dead` on RabbitMQ.
    #[cfg(feature = "rabbitmq")]
    Amqp(crate::amqp::DeadLetterQueue),
    /// The dead-letter stream on JetStream.
    #[cfg(feature = "nats")]
    Nats(crate::nats::DeadLetterStream),
}

impl DeadLetters {
    /// Connects to `transport`'s broker (only its URL matters) and checks that the dead
    /// letters of `queue` exist; `queue` is the source queue or subject, or the dead one
    /// (see [`queue_names`]).
    pub async fn open(transport: &Transport, queue: &str) -> Result<Self, DlqError> {
        Ok(match transport {
            #[cfg(feature = "rabbitmq")]
            Transport::Amqp(config) => {
                Self::Amqp(crate::amqp::DeadLetterQueue::open(config, queue).await?)
            }
            #[cfg(feature = "nats")]
            Transport::Nats(config) => {
                Self::Nats(crate::nats::DeadLetterStream::open(config, queue).await?)
            }
        })
    }

    /// Dead letters waiting.
    pub async fn count(&self) -> Result<u32, DlqError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::Amqp(queue) => queue.count().await,
            #[cfg(feature = "nats")]
            Self::Nats(stream) => stream.count().await,
        }
    }

    /// Shows up to `limit` dead letters (all with `None`), oldest first, and leaves
    /// every one where it was, in the same order.
    pub async fn list(&self, limit: Option<usize>) -> Result<DeadLetterList, DlqError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::Amqp(queue) => queue.list(limit).await,
            #[cfg(feature = "nats")]
            Self::Nats(stream) => stream.list(limit).await,
        }
    }

    /// Republishes the dead letters `options` selects to their source, under their
    /// message id, without the dead-letter headers and with [`REPLAYED_HEADER`]
    /// counting the replays; each leaves the dead letters once the broker confirmed its
    /// copy, the others stay untouched.
    pub async fn replay(&self, options: &ReplayOptions) -> Result<ReplayReport, DlqError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::Amqp(queue) => queue.replay(options).await,
            #[cfg(feature = "nats")]
            Self::Nats(stream) => stream.replay(options).await,
        }
    }

    /// Closes the connection.
    pub async fn close(self) {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::Amqp(queue) => queue.close().await,
            #[cfg(feature = "nats")]
            Self::Nats(stream) => stream.close().await,
        }
    }
}
