//! What only the RabbitMQ transport has, against a real broker and real PostgreSQL (what
//! every broker does is `tests/broker.rs`): retries counted by a quorum queue's delivery
//! limit or by the consumer on a classic queue, queue types and arguments refused or
//! kept, retention checked against the inbox, a refused reply handed back, a silent
//! broker as a timeout, connections closed under consumers and relays, batched claims,
//! the relay woken by PostgreSQL's `NOTIFY` and riding through database cuts, node lists.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::time::Duration;

use common::rabbit::Rabbit;
use common::{Pg, effects, outbox};
use lapin::BasicProperties;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use ractor::Actor;
use sagabox::amqp::{
    AmqpConfig, AmqpDispatch, AmqpError, Consumer, ConsumerOptions, DeadLetterQueue, QueueType,
    codec,
};
use sagabox::consumer::ConsumerHandle;
use sagabox::dead_reason::DEAD_REASON_HEADER;
use sagabox::delivery::Disposition;
use sagabox::orchestrator::Dispatch;
use sagabox::outbox::OutboxWriter;
use sagabox::relay::{Relay, RelayArguments, RelayConfig};
use sagabox::retention::RetentionError;
use sagabox::step::StepFailure;
use sagabox::transport::{Sender, TransportError};
use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, PostgresStore};
use serde_json::{Value, json};
use sqlx::PgConnection;

const EFFECTS: &str = "CREATE TABLE effects (message_id TEXT NOT NULL, body JSONB NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())";

/// A consumer of `consumer_type` that runs each message through the guard and writes
/// one `effects` row per applied message (no unique constraint: only the inbox keeps
/// it exact). Counts duplicates in `duplicates`.
async fn guarded_consumer(
    config: &AmqpConfig,
    guard: &InboxGuard<PostgresStore>,
    consumer_type: &str,
    kinds: &[&str],
    duplicates: Arc<AtomicU32>,
) -> ConsumerHandle {
    let consumer_type = ConsumerType::new(consumer_type).unwrap();
    let options = ConsumerOptions::new(consumer_type.clone(), kinds.iter().copied());
    let handler = effects::guarded(guard, &consumer_type, duplicates);
    Consumer::spawn(config.clone(), options, handler)
        .await
        .unwrap()
}

fn message(id: &str, kind: &str, payload: Value) -> (Vec<u8>, BasicProperties) {
    codec::encode(&Envelope::new(MessageId::new(id).unwrap(), kind, payload).unwrap())
}

/// A relay whose poll never comes (an hour) publishes on PostgreSQL's `NOTIFY` alone:
/// the rows committed before it listened, each later commit, and again after its
/// listening connection is killed; a rolled-back write wakes it to nothing. A relay told
/// not to listen leaves the same rows to its poll.
#[tokio::test]
async fn a_relay_is_woken_by_commits_without_its_poll_and_after_its_listener_is_killed() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["email"]).await);
    let spawn = async |listen: bool| {
        Actor::spawn(
            None,
            Relay::new(),
            RelayArguments {
                source: pg.pool.clone(),
                transport: rabbit.config.clone().into(),
                config: RelayConfig {
                    poll_interval: Duration::from_secs(3600),
                    listen,
                    ..outbox::relay_config()
                },
            },
        )
        .await
        .unwrap()
    };
    let listening = || async {
        pg.scalar(
            "SELECT COUNT(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND query LIKE 'LISTEN%'",
        )
        .await
            == 1
    };

    // Told not to listen: nothing but its poll would publish.
    outbox::write(&pg, 1, 3).await;
    let (deaf, deaf_handle) = spawn(false).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        outbox::unsent(&pg).await,
        3,
        "a relay that does not listen waits for its poll"
    );
    deaf.stop(None);
    deaf_handle.await.unwrap();

    let (relay, handle) = spawn(true).await;
    common::wait_for("the rows from before it listened sent", async || {
        outbox::unsent(&pg).await == 0
    })
    .await;
    for round in 1..=3 {
        outbox::write(&pg, 2, round).await;
        common::wait_for("a commit's rows sent", async || {
            outbox::unsent(&pg).await == 0
        })
        .await;
    }
    let mut tx = pg.pool.begin().await.unwrap();
    let out = <PgConnection as OutboxWriter>::message("notify", json!({"rolled": "back"})).unwrap();
    (*tx)
        .publish(&ConsumerType::new("email").unwrap(), "order-x", &out)
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    // Its listening connection killed: it listens again, and commits wake it again.
    common::wait_for("the relay listening", listening).await;
    pg.exec(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .await;
    common::wait_for("the relay listening again", listening).await;
    outbox::write(&pg, 1, 4).await;
    common::wait_for("rows sent after the kill", async || {
        outbox::unsent(&pg).await == 0
    })
    .await;
    relay.stop(None);
    handle.await.unwrap();

    rabbit
        .wait_ready(&rabbit.queue("email"), 3 + 2 * (1 + 2 + 3) + 4)
        .await;
    assert_eq!(
        pg.scalar("SELECT COUNT(*) FROM sagabox_outbox").await,
        19,
        "the rolled-back row was never written"
    );
}

/// A reply the broker refuses to confirm (its queue full, rejecting publishes) leaves
/// the command unsettled on a live connection: the consumer hands it back, so it is
/// delivered again, and settles once the reply can go.
#[tokio::test]
async fn a_command_whose_reply_is_refused_is_handed_back_and_delivered_again() {
    let rabbit = Rabbit::new(&["payment"]).await;
    rabbit.declare("payment").await;
    let full = format!("{}.full-replies", rabbit.config.queue_prefix);
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    rabbit
        .channel
        .queue_declare(
            full.as_str().into(),
            QueueDeclareOptions::default(),
            arguments,
        )
        .await
        .unwrap();
    let deliveries = Arc::new(AtomicU32::new(0));
    let options = ConsumerOptions::new(ConsumerType::new("payment").unwrap(), ["charge"]);
    let consumer = Consumer::spawn(rabbit.config.clone(), options, {
        let deliveries = Arc::clone(&deliveries);
        move |_: Envelope| {
            deliveries.fetch_add(1, SeqCst);
            async {
                let reply = Envelope::new(MessageId::new_v7(), "reply", json!({})).unwrap();
                Disposition::Done { reply: Some(reply) }
            }
        }
    })
    .await
    .unwrap();
    let (body, properties) = message(MessageId::new_v7().as_str(), "charge", json!({}));
    rabbit
        .publish_raw(
            &rabbit.queue("payment"),
            &body,
            properties.with_reply_to(full.as_str().into()),
        )
        .await;
    common::wait_for(
        "the command delivered again after its refused reply",
        async || deliveries.load(SeqCst) >= 2,
    )
    .await;
    // Room for the reply: the next delivery settles and the queue drains.
    rabbit
        .channel
        .queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let stats = Arc::clone(consumer.stats());
    common::wait_for("the command acked", async || stats.acked.load(SeqCst) == 1).await;
    consumer.stop().await;
    assert_eq!(rabbit.ready(&rabbit.queue("payment")).await, 0);
    assert_eq!(rabbit.ready(&rabbit.dead_queue("payment")).await, 0);
}

/// A broker connection that stops answering (every byte held, as behind a node that
/// accepts but no longer serves) fails the dispatch within its timeout, as a retryable
/// failure, instead of holding the saga's next command for ever.
#[tokio::test]
async fn a_dispatch_whose_broker_stops_answering_fails_within_its_timeout() {
    use common::proxy::FaultProxy;

    let rabbit = Rabbit::new(&["payment"]).await;
    let proxy = FaultProxy::in_front_of(&rabbit.config.url).await;
    let mut config = rabbit.config.clone();
    config.url = proxy.url(&rabbit.config.url);
    let dispatch = AmqpDispatch::connect(config, ConsumerType::new("orchestrator").unwrap())
        .await
        .unwrap();
    proxy.set_delay(Duration::from_secs(60));
    let payment = ConsumerType::new("payment").unwrap();
    let command = Envelope::new(MessageId::new_v7(), "charge", json!({})).unwrap();
    let sent = dispatch.dispatch(&payment, command, Duration::from_secs(2));
    let failure = tokio::time::timeout(Duration::from_secs(20), sent)
        .await
        .expect("the dispatch ended instead of waiting on the silent connection")
        .unwrap_err();
    assert!(
        matches!(&failure, StepFailure::Retryable(reason) if reason.contains("did not answer")),
        "{failure}"
    );
    // Not stopped: its connections are held behind the proxy; the runtime ends them.
    drop(dispatch);
}

#[tokio::test]
async fn the_relay_reconnects_after_the_broker_closes_its_connection() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["email"]).await);
    outbox::write(&pg, 4, 25).await;
    let (relay, relay_handle) = Actor::spawn(
        None,
        Relay::new(),
        RelayArguments {
            source: pg.pool.clone(),
            transport: rabbit.config.clone().into(),
            config: outbox::relay_config(),
        },
    )
    .await
    .unwrap();
    common::wait_for("the first wave sent", async || {
        pg.scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NULL")
            .await
            == 0
    })
    .await;
    assert_eq!(
        rabbit.close_connections("relay"),
        1,
        "the relay's connection was found and closed"
    );
    outbox::write(&pg, 4, 25).await;
    common::wait_for("the second wave sent after reconnecting", async || {
        pg.scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NULL")
            .await
            == 0
    })
    .await;
    relay.stop(None);
    relay_handle.await.unwrap();
    rabbit.wait_ready(&rabbit.queue("email"), 200).await;
    let ids: std::collections::HashSet<String> = rabbit
        .drain(&rabbit.queue("email"))
        .await
        .iter()
        .map(|message| {
            message
                .delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids.len(), 200);
}

#[tokio::test]
async fn a_consumer_whose_connection_is_closed_reconnects_and_applies_each_message_once() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = InboxGuard::new(pg.store(8).await, InboxConfig::default()).unwrap();
    rabbit.declare("payment").await;
    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(
        &rabbit.config,
        &guard,
        "payment",
        &["charge"],
        Arc::clone(&duplicates),
    )
    .await;
    let stats = Arc::clone(consumer.stats());
    let ids: Vec<MessageId> = (0..400).map(|_| MessageId::new_v7()).collect();
    for (n, id) in ids.iter().enumerate() {
        let (body, properties) = message(id.as_str(), "charge", json!({"n": n}));
        rabbit
            .publish_raw(&rabbit.queue("payment"), &body, properties)
            .await;
        if n == 150 {
            // Closed once the consumer is consuming (a close during its subscribing
            // would be a failed subscription, not a lost one): messages are in flight,
            // some applied and not yet acked, some unacked.
            common::wait_for("the first messages applied", async || {
                pg.scalar("SELECT COUNT(*) FROM effects").await >= 20
            })
            .await;
            assert_eq!(rabbit.close_connections("consumer payment"), 1);
        }
    }
    common::wait_for("every message applied", async || {
        pg.scalar("SELECT COUNT(DISTINCT message_id) FROM effects")
            .await
            == 400
    })
    .await;
    common::wait_for("the queue drained", async || {
        rabbit.ready(&rabbit.queue("payment")).await == 0
    })
    .await;
    consumer.stop().await;
    assert!(stats.sessions.load(SeqCst) >= 2, "it reconnected");
    assert_eq!(
        pg.scalar("SELECT COUNT(*) FROM effects").await,
        400,
        "none applied twice"
    );
    assert_eq!(rabbit.ready(&rabbit.dead_queue("payment")).await, 0);
}

#[tokio::test]
async fn stopping_a_consumer_lets_the_messages_in_flight_finish_and_be_acked() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = InboxGuard::new(pg.store(8).await, InboxConfig::default()).unwrap();
    rabbit.declare("payment").await;
    let started = Arc::new(AtomicU32::new(0));
    let consumer = {
        let (guard, started) = (guard.clone(), Arc::clone(&started));
        let payment = ConsumerType::new("payment").unwrap();
        Consumer::spawn(
            rabbit.config.clone(),
            ConsumerOptions::new(payment.clone(), ["charge"]),
            move |envelope: Envelope| {
                let (guard, payment, started) =
                    (guard.clone(), payment.clone(), Arc::clone(&started));
                async move {
                    guard
                        .process(&payment, &envelope, async |conn, envelope| {
                            started.fetch_add(1, SeqCst);
                            // A slow handler: still running when the stop comes.
                            tokio::time::sleep(Duration::from_millis(500)).await;
                            sqlx::query("INSERT INTO effects (message_id, body) VALUES ($1, $2)")
                                .bind(envelope.id.as_str())
                                .bind(&envelope.payload)
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, sqlx::Error>(json!({}))
                        })
                        .await
                        .unwrap();
                    Disposition::Done { reply: None }
                }
            },
        )
        .await
        .unwrap()
    };
    for n in 0..5 {
        let (body, properties) = message(MessageId::new_v7().as_str(), "charge", json!({"n": n}));
        rabbit
            .publish_raw(&rabbit.queue("payment"), &body, properties)
            .await;
    }
    common::wait_for("five handlers running", async || started.load(SeqCst) == 5).await;
    let stats = Arc::clone(consumer.stats());
    consumer.stop().await;
    assert_eq!(
        stats.acked.load(SeqCst),
        5,
        "every message in flight was finished and acked"
    );
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 5);
    assert_eq!(rabbit.ready(&rabbit.queue("payment")).await, 0);
}

#[tokio::test]
async fn a_batching_consumer_claims_what_it_holds_in_batches_and_applies_each_message_once() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = InboxGuard::new(pg.store(8).await, InboxConfig::default()).unwrap();
    rabbit.declare("payment").await;
    // 300 distinct messages, 100 of them published twice.
    let ids: Vec<MessageId> = (0..300).map(|_| MessageId::new_v7()).collect();
    for (n, id) in ids.iter().chain(ids.iter().take(100)).enumerate() {
        let (body, properties) = message(id.as_str(), "charge", json!({"n": n}));
        rabbit
            .publish_raw(&rabbit.queue("payment"), &body, properties)
            .await;
    }
    let batches = Arc::new(AtomicU32::new(0));
    let duplicates = Arc::new(AtomicU32::new(0));
    let payment = ConsumerType::new("payment").unwrap();
    let handler = {
        let (batches, duplicates, payment) = (
            Arc::clone(&batches),
            Arc::clone(&duplicates),
            payment.clone(),
        );
        sagabox::batching::Batching::new(
            50,
            Duration::from_millis(5),
            move |envelopes: Vec<Envelope>| {
                let (guard, batches, duplicates, payment) = (
                    guard.clone(),
                    Arc::clone(&batches),
                    Arc::clone(&duplicates),
                    payment.clone(),
                );
                async move {
                    batches.fetch_add(1, SeqCst);
                    let processed = guard
                        .process_batch(&payment, &envelopes, async |conn, envelope| {
                            sqlx::query("INSERT INTO effects (message_id, body) VALUES ($1, $2)")
                                .bind(envelope.id.as_str())
                                .bind(&envelope.payload)
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, sqlx::Error>(json!({}))
                        })
                        .await;
                    match processed {
                        Ok(outcomes) => outcomes
                            .into_iter()
                            .map(|outcome| match outcome {
                                Ok(outcome) => {
                                    if outcome.is_duplicate() {
                                        duplicates.fetch_add(1, SeqCst);
                                    }
                                    Disposition::Done { reply: None }
                                }
                                Err(refused) => Disposition::Reject(refused.to_string()),
                            })
                            .collect(),
                        Err(error) => envelopes
                            .iter()
                            .map(|_| Disposition::Retry(error.to_string()))
                            .collect(),
                    }
                }
            },
        )
    };
    let mut config = rabbit.config.clone();
    config.prefetch = 100;
    let consumer = Consumer::spawn(config, ConsumerOptions::new(payment, ["charge"]), handler)
        .await
        .unwrap();
    let stats = Arc::clone(consumer.stats());
    common::wait_for("every delivery acked", async || {
        stats.acked.load(SeqCst) == 400
    })
    .await;
    consumer.stop().await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 300);
    assert_eq!(
        pg.scalar("SELECT COUNT(DISTINCT message_id) FROM effects")
            .await,
        300
    );
    assert_eq!(duplicates.load(SeqCst), 100);
    let batches = batches.load(SeqCst);
    assert!(
        batches < 400 / 2,
        "deliveries were claimed in batches ({batches} batches for 400)"
    );
    assert_eq!(rabbit.ready(&rabbit.queue("payment")).await, 0);
}

/// The relay with its database behind a proxy that cuts connections (mid-pass too:
/// after publishing, before the mark commits) and refuses new ones for a while: every
/// row is published, and sent once the database is back; a row published twice is a
/// repeat the consumer's inbox absorbs (same message id).
#[tokio::test]
async fn the_relay_rides_through_database_cuts_and_refusals() {
    use common::proxy::FaultProxy;
    use rand::{RngExt, SeedableRng};

    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["email"]).await);
    let proxy = Arc::new(FaultProxy::in_front_of(&pg.url).await);
    let through: sqlx::postgres::PgConnectOptions = proxy.url(&pg.url).parse().unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(5))
        .test_before_acquire(false)
        .connect_with(through)
        .await
        .unwrap();
    let (relay, relay_handle) = Actor::spawn(
        None,
        Relay::new(),
        RelayArguments {
            source: pool,
            transport: rabbit.config.clone().into(),
            config: outbox::relay_config(),
        },
    )
    .await
    .unwrap();
    let seed: u64 = rand::random();
    let chaos = {
        let (proxy, pool) = (Arc::clone(&proxy), pg.pool.clone());
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let sent = async || {
                sqlx::query_scalar::<_, i64>(
                    "SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NOT NULL",
                )
                .fetch_one(&pool)
                .await
                .unwrap_or(0)
            };
            for round in 0u32.. {
                // Each fault waits for an amount of work (more rows sent), not a span of
                // time: the faults land while rows are still going out, however fast
                // the relay is.
                let target = sent().await + rng.random_range(5..=30);
                while sent().await < target {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                if round % 7 == 6 {
                    proxy.refuse();
                    proxy.cut();
                    tokio::time::sleep(Duration::from_millis(rng.random_range(100..400))).await;
                    proxy.accept();
                } else {
                    proxy.cut();
                }
            }
        })
    };
    for _ in 0..8 {
        outbox::write(&pg, 10, 5).await; // through the direct pool: 50 rows a wave
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    common::wait_for(
        "every row sent while the database connection is cut again and again",
        async || {
            pg.scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NULL")
                .await
                == 0
        },
    )
    .await;
    chaos.abort();
    relay.stop(None);
    relay_handle.await.unwrap();
    assert!(
        proxy.cuts() >= 3,
        "seed {seed}: the faults happened ({} cuts)",
        proxy.cuts()
    );
    let ids: Vec<String> = rabbit
        .drain(&rabbit.queue("email"))
        .await
        .iter()
        .map(|message| {
            message
                .delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .to_string()
        })
        .collect();
    let distinct: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), 400, "seed {seed}: every row published");
    eprintln!(
        "seed {seed}: {} cuts, {} publishes for 400 rows",
        proxy.cuts(),
        ids.len()
    );
}

/// A peer that accepts the TCP connection but never speaks AMQP (a wrong port, a hung
/// broker): `connect` gives up after its bound with a typed timeout that names the URL
/// without its password, instead of leaving a consumer or relay waiting forever.
#[tokio::test]
async fn a_broker_that_never_answers_is_a_connect_timeout_not_a_hang() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let silent_peer = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let config =
        sagabox::amqp::AmqpConfig::new(format!("amqp://guest:s3cret-pw@127.0.0.1:{port}/%2f"));
    let started = std::time::Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        Sender::connect(&config.into(), "silent"),
    )
    .await
    .expect("connect must give up on its own");
    let Err(error) = outcome else {
        panic!("a silent peer cannot complete the AMQP handshake");
    };
    assert!(
        matches!(
            error,
            TransportError::Amqp(AmqpError::ConnectTimeout { .. })
        ),
        "{error}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(9),
        "{:?}",
        started.elapsed()
    );
    let text = error.to_string();
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(!text.contains("s3cret-pw"), "{text}");
    silent_peer.abort();
}

/// A consumer of `consumer_type` on `config` running [`effects::flaky`].
async fn flaky_consumer(
    config: sagabox::amqp::AmqpConfig,
    consumer_type: &str,
    calls: Arc<AtomicU32>,
) -> ConsumerHandle {
    let options = ConsumerOptions::new(ConsumerType::new(consumer_type).unwrap(), ["charge"]);
    Consumer::spawn(config, options, effects::flaky(calls))
        .await
        .unwrap()
}

/// On a quorum queue a retry is a nack: the broker counts the deliveries and, at the
/// queue's delivery limit, dead-letters the message itself; `dlq list` names the reason,
/// and the consumer counts it in `sagabox_dead_letters_total` as it nacks the last time.
/// (The metrics recorder is per process: this is the only test here that installs one,
/// and its consumer type is its own.)
#[tokio::test]
async fn on_a_quorum_queue_the_broker_counts_retries_and_dead_letters_at_its_delivery_limit() {
    let metrics = sagabox::metrics::install_prometheus("127.0.0.1:0").unwrap();
    let rabbit = Rabbit::new(&["exhausting"]).await;
    let mut config = rabbit.config.clone();
    assert_eq!(
        config.queue_type,
        QueueType::Quorum,
        "quorum is the default"
    );
    config.max_redeliveries = 3;
    let calls = Arc::new(AtomicU32::new(0));
    let consumer = flaky_consumer(config.clone(), "exhausting", Arc::clone(&calls)).await;
    let stats = Arc::clone(consumer.stats());

    let (body, properties) = message("flaky-1", "charge", json!({"flaky": true}));
    rabbit
        .publish_raw(&rabbit.queue("exhausting"), &body, properties)
        .await;
    common::wait_for("the flaky message nacked once, then done", async || {
        stats.acked.load(SeqCst) == 1 && stats.requeued.load(SeqCst) == 1
    })
    .await;

    let (body, properties) = message("poison-1", "charge", json!({"flaky": false}));
    rabbit
        .publish_raw(&rabbit.queue("exhausting"), &body, properties)
        .await;
    let dead = rabbit.dead_queue("exhausting");
    common::wait_for(
        "the poison message dead-lettered by the broker",
        async || rabbit.ready(&dead).await == 1,
    )
    .await;
    consumer.stop().await;
    assert_eq!(
        calls.load(SeqCst),
        2 + 3,
        "delivered max_redeliveries times"
    );
    assert_eq!(stats.requeued.load(SeqCst), 1 + 3, "every failure nacked");
    assert_eq!(
        stats.dead_lettered.load(SeqCst),
        0,
        "the broker dead-lettered it, not the consumer"
    );
    assert_eq!(
        rabbit.ready(&rabbit.queue("exhausting")).await,
        0,
        "nothing left behind"
    );

    let dead_letters = |text: &str| {
        common::scrape::sum(
            text,
            sagabox::metrics::DEAD_LETTERS_TOTAL,
            &[
                "consumer_type=\"exhausting\"",
                "reason=\"retries_exhausted\"",
            ],
        )
    };
    let text = common::scrape::scrape(metrics).await.unwrap();
    assert_eq!(dead_letters(&text), 1.0, "{text}");

    let dlq = DeadLetterQueue::open(&config, &dead).await.unwrap();
    let list = dlq.list(None).await.unwrap();
    dlq.close().await;
    assert_eq!(list.messages.len(), 1);
    let letter = &list.messages[0];
    assert_eq!(letter.message_id.as_deref(), Some("poison-1"));
    assert_eq!(letter.reason.as_deref(), Some("retries_exhausted"));
    let detail = letter.detail.as_deref().unwrap_or_default();
    assert!(
        detail.contains("delivery_limit") && detail.contains(&rabbit.queue("exhausting")),
        "{detail}"
    );
}

/// On a classic queue a retry is a republish that carries its attempt in
/// `x-sagabox-attempts`: the consumer counts, and dead-letters the message itself at
/// `max_redeliveries` (the broker keeps no count there).
#[tokio::test]
async fn on_a_classic_queue_the_consumer_counts_retries_and_dead_letters_at_the_limit() {
    let rabbit = Rabbit::new(&["payment"]).await;
    let mut config = rabbit.config.clone();
    config.queue_type = QueueType::Classic;
    config.max_redeliveries = 3;
    let calls = Arc::new(AtomicU32::new(0));
    let consumer = flaky_consumer(config, "payment", Arc::clone(&calls)).await;
    let stats = Arc::clone(consumer.stats());
    let (body, properties) = message("flaky-1", "charge", json!({"flaky": true}));
    rabbit
        .publish_raw(&rabbit.queue("payment"), &body, properties)
        .await;
    common::wait_for("the flaky message requeued once, then done", async || {
        stats.acked.load(SeqCst) == 1 && stats.requeued.load(SeqCst) == 1
    })
    .await;

    let (body, properties) = message("poison-1", "charge", json!({"flaky": false}));
    rabbit
        .publish_raw(&rabbit.queue("payment"), &body, properties)
        .await;
    common::wait_for("the broken message dead-lettered", async || {
        stats.dead_lettered.load(SeqCst) == 1
    })
    .await;
    consumer.stop().await;
    assert_eq!(
        calls.load(SeqCst),
        2 + 3,
        "delivered max_redeliveries times"
    );
    assert_eq!(
        stats.requeued.load(SeqCst),
        1 + 2,
        "requeued twice before the third failure"
    );
    let dead = rabbit.drain(&rabbit.dead_queue("payment")).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        codec::header(&dead[0].delivery.properties, DEAD_REASON_HEADER).as_deref(),
        Some("retries_exhausted")
    );
}

/// A classic queue that exists already is refused as a quorum declare, with the fix.
#[tokio::test]
async fn an_existing_queue_of_another_type_is_refused_with_the_fix() {
    let rabbit = Rabbit::new(&["payment"]).await;
    let mut classic = rabbit.config.clone();
    classic.queue_type = QueueType::Classic;
    let calls = Arc::new(AtomicU32::new(0));
    flaky_consumer(classic, "payment", Arc::clone(&calls))
        .await
        .stop()
        .await;
    let error = Consumer::spawn(
        rabbit.config.clone(),
        ConsumerOptions::new(ConsumerType::new("payment").unwrap(), ["charge"]),
        |_: Envelope| async { Disposition::Done { reply: None } },
    )
    .await
    .unwrap_err();
    assert!(matches!(error, AmqpError::QueueMismatch { .. }), "{error}");
    let text = error.to_string();
    for part in [
        rabbit.queue("payment").as_str(),
        "--queue-type classic",
        "PRECONDITION_FAILED",
        "docs/configuration.md",
    ] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }
}

/// A queue that keeps messages longer than the inbox TTL: the consumer refuses to start,
/// naming both numbers, and takes nothing.
#[tokio::test]
async fn a_queue_whose_ttl_exceeds_the_inbox_ttl_is_refused_at_start() {
    let rabbit = Rabbit::new(&["payment"]).await;
    let mut config = rabbit.config.clone();
    config.message_ttl = Some(Duration::from_secs(45 * 86_400));
    config.retention_check =
        Some(InboxConfig::default().with_ttl(Duration::from_secs(30 * 86_400)));
    let (body, properties) = message("m-1", "charge", json!({}));
    rabbit.declare_with(&config, "payment").await;
    rabbit
        .publish_raw(&rabbit.queue("payment"), &body, properties)
        .await;
    let error = Consumer::spawn(
        config,
        ConsumerOptions::new(ConsumerType::new("payment").unwrap(), ["charge"]),
        |_: Envelope| async { Disposition::Done { reply: None } },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            error,
            AmqpError::Retention(RetentionError::LongerThanTtl { .. })
        ),
        "{error}"
    );
    let text = error.to_string();
    for part in [
        rabbit.queue("payment").as_str(),
        "45.0 days",
        "30.0 days",
        "--ttl-days",
        "--force-short-ttl",
    ] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }
    assert_eq!(
        rabbit.ready(&rabbit.queue("payment")).await,
        1,
        "nothing consumed"
    );
}

/// `replicas` reaches the broker as the quorum queue's `x-quorum-initial-group-size`;
/// without it the queue is declared as before, the group size left to the broker.
#[tokio::test]
async fn replicas_are_declared_as_the_quorum_queues_initial_group_size() {
    let rabbit = Rabbit::new(&["payment", "inventory"]).await;
    let mut config = rabbit.config.clone();
    config.replicas = Some(1);
    rabbit.declare_with(&config, "payment").await;
    let arguments = rabbit.queue_arguments(&rabbit.queue("payment"));
    assert!(
        arguments.contains("x-quorum-initial-group-size") && arguments.contains("x-queue-type"),
        "{arguments}"
    );
    // Its dead queue is a quorum queue too, replicated alike.
    let dead = rabbit.queue_arguments(&rabbit.dead_queue("payment"));
    assert!(
        dead.contains("quorum") && dead.contains("x-quorum-initial-group-size"),
        "{dead}"
    );
    rabbit.declare("inventory").await;
    let arguments = rabbit.queue_arguments(&rabbit.queue("inventory"));
    assert!(arguments.contains("x-queue-type"), "{arguments}");
    assert!(
        !arguments.contains("x-quorum-initial-group-size"),
        "{arguments}"
    );
}

/// A classic dead queue declared before dead queues were quorum queues is kept as it
/// is, with its letters: the declare falls back to it instead of refusing.
#[tokio::test]
async fn an_existing_classic_dead_queue_is_kept_with_its_letters() {
    let rabbit = Rabbit::new(&["payment"]).await;
    let dead = rabbit.dead_queue("payment");
    rabbit
        .channel
        .queue_declare(
            dead.as_str().into(),
            lapin::options::QueueDeclareOptions::durable(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let (body, properties) = message("old-letter", "charge", json!({}));
    rabbit.publish_raw(&dead, &body, properties).await;
    rabbit.declare("payment").await;
    let arguments = rabbit.queue_arguments(&dead);
    assert!(!arguments.contains("quorum"), "{arguments}");
    assert!(
        rabbit
            .queue_arguments(&rabbit.queue("payment"))
            .contains("quorum"),
        "the work queue is a quorum queue"
    );
    common::wait_for("the old letter counted", async || {
        rabbit.ready(&dead).await == 1
    })
    .await;
}

/// A cluster's URL list with nodes that are down: every connection, wherever in the list
/// it starts, reaches the live one, a guarded consumer on the list
/// applies what is published, and a list of only dead nodes is refused naming how many
/// were tried, without a password.
#[tokio::test]
async fn a_url_list_connects_to_the_node_that_answers_wherever_it_stands() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let dead = |port: u16| format!("amqp://guest:s3cret-pw@127.0.0.1:{port}/%2f");
    let (dead_a, dead_b) = (
        dead(common::scrape::free_port()),
        dead(common::scrape::free_port()),
    );
    let live = rabbit.config.url.clone();
    let mut listed = rabbit.config.clone();
    listed.url = format!("{dead_a}, {live},{dead_b}");
    listed.validate().unwrap();
    // Whichever node of the list a connection starts at, it ends on the live one.
    for turn in 0..3 {
        let sender = Sender::connect(&listed.clone().into(), "listed")
            .await
            .unwrap_or_else(|error| panic!("connection {turn}: {error}"));
        assert!(sender.is_connected());
        sender.close().await;
    }
    let guard = InboxGuard::new(pg.store(4).await, InboxConfig::default()).unwrap();
    let consumer = guarded_consumer(
        &listed,
        &guard,
        "payment",
        &["charge"],
        Arc::new(AtomicU32::new(0)),
    )
    .await;
    for n in 0..5 {
        let (body, properties) = message(&format!("listed-{n}"), "charge", json!({"n": n}));
        rabbit
            .publish_raw(&rabbit.queue("payment"), &body, properties)
            .await;
    }
    let stats = Arc::clone(consumer.stats());
    common::wait_for("five acks", async || stats.acked.load(SeqCst) == 5).await;
    consumer.stop().await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 5);

    let mut all_dead = rabbit.config.clone();
    all_dead.url = format!("{dead_a},{dead_b}");
    let error = Sender::connect(&all_dead.into(), "dead").await.unwrap_err();
    assert!(
        matches!(
            error,
            TransportError::Amqp(AmqpError::NoNodeAnswered { nodes: 2, .. })
        ),
        "{error}"
    );
    let text = error.to_string();
    assert!(!text.contains("s3cret-pw"), "{text}");

    let mut mixed = rabbit.config.clone();
    mixed.url = format!("{live},amqps://guest:guest@127.0.0.1:5671/%2f");
    let refused = mixed.validate().unwrap_err().to_string();
    assert!(refused.contains("mixes amqp:// and amqps://"), "{refused}");
}
