//! Tools for testing sagas: [`FaultyDispatch`] wraps the orchestrator's [`Dispatch`] to
//! duplicate commands and lose replies at seeded rates, so a test can prove that a
//! saga's participants apply each command once and that its compensations hold — the
//! faults an at-least-once broker produces, on demand and reproducibly.

use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::envelope::{ConsumerType, Envelope};
use crate::orchestrator::Dispatch;
use crate::step::{StepFailure, StepReply};

/// Fault injection around a [`Dispatch`]: duplicated commands and lost replies, at given
/// rates, from a seeded generator.
#[derive(Debug)]
pub struct FaultyDispatch<D> {
    inner: D,
    duplicate_rate: f64,
    lost_reply_rate: f64,
    rng: std::sync::Mutex<StdRng>,
}

impl<D: Dispatch> FaultyDispatch<D> {
    /// Wraps `inner`: each command is delivered twice, concurrently, with probability
    /// `duplicate_rate`; each reply is dropped after the step answered (the orchestrator
    /// sees a timeout) with probability `lost_reply_rate`. Rates are clamped to 0..=1.
    pub fn new(inner: D, duplicate_rate: f64, lost_reply_rate: f64, seed: u64) -> Self {
        Self {
            inner,
            duplicate_rate: clamp_rate(duplicate_rate),
            lost_reply_rate: clamp_rate(lost_reply_rate),
            rng: std::sync::Mutex::new(StdRng::seed_from_u64(seed)),
        }
    }

    fn roll(&self, rate: f64) -> bool {
        use rand::RngExt;
        let mut rng = self
            .rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        rng.random_bool(rate)
    }
}

fn clamp_rate(rate: f64) -> f64 {
    if rate.is_finite() {
        rate.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

impl<D: Dispatch> Dispatch for FaultyDispatch<D> {
    async fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        envelope: Envelope,
        timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        let duplicate = self.roll(self.duplicate_rate);
        let lose_reply = self.roll(self.lost_reply_rate);
        let reply = if duplicate {
            let (first, _second) = tokio::join!(
                self.inner
                    .dispatch(consumer_type, envelope.clone(), timeout),
                self.inner.dispatch(consumer_type, envelope, timeout),
            );
            first
        } else {
            self.inner.dispatch(consumer_type, envelope, timeout).await
        };
        if lose_reply {
            return Err(StepFailure::Timeout(timeout));
        }
        reply
    }
}
