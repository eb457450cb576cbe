//! The metrics the inbox emits through the `metrics` crate's facade. Install any
//! recorder (Prometheus, StatsD, …) to collect them; without one they cost nothing.
//!
//! | name | kind | labels |
//! | --- | --- | --- |
//! | `sagabox_inbox_messages_total` | counter | `consumer_type`, `outcome` = `applied` \| `duplicate` \| `failed` |
//! | `sagabox_inbox_claim_seconds` | histogram | — : time to begin the transaction and claim the key, waiting for a racing delivery included |
//! | `sagabox_inbox_partitions_created_on_demand_total` | counter | — : months created by a claim that found its partition missing |
//! | `sagabox_pruner_partitions_created_total` | counter | — : months created ahead by the pruner |
//! | `sagabox_pruner_partitions_dropped_total` | counter | — : expired months dropped by the pruner |
//! | `sagabox_pruner_failures_total` | counter | — : pruner passes that failed (retried at the next tick) |
//! | `sagabox_inbox_oldest_partition_age_seconds` | gauge | — : age of the oldest partition's first instant, after a pass |

use std::time::Duration;

use crate::envelope::ConsumerType;

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

pub(crate) fn inbox_message(consumer_type: &ConsumerType, outcome: &'static str) {
    metrics::counter!(
        INBOX_MESSAGES_TOTAL,
        "consumer_type" => consumer_type.as_str().to_owned(),
        "outcome" => outcome
    )
    .increment(1);
}

pub(crate) fn claim_duration(elapsed: Duration) {
    metrics::histogram!(INBOX_CLAIM_SECONDS).record(elapsed.as_secs_f64());
}

pub(crate) fn partition_created_on_demand() {
    metrics::counter!(INBOX_PARTITIONS_CREATED_ON_DEMAND_TOTAL).increment(1);
}

pub(crate) fn pruner_pass(pass: &crate::pruner::PrunePass, now: chrono::DateTime<chrono::Utc>) {
    metrics::counter!(PRUNER_PARTITIONS_CREATED_TOTAL).increment(pass.created.len() as u64);
    metrics::counter!(PRUNER_PARTITIONS_DROPPED_TOTAL).increment(pass.dropped.len() as u64);
    if let Some(oldest) = pass.oldest {
        let age = (now - oldest.start()).num_milliseconds().max(0) as f64 / 1000.0;
        metrics::gauge!(INBOX_OLDEST_PARTITION_AGE_SECONDS).set(age);
    }
}

pub(crate) fn pruner_failure() {
    metrics::counter!(PRUNER_FAILURES_TOTAL).increment(1);
}

/// Messages dead-lettered by a RabbitMQ consumer, by consumer type and reason.
pub const DEAD_LETTERS_TOTAL: &str = "sagabox_dead_letters_total";
/// Outbox rows published by a relay (confirmed by the broker), by destination.
pub const OUTBOX_PUBLISHED_TOTAL: &str = "sagabox_outbox_published_total";
/// Seconds from an outbox row's creation to the broker's confirm.
pub const OUTBOX_LAG_SECONDS: &str = "sagabox_outbox_lag_seconds";

#[cfg(feature = "rabbitmq")]
pub(crate) fn dead_letter(consumer_type: &ConsumerType, reason: &'static str) {
    metrics::counter!(
        DEAD_LETTERS_TOTAL,
        "consumer_type" => consumer_type.as_str().to_owned(),
        "reason" => reason
    )
    .increment(1);
}

#[cfg(feature = "rabbitmq")]
pub(crate) fn outbox_published(destination: &ConsumerType, lag: Duration) {
    metrics::counter!(
        OUTBOX_PUBLISHED_TOTAL,
        "destination" => destination.as_str().to_owned()
    )
    .increment(1);
    metrics::histogram!(OUTBOX_LAG_SECONDS).record(lag.as_secs_f64());
}
