//! `GET /inbox`: the inbox's monthly partitions (rows, size, oldest and newest row), the
//! TTL and the broker's retention side by side, how far back the inbox still deduplicates
//! (the pruned watermark), and when the oldest partition is dropped — the `sagabox
//! inspect` report.

use axum::extract::State;
use chrono::{TimeDelta, Utc};
use maud::{Markup, html};
use sagabox::Month;
use sagabox::inspect::inspect;

use super::{PageError, Shared, pages};

/// `GET /inbox`.
pub(crate) async fn page(State(console): State<Shared>) -> Result<Markup, PageError> {
    let report = inspect(&console.config.database_url, &console.config.inspect)
        .await
        .map_err(PageError::read)?;
    let retention = &report.retention;
    let next_drop = retention
        .oldest_partition
        .as_deref()
        .and_then(parse_month)
        .and_then(|month| {
            let ttl = TimeDelta::try_seconds((retention.ttl_days * 86_400.0) as i64)?;
            month.end().checked_add_signed(ttl)
        });
    let now = Utc::now();
    Ok(pages::frame(
        "Inbox",
        "/inbox",
        html! {
            h1 { "Inbox" }
            div.cards {
                div.card id="ttl" { div.n { (retention.ttl_days) " d" } div.l { "TTL: how long a message stays deduplicated" } }
                div.card id="broker-retention" { div.n { (retention.broker_retention_days) " d" } div.l { "broker's redelivery window" } }
                div.card.warn[retention.margin_days.is_some_and(|m| m < 0.0)] id="margin" {
                    div.n { @if let Some(margin) = retention.margin_days { (format!("{margin:.1}")) " d" } @else { "–" } }
                    div.l { "margin of the inbox's reach over the broker's window" }
                }
                div.card id="pruned" {
                    div.n { (retention.pruned_through.as_deref().unwrap_or("none")) }
                    div.l { "pruned through (watermark)" @if let Some(from) = retention.covered_from { "; deduplicated since " (pages::time(from)) } }
                }
                div.card id="next-drop" {
                    div.n { @if let Some(at) = next_drop { (at.format("%Y-%m-%d")) } @else { "–" } }
                    div.l { "next drop: the oldest partition, " (retention.oldest_partition.as_deref().unwrap_or("none"))
                        @if let Some(at) = next_drop { @if at > now { ", in " (pages::age(now, at)) } @else { ", due now" } } }
                }
            }
            @if !report.missing_ahead.is_empty() {
                section.warn { h2 { "Partitions missing ahead" } p { (report.missing_ahead.join(", ")) } }
            }
            section {
                h2 { "Monthly partitions" }
                table #partitions {
                    thead { tr { th { "month" } th.num { "rows" } th.num { "size" } th { "oldest" } th { "newest" } } }
                    tbody {
                        @for partition in &report.partitions {
                            tr data-month=(partition.month) {
                                td { (partition.month) }
                                td.num.rows { (partition.rows) }
                                td.num { @if let Some(bytes) = partition.bytes { (pages::bytes(bytes)) } @else { "–" } }
                                td.oldest { @if let Some(at) = partition.oldest_at { (pages::time(at)) } @else { "–" } }
                                td.newest { @if let Some(at) = partition.newest_at { (pages::time(at)) } @else { "–" } }
                            }
                        }
                    }
                }
            }
            @if !report.warnings.is_empty() {
                section.warn { h2 { "Needs a person" } ul { @for warning in &report.warnings { li { (warning) } } } }
            }
            p.muted { (report.backend) " · " (report.database) " · read " (pages::time(report.at)) " UTC" }
        },
    ))
}

/// `YYYY-MM` as a month.
fn parse_month(text: &str) -> Option<Month> {
    let (year, month) = text.split_once('-')?;
    Month::new(year.parse().ok()?, month.parse().ok()?).ok()
}
