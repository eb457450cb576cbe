//! [`Faults`]: what an at-least-once transport does to the orchestrator's commands,
//! injected around any [`Dispatch`] — a command delivered twice at once, a reply lost
//! after the step answered — at seeded rates, with counts of what reached the steps.
//!
//! It is a wrapper in the example, not a switch in the library: the library's
//! [`Dispatch`] trait is the seam.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sagabox::ConsumerType;
use sagabox::Envelope;
use sagabox::orchestrator::Dispatch;
use sagabox::step::{StepFailure, StepReply};

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

/// What reached the steps through a [`Faults`], counted per delivery (a duplicated
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
pub struct Faults<D> {
    inner: D,
    duplicate_rate: f64,
    lost_reply_rate: f64,
    rng: Mutex<StdRng>,
    counts: FaultCounts,
}

impl<D: Dispatch> Faults<D> {
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

impl<D: Dispatch> Dispatch for Faults<D> {
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
