//! The `sagabox` binary: `migrate` and `bench`, run as a user would, against a fresh
//! SQLite file and a fresh PostgreSQL database.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

fn sagabox(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run sagabox")
}

fn stdout(output: &std::process::Output) -> String {
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
            "batched_set",
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
    // The same repeated ids: the raw baseline, the guard, the step pool and both batched
    // modes apply each once; without an inbox every repeat is applied again.
    for deduplicating in 1..=4 {
        assert_eq!(applied(0), applied(deduplicating), "mode {deduplicating}");
    }
    assert!(applied(1) < 300, "repeats were deduplicated");
    assert_eq!(applied(5), 300);
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
    assert!(String::from_utf8_lossy(&output.stderr).contains("--batch must be within 1..=10000"));
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
            "batched_set",
            "no_inbox"
        ]
    );
}

/// `demo --clock-speed`: out-of-range speeds and a fast clock with `--resume` are refused
/// with the reason, before anything touches the database.
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
        assert!(!output.status.success(), "{speed}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{speed}: {stderr}");
    }
    let file = std::env::temp_dir().join(format!("sagabox-clock-{}.db", std::process::id()));
    let url = format!("sqlite:{}", file.display());
    let output = sagabox(&[
        "demo",
        "--database-url",
        &url,
        "--clock-speed",
        "43200",
        "--resume",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--clock-speed cannot be combined with --resume"),
        "{stderr}"
    );
    assert!(!file.exists(), "refused before opening the database");
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
