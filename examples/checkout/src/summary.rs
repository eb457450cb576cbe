//! What a demo run did ([`DemoSummary`]), its damage figures read from the business
//! tables by SQL, and the conclusion drawn from them ([`Verdict`]).

use std::fmt;

use chrono::{DateTime, Utc};
use serde::Serialize;

/// What a run did, with the damage figures read from the business tables.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoSummary {
    /// The database, password redacted.
    pub database: String,
    /// How commands travelled: `in-process`, or the broker URL (password redacted).
    pub transport: String,
    /// Whether the inbox was defeated (every delivery under a new message id).
    pub no_inbox: bool,
    /// Orders in the demo tables.
    pub orders: i64,
    /// Checkout sagas completed.
    pub completed: i64,
    /// Checkout sagas compensated (declined, out of stock, gave up).
    pub compensated: i64,
    /// Checkout sagas neither.
    pub unfinished: i64,
    /// Step commands sent by the orchestrator, retries included.
    pub deliveries: u64,
    /// Replies the orchestrator received that said the step had already applied the
    /// command. Fewer than the duplicate deliveries `inspect` counts on the inbox rows:
    /// the answer to an injected second copy and an answer lost on the way are not
    /// received.
    pub duplicate_replies: u64,
    /// Commands sent again after a timeout, a lost reply or a failure.
    pub retries: u64,
    /// Orders charged more than once (SQL over `payment_charges`).
    pub double_charges: i64,
    /// Orders refunded more than once (SQL over `payment_charges`).
    pub double_refunds: i64,
    /// Orders confirmed by email more than once (SQL over `emails_sent`).
    pub double_emails: i64,
    /// Σ over skus of |on_hand − (initial − quantity of completed orders)| (SQL).
    pub stock_drift: i64,
    /// Compensated orders whose charges and refunds do not net to zero (SQL).
    pub unbalanced_refunds: i64,
    /// Wall time of the run.
    pub elapsed_ms: u64,
    /// Sagas finished per second in this run.
    pub sagas_per_sec: f64,
    /// How many times faster than real time the run's clock went (1: real time).
    pub clock_speed: f64,
    /// The run's clock when it ended.
    pub clock_end: DateTime<Utc>,
    /// Inbox months the pruner dropped during the run (`YYYY-MM`).
    pub months_pruned: Vec<String>,
    /// Inbox months with a partition at the end (`YYYY-MM`).
    pub months_kept: Vec<String>,
    /// What the damage figures add up to: [`Verdict::Ok`] when [`damage`](Self::damage)
    /// is 0.
    pub verdict: Verdict,
}

/// The demo's conclusion, from the damage figures read from the business tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Verdict {
    /// Nothing charged, decremented or sent twice, every compensation balanced.
    Ok,
    /// Side effects applied more than once or not undone.
    Damage,
}

impl Verdict {
    /// The verdict on a sum of damage figures.
    pub fn of(damage: i64) -> Self {
        if damage == 0 {
            Verdict::Ok
        } else {
            Verdict::Damage
        }
    }
}

impl DemoSummary {
    /// The sum of every damage figure: 0 when nothing was applied twice or left undone.
    pub fn damage(&self) -> i64 {
        self.double_charges
            + self.double_refunds
            + self.double_emails
            + self.stock_drift
            + self.unbalanced_refunds
    }
}

impl fmt::Display for DemoSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inbox = if self.no_inbox { "BYPASSED" } else { "on" };
        writeln!(
            f,
            "checkout demo on {} via {} (inbox {inbox})",
            self.database, self.transport
        )?;
        let rows: [(&str, String); 17] = [
            ("orders", self.orders.to_string()),
            ("completed", self.completed.to_string()),
            ("compensated", self.compensated.to_string()),
            ("unfinished", self.unfinished.to_string()),
            ("deliveries", self.deliveries.to_string()),
            ("duplicate replies", self.duplicate_replies.to_string()),
            ("retries", self.retries.to_string()),
            ("double charges", self.double_charges.to_string()),
            ("double refunds", self.double_refunds.to_string()),
            ("double emails", self.double_emails.to_string()),
            ("stock drift", self.stock_drift.to_string()),
            ("unbalanced refunds", self.unbalanced_refunds.to_string()),
            ("elapsed", format!("{} ms", self.elapsed_ms)),
            (
                "sagas/s",
                format!(
                    "{:.0}{}",
                    self.sagas_per_sec,
                    // `cargo run` builds without optimisation: say so beside the rate.
                    if cfg!(debug_assertions) {
                        " (a debug build: --release for the optimised rate)"
                    } else {
                        ""
                    }
                ),
            ),
            (
                "clock",
                if self.clock_speed == 1.0 {
                    "real time".to_owned()
                } else {
                    format!(
                        "{}x real time, ended at {}",
                        self.clock_speed,
                        self.clock_end.format("%Y-%m-%d %H:%M")
                    )
                },
            ),
            (
                "inbox months",
                format!(
                    "kept [{}], pruned during the run [{}]",
                    self.months_kept.join(", "),
                    self.months_pruned.join(", ")
                ),
            ),
            (
                "verdict",
                match self.verdict {
                    Verdict::Ok => "nothing charged, decremented or sent twice".to_owned(),
                    Verdict::Damage => {
                        "DAMAGE: side effects applied more than once or not undone".to_owned()
                    }
                },
            ),
        ];
        for (name, value) in rows {
            writeln!(f, "  {name:<20} {value}")?;
        }
        Ok(())
    }
}

/// The summary's figures that are read from the tables, by name; `{schema}` is the
/// schema of sagabox's tables ([`sagabox::Schema::sql`]).
pub(crate) const SUMMARY_SQL: [(&str, &str); 9] = [
    (
        "unbalanced_refunds",
        "SELECT COUNT(*) FROM demo_orders o JOIN {schema}.sagabox_saga_instances s ON s.id = o.saga_id \
        WHERE s.status = 'compensated' AND (SELECT COALESCE(SUM(CASE kind WHEN 'charge' THEN amount_cents ELSE -amount_cents END), 0) \
        FROM payment_charges c WHERE c.order_id = o.id) <> 0",
    ),
    ("orders", "SELECT COUNT(*) FROM demo_orders"),
    (
        "completed",
        "SELECT COUNT(*) FROM {schema}.sagabox_saga_instances WHERE saga_name = 'checkout' AND status = 'completed'",
    ),
    (
        "compensated",
        "SELECT COUNT(*) FROM {schema}.sagabox_saga_instances WHERE saga_name = 'checkout' AND status = 'compensated'",
    ),
    (
        "unfinished",
        "SELECT COUNT(*) FROM {schema}.sagabox_saga_instances WHERE saga_name = 'checkout' AND status IN ('running', 'compensating')",
    ),
    (
        "double_charges",
        "SELECT COUNT(*) FROM (SELECT order_id FROM payment_charges WHERE kind = 'charge' GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "double_refunds",
        "SELECT COUNT(*) FROM (SELECT order_id FROM payment_charges WHERE kind = 'refund' GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "double_emails",
        "SELECT COUNT(*) FROM (SELECT order_id FROM emails_sent GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "stock_drift",
        "SELECT CAST(COALESCE(SUM(ABS(i.on_hand - (i.initial - COALESCE((SELECT SUM(o.quantity) FROM demo_orders o \
        JOIN {schema}.sagabox_saga_instances s ON s.id = o.saga_id WHERE o.sku = i.sku AND s.status = 'completed'), 0)))), 0) AS BIGINT) FROM inventory i",
    ),
];
