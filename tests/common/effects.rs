//! A guarded handler the broker suites share: each message through the inbox guard, one
//! `effects (message_id, body)` row per fresh message (no unique constraint there: only
//! the inbox keeps it exact), settled as the guard's outcome says.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::SeqCst;

use sagabox::delivery::{DeliveryHandler, Disposition};
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

/// A handler that runs each message through [`apply`] as `consumer_type`, counting
/// duplicates in `duplicates`.
pub fn guarded(
    guard: &InboxGuard<PostgresStore>,
    consumer_type: &ConsumerType,
    duplicates: Arc<AtomicU32>,
) -> impl DeliveryHandler {
    let (guard, consumer_type) = (guard.clone(), consumer_type.clone());
    move |envelope: Envelope| {
        let (guard, consumer_type, duplicates) = (
            guard.clone(),
            consumer_type.clone(),
            Arc::clone(&duplicates),
        );
        async move { apply(&guard, &consumer_type, &envelope, &duplicates).await }
    }
}

/// A handler that counts its calls in `calls` and applies nothing: a message with
/// `"flaky": true` is retried on the handler's first call and done after it; any other
/// is retried every time.
pub fn flaky(calls: Arc<AtomicU32>) -> impl DeliveryHandler {
    move |envelope: Envelope| {
        let n = calls.fetch_add(1, SeqCst);
        async move {
            match envelope.payload["flaky"].as_bool() {
                Some(true) if n == 0 => Disposition::Retry("database restarting".into()),
                Some(true) => Disposition::Done { reply: None },
                _ => Disposition::Retry("always down".into()),
            }
        }
    }
}
