//! `sagabox saga list|show|retry|cancel` run as an operator would, against a fresh
//! PostgreSQL database and SQLite files: the listing and the timeline read what the
//! tables hold; retry and cancel change the saga and record who and why in its history;
//! an unknown id, a finished saga, a saga in the wrong state, bad arguments, an
//! unreachable or unmigrated database each say so, exit 1 or 2, and change nothing.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::Output;

use chrono::Utc;
use sagabox::saga::{SagaDefinition, SagaInsert, SagaInstance, SagaStatus, SagaStore};
use serde_json::{Value, json};

const ORDER: &str = r#"
name = "order"
[[steps]]
name = "a"
consumer_type = "a"
command = "do_a"
compensation = "undo_a"
timeout = "5s"
[[steps]]
name = "b"
consumer_type = "b"
command = "do_b"
compensation = "undo_b"
timeout = "5s"
[[steps]]
name = "c"
consumer_type = "c"
command = "do_c"
timeout = "5s"
"#;

/// The binary with `args`, without the test's environment choosing for it.
fn sagabox(args: &[&str]) -> Output {
    common::sagabox_command(args)
        .env("USER", "test-operator")
        .output()
        .expect("run sagabox")
}

/// `sagabox saga <args> --database-url <url>`.
fn saga(url: &str, args: &[&str]) -> Output {
    let mut all = vec!["saga"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--database-url", url]);
    sagabox(&all)
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "sagabox failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        stderr(output)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn json(output: &Output) -> Value {
    serde_json::from_str(&stdout(output)).expect("one JSON object")
}

/// A failure with exit status `code` whose stderr contains `needle`.
fn fails(output: &Output, code: i32, needle: &str) {
    assert_eq!(output.status.code(), Some(code), "{}", stderr(output));
    assert!(
        stderr(output).contains(needle),
        "{needle:?} in {}",
        stderr(output)
    );
}

/// Three sagas of `order`: one parked on a refused compensation, one running at step b,
/// one completed.
async fn sagas(store: &sagabox::PostgresStore) {
    let definition = SagaDefinition::from_toml_str(ORDER).unwrap();
    store.register_definition(&definition).await.unwrap();
    let now = Utc::now();
    let mut parked = SagaInstance::under(&definition, "parked-1", json!({"n": 1}), now);
    parked.status = SagaStatus::Compensating;
    parked.current_step = 0;
    parked.parked = Some("undo a refused: card expired".into());
    let mut running = SagaInstance::under(&definition, "running-1", json!({"n": 2}), now);
    running.current_step = 1;
    let mut done = SagaInstance::under(&definition, "done-1", json!({"n": 3}), now);
    done.status = SagaStatus::Completed;
    done.current_step = 3;
    let mut conn = store.pool().acquire().await.unwrap();
    for saga in [&parked, &running, &done] {
        store.insert(&mut conn, saga).await.unwrap();
    }
}

async fn version(store: &sagabox::PostgresStore, id: &str) -> i64 {
    store.load(id).await.unwrap().unwrap().version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_lists_shows_retries_and_cancels_sagas() {
    let fx = common::Pg::new().await;
    let store = fx.store(2).await;
    sagas(&store).await;
    let url = fx.url.as_str();

    let listing = stdout(&saga(url, &["list"]));
    for id in ["parked-1", "running-1", "done-1"] {
        assert!(listing.contains(id), "{listing}");
    }
    assert!(
        listing.contains("undo a refused: card expired"),
        "{listing}"
    );
    let parked = json(&saga(url, &["list", "--status", "parked", "--json"]));
    let ids: Vec<&str> = parked["sagas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["parked-1"]);
    let running = json(&saga(
        url,
        &["list", "--status", "running", "--saga", "order", "--json"],
    ));
    assert_eq!(running["sagas"][0]["id"], "running-1");
    assert_eq!(running["sagas"][0]["step"], "b");
    let other = json(&saga(url, &["list", "--saga", "trip", "--json"]));
    assert_eq!(other["sagas"], json!([]));

    let shown = json(&saga(url, &["show", "parked-1", "--json"]));
    assert_eq!(shown["saga"]["state"], "parked");
    assert_eq!(shown["timeline"][0]["kind"], "started");
    let text = stdout(&saga(url, &["show", "running-1"]));
    assert!(
        text.contains("state      running") && text.contains("timeline"),
        "{text}"
    );

    let retried = json(&saga(
        url,
        &["retry", "parked-1", "--note", "card renewed", "--json"],
    ));
    assert_eq!(retried["saga"]["state"], "compensating");
    let after = store.load("parked-1").await.unwrap().unwrap();
    assert_eq!(after.parked, None);
    let history = store.history("parked-1").await.unwrap();
    let last = &history.last().unwrap().event;
    assert_eq!(last.kind.as_str(), "retried");
    assert_eq!(last.detail.as_deref(), Some("test-operator: card renewed"));

    let cancelled = stdout(&saga(
        url,
        &["cancel", "running-1", "--note", "customer left"],
    ));
    assert!(
        cancelled.contains("saga running-1 cancelled"),
        "{cancelled}"
    );
    let after = store.load("running-1").await.unwrap().unwrap();
    assert_eq!(
        (after.status, after.current_step),
        (SagaStatus::Compensating, 1)
    );

    // Refusals: exit 1, a message that says why, nothing changed.
    let before = version(&store, "done-1").await;
    fails(&saga(url, &["retry", "done-1"]), 1, "already completed");
    fails(&saga(url, &["cancel", "done-1"]), 1, "already completed");
    assert_eq!(version(&store, "done-1").await, before);
    let before = version(&store, "running-1").await;
    fails(
        &saga(url, &["cancel", "running-1"]),
        1,
        "already compensating",
    );
    fails(&saga(url, &["retry", "running-1"]), 1, "not parked");
    assert_eq!(version(&store, "running-1").await, before);
    fails(&saga(url, &["show", "nope"]), 1, "no saga with id nope");
    fails(&saga(url, &["retry", "nope"]), 1, "no saga with id nope");
    let failed = saga(url, &["cancel", "nope", "--json"]);
    assert_eq!(failed.status.code(), Some(1));
    let error: Value = serde_json::from_slice(&failed.stdout).unwrap();
    assert!(error["error"].as_str().unwrap().contains("nope"), "{error}");

    // `prune` keeps the history of sagas created this month, finished or not.
    let pruned = stdout(&sagabox(&[
        "prune",
        "--history-retention-days",
        "30",
        "--database-url",
        url,
    ]));
    assert!(
        pruned.contains("saga history months dropped: none; rows deleted: 0"),
        "{pruned}"
    );
    assert_eq!(store.history("done-1").await.unwrap().len(), 1);

    // Usage errors: exit 2.
    fails(
        &saga(url, &["list", "--status", "stuck"]),
        2,
        "invalid value 'stuck'",
    );
    fails(&saga(url, &["list", "--limit", "0"]), 2, "--limit");
    fails(&saga(url, &["show"]), 2, "<ID>");
}

#[test]
fn an_unreachable_or_unmigrated_database_is_named_and_left_alone() {
    let refused = saga("postgres://postgres@127.0.0.1:5499/none", &["list"]);
    fails(&refused, 1, "127.0.0.1:5499");

    let folder =
        std::env::temp_dir().join(format!("sagabox-saga-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir(&folder).unwrap();
    let file = folder.join("none.db");
    let url = format!("sqlite:{}", file.display());
    fails(&saga(&url, &["show", "x"]), 1, "sagabox migrate");
    assert!(!file.exists(), "an operator command creates no database");
    fails(&saga("mysql://localhost/x", &["list"]), 2, "--database-url");
    std::fs::remove_dir_all(&folder).unwrap();
}

/// The embedded default: a demo's sagas, listed and shown from the SQLite file.
#[test]
fn the_demo_s_sagas_are_listed_and_shown_from_sqlite() {
    let folder =
        std::env::temp_dir().join(format!("sagabox-saga-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir(&folder).unwrap();
    let url = format!("sqlite:{}", folder.join("demo.db").display());
    let demo = sagabox(&[
        "demo",
        "--orders",
        "20",
        "--decline-rate",
        "0.5",
        "--seed",
        "3",
        "--database-url",
        &url,
    ]);
    assert!(demo.status.success(), "{}", stderr(&demo));
    let listed = json(&saga(&url, &["list", "--status", "compensated", "--json"]));
    let compensated = listed["sagas"].as_array().unwrap();
    assert!(
        !compensated.is_empty(),
        "a decline rate of 0.5 compensates some of 20 orders"
    );
    let id = compensated[0]["id"].as_str().unwrap();
    let shown = json(&saga(&url, &["show", id, "--json"]));
    let kinds: Vec<&str> = shown["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds.first(), Some(&"started"));
    assert_eq!(kinds.last(), Some(&"compensated"));
    assert!(kinds.contains(&"refused"), "{kinds:?}");
    let all = json(&saga(&url, &["list", "--limit", "100", "--json"]));
    assert_eq!(all["sagas"].as_array().unwrap().len(), 20);
    std::fs::remove_dir_all(&folder).unwrap();
}
