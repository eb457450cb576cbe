//! The email participant: `send_confirmation`, recorded in `emails_sent` (one row per
//! email sent: the inbox is what keeps a customer from getting two).

use serde_json::json;

use crate::order::{self, on_both_databases, retryable};

/// The consumer type the email step deduplicates as, and its queue's suffix.
pub const CONSUMER: &str = "email";
/// The command that sends the order's confirmation.
pub const SEND_CONFIRMATION: &str = "send_confirmation";

/// Sends confirmations (here: records them). Answers `{"email": "confirmation"}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Email;

on_both_databases!(Email, |conn, envelope, order_id| {
    match envelope.kind.as_str() {
        SEND_CONFIRMATION => {
            sqlx::query("INSERT INTO emails_sent (order_id, template) VALUES ($1, 'confirmation')")
                .bind(&order_id)
                .execute(&mut *conn)
                .await
                .map_err(retryable)?;
            Ok(json!({ "email": "confirmation" }))
        }
        other => Err(order::unknown(CONSUMER, other)),
    }
});
