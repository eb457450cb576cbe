//! What a participant did: [`ParticipantReport`], per step ([`StepReport`]) and for its
//! pruner ([`PrunerReport`], tallied by a [`Maintenance`] wrapper around the guard).

use std::sync::{Arc, Mutex, PoisonError};

use crate::envelope::ConsumerType;
use crate::inbox::{InboxError, InboxGuard};
use crate::month::Month;
use crate::pruner::{Maintenance, PrunePass};
use crate::store::InboxStore;

/// What a participant did, so far ([`ParticipantHandle::report`](super::ParticipantHandle::report))
/// or in all ([`ParticipantHandle::stop`](super::ParticipantHandle::stop)).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct ParticipantReport {
    /// One per hosted step, in the order they were added.
    pub steps: Vec<StepReport>,
    /// The pruner's passes, if it ran.
    pub pruner: Option<PrunerReport>,
}

impl ParticipantReport {
    /// The report of `consumer_type`'s step, if it is hosted.
    pub fn step(&self, consumer_type: &str) -> Option<&StepReport> {
        self.steps
            .iter()
            .find(|step| step.consumer_type.as_str() == consumer_type)
    }
}

/// What one step's consumer did with its deliveries.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StepReport {
    /// The step.
    pub consumer_type: ConsumerType,
    /// The queue it consumed.
    pub queue: String,
    /// Workers in its pool.
    pub workers: usize,
    /// Deliveries acknowledged after the handler's transaction committed (or found a
    /// duplicate); replies published before each, when asked for.
    pub acked: u64,
    /// Deliveries dead-lettered: bad input, refused by the inbox, out of attempts.
    pub dead_lettered: u64,
    /// Deliveries published again after a retryable failure (a handler's
    /// `StepError::Retryable`, a crashed worker, a timeout).
    pub requeued: u64,
    /// Broker sessions (1 + reconnections).
    pub sessions: u64,
}

/// What the pruner's passes did. Across several instances sharing a database, each
/// month appears in exactly one instance's `dropped`.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct PrunerReport {
    /// Passes that held the maintenance lock and ran.
    pub passes: u64,
    /// Passes skipped because another instance held the lock.
    pub skipped: u64,
    /// Passes that failed (retried at the next tick).
    pub failed: u64,
    /// Months whose partition this instance created.
    pub created: Vec<Month>,
    /// Months whose partition this instance dropped.
    pub dropped: Vec<Month>,
}

/// The guard's maintenance pass, tallied into a [`PrunerReport`].
#[derive(Debug)]
pub(super) struct Tallied<S> {
    guard: InboxGuard<S>,
    tally: Arc<Mutex<PrunerReport>>,
}

impl<S> Tallied<S> {
    pub(super) fn new(guard: InboxGuard<S>, tally: Arc<Mutex<PrunerReport>>) -> Self {
        Self { guard, tally }
    }
}

impl<S: InboxStore> Maintenance for Tallied<S> {
    async fn run_pass(&self, dry_run: bool) -> Result<PrunePass, InboxError> {
        let result = self.guard.run_pass(dry_run).await;
        if !dry_run {
            let mut tally = self.tally.lock().unwrap_or_else(PoisonError::into_inner);
            match &result {
                Ok(pass) if pass.skipped => tally.skipped += 1,
                Ok(pass) => {
                    tally.passes += 1;
                    tally.created.extend(pass.created.iter().copied());
                    tally.dropped.extend(pass.dropped.iter().copied());
                }
                Err(_) => tally.failed += 1,
            }
        }
        result
    }
}
