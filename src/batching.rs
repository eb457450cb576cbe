//! [`Batching`]: a [`DeliveryHandler`] that gathers the deliveries a consumer holds at
//! once (up to its prefetch) into batches, so they can be claimed with one
//! [`InboxGuard::process_batch`](crate::InboxGuard::process_batch) and committed once.
//!
//! The consumer runs up to `prefetch` deliveries concurrently; each one's `handle` call
//! puts its envelope into the open batch and waits. The batch goes to the batch function
//! when it holds `max` envelopes or `linger` after its first arrived, whichever is first;
//! each waiting delivery then gets its own [`Disposition`] and is settled on its own
//! (acked, requeued or dead-lettered), so one bad message does not hold the others back.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::delivery::{DeliveryHandler, Disposition};
use crate::envelope::Envelope;

type Waiting = Vec<(Envelope, oneshot::Sender<Disposition>)>;

/// Gathers deliveries into batches for `batch`, a function from envelopes to one
/// [`Disposition`] each, in order.
#[derive(Debug)]
pub struct Batching<F> {
    shared: Arc<Shared<F>>,
}

#[derive(Debug)]
struct Shared<F> {
    batch: F,
    max: usize,
    linger: Duration,
    open: Mutex<Waiting>,
}

impl<F, Fut> Batching<F>
where
    F: Fn(Vec<Envelope>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<Disposition>> + Send,
{
    /// Batches of at most `max` envelopes (at least 1), sent on when full or `linger`
    /// after their first envelope arrived. Give the consumer a prefetch of at least
    /// `max`, or batches only ever close by `linger`.
    pub fn new(max: usize, linger: Duration, batch: F) -> Self {
        Self {
            shared: Arc::new(Shared {
                batch,
                max: max.max(1),
                linger,
                open: Mutex::new(Vec::new()),
            }),
        }
    }
}

impl<F, Fut> Shared<F>
where
    F: Fn(Vec<Envelope>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<Disposition>> + Send,
{
    fn take(&self) -> Waiting {
        std::mem::take(&mut *self.open.lock().unwrap_or_else(PoisonError::into_inner))
    }

    async fn run(&self, waiting: Waiting) {
        if waiting.is_empty() {
            return;
        }
        let (envelopes, replies): (Vec<Envelope>, Vec<_>) = waiting.into_iter().unzip();
        let count = envelopes.len();
        let dispositions = (self.batch)(envelopes).await;
        if dispositions.len() != count {
            for reply in replies {
                let _ = reply.send(Disposition::Retry(format!(
                    "the batch handler answered {} of {count} messages",
                    dispositions.len()
                )));
            }
            return;
        }
        for (reply, disposition) in replies.into_iter().zip(dispositions) {
            let _ = reply.send(disposition);
        }
    }
}

impl<F, Fut> DeliveryHandler for Batching<F>
where
    F: Fn(Vec<Envelope>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<Disposition>> + Send + 'static,
{
    async fn handle(&self, mut envelope: Envelope) -> Disposition {
        // The batch runs in another delivery's task, or a task of its own: each envelope
        // takes its own delivery's trace context along now.
        crate::trace::inject_current(&mut envelope.headers);
        let (reply, answer) = oneshot::channel();
        let (full, first) = {
            let mut open = self
                .shared
                .open
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            open.push((envelope, reply));
            if open.len() >= self.shared.max {
                (Some(std::mem::take(&mut *open)), false)
            } else {
                (None, open.len() == 1)
            }
        };
        if let Some(full) = full {
            self.shared.run(full).await;
        } else if first {
            // The first of a new batch closes it after `linger`, if it is not full by
            // then. A batch closed early this way is only smaller.
            let shared = Arc::clone(&self.shared);
            tokio::spawn(async move {
                tokio::time::sleep(shared.linger).await;
                let waiting = shared.take();
                shared.run(waiting).await;
            });
        }
        answer.await.unwrap_or_else(|_| {
            Disposition::Retry("the batch was dropped before it answered".into())
        })
    }
}
