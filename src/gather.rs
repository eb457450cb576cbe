//! [`Gather`]: group commit for any operation that can run many items at once (saga
//! saves in one transaction, step commands claimed together, or an application's own
//! writes: orders placed with their sagas, many per transaction).
//!
//! Items submitted while every lane is busy queue up; a lane that comes free takes the
//! first item waiting and every one queued behind it, up to `max`, runs them as one
//! batch and answers each. An item submitted while a lane is free goes at once, alone:
//! nothing waits for company, and batches form only when items arrive faster than
//! batches end — which is when sharing a commit is worth the most.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::task::JoinHandle;

/// An item waiting for its batch, and where its answer goes.
type Waiting<T, R> = (T, oneshot::Sender<R>);

/// A group-commit queue of items `T` answered with `R`, run by a few lane tasks that end
/// when the last clone is dropped.
#[derive(Debug)]
pub struct Gather<T, R> {
    queue: mpsc::UnboundedSender<Waiting<T, R>>,
    _lanes: Arc<Lanes>,
}

impl<T, R> Clone for Gather<T, R> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            _lanes: Arc::clone(&self._lanes),
        }
    }
}

/// The lane tasks, aborted when dropped.
#[derive(Debug)]
struct Lanes(Vec<JoinHandle<()>>);

impl Drop for Lanes {
    fn drop(&mut self) {
        for lane in &self.0 {
            lane.abort();
        }
    }
}

impl<T: Send + 'static, R: Send + 'static> Gather<T, R> {
    /// `lanes` tasks (at least one) running batches of up to `max` items (at least one)
    /// through `run`, which answers each item of its batch, in order. Call it inside a
    /// Tokio runtime: the lanes are tasks spawned on it.
    pub fn new<F, Fut>(lanes: usize, max: usize, run: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<R>> + Send + 'static,
    {
        let (queue, receiver) = mpsc::unbounded_channel();
        let receiver = Arc::new(Mutex::new(receiver));
        let run = Arc::new(run);
        let lanes = (0..lanes.max(1))
            .map(|_| {
                let (receiver, run) = (Arc::clone(&receiver), Arc::clone(&run));
                tokio::spawn(lane(receiver, max.max(1), run))
            })
            .collect();
        Self {
            queue,
            _lanes: Arc::new(Lanes(lanes)),
        }
    }

    /// Stops taking items and waits until the lanes have answered every item queued and
    /// ended, dropping what `run` holds. With other clones alive the lanes go on; they
    /// end with the last one.
    pub async fn close(self) {
        let Self { queue, _lanes } = self;
        drop(queue);
        if let Ok(mut lanes) = Arc::try_unwrap(_lanes) {
            for lane in std::mem::take(&mut lanes.0) {
                let _ = lane.await;
            }
        }
    }

    /// Runs `item` in the next batch and returns its answer; `None` when no answer came
    /// (the lane running it died, or `run` answered fewer items than it was given).
    pub async fn submit(&self, item: T) -> Option<R> {
        let (answer, answered) = oneshot::channel();
        self.queue.send((item, answer)).ok()?;
        answered.await.ok()
    }
}

/// One lane: takes the first item waiting and every other one queued behind it (up to
/// `max`), runs them, answers each, until the queue closes.
async fn lane<T, R, F, Fut>(
    receiver: Arc<Mutex<mpsc::UnboundedReceiver<Waiting<T, R>>>>,
    max: usize,
    run: Arc<F>,
) where
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = Vec<R>>,
{
    loop {
        let batch = {
            let mut receiver = receiver.lock().await;
            let Some(first) = receiver.recv().await else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < max {
                match receiver.try_recv() {
                    Ok(waiting) => batch.push(waiting),
                    Err(_) => break,
                }
            }
            batch
        };
        let (items, answers): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
        for (answer, result) in answers.into_iter().zip(run(items).await) {
            let _ = answer.send(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn items_that_queue_behind_a_busy_lane_share_its_next_batch_and_each_gets_its_answer() {
        let batches = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&batches);
        let gather = Gather::new(1, 64, move |items: Vec<u32>| {
            counted.fetch_add(1, SeqCst);
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                items.into_iter().map(|item| item * 2).collect::<Vec<_>>()
            }
        });
        let mut submitted = tokio::task::JoinSet::new();
        for item in 0..100u32 {
            let gather = gather.clone();
            submitted.spawn(async move { (item, gather.submit(item).await) });
        }
        while let Some(joined) = submitted.join_next().await {
            let (item, answer) = joined.unwrap();
            assert_eq!(answer, Some(item * 2));
        }
        let batches = batches.load(SeqCst);
        assert!(
            (2..=10).contains(&batches),
            "100 items in {batches} batches"
        );
    }

    #[tokio::test]
    async fn an_item_alone_goes_at_once_and_a_short_answer_leaves_the_rest_without_one() {
        let gather = Gather::new(2, 8, |items: Vec<u32>| async move {
            items
                .into_iter()
                .filter(|item| *item != 7)
                .collect::<Vec<_>>()
        });
        assert_eq!(gather.submit(3).await, Some(3));
        assert_eq!(gather.submit(7).await, None);
    }

    #[tokio::test]
    async fn dropping_the_last_clone_ends_the_lanes() {
        let gather = Gather::new(2, 8, |items: Vec<u32>| async move { items });
        let lanes = Arc::downgrade(&gather._lanes);
        let clone = gather.clone();
        drop(gather);
        assert_eq!(clone.submit(1).await, Some(1));
        drop(clone);
        assert!(lanes.upgrade().is_none());
    }
}
