//! The outbox as the relay suites fill and watch it: interleaved `notify` messages for
//! `email` written in one transaction, the rows not yet sent, and the relay settings
//! the suites run with.

use std::time::Duration;

use sagabox::ConsumerType;
use sagabox::outbox::OutboxWriter;
use sagabox::relay::RelayConfig;
use serde_json::json;
use sqlx::PgConnection;

use super::Pg;

/// Writes `per_aggregate` `notify` messages for `email` for each of `aggregates`
/// aggregates (`order-0`, `order-1`, …), interleaved, payload `{"aggregate": a, "n": n}`,
/// in one transaction.
pub async fn write(pg: &Pg, aggregates: usize, per_aggregate: usize) {
    let email = ConsumerType::new("email").expect("consumer type");
    let mut tx = pg.pool.begin().await.expect("begin");
    for n in 0..per_aggregate {
        for a in 0..aggregates {
            let out =
                <PgConnection as OutboxWriter>::message("notify", json!({"aggregate": a, "n": n}))
                    .expect("an outbox message");
            (*tx)
                .publish(&email, &format!("order-{a}"), &out)
                .await
                .expect("written to the outbox");
        }
    }
    tx.commit().await.expect("commit");
}

/// Outbox rows not yet marked sent.
pub async fn unsent(pg: &Pg) -> i64 {
    pg.scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NULL")
        .await
}

/// A relay that polls every 10 ms and takes 20 rows a pass.
pub fn relay_config() -> RelayConfig {
    RelayConfig {
        batch: 20,
        poll_interval: Duration::from_millis(10),
        ..RelayConfig::default()
    }
}
