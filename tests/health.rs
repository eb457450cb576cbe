//! `/healthz` and `/readyz` beside `/metrics`, on participants with their inbox on the
//! real PostgreSQL: ready once the consumers consume and the database answers; unready
//! while RabbitMQ has closed the consumers' connections, or while a NATS server of the
//! test's own is stopped; ready again once the consumers have reconnected, by themselves.
//!
//! One test: the recorder, the endpoint and the readiness registry are the process's.

#![allow(clippy::unwrap_used)]

mod common;
#[cfg(feature = "nats")]
#[path = "common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;

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
async fn readyz_follows_the_consumers_connections_to_the_brokers() {
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

    #[cfg(feature = "nats")]
    over_nats(&pg, addr).await;
}

/// The same over NATS JetStream, on the endpoint the first participant started: the
/// client reconnects by itself, and the consumer is unready while it cannot.
#[cfg(feature = "nats")]
async fn over_nats(pg: &Pg, addr: std::net::SocketAddr) {
    let mut server = jetstream::OwnServer::start().await;
    let js = jetstream::Js::on(&server.url(), &["ledger"]).await;
    let participant = Participant::new(pg.store(4).await, js.config.clone())
        .step("ledger", Noop)
        .start()
        .await
        .unwrap();
    let stream = js.config.stream(&jetstream::Js::consumer_type("ledger"));
    let ready = readyz_becomes(addr, 200, Duration::from_secs(10)).await;
    assert!(
        ready.contains(&format!("ok consumer {stream} (NATS JetStream)")),
        "{ready}"
    );
    server.stop();
    let unready = readyz_becomes(addr, 503, Duration::from_secs(5)).await;
    assert!(unready.contains("not ready consumer"), "{unready}");
    server.restart().await;
    readyz_becomes(addr, 200, Duration::from_secs(20)).await;
    participant.stop().await.unwrap();
}
