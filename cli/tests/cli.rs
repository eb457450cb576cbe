//! The `sagabox` binary run as a user would, against fresh SQLite files, fresh
//! PostgreSQL databases and the real RabbitMQ: `migrate`, `prune` and `bench`; one
//! default database for every subcommand; usage errors (exit status 2); errors that say
//! what is wrong and where; `--json` failures as one object; the demo's verdict as its
//! exit status; `serve`'s up and stop lines.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;

use common::sagabox_command as command;

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

fn sagabox(args: &[&str]) -> Output {
    command(args).output().expect("run sagabox")
}

/// An empty folder of its own, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let path =
            std::env::temp_dir().join(format!("sagabox-cli-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&path).unwrap();
        Self(path)
    }

    /// `sqlite:` and the path of `file` in this folder.
    fn url(&self, file: &str) -> String {
        format!("sqlite:{}", self.0.join(file).display())
    }

    /// Runs the binary in this folder.
    fn run(&self, args: &[&str]) -> Output {
        command(args)
            .current_dir(&self.0)
            .output()
            .expect("run sagabox")
    }

    fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn is_empty(&self) -> bool {
        self.files().is_empty()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// stdout as the one JSON object it must be.
fn json(output: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(text.lines().count(), 1, "one line on stdout: {text}");
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "sagabox failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test]
async fn migrate_creates_partitions_on_sqlite_and_is_idempotent() {
    let db = common::Lite::new().await;
    let first = stdout(&sagabox(&["migrate", "--database-url", &db.url]));
    // The fixture already ran the migrations; partitions are what migrate adds here.
    assert!(first.contains("partitions created: "), "{first}");
    assert!(!first.contains("none"), "{first}");
    let second = stdout(&sagabox(&["migrate", "--database-url", &db.url]));
    assert!(second.contains("none (all present)"), "{second}");
    let tables = db
        .scalar("SELECT COUNT(*) FROM sqlite_master WHERE name GLOB 'sagabox_inbox_[0-9][0-9][0-9][0-9]_[0-9][0-9]'")
        .await;
    assert_eq!(tables, 3, "current month and 2 ahead");
}

#[tokio::test]
async fn migrate_runs_on_a_fresh_postgres_database() {
    let db = common::Pg::new().await;
    let out = stdout(&sagabox(&[
        "migrate",
        "--database-url",
        &db.url,
        "--partitions-ahead",
        "4",
    ]));
    assert!(out.contains("partitions created: "), "{out}");
    let partitions = db
        .scalar("SELECT COUNT(*) FROM pg_inherits WHERE inhparent = 'sagabox_inbox'::regclass")
        .await;
    assert_eq!(partitions, 5);
}

#[test]
fn migrate_refuses_an_unknown_url_without_leaking_the_password() {
    let output = sagabox(&["migrate", "--database-url", "mysql://app:hunter2@db/x"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unsupported database url"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

fn check_bench_json(text: &str, messages: u64) {
    let report: serde_json::Value = serde_json::from_str(text.trim()).expect("one JSON object");
    let modes = report["modes"].as_array().expect("modes");
    let names: Vec<&str> = modes.iter().map(|m| m["mode"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "raw_sql",
            "guard",
            "actor",
            "batched",
            "raw_batch_set",
            "batched_set",
            "set_no_inbox",
            "no_inbox"
        ]
    );
    for mode in modes {
        assert_eq!(mode["messages"].as_u64(), Some(messages), "{mode}");
        assert!(mode["msgs_per_sec"].as_f64().unwrap() > 0.0, "{mode}");
        assert!(mode["p99_us"].as_u64().unwrap() >= mode["p50_us"].as_u64().unwrap());
    }
    assert_eq!(modes[0]["ratio_to_raw"].as_f64(), Some(1.0));
}

#[tokio::test]
async fn bench_reports_every_mode_on_postgres_and_dedups_repeats() {
    let db = common::Pg::new().await;
    let out = stdout(&sagabox(&[
        "bench",
        "--database-url",
        &db.url,
        "--messages",
        "300",
        "--concurrency",
        "4",
        "--duplicate-rate",
        "0.3",
        "--json",
    ]));
    check_bench_json(&out, 300);
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let applied = |i: usize| report["modes"][i]["applied"].as_u64().unwrap();
    // The same repeated ids: both raw baselines, the guard, the step pool and both batched
    // modes apply each once; without an inbox (both ceilings) every repeat is applied again.
    for deduplicating in 1..=5 {
        assert_eq!(applied(0), applied(deduplicating), "mode {deduplicating}");
    }
    assert!(applied(1) < 300, "repeats were deduplicated");
    assert_eq!(applied(6), 300, "set_no_inbox applies every repeat");
    assert_eq!(applied(7), 300, "no_inbox applies every repeat");
    // The scratch schema is gone afterwards.
    let left = db
        .scalar("SELECT COUNT(*) FROM pg_namespace WHERE nspname LIKE 'sagabox_bench_%'")
        .await;
    assert_eq!(left, 0);
}

#[test]
fn bench_runs_on_sqlite() {
    let out = stdout(&sagabox(&[
        "bench",
        "--database-url",
        "sqlite:ignored.db",
        "--messages",
        "200",
        "--concurrency",
        "2",
        "--json",
    ]));
    check_bench_json(&out, 200);
}

#[test]
fn bench_refuses_bad_arguments() {
    let output = sagabox(&[
        "bench",
        "--database-url",
        "sqlite:x.db",
        "--duplicate-rate",
        "1.5",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--duplicate-rate") && stderr.contains("rate 1.5 is out of range"),
        "{stderr}"
    );
    let output = sagabox(&["bench", "--database-url", "sqlite:x.db", "--modes", "turbo"]);
    assert_eq!(output.status.code(), Some(2), "a usage error");
    assert!(String::from_utf8_lossy(&output.stderr).contains("invalid value 'turbo' for '--modes"));
    let output = sagabox(&["bench", "--database-url", "sqlite:x.db", "--batch", "0"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("0 is not in 1..=10000"));
    let output = sagabox(&["bench", "--database-url", "sqlite:x.db", "--prefill", "10"]);
    assert!(String::from_utf8_lossy(&output.stderr).contains("run on PostgreSQL only"));
}

/// The mode names in `bench --help` (clap's `Possible values:` list, or its inline
/// `[possible values: …]` form).
fn modes_in_help(help: &str) -> Vec<String> {
    let section = help
        .split("--modes <MODES>")
        .nth(1)
        .expect("--modes in the help");
    let section = section.split("\n      --").next().unwrap_or(section);
    if let Some(inline) = section.split("[possible values: ").nth(1) {
        return inline
            .split(']')
            .next()
            .unwrap()
            .split(", ")
            .map(str::to_owned)
            .collect();
    }
    let list = section
        .split("Possible values:")
        .nth(1)
        .expect("possible values under --modes");
    list.lines()
        .filter_map(|line| line.trim().strip_prefix("- "))
        .map(|item| item.split(':').next().unwrap().trim().to_owned())
        .collect()
}

/// `bench --help` and the error for an unknown mode name the same modes, and those are
/// the modes a full run reports (`check_bench_json`).
#[test]
fn bench_help_and_the_unknown_mode_error_list_the_same_modes() {
    let help = stdout(&sagabox(&["bench", "--help"]));
    let in_help = modes_in_help(&help);

    let output = sagabox(&["bench", "--database-url", "sqlite:x.db", "--modes", "foo"]);
    assert_eq!(output.status.code(), Some(2), "a usage error");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let in_error: Vec<String> = stderr
        .split("[possible values: ")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .unwrap_or_else(|| panic!("no possible values in {stderr}"))
        .split(", ")
        .map(str::to_owned)
        .collect();

    assert_eq!(in_help, in_error, "help:\n{help}\nerror:\n{stderr}");
    assert_eq!(
        in_help,
        [
            "raw_sql",
            "guard",
            "actor",
            "batched",
            "raw_batch_set",
            "batched_set",
            "set_no_inbox",
            "no_inbox"
        ]
    );
}

/// `demo --clock-speed`: out-of-range speeds and a fast clock with `--resume` are refused
/// as usage errors (exit status 2) with the reason, before anything touches the database.
#[test]
fn demo_refuses_a_bad_clock_speed() {
    for (speed, expected) in [
        ("0.5", "clock speed must be a number from 1 to 1e9"),
        ("fast", "\"fast\" is not a number"),
        ("inf", "clock speed must be a number from 1 to 1e9"),
    ] {
        let output = sagabox(&[
            "demo",
            "--database-url",
            "sqlite:x.db",
            "--clock-speed",
            speed,
        ]);
        assert_eq!(output.status.code(), Some(2), "{speed}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{speed}: {stderr}");
    }
    let dir = Scratch::new();
    let output = sagabox(&[
        "demo",
        "--database-url",
        &dir.url("x.db"),
        "--clock-speed",
        "43200",
        "--resume",
    ]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("cannot be used with") && stderr.contains("--resume"),
        "{stderr}"
    );
    assert!(dir.is_empty(), "refused before opening the database");
}

#[tokio::test]
async fn prune_dry_run_changes_nothing_and_a_pass_creates_ahead() {
    let db = common::Pg::new().await;
    let dry = stdout(&sagabox(&["prune", "--database-url", &db.url, "--dry-run"]));
    assert!(dry.contains("partitions would be created: "), "{dry}");
    assert!(!dry.contains("would be created: none"), "{dry}");
    let count = "SELECT COUNT(*) FROM pg_inherits WHERE inhparent = 'sagabox_inbox'::regclass";
    assert_eq!(db.scalar(count).await, 0, "dry run created nothing");
    let pass = stdout(&sagabox(&["prune", "--database-url", &db.url]));
    assert!(pass.contains("partitions dropped: none"), "{pass}");
    assert_eq!(db.scalar(count).await, 3);
    let refused = sagabox(&["prune", "--database-url", &db.url, "--ttl-days", "7"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("shorter than the broker retention"));
}

/// `serve --max-deliveries` reaches the queue it declares: the quorum queue's
/// `x-delivery-limit` is one less, so a declare with the same limit is accepted and one
/// with the default (5) is refused by the broker as another queue.
#[tokio::test]
async fn serve_declares_its_queue_with_the_delivery_limit_it_was_given() {
    let (db, rabbit) = (
        common::Pg::new().await,
        common::rabbit::Rabbit::new(&["payment"]).await,
    );
    let serve = common::children::Children::new(vec![rabbit.serve("payment", &db.url, 1)]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while rabbit.consumers(&rabbit.queue("payment")).await == 0 {
        assert!(Instant::now() < deadline, "serve never started consuming");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let payment = sagabox::ConsumerType::new("payment").unwrap();
    let declare = async |max_redeliveries: u32| {
        let mut config = rabbit.config.clone();
        config.max_redeliveries = max_redeliveries;
        common::rabbit::declare(&config, &payment).await
    };
    declare(common::rabbit::MAX_DELIVERIES)
        .await
        .expect("the same limit as serve's");
    let refused = declare(5).await.unwrap_err();
    assert!(
        matches!(
            refused,
            sagabox::transport::TransportError::Amqp(
                sagabox::amqp::AmqpError::QueueMismatch { .. }
            )
        ),
        "{refused}"
    );
    drop(serve);
}

/// Runs `bench-broker` on a small scale against the real broker at `transport` and a
/// fresh database, and checks what every transport must show: the three consumers
/// (hand-written, sagabox's consumer alone, the participant runtime) drain their queue or
/// stream, each message id is applied exactly once by each, the ratio is to the
/// hand-written consumer, and the scratch schema is gone afterwards.
async fn bench_broker_on(transport: &str) {
    let db = common::Pg::new().await;
    let out = stdout(&sagabox(&[
        "bench-broker",
        "--database-url",
        &db.url,
        "--transport",
        transport,
        "--messages",
        "300",
        "--paced",
        "60",
        "--rate",
        "300",
        "--duplicate-rate",
        "0.3",
        "--json",
    ]));
    let report: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let modes = report["modes"].as_array().expect("modes");
    let names: Vec<&str> = modes.iter().map(|m| m["mode"].as_str().unwrap()).collect();
    assert_eq!(names, ["handwritten", "consumer", "sagabox"], "{report}");
    let applied = modes[0]["applied"].as_i64().unwrap();
    assert!(
        applied > 0 && applied < 360,
        "duplicates were skipped: {report}"
    );
    for mode in modes {
        assert_eq!(mode["exactly_once"], true, "{report}");
        assert_eq!(mode["applied"].as_i64(), Some(applied), "{report}");
        assert_eq!(mode["backlog"], 300, "{report}");
        assert!(mode["msgs_per_sec"].as_f64().unwrap() > 0.0, "{report}");
        // Read from /proc in 10 ms ticks: present, but a small drain may round to 0.
        assert!(mode["client_cpu_us"].as_f64().is_some(), "{report}");
        assert!(
            mode["p99_us"].as_u64().unwrap() >= mode["p50_us"].as_u64().unwrap(),
            "{report}"
        );
    }
    assert_eq!(modes[0]["vs_handwritten"], 1.0, "{report}");
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM pg_namespace WHERE nspname LIKE 'sagabox_bench_broker_%'")
            .await,
        0,
        "the scratch schema is dropped"
    );
}

/// The names of the streams on the JetStream server at `url`.
async fn stream_names(url: &str) -> Vec<String> {
    let client = async_nats::connect(url).await.expect("NATS answers");
    futures_lite::StreamExt::try_collect(async_nats::jetstream::new(client).stream_names())
        .await
        .expect("list streams")
}

/// `bench-broker` over RabbitMQ: see [`bench_broker_on`].
#[tokio::test]
async fn bench_broker_over_rabbitmq_applies_every_message_once_in_every_mode() {
    bench_broker_on(&common::rabbit::amqp_url()).await;
}

/// `bench-broker` over NATS JetStream: see [`bench_broker_on`] (every delivery is
/// acked, so the repeats got past the server's duplicate window to the consumers), and
/// the bench's streams are deleted afterwards.
#[tokio::test]
async fn bench_broker_over_jetstream_applies_every_message_once_and_deletes_its_streams() {
    let url = jetstream::nats_url();
    bench_broker_on(&url).await;
    let names = stream_names(&url).await;
    assert!(
        !names.iter().any(|name| name.starts_with("sagabox-bench-")),
        "the bench's streams are deleted: {names:?}"
    );
}

/// `bench-saga` on a small scale, in process and over both brokers: every mode runs
/// every saga to its end at full load and paced, the hand-written floor commits its
/// seven transactions per saga (one start, a participant's and the orchestrator's per
/// step, a compensated saga as many) plus the run's set-up (a few per connection opened,
/// at most 30 here), each mode has its ratio to the floor, and no scratch database,
/// queue or stream is left. How many commits sagabox's modes share is the benchmark's
/// figure, not asserted here: at sixty sagas it turns on the load and on the
/// connections the pools happen to open (the group-commit tests in
/// `tests/orchestrator.rs` prove the sharing, with saves made slow).
#[tokio::test]
async fn bench_saga_measures_every_mode_against_the_floor_and_leaves_nothing_behind() {
    let db = common::Pg::new().await;
    let (amqp, nats) = (common::rabbit::amqp_url(), jetstream::nats_url());
    let out = stdout(&sagabox(&[
        "bench-saga",
        "--database-url",
        &db.url,
        "--orders",
        "60",
        "--concurrency",
        "8",
        "--paced-orders",
        "20",
        "--paced-rate",
        "100",
        "--transport",
        &amqp,
        "--transport",
        &nats,
        "--json",
    ]));
    let report: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let runs = report["runs"].as_array().expect("runs");
    let rows: Vec<(&str, &str)> = runs
        .iter()
        .map(|run| (run["mode"].as_str().unwrap(), run["load"].as_str().unwrap()))
        .collect();
    let modes = ["floor", "in-process", "rabbitmq", "nats"];
    let expected: Vec<(&str, &str)> = ["full", "paced 100/s"]
        .into_iter()
        .flat_map(|load| modes.map(|mode| (mode, load)))
        .collect();
    assert_eq!(rows, expected, "{report}");
    for run in runs {
        let sagas = if run["load"] == "full" { 60 } else { 20 };
        assert_eq!(run["sagas"], sagas, "every saga finished: {run}");
        let commits = run["commits_per_saga"].as_f64().unwrap();
        if run["mode"] == "floor" {
            assert!(run["ratio_to_floor"].is_null(), "{run}");
            // Beyond its seven per saga: the run's set-up (about 30 commits) and any
            // autovacuum or autoanalyze of the scratch database, which count there too.
            assert!(
                (7.0..=7.0 + 60.0 / f64::from(sagas)).contains(&commits),
                "the floor commits seven times per saga: {run}"
            );
        } else {
            assert!(run["ratio_to_floor"].as_f64().unwrap() > 0.0, "{run}");
            assert!(commits > 0.0, "{run}");
        }
        assert!(run["wal_bytes_per_saga"].as_f64().unwrap() > 0.0, "{run}");
        let (p50, p99) = (
            run["p50_ms"].as_f64().unwrap(),
            run["p99_ms"].as_f64().unwrap(),
        );
        assert!(p50 > 0.0 && p99 >= p50, "{run}");
    }
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM pg_database WHERE datname LIKE 'sagabox_bench_saga_%'")
            .await,
        0,
        "the scratch databases are dropped"
    );
    let streams = stream_names(&nats).await;
    assert!(
        !streams
            .iter()
            .any(|name| name.starts_with("sagabox-bench-saga")),
        "the bench's streams are deleted: {streams:?}"
    );
}

/// `bench-relay` on a small scale over both brokers: every mode reports every row it
/// was asked for, timed from commit to confirm, with its ratio to the floor; the scratch
/// schema and the streams are removed.
#[tokio::test]
async fn bench_relay_times_every_mode_and_leaves_nothing_behind() {
    let db = common::Pg::new().await;
    let nats = jetstream::nats_url();
    for broker in [common::rabbit::amqp_url(), nats.clone()] {
        let out = stdout(&sagabox(&[
            "bench-relay",
            "--database-url",
            &db.url,
            "--transport",
            &broker,
            "--rows",
            "30",
            "--rate",
            "200",
            "--warm-up",
            "5",
            "--json",
        ]));
        let report: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
        let modes = report["modes"].as_array().expect("modes");
        let names: Vec<&str> = modes.iter().map(|m| m["mode"].as_str().unwrap()).collect();
        assert_eq!(names, ["floor", "listen", "poll"], "{report}");
        for mode in modes {
            assert_eq!(mode["rows"], 30, "{report}");
            let (p50, p99) = (
                mode["p50_ms"].as_f64().unwrap(),
                mode["p99_ms"].as_f64().unwrap(),
            );
            assert!(p50 > 0.0 && p99 >= p50, "{report}");
            assert!(mode["p50_vs_floor"].as_f64().unwrap() > 0.0, "{report}");
        }
        assert_eq!(modes[0]["p50_vs_floor"], 1.0, "{report}");
    }
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM pg_namespace WHERE nspname LIKE 'sagabox_bench_relay_%'")
            .await,
        0,
        "the scratch schema is dropped"
    );
    let streams = stream_names(&nats).await;
    assert!(
        !streams
            .iter()
            .any(|name| name.starts_with("sagabox-bench-relay")),
        "the bench's streams are deleted: {streams:?}"
    );
}

/// `--prefill` and `--prune-rows` on a small scale: the figures are there and say what
/// they measured (the row counts it was asked for; a drop that moved the rows out).
#[tokio::test]
async fn bench_prefill_and_pruning_report_their_figures_on_postgres() {
    let db = common::Pg::new().await;
    let out = stdout(&sagabox(&[
        "bench",
        "--database-url",
        &db.url,
        "--messages",
        "200",
        "--concurrency",
        "2",
        "--modes",
        "guard",
        "--prefill",
        "1205",
        "--prune-rows",
        "300",
        "--json",
    ]));
    let report: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let scale = &report["scale"];
    assert_eq!(scale["rows"].as_u64(), Some(1205), "{scale}");
    assert_eq!(scale["months"].as_u64(), Some(12));
    assert_eq!(
        scale["rows_in_claimed_month"].as_u64(),
        Some(1205 - 11 * 100)
    );
    assert!(scale["ratio_to_empty"].as_f64().unwrap() > 0.0);
    let pruning = &report["pruning"];
    assert_eq!(pruning["rows"].as_u64(), Some(300), "{pruning}");
    for retire in ["delete", "vacuum", "drop"] {
        assert!(
            pruning[retire]["seconds"].as_f64().unwrap() > 0.0,
            "{pruning}"
        );
    }
    assert!(pruning["claims_outside"].as_u64().unwrap() > 0, "{pruning}");
    let left = db
        .scalar("SELECT COUNT(*) FROM pg_namespace WHERE nspname LIKE 'sagabox_bench_%'")
        .await;
    assert_eq!(left, 0, "the scratch schema is dropped");
}

/// Every subcommand has the same default database: `demo` then `inspect` and `prune`, in
/// an empty folder and without `--database-url`, look at the same file.
#[test]
fn demo_then_inspect_and_prune_use_the_same_default_database() {
    let dir = Scratch::new();
    let demo = dir.run(&["demo", "--orders", "5", "--json"]);
    assert!(demo.status.success(), "{}", stderr(&demo));
    assert_eq!(
        json(&demo)["database"],
        sagabox_cli::args::DEFAULT_DATABASE_URL
    );
    let inspect = dir.run(&["inspect", "--json"]);
    assert!(inspect.status.success(), "{}", stderr(&inspect));
    let report = json(&inspect);
    assert_eq!(
        report["sagas"]["by_status"]["completed"]
            .as_i64()
            .unwrap_or(0)
            + report["sagas"]["by_status"]["compensated"]
                .as_i64()
                .unwrap_or(0),
        5,
        "{report}"
    );
    let prune = dir.run(&["prune", "--dry-run"]);
    assert!(prune.status.success(), "{}", stderr(&prune));
    assert_eq!(
        dir.files()
            .iter()
            .filter(|name| name.ends_with(".db"))
            .collect::<Vec<_>>(),
        ["sagabox.db"]
    );
}

/// `AMQP_URL` and `DATABASE_URL` (which the tests read) never move the demo onto
/// RabbitMQ or another database: only `--transport` and `--database-url` (or
/// `SAGABOX_DATABASE_URL`) do.
#[test]
fn the_tests_variables_in_the_environment_leave_the_demo_on_its_defaults() {
    let dir = Scratch::new();
    let output = command(&["demo", "--orders", "3", "--json"])
        .current_dir(&dir.0)
        .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/nowhere")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let summary = json(&output);
    assert_eq!(summary["transport"], "in-process");
    assert_eq!(summary["database"], "sqlite:sagabox.db");
    assert!(dir.0.join("sagabox.db").exists());

    let output = command(&["demo", "--orders", "3", "--json"])
        .current_dir(&dir.0)
        .env("SAGABOX_DATABASE_URL", "sqlite:chosen.db")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(json(&output)["database"], "sqlite:chosen.db");
}

/// Usage errors exit with status 2 and say what was wrong, before any database or
/// broker is touched.
#[test]
fn usage_errors_exit_with_status_2() {
    let dir = Scratch::new();
    let url = dir.url("usage.db");
    let amqp = "amqp://guest:guest@127.0.0.1:1/%2f";
    let cases: &[(&[&str], &str)] = &[
        (
            &["demo", "--orders", "-5"],
            "\"-5\" is not a whole number of 0 or more",
        ),
        (
            &["bench-broker", "--transport", amqp],
            "the broker bench runs on PostgreSQL",
        ),
        (&["bench-saga"], "the saga bench runs on PostgreSQL"),
        (
            &["bench-relay", "--transport", amqp],
            "the relay bench runs on PostgreSQL",
        ),
        (
            &["bench-saga", "--paced-rate", "-1"],
            "is not a rate: give sagas per second from 0",
        ),
        (
            &[
                "bench-broker",
                "--database-url",
                "postgres://postgres@127.0.0.1:1/postgres",
                "--transport",
                "redis://127.0.0.1:1",
            ],
            "or NATS JetStream (nats://host:port)",
        ),
        (
            &["demo", "--concurrency", "0"],
            "\"0\" is not a whole number from 1 to 10000",
        ),
        (
            &["demo", "--resume", "--clock-speed", "2"],
            "cannot be used with",
        ),
        (
            &[
                "demo",
                "--transport",
                amqp,
                "--external-participants",
                "--clock-speed",
                "2",
            ],
            "cannot be used with",
        ),
        (
            &["demo", "--transport", "rabbit://x"],
            "is not a broker URL this build speaks",
        ),
        (
            &["demo", "--duplicate-rate", "1.5"],
            "rate 1.5 is out of range",
        ),
        (
            &["serve", "--role", "cashier", "--transport", amqp],
            "[possible values: payment, inventory, email, orchestrator, all]",
        ),
        (&["serve", "--role", "payment"], "--transport <URL>"),
        (
            &[
                "serve",
                "--role",
                "payment",
                "--transport",
                amqp,
                "--ttl-days",
                "3",
            ],
            "--force-short-ttl",
        ),
        (
            &[
                "serve",
                "--role",
                "payment",
                "--transport",
                amqp,
                "--prefetch",
                "0",
            ],
            "\"0\" is not a whole number from 1 to 65535",
        ),
        (
            &[
                "serve",
                "--role",
                "payment",
                "--transport",
                amqp,
                "--max-deliveries",
                "0",
            ],
            "0 is not in 1..=1000",
        ),
        (
            &[
                "serve",
                "--role",
                "payment",
                "--transport",
                amqp,
                "--workers",
                "0",
            ],
            "\"0\" is not a whole number from 1 to 10000",
        ),
        (
            &[
                "serve",
                "--role",
                "payment",
                "--transport",
                amqp,
                "--prefetch",
                "4",
                "--batch",
                "8",
            ],
            "--batch 8 is above --prefetch 4",
        ),
        (
            &["migrate", "--database-url", "mysql://app:hunter2@db/x"],
            "unsupported database url",
        ),
        (
            &["migrate", "--partitions-ahead", "13"],
            "create at most 12 months ahead",
        ),
        (&["prune", "--ttl-days", "7"], "--force-short-ttl"),
        (
            &[
                "orchestrate",
                "--saga",
                concat!(env!("CARGO_MANIFEST_DIR"), "/../sagas/trip.toml"),
                "--transport",
                amqp,
                "--ttl-days",
                "7",
            ],
            "--force-short-ttl",
        ),
        (&["prune", "--ttl-days", "-1"], "invalid value '-1'"),
        (
            &["inspect", "--ttl-days", "7"],
            "shorter than the broker retention",
        ),
        (
            &["bench", "--messages", "0"],
            "\"0\" is not a whole number of 1 or more",
        ),
        (
            &["demo", "--concurrency", "99999999999999999999"],
            "is not a whole number from 1 to 10000",
        ),
        (
            &["bench", "--concurrency", "0"],
            "\"0\" is not a whole number from 1 to 10000",
        ),
    ];
    for (args, expected) in cases {
        let mut args = args.to_vec();
        if args[0] != "migrate" || !args.contains(&"--database-url") {
            args.extend(["--database-url", &url]);
        }
        let output = dir.run(&args);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(expected), "{args:?}: {text}");
        assert!(!text.contains("hunter2"), "{args:?}: {text}");
        // The usage line names the command a user types, not the package.
        assert!(
            !text.contains("Usage:") || text.contains(&format!("Usage: sagabox {}", args[0])),
            "{args:?}: {text}"
        );
    }
    assert!(
        dir.is_empty(),
        "no usage error created a file: {:?}",
        dir.files()
    );
    // The roles are a value list, so `--help` names them.
    let help = String::from_utf8_lossy(&sagabox(&["serve", "--help"]).stdout).into_owned();
    for role in ["payment", "inventory", "email", "orchestrator", "all"] {
        assert!(help.contains(role), "{help}");
    }
}

/// A database that cannot be opened: the error names the file, or the host and port,
/// without the password or the server's source line.
#[tokio::test]
async fn connection_errors_name_the_file_or_the_server() {
    let dir = Scratch::new();
    let missing = dir.0.join("no-such-folder").join("x.db");
    let output = sagabox(&[
        "migrate",
        "--database-url",
        &format!("sqlite:{}", missing.display()),
    ]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&missing.display().to_string())
            && text.contains(&format!(
                "the folder {} does not exist",
                missing.parent().unwrap().display()
            )),
        "{text}"
    );

    let refused = sagabox(&[
        "migrate",
        "--database-url",
        "postgres://app:hunter2@127.0.0.1:1/x",
    ]);
    let text = stderr(&refused);
    assert_eq!(refused.status.code(), Some(1), "{text}");
    assert!(
        text.contains("cannot connect to PostgreSQL at 127.0.0.1:1")
            && text.contains("connection refused")
            && !text.contains("hunter2"),
        "{text}"
    );

    let admin = common::admin_url();
    let (server, _) = admin.rsplit_once('/').unwrap();
    let absent = format!("{server}/sagabox_absent_{}", uuid::Uuid::new_v4().simple());
    for args in [
        vec!["migrate", "--database-url", &absent],
        vec!["inspect", "--database-url", &absent],
        vec!["demo", "--database-url", &absent, "--orders", "1"],
    ] {
        let output = sagabox(&args);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {text}");
        assert!(text.contains("does not exist"), "{args:?}: {text}");
        assert!(!text.contains(" at line "), "{args:?}: {text}");
    }
}

/// `prune` needs a migrated database, as `inspect` does, and never creates one.
#[tokio::test]
async fn prune_asks_for_migrate_on_an_unmigrated_or_missing_database() {
    let empty = common::Pg::unmigrated().await;
    for args in [
        vec!["prune", "--database-url", &empty.url],
        vec!["prune", "--database-url", &empty.url, "--dry-run"],
    ] {
        let output = sagabox(&args);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {text}");
        assert!(text.contains("run `sagabox migrate"), "{args:?}: {text}");
    }
    let dir = Scratch::new();
    for dry_run in [true, false] {
        let mut args = vec!["prune"];
        if dry_run {
            args.push("--dry-run");
        }
        let output = dir.run(&args);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{text}");
        assert!(
            text.contains("there is no file sagabox.db") && text.contains("run `sagabox migrate"),
            "{text}"
        );
    }
    assert!(dir.is_empty(), "prune created {:?}", dir.files());
}

/// `demo --resume` where no run is on record says so (exit status 1), and with `--json`
/// as one object on stdout.
#[test]
fn resume_with_nothing_to_resume_says_so() {
    let dir = Scratch::new();
    let output = dir.run(&["demo", "--resume", "--json"]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let error = json(&output)["error"].as_str().unwrap().to_owned();
    assert!(
        error.contains("nothing to resume in sqlite:sagabox.db"),
        "{error}"
    );
    assert!(stderr(&output).contains(&error));
    assert!(dir.is_empty(), "no database created: {:?}", dir.files());
    // A database with the demo's tables but no run on record.
    let migrated = dir.run(&["migrate"]);
    assert!(migrated.status.success(), "{}", stderr(&migrated));
    let output = dir.run(&["demo", "--resume"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("no demo run is on record"),
        "{}",
        stderr(&output)
    );
}

/// A broker that refuses the demo: one line on stderr, without lapin's own error lines.
#[test]
fn an_amqp_failure_is_one_line() {
    let url = common::rabbit::amqp_url();
    let (_, host) = url
        .rsplit_once('@')
        .expect("the test broker URL has user info");
    let wrong = format!("amqp://sagabox-nobody:wrong@{host}");
    let dir = Scratch::new();
    let output = dir.run(&["demo", "--orders", "1", "--transport", &wrong]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert_eq!(text.trim_end().lines().count(), 1, "{text}");
    assert!(
        text.starts_with("sagabox demo: cannot connect to RabbitMQ at amqp://sagabox-nobody:***@"),
        "{text}"
    );
    assert!(!text.contains("wrong@"), "{text}");
}

/// `--json` failures are one object on stdout; the demo's JSON carries its verdict, and
/// damage is exit status 3.
#[test]
fn json_carries_failures_and_the_verdict() {
    let dir = Scratch::new();
    let inspect = dir.run(&["inspect", "--json"]);
    assert_eq!(inspect.status.code(), Some(1));
    assert!(
        json(&inspect)["error"]
            .as_str()
            .unwrap()
            .contains("run `sagabox migrate")
    );
    let bench = dir.run(&[
        "bench",
        "--database-url",
        "postgres://nobody@127.0.0.1:1/nowhere",
        "--json",
    ]);
    assert_eq!(bench.status.code(), Some(1));
    assert!(
        json(&bench)["error"]
            .as_str()
            .unwrap()
            .contains("127.0.0.1:1")
    );

    let exact = dir.run(&["demo", "--orders", "30", "--json"]);
    assert_eq!(exact.status.code(), Some(0), "{}", stderr(&exact));
    assert_eq!(json(&exact)["verdict"], "ok");
    let damaged = dir.run(&[
        "demo",
        "--orders",
        "30",
        "--no-inbox",
        "--duplicate-rate",
        "1",
        "--json",
    ]);
    assert_eq!(damaged.status.code(), Some(3), "{}", stderr(&damaged));
    let report = json(&damaged);
    assert_eq!(report["verdict"], "damage", "{report}");
    assert!(report["double_charges"].as_i64().unwrap() > 0, "{report}");
    let table = dir.run(&[
        "demo",
        "--orders",
        "30",
        "--no-inbox",
        "--duplicate-rate",
        "1",
    ]);
    assert_eq!(table.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&table.stdout).contains("DAMAGE"));
}

/// With the default log filter, the demo writes nothing on stderr, and `serve` one JSON
/// line when it is up (version, redacted URLs, its queues) and when it stops.
#[tokio::test]
async fn serve_logs_when_it_is_up_and_when_it_stops() {
    let dir = Scratch::new();
    let demo = dir.run(&["demo", "--orders", "5"]);
    assert!(demo.status.success());
    assert_eq!(stderr(&demo), "", "the demo is quiet by default");

    let rabbit = common::rabbit::Rabbit::new(&["payment", "email"]).await;
    let url = dir.url("serve.db");
    let child = command(&[
        "--log-format",
        "json",
        "serve",
        "--role",
        "payment,email",
        "--transport",
        &rabbit.config.url,
        "--queue-prefix",
        &rabbit.config.queue_prefix,
        "--database-url",
        &url,
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut children = common::children::Children::new(vec![child]);
    let stderr = children[0].stderr.take().unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            if lines_tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let up = loop {
        let line = lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("serve logged that it is up within 60 s");
        let event: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        if event["fields"]["message"] == "serving" {
            break event;
        }
    };
    let fields = &up["fields"];
    assert_eq!(up["level"], "INFO", "{up}");
    assert_eq!(fields["version"], env!("CARGO_PKG_VERSION"), "{up}");
    assert_eq!(fields["database"], url, "{up}");
    let broker = fields["broker"].as_str().unwrap();
    assert_eq!(broker, sagabox::logging::redact(&rabbit.config.url), "{up}");
    assert!(broker.contains(":***@"), "the password redacted: {up}");
    // A list is a JSON list, not a string to parse again.
    let prefix = &rabbit.config.queue_prefix;
    assert_eq!(
        fields["queues"],
        serde_json::json!([format!("{prefix}.email"), format!("{prefix}.payment")]),
        "{up}"
    );
    let status = common::children::stop(&mut children[0], "serve", Duration::from_secs(60)).await;
    assert!(status.success(), "{status}");
    let rest: Vec<serde_json::Value> = lines
        .iter()
        .map(|line| serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    let messages: Vec<&str> = rest
        .iter()
        .filter_map(|e| e["fields"]["message"].as_str())
        .collect();
    assert_eq!(
        messages,
        ["stopping: finishing the messages in flight", "stopped"],
        "{rest:?}"
    );
}

/// `serve` runs the pruner and the outbox relay beside its participants: a month of the
/// inbox older than `--ttl-days` is dropped by the pass at start, and a row written to
/// the outbox is published to its queue, once.
#[tokio::test]
async fn serve_prunes_expired_months_and_relays_the_outbox() {
    use sagabox::outbox::OutboxWriter;
    use sagabox::{ConsumerType, InboxConfig, InboxGuard, Month};

    let fx = common::Pg::new().await;
    let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default()).unwrap();
    let expired = Month::of(chrono::Utc::now() - chrono::Duration::days(120)).unwrap();
    assert_eq!(
        guard.create_partitions(expired, expired).await.unwrap(),
        [expired]
    );
    let rabbit = common::rabbit::Rabbit::new(&["payment", "notices"]).await;
    rabbit.declare("notices").await;
    let notice = sqlx::PgConnection::message("notice", serde_json::json!({"n": 1})).unwrap();
    let mut conn = fx.pool.acquire().await.unwrap();
    conn.publish(&ConsumerType::new("notices").unwrap(), "order-1", &notice)
        .await
        .unwrap();
    drop(conn);

    let child = command(&[
        "serve",
        "--role",
        "payment",
        "--transport",
        &rabbit.config.url,
        "--queue-prefix",
        &rabbit.config.queue_prefix,
        "--database-url",
        &fx.url,
        "--ttl-days",
        "30",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut children = common::children::Children::new(vec![child]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while guard.partitions().await.unwrap().contains(&expired)
        || rabbit.ready(&rabbit.queue("notices")).await == 0
    {
        if let Some(status) = children[0].try_wait().unwrap() {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut children[0].stderr.take().unwrap(), &mut stderr)
                .unwrap();
            panic!("serve ended ({status}) before pruning and relaying: {stderr}");
        }
        assert!(
            Instant::now() < deadline,
            "within 60 s, serve neither dropped {expired} nor published the outbox row"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = common::children::stop(&mut children[0], "serve", Duration::from_secs(60)).await;
    assert!(status.success(), "{status}");
    let published = rabbit.drain(&rabbit.queue("notices")).await;
    assert_eq!(published.len(), 1, "the outbox row published once");
    let message_id = published[0]
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.to_string());
    assert_eq!(message_id.as_deref(), Some(notice.id.as_str()));
    let unsent = fx
        .scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NULL")
        .await;
    assert_eq!(unsent, 0, "the row is marked published");
    let current = Month::of(chrono::Utc::now()).unwrap();
    assert!(
        guard.partitions().await.unwrap().contains(&current),
        "the current month stays"
    );
}

/// The quick start is `cargo run --release -- demo` at the repository root: cargo runs
/// it only when the workspace's default members hold a single binary, and that binary
/// must be `sagabox`. An example package with a binary of its own, added to the
/// default members, would make cargo refuse the README's first command.
#[test]
fn the_quick_starts_cargo_run_finds_the_sagabox_binary_alone() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let output = std::process::Command::new(cargo)
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(&root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata: {}",
        stderr(&output)
    );
    let metadata = json(&output);
    let defaults: Vec<&str> = metadata["workspace_default_members"]
        .as_array()
        .expect("cargo reports the default members")
        .iter()
        .filter_map(|id| id.as_str())
        .collect();
    let binaries: Vec<String> = metadata["packages"]
        .as_array()
        .expect("cargo lists the packages")
        .iter()
        .filter(|package| defaults.contains(&package["id"].as_str().unwrap_or_default()))
        .flat_map(|package| package["targets"].as_array().cloned().unwrap_or_default())
        .filter(|target| {
            target["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k == "bin"))
        })
        .filter_map(|target| target["name"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(binaries, ["sagabox"], "the default members' binaries");
}
