//! The checkout demo over RabbitMQ with payment, inventory and email as separate
//! `sagabox serve` processes (real broker, real PostgreSQL). Its own test binary: it
//! needs some 60 connections, which it should not share with the other demo tests.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use sagabox_checkout::{DemoConfig, run};

fn faulty(orders: usize) -> DemoConfig {
    DemoConfig {
        orders,
        concurrency: 32,
        duplicate_rate: 0.5,
        lost_reply_rate: 0.1,
        fail_rate: 0.1,
        decline_rate: 0.05,
        seed: 42,
        ..DemoConfig::default()
    }
}

use common::chaos::{FINISHED, UNFINISHED};
use common::rabbit::Rabbit;
use sagabox_checkout::DemoTransport;

const ROLES: [&str; 3] = ["payment", "inventory", "email"];

fn check_alive(participants: &mut [Child]) {
    for child in participants.iter_mut() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                std::io::Read::read_to_string(&mut pipe, &mut stderr).unwrap();
            }
            panic!("a participant exited ({status}): {stderr}");
        }
    }
}

/// The checkout demo over RabbitMQ with payment, inventory and email as separate
/// `sagabox serve` processes (real broker, real PostgreSQL), under the saga issue's
/// fault rates and with every broker connection closed part-way: every invariant holds,
/// the participants stop gracefully on SIGTERM, and no command that still needed applying
/// is left in a queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn participants_in_separate_processes_keep_every_invariant() {
    // The library's warnings (reconnections, abandoned deliveries) show with a failure.
    let _ = tracing_subscriber::fmt()
        .with_env_filter("sagabox=info")
        .with_test_writer()
        .try_init();
    let fx = common::Pg::new().await;
    let rabbit = Rabbit::new(&ROLES).await;
    let mut participants = common::children::Children::new(
        ROLES
            .iter()
            .map(|role| rabbit.serve(role, &fx.url, 5))
            .collect(),
    );
    let config = DemoConfig {
        fail_rate: 0.0, // failures are injected in the participants (--fail-rate 0.1)
        transport: Some(DemoTransport {
            external_participants: true,
            queue_prefix: rabbit.config.queue_prefix.clone(),
            max_deliveries: common::rabbit::MAX_DELIVERIES,
            ..DemoTransport::new(rabbit.config.url.clone())
        }),
        ..faulty(1000)
    };
    // Ready when each queue has its consumer; a participant that dies fails the test.
    let deadline = Instant::now() + Duration::from_secs(60);
    for role in ROLES {
        while rabbit.consumers(&rabbit.queue(role)).await == 0 {
            check_alive(&mut participants[..]);
            assert!(
                Instant::now() < deadline,
                "the {role} participant never started consuming"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let demo = tokio::spawn({
        let url = fx.url.clone();
        async move { run(&url, &config).await }
    });
    // Part-way through, the broker drops every connection of the run (participants'
    // consumers and the orchestrator's dispatch): all reconnect, and what was in
    // flight is redelivered and absorbed by the inboxes. "Part-way" is an amount of work
    // counted in the database, not a span of time, so that a fast build is caught
    // mid-run as surely as a slow one.
    const PART_WAY: i64 = 200;
    let mut last = (0, Instant::now());
    loop {
        check_alive(&mut participants[..]);
        if demo.is_finished() {
            panic!(
                "the run ended before {PART_WAY} sagas finished: {:?}",
                demo.await
            );
        }
        let done = fx.scalar(FINISHED).await;
        if done >= PART_WAY {
            break;
        }
        if done > last.0 {
            last = (done, Instant::now());
        }
        assert!(
            last.1.elapsed() < common::chaos::STALL,
            "the run made no progress for {:?} ({done} sagas finished)",
            common::chaos::STALL
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The email participant's inserts are held (the test takes a SHARE lock on
    // `emails_sent`) until one of them waits: commands are then in flight and the run
    // cannot end while `rabbitmqctl` closes the connections, however fast the build.
    let mut hold = fx.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE emails_sent IN SHARE MODE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let deadline = Instant::now() + common::chaos::STALL;
    while fx
        .scalar(
            "SELECT COUNT(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
             WHERE c.relname = 'emails_sent' AND NOT l.granted \
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .await
        == 0
    {
        check_alive(&mut participants[..]);
        assert!(
            Instant::now() < deadline,
            "no email insert ever waited on the lock"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let dropped = rabbit.close_all_connections();
    // Counted after the last close: orders still to place, or a saga not finished, mean
    // the run had not ended when the connections went.
    let placed = fx.scalar("SELECT COUNT(*) FROM demo_orders").await;
    let unfinished = fx.scalar(UNFINISHED).await;
    assert!(
        placed < 1000 || unfinished > 0,
        "the connections were closed after the run had ended"
    );
    hold.rollback().await.unwrap();
    assert!(
        dropped >= 4,
        "the broker closed the participants' and the orchestrator's connections ({dropped})"
    );
    let deadline = Instant::now() + Duration::from_secs(600);
    while !demo.is_finished() {
        check_alive(&mut participants[..]);
        assert!(
            Instant::now() < deadline,
            "the run did not finish within 10 minutes of the connections' close ({} sagas finished)",
            fx.scalar(FINISHED).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let summary = demo.await.unwrap().unwrap();
    eprintln!("{summary:?}");
    for child in participants.iter() {
        common::children::terminate(child);
    }
    for child in std::mem::take(&mut participants.0) {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "a participant did not stop cleanly: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    assert_eq!(summary.orders, 1000);
    assert_eq!(summary.unfinished, 0, "{summary:?}");
    assert_eq!(summary.damage(), 0, "{summary:?}");
    assert!(
        summary.retries > 0 && summary.duplicate_replies > 0,
        "{summary:?}"
    );
    assert!(
        !summary.transport.contains("guest:guest"),
        "password redacted: {}",
        summary.transport
    );
    let broken = common::invariants::violations(&fx.pool).await;
    assert!(broken.is_empty(), "invariants broken: {broken:?}");
    // Handler failures (--fail-rate in the participants) were retried, not lost.
    let failed_then_applied = fx
        .scalar("SELECT COUNT(*) FROM sagabox_inbox WHERE consumer_type = 'payment'")
        .await;
    assert!(
        failed_then_applied >= 1000 - summary.compensated,
        "{failed_then_applied}"
    );
    for role in ROLES {
        // The run ends when every saga has its answers; a redundant copy of a command (the
        // demo's duplicate, or a resend after a lost reply) may still be in the queue, or
        // be requeued by a retry that was backing off when SIGTERM came. None may be a
        // command that still needed applying: each one left was applied already (its id
        // is in the role's inbox), so the next consumer answers it from there.
        for left in rabbit.drain(&rabbit.queue(role)).await {
            let id = left
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .expect("a command has its message id");
            let applied: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM sagabox_inbox WHERE consumer_type = $1 AND message_id = $2",
            )
            .bind(role)
            .bind(&id)
            .fetch_one(&fx.pool)
            .await
            .unwrap();
            assert_eq!(applied, 1, "{role}: {id} was left in the queue unapplied");
        }
        // Shown with their headers (the reason, the detail, RabbitMQ's x-death) so a
        // failure says why a message was dead-lettered.
        let dead: Vec<_> = rabbit
            .drain(&rabbit.dead_queue(role))
            .await
            .into_iter()
            .map(|message| {
                (
                    String::from_utf8_lossy(&message.delivery.data).into_owned(),
                    message.delivery.properties.headers().clone(),
                )
            })
            .collect();
        assert!(dead.is_empty(), "{role}: dead-lettered {dead:#?}");
    }
}
