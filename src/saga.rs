//! Saga definitions as data: the steps of a saga, the consumer that runs each one, the
//! command that runs it and the one that undoes it, its timeout and its retry policy.
//!
//! Definitions live as TOML files under `sagas/` (see `sagas/checkout.toml`) and are
//! loaded with [`SagaDefinition::load`], which refuses an invalid definition with a
//! [`DefinitionError`] that names the saga and the step and says how to fix it.
//!
//! Instances of a saga are rows of `saga_instances` ([`SagaInstance`], [`SagaStore`]);
//! each step's command has a stable id ([`SagaInstance::command_id`]), so every retry is
//! the same message.
//!
//! A saga is started idempotently from a start message: its id is derived from the
//! message's id ([`SagaInstance::from_start`] documents the envelope's shape), and
//! [`SagaStore::create_if_absent`] stores it once however often the message arrives, so
//! every sender learns the one saga's id.

mod definition;
mod instance;

pub use definition::{DefinitionError, RetryPolicy, SagaDefinition, StepDefinition};
pub use instance::{
    Direction, SagaInstance, SagaStatus, SagaStore, StartError, Started, UnknownStatus,
};
