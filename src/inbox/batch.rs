//! [`InboxGuard::process_batch`]: a batch of envelopes through the guard in one
//! transaction. On PostgreSQL a fresh batch whose handler records no result costs the
//! inbox one statement (the claim writes every row, as a single claim does); otherwise
//! a claim, a lookup of earlier deliveries and one statement recording the results.

use std::collections::HashMap;
use std::time::Instant;

use serde_json::Value;
use sqlx::Database;

use crate::envelope::{ConsumerType, Envelope};
use crate::inbox::{GuardError, InboxError, InboxGuard, Outcome};
use crate::metrics::{self, MessageOutcome};
use crate::store::{ClaimKey, Claimed, InboxStore};

/// The most envelopes [`InboxGuard::process_batch`] takes at once. A batch holds the locks
/// of all its keys until it commits; bigger batches only make racing deliveries wait
/// longer.
pub const MAX_BATCH: usize = 10_000;

/// What a batch entry turned into before the claim.
enum Slot<'a> {
    /// Refused before the claim (expired, in the future, pruned month).
    Refused(InboxError),
    /// Claimed as `keys[index]`.
    Claimed(usize),
    /// The same message id as an earlier entry of the batch (`keys[index]`).
    Repeat(usize),
    /// Placeholder while the claim key is borrowed.
    Pending(ClaimKey<'a>),
}

impl<S: InboxStore> InboxGuard<S> {
    /// Runs `handler` for each envelope of a batch at most once per `consumer_type`, in
    /// one transaction — what a broker consumer with a prefetch above one, or a
    /// partition poll, delivers. Returns one result per envelope, in input order.
    ///
    /// The contract of [`process`](Self::process), per envelope: an envelope already
    /// recorded gets [`Outcome::Duplicate`] with its first result and its handler does not
    /// run; an envelope that repeats an earlier one of the same batch is a duplicate of it
    /// (with its result); the others run `handler` in order, with the batch's
    /// transaction, and are recorded with their results in one statement before the one
    /// commit. A racing delivery of any key waits for the batch to end, and a batch waits
    /// for racing deliveries of its keys; overlapping batches do not deadlock.
    ///
    /// An envelope the inbox refuses (expired, published in the future, its month
    /// pruned) gets its [`InboxError`] in its slot and takes no part; the rest go on.
    ///
    /// A handler error rolls back the **whole batch** — no inbox row, no side effect of
    /// any envelope — and is returned as [`GuardError::Handler`]; so is any database
    /// failure, as [`GuardError::Inbox`]. To isolate a poison message, deliver the
    /// batch's envelopes one by one with [`process`](Self::process). Acknowledge the
    /// batch to its source only after `Ok`.
    ///
    /// `handler` is cloned for each envelope (capture references or `Arc`s). Handlers
    /// take their row locks in input order and hold them until the batch commits:
    /// batches that run concurrently and touch shared rows should present them in one
    /// order, or the database aborts one of them as deadlocked (a retryable
    /// [`InboxError::Database`]).
    ///
    /// Refuses a batch of more than [`MAX_BATCH`] envelopes with
    /// [`InboxError::BatchTooLarge`]. An empty batch does nothing.
    pub async fn process_batch<F, E>(
        &self,
        consumer_type: &ConsumerType,
        envelopes: &[Envelope],
        handler: F,
    ) -> Result<Vec<Result<Outcome, InboxError>>, GuardError<E>>
    where
        F: AsyncFnOnce(&mut <S::Db as Database>::Connection, &Envelope) -> Result<Value, E> + Clone,
    {
        self.process_batch_set(consumer_type, envelopes, async move |conn, fresh| {
            let mut results = Vec::with_capacity(fresh.len());
            for envelope in fresh {
                results.push(handler.clone()(&mut *conn, envelope).await?);
            }
            Ok(results)
        })
        .await
    }

    /// [`process_batch`](Self::process_batch) with a set-based handler: `handler` gets
    /// the batch's fresh envelopes (neither recorded before nor repeated in the batch)
    /// all at once, in input order, and returns one result per envelope, in the same
    /// order — so it can apply them with a few set-based statements (`UPDATE … FROM
    /// unnest(…)`) instead of a few per envelope. Everything else is as in
    /// `process_batch`; a handler that returns a different number of results than it got
    /// envelopes fails the batch with [`InboxError::BatchResultCount`] (rolled back).
    pub async fn process_batch_set<F, E>(
        &self,
        consumer_type: &ConsumerType,
        envelopes: &[Envelope],
        handler: F,
    ) -> Result<Vec<Result<Outcome, InboxError>>, GuardError<E>>
    where
        F: AsyncFnOnce(&mut <S::Db as Database>::Connection, &[&Envelope]) -> Result<Vec<Value>, E>,
    {
        let result = self
            .process_batch_inner(consumer_type, envelopes, handler)
            .await
            .map_err(|error| self.sized(error));
        match &result {
            Ok(outcomes) => {
                for outcome in outcomes {
                    let label = outcome
                        .as_ref()
                        .map_or(MessageOutcome::Failed, Outcome::metric);
                    metrics::inbox_message(consumer_type, label);
                }
            }
            Err(_) => {
                for _ in envelopes {
                    metrics::inbox_message(consumer_type, MessageOutcome::Failed);
                }
            }
        }
        result
    }

    async fn process_batch_inner<F, E>(
        &self,
        consumer_type: &ConsumerType,
        envelopes: &[Envelope],
        handler: F,
    ) -> Result<Vec<Result<Outcome, InboxError>>, GuardError<E>>
    where
        F: AsyncFnOnce(&mut <S::Db as Database>::Connection, &[&Envelope]) -> Result<Vec<Value>, E>,
    {
        if envelopes.len() > MAX_BATCH {
            return Err(InboxError::BatchTooLarge {
                len: envelopes.len(),
                max: MAX_BATCH,
            }
            .into());
        }
        if envelopes.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.now();
        let mut slots = self.place(consumer_type, envelopes, now).await?;
        let (keys, envelope_of) = first_of_each(&mut slots, envelopes);

        // As for a single claim: a handler that records no result lets the claim write
        // the fresh keys' rows in its own statement.
        let write_rows_at = (!self.records_results(consumer_type)).then_some(now);
        let claim_started = Instant::now();
        let (mut tx, claims) = self.claim_batch(&keys, write_rows_at).await?;
        metrics::claim_duration(consumer_type, claim_started.elapsed());

        // Per claimed key: its first delivery, or None while it waits for its result.
        let mut claimed: Vec<Option<Outcome>> = Vec::with_capacity(keys.len());
        let mut fresh = Vec::new();
        let mut fresh_envelopes = Vec::new();
        let mut counted_duplicates = false;
        for (i, claim) in claims.into_iter().enumerate() {
            match claim {
                Claimed::Duplicate { first, counted } => {
                    // Counted on the first delivery's row, as a single duplicate is, for
                    // `sagabox inspect`; in this transaction, which holds the key.
                    if !counted {
                        self.store()
                            .record_duplicate(&mut tx, &keys[i], &first, now)
                            .await?;
                    }
                    counted_duplicates = true;
                    claimed.push(Some(Outcome::Duplicate {
                        first_processed_at: first.processed_at,
                        result: first.result,
                    }));
                }
                Claimed::Fresh { row_written } => {
                    claimed.push(None);
                    fresh.push((keys[i], row_written));
                    fresh_envelopes.push(envelope_of[i]);
                }
            }
        }
        let results = if fresh_envelopes.is_empty() {
            Vec::new()
        } else {
            match handler(&mut *tx, &fresh_envelopes).await {
                Ok(results) if results.len() == fresh_envelopes.len() => results,
                Ok(results) => {
                    tx.rollback().await.ok();
                    return Err(InboxError::BatchResultCount {
                        expected: fresh_envelopes.len(),
                        returned: results.len(),
                    }
                    .into());
                }
                Err(error) => {
                    if let Err(rollback) = tx.rollback().await {
                        // The connection is discarded by the pool; the database rolls back.
                        tracing::warn!(%rollback, "rollback after handler error failed");
                    }
                    return Err(GuardError::Handler(error));
                }
            }
        };

        if !fresh.is_empty() {
            self.learn_records_results(
                consumer_type,
                results.iter().any(|result| !result.is_null()),
            );
            if let Err(error) = self
                .record_fresh(&mut tx, consumer_type, &fresh, &results, now)
                .await
            {
                tx.rollback().await.ok();
                if let InboxError::Database(error) = &error
                    && S::is_missing_partition(error)
                {
                    // A month dropped under us: nothing of ours commits.
                    for (key, _) in &fresh {
                        self.forget_partition(key.bucket);
                    }
                }
                return Err(error.into());
            }
            tx.commit().await?;
        } else if counted_duplicates {
            // Nothing applied; only the duplicate counts to keep.
            tx.commit().await?;
        } else {
            tx.rollback().await?;
        }
        Ok(answers(slots, claimed, results, now))
    }

    /// Each envelope's slot: its claim key, its month's partition made sure of, or the
    /// reason it is refused before the claim (expired, in the future, pruned month).
    async fn place<'a>(
        &self,
        consumer_type: &'a ConsumerType,
        envelopes: &'a [Envelope],
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<Vec<Slot<'a>>, InboxError> {
        let mut slots: Vec<Slot<'a>> = envelopes
            .iter()
            .map(
                |envelope| match self.placement(consumer_type, envelope, now) {
                    Ok(key) => Slot::Pending(key),
                    Err(refused) => Slot::Refused(refused),
                },
            )
            .collect();
        for slot in &mut slots {
            let Slot::Pending(key) = slot else {
                continue;
            };
            match self.ensure_partition(key.bucket).await {
                Ok(()) => {}
                Err(refused @ InboxError::PartitionPruned(_)) => *slot = Slot::Refused(refused),
                Err(error) => return Err(error),
            }
        }
        Ok(slots)
    }

    /// Claims `keys` in one transaction. A month dropped by a pruner since it was cached
    /// is asked for again (a pruned month is refused, never recreated) and the claim
    /// made once more.
    async fn claim_batch(
        &self,
        keys: &[ClaimKey<'_>],
        write_rows_at: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<crate::store::BatchClaim<S::Db>, InboxError> {
        match self.store().begin_batch_claim(keys, write_rows_at).await {
            Err(error) if S::is_missing_partition(&error) => {
                for key in keys {
                    self.forget_partition(key.bucket);
                    self.ensure_partition(key.bucket).await?;
                }
                Ok(self.store().begin_batch_claim(keys, write_rows_at).await?)
            }
            claimed => Ok(claimed?),
        }
    }

    /// Records the handler's results of a batch's fresh keys (`results[i]` for
    /// `fresh[i]`, with whether the claim wrote its row): non-null results onto the rows
    /// the claim wrote, in one statement; the other rows inserted with theirs, in one. Fails with
    /// [`InboxError::BatchRaced`] when a row was not where the claim left it.
    async fn record_fresh(
        &self,
        tx: &mut sqlx::Transaction<'static, S::Db>,
        consumer_type: &ConsumerType,
        fresh: &[(ClaimKey<'_>, bool)],
        results: &[Value],
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), InboxError> {
        let mut to_update = (Vec::new(), Vec::new());
        let mut to_insert = (Vec::new(), Vec::new());
        for ((key, row_written), result) in fresh.iter().zip(results) {
            if !row_written {
                to_insert.0.push(*key);
                to_insert.1.push(result);
            } else if !result.is_null() {
                to_update.0.push(*key);
                to_update.1.push(result);
            }
        }
        let raced = || InboxError::BatchRaced {
            consumer_type: consumer_type.clone(),
        };
        if !to_update.0.is_empty() {
            let updated = self
                .store()
                .record_batch_results(tx, &to_update.0, &to_update.1)
                .await?;
            if updated != to_update.0.len() as u64 {
                return Err(raced());
            }
        }
        if !to_insert.0.is_empty() {
            // Fewer rows than keys: a key was recorded meanwhile. Cannot happen while
            // every claim path takes the key's lock before it records; if it does,
            // applying nothing is the safe answer.
            let recorded = self
                .store()
                .record_batch(tx, &to_insert.0, now, &to_insert.1)
                .await?;
            if recorded != to_insert.0.len() as u64 {
                return Err(raced());
            }
        }
        Ok(())
    }
}

/// One key per message id: the first entry of an id becomes `Claimed` (its key and
/// envelope returned, in order), a later one a `Repeat` of it.
fn first_of_each<'a>(
    slots: &mut [Slot<'a>],
    envelopes: &'a [Envelope],
) -> (Vec<ClaimKey<'a>>, Vec<&'a Envelope>) {
    let mut keys: Vec<ClaimKey<'a>> = Vec::new();
    let mut envelope_of: Vec<&'a Envelope> = Vec::new();
    let mut index_of: HashMap<&str, usize> = HashMap::new();
    for (slot, envelope) in slots.iter_mut().zip(envelopes) {
        if let Slot::Pending(key) = *slot {
            *slot = match index_of.get(key.message_id.as_str()) {
                Some(&index) => Slot::Repeat(index),
                None => {
                    index_of.insert(key.message_id.as_str(), keys.len());
                    keys.push(key);
                    envelope_of.push(envelope);
                    Slot::Claimed(keys.len() - 1)
                }
            };
        }
    }
    (keys, envelope_of)
}

/// Each envelope's answer, in input order: a refusal, its claim's outcome (`claimed`,
/// with the handler's `results` in order for the fresh ones), or for a repeat within the
/// batch a duplicate of its first entry.
fn answers(
    slots: Vec<Slot<'_>>,
    claimed: Vec<Option<Outcome>>,
    results: Vec<Value>,
    now: chrono::DateTime<chrono::Utc>,
) -> Vec<Result<Outcome, InboxError>> {
    let mut results = results.into_iter();
    let claimed: Vec<Outcome> = claimed
        .into_iter()
        .map(|first| match first {
            Some(duplicate) => duplicate,
            // One result per fresh key, in order: checked by the caller.
            None => Outcome::Applied(results.next().unwrap_or_default()),
        })
        .collect();
    slots
        .into_iter()
        .map(|slot| match slot {
            Slot::Refused(refused) => Err(refused),
            Slot::Claimed(index) => Ok(claimed[index].clone()),
            Slot::Repeat(index) => Ok(match &claimed[index] {
                Outcome::Applied(result) => Outcome::Duplicate {
                    first_processed_at: now,
                    result: result.clone(),
                },
                duplicate => duplicate.clone(),
            }),
            Slot::Pending(_) => unreachable!("every pending slot was claimed or repeated"),
        })
        .collect()
}
