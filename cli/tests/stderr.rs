//! The built `sagabox demo` and `sagabox serve` with their stderr unwritable
//! (`2>/dev/full`, a log shipper gone): the demo finishes instead of hanging, and serve
//! consumes, then stops cleanly on SIGTERM. Every wait is bounded.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;

const BOUND: Duration = Duration::from_secs(20);

/// With logging on and stderr unwritable, the demo must end (and succeed: losing log
/// lines is not a failure of the work), not hang on an actor killed by its logging.
#[test]
fn the_demo_finishes_with_an_unwritable_stderr() {
    let dir = tempdir();
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .args([
            "demo",
            "--json",
            "--orders",
            "20",
            "--database-url",
            &format!("sqlite:{}/h.db", dir.display()),
        ])
        .env("RUST_LOG", "sagabox=debug")
        .env_remove("AMQP_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(full))
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("the demo hung with its stderr at /dev/full");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut report = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut report).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "{status}: {report}");
    let summary: Value = serde_json::from_str(&report).unwrap();
    assert_eq!(summary["orders"], 20, "{report}");
    assert_eq!(summary["unfinished"], 0, "{report}");
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sagabox_sup_{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `sagabox serve` with logging on and stderr unwritable serves the checkout saga's
/// steps (a demo in this process drives sagas through it) and stops cleanly on SIGTERM,
/// instead of dying on its first log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_works_and_stops_cleanly_with_an_unwritable_stderr() {
    use sagabox_checkout::{DemoConfig, DemoTransport, run};
    let fx = common::Pg::new().await;
    let rabbit = common::rabbit::Rabbit::new(&["payment", "inventory", "email"]).await;
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let serve = std::process::Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .args([
            "serve",
            "--role",
            "payment,inventory,email",
            "--database-url",
            &fx.url,
            "--transport",
            &rabbit.config.url,
            "--queue-prefix",
            &rabbit.config.queue_prefix,
        ])
        .env_remove("DATABASE_URL")
        .env_remove("SAGABOX_DATABASE_URL")
        .env_remove("AMQP_URL")
        .env("RUST_LOG", "sagabox=debug")
        .stdout(Stdio::null())
        .stderr(Stdio::from(full))
        .spawn()
        .unwrap();
    let mut serve = common::children::Children::new(vec![serve]);
    let deadline = Instant::now() + BOUND;
    for role in ["payment", "inventory", "email"] {
        while rabbit.consumers(&rabbit.queue(role)).await == 0 {
            assert!(
                serve[0].try_wait().unwrap().is_none(),
                "serve exited before consuming {role}"
            );
            assert!(Instant::now() < deadline, "serve never consumed {role}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let config = DemoConfig {
        orders: 20,
        transport: Some(DemoTransport {
            external_participants: true,
            queue_prefix: rabbit.config.queue_prefix.clone(),
            ..DemoTransport::new(rabbit.config.url.clone())
        }),
        ..DemoConfig::default()
    };
    let summary = tokio::time::timeout(Duration::from_secs(120), run(&fx.url, &config))
        .await
        .expect("the demo ends")
        .unwrap();
    assert_eq!((summary.orders, summary.unfinished), (20, 0), "{summary:?}");
    let status = common::children::stop(&mut serve[0], "serve", BOUND).await;
    assert!(status.success(), "serve stopped with {status}");
}
