//! The demo's fault injection around unchanged participants:
//!
//! - [`FailAfterWrite`] wraps a step handler so that a share of its runs fail after the
//!   handler wrote, before the guard commits: the write rolls back and the command is
//!   sent again.
//! - [`FreshIds`] is the control run: it sends every delivery of a command under a new
//!   message id, so the inbox never recognises a repeat — what running the steps
//!   without an inbox does to the business tables.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sagabox::envelope::{ConsumerType, Envelope, MessageId};
use sagabox::orchestrator::Dispatch;
use sagabox::step::{StepError, StepFailure, StepHandler, StepReply};
use serde_json::Value;

/// A step handler whose successful runs fail, at `fail_rate`, after the write and before
/// the commit (seeded: the same seed fails the same runs in the same order).
#[derive(Debug, Clone)]
pub struct FailAfterWrite<H> {
    inner: H,
    fail_rate: f64,
    rng: Arc<Mutex<StdRng>>,
}

impl<H> FailAfterWrite<H> {
    /// Wraps `inner`; `fail_rate` is clamped to 0..=1 (0: never fails).
    pub fn new(inner: H, fail_rate: f64, seed: u64) -> Self {
        Self {
            inner,
            fail_rate: fail_rate.clamp(0.0, 1.0),
            rng: Arc::new(Mutex::new(StdRng::seed_from_u64(seed))),
        }
    }

    fn fails(&self) -> bool {
        self.rng
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .random_bool(self.fail_rate)
    }
}

impl<Db: sqlx::Database, H: StepHandler<Db>> StepHandler<Db> for FailAfterWrite<H> {
    async fn handle(
        &self,
        conn: &mut Db::Connection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let result = self.inner.handle(conn, envelope).await?;
        if self.fails() {
            return Err(StepError::Retryable(INJECTED.into()));
        }
        Ok(result)
    }

    /// The inner handler's batch, each applied command of it failing at `fail_rate`
    /// after the batch's writes: one failure rolls the whole batch back.
    async fn handle_batch(
        &self,
        conn: &mut Db::Connection,
        envelopes: &[&Envelope],
    ) -> Option<Vec<Result<Value, StepError>>> {
        let answers = self.inner.handle_batch(conn, envelopes).await?;
        Some(
            answers
                .into_iter()
                .map(|answer| match answer {
                    Ok(_) if self.fails() => Err(StepError::Retryable(INJECTED.into())),
                    answer => answer,
                })
                .collect(),
        )
    }
}

/// The reason of an injected failure.
const INJECTED: &str = "injected failure after the write, before commit";

/// A [`Dispatch`] that gives each envelope it passes on a fresh UUIDv7 id when `on`.
#[derive(Debug)]
pub struct FreshIds<D> {
    inner: D,
    on: bool,
}

impl<D: Dispatch> FreshIds<D> {
    /// Wraps `inner`; with `on` false it passes envelopes through unchanged.
    pub fn new(inner: D, on: bool) -> Self {
        Self { inner, on }
    }
}

impl<D: Dispatch> Dispatch for FreshIds<D> {
    async fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        mut envelope: Envelope,
        timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        if self.on {
            envelope.id = MessageId::new_v7();
        }
        self.inner.dispatch(consumer_type, envelope, timeout).await
    }
}
