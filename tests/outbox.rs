//! The outbox's write side on real PostgreSQL and SQLite: rows commit with the guard's
//! transaction or not at all, a duplicate writes nothing, ids are UUIDv7, and pending
//! rows come back in order until marked sent.

#![allow(clippy::unwrap_used)]

mod common;

use chrono::Utc;
use sagabox::outbox::{OutboxReader, OutboxWriter};
use sagabox::{ConsumerType, Envelope, GuardError, InboxConfig, InboxGuard, MessageId};
use serde_json::json;

macro_rules! outbox_suite {
    ($backend:ident, $fixture:ty, $conn:ty) => {
        mod $backend {
            use super::*;

            #[tokio::test]
            async fn outbox_rows_commit_with_the_guard_or_not_at_all() {
                let fx = <$fixture>::new().await;
                let schema = fx.store(1).await.schema().clone();
                let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default()).unwrap();
                let payment = ConsumerType::new("payment").unwrap();
                let email = ConsumerType::new("email").unwrap();
                let command = Envelope::new(MessageId::new_v7(), "charge", json!({"order": 1})).unwrap();

                // The handler fails after writing its outbox row: nothing stays.
                let failed = guard
                    .process(&payment, &command, async |conn, _| {
                        let out = <$conn>::message("charged", json!({"order": 1})).unwrap();
                        conn.publish(&email, "order-1", &out).await.unwrap();
                        Err::<serde_json::Value, _>("boom")
                    })
                    .await;
                assert!(matches!(failed, Err(GuardError::Handler("boom"))));
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM sagabox_outbox").await, 0);

                // Applied once, then a duplicate: one row.
                for _ in 0..3 {
                    guard
                        .process(&payment, &command, async |conn, envelope| {
                            let out = <$conn>::message("charged", envelope.payload.clone())
                                .unwrap()
                                .with_saga_id("saga-1");
                            conn.publish(&email, "order-1", &out).await?;
                            Ok::<_, sqlx::Error>(json!({"published": out.id.as_str()}))
                        })
                        .await
                        .unwrap();
                }
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM sagabox_outbox").await, 1);

                let mut conn = fx.pool.acquire().await.unwrap();
                let pending = conn.pending(&schema, 10).await.unwrap();
                assert_eq!(pending.len(), 1);
                let row = &pending[0];
                assert_eq!(row.destination, email);
                assert_eq!(row.aggregate, "order-1");
                assert_eq!(row.envelope.kind, "charged");
                assert_eq!(row.envelope.saga_id.as_deref(), Some("saga-1"));
                assert!(row.envelope.id.uuid_v7_time().is_some(), "the message id is a UUIDv7");
                assert!(conn.mark_sent(&schema, row.seq, Utc::now()).await.unwrap());
                assert!(!conn.mark_sent(&schema, row.seq, Utc::now()).await.unwrap(), "already sent");
                assert!(conn.pending(&schema, 10).await.unwrap().is_empty());
            }

            #[tokio::test]
            async fn pending_rows_come_back_in_publish_order() {
                let fx = <$fixture>::new().await;
                let schema = fx.store(1).await.schema().clone();
                let email = ConsumerType::new("email").unwrap();
                let mut conn = fx.pool.acquire().await.unwrap();
                let mut ids = Vec::new();
                for n in 0..5 {
                    let out = <$conn>::message("notice", json!({"n": n})).unwrap();
                    ids.push(out.id.clone());
                    conn.publish(&email, "agg", &out).await.unwrap();
                }
                let pending = conn.pending(&schema, 3).await.unwrap();
                let got: Vec<_> = pending.iter().map(|r| r.envelope.id.clone()).collect();
                assert_eq!(got, ids[..3]);
                // A second row with an id already used is refused.
                let again = Envelope::new(ids[0].clone(), "notice", json!({})).unwrap();
                assert!(conn.publish(&email, "agg", &again).await.is_err());
            }

            #[tokio::test]
            async fn claimed_rows_come_in_order_and_only_old_sent_rows_are_pruned() {
                let fx = <$fixture>::new().await;
                let schema = fx.store(1).await.schema().clone();
                let email = ConsumerType::new("email").unwrap();
                let mut conn = fx.pool.acquire().await.unwrap();
                for n in 0..4 {
                    let out = <$conn>::message("notice", json!({"n": n})).unwrap();
                    conn.publish(&email, &format!("agg-{}", n % 2), &out).await.unwrap();
                }
                let claimed = conn.claim(&schema, 10).await.unwrap();
                let ns: Vec<_> = claimed.iter().map(|r| r.envelope.payload["n"].as_i64().unwrap()).collect();
                assert_eq!(ns, [0, 1, 2, 3]);
                let long_ago = Utc::now() - chrono::Duration::days(3);
                assert!(conn.mark_sent(&schema, claimed[0].seq, long_ago).await.unwrap());
                assert!(conn.mark_sent(&schema, claimed[1].seq, Utc::now()).await.unwrap());
                let pruned = conn.prune_sent(&schema, Utc::now() - chrono::Duration::days(1)).await.unwrap();
                assert_eq!(pruned, 1, "only the row sent before the cut-off");
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM sagabox_outbox").await, 3);
                assert_eq!(fx.scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NULL").await, 2, "pending rows are never pruned");
            }
        }
    };
}

outbox_suite!(postgres, common::Pg, sqlx::PgConnection);
outbox_suite!(sqlite, common::Lite, sqlx::SqliteConnection);
