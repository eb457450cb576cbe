//! Log and trace output for the `sagabox` binary and for services built on the library:
//! [`init_tracing`] installs a `tracing` subscriber filtered by `RUST_LOG`, writing to
//! stderr as human-readable lines or as one JSON object per line ([`LogFormat`]).
//!
//! The spans sagabox opens: `inbox.process` per message through the guard (fields
//! `consumer_type`, `message_id`, `saga_id`, `outcome`) at `debug`, and `saga.step` per
//! step command attempt (`saga`, `saga_id`, `step`, `direction`, `attempt`, `outcome`)
//! at `debug`. Each is printed once, when it closes, with its fields and its time —
//! `RUST_LOG=sagabox=debug` shows them; the default ([`DEFAULT_FILTER`]) shows only
//! problems and `serve`'s up and stop lines.
//! In JSON lines, lists are JSON lists ([`json_list`](sagabox::logging::json_list)).
//! No span or event carries a database URL: URLs are logged only through
//! [`redact`](sagabox::database::redact).

use std::fmt;
use std::io::IsTerminal;
use std::str::FromStr;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::{FmtSpan, JsonFields};

mod json;

/// The filter used when `RUST_LOG` is unset: warnings and errors, and `serve`'s up and
/// stop lines; lapin's own error lines are held back, since every broker failure reaches
/// the caller as one typed error that says it in full.
pub const DEFAULT_FILTER: &str = "warn,lapin=off,sagabox::serve=info";

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum LogFormat {
    /// One readable line per event. The default.
    #[default]
    Human,
    /// One JSON object per event, for log shippers.
    Json,
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Human => "human",
            LogFormat::Json => "json",
        })
    }
}

impl FromStr for LogFormat {
    type Err = TelemetryError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "human" => Ok(LogFormat::Human),
            "json" => Ok(LogFormat::Json),
            other => Err(TelemetryError::UnknownFormat(other.to_owned())),
        }
    }
}

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    /// The log format is neither `human` nor `json`.
    #[error("unknown log format {0:?}; use human or json")]
    UnknownFormat(String),
    /// `RUST_LOG` does not parse as a filter.
    #[error("RUST_LOG={value:?} is not a valid filter: {reason}; e.g. RUST_LOG=warn,sagabox=debug")]
    InvalidFilter {
        /// The variable's value.
        value: String,
        /// The parser's complaint.
        reason: String,
    },
    /// A global subscriber is already installed in this process.
    #[error("a tracing subscriber is already installed; call init_tracing once, at start-up")]
    AlreadyInstalled,
}

/// The filter from `RUST_LOG`, or [`DEFAULT_FILTER`] when it is unset or empty.
pub fn env_filter() -> Result<EnvFilter, TelemetryError> {
    match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(value) if !value.trim().is_empty() => {
            EnvFilter::try_new(&value).map_err(|error| TelemetryError::InvalidFilter {
                value,
                reason: error.to_string(),
            })
        }
        _ => Ok(EnvFilter::new(DEFAULT_FILTER)),
    }
}

/// Installs the global subscriber: `RUST_LOG` filters, `format` shapes the lines,
/// stderr receives them (stdout stays free for reports and `--json` output). Spans are
/// printed when they close, so each message and each step attempt is one line. A line
/// that cannot be written is dropped: logging never fails the work it describes. With
/// [`LogFormat::Json`] it also installs a panic hook that logs a panic as one JSON line.
pub fn init_tracing(format: LogFormat) -> Result<(), TelemetryError> {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter()?)
        .with_span_events(FmtSpan::CLOSE)
        // Colour codes only for a person at a terminal, never into a log file.
        .with_ansi(std::io::stderr().is_terminal())
        // A log line that cannot be written (stderr closed, full, a pipe whose reader
        // went away) is dropped. The default reports it with `eprintln!`, which panics
        // on the same broken stderr — inside whatever actor or task was logging.
        .log_internal_errors(false)
        .with_writer(std::io::stderr);
    if format == LogFormat::Json {
        // A panic the process survives (a handler's, caught and retried; a saga driver's)
        // would otherwise print lines of plain text among the JSON ones.
        std::panic::set_hook(Box::new(|info| {
            let location = info
                .location()
                .map(|at| format!("{}:{}", at.file(), at.line()))
                .unwrap_or_default();
            let message = sagabox::supervisor::panic_message(info.payload());
            tracing::error!(target: "panic", %location, panic = %message, "a panic");
        }));
    }
    let installed = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder
            .fmt_fields(JsonFields::new())
            .event_format(json::JsonLines)
            .try_init(),
    };
    installed.map_err(|_| TelemetryError::AlreadyInstalled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_print() {
        for format in [LogFormat::Human, LogFormat::Json] {
            assert_eq!(format.to_string().parse::<LogFormat>().ok(), Some(format));
        }
        let error = "xml".parse::<LogFormat>().expect_err("xml");
        assert!(error.to_string().contains("human or json"), "{error}");
    }
}
