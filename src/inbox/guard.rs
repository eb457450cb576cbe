//! [`InboxGuard`]: begin → claim → handler → record result → commit, as one call.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use chrono::{DateTime, TimeDelta, Utc};
use serde_json::Value;
use sqlx::Database;
use tracing::Instrument;

use crate::clock::{Clock, SystemClock};
use crate::envelope::{ConsumerType, Envelope};
use crate::inbox::{ConfigError, GuardError, InboxConfig, InboxError, Outcome};
use crate::metrics::{self, MessageOutcome};
use crate::month::Month;
use crate::store::{ClaimKey, Claimed, FirstDelivery, InboxStore, PartitionCreation};

/// The dedup gate every consumed message passes.
///
/// [`process`](Self::process) runs the caller's handler inside the transaction that
/// claimed the message, records the handler's result in the same row, and commits once.
/// A redelivery gets [`Outcome::Duplicate`] with the first delivery's result and applies
/// nothing. The guard is cheap to clone and safe to share between tasks.
#[derive(Debug)]
pub struct InboxGuard<S> {
    store: Arc<S>,
    config: InboxConfig,
    clock: Arc<dyn Clock>,
    /// Months known to have a partition, so the hot path does no DDL lookups.
    known_partitions: Arc<Mutex<BTreeSet<Month>>>,
    /// Per consumer type, whether its handler's last result was non-null: decides
    /// whether a claim writes the inbox row up front (see `process_inner`).
    records_results: Arc<Mutex<HashMap<ConsumerType, bool>>>,
}

impl<S> Clone for InboxGuard<S> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            config: self.config.clone(),
            clock: Arc::clone(&self.clock),
            known_partitions: Arc::clone(&self.known_partitions),
            records_results: Arc::clone(&self.records_results),
        }
    }
}

impl<S: InboxStore> InboxGuard<S> {
    /// A guard over `store`, refusing an unsafe `config` (a TTL shorter than the broker's
    /// redelivery window).
    ///
    /// A TTL shorter than the retention is accepted only when the configuration says so
    /// explicitly ([`InboxConfig::allow_ttl_below_retention`]), and then logged as a
    /// warning.
    pub fn new(store: S, config: InboxConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        if config.ttl_below_retention() {
            tracing::warn!(
                ttl_days = config.ttl.as_secs_f64() / 86_400.0,
                broker_retention_days = config.broker_retention.as_secs_f64() / 86_400.0,
                "inbox ttl is shorter than the broker retention, forced: a redelivery later than the \
                 ttl is refused as expired, or applied a second time if the message carries no time"
            );
        }
        Ok(Self {
            store: Arc::new(store),
            config,
            clock: Arc::new(SystemClock),
            known_partitions: Arc::default(),
            records_results: Arc::default(),
        })
    }

    /// Uses `clock` for processing times, expiry and pruning instead of the system clock.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The store underneath.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The configuration in force.
    pub fn config(&self) -> &InboxConfig {
        &self.config
    }

    /// The guard's current time.
    pub fn now(&self) -> DateTime<Utc> {
        self.clock.now()
    }

    /// Runs `handler` for `envelope` at most once per `consumer_type`.
    ///
    /// In one transaction: claim `(consumer_type, envelope.id)`; if a delivery was already
    /// recorded, return [`Outcome::Duplicate`] with its result (the handler does not
    /// run); otherwise run `handler` with the transaction, record its result in the inbox
    /// row and commit. A racing delivery of the same key waits for this one to
    /// end, then sees its result.
    ///
    /// A handler error rolls everything back (no inbox row, no side effect) and is
    /// returned as [`GuardError::Handler`]; so is any database failure, as
    /// [`GuardError::Inbox`]. Acknowledge the message to its source only after `Ok`.
    ///
    /// Refuses, without running the handler, a message filed further back than the TTL
    /// ([`InboxError::Expired`]) or further ahead than the allowed clock skew
    /// ([`InboxError::PublishedInFuture`]).
    pub async fn process<F, E>(
        &self,
        consumer_type: &ConsumerType,
        envelope: &Envelope,
        handler: F,
    ) -> Result<Outcome, GuardError<E>>
    where
        F: AsyncFnOnce(&mut <S::Db as Database>::Connection, &Envelope) -> Result<Value, E>,
    {
        let span = tracing::debug_span!(
            "inbox.process",
            consumer_type = %consumer_type,
            message_id = %envelope.id,
            saga_id = envelope.saga_id.as_deref(),
            outcome = tracing::field::Empty,
        );
        let result = self
            .process_inner(consumer_type, envelope, handler)
            .instrument(span.clone())
            .await
            .map_err(|error| self.sized(error));
        let label = match &result {
            Ok(outcome) => outcome.metric(),
            Err(_) => MessageOutcome::Failed,
        };
        span.record("outcome", label.as_str());
        metrics::inbox_message(consumer_type, label);
        result
    }

    /// `error` with the pool's size, when it is a pool timeout: the error then says how
    /// many connections were all busy.
    pub(crate) fn sized<E>(&self, error: GuardError<E>) -> GuardError<E> {
        match error {
            GuardError::Inbox(InboxError::PoolTimedOut { size: None }) => {
                GuardError::Inbox(InboxError::PoolTimedOut {
                    size: self.store.pool_size(),
                })
            }
            other => other,
        }
    }

    async fn process_inner<F, E>(
        &self,
        consumer_type: &ConsumerType,
        envelope: &Envelope,
        handler: F,
    ) -> Result<Outcome, GuardError<E>>
    where
        F: AsyncFnOnce(&mut <S::Db as Database>::Connection, &Envelope) -> Result<Value, E>,
    {
        let now = self.clock.now();
        let key = self.placement(consumer_type, envelope, now)?;
        self.ensure_partition(key.bucket).await?;

        // A handler that records no result lets the claim write the inbox row in its own
        // statement: as few round trips as a hand-written `INSERT … ON CONFLICT` inbox.
        // One that records a result would then need an UPDATE too, so its claim only
        // looks, and the row is inserted after the handler. Which one a handler is, is
        // learnt from its last result; a wrong guess costs time, never correctness.
        let write_row_at = (!self.records_results(consumer_type)).then_some(now);
        let claim_started = Instant::now();
        let (mut tx, claimed) = match self.store.begin_claim(&key, write_row_at).await {
            Err(error) if S::is_missing_partition(&error) => {
                // Dropped by a pruner since we cached it: ask again. A pruned month is
                // refused, never recreated empty.
                self.known().remove(&key.bucket);
                self.ensure_partition(key.bucket).await?;
                self.store.begin_claim(&key, write_row_at).await?
            }
            claimed => claimed?,
        };
        metrics::claim_duration(consumer_type, claim_started.elapsed());
        let row_written = match claimed {
            Claimed::Duplicate { first, counted } => {
                self.count_duplicate(tx, &key, &first, counted, now).await;
                return Ok(Outcome::Duplicate {
                    first_processed_at: first.processed_at,
                    result: first.result,
                });
            }
            Claimed::Fresh { row_written } => row_written,
        };

        let result = match handler(&mut *tx, envelope).await {
            Ok(result) => result,
            Err(error) => {
                if let Err(rollback) = tx.rollback().await {
                    // The connection is discarded by the pool; the database rolls back.
                    tracing::warn!(%rollback, "rollback after handler error failed");
                }
                return Err(GuardError::Handler(error));
            }
        };

        self.learn_records_results(consumer_type, !result.is_null());
        if row_written {
            // The claim wrote the row with a null result: a handler with nothing to
            // record costs no statement more than a hand-written inbox.
            if !result.is_null() {
                self.store.record_result(&mut tx, &key, &result).await?;
            }
            tx.commit().await?;
            return Ok(Outcome::Applied(result));
        }
        let recorded = match self.store.record(&mut tx, &key, now, &result).await {
            Err(error) if S::is_missing_partition(&error) => {
                // The month was dropped under us (its rows expiring meanwhile): nothing
                // of ours commits. Refused if it was pruned; else retry.
                tx.rollback().await.ok();
                self.known().remove(&key.bucket);
                self.ensure_partition(key.bucket).await?;
                return Err(InboxError::from(error).into());
            }
            recorded => recorded?,
        };
        if !recorded {
            // A delivery of the same key committed between our claim's snapshot and its
            // lock (see `PostgresStore`): our handler ran but must not count. Roll it
            // all back and answer with the row that won.
            tx.rollback().await?;
            let (tx, claimed) = self.store.begin_claim(&key, None).await?;
            let Claimed::Duplicate { first, counted } = claimed else {
                tx.rollback().await?;
                return Err(InboxError::ClaimVanished {
                    consumer_type: consumer_type.clone(),
                    message_id: envelope.id.clone(),
                }
                .into());
            };
            self.count_duplicate(tx, &key, &first, counted, now).await;
            tracing::debug!(
                consumer_type = %consumer_type,
                message_id = %envelope.id,
                "late conflict: handler rolled back, answered with the first result"
            );
            return Ok(Outcome::Duplicate {
                first_processed_at: first.processed_at,
                result: first.result,
            });
        }
        tx.commit().await?;
        Ok(Outcome::Applied(result))
    }

    /// Adds one to the duplicates recorded on the first delivery's row, in the claim's
    /// transaction (which still holds the key), unless the claim `counted` it already,
    /// and commits; `sagabox inspect` reads the counts from there. Only the duplicate path
    /// pays for it. A failure here only loses a count: it is logged and the duplicate is
    /// still answered.
    async fn count_duplicate(
        &self,
        mut tx: sqlx::Transaction<'static, S::Db>,
        key: &ClaimKey<'_>,
        first: &FirstDelivery,
        counted: bool,
        now: DateTime<Utc>,
    ) {
        let recorded = if counted {
            Ok(())
        } else {
            self.store.record_duplicate(&mut tx, key, first, now).await
        };
        let committed = match recorded {
            Ok(()) => tx.commit().await,
            Err(error) => {
                tx.rollback().await.ok();
                Err(error)
            }
        };
        if let Err(error) = committed {
            tracing::warn!(
                consumer_type = %key.consumer_type,
                message_id = %key.message_id,
                %error,
                "duplicate answered but not counted in the inbox row"
            );
        }
    }

    /// Decides where a message is filed and where its claim looks, and refuses the ones
    /// that cannot be deduplicated safely.
    ///
    /// A message is filed under the month of its time (UUIDv7 time, else publish time,
    /// else now). Its claim looks only in that month when the time cannot differ between
    /// deliveries — a UUIDv7 id, or a publish time the configuration trusts — so every
    /// redelivery, next month too, meets the first one in the same partition. Otherwise
    /// it looks in every live partition, under the key's lock.
    pub(super) fn placement<'a>(
        &self,
        consumer_type: &'a ConsumerType,
        envelope: &'a Envelope,
        now: DateTime<Utc>,
    ) -> Result<ClaimKey<'a>, InboxError> {
        let message_id = &envelope.id;
        // The same rule as `Envelope::dedup_time`, with the id parsed once: this runs
        // for every message.
        let id_time = message_id.uuid_v7_time();
        let stable_time = id_time.is_some()
            || (self.config.trust_publish_time && envelope.published_at.is_some());
        let Some(filed_at) = id_time.or(envelope.published_at) else {
            return Ok(ClaimKey {
                consumer_type,
                message_id,
                bucket: Month::of(now)?,
                probe_all: true,
            });
        };
        let window_start = now
            .checked_sub_signed(to_delta(self.config.ttl))
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        if filed_at < window_start {
            return Err(InboxError::Expired {
                message_id: message_id.clone(),
                filed_at,
                window_start,
            });
        }
        let latest = now
            .checked_add_signed(to_delta(self.config.max_future_skew))
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        if filed_at > latest {
            return Err(InboxError::PublishedInFuture {
                message_id: message_id.clone(),
                filed_at,
                now,
            });
        }
        Ok(ClaimKey {
            consumer_type,
            message_id,
            bucket: Month::of(filed_at)?,
            probe_all: !stable_time,
        })
    }

    pub(super) async fn ensure_partition(&self, month: Month) -> Result<(), InboxError> {
        if self.known().contains(&month) {
            return Ok(());
        }
        match self.store.create_partition(month).await? {
            PartitionCreation::Pruned => return Err(InboxError::PartitionPruned(month)),
            PartitionCreation::Created => metrics::partition_created_on_demand(),
            PartitionCreation::Existed => {}
        }
        self.known().insert(month);
        Ok(())
    }

    /// Forgets that `month` has a partition (a pruner dropped it), so the next claim
    /// asks the store again.
    pub(super) fn forget_partition(&self, month: Month) {
        self.known().remove(&month);
    }

    pub(super) fn records_results(&self, consumer_type: &ConsumerType) -> bool {
        self.records_results
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(consumer_type)
            .copied()
            .unwrap_or(false)
    }

    pub(super) fn learn_records_results(&self, consumer_type: &ConsumerType, records: bool) {
        let mut known = self
            .records_results
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if known.get(consumer_type) != Some(&records) {
            known.insert(consumer_type.clone(), records);
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, BTreeSet<Month>> {
        self.known_partitions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs the migrations, then creates the partitions of the current month and
    /// [`partitions_ahead`](InboxConfig::partitions_ahead) months after it.
    pub async fn migrate(&self) -> Result<Vec<Month>, InboxError> {
        self.store.migrate().await?;
        self.prepare_partitions().await
    }

    /// Creates the partitions of the current month and the
    /// [`partitions_ahead`](InboxConfig::partitions_ahead) months after it. Returns the
    /// months it created (those that already existed are skipped).
    pub async fn prepare_partitions(&self) -> Result<Vec<Month>, InboxError> {
        let current = Month::of(self.clock.now())?;
        self.create_partitions(current, current.plus(self.config.partitions_ahead))
            .await
    }

    /// Creates the partitions of `first..=last`. Returns the months it created; months
    /// already pruned are skipped, never recreated.
    pub async fn create_partitions(
        &self,
        first: Month,
        last: Month,
    ) -> Result<Vec<Month>, InboxError> {
        let mut created = Vec::new();
        for month in first.through(last) {
            match self.store.create_partition(month).await? {
                PartitionCreation::Created => created.push(month),
                PartitionCreation::Existed => {}
                PartitionCreation::Pruned => continue,
            }
            self.known().insert(month);
        }
        Ok(created)
    }

    /// The months that have a partition, oldest first.
    pub async fn partitions(&self) -> Result<Vec<Month>, InboxError> {
        Ok(self.store.partitions().await?)
    }

    /// The partitions wholly older than the TTL: every row in them was filed before
    /// `now − ttl`, so no message still inside the window can need them.
    pub async fn expired_partitions(&self) -> Result<Vec<Month>, InboxError> {
        let window_start = self
            .clock
            .now()
            .checked_sub_signed(to_delta(self.config.ttl))
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        let mut months = self.store.partitions().await?;
        months.retain(|month| month.end() <= window_start);
        Ok(months)
    }

    /// Drops the partitions wholly older than the TTL, whole (never row by row). Returns
    /// the months dropped.
    pub async fn drop_expired_partitions(&self) -> Result<Vec<Month>, InboxError> {
        let mut dropped = Vec::new();
        for month in self.expired_partitions().await? {
            // Claims that cached it will find it gone and be refused (the store records
            // the month as pruned before dropping it).
            self.known().remove(&month);
            if self.store.drop_partition(month).await? {
                dropped.push(month);
            }
        }
        Ok(dropped)
    }
}

fn to_delta(duration: std::time::Duration) -> TimeDelta {
    TimeDelta::from_std(duration).unwrap_or(TimeDelta::MAX)
}
