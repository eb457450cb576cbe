//! Starts a `deposit` saga (`sagas/deposit.toml`, driven by `sagabox orchestrate`):
//! `cargo run --bin deposit -- REQUEST ACCOUNT CENTS`.
//!
//! A start message is an envelope whose kind is the saga's name and whose payload is the
//! saga's data; it goes to `bank.deposit.start`. The saga's id is derived from the
//! message id, so the same request sent twice starts one saga.

use sagabox::transport::{Sender, Transport};
use sagabox::{Envelope, MessageId};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [request, account, cents] = args.as_slice() else {
        return Err("usage: deposit REQUEST ACCOUNT CENTS".into());
    };
    let cents: i64 = cents
        .parse()
        .map_err(|_| format!("CENTS is a whole number, not {cents:?}"))?;
    let broker = Transport::from_url(&std::env::var("BROKER_URL")?, "bank")?;

    let start = Envelope::new(
        MessageId::new(format!("deposit-{request}"))?,
        "deposit",
        json!({"account": account, "cents": cents}),
    )?;
    let mut sender = Sender::connect(&broker, "deposit").await?;
    sender.start_saga(&start).await?;
    sender.close().await;
    println!("started the deposit of request {request} ({})", start.id);
    Ok(())
}
