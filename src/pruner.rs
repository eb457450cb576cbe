//! The [`Pruner`] actor: on a timer, creates the coming months' inbox partitions ahead of
//! time and drops the partitions wholly older than the TTL, whole.
//!
//! The pass itself is [`Maintenance::run_pass`], implemented by
//! [`InboxGuard`]; the actor only schedules it (ractor's
//! `send_interval`, so a paused tokio clock drives it in tests), keeps going when a pass
//! fails (the next tick tries again), and answers [`PrunerMessage::RunNow`] for a pass on
//! demand. `sagabox prune` runs one pass without the actor.

use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::task::JoinHandle;

use crate::inbox::{InboxError, InboxGuard};
use crate::logging::json_list;
use crate::metrics;
use crate::month::Month;
use crate::store::InboxStore;

/// What one maintenance pass did (or, dry, would do).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PrunePass {
    /// Months whose partition was created (would be, when dry).
    pub created: Vec<Month>,
    /// Months whose partition was dropped (would be, when dry).
    pub dropped: Vec<Month>,
    /// Whether nothing was changed.
    pub dry_run: bool,
    /// The oldest partition left, if any.
    pub oldest: Option<Month>,
    /// Another instance held the maintenance lock, running a pass of its own: this one
    /// did nothing ([`InboxStore::try_maintenance_lock`]).
    pub skipped: bool,
}

/// One maintenance pass over an inbox's partitions.
pub trait Maintenance: Send + Sync + 'static {
    /// Creates the partitions ahead and drops the expired ones; with `dry_run`, only
    /// reports what it would do.
    fn run_pass(&self, dry_run: bool)
    -> impl Future<Output = Result<PrunePass, InboxError>> + Send;
}

impl<S: InboxStore> Maintenance for InboxGuard<S> {
    async fn run_pass(&self, dry_run: bool) -> Result<PrunePass, InboxError> {
        let pass = if dry_run {
            let existing = self.partitions().await?;
            let current = Month::of(self.now())?;
            PrunePass {
                created: current
                    .through(current.plus(self.config().partitions_ahead))
                    .filter(|month| !existing.contains(month))
                    .collect(),
                dropped: self.expired_partitions().await?,
                dry_run,
                oldest: existing.first().copied(),
                skipped: false,
            }
        } else {
            // One instance at a time does the work; the others' passes find the lock
            // taken and do nothing until their next tick.
            let Some(lock) = self.store().try_maintenance_lock().await? else {
                return Ok(PrunePass {
                    skipped: true,
                    ..PrunePass::default()
                });
            };
            let pass = async {
                let created = self.prepare_partitions().await?;
                let dropped = self.drop_expired_partitions().await?;
                Ok::<_, InboxError>(PrunePass {
                    created,
                    dropped,
                    dry_run,
                    oldest: self.partitions().await?.first().copied(),
                    skipped: false,
                })
            }
            .await;
            // Released at once, failed pass or not: the next tick of any instance may
            // take it.
            lock.release().await;
            pass?
        };
        if !dry_run {
            let now = self.now();
            let oldest_age = pass
                .oldest
                .map(|oldest| (now - oldest.start()).to_std().unwrap_or_default());
            metrics::pruner_pass(pass.created.len(), pass.dropped.len(), oldest_age);
        }
        Ok(pass)
    }
}

/// The pruner actor's name, as a supervisor reports its death.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) const ACTOR: &str = "pruner";

/// How a service runs its [`Pruner`] (a participant's or an orchestrator's). What it
/// drops is decided by the inbox's TTL and how far ahead it creates partitions by its
/// `partitions_ahead`, both in the service's [`InboxConfig`](crate::InboxConfig) — the
/// same TTL the claims expire by, checked at start against the broker's retention
/// ([`InboxConfig::broker_retention`](crate::InboxConfig::broker_retention)).
#[derive(Debug, Clone, PartialEq)]
pub struct PrunerSettings {
    /// Time between passes; the first runs at start. A month changes slowly: hourly is
    /// plenty, and every instance of a service may run one (one pass at a time runs, the
    /// others find the maintenance lock taken and skip). Defaults to one hour.
    pub interval: Duration,
}

impl Default for PrunerSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(3600),
        }
    }
}

/// Messages the [`Pruner`] handles.
#[derive(Debug)]
pub enum PrunerMessage {
    /// The timer's tick: run a pass.
    Tick,
    /// Run a pass now and answer with what it did (a failure as its message).
    RunNow(RpcReplyPort<Result<PrunePass, String>>),
}

/// How the [`Pruner`] runs.
#[derive(Debug)]
pub struct PrunerArguments<M> {
    /// The inbox to maintain (an [`InboxGuard`]).
    pub maintenance: M,
    /// Time between passes. A month changes slowly: hourly is plenty. The first pass
    /// runs at start.
    pub interval: Duration,
}

/// The pruner's mutable state.
#[derive(Debug)]
pub struct PrunerState<M> {
    maintenance: M,
    timer: JoinHandle<()>,
    passes: u64,
    failures: u64,
    /// Passes skipped in a row because another instance held the maintenance lock.
    skipped_in_a_row: u64,
}

/// Skipped passes in a row after which the pruner warns: one instance's pass normally
/// ends long before the others' next tick, so a lock held that long is likely stuck.
const SKIPS_BEFORE_WARNING: u64 = 3;

/// The pruning actor. Spawn it with [`Actor::spawn`] and [`PrunerArguments`].
#[derive(Debug)]
pub struct Pruner<M>(PhantomData<fn() -> M>);

impl<M> Default for Pruner<M> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<M: Maintenance> Pruner<M> {
    /// The pruner.
    pub fn new() -> Self {
        Self::default()
    }

    async fn pass(state: &mut PrunerState<M>) -> Result<PrunePass, InboxError> {
        let result = state.maintenance.run_pass(false).await;
        state.passes += 1;
        match &result {
            Ok(pass) if pass.skipped => {
                state.skipped_in_a_row += 1;
                if state.skipped_in_a_row >= SKIPS_BEFORE_WARNING {
                    tracing::warn!(
                        skipped_in_a_row = state.skipped_in_a_row,
                        "another instance has held the pruner's maintenance lock for several \
                         passes: if no instance logs finished passes, look for a stuck one \
                         (a partition detach waiting on a long transaction)"
                    );
                } else {
                    tracing::debug!(
                        "pruner pass skipped: another instance holds the maintenance lock"
                    );
                }
            }
            Ok(pass) => {
                state.skipped_in_a_row = 0;
                tracing::info!(
                    created = %json_list(&pass.created),
                    dropped = %json_list(&pass.dropped),
                    oldest = pass.oldest.map(|month| month.to_string()).as_deref().unwrap_or("none"),
                    "pruner pass"
                );
            }
            Err(error) => {
                state.failures += 1;
                metrics::pruner_failure();
                tracing::warn!(%error, failures = state.failures, "pruner pass failed; retrying at the next tick");
            }
        }
        result
    }
}

impl<M: Maintenance> Actor for Pruner<M> {
    type Msg = PrunerMessage;
    type State = PrunerState<M>;
    type Arguments = PrunerArguments<M>;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        if args.interval.is_zero() {
            return Err("pruner interval is zero: give it a period such as one hour".into());
        }
        myself.send_message(PrunerMessage::Tick)?;
        let timer = myself.send_interval(args.interval, || PrunerMessage::Tick);
        Ok(PrunerState {
            maintenance: args.maintenance,
            timer,
            passes: 0,
            failures: 0,
            skipped_in_a_row: 0,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.timer.abort();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            // A failed pass is logged and counted; the actor stays up for the next tick.
            PrunerMessage::Tick => {
                let _ = Self::pass(state).await;
            }
            PrunerMessage::RunNow(reply) => {
                let result = Self::pass(state).await.map_err(|error| error.to_string());
                // The caller may have given up waiting; nothing to do then.
                let _ = reply.send(result);
            }
        }
        Ok(())
    }
}
