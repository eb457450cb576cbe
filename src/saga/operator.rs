//! What an operator does to a saga that is stuck: [`retry`] a parked saga from where it
//! stopped, or [`cancel`] a saga, compensating what it completed.
//!
//! Both are safe while orchestrators run. They change the saga through the same version
//! fence as a driver ([`SagaStore::save`]): if a driver saved since the operator read
//! the saga, the operator's write is refused and made again on the fresh state; if the
//! operator wrote first, the driver's next save is refused and the driver goes on from
//! the operator's state. A driver and an operator never both move a saga. Each action is
//! recorded in the saga's history with the operator's note, in the same write.
//!
//! A retried or cancelled saga is driven by the next resume pass of an orchestrator
//! (`sagabox orchestrate` resumes unfinished sagas periodically), or at once by a driver
//! already in flight.

use chrono::{DateTime, Utc};

use crate::saga::versions::{VersionError, stored_definition};
use crate::saga::{EventKind, SagaDefinition, SagaEvent, SagaInstance, SagaStatus, SagaStore};

/// How many times an action is made again after a driver saved first.
const ATTEMPTS: usize = 5;

/// Why an operator's action was refused. Nothing was changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperatorError {
    /// No saga has this id.
    #[error("no saga with id {0}: check the id with `sagabox saga list`")]
    NotFound(String),
    /// The saga is completed or compensated.
    #[error("saga {id} is already {status}: there is nothing left to do")]
    Finished {
        /// The saga.
        id: String,
        /// Its terminal status.
        status: SagaStatus,
    },
    /// `retry` of a saga that is not parked: its orchestrator is driving it.
    #[error(
        "saga {id} is {status} and not parked: an orchestrator drives it (retries included); \
         only a parked saga is retried by hand"
    )]
    NotParked {
        /// The saga.
        id: String,
        /// Its status.
        status: SagaStatus,
    },
    /// `cancel` of a saga that is already compensating.
    #[error(
        "saga {id} is already compensating; if it is parked (a compensation was refused), \
         fix the cause and `retry` it"
    )]
    AlreadyCompensating {
        /// The saga.
        id: String,
    },
    /// `cancel` of a saga past a step that has no compensation: what it did cannot be undone.
    #[error(
        "saga {id} cannot be cancelled: its step `{step}` has no compensation and may have \
         run; the saga can only go forward (retry it if it is parked)"
    )]
    PastPivot {
        /// The saga.
        id: String,
        /// The step without compensation.
        step: String,
    },
    /// The saga's definition version could not be read.
    #[error(transparent)]
    Definition(#[from] VersionError),
    /// Drivers kept saving the saga before the action could be written.
    #[error("saga {0} kept changing under the action; try again")]
    Busy(String),
    /// The database could not be read or written.
    #[error("cannot reach the saga store: {0}")]
    Store(#[from] sqlx::Error),
}

/// Sends parked saga `id` on from where it stopped: its next step's command (or
/// compensation) is sent again by the next orchestrator that resumes it. Clears the
/// parked reason and the deadline (the operator decided the saga should go on).
/// `note` (who and why) is recorded in the history. Returns the saga as saved.
pub async fn retry<St: SagaStore>(
    store: &St,
    id: &str,
    note: &str,
    now: DateTime<Utc>,
) -> Result<SagaInstance, OperatorError> {
    act(store, id, |saga| retried(saga, note, now)).await
}

/// An operator's retry of `saga`, applied to it: the event to record, or why the saga
/// cannot be retried.
pub(crate) fn retried(
    saga: &mut SagaInstance,
    note: &str,
    now: DateTime<Utc>,
) -> Result<SagaEvent, OperatorError> {
    if saga.status.is_terminal() {
        return Err(finished(saga));
    }
    if saga.parked.is_none() {
        return Err(OperatorError::NotParked {
            id: saga.id.clone(),
            status: saga.status,
        });
    }
    saga.parked = None;
    saga.deadline_at = None;
    saga.attempts = 0;
    Ok(SagaEvent::new(EventKind::Retried, now).detail(note))
}

/// Cancels saga `id`: compensates the steps it completed (and the step it is at, which
/// may have run) in reverse order, then ends it `compensated`. Refused for a finished
/// saga, one already compensating, and one at or past a step without compensation.
/// `note` (who and why) is recorded in the history. Returns the saga as saved.
pub async fn cancel<St: SagaStore>(
    store: &St,
    id: &str,
    note: &str,
    now: DateTime<Utc>,
) -> Result<SagaInstance, OperatorError> {
    let Some(saga) = store.load(id).await? else {
        return Err(OperatorError::NotFound(id.to_owned()));
    };
    let definition = stored_definition(store, &saga.saga_name, saga.definition_version).await?;
    act(store, id, |saga| cancelled(&definition, saga, note, now)).await
}

/// An operator's cancel of `saga`, running `definition`, applied to it: the event to
/// record, or why the saga cannot be cancelled.
pub(crate) fn cancelled(
    definition: &SagaDefinition,
    saga: &mut SagaInstance,
    note: &str,
    now: DateTime<Utc>,
) -> Result<SagaEvent, OperatorError> {
    if saga.status.is_terminal() {
        return Err(finished(saga));
    }
    if saga.status == SagaStatus::Compensating {
        return Err(OperatorError::AlreadyCompensating {
            id: saga.id.clone(),
        });
    }
    let step = undo_from(definition, saga)?;
    saga.status = SagaStatus::Compensating;
    saga.current_step = step;
    saga.attempts = 0;
    saga.parked = None;
    saga.last_error = Some(format!("cancelled by an operator: {note}"));
    Ok(SagaEvent::new(EventKind::Cancelled, now).detail(note))
}

/// The step a cancelled running saga compensates first: the one it is at (its command
/// may have been sent), or the last one when every step is done.
fn undo_from(definition: &SagaDefinition, saga: &SagaInstance) -> Result<i32, OperatorError> {
    let last = definition.steps().len().saturating_sub(1);
    let at = usize::try_from(saga.current_step).unwrap_or(0).min(last);
    let step = &definition.steps()[at];
    if step.compensation().is_none() {
        return Err(OperatorError::PastPivot {
            id: saga.id.clone(),
            step: step.name().to_owned(),
        });
    }
    Ok(i32::try_from(at).unwrap_or(i32::MAX))
}

fn finished(saga: &SagaInstance) -> OperatorError {
    OperatorError::Finished {
        id: saga.id.clone(),
        status: saga.status,
    }
}

/// Loads saga `id`, changes it with `change` and saves it with the event `change`
/// returns, again on the fresh state when a driver saved first.
async fn act<St: SagaStore>(
    store: &St,
    id: &str,
    change: impl Fn(&mut SagaInstance) -> Result<SagaEvent, OperatorError>,
) -> Result<SagaInstance, OperatorError> {
    for _ in 0..ATTEMPTS {
        let Some(mut saga) = store.load(id).await? else {
            return Err(OperatorError::NotFound(id.to_owned()));
        };
        let event = change(&mut saga)?;
        saga.updated_at = event.at;
        if store.save(&mut saga, &[event]).await? {
            return Ok(saga);
        }
    }
    Err(OperatorError::Busy(id.to_owned()))
}
