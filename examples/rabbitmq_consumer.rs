//! A payment participant on the [`Participant`] runtime: it consumes
//! `sagabox-example.payment`, charges inside the inbox guard's transaction, writes a
//! "charged" message to the outbox in that same transaction, and acks only after commit;
//! the runtime's relay publishes the outbox to `sagabox-example.email` with confirms.
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

use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, QueueDeleteOptions};
use sagabox::amqp::{AmqpConfig, codec};
use sagabox::dead_reason::DEAD_REASON_HEADER;
use sagabox::outbox::OutboxWriter;
use sagabox::participant::StepOptions;
use sagabox::relay::RelayConfig;
use sagabox::step::{StepError, StepHandler};
use sagabox::{ConsumerType, Envelope, MessageId, Participant, SqliteStore};
use serde_json::{Value, json};
use sqlx::{Sqlite, SqliteConnection};

/// The payment step: a charge in the ledger and a "charged" message for `email`, in the
/// guard's transaction — both committed with the inbox row, or neither.
struct Payment {
    email: ConsumerType,
}

impl StepHandler<Sqlite> for Payment {
    async fn handle(
        &self,
        conn: &mut SqliteConnection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let retryable = |error: sqlx::Error| StepError::Retryable(error.to_string());
        let order = envelope.payload["order_id"].as_str().unwrap_or_default();
        sqlx::query("INSERT INTO payment_charges (order_id, cents) VALUES ($1, $2)")
            .bind(order)
            .bind(envelope.payload["cents"].as_i64())
            .execute(&mut *conn)
            .await
            .map_err(retryable)?;
        let charged = SqliteConnection::message("charged", json!({"order_id": order}))
            .map_err(|error| StepError::Permanent(error.to_string()))?;
        conn.publish(&self.email, order, &charged)
            .await
            .map_err(retryable)?;
        Ok(json!({"charged": envelope.payload["cents"]}))
    }
}

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

    // The inbox, the business table and the outbox, in one database.
    let store = SqliteStore::connect(&database_url, 4).await?;
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE IF NOT EXISTS payment_charges (order_id TEXT NOT NULL, cents INTEGER NOT NULL)")
        .execute(&pool)
        .await?;
    let config = AmqpConfig::new(amqp_url.clone()).with_queue_prefix("sagabox-example");
    let (payment, email) = (ConsumerType::new("payment")?, ConsumerType::new("email")?);

    // The runtime: the queue consumed through the guard, the outbox relayed. A service
    // would call `.run(shutdown_signal)` instead of `start` and `stop`.
    let participant = Participant::new(store, config.clone())
        .step_with(
            "payment",
            Payment {
                email: email.clone(),
            },
            StepOptions::default().kinds(["charge"]),
        )
        .relay(RelayConfig::default())
        .start()
        .await?;

    // A producer publishes the same charge three times, and one message with no id.
    let connection = lapin::Connection::connect(&amqp_url, Default::default()).await?;
    let channel = connection.create_channel().await?;
    let charge = Envelope::new(
        MessageId::new_v7(),
        "charge",
        json!({"order_id": "order-42", "cents": 4200}),
    )?;
    let queue = config.queue(&payment);
    publish(&channel, &queue, &charge).await?;

    let deadline = Instant::now() + Duration::from_secs(20);
    while participant
        .report()
        .step("payment")
        .is_none_or(|step| step.acked < 3 || step.dead_lettered < 1)
    {
        if Instant::now() > deadline {
            return Err("the participant did not settle the four messages in 20 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Stops in order: deliveries in flight finished and acked, the outbox published.
    let report = participant.stop().await?;

    let charges: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payment_charges")
        .fetch_one(&pool)
        .await?;
    let outbox_sent: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NOT NULL")
            .fetch_one(&pool)
            .await?;
    let acked = report.step("payment").map_or(0, |step| step.acked);
    println!("deliveries acked:        {acked}");
    println!("charges in the ledger:   {charges}");
    println!("outbox rows relayed:     {outbox_sent}");
    print_and_delete_queues(&channel, &config, &payment, &email).await?;
    connection.close(200, "done".into()).await?;
    if charges != 1 {
        return Err(format!("expected one charge, found {charges}").into());
    }
    Ok(())
}

/// Publishes `charge` three times to `queue`, then once more without a message id.
async fn publish(
    channel: &lapin::Channel,
    queue: &str,
    charge: &Envelope,
) -> Result<(), Box<dyn std::error::Error>> {
    let (body, properties) = codec::encode(charge);
    let without_id = BasicProperties::default();
    for properties in [
        properties.clone(),
        properties.clone(),
        properties,
        without_id,
    ] {
        channel
            .basic_publish(
                "".into(),
                queue.into(),
                Default::default(),
                &body,
                properties,
            )
            .await?;
    }

    Ok(())
}

/// Prints what the relay put on the email queue and why a message was dead-lettered,
/// then deletes the example's queues.
async fn print_and_delete_queues(
    channel: &lapin::Channel,
    config: &AmqpConfig,
    payment: &ConsumerType,
    email: &ConsumerType,
) -> Result<(), Box<dyn std::error::Error>> {
    let email_queue = config.queue(email);
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
    let dead_queue = config.dead_queue(payment);
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
        config.queue(payment),
        dead_queue,
        email_queue,
        config.dead_queue(email),
    ] {
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    Ok(())
}
