//! Group commit of saga saves: the saves that the drivers ask for while a batch is being
//! written go together into the next one, one transaction and one commit for all
//! ([`SagaStore::save_batch`]).
//!
//! No save waits for company: a save asked for when a writer is free goes at once, alone;
//! batches form only when saves arrive faster than commits end, which is when a commit
//! saved is worth the most. A few writers take turns, so that one slow commit does not
//! hold every saga. A batch that fails is written again one save at a time, so a save
//! that cannot be written fails alone, and its driver retries it as it would any failed
//! save.

use std::sync::Arc;

use tokio::sync::{Mutex, mpsc, oneshot};

use super::AbortOnDrop;
use crate::saga::{SagaEvent, SagaInstance, SagaSave, SagaStore};

/// How many batches may be written at once.
const WRITERS: usize = 2;

/// A save waiting for its batch, and where its outcome goes.
struct Pending {
    save: SagaSave,
    done: oneshot::Sender<Result<SagaSave, sqlx::Error>>,
}

/// The orchestrator's saves, written in batches of up to `max` by a few writer tasks,
/// which end when this is dropped.
#[derive(Debug)]
pub(super) struct Saves<St> {
    store: St,
    queue: Option<mpsc::UnboundedSender<Pending>>,
    _writers: Vec<AbortOnDrop>,
}

impl<St> Clone for Saves<St>
where
    St: Clone,
{
    fn clone(&self) -> Self {
        // A clone shares the queue, not the writers: only the orchestrator's own copy
        // ends them.
        Self {
            store: self.store.clone(),
            queue: self.queue.clone(),
            _writers: Vec::new(),
        }
    }
}

impl<St: SagaStore> Saves<St> {
    /// Saves to `store` in batches of up to `max`; `max` 1 writes every save alone, in
    /// the caller's task.
    pub(super) fn new(store: St, max: usize) -> Self {
        if max <= 1 {
            return Self {
                store,
                queue: None,
                _writers: Vec::new(),
            };
        }
        let (queue, receiver) = mpsc::unbounded_channel();
        let receiver = Arc::new(Mutex::new(receiver));
        let writers = (0..WRITERS)
            .map(|_| {
                let (store, receiver) = (store.clone(), Arc::clone(&receiver));
                AbortOnDrop(tokio::spawn(write_batches(store, receiver, max)).abort_handle())
            })
            .collect();
        Self {
            store,
            queue: Some(queue),
            _writers: writers,
        }
    }

    /// [`SagaStore::save`] through the next batch: writes `instance`'s progress and
    /// `events` if the stored row is still at `instance.version` and bumps it; `false`
    /// when the row moved on.
    pub(super) async fn save(
        &self,
        instance: &mut SagaInstance,
        events: &[SagaEvent],
    ) -> Result<bool, sqlx::Error> {
        if let Some(queue) = &self.queue {
            let (done, outcome) = oneshot::channel();
            let save = SagaSave::new(instance.clone(), events.to_vec());
            if queue.send(Pending { save, done }).is_ok() {
                // A writer that dies drops its batch's senders: save alone then.
                if let Ok(outcome) = outcome.await {
                    let saved = outcome?;
                    if saved.written {
                        instance.version = saved.instance.version;
                    }
                    return Ok(saved.written);
                }
            }
        }
        self.store.save(instance, events).await
    }
}

/// One writer: takes the first save waiting and every other one queued behind it (up to
/// `max`), writes them in one transaction, answers each, and goes on until the queue
/// closes.
async fn write_batches<St: SagaStore>(
    store: St,
    receiver: Arc<Mutex<mpsc::UnboundedReceiver<Pending>>>,
    max: usize,
) {
    loop {
        let batch = {
            let mut receiver = receiver.lock().await;
            let Some(first) = receiver.recv().await else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < max {
                match receiver.try_recv() {
                    Ok(pending) => batch.push(pending),
                    Err(_) => break,
                }
            }
            batch
        };
        write(&store, batch).await;
    }
}

/// Writes `batch` in one transaction and answers each save; if the transaction fails,
/// writes each save alone, so that only a save that cannot be written fails.
async fn write<St: SagaStore>(store: &St, mut batch: Vec<Pending>) {
    // In the order the store writes them (by saga id), so each answer stays with its save.
    batch.sort_by(|a, b| a.save.instance.id.cmp(&b.save.instance.id));
    let (mut saves, answers): (Vec<SagaSave>, Vec<_>) = batch
        .into_iter()
        .map(|pending| (pending.save, pending.done))
        .unzip();
    if saves.len() > 1 {
        match store.save_batch(&mut saves).await {
            Ok(()) => {
                for (save, done) in saves.into_iter().zip(answers) {
                    let _ = done.send(Ok(save));
                }
                return;
            }
            Err(error) => {
                tracing::warn!(%error, sagas = saves.len(), "a batch of saga saves failed; writing each alone");
            }
        }
    }
    for (mut save, done) in saves.into_iter().zip(answers) {
        let written = store.save(&mut save.instance, &save.events).await;
        let _ = done.send(written.map(|written| SagaSave { written, ..save }));
    }
}
