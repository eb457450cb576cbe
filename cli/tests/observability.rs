//! The binary's operator surface, run as an operator would: `sagabox inspect` after a
//! `sagabox demo` (table and JSON, figures equal to SQL counts, its duplicate deliveries
//! at least the demo's duplicate replies), `--metrics-addr` served
//! while a demo runs, `--log-format json` lines carrying the spans, and no password from
//! a database URL anywhere in the output, even at `RUST_LOG=trace`.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::scrape::{free_port, has_metric, has_unlabelled_series, scrape};
use sagabox::metrics::CATALOGUE;

/// The binary with `args`, no `DATABASE_URL` and the given `RUST_LOG` (none: unset).
fn sagabox(args: &[&str], rust_log: Option<&str>) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sagabox"));
    command
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("SAGABOX_DATABASE_URL")
        .env_remove("SAGABOX_LOG_FORMAT");
    match rust_log {
        Some(filter) => command.env("RUST_LOG", filter),
        None => command.env_remove("RUST_LOG"),
    };
    command
}

fn run(args: &[&str], rust_log: Option<&str>) -> Output {
    sagabox(args, rust_log).output().expect("run sagabox")
}

fn succeeded(output: &Output) -> String {
    assert!(
        output.status.success(),
        "sagabox failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test]
async fn inspect_after_a_demo_prints_a_table_and_json_that_match_sql() {
    let db = common::Lite::new().await;
    let demo = succeeded(&run(
        &[
            "demo",
            "--database-url",
            &db.url,
            "--orders",
            "60",
            "--json",
        ],
        None,
    ));
    let demo: serde_json::Value = serde_json::from_str(demo.trim()).expect("one JSON object");
    let duplicate_replies = demo["duplicate_replies"]
        .as_i64()
        .expect("duplicate_replies");

    let table = succeeded(&run(&["inspect", "--database-url", &db.url], None));
    for section in [
        "inbox partitions",
        "retention",
        "duplicate deliveries absorbed",
        "sagas",
        "outbox",
        "warnings\n  none",
    ] {
        assert!(table.contains(section), "no {section:?} in\n{table}");
    }

    let json = succeeded(&run(
        &["inspect", "--database-url", &db.url, "--json"],
        None,
    ));
    let report: serde_json::Value = serde_json::from_str(json.trim()).expect("one JSON object");
    let completed = db
        .scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'completed'")
        .await;
    let compensated = db
        .scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'compensated'")
        .await;
    assert_eq!(
        report["sagas"]["by_status"]["completed"].as_i64(),
        Some(completed)
    );
    assert_eq!(
        report["sagas"]["by_status"]["compensated"].as_i64(),
        Some(compensated)
    );
    assert_eq!(completed + compensated, 60);
    let rows: i64 = report["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["rows"].as_i64().unwrap())
        .sum();
    assert_eq!(rows, db.inbox_rows().await);
    let duplicates: i64 = report["duplicate_deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["in_inbox"].as_i64().unwrap())
        .sum();
    // As docs/operations.md says: every duplicate reply the demo received is one of the
    // duplicate deliveries counted on the rows; the answers it never received (to the
    // injected second copies, lost on the way) are counted there too.
    assert!(duplicate_replies > 0, "{demo}");
    assert!(
        duplicates >= duplicate_replies,
        "inspect counted {duplicates} duplicate deliveries, the demo {duplicate_replies} duplicate replies"
    );
}

#[tokio::test]
async fn inspect_refuses_a_missing_file_and_an_unmigrated_database() {
    let path = std::env::temp_dir().join(format!(
        "sagabox_absent_{}.db",
        uuid::Uuid::new_v4().simple()
    ));
    let output = run(
        &[
            "inspect",
            "--database-url",
            &format!("sqlite:{}", path.display()),
        ],
        None,
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("there is no file {}", path.display()))
            && stderr.contains("run `sagabox migrate"),
        "{stderr}"
    );
    assert!(!path.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_serves_the_catalogue_while_it_runs() {
    let db = common::Lite::new().await;
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut demo = sagabox(
        &[
            "demo",
            "--database-url",
            &db.url,
            "--orders",
            "1000",
            "--metrics-addr",
            &addr.to_string(),
            "--json",
        ],
        None,
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        assert!(
            demo.try_wait().unwrap().is_none(),
            "the demo ended before the endpoint answered"
        );
        assert!(Instant::now() < deadline, "the endpoint never answered");
        match scrape(addr).await {
            Ok(text) => break text,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    // The first answer: what is registered at start — every metric without labels, at
    // zero, and the build info — and no labelled family without its labels.
    for spec in CATALOGUE {
        if spec.labels.is_empty() {
            assert!(
                has_metric(&text, spec.name),
                "{} missing from\n{text}",
                spec.name
            );
        } else {
            assert!(
                !has_unlabelled_series(&text, spec.name),
                "{} has a series without its labels:\n{text}",
                spec.name
            );
        }
    }
    assert!(
        text.contains(&format!(
            "sagabox_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    let output = demo.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn bad_flags_are_refused_with_what_to_do() {
    let output = run(
        &[
            "demo",
            "--database-url",
            "sqlite:never.db",
            "--metrics-addr",
            "9464",
        ],
        None,
    );
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("give HOST:PORT"),
        "{output:?}"
    );
    assert!(
        !std::path::Path::new("never.db").exists(),
        "the demo started anyway"
    );

    let output = run(&["--log-format", "xml", "inspect"], None);
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("human or json"),
        "{output:?}"
    );

    let output = run(
        &["inspect", "--database-url", "sqlite:never.db"],
        Some("sagabox=loud"),
    );
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("is not a valid filter"),
        "{output:?}"
    );
}

/// `--log-format json` at `RUST_LOG=trace` (every crate, every span), with a password in
/// the URL: each line is one JSON object, the guard's and the orchestrator's spans are
/// there with their fields, and the password is nowhere — not in the demo's, the
/// migration's or inspect's output, nor in an error.
#[tokio::test]
async fn json_logs_carry_the_spans_and_never_a_password() {
    let db = common::Pg::new().await;
    let (scheme_user, rest) = db.url.split_once('@').expect("user@host in the test URL");
    let user = scheme_user.split_once("//").expect("scheme://").1;
    assert!(
        !user.contains(':'),
        "the fixture URL already has a password"
    );
    let secret_url = format!("{scheme_user}:hunter2@{rest}");

    let mut outputs = Vec::new();
    outputs.push(run(
        &[
            "--log-format",
            "json",
            "migrate",
            "--database-url",
            &secret_url,
        ],
        Some("trace"),
    ));
    let demo = run(
        &[
            "--log-format",
            "json",
            "demo",
            "--database-url",
            &secret_url,
            "--orders",
            "5",
        ],
        Some("trace"),
    );
    let stderr = String::from_utf8_lossy(&demo.stderr).into_owned();
    succeeded(&demo);
    outputs.push(demo);
    outputs.push(run(
        &[
            "--log-format",
            "json",
            "inspect",
            "--database-url",
            &secret_url,
        ],
        Some("trace"),
    ));
    let wrong_port = secret_url.replace(":5432/", ":1/");
    let failed = run(
        &[
            "--log-format",
            "json",
            "inspect",
            "--database-url",
            &wrong_port,
        ],
        Some("trace"),
    );
    assert!(!failed.status.success());
    outputs.push(failed);
    for output in &outputs {
        for text in [&output.stdout, &output.stderr] {
            let text = String::from_utf8_lossy(text);
            assert!(!text.contains("hunter2"), "a password leaked:\n{text}");
        }
    }

    let mut inbox_spans = 0;
    let mut step_spans = 0;
    for line in stderr.lines() {
        let event: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        match event["span"]["name"].as_str() {
            Some("inbox.process") if event["fields"]["message"] == "close" => {
                inbox_spans += 1;
                for field in ["consumer_type", "message_id", "saga_id", "outcome"] {
                    assert!(event["span"][field].is_string(), "{field} missing: {line}");
                }
            }
            Some("saga.step") if event["fields"]["message"] == "close" => {
                step_spans += 1;
                for field in ["saga", "saga_id", "step", "direction", "outcome"] {
                    assert!(event["span"][field].is_string(), "{field} missing: {line}");
                }
                assert!(event["span"]["attempt"].is_number(), "{line}");
            }
            _ => {}
        }
    }
    // Five sagas of three steps at least, each step at least one guarded message.
    assert!(step_spans >= 5, "{step_spans} step spans");
    assert!(
        inbox_spans >= step_spans,
        "{inbox_spans} inbox spans for {step_spans} step spans"
    );

    // Human format by default: no JSON, no colour codes into a pipe.
    let human = run(
        &["demo", "--database-url", &secret_url, "--orders", "2"],
        Some("sagabox=debug"),
    );
    succeeded(&human);
    let text = String::from_utf8_lossy(&human.stderr);
    assert!(
        text.contains("inbox.process{consumer_type=payment"),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "colour codes in a pipe");
    assert!(!text.contains("hunter2"));
}
