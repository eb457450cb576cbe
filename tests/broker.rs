//! The broker suite, written once and run on RabbitMQ and on NATS JetStream (each
//! scenario is a module with a `rabbitmq` and a `nats` test), against the real servers
//! and real PostgreSQL, through the library's broker-neutral surface (`transport::consume`,
//! `transport::serve_step`, `Dispatcher`, the outbox `Relay`): a message delivered
//! again is applied once, bad input is dead-lettered with its reason while consuming
//! goes on, an ack lost after commit brings a duplicate and no second side effect, a
//! failure is retried and then dead-lettered, a panicking handler is a retry, the
//! orchestrator's repeats get the first answer, the relay publishes every row at
//! least once, in order per aggregate, across several relays, and a producer's
//! `Sender` declares and removes a consumer type's queues.
//!
//! What only one broker has stays in its own suite: `tests/amqp.rs` (queue types and
//! arguments, the management API, refused replies, node lists) and `tests/nats.rs` (the
//! duplicate window, stream retention, dead letters kept in a stream, server restarts).

#![allow(clippy::unwrap_used)]

// Refused rather than skipped: under `cargo test -p sagabox` the library's default features
// leave some of these out, and a suite that silently does not run proves nothing.
#[cfg(not(all(feature = "postgres", feature = "rabbitmq", feature = "nats")))]
compile_error!(
    "tests/broker.rs needs the features postgres, rabbitmq and nats: run `cargo test` at the \
     workspace's root, or `cargo test -p sagabox --all-features`"
);

#[path = "common/broker.rs"]
#[allow(dead_code, unreachable_pub)]
mod broker;
mod common;
#[path = "common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::time::Duration;

use broker::{Broker, Kind};
use common::{Pg, effects, outbox};
use ractor::Actor;
use sagabox::consumer::ConsumerHandle;
use sagabox::delivery::{DeliveryHandler, Disposition};
use sagabox::orchestrator::Dispatch;
use sagabox::relay::{Relay, RelayArguments, RelayMessage};
use sagabox::step::{StepError, StepHandler, StepOutcome, StepPool, StepPoolConfig};
use sagabox::transport::{self, Dispatcher, Sender, Transport};
use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, PostgresStore};
use serde_json::{Value, json};
use sqlx::PgConnection;

/// Runs each scenario, an `async fn(Kind)`, as two tests: `scenario::rabbitmq` and
/// `scenario::nats`.
macro_rules! on_both_brokers {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test]
            async fn rabbitmq() {
                super::$scenario(super::Kind::Amqp).await;
            }

            #[tokio::test]
            async fn nats() {
                super::$scenario(super::Kind::Nats).await;
            }
        }
    )*};
}

on_both_brokers!(
    a_message_delivered_three_times_is_applied_once_and_settled_three_times,
    malformed_messages_are_dead_lettered_with_their_reason_and_consuming_goes_on,
    a_consumer_dropped_between_commit_and_ack_gets_a_duplicate_and_one_side_effect,
    a_retryable_failure_is_delivered_again_then_dead_lettered_when_it_keeps_failing,
    a_handler_that_panics_is_retried_and_the_consumer_goes_on,
    the_orchestrator_reaches_a_step_through_the_broker_and_repeats_get_the_first_answer,
    rows_a_relay_published_before_failing_to_mark_go_again_and_apply_once,
    several_relays_publish_each_row_once_in_order_per_aggregate,
    a_sender_declares_and_removes_a_consumer_types_queues_with_their_dead_letters,
);

const EFFECTS: &str = "CREATE TABLE effects (message_id TEXT NOT NULL, body JSONB NOT NULL)";

fn kinds(kinds: &[&str]) -> BTreeSet<String> {
    kinds.iter().map(|kind| (*kind).to_owned()).collect()
}

fn charge(payload: Value) -> Envelope {
    Envelope::new(MessageId::new_v7(), "charge", payload).unwrap()
}

/// Consumes `consumer_type`'s messages of `kinds` on `transport` with `handler`.
async fn consume(
    transport: &Transport,
    consumer_type: &str,
    kinds_taken: &[&str],
    inbox: Option<&InboxConfig>,
    handler: impl DeliveryHandler,
) -> ConsumerHandle {
    transport::consume(
        transport,
        Broker::consumer_type(consumer_type),
        kinds(kinds_taken),
        inbox,
        handler,
    )
    .await
    .unwrap()
}

/// A consumer of `consumer_type` that runs each message through the guard and writes
/// one `effects` row per applied message (no unique constraint: only the inbox keeps
/// it exact). Counts duplicates in `duplicates`.
async fn guarded_consumer(
    broker: &Broker,
    guard: &InboxGuard<PostgresStore>,
    consumer_type: &str,
    kinds_taken: &[&str],
    duplicates: Arc<AtomicU32>,
) -> ConsumerHandle {
    let handler = effects::guarded(guard, &Broker::consumer_type(consumer_type), duplicates);
    let inbox = Some(guard.config());
    consume(
        &broker.transport(),
        consumer_type,
        kinds_taken,
        inbox,
        handler,
    )
    .await
}

async fn with_effects(
    kind: Kind,
    consumer_types: &[&str],
) -> (Pg, Broker, InboxGuard<PostgresStore>) {
    let (pg, broker) = (Pg::new().await, Broker::new(kind, consumer_types).await);
    pg.exec(EFFECTS).await;
    let guard = InboxGuard::new(pg.store(8).await, InboxConfig::default()).unwrap();
    (pg, broker, guard)
}

async fn a_message_delivered_three_times_is_applied_once_and_settled_three_times(kind: Kind) {
    let (pg, broker, guard) = with_effects(kind, &["payment"]).await;
    broker.declare("payment").await;
    let message = charge(json!({"cents": 100}));
    for _ in 0..3 {
        broker.publish("payment", &message).await;
    }
    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(
        &broker,
        &guard,
        "payment",
        &["charge"],
        Arc::clone(&duplicates),
    )
    .await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("three acks", async || stats.acked.load(SeqCst) == 3).await;
    consumer.stop().await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);
    assert_eq!(duplicates.load(SeqCst), 2);
    assert_eq!(broker.pending("payment").await, 0);
    assert_eq!(broker.dead("payment").await, 0);
}

async fn malformed_messages_are_dead_lettered_with_their_reason_and_consuming_goes_on(kind: Kind) {
    let (pg, broker, guard) = with_effects(kind, &["payment"]).await;
    broker.declare("payment").await;
    let good: &[u8] = br#"{"kind":"charge","payload":{}}"#;
    let bad: [(Option<&str>, &[u8], &str); 6] = [
        (None, good, "missing_message_id"),
        (Some(""), good, "invalid_message_id"),
        (Some("bad\u{7}id"), good, "invalid_message_id"),
        (Some("m-1"), b"\xff not json", "not_an_envelope"),
        (Some("m-2"), br#"{"kind":"charge"}"#, "not_an_envelope"),
        (
            Some("m-3"),
            br#"{"kind":"teleport","payload":{}}"#,
            "unknown_kind",
        ),
    ];
    for (id, body, _) in bad {
        broker.publish_bytes("payment", id, body).await;
    }
    broker
        .publish("payment", &charge(json!({"after": "bad"})))
        .await;

    let consumer = guarded_consumer(&broker, &guard, "payment", &["charge"], Arc::default()).await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("every message settled", async || {
        stats.acked.load(SeqCst) == 1 && stats.dead_lettered.load(SeqCst) == bad.len() as u64
    })
    .await;
    consumer.stop().await;
    assert_eq!(
        pg.scalar("SELECT COUNT(*) FROM effects").await,
        1,
        "the good message after the bad ones was applied"
    );
    let expected: Vec<&str> = bad.iter().map(|(_, _, reason)| *reason).collect();
    assert_eq!(broker.dead_reasons("payment").await, expected);
    assert_eq!(broker.pending("payment").await, 0);
}

async fn a_consumer_dropped_between_commit_and_ack_gets_a_duplicate_and_one_side_effect(
    kind: Kind,
) {
    let (pg, broker, guard) = with_effects(kind, &["payment"]).await;
    broker.declare("payment").await;
    broker.publish("payment", &charge(json!({}))).await;

    // The first consumer commits, then hangs before its ack until it is dropped.
    let (committed, mut committed_rx) = tokio::sync::mpsc::unbounded_channel();
    let crashing = {
        let guard = guard.clone();
        let payment = Broker::consumer_type("payment");
        consume(
            &broker.transport(),
            "payment",
            &["charge"],
            None,
            move |envelope: Envelope| {
                let (guard, payment, committed) =
                    (guard.clone(), payment.clone(), committed.clone());
                async move {
                    guard
                        .process(&payment, &envelope, async |conn, envelope| {
                            sqlx::query("INSERT INTO effects (message_id, body) VALUES ($1, $2)")
                                .bind(envelope.id.as_str())
                                .bind(&envelope.payload)
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, sqlx::Error>(json!({}))
                        })
                        .await
                        .unwrap();
                    committed.send(()).unwrap();
                    std::future::pending::<Disposition>().await
                }
            },
        )
        .await
    };
    committed_rx.recv().await.unwrap();
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);
    crashing.abort();

    // Delivered again to the next consumer: RabbitMQ requeues it when the channel goes,
    // JetStream after its ack_wait.
    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(
        &broker,
        &guard,
        "payment",
        &["charge"],
        Arc::clone(&duplicates),
    )
    .await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("the redelivery", async || stats.acked.load(SeqCst) == 1).await;
    consumer.stop().await;
    assert_eq!(duplicates.load(SeqCst), 1, "the redelivery was a duplicate");
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);
    assert_eq!(broker.pending("payment").await, 0);
}

/// Three deliveries at most: a message failing once is delivered again and settles; one
/// that keeps failing is dead-lettered as `retries_exhausted` after its third delivery
/// (by the consumer on JetStream, by the broker at a quorum queue's delivery limit).
async fn a_retryable_failure_is_delivered_again_then_dead_lettered_when_it_keeps_failing(
    kind: Kind,
) {
    let broker = Broker::new(kind, &["payment"]).await;
    let calls = Arc::new(AtomicU32::new(0));
    let transport = broker.transport().with_max_deliveries(3);
    let flaky = effects::flaky(Arc::clone(&calls));
    let consumer = consume(&transport, "payment", &["charge"], None, flaky).await;
    broker
        .publish("payment", &charge(json!({"flaky": true})))
        .await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("the flaky message delivered again, then done", async || {
        stats.acked.load(SeqCst) == 1 && stats.requeued.load(SeqCst) == 1
    })
    .await;
    broker
        .publish("payment", &charge(json!({"flaky": false})))
        .await;
    common::wait_for("the broken message dead-lettered", async || {
        broker.dead("payment").await == 1
    })
    .await;
    consumer.stop().await;
    assert_eq!(
        calls.load(SeqCst),
        2 + 3,
        "the broken one delivered three times"
    );
    assert_eq!(stats.acked.load(SeqCst), 1);
    assert_eq!(broker.dead_reasons("payment").await, ["retries_exhausted"]);
    assert_eq!(broker.pending("payment").await, 0);
}

/// A handler that panics is a retry, not a delivery left unacked: with one message held
/// at a time, a panic that held its delivery would stall the consumer for good.
async fn a_handler_that_panics_is_retried_and_the_consumer_goes_on(kind: Kind) {
    let broker = Broker::new(kind, &["payment"]).await;
    let calls = Arc::new(AtomicU32::new(0));
    let consumer = {
        let calls = Arc::clone(&calls);
        let transport = broker.transport().with_prefetch(1);
        consume(
            &transport,
            "payment",
            &["charge"],
            None,
            move |envelope: Envelope| {
                let calls = Arc::clone(&calls);
                async move {
                    if envelope.payload["buggy"] == json!(true) {
                        let n = calls.fetch_add(1, SeqCst);
                        if n < 2 {
                            panic!("handler bug on call {n}");
                        }
                    }
                    Disposition::Done { reply: None }
                }
            },
        )
        .await
    };
    for buggy in [true, false, false] {
        broker
            .publish("payment", &charge(json!({ "buggy": buggy })))
            .await;
    }
    let stats = Arc::clone(consumer.stats());
    common::wait_for("all three acked after two panics", async || {
        stats.acked.load(SeqCst) == 3
    })
    .await;
    consumer.stop().await;
    assert_eq!(stats.requeued.load(SeqCst), 2, "each panic was a retry");
    assert_eq!(stats.dead_lettered.load(SeqCst), 0);
    assert_eq!(broker.dead("payment").await, 0);
}

/// A step handler that records each applied charge, and refuses a declined card.
struct Charges;

impl StepHandler<sqlx::Postgres> for Charges {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        if envelope.payload["decline"].as_bool() == Some(true) {
            return Err(StepError::Permanent("card declined".into()));
        }
        sqlx::query("INSERT INTO effects (message_id, body) VALUES ($1, $2)")
            .bind(envelope.id.as_str())
            .bind(&envelope.payload)
            .execute(&mut *conn)
            .await
            .map_err(|error| StepError::Retryable(error.to_string()))?;
        Ok(json!({"charged": envelope.payload["cents"]}))
    }
}

async fn the_orchestrator_reaches_a_step_through_the_broker_and_repeats_get_the_first_answer(
    kind: Kind,
) {
    let (pg, broker, guard) = with_effects(kind, &["payment"]).await;
    let payment = Broker::consumer_type("payment");
    let pool = StepPool::spawn(
        guard.clone(),
        payment.clone(),
        Charges,
        StepPoolConfig::default(),
    )
    .await
    .unwrap();
    let transport = broker.transport();
    let step = transport::serve_step(
        &transport,
        Arc::new(pool),
        kinds(&["charge"]),
        Duration::from_secs(5),
        1,
        guard.config(),
    )
    .await
    .unwrap();
    let dispatch = Arc::new(
        Dispatcher::connect(&transport, ConsumerType::new("orchestrator").unwrap())
            .await
            .unwrap(),
    );

    // Sent five times at once, as retries after lost replies would be: each is answered
    // with the first result (on JetStream the dispatch sends them past the duplicate
    // window), the charge applied once.
    let command = charge(json!({"cents": 700}));
    let mut sends = tokio::task::JoinSet::new();
    for _ in 0..5 {
        let (dispatch, payment, command) =
            (Arc::clone(&dispatch), payment.clone(), command.clone());
        sends.spawn(async move {
            dispatch
                .dispatch(&payment, command, Duration::from_secs(10))
                .await
        });
    }
    let mut answers = 0;
    while let Some(answer) = sends.join_next().await {
        let reply = answer
            .unwrap()
            .unwrap_or_else(|failure| panic!("dispatch failed: {failure}"));
        assert_eq!(reply.outcome, StepOutcome::Done(json!({"charged": 700})));
        answers += 1;
    }
    assert_eq!(answers, 5);
    let declined = charge(json!({"decline": true}));
    let reply = dispatch
        .dispatch(&payment, declined.clone(), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(reply.outcome, StepOutcome::Refused("card declined".into()));
    let again = dispatch
        .dispatch(&payment, declined, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(again.outcome, StepOutcome::Refused("card declined".into()));
    assert!(
        again.duplicate,
        "the second send was answered from the step's inbox"
    );

    dispatch.stop().await;
    step.stop().await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);
    assert_eq!(broker.pending("payment").await, 0);
}

/// Fails every UPDATE of the outbox while `fail_marks` has a row: a relay that
/// published and then could not mark — what a crash between the two leaves.
const FAIL_MARKS: &str = "
CREATE TABLE fail_marks (armed BOOLEAN);
INSERT INTO fail_marks VALUES (true);
CREATE FUNCTION fail_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM fail_marks) THEN RAISE EXCEPTION 'relay crashed before marking'; END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER fail_mark BEFORE UPDATE ON sagabox_outbox FOR EACH ROW EXECUTE FUNCTION fail_mark();";

/// A relay on `source`, polling every 10 ms, 20 rows a pass.
async fn spawn_relay(
    source: sqlx::PgPool,
    transport: Transport,
) -> (ractor::ActorRef<RelayMessage>, tokio::task::JoinHandle<()>) {
    let arguments = RelayArguments {
        source,
        transport,
        config: outbox::relay_config(),
    };
    Actor::spawn(None, Relay::new(), arguments).await.unwrap()
}

async fn rows_a_relay_published_before_failing_to_mark_go_again_and_apply_once(kind: Kind) {
    let (pg, broker, guard) = with_effects(kind, &["email"]).await;
    pg.exec(FAIL_MARKS).await;
    outbox::write(&pg, 1, 5).await;
    let (relay, relay_handle) = spawn_relay(pg.pool.clone(), broker.transport()).await;
    // Published, then the mark fails: the rows stay pending.
    let flushed = ractor::call!(relay, RelayMessage::Flush).unwrap();
    assert!(
        flushed
            .unwrap_err()
            .contains("relay crashed before marking")
    );
    broker.wait_pending("email", 5).await;
    assert_eq!(outbox::unsent(&pg).await, 5);

    pg.exec("DELETE FROM fail_marks").await;
    common::wait_for("the rows marked sent", async || {
        outbox::unsent(&pg).await == 0
    })
    .await;
    relay.stop(None);
    relay_handle.await.unwrap();
    // Published twice: RabbitMQ holds both copies; JetStream's duplicate window dropped
    // the second (same Nats-Msg-Id).
    let stored = match kind {
        Kind::Amqp => 10,
        Kind::Nats => 5,
    };
    broker.wait_pending("email", stored).await;

    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(
        &broker,
        &guard,
        "email",
        &["notify"],
        Arc::clone(&duplicates),
    )
    .await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("every copy delivered", async || {
        stats.acked.load(SeqCst) == stored
    })
    .await;
    consumer.stop().await;
    assert_eq!(u64::from(duplicates.load(SeqCst)), stored - 5);
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 5);
    assert_eq!(
        pg.scalar("SELECT COUNT(DISTINCT message_id) FROM effects")
            .await,
        5
    );
    assert_eq!(broker.pending("email").await, 0);
}

/// Four relays, two connections each, drain one outbox at once, three times over: each
/// row reaches the broker once, and each aggregate's messages in the order written.
async fn several_relays_publish_each_row_once_in_order_per_aggregate(kind: Kind) {
    const AGGREGATES: usize = 8;
    const PER_AGGREGATE: usize = 40;
    for round in 0..3 {
        let (pg, broker) = (Pg::new().await, Broker::new(kind, &["email"]).await);
        outbox::write(&pg, AGGREGATES, PER_AGGREGATE).await;
        let mut relays = Vec::new();
        for _ in 0..4 {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(&pg.url)
                .await
                .unwrap();
            relays.push(spawn_relay(pool, broker.transport()).await);
        }
        common::wait_for("every row sent", async || outbox::unsent(&pg).await == 0).await;
        for (relay, handle) in relays {
            relay.stop(None);
            handle.await.unwrap();
        }
        let total = (AGGREGATES * PER_AGGREGATE) as u64;
        broker.wait_pending("email", total).await;
        let mut seen: HashMap<u64, Vec<u64>> = HashMap::new();
        for envelope in broker.stored("email").await {
            seen.entry(envelope.payload["aggregate"].as_u64().unwrap())
                .or_default()
                .push(envelope.payload["n"].as_u64().unwrap());
        }
        assert_eq!(seen.len(), AGGREGATES, "round {round}");
        for (aggregate, ns) in seen {
            let expected: Vec<u64> = (0..PER_AGGREGATE as u64).collect();
            assert_eq!(
                ns, expected,
                "round {round}: aggregate {aggregate} out of order or repeated"
            );
        }
    }
}

/// A producer's sender creates a consumer type's queue or stream, and its dead letters',
/// before any consumer runs; removing deletes both with what they hold, removing them
/// again is no error, and a send after a removal declares them anew.
async fn a_sender_declares_and_removes_a_consumer_types_queues_with_their_dead_letters(kind: Kind) {
    let broker = Broker::new(kind, &["scratch"]).await;
    let scratch = Broker::consumer_type("scratch");
    let mut sender = Sender::connect(&broker.transport(), "declaring")
        .await
        .unwrap();
    assert_eq!(broker.exists("scratch").await, (false, false));
    sender.declare(&scratch).await.unwrap();
    assert_eq!(broker.exists("scratch").await, (true, true));
    sender.send(&scratch, &charge(json!({}))).await.unwrap();
    broker.wait_pending("scratch", 1).await;

    sender.remove(&scratch).await.unwrap();
    assert_eq!(broker.exists("scratch").await, (false, false));
    sender.remove(&scratch).await.unwrap();

    sender.send(&scratch, &charge(json!({}))).await.unwrap();
    assert_eq!(broker.exists("scratch").await, (true, true));
    broker.wait_pending("scratch", 1).await;
    sender.close().await;
}
