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
//! The RabbitMQ consumer opens `amqp.consume` per delivery and a step worker
//! `step.handle` per command, and the orchestrator a `saga` span per drive of a saga,
//! around its `saga.step` spans; all at `debug`.
//!
//! With an OTLP endpoint (`--otlp-endpoint`, or `OTEL_EXPORTER_OTLP_ENDPOINT`; feature
//! `otlp`), the same spans are also exported as OpenTelemetry spans over OTLP/HTTP,
//! filtered by [`OTLP_FILTER`] rather than `RUST_LOG`, so a trace is whole whatever the
//! log lines show. Their W3C context travels in every message sagabox sends
//! ([`sagabox::trace`]): one saga is one trace across the orchestrator and its
//! participants. Without an endpoint no OpenTelemetry layer is installed and nothing is
//! exported.
//!
//! In JSON lines, lists are JSON lists ([`json_list`](sagabox::logging::json_list)).
//! No span or event carries a database URL: URLs are logged only through
//! [`redact`](sagabox::logging::redact).

use std::fmt;
use std::io::IsTerminal;
use std::str::FromStr;

use tracing_subscriber::fmt::format::{FmtSpan, JsonFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

mod json;

/// The filter used when `RUST_LOG` is unset: warnings and errors, and `serve`'s up and
/// stop lines; lapin's own error lines are held back, since every broker failure reaches
/// the caller as one typed error that says it in full.
pub const DEFAULT_FILTER: &str = "warn,lapin=off,sagabox::serve=info";

/// Which spans and events go to the OTLP endpoint: sagabox's spans at `debug` (every
/// message, step attempt and saga drive) and every warning, whatever `RUST_LOG` says.
pub const OTLP_FILTER: &str =
    "warn,lapin=off,sagabox=debug,sagabox_cli=debug,sagabox_checkout=debug,sagabox_trip=debug";

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
    /// The OTLP exporter could not be set up (a malformed endpoint, most often).
    #[error(
        "cannot export traces to {endpoint}: {reason}; give a base URL such as http://localhost:4318"
    )]
    Otlp {
        /// The endpoint as given.
        endpoint: String,
        /// What the exporter said.
        reason: String,
    },
    /// An endpoint was given to a binary built without the `otlp` feature.
    #[error(
        "--otlp-endpoint {0} was given, but this sagabox was built without the otlp feature; \
         rebuild with --features otlp or unset OTEL_EXPORTER_OTLP_ENDPOINT"
    )]
    OtlpNotBuilt(String),
}

/// Keeps the trace export running: dropping it sends the spans not yet exported and
/// stops the exporter. Hold it until the process ends.
#[must_use = "dropping the guard stops the trace export"]
#[derive(Debug, Default)]
pub struct TracingGuard {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            // The subscriber may already be gone: say it where a person sees it.
            eprintln!("sagabox: exporting the last spans failed: {error}");
        }
    }
}

/// The OTLP/HTTP traces URL for `endpoint`: like `OTEL_EXPORTER_OTLP_ENDPOINT`, a base
/// URL to which `/v1/traces` is appended, unless it already ends with it.
pub fn otlp_traces_url(endpoint: &str) -> String {
    let base = endpoint.trim().trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_owned()
    } else {
        format!("{base}/v1/traces")
    }
}

/// The tracer provider exporting to `endpoint` as `service` (unless `OTEL_SERVICE_NAME`
/// names it), spans sent in batches from a thread of the SDK's.
#[cfg(feature = "otlp")]
fn otlp_provider(
    endpoint: &str,
    service: &str,
) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, TelemetryError> {
    use opentelemetry_otlp::WithExportConfig;

    let url = otlp_traces_url(endpoint);
    let failed = |reason: String| TelemetryError::Otlp {
        endpoint: endpoint.to_owned(),
        reason,
    };
    match url.split_once("://") {
        Some(("http" | "https", rest)) if !rest.is_empty() => {}
        _ => {
            return Err(failed(
                "the endpoint is not an http:// or https:// URL".into(),
            ));
        }
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .build()
        .map_err(|error| failed(error.to_string()))?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service.to_owned());
    }
    Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

#[cfg(not(feature = "otlp"))]
fn otlp_provider(
    endpoint: &str,
    _service: &str,
) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, TelemetryError> {
    Err(TelemetryError::OtlpNotBuilt(endpoint.to_owned()))
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
///
/// With `otlp_endpoint`, spans are exported there too (see the module's docs), as
/// `service` unless `OTEL_SERVICE_NAME` says otherwise; keep the returned guard until
/// the process ends, so the last spans are sent.
pub fn init_tracing(
    format: LogFormat,
    otlp_endpoint: Option<&str>,
    service: &str,
) -> Result<TracingGuard, TelemetryError> {
    let filter = env_filter()?;
    let provider = match otlp_endpoint.map(str::trim).filter(|e| !e.is_empty()) {
        Some(endpoint) => Some(otlp_provider(endpoint, service)?),
        None => None,
    };
    let lines = tracing_subscriber::fmt::layer()
        .with_span_events(FmtSpan::CLOSE)
        // Colour codes only for a person at a terminal, never into a log file.
        .with_ansi(std::io::stderr().is_terminal())
        // A log line that cannot be written (stderr closed, full, a pipe whose reader
        // went away) is dropped. The default reports it with `eprintln!`, which panics
        // on the same broken stderr — inside whatever actor or task was logging.
        .log_internal_errors(false)
        .with_writer(std::io::stderr);
    let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> = vec![match format {
        LogFormat::Human => lines.with_filter(filter).boxed(),
        LogFormat::Json => lines
            .fmt_fields(JsonFields::new())
            .event_format(json::JsonLines)
            .with_filter(filter)
            .boxed(),
    }];
    if let Some(provider) = &provider {
        use opentelemetry::trace::TracerProvider as _;
        layers.push(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("sagabox"))
                .with_filter(EnvFilter::new(OTLP_FILTER))
                .boxed(),
        );
    }
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
    tracing_subscriber::registry()
        .with(layers)
        .try_init()
        .map_err(|_| TelemetryError::AlreadyInstalled)?;
    Ok(TracingGuard { provider })
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

    #[test]
    fn the_traces_path_is_appended_once() {
        for endpoint in [
            "http://localhost:4318",
            "http://localhost:4318/",
            "http://localhost:4318/v1/traces",
            " http://localhost:4318/v1/traces/ ",
        ] {
            assert_eq!(
                otlp_traces_url(endpoint),
                "http://localhost:4318/v1/traces",
                "{endpoint:?}"
            );
        }
    }

    #[cfg(feature = "otlp")]
    #[test]
    fn a_malformed_endpoint_is_refused_with_its_cause() {
        for endpoint in ["localhost:4318", "ftp://collector", "http://"] {
            let error = otlp_provider(endpoint, "sagabox").expect_err(endpoint);
            assert!(matches!(error, TelemetryError::Otlp { .. }), "{error}");
            assert!(error.to_string().contains(endpoint), "{error}");
        }
    }
}
