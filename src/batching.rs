//! Two [`DeliveryHandler`]s that gather the deliveries a consumer holds at once (up to
//! its prefetch) into batches, so they can be claimed with one
//! [`InboxGuard::process_batch`](crate::InboxGuard::process_batch) and committed once:
//!
//! - [`Batching`]: the consumer runs up to `prefetch` deliveries concurrently; each
//!   one's `handle` call puts its envelope into the open batch and waits. The batch goes
//!   to the batch function when it holds `max` envelopes or `linger` after its first
//!   arrived, whichever is first, so several batches may run at once (and handlers that
//!   lock shared rows in different orders may deadlock across them).
//! - [`GroupCommit`]: one batch at a time. A delivery that arrives while no batch runs
//!   goes at once, alone; those that arrive while one runs go together in the next. No
//!   delivery waits for company, and two batches of one consumer never lock the same
//!   rows against each other.
//!
//! Either way each waiting delivery then gets its own [`Disposition`] and is settled on
//! its own (acked, requeued or dead-lettered), so one bad message does not hold the
//! others back.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::delivery::{DeliveryHandler, Disposition};
use crate::envelope::Envelope;
use crate::gather::Gather;

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

/// Runs the deliveries a consumer holds in batches, one batch at a time, for `batch`, a
/// function from envelopes to one [`Disposition`] each, in order (see the module docs).
#[derive(Debug)]
pub struct GroupCommit {
    gather: Gather<Envelope, Disposition>,
}

impl GroupCommit {
    /// Batches of at most `max` envelopes (at least 1), one at a time.
    pub fn new<F, Fut>(max: usize, batch: F) -> Self
    where
        F: Fn(Vec<Envelope>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Disposition>> + Send + 'static,
    {
        Self {
            gather: Gather::new(1, max, batch),
        }
    }
}

impl DeliveryHandler for GroupCommit {
    async fn handle(&self, mut envelope: Envelope) -> Disposition {
        // The batch runs in the lane's task: each envelope takes its own delivery's
        // trace context along now.
        crate::trace::inject_current(&mut envelope.headers);
        self.gather.submit(envelope).await.unwrap_or_else(|| {
            Disposition::Retry("the batch was dropped before it answered".into())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::MessageId;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    fn envelope(n: usize) -> Envelope {
        Envelope::new(MessageId::new_v7(), "do", serde_json::json!({ "n": n }))
            .expect("a valid envelope")
    }

    /// Twenty deliveries at once: the first goes alone, the rest queue behind it and go
    /// in batches of at most eight; never two batches at once; each delivery gets the
    /// answer to its own envelope.
    #[tokio::test]
    async fn group_commit_runs_one_batch_at_a_time_and_answers_each_delivery() {
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let handler = Arc::new(GroupCommit::new(8, {
            let (running, most, sizes) = (running.clone(), most.clone(), sizes.clone());
            move |batch: Vec<Envelope>| {
                let (running, most, sizes) = (running.clone(), most.clone(), sizes.clone());
                async move {
                    most.fetch_max(running.fetch_add(1, SeqCst) + 1, SeqCst);
                    sizes.lock().unwrap().push(batch.len());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    running.fetch_sub(1, SeqCst);
                    batch
                        .iter()
                        .map(|envelope| Disposition::Retry(envelope.payload["n"].to_string()))
                        .collect()
                }
            }
        }));
        let mut deliveries = tokio::task::JoinSet::new();
        for n in 0..20 {
            let handler = Arc::clone(&handler);
            deliveries.spawn(async move { (n, handler.handle(envelope(n)).await) });
            if n == 0 {
                // The first starts its batch before the others arrive.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        while let Some(delivery) = deliveries.join_next().await {
            let (n, disposition) = delivery.unwrap();
            assert!(
                matches!(&disposition, Disposition::Retry(answer) if *answer == n.to_string()),
                "{n}: {disposition:?}"
            );
        }
        let sizes = sizes.lock().unwrap().clone();
        assert_eq!(most.load(SeqCst), 1, "one batch at a time: {sizes:?}");
        assert_eq!(sizes.iter().sum::<usize>(), 20);
        assert_eq!(sizes[0], 1, "the first went alone: {sizes:?}");
        assert!(sizes.iter().all(|&size| size <= 8), "{sizes:?}");
        assert!(sizes.len() <= 4, "the rest went together: {sizes:?}");
    }
}
