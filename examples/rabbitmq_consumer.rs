//! A hand-written RabbitMQ consumer using the inbox guard: a payment participant that
//! consumes `sagabox-example.payment`, charges inside the guard's transaction, writes a
//! "charged" message to the outbox in that same transaction, and acks only after commit.
//! A [`Relay`] then publishes the outbox to `sagabox-example.email` with confirms.
//!
//! The program publishes the same charge three times with a plain AMQP publisher (as a
//! producer retrying after a lost confirm would) plus one message without a
//! `message_id`, and shows: one charge, three acks, one outbox message relayed, and the
//! bad message in the dead-letter queue with its reason.
//!
//! ```text
//! cargo run --example rabbitmq_consumer
//! AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f DATABASE_URL=sqlite:/tmp/x.db cargo run --example rabbitmq_consumer
//! ```

use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, QueueDeleteOptions};
use sagabox::amqp::{
    AmqpConfig, Consumer, ConsumerOptions, DEAD_REASON_HEADER, Disposition, Relay, RelayArguments,
    RelayConfig, RelayMessage, codec,
};
use sagabox::outbox::OutboxWriter;
use sagabox::supervisor::Supervision;
use sagabox::{
    ConsumerType, Envelope, GuardError, InboxConfig, InboxGuard, MessageId, Outcome, SqliteStore,
};
use serde_json::json;
use sqlx::SqliteConnection;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let path = std::env::temp_dir().join("sagabox-rabbitmq-example.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let database_url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| format!("sqlite:{}", path.display()));

    // The inbox and the business table, in one database.
    let store = SqliteStore::connect(&database_url, 4).await?;
    let guard = InboxGuard::new(store, InboxConfig::default())?;
    guard.migrate().await?;
    let pool = guard.store().pool().clone();
    sqlx::query("CREATE TABLE IF NOT EXISTS payment_charges (order_id TEXT NOT NULL, cents INTEGER NOT NULL)")
        .execute(&pool)
        .await?;

    let config = AmqpConfig::new(amqp_url.clone()).with_queue_prefix("sagabox-example");
    let payment = ConsumerType::new("payment")?;
    let email = ConsumerType::new("email")?;

    // The consumer: every message through the guard; ack only after it returned.
    let consumer = {
        let (guard, payment, email) = (guard.clone(), payment.clone(), email.clone());
        Consumer::spawn(
            config.clone(),
            ConsumerOptions::new(payment.clone(), ["charge"]),
            move |envelope: Envelope| {
                let (guard, payment, email) = (guard.clone(), payment.clone(), email.clone());
                async move {
                    let processed = guard
                        .process(&payment, &envelope, async |conn, envelope| {
                            let order = envelope.payload["order_id"].as_str().unwrap_or_default();
                            sqlx::query(
                                "INSERT INTO payment_charges (order_id, cents) VALUES ($1, $2)",
                            )
                            .bind(order)
                            .bind(envelope.payload["cents"].as_i64())
                            .execute(&mut *conn)
                            .await?;
                            // Committed with the charge, or not at all.
                            let charged = <SqliteConnection as OutboxWriter>::message(
                                "charged",
                                json!({"order_id": order}),
                            )
                            .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
                            conn.publish(&email, order, &charged).await?;
                            Ok::<_, sqlx::Error>(json!({"charged": envelope.payload["cents"]}))
                        })
                        .await;
                    match processed {
                        Ok(Outcome::Applied(_) | Outcome::Duplicate { .. }) => {
                            Disposition::Done { reply: None }
                        }
                        // A database hiccup: try again later.
                        Err(GuardError::Inbox(error)) if error.is_retryable() => {
                            Disposition::Retry(error.to_string())
                        }
                        Err(GuardError::Handler(error)) => Disposition::Retry(error.to_string()),
                        // Expired, pruned month, clock skew: will never pass.
                        Err(error) => Disposition::Reject(error.to_string()),
                    }
                }
            },
        )
        .await?
    };

    // The relay: publishes the outbox with confirms, marks rows sent after. Linked to a
    // supervisor, so that its death would reach this code instead of going unnoticed.
    let supervision = Supervision::start().await?;
    let (relay, _) = supervision
        .spawn(
            "relay",
            Relay::new(),
            RelayArguments {
                source: pool.clone(),
                amqp: config.clone(),
                config: RelayConfig::default(),
            },
        )
        .await?;

    // A producer publishes the same charge three times, and one message with no id.
    let connection = lapin::Connection::connect(&amqp_url, Default::default()).await?;
    let channel = connection.create_channel().await?;
    let charge = Envelope::new(
        MessageId::new_v7(),
        "charge",
        json!({"order_id": "order-42", "cents": 4200}),
    )?;
    let (body, properties) = codec::encode(&charge);
    let queue = config.queue(&payment);
    for _ in 0..3 {
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                Default::default(),
                &body,
                properties.clone(),
            )
            .await?;
    }
    channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            Default::default(),
            &body,
            BasicProperties::default(),
        )
        .await?;

    let stats = Arc::clone(consumer.stats());
    let deadline = Instant::now() + Duration::from_secs(20);
    while stats.acked.load(SeqCst) < 3 || stats.dead_lettered.load(SeqCst) < 1 {
        if Instant::now() > deadline {
            return Err("the consumer did not settle the four messages in 20 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    supervision.check()?;
    let relayed = ractor::call!(relay, RelayMessage::Flush)?;
    supervision.stop().await;
    consumer.stop().await;

    let charges: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payment_charges")
        .fetch_one(&pool)
        .await?;
    let outbox_sent: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NOT NULL")
            .fetch_one(&pool)
            .await?;
    println!("deliveries acked:        {}", stats.acked.load(SeqCst));
    println!("charges in the ledger:   {charges}");
    println!("outbox rows relayed:     {outbox_sent} (this flush: {relayed:?})");
    let email_queue = config.queue(&email);
    if let Some(message) = channel
        .basic_get(
            email_queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await?
    {
        let envelope = codec::decode(
            &message.delivery.properties,
            &message.delivery.data,
            &Default::default(),
        )?;
        println!("on {email_queue}: {} {}", envelope.kind, envelope.payload);
    }
    let dead_queue = config.dead_queue(&payment);
    if let Some(message) = channel
        .basic_get(dead_queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await?
    {
        println!(
            "dead-lettered:           {}",
            codec::header(&message.delivery.properties, DEAD_REASON_HEADER).unwrap_or_default()
        );
    }
    for queue in [
        queue,
        dead_queue,
        email_queue.clone(),
        config.dead_queue(&email),
    ] {
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    connection.close(200, "done".into()).await?;
    if charges != 1 {
        return Err(format!("expected one charge, found {charges}").into());
    }
    Ok(())
}
