//! `GET /`: sagas by state and by definition, the sagas finished per minute over the
//! last hours, duplicates the inbox absorbed per consumer type, the outbox's backlog,
//! and the parked sagas and dead letters, each linking to its list.

use std::collections::BTreeMap;

use axum::extract::State;
use chrono::{DateTime, TimeDelta, Timelike, Utc};
use maud::{Markup, html};
use sagabox::inspect::{InspectReport, inspect};
use sagabox::saga::{FinishedMinute, SagaCount, SagaStatus, SagaStore};

use super::chart::{self, MinuteBar};
use super::pages::STATES;
use super::{PageError, Shared, dead, pages};

/// Hours the chart covers.
const CHART_HOURS: i64 = 3;

/// `GET /`.
pub(crate) async fn page(State(console): State<Shared>) -> Result<Markup, PageError> {
    let now = Utc::now();
    let from = chart_start(now);
    // Side by side: each is a scan or a round trip of its own, and the page waits for all.
    let (counts, finished, report, dead) = {
        let store = &console.db;
        tokio::join!(
            store.counts(),
            store.finished_per_minute(from),
            inspect(&console.config.database_url, &console.config.inspect),
            dead::counts(&console),
        )
    };
    let counts = counts.map_err(PageError::read)?;
    let finished = finished.map_err(PageError::read)?;
    let report = report.map_err(PageError::read)?;

    let bars = bars(&finished, from);
    let table = Table::of(&counts);
    let parked = table.total("parked");
    let dead_total: Option<u64> = dead.as_ref().map(|queues| {
        queues
            .iter()
            .filter_map(|(_, n)| n.as_ref().ok())
            .map(|n| u64::from(*n))
            .sum()
    });
    let lag = report
        .outbox
        .oldest_pending_at
        .map(|at| pages::age(at, now));

    Ok(pages::frame(
        "Overview",
        "/",
        html! {
            h1 { "Overview" }
            div.cards {
                @for state in STATES {
                    div.card.warn[state == "parked" && parked > 0] id={ "count-" (state) } {
                        a href={ "/sagas?status=" (state) } {
                            div.n { (table.total(state)) }
                            div.l { (state) }
                        }
                    }
                }
                div.card.warn[dead_total.unwrap_or(0) > 0] id="dead-letters" {
                    a href="/dead" {
                        div.n { @if let Some(n) = dead_total { (n) } @else { "–" } }
                        div.l { "dead letters" @if dead.is_none() { " (no broker given)" } }
                    }
                }
                div.card id="outbox" {
                    div.n { (report.outbox.pending) }
                    div.l { "outbox pending" @if let Some(lag) = &lag { ", oldest " (lag) } }
                }
            }
            @if !report.warnings.is_empty() {
                section.warn {
                    h2 { "Needs a person" }
                    ul { @for warning in &report.warnings { li { (warning) } } }
                }
            }
            section {
                h2 { "Sagas finished per minute, last " (CHART_HOURS) " hours (UTC)" }
                p.legend {
                    span { i style="background:#2e8b57" {} "completed" }
                    span { i style="background:#c9822b" {} "compensated" }
                }
                (chart::per_minute(from, &bars))
            }
            section {
                h2 { "Sagas by definition" }
                table #by-definition {
                    thead { tr { th { "definition" } @for state in STATES { th.num { (state) } } th.num { "total" } } }
                    tbody {
                        @for (name, row) in &table.rows {
                            tr {
                                td { a href={ "/sagas?saga=" (name) } { (name) } }
                                @for state in STATES {
                                    td.num data-state=(state) {
                                        a href={ "/sagas?saga=" (name) "&status=" (state) } { (row.get(state).copied().unwrap_or(0)) }
                                    }
                                }
                                td.num { (row.values().sum::<i64>()) }
                            }
                        }
                    }
                }
            }
            (duplicates(&report))
        },
    ))
}

/// One bar per minute since `from`: the sagas that finished in it, by how.
fn bars(finished: &[FinishedMinute], from: DateTime<Utc>) -> Vec<MinuteBar> {
    let mut bars = vec![MinuteBar::default(); usize::try_from(CHART_HOURS * 60).unwrap_or(0)];
    for minute in finished {
        let index = usize::try_from((minute.minute - from).num_minutes()).unwrap_or(usize::MAX);
        if let Some(bar) = bars.get_mut(index) {
            match minute.status {
                SagaStatus::Compensated => bar.compensated += minute.sagas,
                _ => bar.completed += minute.sagas,
            }
        }
    }
    bars
}

/// The duplicates the inbox absorbed, per consumer type.
fn duplicates(report: &InspectReport) -> Markup {
    html! {
    section {
        h2 { "Duplicates the inbox absorbed" }
        @if report.duplicate_deliveries.is_empty() {
            p.muted { "none in the inbox" }
        } @else {
            table #duplicates {
                thead { tr { th { "consumer type" } th.num { "last hour" } th.num { "last day" } th.num { "in the inbox" } } }
                tbody {
                    @for row in &report.duplicate_deliveries {
                        tr data-consumer=(row.consumer_type) {
                            td { (row.consumer_type) }
                            td.num { (row.last_hour) }
                            td.num { (row.last_day) }
                            td.num.in-inbox { (row.in_inbox) }
                        }
                    }
                }
            }
        }
    }
    }
}

/// The first minute the chart shows: whole minutes, so bars line up with the query's.
fn chart_start(now: DateTime<Utc>) -> DateTime<Utc> {
    let start = now - TimeDelta::hours(CHART_HOURS) + TimeDelta::minutes(1);
    start
        .with_second(0)
        .and_then(|at| at.with_nanosecond(0))
        .unwrap_or(start)
}

/// Counts per definition and state.
struct Table {
    rows: BTreeMap<String, BTreeMap<&'static str, i64>>,
}

impl Table {
    fn of(counts: &[SagaCount]) -> Self {
        let mut rows: BTreeMap<String, BTreeMap<&'static str, i64>> = BTreeMap::new();
        for count in counts {
            *rows
                .entry(count.saga_name.clone())
                .or_default()
                .entry(count.state.as_str())
                .or_default() += count.sagas;
        }
        Self { rows }
    }

    fn total(&self, state: &str) -> i64 {
        self.rows.values().filter_map(|row| row.get(state)).sum()
    }
}
