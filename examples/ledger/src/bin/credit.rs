//! Sends one `credit` command to the ledger and returns once the broker has stored it:
//! `cargo run --bin credit -- REQUEST ACCOUNT CENTS`.
//!
//! The message id is made from the request's id, not drawn at random: sending the same
//! request again — a retry after a timeout, a second run — is the same command, and the
//! ledger's inbox applies it once.

use sagabox::transport::{Sender, Transport};
use sagabox::{ConsumerType, Envelope, MessageId};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [request, account, cents] = args.as_slice() else {
        return Err("usage: credit REQUEST ACCOUNT CENTS".into());
    };
    let cents: i64 = cents
        .parse()
        .map_err(|_| format!("CENTS is a whole number, not {cents:?}"))?;
    let broker = Transport::from_url(&std::env::var("BROKER_URL")?, "bank")?;

    let credit = Envelope::new(
        MessageId::new(format!("credit-{request}"))?,
        "credit",
        json!({"account": account, "cents": cents}),
    )?;
    let mut sender = Sender::connect(&broker, "credit").await?;
    sender.send(&ConsumerType::new("ledger")?, &credit).await?;
    sender.close().await;
    println!("sent {}", credit.id);
    Ok(())
}
