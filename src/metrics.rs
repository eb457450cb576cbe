//! The metrics the inbox emits through the `metrics` crate's facade. Install any
//! recorder (Prometheus, StatsD, …) to collect them; without one they cost nothing.
//!
//! | name | kind | labels |
//! | --- | --- | --- |
//! | `sagabox_inbox_messages_total` | counter | `consumer_type`, `outcome` = `applied` \| `duplicate` \| `failed` |
//! | `sagabox_inbox_claim_seconds` | histogram | — : time to begin the transaction and claim the key, waiting for a racing delivery included |
//! | `sagabox_inbox_partitions_created_total` | counter | — |
//! | `sagabox_inbox_partitions_dropped_total` | counter | — |

use std::time::Duration;

use crate::envelope::ConsumerType;

/// Messages through the guard, by consumer type and outcome.
pub const INBOX_MESSAGES_TOTAL: &str = "sagabox_inbox_messages_total";
/// Seconds from begin to a settled claim.
pub const INBOX_CLAIM_SECONDS: &str = "sagabox_inbox_claim_seconds";
/// Inbox partitions created.
pub const INBOX_PARTITIONS_CREATED_TOTAL: &str = "sagabox_inbox_partitions_created_total";
/// Inbox partitions dropped.
pub const INBOX_PARTITIONS_DROPPED_TOTAL: &str = "sagabox_inbox_partitions_dropped_total";

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

pub(crate) fn partition_created() {
    metrics::counter!(INBOX_PARTITIONS_CREATED_TOTAL).increment(1);
}

pub(crate) fn partition_dropped() {
    metrics::counter!(INBOX_PARTITIONS_DROPPED_TOTAL).increment(1);
}
