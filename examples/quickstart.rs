//! The inbox in one screen: a payment consumer receives the same "charge" message three
//! times — as an at-least-once broker may deliver it — and charges the card once. The
//! second and third deliveries are answered with the first delivery's result. Runs on an
//! embedded SQLite file; no server needed.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, Outcome, SqliteStore};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join("sagabox-quickstart.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let url = format!("sqlite:{}", path.display());
    let store = SqliteStore::connect(&url, 4).await?;
    let guard = InboxGuard::new(store, InboxConfig::default())?;
    guard.migrate().await?;
    let pool = guard.store().pool().clone();
    // A business table that is deliberately not idempotent: an append-only ledger.
    sqlx::query(
        "CREATE TABLE payment_charges (id INTEGER PRIMARY KEY, order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let payment = ConsumerType::new("payment")?;
    let message = Envelope::new(
        MessageId::new_v7(),
        "charge",
        json!({"order_id": "order-42", "amount_cents": 4200}),
    )?;
    println!("database: {url}");
    println!(
        "message {} ({}): {}",
        message.id, message.kind, message.payload
    );

    for delivery in 1..=3 {
        let outcome = guard
            .process(&payment, &message, async |conn, envelope| {
                let order_id = envelope.payload["order_id"].as_str().unwrap_or_default();
                let cents = envelope.payload["amount_cents"].as_i64().unwrap_or_default();
                let charge_id: i64 = sqlx::query_scalar(
                    "INSERT INTO payment_charges (order_id, amount_cents) VALUES ($1, $2) RETURNING id",
                )
                .bind(order_id)
                .bind(cents)
                .fetch_one(&mut *conn)
                .await?;
                Ok::<_, sqlx::Error>(json!({"charge_id": charge_id, "amount_cents": cents}))
            })
            .await?;
        match outcome {
            Outcome::Applied(result) => {
                println!("delivery {delivery}: applied   -> charged the card, recorded {result}")
            }
            Outcome::Duplicate {
                first_processed_at,
                result,
            } => println!(
                "delivery {delivery}: duplicate -> skipped; first processed at {first_processed_at}, its result {result}"
            ),
        }
    }

    let (charges, total): (i64, i64) = sqlx::query_as(
        "SELECT COUNT(*), COALESCE(SUM(amount_cents), 0) FROM payment_charges WHERE order_id = 'order-42'",
    )
    .fetch_one(&pool)
    .await?;
    println!(
        "payment_charges for order-42: {charges} row(s), {total} cents in all (read from the database)"
    );
    if charges != 1 {
        return Err(format!("expected exactly one charge, found {charges}").into());
    }
    println!("3 deliveries, 1 charge: applied exactly once.");
    Ok(())
}
