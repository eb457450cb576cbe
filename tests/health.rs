//! `/healthz` and `/readyz` beside `/metrics`, on a participant consuming from the real
//! RabbitMQ with its inbox on the real PostgreSQL: ready once its consumers consume and
//! its database answers, unready while the broker has closed its connections, ready
//! again once the consumer has reconnected, by itself.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::Pg;
use common::rabbit::Rabbit;
use common::scrape::{get, readyz_becomes};
use sagabox::step::{StepError, StepHandler};
use sagabox::{Envelope, Participant};
use serde_json::{Value, json};
use sqlx::{PgConnection, Postgres};

struct Noop;

impl StepHandler<Postgres> for Noop {
    async fn handle(&self, _: &mut PgConnection, _: &Envelope) -> Result<Value, StepError> {
        Ok(json!(null))
    }
}

#[tokio::test]
async fn readyz_follows_the_consumers_connection_to_the_broker() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["ledger", "notify"]).await);
    let mut config = rabbit.config.clone();
    // A reconnect that waits long enough for the unready state to be seen.
    config.reconnect_backoff = Duration::from_secs(3);
    config.max_reconnect_backoff = Duration::from_secs(3);
    let participant = Participant::new(pg.store(4).await, config)
        .step("ledger", Noop)
        .step("notify", Noop)
        .metrics_addr("127.0.0.1:0")
        .start()
        .await
        .unwrap();
    let addr = participant.metrics_addr().unwrap();
    assert_eq!(
        get(addr, "/healthz").await.unwrap(),
        (200, "ok\n".to_owned())
    );
    let (status, metrics) = get(addr, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert!(metrics.contains("sagabox_build_info"), "{metrics}");

    let ready = readyz_becomes(addr, 200, Duration::from_secs(10)).await;
    for part in [
        "ok database inbox database",
        &format!("ok consumer {} (RabbitMQ)", rabbit.queue("ledger")),
        &format!("ok consumer {} (RabbitMQ)", rabbit.queue("notify")),
    ] {
        assert!(ready.contains(part), "{part:?} not in {ready}");
    }

    for round in 0..2 {
        assert!(rabbit.close_all_connections() >= 2, "round {round}");
        let unready = readyz_becomes(addr, 503, Duration::from_secs(5)).await;
        assert!(
            unready.contains("not ready consumer") && unready.contains("ok database"),
            "round {round}: {unready}"
        );
        assert_eq!(
            get(addr, "/healthz").await.unwrap().0,
            200,
            "alive throughout"
        );
        readyz_becomes(addr, 200, Duration::from_secs(15)).await;
    }

    participant.stop().await.unwrap();
    // Its consumers and database leave the registry: nothing left to be ready for.
    let (status, body) = get(addr, "/readyz").await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("no consumer or database registered"),
        "{body}"
    );
}
