//! The metric catalogue, `docs/operations.md` and the Grafana dashboard name the same
//! metrics, labels, label values and dead-letter reasons; registering the catalogue
//! makes no series without its labels. Local `DebuggingRecorder`s only.

#![allow(clippy::unwrap_used)]

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use sagabox::dead_reason::DeadReason;
use sagabox::metrics::{CATALOGUE, DEAD_LETTERS_TOTAL};

/// The metrics an in-process demo never emits: it has no transport to dead-letter or
/// publish an outbox through.
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
        (
            "docs/configuration.md",
            include_str!("../docs/configuration.md"),
        ),
        ("docs/console.md", include_str!("../docs/console.md")),
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
    let docs = [
        ("docs/operations.md", guide),
        (
            "docs/configuration.md",
            include_str!("../docs/configuration.md"),
        ),
        ("docs/console.md", include_str!("../docs/console.md")),
    ];
    for retired in ["malformed", "expired", "pruned", "future", "poison"] {
        for (file, text) in docs {
            assert!(
                !text.contains(&format!("`{retired}`")),
                "{file} still names the reason {retired:?}"
            );
        }
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
