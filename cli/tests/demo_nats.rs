//! The checkout demo over NATS JetStream: in one process, and with payment, inventory
//! and email as separate `sagabox serve` processes on a `nats-server` of the test's own,
//! restarted part-way (real server, real PostgreSQL). Every invariant holds, nothing is
//! left in a work stream or dead-lettered.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;

use std::process::Child;
use std::time::{Duration, Instant};

use common::chaos::{FINISHED, UNFINISHED};
use jetstream::{Js, OwnServer};
use sagabox_checkout::{DemoConfig, DemoTransport, run};

const ROLES: [&str; 3] = ["payment", "inventory", "email"];

fn faulty(orders: usize, transport: DemoTransport) -> DemoConfig {
    DemoConfig {
        orders,
        concurrency: 32,
        duplicate_rate: 0.5,
        lost_reply_rate: 0.1,
        fail_rate: 0.1,
        decline_rate: 0.05,
        seed: 42,
        transport: Some(transport),
        ..DemoConfig::default()
    }
}

/// `sagabox serve --role role` over `js`'s server and prefix, failing 10 % of handler
/// runs (seeded).
fn serve(js: &Js, role: &str, database_url: &str, seed: u64) -> Child {
    common::sagabox_command(&[
        "serve",
        "--role",
        role,
        "--database-url",
        database_url,
        "--transport",
        &js.config.url,
        "--queue-prefix",
        &js.config.prefix,
        "--fail-rate",
        "0.1",
        "--seed",
        &seed.to_string(),
    ])
    .env("RUST_LOG", "error")
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .expect("start sagabox serve")
}

async fn assert_drained(js: &Js) {
    for role in ROLES {
        assert_eq!(js.pending(role).await, 0, "{role} stream drained");
        assert_eq!(js.dead(role).await, 0, "{role}: nothing dead-lettered");
    }
}

/// In one process, under the fault rates: every invariant holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_demo_over_jetstream_keeps_every_invariant() {
    let fx = common::Pg::new().await;
    let js = Js::new(&ROLES).await;
    let transport = DemoTransport {
        queue_prefix: js.config.prefix.clone(),
        ..DemoTransport::new(js.config.url.clone())
    };
    let summary = run(&fx.url, &faulty(300, transport)).await.unwrap();
    assert_eq!(
        (summary.orders, summary.unfinished),
        (300, 0),
        "{summary:?}"
    );
    assert_eq!(summary.damage(), 0, "{summary:?}");
    assert!(
        summary.duplicate_replies > 0 && summary.retries > 0,
        "{summary:?}"
    );
    let broken = common::invariants::violations(&fx.pool).await;
    assert!(broken.is_empty(), "invariants broken: {broken:?}");
    assert_drained(&js).await;
    // `inspect` reads each work stream's max_age from the server, beside the TTL.
    let inspected = common::sagabox_command(&[
        "inspect",
        "--database-url",
        &fx.url,
        "--nats-url",
        &js.config.url,
        "--queue-prefix",
        &js.config.prefix,
        "--json",
    ])
    .output()
    .unwrap();
    assert!(inspected.status.success(), "{inspected:?}");
    let report: serde_json::Value = serde_json::from_slice(&inspected.stdout).unwrap();
    let streams = report["broker_queues"].as_array().unwrap();
    assert_eq!(streams.len(), 3, "{report}");
    for stream in streams {
        assert_eq!(stream["retention_days"], 14.0, "{stream}");
        assert_eq!(stream["covered"], true, "{stream}");
    }
}

/// Participants as separate processes, the server restarted part-way while commands
/// are in flight: all reconnect, what was unacked is redelivered and absorbed by the
/// inboxes, the participants stop gracefully on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn participants_in_separate_processes_survive_a_server_restart() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("sagabox=info")
        .with_test_writer()
        .try_init();
    let mut server = OwnServer::start().await;
    let fx = common::Pg::new().await;
    let js = Js::on(&server.url(), &ROLES).await;
    let mut participants = common::children::Children::new(
        ROLES
            .iter()
            .map(|role| serve(&js, role, &fx.url, 5))
            .collect(),
    );
    let config = DemoConfig {
        fail_rate: 0.0, // failures are injected in the participants (--fail-rate 0.1)
        ..faulty(
            600,
            DemoTransport {
                external_participants: true,
                queue_prefix: js.config.prefix.clone(),
                ..DemoTransport::new(js.config.url.clone())
            },
        )
    };
    let demo = tokio::spawn({
        let url = fx.url.clone();
        async move { run(&url, &config).await }
    });
    // Part-way is an amount of work counted in the database, not a span of time.
    const PART_WAY: i64 = 150;
    let started = Instant::now();
    while fx.scalar(FINISHED).await < PART_WAY {
        common::cluster_run::check_alive(&mut participants[..], "");
        assert!(!demo.is_finished(), "the run ended early: {:?}", demo.await);
        assert!(started.elapsed() < common::chaos::STALL, "no progress");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The email participant's inserts are held until one waits: commands are then in
    // flight, and the run cannot end while the server restarts.
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
        common::cluster_run::check_alive(&mut participants[..], "");
        assert!(
            Instant::now() < deadline,
            "no email insert ever waited on the lock"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.restart().await;
    let placed = fx.scalar("SELECT COUNT(*) FROM demo_orders").await;
    let unfinished = fx.scalar(UNFINISHED).await;
    assert!(
        placed < 600 || unfinished > 0,
        "the server restarted after the run had ended"
    );
    hold.rollback().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    while !demo.is_finished() {
        common::cluster_run::check_alive(&mut participants[..], "");
        assert!(
            Instant::now() < deadline,
            "the run did not finish within 10 minutes of the restart ({} sagas finished)",
            fx.scalar(FINISHED).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let summary = demo.await.unwrap().unwrap();
    eprintln!("{summary:?}");
    // An ack sent while the server was down is lost with it: JetStream redelivers that
    // message after ack_wait (30 s by default) and the inbox answers it as a duplicate.
    // The participants run until every stream is empty.
    js.wait_drained(&ROLES, Duration::from_secs(120), "", || {
        common::cluster_run::check_alive(&mut participants[..], "");
    })
    .await;
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
    assert_eq!(
        (summary.orders, summary.unfinished),
        (600, 0),
        "{summary:?}"
    );
    assert_eq!(summary.damage(), 0, "{summary:?}");
    let broken = common::invariants::violations(&fx.pool).await;
    assert!(broken.is_empty(), "invariants broken: {broken:?}");
    assert_drained(&js).await;
}
