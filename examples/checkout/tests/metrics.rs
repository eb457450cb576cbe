//! The Prometheus endpoint: a scrape taken while a demo runs lists every catalogued
//! metric the demo emits (and no labelled family without its labels), and the figures
//! it serves agree with the database (applied messages = inbox rows, duplicates = the
//! counts on the inbox rows, saga durations = sagas finished). The one test here
//! installs the global recorder. (The catalogue against the docs and the dashboard:
//! `tests/catalogue.rs` at the workspace root.)

#![allow(clippy::unwrap_used)]

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::scrape::{free_port, has_metric, has_unlabelled_series, scrape, sum};
use sagabox::inspect::{InspectOptions, inspect};
use sagabox::metrics::{CATALOGUE, DEAD_LETTERS_TOTAL, MetricKind, MetricSpec};
use sagabox_checkout::{DemoConfig, run};

/// The metrics an in-process demo never emits: it has no transport to dead-letter or
/// publish an outbox through, and parks no saga (its compensations never refuse).
const NOT_IN_A_DEMO: [&str; 3] = [
    DEAD_LETTERS_TOTAL,
    sagabox::metrics::OUTBOX_PUBLISHED_TOTAL,
    sagabox::metrics::SAGAS_PARKED_TOTAL,
];

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
