//! Tools for testing sagas: [`FaultyDispatch`] wraps the orchestrator's [`Dispatch`] to
//! duplicate commands and lose replies at seeded rates, and counts what reached the
//! steps, so a test can prove that a saga's participants apply each command once and
//! that its compensations hold — the faults an at-least-once broker produces, on demand
//! and reproducibly.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::envelope::{ConsumerType, Envelope};
use crate::orchestrator::Dispatch;
use crate::step::{StepFailure, StepReply};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// A fault rate outside 0..=1 (or not a number).
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("the {what} rate is {rate}: a rate is a probability, from 0 to 1")]
pub struct InvalidRate {
    /// Which rate.
    pub what: &'static str,
    /// The refused value.
    pub rate: f64,
}

fn checked(what: &'static str, rate: f64) -> Result<f64, InvalidRate> {
    if (0.0..=1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err(InvalidRate { what, rate })
    }
}

/// What reached the steps through a [`FaultyDispatch`], counted per delivery (a duplicated
/// command is two deliveries).
#[derive(Debug, Default)]
pub struct FaultCounts {
    /// Deliveries the step answered as the first: each left one inbox row.
    pub applied: AtomicU64,
    /// Deliveries the step answered as duplicates: each absorbed by the inbox, counted
    /// on the first delivery's row.
    pub duplicates: AtomicU64,
    /// Deliveries with no answer from the step (a timeout, a failure).
    pub failed: AtomicU64,
    /// Commands sent twice.
    pub duplicated: AtomicU64,
    /// Replies dropped after the step answered.
    pub replies_dropped: AtomicU64,
}

impl FaultCounts {
    fn tally(&self, reply: &Result<StepReply, StepFailure>) {
        let counter = match reply {
            Ok(reply) if reply.duplicate => &self.duplicates,
            Ok(_) => &self.applied,
            Err(_) => &self.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A [`Dispatch`] that duplicates commands and loses replies, from a seeded generator.
#[derive(Debug)]
pub struct FaultyDispatch<D> {
    inner: D,
    duplicate_rate: f64,
    lost_reply_rate: f64,
    rng: Mutex<StdRng>,
    counts: FaultCounts,
}

impl<D: Dispatch> FaultyDispatch<D> {
    /// Wraps `inner`: each command is delivered twice, concurrently, with probability
    /// `duplicate_rate`; each reply is dropped after the step answered — the
    /// orchestrator sees a timeout and sends the command again — with probability
    /// `lost_reply_rate`. The same `seed` draws the same faults in the same order.
    pub fn new(
        inner: D,
        duplicate_rate: f64,
        lost_reply_rate: f64,
        seed: u64,
    ) -> Result<Self, InvalidRate> {
        Ok(Self {
            inner,
            duplicate_rate: checked("duplicate", duplicate_rate)?,
            lost_reply_rate: checked("lost reply", lost_reply_rate)?,
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            counts: FaultCounts::default(),
        })
    }

    /// What reached the steps so far.
    pub fn counts(&self) -> &FaultCounts {
        &self.counts
    }

    /// The dispatch underneath.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Both draws of one command at once, so that the lock is never held across an
    /// await (and a poisoned lock still draws: the generator's state cannot be broken).
    fn draw(&self) -> (bool, bool) {
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        let duplicate = rng.random_bool(self.duplicate_rate);
        let lose_reply = rng.random_bool(self.lost_reply_rate);
        (duplicate, lose_reply)
    }
}

impl<D: Dispatch> Dispatch for FaultyDispatch<D> {
    async fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        envelope: Envelope,
        timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        let (duplicate, lose_reply) = self.draw();
        let reply = if duplicate {
            self.counts.duplicated.fetch_add(1, Ordering::Relaxed);
            let (first, second) = tokio::join!(
                self.inner
                    .dispatch(consumer_type, envelope.clone(), timeout),
                self.inner.dispatch(consumer_type, envelope, timeout),
            );
            self.counts.tally(&second);
            first
        } else {
            self.inner.dispatch(consumer_type, envelope, timeout).await
        };
        self.counts.tally(&reply);
        if lose_reply {
            self.counts.replies_dropped.fetch_add(1, Ordering::Relaxed);
            return Err(StepFailure::Timeout(timeout));
        }
        reply
    }
}
