//! A guarded handler the broker suites share: each message through the inbox guard, one
//! `effects (message_id, body)` row per fresh message (no unique constraint there: only
//! the inbox keeps it exact), settled as the guard's outcome says.

#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::SeqCst;

use sagabox::delivery::Disposition;
use sagabox::inbox::GuardError;
use sagabox::{ConsumerType, Envelope, InboxGuard, Outcome, PostgresStore};
use serde_json::json;

/// `envelope` through the guard, one `effects` row if fresh: done when applied or a
/// duplicate (counted in `duplicates`), rejected when the inbox refuses it for good,
/// retried otherwise.
pub async fn apply(
    guard: &InboxGuard<PostgresStore>,
    consumer_type: &ConsumerType,
    envelope: &Envelope,
    duplicates: &AtomicU32,
) -> Disposition {
    let processed = guard
        .process(consumer_type, envelope, async |conn, envelope| {
            sqlx::query("INSERT INTO effects (message_id, body) VALUES ($1, $2)")
                .bind(envelope.id.as_str())
                .bind(&envelope.payload)
                .execute(&mut *conn)
                .await?;
            Ok::<_, sqlx::Error>(json!({"ok": true}))
        })
        .await;
    match processed {
        Ok(Outcome::Applied(_)) => Disposition::Done { reply: None },
        Ok(Outcome::Duplicate { .. }) => {
            duplicates.fetch_add(1, SeqCst);
            Disposition::Done { reply: None }
        }
        Err(GuardError::Inbox(error)) if !error.is_retryable() => {
            Disposition::Reject(error.to_string())
        }
        Err(error) => Disposition::Retry(error.to_string()),
    }
}
