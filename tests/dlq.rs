//! The dead-letter queue as an operator uses it, against the real RabbitMQ (and
//! PostgreSQL for the side effects): a listing leaves the queue as it was, in order; a
//! replay republishes under the original message id, only the reason asked and at most
//! the limit, and leaves the rest untouched; a missing queue and an unreachable broker
//! are typed errors that change nothing; a replay of a message already applied, and of
//! a replayed one, is still one side effect.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

use common::Pg;
use common::rabbit::Rabbit;
use lapin::BasicProperties;
use lapin::types::AMQPValue;
use sagabox::amqp::{AmqpConfig, AmqpError, Consumer, ConsumerOptions, DeadLetterQueue, codec};
use sagabox::consumer::ConsumerHandle;
use sagabox::dead_reason::DeadReason;
use sagabox::dead_reason::{DEAD_DETAIL_HEADER, DEAD_REASON_HEADER};
use sagabox::delivery::{ATTEMPTS_HEADER, Disposition};
use sagabox::dlq::{DeadLetter, DlqError, REPLAYED_HEADER, ReplayOptions};
use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, Outcome, PostgresStore};
use serde_json::json;

/// A dead letter as the consumer writes one: the envelope of `id`, its publish time, and
/// the reason, detail and attempt headers.
fn dead_letter(id: &str, reason: &str, attempts: i64) -> (Vec<u8>, BasicProperties) {
    let envelope = Envelope::new(
        MessageId::new(id).unwrap(),
        "charge",
        json!({"order_id": id, "amount_cents": 500}),
    )
    .unwrap()
    .with_saga_id("saga-1")
    .with_published_at(chrono::Utc::now() - chrono::Duration::minutes(10));
    let (body, properties) = codec::encode(&envelope);
    let properties = codec::with_headers(
        properties,
        [
            (DEAD_REASON_HEADER, AMQPValue::LongString(reason.into())),
            (
                DEAD_DETAIL_HEADER,
                AMQPValue::LongString(format!("detail of {id}").into()),
            ),
            (ATTEMPTS_HEADER, AMQPValue::LongLongInt(attempts)),
        ],
    );
    (body, properties)
}

/// Declares `payment`'s queues and puts one dead letter per `(id, reason)` in its
/// dead-letter queue, in order.
async fn dead_letters(rabbit: &Rabbit, letters: &[(&str, &str)]) {
    rabbit.declare("payment").await;
    for (id, reason) in letters {
        let (body, properties) = dead_letter(id, reason, 5);
        rabbit
            .publish_raw(&rabbit.dead_queue("payment"), &body, properties)
            .await;
    }
}

/// The message ids in `queue`, taken (acked) in order.
async fn drain_ids(rabbit: &Rabbit, queue: &str) -> Vec<String> {
    rabbit
        .drain(queue)
        .await
        .iter()
        .map(|message| {
            message
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default()
        })
        .collect()
}

#[tokio::test]
async fn a_listing_shows_every_field_and_leaves_the_queue_as_it_was() {
    let rabbit = Rabbit::new(&["payment"]).await;
    dead_letters(
        &rabbit,
        &[
            ("m-1", "rejected"),
            ("m-2", "retries_exhausted"),
            ("m-3", "unknown_kind"),
        ],
    )
    .await;
    // One the broker dead-lettered: no sagabox headers, not even JSON.
    rabbit
        .publish_raw(
            &rabbit.dead_queue("payment"),
            b"not json",
            BasicProperties::default().with_message_id("m-4".into()),
        )
        .await;
    let source = rabbit.queue("payment");
    let dlq = DeadLetterQueue::open(&rabbit.config, &source)
        .await
        .unwrap();
    assert_eq!(dlq.dead_queue(), rabbit.dead_queue("payment"));
    assert_eq!(dlq.count().await.unwrap(), 4);

    let listed = dlq.list(None).await.unwrap();
    assert_eq!(listed.total, 4);
    assert_eq!(listed.source_queue, source);
    let ids: Vec<_> = listed
        .messages
        .iter()
        .map(|m| m.message_id.clone().unwrap())
        .collect();
    assert_eq!(ids, ["m-1", "m-2", "m-3", "m-4"]);
    let first = &listed.messages[0];
    assert_eq!(first.kind.as_deref(), Some("charge"));
    assert_eq!(first.saga_id.as_deref(), Some("saga-1"));
    assert_eq!(first.reason.as_deref(), Some("rejected"));
    assert_eq!(first.detail.as_deref(), Some("detail of m-1"));
    assert_eq!(first.attempts, Some(5));
    assert_eq!(first.replayed, None);
    let age = first.age_seconds.unwrap();
    assert!((590..=700).contains(&age), "about ten minutes old: {age}");
    let broker = &listed.messages[3];
    assert_eq!(
        (broker.kind.as_deref(), broker.reason.as_deref()),
        (None, None)
    );
    assert_eq!(broker.bytes, 8);
    let table = listed.to_string();
    assert!(table.contains("retries_exhausted"), "{table}");
    assert!(table.contains("10 min"), "{table}");

    let limited = dlq.list(Some(2)).await.unwrap();
    assert_eq!((limited.total, limited.messages.len()), (4, 2));
    assert_eq!(limited.messages[1].message_id.as_deref(), Some("m-2"));

    // The `.dead` name opens the same queue.
    let by_dead = DeadLetterQueue::open(&rabbit.config, &rabbit.dead_queue("payment"))
        .await
        .unwrap();
    assert_eq!(by_dead.source_queue(), source);
    // The same messages; their age is read anew and may have crossed a second.
    let ageless = |messages: Vec<DeadLetter>| -> Vec<DeadLetter> {
        messages
            .into_iter()
            .map(|message| DeadLetter {
                age_seconds: None,
                ..message
            })
            .collect()
    };
    assert_eq!(
        ageless(by_dead.list(None).await.unwrap().messages),
        ageless(listed.messages.clone())
    );
    by_dead.close().await;
    dlq.close().await;

    assert_eq!(
        drain_ids(&rabbit, &rabbit.dead_queue("payment")).await,
        ["m-1", "m-2", "m-3", "m-4"],
        "every message still there, in order"
    );
}

#[tokio::test]
async fn a_replay_republishes_the_reason_asked_under_its_id_and_leaves_the_rest() {
    let rabbit = Rabbit::new(&["payment"]).await;
    dead_letters(
        &rabbit,
        &[
            ("m-1", "rejected"),
            ("m-2", "unknown_kind"),
            ("m-3", "rejected"),
            ("m-4", "rejected"),
        ],
    )
    .await;
    let dlq = DeadLetterQueue::open(&rabbit.config, &rabbit.queue("payment"))
        .await
        .unwrap();
    let original = rabbit.channel.basic_get(
        rabbit.dead_queue("payment").as_str().into(),
        lapin::options::BasicGetOptions { no_ack: false },
    );
    let original = original.await.unwrap().unwrap();
    let original_body = original.delivery.data.clone();
    original
        .delivery
        .acker
        .nack(lapin::options::BasicNackOptions {
            multiple: false,
            requeue: true,
        })
        .await
        .unwrap();

    let report = dlq
        .replay(&ReplayOptions {
            reason: Some(DeadReason::Rejected),
            limit: Some(2),
        })
        .await
        .unwrap();
    assert_eq!((report.replayed, report.left), (2, 2));
    assert_eq!(report.reason.as_deref(), Some("rejected"));
    let replayed: Vec<_> = report
        .messages
        .iter()
        .map(|m| m.message_id.clone().unwrap())
        .collect();
    assert_eq!(replayed, ["m-1", "m-3"]);
    assert!(report.to_string().starts_with(&format!(
        "replayed 2 dead letter(s) with reason rejected from {} to {}; 2 left",
        rabbit.dead_queue("payment"),
        rabbit.queue("payment")
    )));

    let republished = rabbit.drain(&rabbit.queue("payment")).await;
    assert_eq!(republished.len(), 2);
    let copy = &republished[0].delivery;
    assert_eq!(
        copy.properties.message_id().as_ref().unwrap().as_str(),
        "m-1"
    );
    assert_eq!(copy.data, original_body, "the body unchanged");
    assert_eq!(codec::header(&copy.properties, DEAD_REASON_HEADER), None);
    assert_eq!(codec::header(&copy.properties, DEAD_DETAIL_HEADER), None);
    assert_eq!(codec::count_header(&copy.properties, ATTEMPTS_HEADER), None);
    assert_eq!(
        codec::count_header(&copy.properties, REPLAYED_HEADER),
        Some(1)
    );
    assert!(
        copy.properties.timestamp().is_some(),
        "the publish time kept"
    );

    // Without a reason: everything left.
    let rest = dlq.replay(&ReplayOptions::default()).await.unwrap();
    assert_eq!((rest.replayed, rest.left), (2, 0));
    dlq.close().await;
    assert_eq!(
        drain_ids(&rabbit, &rabbit.queue("payment")).await,
        ["m-2", "m-4"]
    );
}

#[tokio::test]
async fn a_missing_queue_is_not_found_and_changes_nothing() {
    let rabbit = Rabbit::new(&["payment"]).await;
    // Never declared, so not in the fixture's list of queues to delete.
    let nowhere = format!("{}.nowhere", rabbit.config.queue_prefix);
    let error = DeadLetterQueue::open(&rabbit.config, &nowhere)
        .await
        .unwrap_err();
    match &error {
        DlqError::QueueNotFound { queue, .. } => assert_eq!(*queue, format!("{nowhere}.dead")),
        other => panic!("not QueueNotFound: {other}"),
    }
    assert!(error.to_string().contains("nothing was changed"), "{error}");
    assert!(!error.to_string().contains("guest:guest"), "{error}");

    // A dead-letter queue whose source queue is gone: nothing is read or republished.
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
    let (body, properties) = dead_letter("m-1", "rejected", 1);
    rabbit.publish_raw(&dead, &body, properties).await;
    let dlq = DeadLetterQueue::open(&rabbit.config, &dead).await.unwrap();
    let error = dlq.replay(&ReplayOptions::default()).await.unwrap_err();
    match &error {
        DlqError::QueueNotFound { queue, .. } => assert_eq!(*queue, rabbit.queue("payment")),
        other => panic!("not QueueNotFound: {other}"),
    }
    assert_eq!(
        dlq.count().await.unwrap(),
        1,
        "the dead letter is still there"
    );
    dlq.close().await;
}

#[tokio::test]
async fn an_unreachable_broker_is_named_without_its_password() {
    let config = AmqpConfig::new("amqp://guest:hunter2@127.0.0.1:5999/%2f");
    let error = DeadLetterQueue::open(&config, "sagabox.payment")
        .await
        .unwrap_err();
    assert!(
        matches!(error, DlqError::Amqp(AmqpError::Unreachable { .. })),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(text.contains("127.0.0.1:5999"), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
}

const EFFECTS: &str = "CREATE TABLE effects (message_id TEXT NOT NULL)";

/// A consumer of `payment` through the guard, one `effects` row per applied message (no
/// unique constraint: only the inbox keeps it exact); counts the duplicates.
async fn guarded_consumer(
    rabbit: &Rabbit,
    guard: &InboxGuard<PostgresStore>,
    duplicates: Arc<AtomicU32>,
) -> ConsumerHandle {
    let consumer_type = ConsumerType::new("payment").unwrap();
    let options = ConsumerOptions::new(consumer_type.clone(), ["charge"]);
    let guard = guard.clone();
    Consumer::spawn(rabbit.config.clone(), options, move |envelope: Envelope| {
        let (guard, consumer_type, duplicates) = (
            guard.clone(),
            consumer_type.clone(),
            Arc::clone(&duplicates),
        );
        async move {
            let processed = guard
                .process(&consumer_type, &envelope, async |conn, envelope| {
                    sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
                        .bind(envelope.id.as_str())
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
                Err(error) => Disposition::Retry(error.to_string()),
            }
        }
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn replaying_an_applied_message_and_a_replayed_one_is_still_one_side_effect() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = InboxGuard::new(pg.store(4).await, InboxConfig::default()).unwrap();
    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(&rabbit, &guard, Arc::clone(&duplicates)).await;
    let stats = Arc::clone(consumer.stats());
    let id = MessageId::new_v7();
    let (body, properties) = dead_letter(id.as_str(), "unused", 0);
    rabbit
        .publish_raw(&rabbit.queue("payment"), &body, properties)
        .await;
    common::wait_for("the message applied", async || {
        stats.acked.load(SeqCst) == 1
    })
    .await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);

    // A copy of it dead-lettered (as a rejection it did not deserve), then replayed.
    let (body, properties) = dead_letter(id.as_str(), "rejected", 0);
    rabbit
        .publish_raw(&rabbit.dead_queue("payment"), &body, properties)
        .await;
    let dlq = DeadLetterQueue::open(&rabbit.config, &rabbit.queue("payment"))
        .await
        .unwrap();
    assert_eq!(
        dlq.replay(&ReplayOptions::default())
            .await
            .unwrap()
            .replayed,
        1
    );
    common::wait_for("the replay absorbed", async || duplicates.load(SeqCst) == 1).await;

    // The replayed copy dead-lettered again, and replayed again.
    let (body, properties) = dead_letter(id.as_str(), "retries_exhausted", 5);
    let properties =
        codec::with_headers(properties, [(REPLAYED_HEADER, AMQPValue::LongLongInt(1))]);
    rabbit
        .publish_raw(&rabbit.dead_queue("payment"), &body, properties)
        .await;
    assert_eq!(dlq.list(None).await.unwrap().messages[0].replayed, Some(1));
    assert_eq!(
        dlq.replay(&ReplayOptions::default())
            .await
            .unwrap()
            .replayed,
        1
    );
    common::wait_for("the second replay absorbed", async || {
        duplicates.load(SeqCst) == 2
    })
    .await;
    consumer.stop().await;
    dlq.close().await;

    assert_eq!(
        pg.scalar("SELECT COUNT(*) FROM effects").await,
        1,
        "one side effect"
    );
    assert_eq!(pg.inbox_rows().await, 1);
    assert_eq!(rabbit.ready(&rabbit.dead_queue("payment")).await, 0);
    assert_eq!(stats.dead_lettered.load(SeqCst), 0);
}
