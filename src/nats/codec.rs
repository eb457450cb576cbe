//! An [`Envelope`] on JetStream: the `Nats-Msg-Id` header is the message id (so the
//! server's duplicate window drops a re-publish), the body is the JSON envelope body
//! ([`wire`](mod@crate::wire)), the publish time travels in `x-sagabox-published-at` (RFC
//! 3339) and the W3C trace headers are copied to NATS headers too, where `nats` tools
//! show them.
//!
//! A sender that must get a message past the duplicate window on purpose (an
//! orchestrator asking a step again for a reply it lost) publishes it under a fresh
//! `Nats-Msg-Id` with the real id in `x-sagabox-message-id`, which [`decode`] prefers.

use std::collections::BTreeSet;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use chrono::{DateTime, Utc};

use crate::envelope::Envelope;
use crate::trace::{TRACEPARENT, TRACESTATE};
use crate::wire::{self, Malformed};

/// The header holding the message id when `Nats-Msg-Id` is not it (a deliberate resend).
pub const MESSAGE_ID_HEADER: &str = "x-sagabox-message-id";
/// The header with the time the message was first published (RFC 3339).
pub const PUBLISHED_AT_HEADER: &str = "x-sagabox-published-at";
/// The subject a step's reply goes to (core NATS, not persisted).
pub const REPLY_TO_HEADER: &str = "x-sagabox-reply-to";
/// The id of the message a reply answers.
pub const CORRELATION_ID_HEADER: &str = "x-sagabox-correlation-id";

/// The body and headers to publish `envelope` with.
pub fn encode(envelope: &Envelope) -> (Vec<u8>, HeaderMap) {
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, envelope.id.as_str());
    headers.insert("Content-Type", "application/json");
    if let Some(at) = envelope.published_at {
        headers.insert(PUBLISHED_AT_HEADER, at.to_rfc3339());
    }
    for name in [TRACEPARENT, TRACESTATE] {
        if let Some(value) = envelope.headers.get(name) {
            headers.insert(name, value.as_str());
        }
    }
    (wire::encode_body(envelope), headers)
}

/// The envelope in a message, checked against the kinds the consumer takes (an empty set
/// takes every kind).
pub fn decode(
    headers: Option<&HeaderMap>,
    data: &[u8],
    kinds: &BTreeSet<String>,
) -> Result<Envelope, Malformed> {
    let id = headers.and_then(|headers| {
        header(headers, MESSAGE_ID_HEADER).or_else(|| header(headers, NATS_MESSAGE_ID.as_ref()))
    });
    let mut envelope = wire::decode_body(id.as_deref(), data, kinds)?;
    let Some(headers) = headers else {
        return Ok(envelope);
    };
    if !envelope.headers.contains_key(TRACEPARENT)
        && let Some(traceparent) = header(headers, TRACEPARENT)
    {
        envelope.headers.insert(TRACEPARENT.to_owned(), traceparent);
        if let Some(tracestate) = header(headers, TRACESTATE) {
            envelope.headers.insert(TRACESTATE.to_owned(), tracestate);
        }
    }
    envelope.published_at = header(headers, PUBLISHED_AT_HEADER)
        .and_then(|at| DateTime::parse_from_rfc3339(&at).ok())
        .map(|at| at.with_timezone(&Utc));
    Ok(envelope)
}

/// A header's (last) value, if present.
pub fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_last(name)
        .map(|value| value.as_str().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::MessageId;
    use chrono::TimeZone;
    use serde_json::json;

    fn kinds(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|kind| (*kind).to_owned()).collect()
    }

    #[test]
    fn an_envelope_round_trips() {
        let envelope = Envelope::new(MessageId::new_v7(), "charge", json!({"cents": 5}))
            .unwrap()
            .with_saga_id("saga-1")
            .with_header("trace", "abc")
            .with_published_at(Utc.timestamp_opt(1_790_000_000, 0).unwrap());
        let (body, headers) = encode(&envelope);
        assert_eq!(
            header(&headers, "Nats-Msg-Id").as_deref(),
            Some(envelope.id.as_str())
        );
        let decoded = decode(Some(&headers), &body, &kinds(&["charge"])).unwrap();
        assert_eq!(decoded, envelope);
    }

    #[test]
    fn a_resend_keeps_its_real_id() {
        let envelope = Envelope::new(MessageId::new_v7(), "charge", json!({})).unwrap();
        let (body, mut headers) = encode(&envelope);
        headers.insert(MESSAGE_ID_HEADER, envelope.id.as_str());
        headers.insert(NATS_MESSAGE_ID, "resend-1");
        let decoded = decode(Some(&headers), &body, &BTreeSet::new()).unwrap();
        assert_eq!(decoded.id, envelope.id);
    }

    #[test]
    fn each_kind_of_bad_input_has_its_reason() {
        let good = br#"{"kind":"charge","payload":{}}"#;
        let with_id = |id: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(NATS_MESSAGE_ID, id);
            headers
        };
        let any = BTreeSet::new();
        assert_eq!(
            decode(None, good, &any).unwrap_err(),
            Malformed::MissingMessageId
        );
        assert!(matches!(
            decode(Some(&with_id("m-1")), b"not json", &any).unwrap_err(),
            Malformed::NotAnEnvelope(_)
        ));
        assert!(matches!(
            decode(Some(&with_id("m-1")), good, &kinds(&["refund"])).unwrap_err(),
            Malformed::UnknownKind { .. }
        ));
        assert!(decode(Some(&with_id("m-1")), good, &kinds(&["charge"])).is_ok());
    }
}
