//! Saga definitions as data: the steps of a saga, the consumer that runs each one, the
//! command that runs it and the one that undoes it, its timeout and its retry policy.
//!
//! Definitions live as TOML files under `sagas/` (see `sagas/checkout.toml`) and are
//! loaded with [`SagaDefinition::load`], which refuses an invalid definition with a
//! [`DefinitionError`] that names the saga and the step and says how to fix it. Each
//! definition has a version; a saga runs to its end on the version it started under
//! ([`versions`]).
//!
//! Instances of a saga are rows of `saga_instances` ([`SagaInstance`], [`SagaStore`]);
//! each step's command has a stable id ([`SagaInstance::command_id`]), so every retry is
//! the same message. Everything that happens to a saga is recorded in its history
//! ([`SagaEvent`]), in the same transaction as the state it changes; an operator lists
//! sagas, reads a history, and retries or cancels a stuck saga with [`operator`].
//!
//! A saga is started idempotently from a start message: its id is derived from the
//! message's id ([`SagaInstance::from_start`] documents the envelope's shape), and
//! [`SagaStore::create_if_absent`] stores it once however often the message arrives, so
//! every sender learns the one saga's id.

mod definition;
mod history;
mod instance;
pub(crate) mod machine;
pub mod operator;
mod store;
pub mod versions;

pub use definition::{DefinitionError, RetryPolicy, SagaDefinition, StepDefinition};
pub use history::{EventKind, HistoryEntry, SagaEvent, UnknownEventKind};
pub use instance::{
    Direction, SagaInstance, SagaState, SagaStatus, StartError, UnknownDirection, UnknownStatus,
};
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) use store::history_months;
pub use store::{
    DEFAULT_HISTORY_RETENTION, FinishedMinute, HISTORY_PARTITION_PREFIX, HistoryPruned, SagaCount,
    SagaCursor, SagaFilter, SagaInsert, SagaSave, SagaStore, Started, history_pass,
};

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
use crate::envelope::{ConsumerType, KeyError};

/// The consumer type whose queue or subject takes the start messages of the saga named
/// `saga`: `<saga>.start`.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) fn start_consumer(saga: &str) -> Result<ConsumerType, KeyError> {
    ConsumerType::new(format!("{saga}.start"))
}
