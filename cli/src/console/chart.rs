//! Charts drawn on the server as SVG: no script runs in the browser. The finished sagas
//! per minute (stacked bars) and a saga's timeline (one lane per step, an attempt's
//! wait as a bar ending at its answer, every other event a mark).

use chrono::{DateTime, TimeDelta, Utc};
use maud::{Markup, html};

const WIDTH: f64 = 1000.0;

/// One minute of the per-minute chart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct MinuteBar {
    pub(crate) completed: i64,
    pub(crate) compensated: i64,
}

/// Completed (green) and compensated (amber) sagas per minute, `bars[0]` being the
/// minute starting at `from`.
pub(crate) fn per_minute(from: DateTime<Utc>, bars: &[MinuteBar]) -> Markup {
    const HEIGHT: f64 = 180.0;
    const LEFT: f64 = 44.0;
    const BOTTOM: f64 = 22.0;
    let plot_h = HEIGHT - BOTTOM - 8.0;
    let top = bars
        .iter()
        .map(|bar| bar.completed + bar.compensated)
        .max()
        .unwrap_or(0)
        .max(1);
    let slot = (WIDTH - LEFT) / bars.len().max(1) as f64;
    let scale = |n: i64| n as f64 / top as f64 * plot_h;
    let base = HEIGHT - BOTTOM;
    let hours = bars.len() / 60;
    html! {
        svg.chart viewBox={ "0 0 " (WIDTH) " " (HEIGHT) } width="100%" role="img"
            aria-label="sagas finished per minute" {
            line x1=(LEFT) y1=(base) x2=(WIDTH) y2=(base) stroke="#d9dee7" {}
            text x="2" y="14" { (top) "/min" }
            text x="2" y=(base) { "0" }
            @for (i, bar) in bars.iter().enumerate() {
                @let x = LEFT + i as f64 * slot;
                @let done = scale(bar.completed);
                @let undone = scale(bar.compensated);
                @if bar.completed > 0 {
                    rect x=(x) y=(base - done) width=(slot.max(1.0)) height=(done) fill="#2e8b57" {
                        title { (minute(from, i)) ": " (bar.completed) " completed" }
                    }
                }
                @if bar.compensated > 0 {
                    rect x=(x) y=(base - done - undone) width=(slot.max(1.0)) height=(undone) fill="#c9822b" {
                        title { (minute(from, i)) ": " (bar.compensated) " compensated" }
                    }
                }
            }
            @for h in 0..=hours {
                @let x = LEFT + (h * 60) as f64 * slot;
                line x1=(x) y1=(base) x2=(x) y2=(base + 4.0) stroke="#8a94a6" {}
                text x=(x) y=(HEIGHT - 4.0) text-anchor=(if h == hours { "end" } else { "middle" }) { (minute(from, h * 60)) }
            }
        }
    }
}

fn minute(from: DateTime<Utc>, offset: usize) -> String {
    let at = from + TimeDelta::minutes(i64::try_from(offset).unwrap_or(0));
    at.format("%H:%M").to_string()
}

/// One event on a timeline.
#[derive(Debug, Clone)]
pub(crate) struct Mark {
    /// Milliseconds since the saga started.
    pub(crate) at_ms: i64,
    /// How long it waited for this answer, if it was one.
    pub(crate) waited_ms: Option<i64>,
    /// The lane: the step's name, or empty for the saga itself.
    pub(crate) lane: String,
    /// The event's kind.
    pub(crate) kind: &'static str,
    /// What a hover shows.
    pub(crate) label: String,
}

/// The colour of an event kind: answers that moved the saga on are green, failures
/// red, undoing amber, operators purple.
fn colour(kind: &str) -> &'static str {
    match kind {
        "applied" | "completed" | "started" => "#2e8b57",
        "duplicate" => "#6aa5ff",
        "failed" | "timed_out" | "refused" | "rejected" | "deadline_passed" => "#c0392b",
        "compensating" | "compensated" | "skipped" => "#c9822b",
        "parked" | "retried" | "cancelled" => "#8e44ad",
        _ => "#8a94a6",
    }
}

/// The timeline of one saga: `lanes` in order, `marks` placed on a shared time axis.
pub(crate) fn timeline(lanes: &[String], marks: &[Mark]) -> Markup {
    const LANE: f64 = 28.0;
    const LEFT: f64 = 120.0;
    let height = LANE * lanes.len() as f64 + 30.0;
    let end = marks
        .iter()
        .map(|mark| mark.at_ms)
        .max()
        .unwrap_or(0)
        .max(1);
    let x = |ms: i64| LEFT + (ms.max(0) as f64 / end as f64) * (WIDTH - LEFT - 12.0);
    let lane_of = |name: &str| lanes.iter().position(|lane| lane == name).unwrap_or(0);
    html! {
        svg.timeline viewBox={ "0 0 " (WIDTH) " " (height) } width="100%" role="img"
            aria-label="the saga's timeline" {
            @for (i, lane) in lanes.iter().enumerate() {
                @let y = 10.0 + i as f64 * LANE;
                rect x="0" y=(y) width=(WIDTH) height=(LANE) fill=(if i % 2 == 0 { "#fafbfc" } else { "#fff" }) {}
                text x="6" y=(y + 18.0) { (if lane.is_empty() { "saga" } else { lane.as_str() }) }
            }
            @for mark in marks {
                @let y = 10.0 + lane_of(&mark.lane) as f64 * LANE;
                @if let Some(waited) = mark.waited_ms {
                    rect x=(x(mark.at_ms - waited)) y=(y + 9.0)
                        width=((x(mark.at_ms) - x(mark.at_ms - waited)).max(2.0)) height="10"
                        rx="2" fill=(colour(mark.kind)) opacity="0.55" {
                        title { (mark.label) }
                    }
                }
                circle cx=(x(mark.at_ms)) cy=(y + 14.0) r="5" fill=(colour(mark.kind)) {
                    title { (mark.label) }
                }
            }
            @let axis = 10.0 + LANE * lanes.len() as f64;
            line x1=(LEFT) y1=(axis) x2=(WIDTH - 12.0) y2=(axis) stroke="#8a94a6" {}
            text x=(LEFT) y=(axis + 16.0) { "0 s" }
            text x=(WIDTH - 80.0) y=(axis + 16.0) { (format!("{:.3} s", end as f64 / 1000.0)) }
        }
    }
}
