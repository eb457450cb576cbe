//! Saga definitions as data: the steps of a saga, the consumer that runs each one, the
//! command that runs it and the one that undoes it, its timeout and its retry policy.
//!
//! Definitions live as TOML files under `sagas/` (see `sagas/checkout.toml`) and are
//! loaded with [`SagaDefinition::load`], which refuses an invalid definition with a
//! [`DefinitionError`] that names the saga and the step and says how to fix it.

mod definition;

pub use definition::{DefinitionError, RetryPolicy, SagaDefinition, StepDefinition};
