//! Group commit of saga saves: the saves the drivers ask for while a batch is being
//! written go together into the next one, one transaction and one commit for all
//! ([`SagaStore::save_batch`], through a [`Gather`]).
//!
//! A save asked for while a writer is free goes at once, alone. A few writers take
//! turns, so that one slow commit does not hold every saga. A batch that fails is
//! written again one save at a time, so a save that cannot be written fails alone and
//! its driver retries it as it would any failed save.

use std::collections::HashMap;

use crate::gather::Gather;
use crate::saga::{SagaEvent, SagaInstance, SagaSave, SagaStore};

/// How many batches may be written at once.
const WRITERS: usize = 2;

/// The orchestrator's saves, written in batches when `max` is above 1.
#[derive(Debug, Clone)]
pub(super) struct Saves<St> {
    store: St,
    batches: Option<Gather<SagaSave, Result<SagaSave, sqlx::Error>>>,
}

impl<St: SagaStore> Saves<St> {
    /// Saves to `store` in batches of up to `max`; `max` 1 writes every save alone, in
    /// the caller's task.
    pub(super) fn new(store: St, max: usize) -> Self {
        let batches = (max > 1).then(|| {
            let store = store.clone();
            Gather::new(WRITERS, max, move |batch: Vec<SagaSave>| {
                let store = store.clone();
                async move { write(&store, batch).await }
            })
        });
        Self { store, batches }
    }

    /// [`SagaStore::save`] through the next batch: writes `instance`'s progress and
    /// `events` if the stored row is still at `instance.version` and bumps it; `false`
    /// when the row moved on.
    pub(super) async fn save(
        &self,
        instance: &mut SagaInstance,
        events: &[SagaEvent],
    ) -> Result<bool, sqlx::Error> {
        if let Some(batches) = &self.batches {
            let save = SagaSave::new(instance.clone(), events.to_vec());
            // No answer (a writer died with the batch): the save is written alone below.
            if let Some(saved) = batches.submit(save).await {
                let saved = saved?;
                if saved.written {
                    instance.version = saved.instance.version;
                }
                return Ok(saved.written);
            }
        }
        self.store.save(instance, events).await
    }
}

/// Writes `batch` in one transaction and answers each save, in order; if the transaction
/// fails, writes each save alone, so that only a save that cannot be written fails.
async fn write<St: SagaStore>(
    store: &St,
    mut batch: Vec<SagaSave>,
) -> Vec<Result<SagaSave, sqlx::Error>> {
    // The store writes a batch in the order of the saga ids: each answer goes back to
    // its save's place.
    let places: Vec<String> = batch.iter().map(|save| save.instance.id.clone()).collect();
    if batch.len() > 1 {
        match store.save_batch(&mut batch).await {
            Ok(()) => return in_places(&places, batch).into_iter().map(Ok).collect(),
            Err(error) => {
                tracing::warn!(%error, sagas = batch.len(), "a batch of saga saves failed; writing each alone");
            }
        }
    }
    let mut answers = Vec::with_capacity(places.len());
    for mut save in in_places(&places, batch) {
        let written = store.save(&mut save.instance, &save.events).await;
        answers.push(written.map(|written| SagaSave { written, ..save }));
    }
    answers
}

/// `saves` in the order of `places` (saga ids).
fn in_places(places: &[String], saves: Vec<SagaSave>) -> Vec<SagaSave> {
    let mut by_id: HashMap<String, SagaSave> = saves
        .into_iter()
        .map(|save| (save.instance.id.clone(), save))
        .collect();
    places.iter().filter_map(|id| by_id.remove(id)).collect()
}
