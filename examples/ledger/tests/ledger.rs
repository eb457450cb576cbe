//! The ledger behind a real broker and database: a credit sent twice is applied once,
//! and a deposit saga started twice runs once.

mod fixture;

use std::time::{Duration, Instant};

use fixture::Fixture;
use ledger_service::Credit;
use sagabox::orchestrate::{OrchestrateConfig, orchestrate};
use sagabox::participant::StepOptions;
use sagabox::saga::SagaDefinition;
use sagabox::transport::Sender;
use sagabox::{ConsumerType, Envelope, InboxConfig, MessageId, Participant};
use serde_json::json;

/// Waits until `done` holds, for at most 10 s.
async fn within_10_s(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done().await {
        assert!(Instant::now() < deadline, "{what} within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_credit_sent_twice_is_applied_once() {
    let fx = Fixture::new().await;
    let ledger = Participant::new(fx.store.clone(), fx.broker.clone())
        .step("ledger", Credit)
        .start()
        .await
        .expect("the participant starts");

    let credit = Envelope::new(
        MessageId::new("credit-request-1").unwrap(),
        "credit",
        json!({"account": "alice", "cents": 500}),
    )
    .unwrap();
    let mut sender = Sender::connect(&fx.broker, "test").await.unwrap();
    let ledger_queue = ConsumerType::new("ledger").unwrap();
    for _ in 0..2 {
        sender.send(&ledger_queue, &credit).await.unwrap();
    }
    sender.close().await;
    within_10_s("two acks", async || {
        ledger.report().step("ledger").map_or(0, |step| step.acked) == 2
    })
    .await;
    ledger.stop().await.unwrap();

    assert_eq!(fx.entries("alice").await, 1);
    fx.delete_queues(&["ledger", "notify"]).await;
}

#[tokio::test]
async fn a_deposit_started_twice_runs_once() {
    let fx = Fixture::new().await;
    let ledger = Participant::new(fx.store.clone(), fx.broker.clone())
        .step_with("ledger", Credit, StepOptions::default().kinds(["credit"]))
        .start()
        .await
        .expect("the participant starts");
    let deposit = SagaDefinition::load(concat!(env!("CARGO_MANIFEST_DIR"), "/sagas/deposit.toml"))
        .expect("the saga's definition");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let orchestrator = tokio::spawn(orchestrate(
        fx.store.clone(),
        OrchestrateConfig {
            definitions: vec![deposit],
            transport: fx.broker.clone(),
            resume_interval: Duration::from_secs(1),
            history_retention: None,
            inbox: InboxConfig::default(),
            pruner: None,
        },
        async move {
            let _ = stopped.await;
        },
    ));

    let start = Envelope::new(
        MessageId::new("deposit-request-1").unwrap(),
        "deposit",
        json!({"account": "bob", "cents": 700}),
    )
    .unwrap();
    let mut sender = Sender::connect(&fx.broker, "test").await.unwrap();
    for _ in 0..2 {
        sender.start_saga(&start).await.unwrap();
    }
    sender.close().await;
    within_10_s("the deposit completed", async || {
        let completed: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM sagabox.sagabox_saga_instances WHERE status = 'completed'",
        )
        .fetch_one(&fx.pool)
        .await
        .unwrap();
        completed == 1
    })
    .await;
    // Stopping finishes the start messages in flight; one not taken yet stays queued.
    let _ = stop.send(());
    orchestrator.await.unwrap().unwrap();
    ledger.stop().await.unwrap();

    let sagas: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM sagabox.sagabox_saga_instances")
        .fetch_one(&fx.pool)
        .await
        .unwrap();
    assert_eq!(sagas, 1, "one saga for two start messages");
    assert_eq!(fx.entries("bob").await, 1);
    assert_eq!(
        fx.queued("deposit.start").await,
        0,
        "both start messages taken"
    );
    fx.delete_queues(&["ledger", "notify", "deposit.start"])
        .await;
}
