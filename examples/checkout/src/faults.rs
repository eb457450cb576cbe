//! The checkout demo's control run: [`FreshIds`] sends every delivery of a command under
//! a new message id, so the inbox never recognises a repeat — what running the steps
//! without an inbox does to the business tables, with the participants unchanged.

use std::time::Duration;

use sagabox::envelope::{ConsumerType, Envelope, MessageId};
use sagabox::orchestrator::Dispatch;
use sagabox::step::{StepFailure, StepReply};

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
