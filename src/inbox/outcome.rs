//! [`Outcome`]: what one pass through the guard did.

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::metrics::MessageOutcome;

/// What [`InboxGuard::process`](crate::InboxGuard::process) did with a message.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// First delivery: the handler ran, its result was recorded and everything committed.
    Applied(Value),
    /// A redelivery: nothing was applied; here is what the first delivery recorded.
    Duplicate {
        /// When the first delivery was processed.
        first_processed_at: DateTime<Utc>,
        /// The result the first delivery's handler returned.
        result: Value,
    },
}

impl Outcome {
    /// The handler's result: this delivery's, or the first delivery's for a duplicate.
    pub fn result(&self) -> &Value {
        match self {
            Outcome::Applied(result) | Outcome::Duplicate { result, .. } => result,
        }
    }

    /// Whether this delivery was a duplicate.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Outcome::Duplicate { .. })
    }

    /// The metric label of this outcome: `applied` or `duplicate`.
    pub fn label(&self) -> &'static str {
        self.metric().as_str()
    }

    /// This outcome as the `outcome` of the inbox's message counter.
    pub(crate) const fn metric(&self) -> MessageOutcome {
        match self {
            Outcome::Applied(_) => MessageOutcome::Applied,
            Outcome::Duplicate { .. } => MessageOutcome::Duplicate,
        }
    }
}
