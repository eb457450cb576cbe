//! [`ParticipantError`]: why a participant did not start, or why it stopped.

use ractor::SpawnErr;

use crate::envelope::{ConsumerType, KeyError};
use crate::inbox::{ConfigError, InboxError};
use crate::supervisor::ActorDied;
use crate::transport::TransportError;

/// Why a [`Participant`](super::Participant) refused to start, failed to, or ended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ParticipantError {
    /// No step was added.
    #[error("the participant hosts no step: add one with .step(consumer_type, handler)")]
    NoSteps,
    /// A step's consumer type is not a valid key.
    #[error("invalid consumer type {name:?}: {source}")]
    InvalidConsumerType {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        #[source]
        source: KeyError,
    },
    /// Two steps have the same consumer type: they would share one queue and one inbox
    /// key space, each taking the other's messages.
    #[error(
        "consumer type {0} is hosted twice: one handler per consumer type (it names the queue \
         and the inbox's key)"
    )]
    DuplicateConsumerType(ConsumerType),
    /// A step's pool would have no worker.
    #[error("the step {consumer_type} has 0 workers: give it at least 1")]
    ZeroWorkers {
        /// The step.
        consumer_type: ConsumerType,
    },
    /// A step's deliveries would time out at once.
    #[error("the step {consumer_type} has a timeout of zero: give its handler time to answer")]
    ZeroTimeout {
        /// The step.
        consumer_type: ConsumerType,
    },
    /// A step lists an empty message kind.
    #[error("the step {consumer_type} lists an empty message kind")]
    EmptyKind {
        /// The step.
        consumer_type: ConsumerType,
    },
    /// A step's batch size is zero or above the prefetch (a consumer never holds more
    /// than the prefetch at once, so a larger batch would never fill).
    #[error(
        "the step {consumer_type} claims batches of {batch}: give a batch from 1 to the \
         prefetch ({prefetch})"
    )]
    InvalidBatch {
        /// The step.
        consumer_type: ConsumerType,
        /// The batch size asked for.
        batch: usize,
        /// The broker's prefetch.
        prefetch: usize,
    },
    /// The relay's settings were refused.
    #[error("invalid relay configuration: {0}")]
    InvalidRelay(String),
    /// The pruner would run without pause.
    #[error("the pruner's interval is zero: give it a period such as one hour")]
    ZeroPrunerInterval,
    /// The inbox's settings were refused (a TTL shorter than the broker's retention).
    #[error(transparent)]
    InboxConfig(#[from] ConfigError),
    /// Preparing the inbox (migrations, partitions) failed.
    #[error("preparing the inbox failed: {0}")]
    Inbox(#[from] InboxError),
    /// The broker's settings were refused, or it could not be reached at start (or a
    /// stream's retention is longer than the inbox TTL).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The Prometheus endpoint could not start.
    #[cfg(feature = "prometheus")]
    #[cfg_attr(docsrs, doc(cfg(feature = "prometheus")))]
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    /// An actor could not be started.
    #[error("could not start the {actor} actor: {source}")]
    Spawn {
        /// Which (`step pool <consumer_type>`, `relay`, `pruner`, `supervisor`).
        actor: String,
        /// The cause.
        #[source]
        source: SpawnErr,
    },
    /// A supervised actor died while running (`step pool <consumer_type>`, `relay`,
    /// `pruner`): the participant stopped rather than go on without it.
    #[error(transparent)]
    ActorDied(#[from] ActorDied),
    /// A consumer's task ended without being stopped (it reconnects after broker
    /// failures, so this is a bug): the participant stopped rather than leave its
    /// queue unconsumed.
    #[error("the consumer of {consumer_type} ended without being stopped; the participant stopped")]
    ConsumerEnded {
        /// The step whose queue nobody consumed any more.
        consumer_type: ConsumerType,
    },
}
