//! The metrics sagabox emits through the `metrics` crate's facade, as one catalogue
//! ([`CATALOGUE`]) that the docs, the Grafana dashboard and the Prometheus exporter are
//! built from. Install any recorder (Prometheus with [`install_prometheus`], StatsD, …)
//! to collect them; without one they cost next to nothing (the labels are still built: a
//! copy of the consumer type or saga name per labelled metric).
//!
//! | name | kind | labels | what |
//! | --- | --- | --- | --- |
//! | `sagabox_inbox_messages_total` | counter | `consumer_type`, `outcome` = `applied` \| `duplicate` \| `failed` | messages through the guard |
//! | `sagabox_inbox_claim_seconds` | histogram | `consumer_type` | time to begin the transaction and claim the key, waiting for a racing delivery included |
//! | `sagabox_inbox_partitions_created_on_demand_total` | counter | — | months created by a claim that found its partition missing |
//! | `sagabox_pruner_partitions_created_total` | counter | — | months created ahead by the pruner |
//! | `sagabox_pruner_partitions_dropped_total` | counter | — | expired months dropped by the pruner |
//! | `sagabox_pruner_failures_total` | counter | — | pruner passes that failed (retried at the next tick) |
//! | `sagabox_inbox_oldest_partition_age_seconds` | gauge | — | age of the oldest partition's first instant, after a pass |
//! | `sagabox_saga_steps_total` | counter | `saga`, `step`, `direction` = `forward` \| `backward`, `outcome` = `done` \| `refused` \| `failed` | step command attempts and how they ended |
//! | `sagabox_saga_step_seconds` | histogram | `saga`, `step`, `direction` | one attempt, send to reply (or failure) |
//! | `sagabox_saga_retries_total` | counter | `saga`, `step`, `direction` | attempts after the first of a command |
//! | `sagabox_saga_compensations_total` | counter | `saga`, `trigger` = `refused` \| `exhausted` \| `rejected` \| `deadline` | sagas that turned to compensating, and why |
//! | `sagabox_sagas_parked_total` | counter | `saga` | sagas parked for an operator |
//! | `sagabox_saga_duration_seconds` | histogram | `saga`, `status` = `completed` \| `compensated` | creation to terminal state |
//! | `sagabox_outbox_published_total` | counter | `destination` | outbox rows published and confirmed by the broker |
//! | `sagabox_outbox_pending` | gauge | — | outbox rows not yet published |
//! | `sagabox_outbox_lag_seconds` | histogram | — | outbox row committed → broker confirm |
//! | `sagabox_dead_letters_total` | counter | `consumer_type`, `reason` = one of [`DeadReason::ALL`] | messages dead-lettered instead of processed |
//! | `sagabox_build_info` | gauge | `version` | always 1; the crate version of the process |
//!
//! The closed label values (`outcome`, `direction`, `trigger`, `status`, `reason`) are
//! typed ([`DeadReason`] in [`delivery`](crate::delivery), crate-private enums here), so
//! the code can emit no value
//! the catalogue does not list; [`MetricSpec::values`] lists them.
//!
//! `docs/operations.md` explains each one and what to do when it moves.

use std::time::Duration;

use crate::dead_reason::DeadReason;
use crate::envelope::ConsumerType;
use crate::saga::{Direction, SagaStatus};

#[cfg(feature = "prometheus")]
mod endpoint;
#[cfg(feature = "prometheus")]
mod prometheus;

#[cfg(feature = "prometheus")]
pub use prometheus::{MetricsError, install_prometheus, prometheus_builder};

/// Messages through the guard, by consumer type and outcome.
pub const INBOX_MESSAGES_TOTAL: &str = "sagabox_inbox_messages_total";
/// Seconds from begin to a settled claim.
pub const INBOX_CLAIM_SECONDS: &str = "sagabox_inbox_claim_seconds";
/// Months created by a claim that found its partition missing.
pub const INBOX_PARTITIONS_CREATED_ON_DEMAND_TOTAL: &str =
    "sagabox_inbox_partitions_created_on_demand_total";
/// Months created ahead by the pruner.
pub const PRUNER_PARTITIONS_CREATED_TOTAL: &str = "sagabox_pruner_partitions_created_total";
/// Expired months dropped by the pruner.
pub const PRUNER_PARTITIONS_DROPPED_TOTAL: &str = "sagabox_pruner_partitions_dropped_total";
/// Failed pruner passes.
pub const PRUNER_FAILURES_TOTAL: &str = "sagabox_pruner_failures_total";
/// Age of the oldest inbox partition, in seconds.
pub const INBOX_OLDEST_PARTITION_AGE_SECONDS: &str = "sagabox_inbox_oldest_partition_age_seconds";
/// Step command attempts, by saga, step, direction and outcome.
pub const SAGA_STEPS_TOTAL: &str = "sagabox_saga_steps_total";
/// Seconds of one step command attempt.
pub const SAGA_STEP_SECONDS: &str = "sagabox_saga_step_seconds";
/// Step command attempts after the first.
pub const SAGA_RETRIES_TOTAL: &str = "sagabox_saga_retries_total";
/// Sagas that turned to compensating, by trigger.
pub const SAGA_COMPENSATIONS_TOTAL: &str = "sagabox_saga_compensations_total";
/// Sagas parked for an operator, by saga.
pub const SAGAS_PARKED_TOTAL: &str = "sagabox_sagas_parked_total";
/// Seconds from a saga's creation to its terminal state.
pub const SAGA_DURATION_SECONDS: &str = "sagabox_saga_duration_seconds";
/// Outbox rows published and confirmed, by destination.
pub const OUTBOX_PUBLISHED_TOTAL: &str = "sagabox_outbox_published_total";
/// Outbox rows not yet published.
pub const OUTBOX_PENDING: &str = "sagabox_outbox_pending";
/// Seconds from an outbox row's commit to the broker's confirm.
pub const OUTBOX_LAG_SECONDS: &str = "sagabox_outbox_lag_seconds";
/// Messages dead-lettered, by consumer type and reason.
pub const DEAD_LETTERS_TOTAL: &str = "sagabox_dead_letters_total";
/// Always 1, with the crate version as the `version` label.
pub const BUILD_INFO: &str = "sagabox_build_info";

/// The `outcome` of a message through the guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MessageOutcome {
    Applied,
    Duplicate,
    Failed,
}

impl MessageOutcome {
    const ALL: [MessageOutcome; 3] = [
        MessageOutcome::Applied,
        MessageOutcome::Duplicate,
        MessageOutcome::Failed,
    ];

    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            MessageOutcome::Applied => "applied",
            MessageOutcome::Duplicate => "duplicate",
            MessageOutcome::Failed => "failed",
        }
    }
}

/// How one step command attempt ended: the `outcome` of [`SAGA_STEPS_TOTAL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepAttempt {
    /// The step answered done.
    Done,
    /// The step answered that it refuses the command for good.
    Refused,
    /// No answer: a timeout, a lost reply, a retryable error or a rejection.
    Failed,
}

impl StepAttempt {
    const ALL: [StepAttempt; 3] = [StepAttempt::Done, StepAttempt::Refused, StepAttempt::Failed];

    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            StepAttempt::Done => "done",
            StepAttempt::Refused => "refused",
            StepAttempt::Failed => "failed",
        }
    }
}

/// Why a saga turned to compensating: the `trigger` of [`SAGA_COMPENSATIONS_TOTAL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CompensationTrigger {
    /// A step said no.
    Refused,
    /// A step ran out of attempts.
    Exhausted,
    /// The inbox refused the command.
    Rejected,
    /// The saga's deadline passed.
    Deadline,
}

impl CompensationTrigger {
    const ALL: [CompensationTrigger; 4] = [
        CompensationTrigger::Refused,
        CompensationTrigger::Exhausted,
        CompensationTrigger::Rejected,
        CompensationTrigger::Deadline,
    ];

    /// The label value, also the detail of the history's `compensating` event.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            CompensationTrigger::Refused => "refused",
            CompensationTrigger::Exhausted => "exhausted",
            CompensationTrigger::Rejected => "rejected",
            CompensationTrigger::Deadline => "deadline",
        }
    }
}

/// Both directions of a step command.
const DIRECTION_VALUES: [Direction; 2] = [Direction::Forward, Direction::Backward];

const fn direction_str(direction: Direction) -> &'static str {
    match direction {
        Direction::Forward => "forward",
        Direction::Backward => "backward",
    }
}

/// The `status` values of [`SAGA_DURATION_SECONDS`]: the terminal ones.
const FINISHED: [SagaStatus; 2] = [SagaStatus::Completed, SagaStatus::Compensated];

/// The values of each closed label, as text, from the lists of the types the code emits
/// (each list as long as its type's `ALL`, so a value added there shows up here).
mod values {
    use super::*;

    /// Fills `[&str; N]` from `$all` through `$name`; a loop because `const` cannot map.
    macro_rules! names {
        ($all:expr, $name:expr) => {{
            let all = $all;
            let mut names = [""; $all.len()];
            let mut i = 0;
            while i < all.len() {
                names[i] = $name(all[i]);
                i += 1;
            }
            names
        }};
    }

    pub(super) const MESSAGE_OUTCOMES: [&str; MessageOutcome::ALL.len()] =
        names!(MessageOutcome::ALL, MessageOutcome::as_str);
    pub(super) const STEP_ATTEMPTS: [&str; StepAttempt::ALL.len()] =
        names!(StepAttempt::ALL, StepAttempt::as_str);
    pub(super) const DIRECTIONS: [&str; DIRECTION_VALUES.len()] =
        names!(DIRECTION_VALUES, direction_str);
    pub(super) const TRIGGERS: [&str; CompensationTrigger::ALL.len()] =
        names!(CompensationTrigger::ALL, CompensationTrigger::as_str);
    pub(super) const STATUSES: [&str; FINISHED.len()] = names!(FINISHED, SagaStatus::as_str);
    pub(super) const DEAD_REASONS: [&str; DeadReason::ALL.len()] =
        names!(DeadReason::ALL, DeadReason::as_str);
}

/// What kind of instrument a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetricKind {
    /// Only goes up; rate it.
    Counter,
    /// A level that goes up and down.
    Gauge,
    /// A distribution of observations (seconds), rendered with buckets.
    Histogram,
}

/// The values a label of closed set takes, all of them.
#[derive(Debug, Clone, Copy)]
pub struct LabelValues {
    /// The label's name.
    pub label: &'static str,
    /// Every value the code emits for it.
    pub values: &'static [&'static str],
}

/// One entry of the [`CATALOGUE`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct MetricSpec {
    /// The metric's name, as exported.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// The label names its series carry.
    pub labels: &'static [&'static str],
    /// One line on what it counts or measures.
    pub help: &'static str,
    /// The labels of a closed set with every value they take; labels not listed here
    /// carry names (a consumer type, a saga, a step, a destination).
    pub values: &'static [LabelValues],
}

const NO_VALUES: &[LabelValues] = &[];
const DIRECTION: LabelValues = LabelValues {
    label: "direction",
    values: &values::DIRECTIONS,
};

/// Every metric sagabox emits (or, for the outbox relay and dead-lettering, defines for
/// its transports to emit), with its labels and the values of its closed labels. The
/// exporter describes all of them when installed (see [`register_catalogue`]).
pub const CATALOGUE: &[MetricSpec] = &[
    MetricSpec {
        name: INBOX_MESSAGES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["consumer_type", "outcome"],
        help: "Messages through the inbox guard, by outcome (applied, duplicate, failed).",
        values: &[LabelValues {
            label: "outcome",
            values: &values::MESSAGE_OUTCOMES,
        }],
    },
    MetricSpec {
        name: INBOX_CLAIM_SECONDS,
        kind: MetricKind::Histogram,
        labels: &["consumer_type"],
        help: "Seconds to begin the transaction and claim the key, waiting for a racing delivery included.",
        values: NO_VALUES,
    },
    MetricSpec {
        name: INBOX_PARTITIONS_CREATED_ON_DEMAND_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        help: "Inbox months created by a claim that found its partition missing.",
        values: NO_VALUES,
    },
    MetricSpec {
        name: PRUNER_PARTITIONS_CREATED_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        help: "Inbox months created ahead by the pruner.",
        values: NO_VALUES,
    },
    MetricSpec {
        name: PRUNER_PARTITIONS_DROPPED_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        help: "Expired inbox months dropped by the pruner.",
        values: NO_VALUES,
    },
    MetricSpec {
        name: PRUNER_FAILURES_TOTAL,
        kind: MetricKind::Counter,
        labels: &[],
        help: "Pruner passes that failed (retried at the next tick).",
        values: NO_VALUES,
    },
    MetricSpec {
        name: INBOX_OLDEST_PARTITION_AGE_SECONDS,
        kind: MetricKind::Gauge,
        labels: &[],
        help: "Age in seconds of the oldest inbox partition's first instant, after the last pruner pass.",
        values: NO_VALUES,
    },
    MetricSpec {
        name: SAGA_STEPS_TOTAL,
        kind: MetricKind::Counter,
        labels: &["saga", "step", "direction", "outcome"],
        help: "Saga step command attempts, by direction (forward, backward) and outcome (done, refused, failed).",
        values: &[
            DIRECTION,
            LabelValues {
                label: "outcome",
                values: &values::STEP_ATTEMPTS,
            },
        ],
    },
    MetricSpec {
        name: SAGA_STEP_SECONDS,
        kind: MetricKind::Histogram,
        labels: &["saga", "step", "direction"],
        help: "Seconds of one saga step command attempt, send to reply or failure.",
        values: &[DIRECTION],
    },
    MetricSpec {
        name: SAGA_RETRIES_TOTAL,
        kind: MetricKind::Counter,
        labels: &["saga", "step", "direction"],
        help: "Saga step command attempts after the first (timeouts, lost replies, retryable failures).",
        values: &[DIRECTION],
    },
    MetricSpec {
        name: SAGA_COMPENSATIONS_TOTAL,
        kind: MetricKind::Counter,
        labels: &["saga", "trigger"],
        help: "Sagas that turned to compensating, by trigger (refused, exhausted, rejected, deadline).",
        values: &[LabelValues {
            label: "trigger",
            values: &values::TRIGGERS,
        }],
    },
    MetricSpec {
        name: SAGAS_PARKED_TOTAL,
        kind: MetricKind::Counter,
        labels: &["saga"],
        help: "Sagas parked for an operator (a compensation refused or rejected, a deadline past a step without compensation, an unknown definition version).",
        values: NO_VALUES,
    },
    MetricSpec {
        name: SAGA_DURATION_SECONDS,
        kind: MetricKind::Histogram,
        labels: &["saga", "status"],
        help: "Seconds from a saga's creation to its terminal state (completed, compensated).",
        values: &[LabelValues {
            label: "status",
            values: &values::STATUSES,
        }],
    },
    MetricSpec {
        name: OUTBOX_PUBLISHED_TOTAL,
        kind: MetricKind::Counter,
        labels: &["destination"],
        help: "Outbox rows published and confirmed by the broker.",
        values: NO_VALUES,
    },
    MetricSpec {
        name: OUTBOX_PENDING,
        kind: MetricKind::Gauge,
        labels: &[],
        help: "Outbox rows not yet published.",
        values: NO_VALUES,
    },
    MetricSpec {
        name: OUTBOX_LAG_SECONDS,
        kind: MetricKind::Histogram,
        labels: &[],
        help: "Seconds from an outbox row's commit to the broker's publish confirm.",
        values: NO_VALUES,
    },
    MetricSpec {
        name: DEAD_LETTERS_TOTAL,
        kind: MetricKind::Counter,
        labels: &["consumer_type", "reason"],
        help: "Messages dead-lettered instead of processed, by reason.",
        values: &[LabelValues {
            label: "reason",
            values: &values::DEAD_REASONS,
        }],
    },
    MetricSpec {
        name: BUILD_INFO,
        kind: MetricKind::Gauge,
        labels: &["version"],
        help: "Always 1; the sagabox crate version of this process as the version label.",
        values: NO_VALUES,
    },
];

/// Histogram buckets, in seconds, for latencies: 100 µs to 10 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Histogram buckets, in seconds, for whole sagas and outbox lag: 10 ms to 1 h.
pub const LONG_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

pub(crate) fn inbox_message(consumer_type: &ConsumerType, outcome: MessageOutcome) {
    metrics::counter!(
        INBOX_MESSAGES_TOTAL,
        "consumer_type" => consumer_type.as_str().to_owned(),
        "outcome" => outcome.as_str()
    )
    .increment(1);
}

pub(crate) fn claim_duration(consumer_type: &ConsumerType, elapsed: Duration) {
    metrics::histogram!(INBOX_CLAIM_SECONDS, "consumer_type" => consumer_type.as_str().to_owned())
        .record(elapsed.as_secs_f64());
}

pub(crate) fn partition_created_on_demand() {
    metrics::counter!(INBOX_PARTITIONS_CREATED_ON_DEMAND_TOTAL).increment(1);
}

/// A pruner pass created `created` partitions and dropped `dropped`; the oldest one left
/// is `oldest_age` old, if any is left.
pub(crate) fn pruner_pass(created: usize, dropped: usize, oldest_age: Option<Duration>) {
    metrics::counter!(PRUNER_PARTITIONS_CREATED_TOTAL).increment(created as u64);
    metrics::counter!(PRUNER_PARTITIONS_DROPPED_TOTAL).increment(dropped as u64);
    if let Some(age) = oldest_age {
        metrics::gauge!(INBOX_OLDEST_PARTITION_AGE_SECONDS).set(age.as_secs_f64());
    }
}

pub(crate) fn pruner_failure() {
    metrics::counter!(PRUNER_FAILURES_TOTAL).increment(1);
}

/// One step command attempt ended.
pub(crate) fn saga_step(
    saga: &str,
    step: &str,
    direction: Direction,
    outcome: StepAttempt,
    elapsed: Duration,
    retry: bool,
) {
    let direction = direction_str(direction);
    let labels = [
        ("saga", saga.to_owned()),
        ("step", step.to_owned()),
        ("direction", direction.to_owned()),
    ];
    metrics::histogram!(SAGA_STEP_SECONDS, &labels).record(elapsed.as_secs_f64());
    if retry {
        metrics::counter!(SAGA_RETRIES_TOTAL, &labels).increment(1);
    }
    metrics::counter!(
        SAGA_STEPS_TOTAL,
        "saga" => saga.to_owned(),
        "step" => step.to_owned(),
        "direction" => direction,
        "outcome" => outcome.as_str()
    )
    .increment(1);
}

/// A saga turned to compensating.
pub(crate) fn saga_compensation(saga: &str, trigger: CompensationTrigger) {
    metrics::counter!(SAGA_COMPENSATIONS_TOTAL, "saga" => saga.to_owned(), "trigger" => trigger.as_str())
        .increment(1);
}

/// A saga of `saga` was parked for an operator.
pub(crate) fn saga_parked(saga: &str) {
    metrics::counter!(SAGAS_PARKED_TOTAL, "saga" => saga.to_owned()).increment(1);
}

/// A saga reached `status` after `elapsed` since its creation; a status that is not
/// terminal records nothing.
pub(crate) fn saga_finished(saga: &str, status: SagaStatus, elapsed: Duration) {
    if FINISHED.contains(&status) {
        metrics::histogram!(SAGA_DURATION_SECONDS, "saga" => saga.to_owned(), "status" => status.as_str())
            .record(elapsed.as_secs_f64());
    }
}

/// Records that the relay published an outbox row to `destination` and the broker
/// confirmed it `lag` after the row was committed.
pub fn outbox_published(destination: &ConsumerType, lag: Duration) {
    metrics::counter!(OUTBOX_PUBLISHED_TOTAL, "destination" => destination.as_str().to_owned())
        .increment(1);
    metrics::histogram!(OUTBOX_LAG_SECONDS).record(lag.as_secs_f64());
}

/// Sets the number of outbox rows not yet published.
pub fn outbox_pending(rows: u64) {
    metrics::gauge!(OUTBOX_PENDING).set(rows as f64);
}

/// Records a message dead-lettered by a `consumer_type` for `reason` (a fixed code, never
/// the message text, which would make a series per message).
pub fn dead_lettered(consumer_type: &str, reason: DeadReason) {
    metrics::counter!(
        DEAD_LETTERS_TOTAL,
        "consumer_type" => consumer_type.to_owned(),
        "reason" => reason.as_str()
    )
    .increment(1);
}

/// Describes every catalogued metric to the installed recorder, registers at zero the
/// ones without labels (so a scrape lists them before they move: a pruner that never
/// ran, an outbox never used), and sets [`BUILD_INFO`] to 1 with this crate's version.
/// A labelled family gets no series until the code emits one: a series without its
/// labels would be a phantom that queries grouping by label would show as an empty
/// group.
pub fn register_catalogue() {
    for spec in CATALOGUE {
        match spec.kind {
            MetricKind::Counter => metrics::describe_counter!(spec.name, spec.help),
            MetricKind::Gauge => metrics::describe_gauge!(spec.name, spec.help),
            MetricKind::Histogram => {
                metrics::describe_histogram!(spec.name, metrics::Unit::Seconds, spec.help);
            }
        }
        if !spec.labels.is_empty() {
            continue;
        }
        match spec.kind {
            MetricKind::Counter => metrics::counter!(spec.name).increment(0),
            MetricKind::Gauge => metrics::gauge!(spec.name).increment(0.0),
            // Registering the handle creates the series with no observations.
            MetricKind::Histogram => drop(metrics::histogram!(spec.name)),
        }
    }
    build_info();
}

/// Sets [`BUILD_INFO`] to 1 with `version` = this crate's version.
pub fn build_info() {
    metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalogue_names_are_unique_and_prefixed() {
        let mut names: Vec<&str> = CATALOGUE.iter().map(|spec| spec.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CATALOGUE.len(), "a name is listed twice");
        for spec in CATALOGUE {
            assert!(spec.name.starts_with("sagabox_"), "{}", spec.name);
            match spec.kind {
                MetricKind::Counter => assert!(spec.name.ends_with("_total"), "{}", spec.name),
                MetricKind::Histogram => assert!(spec.name.ends_with("_seconds"), "{}", spec.name),
                MetricKind::Gauge => assert!(!spec.name.ends_with("_total"), "{}", spec.name),
            }
        }
    }

    #[test]
    fn buckets_ascend() {
        for buckets in [LATENCY_BUCKETS, LONG_BUCKETS] {
            assert!(buckets.windows(2).all(|pair| pair[0] < pair[1]));
        }
        assert!(LATENCY_BUCKETS[0] < 0.001, "sub-millisecond resolution");
    }
}
