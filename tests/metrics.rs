//! The Prometheus endpoint: a scrape taken while a demo runs lists every catalogued
//! metric the demo emits (and no labelled family without its labels), and the figures
//! it serves agree with the database (applied messages = inbox rows, duplicates = the
//! counts on the inbox rows, saga durations = sagas finished). The catalogue,
//! `docs/operations.md` and the Grafana dashboard name the same metrics, labels, label
//! values and dead-letter reasons.
//!
//! The global recorder is installed by exactly one test here; the others use a local
//! `DebuggingRecorder`.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::scrape::{free_port, has_metric, has_unlabelled_series, scrape, sum};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use sagabox::demo::{DemoConfig, run};
use sagabox::inspect::{InspectOptions, inspect};
use sagabox::metrics::{CATALOGUE, DEAD_LETTERS_TOTAL, DeadReason, MetricKind, MetricSpec};

/// The metrics an in-process demo never emits: it has no transport to dead-letter or
/// publish an outbox through.
const NOT_IN_A_DEMO: [&str; 2] = [DEAD_LETTERS_TOTAL, sagabox::metrics::OUTBOX_PUBLISHED_TOTAL];

fn kind_word(spec: &MetricSpec) -> &'static str {
    match spec.kind {
        MetricKind::Counter => "counter",
        MetricKind::Gauge => "gauge",
        MetricKind::Histogram => "histogram",
        _ => unreachable!("a kind the test does not know"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scrape_during_a_demo_run_finds_every_catalogued_metric() {
    let addr = sagabox::metrics::install_prometheus(&format!("127.0.0.1:{}", free_port())).unwrap();
    let fx = common::Lite::new().await;
    let config = DemoConfig {
        orders: 1000,
        concurrency: 16,
        duplicate_rate: 0.5,
        lost_reply_rate: 0.1,
        fail_rate: 0.1,
        decline_rate: 0.05,
        seed: 3,
        ..DemoConfig::default()
    };
    let url = fx.url.clone();
    let demo = tokio::spawn(async move { run(&url, &config).await });

    // Scrape until a scrape shows every metric the demo emits, while it still runs; no
    // scrape has a labelled family without its labels.
    let emitted = |text: &str| {
        CATALOGUE
            .iter()
            .filter(|spec| !NOT_IN_A_DEMO.contains(&spec.name))
            .all(|spec| has_metric(text, spec.name))
    };
    let during = loop {
        assert!(
            !demo.is_finished(),
            "the demo ended before a scrape saw every metric it emits"
        );
        let text = scrape(addr).await.unwrap();
        for spec in CATALOGUE.iter().filter(|spec| !spec.labels.is_empty()) {
            assert!(
                !has_unlabelled_series(&text, spec.name),
                "{} has a series without its labels:\n{text}",
                spec.name
            );
        }
        if emitted(&text) {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        sum(
            &during,
            "sagabox_inbox_messages_total",
            &["outcome=\"applied\""]
        ) > 0.0
    );
    for spec in CATALOGUE {
        if NOT_IN_A_DEMO.contains(&spec.name) {
            // Transports emit these; the in-process demo has none.
            assert!(!has_metric(&during, spec.name), "{}: {during}", spec.name);
            continue;
        }
        let kind = kind_word(spec);
        assert!(
            during.contains(&format!("# TYPE {} {kind}", spec.name)),
            "{} is not a {kind}",
            spec.name
        );
        assert!(
            during.contains(&format!("# HELP {} ", spec.name)),
            "{} has no help",
            spec.name
        );
    }

    let summary = demo.await.unwrap().unwrap();
    let after = scrape(addr).await.unwrap();
    let report = inspect(&fx.url, &InspectOptions::default()).await.unwrap();

    // Histograms have buckets from sub-millisecond up; claims are timed per consumer type.
    for consumer_type in ["payment", "inventory", "email"] {
        assert!(
            after.contains(&format!(
                "sagabox_inbox_claim_seconds_bucket{{consumer_type=\"{consumer_type}\",le=\"0.0001\"}}"
            )),
            "{after}"
        );
        assert!(
            sum(
                &after,
                "sagabox_inbox_claim_seconds_count",
                &[&format!("consumer_type=\"{consumer_type}\"")]
            ) > 0.0
        );
    }
    assert!(
        after.contains(&format!(
            "sagabox_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{after}"
    );
    assert!(after.contains("sagabox_saga_duration_seconds_bucket{saga=\"checkout\",status=\"completed\",le=\"3600\"}"), "{after}");

    // What the process counted equals what the database holds.
    let applied = sum(
        &after,
        "sagabox_inbox_messages_total",
        &["outcome=\"applied\""],
    );
    assert_eq!(
        applied as i64,
        fx.inbox_rows().await,
        "one inbox row per applied message"
    );
    let duplicates = sum(
        &after,
        "sagabox_inbox_messages_total",
        &["outcome=\"duplicate\""],
    );
    let on_rows: i64 = report.duplicate_deliveries.iter().map(|d| d.in_inbox).sum();
    assert!(on_rows > 0);
    assert_eq!(
        duplicates as i64, on_rows,
        "each duplicate answered is counted on its row"
    );
    let completed = sum(
        &after,
        "sagabox_saga_duration_seconds_count",
        &["status=\"completed\""],
    );
    let compensated = sum(
        &after,
        "sagabox_saga_duration_seconds_count",
        &["status=\"compensated\""],
    );
    assert_eq!(
        (completed as i64, compensated as i64),
        (summary.completed, summary.compensated)
    );
    let retries = sum(&after, "sagabox_saga_retries_total", &[]);
    assert_eq!(
        retries as u64, summary.retries,
        "the orchestrator's own count of retries"
    );
    let steps = sum(&after, "sagabox_saga_steps_total", &[]);
    assert_eq!(
        steps as u64, summary.deliveries,
        "one step attempt per command sent"
    );
    assert!(
        sum(
            &after,
            "sagabox_saga_compensations_total",
            &["trigger=\"refused\""]
        ) > 0.0
    );
}

#[test]
fn the_operations_guide_documents_every_catalogued_metric_with_its_labels() {
    let guide = include_str!("../docs/operations.md");
    for spec in CATALOGUE {
        let line = guide
            .lines()
            .find(|line| line.starts_with('|') && line.contains(&format!("`{}`", spec.name)))
            .unwrap_or_else(|| panic!("docs/operations.md has no catalogue row for {}", spec.name));
        for label in spec.labels {
            assert!(
                line.contains(&format!("`{label}`")),
                "the row of {} lacks label {label}: {line}",
                spec.name
            );
        }
    }
}

#[test]
fn the_grafana_dashboard_charts_every_catalogued_metric() {
    let text = include_str!("../docs/grafana-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(target["expr"].as_str().expect("expr").to_owned());
        }
    }
    for spec in CATALOGUE {
        assert!(
            exprs.iter().any(|expr| expr.contains(spec.name)),
            "no panel charts {}",
            spec.name
        );
    }
}

/// The catalogue row of `name` in docs/operations.md.
fn guide_row<'a>(guide: &'a str, name: &str) -> &'a str {
    guide
        .lines()
        .find(|line| line.starts_with('|') && line.contains(&format!("`{name}`")))
        .unwrap_or_else(|| panic!("docs/operations.md has no catalogue row for {name}"))
}

/// The values a catalogue row lists for `label`, written `` `label` = `a` \| `b` `` (each
/// value may be followed by a parenthesis explaining it).
fn listed_values(row: &str, label: &str) -> Option<Vec<String>> {
    let mut rest = row.split(&format!("`{label}` = ")).nth(1)?;
    let mut values = Vec::new();
    loop {
        let value = rest.strip_prefix('`')?;
        let (value, after) = value.split_once('`')?;
        values.push(value.to_owned());
        rest = after.trim_start();
        if rest.starts_with('(') {
            rest = rest.split_once(')')?.1.trim_start();
        }
        match rest.strip_prefix("\\|") {
            Some(next) => rest = next.trim_start(),
            None => return Some(values),
        }
    }
}

#[test]
fn the_operations_guide_lists_every_value_of_every_closed_label() {
    let guide = include_str!("../docs/operations.md");
    let mut checked = 0;
    for spec in CATALOGUE {
        let row = guide_row(guide, spec.name);
        for closed in spec.values {
            assert!(spec.labels.contains(&closed.label), "{}", spec.name);
            let listed = listed_values(row, closed.label).unwrap_or_else(|| {
                panic!(
                    "the row of {} does not list the values of {}: {row}",
                    spec.name, closed.label
                )
            });
            assert_eq!(
                listed, closed.values,
                "{} {}: {row}",
                spec.name, closed.label
            );
            checked += 1;
        }
    }
    assert!(checked >= 8, "the closed labels were found ({checked})");
}

/// Every `label="value"` written in the docs and the dashboard, for a label whose values
/// the catalogue lists, is one of them: an alert on a value the code never emits would
/// never fire.
#[test]
fn every_label_value_the_docs_and_dashboard_query_is_emitted() {
    let dashboard = include_str!("../docs/grafana-dashboard.json").replace("\\\"", "\"");
    let texts = [
        ("docs/operations.md", include_str!("../docs/operations.md")),
        ("docs/guarantees.md", include_str!("../docs/guarantees.md")),
        (
            "docs/architecture.md",
            include_str!("../docs/architecture.md"),
        ),
        ("README.md", include_str!("../README.md")),
        ("docs/grafana-dashboard.json", dashboard.as_str()),
    ];
    let mut checked = 0;
    for (file, text) in texts {
        for closed in CATALOGUE.iter().flat_map(|spec| spec.values) {
            let allowed: Vec<&str> = CATALOGUE
                .iter()
                .flat_map(|spec| spec.values)
                .filter(|other| other.label == closed.label)
                .flat_map(|other| other.values.iter().copied())
                .collect();
            for (i, _) in text.match_indices(&format!("{}=\"", closed.label)) {
                // Not the tail of a longer label name (`xreason="…"`).
                if text[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                    continue;
                }
                let value = text[i + closed.label.len() + 2..]
                    .split('"')
                    .next()
                    .unwrap();
                assert!(
                    allowed.contains(&value),
                    "{file} queries {}=\"{value}\", which the code never emits ({allowed:?})",
                    closed.label
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "the queries were found");
}

/// The dead-letter reasons: the guide's table lists exactly `DeadReason::ALL`, the
/// catalogue row and the catalogue's values name the same, and the alert names only
/// those (the code can emit no other: the header and the label take a `DeadReason`).
#[test]
fn the_dead_letter_reasons_in_the_guide_are_the_ones_the_code_emits() {
    let guide = include_str!("../docs/operations.md");
    let all: Vec<&str> = DeadReason::ALL
        .iter()
        .map(|reason| reason.as_str())
        .collect();

    let section = guide
        .split("### Dead-letter reasons")
        .nth(1)
        .expect("a Dead-letter reasons section");
    let in_table: Vec<&str> = section
        .lines()
        .skip_while(|line| !line.starts_with("| reason |"))
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| line.trim_start_matches("| `").split('`').next().unwrap())
        .collect();
    assert_eq!(in_table, all, "the table of reasons");

    let spec = CATALOGUE
        .iter()
        .find(|spec| spec.name == DEAD_LETTERS_TOTAL)
        .unwrap();
    let reason = spec.values.iter().find(|v| v.label == "reason").unwrap();
    assert_eq!(reason.values, all.as_slice(), "the catalogue's values");
    assert_eq!(
        listed_values(guide_row(guide, DEAD_LETTERS_TOTAL), "reason").unwrap(),
        all,
        "the catalogue row"
    );

    // The alert and the RabbitMQ section: every backquoted snake_case word that looks
    // like a reason (one of the old or new ones, or any listed) is a listed one.
    let alert = guide
        .lines()
        .find(|line| line.starts_with("| **dead letters** |"))
        .expect("the dead letters alert");
    let named: Vec<&str> = alert
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|word| word.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .collect();
    for word in &named {
        assert!(
            all.contains(word),
            "the alert names {word:?}, not a reason: {alert}"
        );
    }
    for reason in &all {
        assert!(
            named.contains(reason),
            "the alert leaves out {reason}: {alert}"
        );
    }
    for retired in ["malformed", "expired", "pruned", "future", "poison"] {
        assert!(
            !guide.contains(&format!("`{retired}`")),
            "docs/operations.md still names the reason {retired:?}"
        );
    }
}

/// What registering the catalogue creates: every metric described, a zero series for
/// each one without labels, none for a labelled family (no phantom series without its
/// labels), and the build info at 1 with this version.
#[test]
fn registering_the_catalogue_makes_no_series_without_its_labels() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, sagabox::metrics::register_catalogue);
    let snapshot = snapshotter.snapshot().into_vec();

    let mut registered = Vec::new();
    for (key, _, description, value) in &snapshot {
        let key = key.key();
        let spec = CATALOGUE
            .iter()
            .find(|spec| spec.name == key.name())
            .unwrap_or_else(|| panic!("{} is not catalogued", key.name()));
        assert!(description.is_some(), "{} is not described", spec.name);
        let labels: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
        if spec.name == sagabox::metrics::BUILD_INFO {
            assert_eq!(labels, [("version", env!("CARGO_PKG_VERSION"))]);
            assert_eq!(value, &DebugValue::Gauge(1.0.into()));
        } else {
            assert!(
                spec.labels.is_empty(),
                "{} registered without its labels {:?}",
                spec.name,
                spec.labels
            );
            assert!(labels.is_empty());
        }
        registered.push(spec.name);
    }
    for spec in CATALOGUE {
        if spec.labels.is_empty() || spec.name == sagabox::metrics::BUILD_INFO {
            assert!(
                registered.contains(&spec.name),
                "{} not registered",
                spec.name
            );
        }
    }

    // A dead letter is counted under its reason's code.
    metrics::with_local_recorder(&recorder, || {
        sagabox::metrics::dead_lettered("payment", DeadReason::RetriesExhausted);
    });
    let dead = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(key, ..)| key.key().name() == DEAD_LETTERS_TOTAL)
        .expect("the dead letter counted");
    let labels: Vec<(String, String)> = dead
        .0
        .key()
        .labels()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect();
    assert_eq!(
        labels,
        [
            ("consumer_type".to_owned(), "payment".to_owned()),
            ("reason".to_owned(), "retries_exhausted".to_owned())
        ]
    );
}
