//! The ledger participant: credits accounts, each command applied exactly once.

use ledger_service::Credit;
use sagabox::participant::{PrunerSettings, StepOptions};
use sagabox::relay::RelayConfig;
use sagabox::transport::Transport;
use sagabox::{Participant, PostgresStore};

/// Ctrl-C, or SIGTERM from the orchestrator of containers.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        },
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let database_url = std::env::var("DATABASE_URL")?;
    // amqp://… (RabbitMQ) or nats://… (NATS JetStream); queues are bank.<consumer type>.
    let broker = Transport::from_url(&std::env::var("BROKER_URL")?, "bank")?;

    // Workers of every step + the relay + the pruner + a few: each running handler
    // holds a connection for its transaction.
    let store = PostgresStore::connect(&database_url, 8).await?;
    // Our tables (sagabox's own are migrated by the participant at start, in its schema).
    sqlx::migrate!().run(store.pool()).await?;

    let report = Participant::new(store, broker)
        .step_with("ledger", Credit, StepOptions::default().kinds(["credit"]))
        .workers(4)
        .relay(RelayConfig::default())
        .pruner(PrunerSettings::default())
        .metrics_addr("127.0.0.1:9464") // 0.0.0.0:9464 for a Prometheus on another host
        .run(shutdown_signal())
        .await?;
    println!("{report:?}");
    Ok(())
}
