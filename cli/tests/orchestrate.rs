//! `sagabox orchestrate --saga sagas/trip.toml`, the built binary, drives trip sagas
//! whose participants run in another process (this test's, on the `Participant`
//! runtime), over a real RabbitMQ and a
//! real PostgreSQL: a start message delivered twice makes one saga and both deliveries
//! are answered with its id; a trip without a car is compensated, the hotel cancelled
//! before the flight. And `sagabox serve --role all` runs checkout sagas from start
//! messages the same way. Every check reads the participants' tables and
//! `sagabox_saga_instances`.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeSet;
use std::process::Stdio;
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use sagabox::MessageId;
use sagabox::amqp::codec;
use sagabox::orchestrate::{STARTED_KIND, start_queue};
use sagabox_trip::Trip;

const BOUND: Duration = Duration::from_secs(60);

/// Waits until `sagas` sagas are completed or compensated, while `driver` (named `what`)
/// keeps running; panics after [`BOUND`].
async fn wait_finished(fx: &common::Pg, driver: &mut std::process::Child, what: &str, sagas: i64) {
    let deadline = Instant::now() + BOUND;
    loop {
        let finished = fx
            .scalar(
                "SELECT COUNT(*) FROM sagabox_saga_instances WHERE status IN ('completed', 'compensated')",
            )
            .await;
        if finished == sagas {
            return;
        }
        assert!(
            matches!(driver.try_wait(), Ok(None)),
            "{what} exited while driving"
        );
        assert!(
            Instant::now() < deadline,
            "{finished} of {sagas} sagas finished"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orchestrate_drives_trips_whose_participants_run_elsewhere_and_a_repeated_start_makes_one_saga()
 {
    let fx = common::Pg::new().await;
    let rabbit =
        common::rabbit::Rabbit::new(&["flight", "hotel", "car", "notify", "trip.start"]).await;
    fx.exec(sagabox_trip::schema::POSTGRES).await;

    // The participants: this process, on the runtime, over the broker.
    let participants = sagabox_trip::participant(fx.store(8).await, rabbit.config.clone())
        .workers(2)
        .start()
        .await
        .unwrap();

    // The orchestrator: the built binary.
    let saga_file = concat!(env!("CARGO_MANIFEST_DIR"), "/../sagas/trip.toml");
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], common::scrape::free_port()));
    let orchestrator = std::process::Command::new(common::sagabox_bin())
        .args([
            "orchestrate",
            "--metrics-addr",
            &metrics.to_string(),
            "--saga",
            saga_file,
            "--transport",
            &rabbit.config.url,
            "--database-url",
            &fx.url,
            "--queue-prefix",
            &rabbit.config.queue_prefix,
            "--resume-interval-ms",
            "200",
            "--ttl-days",
            "45",
            "--partitions-ahead",
            "4",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut children = common::children::Children::new(vec![orchestrator]);
    let starts = start_queue(&rabbit.config.clone().into(), "trip").unwrap();
    let deadline = Instant::now() + BOUND;
    while rabbit.consumers(&starts).await == 0 {
        assert!(
            matches!(children[0].try_wait(), Ok(None)),
            "orchestrate exited before consuming {starts}"
        );
        assert!(
            Instant::now() < deadline,
            "orchestrate never consumed {starts}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Ready: its database answers and its consumers consume.
    let ready = common::scrape::readyz_becomes(metrics, 200, BOUND).await;
    assert!(
        ready.contains("ok database inbox database")
            && ready.contains(&format!("ok consumer {starts} (RabbitMQ)")),
        "{ready}"
    );
    assert_eq!(
        common::scrape::get(metrics, "/healthz").await.unwrap().0,
        200
    );
    // Its pruner's pass at start made the inbox's months up to the fourth ahead (the
    // participants' migration made two).
    let fourth_ahead = "SELECT COUNT(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'sagabox_inbox'::regclass AND c.relname = 'sagabox_inbox_' || \
         to_char(date_trunc('month', now() AT TIME ZONE 'UTC') + interval '4 months', 'YYYY_MM')";
    let deadline = Instant::now() + BOUND;
    while fx.scalar(fourth_ahead).await < 1 {
        assert!(
            Instant::now() < deadline,
            "orchestrate's pruner never created the fourth month ahead"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Its history pass at start made the saga history's partitions of this month and the
    // two ahead (beside the default one).
    let deadline = Instant::now() + BOUND;
    while fx
        .scalar(
            "SELECT COUNT(*) FROM pg_inherits WHERE inhparent = 'sagabox_saga_events'::regclass",
        )
        .await
        < 4
    {
        assert!(Instant::now() < deadline, "no history partitions created");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Each start request sent twice, the same message id; answers to a queue of ours.
    let answers = format!("{}.answers", rabbit.config.queue_prefix);
    rabbit
        .channel
        .queue_declare(
            answers.as_str().into(),
            // Exclusive: gone with the fixture's connection (an auto-delete queue that
            // nobody ever consumed from would stay).
            QueueDeclareOptions {
                exclusive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let trips = [
        Trip::new("t-ok", "Ada", "Lisbon"),
        Trip::new("t-nocar", "Grace", "Porto").without_car(),
    ];
    let mut requests = Vec::new();
    for trip in &trips {
        let request = trip.start_message(MessageId::new_v7()).unwrap();
        let (body, properties) = codec::encode(&request);
        let properties: BasicProperties = properties.with_reply_to(answers.as_str().into());
        for _ in 0..2 {
            rabbit.publish_raw(&starts, &body, properties.clone()).await;
        }
        requests.push(request);
    }

    // Both sagas end; one row each.
    wait_finished(&fx, &mut children[0], "orchestrate", 2).await;
    assert_eq!(
        fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances")
            .await,
        2,
        "one saga per start request"
    );
    assert_eq!(
        fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'completed'")
            .await,
        1
    );
    assert_eq!(
        fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'compensated'")
            .await,
        1
    );

    // Four answers, two per request, each naming its request's saga.
    rabbit.wait_ready(&answers, 4).await;
    let mut named = std::collections::BTreeMap::<String, BTreeSet<String>>::new();
    for message in rabbit.drain(&answers).await {
        let answer = codec::decode(
            &message.delivery.properties,
            &message.delivery.data,
            &BTreeSet::new(),
        )
        .unwrap();
        assert_eq!(answer.kind, STARTED_KIND);
        let correlation = message
            .delivery
            .properties
            .correlation_id()
            .as_ref()
            .map(|id| id.to_string())
            .unwrap_or_default();
        named
            .entry(correlation)
            .or_default()
            .insert(answer.payload["saga_id"].as_str().unwrap().to_owned());
    }
    assert_eq!(
        named.len(),
        2,
        "answers correlated to both requests: {named:?}"
    );
    for (request, sagas) in &named {
        assert_eq!(
            sagas.len(),
            1,
            "request {request} answered with one saga id: {sagas:?}"
        );
    }

    // The participants' own tables: once each, the hotel cancelled before the flight.
    assert_eq!(fx.scalar("SELECT COUNT(*) FROM flight_bookings").await, 2);
    assert_eq!(fx.scalar("SELECT COUNT(*) FROM hotel_bookings").await, 2);
    assert_eq!(fx.scalar("SELECT COUNT(*) FROM car_rentals").await, 1);
    assert_eq!(fx.scalar("SELECT COUNT(*) FROM notifications").await, 1);
    assert_eq!(
        fx.scalar(
            "SELECT COUNT(*) FROM flight_bookings WHERE status = 'cancelled' AND cancellations = 1"
        )
        .await,
        1
    );
    assert_eq!(
        fx.scalar(
            "SELECT COUNT(*) FROM hotel_bookings h JOIN flight_bookings f ON f.trip_id = h.trip_id \
             WHERE h.status = 'cancelled' AND h.cancellations = 1 AND h.cancel_seq < f.cancel_seq"
        )
        .await,
        1,
        "the hotel is cancelled once, before the flight"
    );

    // SIGTERM: it stops cleanly.
    let status = common::children::stop(&mut children[0], "orchestrate", BOUND).await;
    assert!(status.success(), "orchestrate ended with {status}");
    let report = participants.stop().await.unwrap();
    assert!(format!("{report:?}").contains("flight"), "{report:?}");
    drop(requests);
}

/// `sagabox serve --role all` is a whole checkout service in one process: the three
/// participants on the runtime and an orchestrator that starts sagas from start messages.
/// Each start sent twice makes one saga. The paid order is charged, taken from stock and
/// confirmed once; the declined one is never charged; the one larger than the stock is
/// charged, then refunded once (the payment's compensation), nothing taken from stock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_all_runs_checkout_sagas_from_start_messages_once_each() {
    let fx = common::Pg::new().await;
    let rabbit =
        common::rabbit::Rabbit::new(&["payment", "inventory", "email", "checkout.start"]).await;
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], common::scrape::free_port()));
    let serve = std::process::Command::new(common::sagabox_bin())
        .args([
            "serve",
            "--metrics-addr",
            &metrics.to_string(),
            "--role",
            "all",
            "--transport",
            &rabbit.config.url,
            "--database-url",
            &fx.url,
            "--queue-prefix",
            &rabbit.config.queue_prefix,
        ])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut children = common::children::Children::new(vec![serve]);
    let starts = start_queue(&rabbit.config.clone().into(), "checkout").unwrap();
    let deadline = Instant::now() + BOUND;
    while rabbit.consumers(&starts).await == 0
        || rabbit.consumers(&rabbit.queue("email")).await == 0
    {
        assert!(
            matches!(children[0].try_wait(), Ok(None)),
            "serve exited before consuming"
        );
        assert!(Instant::now() < deadline, "serve never consumed {starts}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ready = common::scrape::readyz_becomes(metrics, 200, BOUND).await;
    for consumer in [
        starts.clone(),
        rabbit.queue("payment"),
        rabbit.queue("email"),
    ] {
        assert!(
            ready.contains(&format!("ok consumer {consumer} (RabbitMQ)")),
            "{consumer}: {ready}"
        );
    }
    // serve created the tables before it consumed.
    fx.exec("INSERT INTO inventory (sku, initial, on_hand) VALUES ('sku-apple', 10, 10)")
        .await;
    for (order, quantity, decline) in [
        ("o-paid", 3, false),
        ("o-declined", 3, true),
        ("o-large", 50, false),
    ] {
        let start = sagabox::Envelope::new(
            MessageId::new_v7(),
            "checkout",
            serde_json::json!({"order_id": order, "sku": "sku-apple", "quantity": quantity,
                               "amount_cents": 1250, "decline": decline}),
        )
        .unwrap();
        let (body, properties) = codec::encode(&start);
        for _ in 0..2 {
            rabbit.publish_raw(&starts, &body, properties.clone()).await;
        }
    }
    wait_finished(&fx, &mut children[0], "serve", 3).await;
    for (sql, expected) in [
        ("SELECT COUNT(*) FROM sagabox_saga_instances", 3),
        (
            "SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'completed'",
            1,
        ),
        (
            "SELECT COUNT(*) FROM payment_charges WHERE kind = 'charge'",
            2,
        ),
        (
            "SELECT COUNT(*) FROM payment_charges WHERE order_id = 'o-declined'",
            0,
        ),
        (
            "SELECT COUNT(*) FROM payment_charges WHERE order_id = 'o-large' AND kind = 'refund' AND amount_cents = 1250",
            1,
        ),
        (
            "SELECT COUNT(*) FROM payment_charges WHERE kind = 'refund'",
            1,
        ),
        ("SELECT COUNT(*) FROM inventory_moves", 1),
        (
            "SELECT COUNT(*) FROM emails_sent WHERE order_id = 'o-paid'",
            1,
        ),
        ("SELECT COUNT(*) FROM emails_sent", 1),
        ("SELECT on_hand FROM inventory WHERE sku = 'sku-apple'", 7),
    ] {
        assert_eq!(fx.scalar(sql).await, expected, "{sql}");
    }

    let status = common::children::stop(&mut children[0], "serve", BOUND).await;
    assert!(status.success(), "serve ended with {status}");
}
