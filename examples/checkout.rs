//! The checkout saga — payment → inventory → email, compensated by refund and restock —
//! run by the orchestrator over step pools while commands are duplicated, replies lost
//! and handlers fail after writing. The summary's damage figures are read from the
//! business tables by SQL. The same run as `sagabox demo`.
//!
//! ```text
//! cargo run --example checkout                                   # SQLite file here
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example checkout
//! ```

use sagabox::demo::{DemoConfig, run};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite:sagabox-checkout.db".into());
    let config = DemoConfig {
        orders: 500,
        duplicate_rate: 0.5,
        lost_reply_rate: 0.1,
        fail_rate: 0.1,
        decline_rate: 0.05,
        progress: true,
        ..DemoConfig::default()
    };
    let summary = run(&url, &config).await?;
    print!("{summary}");
    Ok(())
}
