//! The Prometheus endpoint: a scrape taken while a demo runs lists every catalogued
//! metric, and the figures it serves agree with the database (applied messages = inbox
//! rows, duplicates = the counts on the inbox rows, saga durations = sagas finished).
//! The catalogue, `docs/operations.md` and the Grafana dashboard name the same metrics.
//!
//! The recorder is global to the process, so exactly one test here installs it.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::scrape::{free_port, has_metric, scrape, sum};
use sagabox::demo::{DemoConfig, run};
use sagabox::inspect::{InspectOptions, inspect};
use sagabox::metrics::{CATALOGUE, MetricKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scrape_during_a_demo_run_finds_every_catalogued_metric() {
    let addr = sagabox::metrics::install_prometheus(&format!("127.0.0.1:{}", free_port())).unwrap();
    let fx = common::Lite::new().await;
    let config = DemoConfig {
        orders: 300,
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

    // Scrape until a scrape shows the demo at work, while it still runs.
    let during = loop {
        assert!(
            !demo.is_finished(),
            "the demo ended before a scrape saw it running"
        );
        let text = scrape(addr).await.unwrap();
        if sum(
            &text,
            "sagabox_inbox_messages_total",
            &["outcome=\"applied\""],
        ) > 0.0
        {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for spec in CATALOGUE {
        assert!(
            has_metric(&during, spec.name),
            "{} missing from\n{during}",
            spec.name
        );
        let kind = match spec.kind {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
            _ => unreachable!("a kind the test does not know"),
        };
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

    // Histograms have buckets from sub-millisecond up.
    assert!(
        after.contains("sagabox_inbox_claim_seconds_bucket{le=\"0.0001\"}"),
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
    let on_rows: i64 = report.duplicates.iter().map(|d| d.in_inbox).sum();
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
