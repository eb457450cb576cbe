//! Trace context across processes: the W3C [`traceparent`](TRACEPARENT) and
//! [`tracestate`](TRACESTATE) of the span that sent a message travel in the message's
//! [`Envelope::headers`](crate::Envelope::headers), so the span that handles it in
//! another process continues the same trace.
//!
//! Where the library does it:
//!
//! - a step command takes the context of the orchestrator's `saga.step` span (in
//!   [`AmqpDispatch`](crate::amqp::AmqpDispatch), and in
//!   [`StepPool::deliver`](crate::step::StepPool::deliver) for steps in process);
//! - the RabbitMQ consumer's `amqp.consume` span and a step worker's `step.handle` span
//!   are children of the context their message carries;
//! - a step's reply, and a row a handler writes to the outbox, carry the handler's span;
//! - the AMQP codec copies both headers into the message's AMQP headers as well, for
//!   broker tools, and reads them from there when the body has none.
//!
//! Every drive of a saga runs in a `saga` span whose (never exported) parent has the
//! trace id [`saga_trace_id`] derives from the saga's id: one saga is one trace, across
//! processes and across restarts of its orchestrator.
//!
//! The spans are `tracing` spans; they become OpenTelemetry spans only where the
//! application installs a `tracing-opentelemetry` layer (the `sagabox` command does with
//! `--otlp-endpoint`). Without one, or without the `otel` feature, no context is injected
//! and nothing else changes. A header that does not parse is ignored — the message
//! starts a new trace — never an error: a message is never refused for its tracing.

use std::collections::BTreeMap;
use std::fmt;

use uuid::Uuid;

/// The W3C header naming the trace and the parent span: `00-<trace>-<span>-<flags>`.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header with vendor-specific trace data, carried along with
/// [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// The trace context of a `traceparent` header, parsed and checked.
///
/// ```
/// use sagabox::trace::TraceParent;
/// let text = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// let parent = TraceParent::parse(text).unwrap();
/// assert!(parent.sampled());
/// assert_eq!(parent.to_string(), text);
/// assert_eq!(TraceParent::parse("00-not-a-trace-01"), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// The trace's id; never all zeros.
    pub trace_id: [u8; 16],
    /// The parent span's id; never all zeros.
    pub span_id: [u8; 8],
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceParent {
    /// Parses a `traceparent` value as the W3C Trace Context spec reads it: version
    /// `00` exactly `00-<32 hex>-<16 hex>-<2 hex>`, lower-case; a later version may
    /// append fields after a `-`; version `ff`, an all-zero id or anything else that does
    /// not fit gives `None`.
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        let mut parts = text.splitn(5, '-');
        let version = parts.next()?;
        let trace_id = parts.next()?;
        let span_id = parts.next()?;
        let flags = parts.next()?;
        let rest = parts.next();
        let [version] = hex::<1>(version)?;
        if version == 0xff || (version == 0 && rest.is_some()) {
            return None;
        }
        let trace_id = hex::<16>(trace_id)?;
        let span_id = hex::<8>(span_id)?;
        let [flags] = hex::<1>(flags)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Whether the sender sampled the trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        for byte in self.trace_id {
            write!(f, "{byte:02x}")?;
        }
        f.write_str("-")?;
        for byte in self.span_id {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

/// `N` bytes from exactly `2 * N` lower-case hex digits.
fn hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut bytes = [0u8; N];
    for (byte, pair) in bytes.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(bytes)
}

/// The trace id of the saga `saga_id`: its 16 bytes when it is a UUID (as the ids
/// [`SagaInstance::start_id`](crate::saga::SagaInstance::start_id) gives are), else a
/// UUIDv5 of it. The same id always gives the same trace, whichever process asks.
pub fn saga_trace_id(saga_id: &str) -> [u8; 16] {
    let bytes = match Uuid::parse_str(saga_id) {
        Ok(uuid) if !uuid.is_nil() => *uuid.as_bytes(),
        _ => *Uuid::new_v5(&Uuid::NAMESPACE_OID, saga_id.as_bytes()).as_bytes(),
    };
    // A trace id of all zeros is invalid; only the nil UUID's v5 could come near it.
    if bytes == [0; 16] { [1; 16] } else { bytes }
}

/// The id of the saga's virtual root span: the parent of every `saga` span of one saga,
/// never exported itself. Stable per saga, so every drive of it hangs off one node.
fn saga_root_span_id(saga_id: &str) -> [u8; 8] {
    let name = format!("sagabox-saga-root\u{1f}{saga_id}");
    let hash = Uuid::new_v5(&Uuid::NAMESPACE_OID, name.as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&hash.as_bytes()[..8]);
    if bytes == [0; 8] { [1; 8] } else { bytes }
}

/// The `traceparent` (and `tracestate`, when there is one) in `headers`, if it parses.
/// A `tracestate` is only read next to a valid `traceparent`.
pub fn extract(headers: &BTreeMap<String, String>) -> Option<(TraceParent, Option<&str>)> {
    let parent = TraceParent::parse(headers.get(TRACEPARENT)?)?;
    let state = headers
        .get(TRACESTATE)
        .map(String::as_str)
        .filter(|state| !state.trim().is_empty());
    Some((parent, state))
}

/// The span a `saga` drive runs in, its parent the saga's virtual root
/// ([`saga_trace_id`]).
pub(crate) fn saga_span(saga: &str, saga_id: &str) -> tracing::Span {
    let span = tracing::debug_span!("saga", saga, saga_id);
    #[cfg(feature = "otel")]
    otel::set_remote_parent(
        &span,
        TraceParent {
            trace_id: saga_trace_id(saga_id),
            span_id: saga_root_span_id(saga_id),
            flags: 1,
        },
        None,
    );
    #[cfg(not(feature = "otel"))]
    let _ = saga_root_span_id;
    span
}

/// Makes `span` a child of the context in `headers`. Call it before the span is first
/// entered. A missing or malformed header leaves `span` where it was (a new trace, or
/// under the current span).
pub fn continue_from(span: &tracing::Span, headers: &BTreeMap<String, String>) {
    #[cfg(feature = "otel")]
    if let Some((parent, state)) = extract(headers) {
        otel::set_remote_parent(span, parent, state);
    }
    #[cfg(not(feature = "otel"))]
    let _ = (span, headers);
}

/// Writes the current span's context into `headers`, replacing what was there. Does
/// nothing when the current span has no OpenTelemetry context (no layer installed, the
/// span disabled, or the `otel` feature off), so headers a message already carries
/// stay.
pub fn inject_current(headers: &mut BTreeMap<String, String>) {
    #[cfg(feature = "otel")]
    otel::inject_current(headers);
    #[cfg(not(feature = "otel"))]
    let _ = headers;
}

/// `headers` with the current span's context added, unless they carry a
/// [`TRACEPARENT`] already (a sender that set its own context keeps it).
pub(crate) fn with_current(
    headers: &BTreeMap<String, String>,
) -> std::borrow::Cow<'_, BTreeMap<String, String>> {
    if headers.contains_key(TRACEPARENT) {
        return std::borrow::Cow::Borrowed(headers);
    }
    let mut owned = headers.clone();
    inject_current(&mut owned);
    if owned.len() == headers.len() {
        std::borrow::Cow::Borrowed(headers)
    } else {
        std::borrow::Cow::Owned(owned)
    }
}

/// The bridge to OpenTelemetry, through the `tracing-opentelemetry` layer the
/// application installs.
#[cfg(feature = "otel")]
mod otel {
    use std::collections::BTreeMap;
    use std::str::FromStr;

    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::{TRACEPARENT, TRACESTATE, TraceParent};

    pub(super) fn set_remote_parent(
        span: &tracing::Span,
        parent: TraceParent,
        state: Option<&str>,
    ) {
        // A malformed tracestate is dropped on its own, as the spec asks; the
        // traceparent still holds.
        let state = state
            .and_then(|state| TraceState::from_str(state).ok())
            .unwrap_or_default();
        let context = SpanContext::new(
            TraceId::from_bytes(parent.trace_id),
            SpanId::from_bytes(parent.span_id),
            TraceFlags::new(parent.flags),
            true,
            state,
        );
        // Fails only when no OpenTelemetry layer sees the span: then there is no trace
        // to continue anyway.
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(context));
    }

    pub(super) fn inject_current(headers: &mut BTreeMap<String, String>) {
        let context = tracing::Span::current().context();
        let span = context.span();
        let span_context = span.span_context();
        if !span_context.is_valid() {
            return;
        }
        let parent = TraceParent {
            trace_id: span_context.trace_id().to_bytes(),
            span_id: span_context.span_id().to_bytes(),
            flags: span_context.trace_flags().to_u8(),
        };
        headers.insert(TRACEPARENT.to_owned(), parent.to_string());
        let state = span_context.trace_state().header();
        if state.is_empty() {
            headers.remove(TRACESTATE);
        } else {
            headers.insert(TRACESTATE.to_owned(), state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect()
    }

    #[test]
    fn a_traceparent_round_trips() {
        let parent = TraceParent::parse(VALID).unwrap();
        assert_eq!(parent.trace_id[0], 0x4b);
        assert_eq!(parent.span_id[7], 0xb7);
        assert!(parent.sampled());
        assert_eq!(parent.to_string(), VALID);
        let unsampled = TraceParent { flags: 0, ..parent };
        assert!(!unsampled.sampled());
        assert_eq!(TraceParent::parse(&unsampled.to_string()), Some(unsampled));
        // A later version may add fields; its first four are read.
        let future = format!("cc-{}-what-comes-next", &VALID[3..]);
        assert_eq!(
            TraceParent::parse(&future).map(|p| p.trace_id),
            Some(parent.trace_id)
        );
    }

    #[test]
    fn malformed_traceparents_are_none() {
        for bad in [
            "",
            "00",
            "garbage",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902é-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
            assert_eq!(extract(&headers(&[(TRACEPARENT, bad)])), None, "{bad:?}");
        }
    }

    #[test]
    fn extract_reads_the_state_only_next_to_a_valid_parent() {
        let both = headers(&[(TRACEPARENT, VALID), (TRACESTATE, "k=v")]);
        let found = extract(&both);
        assert_eq!(
            found,
            Some((TraceParent::parse(VALID).unwrap(), Some("k=v")))
        );
        assert_eq!(extract(&headers(&[(TRACESTATE, "k=v")])), None);
        assert_eq!(
            extract(&headers(&[(TRACEPARENT, VALID), (TRACESTATE, " ")])).map(|f| f.1),
            Some(None)
        );
    }

    #[test]
    fn a_saga_has_one_trace_id_derived_from_its_id() {
        let uuid = Uuid::now_v7();
        assert_eq!(saga_trace_id(&uuid.to_string()), *uuid.as_bytes());
        assert_eq!(saga_trace_id("j-001"), saga_trace_id("j-001"));
        assert_ne!(saga_trace_id("j-001"), saga_trace_id("j-002"));
        assert_ne!(saga_trace_id(&Uuid::nil().to_string()), [0; 16]);
        assert_ne!(saga_root_span_id("j-001"), saga_root_span_id("j-002"));
    }

    /// Without an OpenTelemetry layer there is no context: headers stay as they are,
    /// and a span given a malformed context is untouched.
    #[test]
    fn without_a_layer_nothing_is_injected_and_nothing_fails() {
        let mut carried = headers(&[(TRACEPARENT, VALID)]);
        inject_current(&mut carried);
        assert_eq!(carried, headers(&[(TRACEPARENT, VALID)]));
        let mut empty = BTreeMap::new();
        inject_current(&mut empty);
        assert!(empty.is_empty());
        assert!(matches!(
            with_current(&empty),
            std::borrow::Cow::Borrowed(_)
        ));
        continue_from(&tracing::Span::none(), &headers(&[(TRACEPARENT, "junk")]));
    }

    /// With a layer: a span continued from a header is in the header's trace, a child
    /// of the header's span, and what it injects names it as the parent; a span given a
    /// malformed header starts a trace of its own.
    #[cfg(feature = "otel")]
    #[test]
    fn inject_and_extract_round_trip_through_a_span() {
        use opentelemetry::trace::TracerProvider as _;
        use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
        use tracing_subscriber::layer::SubscriberExt;

        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let incoming = TraceParent::parse(VALID).unwrap();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("handle");
            continue_from(
                &span,
                &headers(&[(TRACEPARENT, VALID), (TRACESTATE, "vendor=abc")]),
            );
            let mut out = BTreeMap::new();
            span.in_scope(|| inject_current(&mut out));
            let (parent, state) = extract(&out).expect("a context was injected");
            assert_eq!(parent.trace_id, incoming.trace_id);
            assert_ne!(parent.span_id, incoming.span_id, "the handler's own span");
            assert!(parent.sampled());
            assert_eq!(state, Some("vendor=abc"));
            drop(span);

            let fresh = tracing::info_span!("fresh");
            continue_from(&fresh, &headers(&[(TRACEPARENT, "00-zz-zz-zz")]));
            let mut new_trace = BTreeMap::new();
            fresh.in_scope(|| inject_current(&mut new_trace));
            let (parent, _) = extract(&new_trace).expect("a new trace");
            assert_ne!(parent.trace_id, incoming.trace_id);
        });
        let spans = exporter.get_finished_spans().unwrap();
        let handle = spans.iter().find(|span| span.name == "handle").unwrap();
        assert_eq!(handle.parent_span_id.to_bytes(), incoming.span_id);
        assert!(handle.parent_span_is_remote);
        let fresh = spans.iter().find(|span| span.name == "fresh").unwrap();
        assert_eq!(fresh.parent_span_id, opentelemetry::trace::SpanId::INVALID);
    }
}
