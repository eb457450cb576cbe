//! The frame every page shares (header, navigation, the vendored stylesheet) and the
//! small formatting helpers the pages use.

use axum::http::header;
use axum::response::IntoResponse;
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

/// The states in the order of the tables' columns.
pub(crate) const STATES: [&str; 5] = [
    "running",
    "compensating",
    "parked",
    "completed",
    "compensated",
];

/// The stylesheet, compiled into the binary.
const STYLESHEET: &str = include_str!("../../assets/console.css");

/// `GET /assets/console.css`.
pub(crate) async fn stylesheet() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        STYLESHEET,
    )
}

/// A whole page: `title`, the navigation with `here` marked, then `body`.
pub(crate) fn frame(title: &str, here: &str, body: Markup) -> Markup {
    let links = [
        ("/", "Overview"),
        ("/sagas", "Sagas"),
        ("/inbox", "Inbox"),
        ("/dead", "Dead letters"),
    ];
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · sagabox console" }
                link rel="stylesheet" href="/assets/console.css";
            }
            body {
                header {
                    span.brand { "sagabox console" }
                    nav {
                        @for (href, label) in links {
                            a href=(href) class=[(href == here).then_some("here")] { (label) }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// A state as a coloured label.
pub(crate) fn state(state: &str) -> Markup {
    html! { span class={ "state " (state) } { (state) } }
}

/// How long ago `at` was, for people: `42 s`, `7 min`, `3 h`, `12 d`.
pub(crate) fn age(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let seconds = (now - at).num_seconds().max(0);
    duration_text(seconds)
}

/// `seconds` as the largest whole unit.
pub(crate) fn duration_text(seconds: i64) -> String {
    match seconds {
        s if s < 120 => format!("{s} s"),
        s if s < 2 * 3600 => format!("{} min", s / 60),
        s if s < 2 * 86_400 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}

/// `at` as a UTC timestamp to the second.
pub(crate) fn time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S").to_string()
}

/// Bytes for people: `812 kB`, `3.4 MB`.
pub(crate) fn bytes(n: i64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_read_well() {
        assert_eq!(duration_text(5), "5 s");
        assert_eq!(duration_text(600), "10 min");
        assert_eq!(duration_text(3 * 3600), "3 h");
        assert_eq!(duration_text(3 * 86_400), "3 d");
        assert_eq!(bytes(812), "812 B");
        assert_eq!(bytes(3_400_000), "3.4 MB");
    }
}
