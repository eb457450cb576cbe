//! An [`Envelope`] on the wire: the AMQP `message_id` property is the message id (the
//! delivery tag never is), the body is a JSON object `{"kind", "saga_id"?, "payload",
//! "headers"?}`, and the `timestamp` property carries the publish time.
//!
//! The W3C trace headers ([`TRACEPARENT`], [`TRACESTATE`]) travel in the body with the
//! other headers and are copied to the AMQP headers too, where broker tools show them;
//! a body without them takes them from the AMQP headers (a foreign publisher's).
//!
//! [`decode`] turns a delivery into an envelope or a [`Malformed`] reason that goes into
//! the dead-letter header, so a bad message is set aside with a cause, never retried.

use std::collections::BTreeSet;

use chrono::{DateTime, TimeZone, Utc};
use lapin::BasicProperties;
use lapin::types::AMQPValue;

use crate::envelope::Envelope;
use crate::trace::{TRACEPARENT, TRACESTATE};
use crate::wire;
pub use crate::wire::Malformed;

/// The body and properties to publish `envelope` with: persistent, JSON, its id as
/// `message_id`, its publish time (if any) as `timestamp`.
pub fn encode(envelope: &Envelope) -> (Vec<u8>, BasicProperties) {
    let bytes = wire::encode_body(envelope);
    let mut properties = BasicProperties::default()
        .with_message_id(envelope.id.as_str().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    if let Some(at) = envelope.published_at {
        properties = properties.with_timestamp(u64::try_from(at.timestamp()).unwrap_or(0));
    }
    let trace: Vec<_> = [TRACEPARENT, TRACESTATE]
        .into_iter()
        .filter_map(|name| {
            let value = envelope.headers.get(name)?;
            Some((name, AMQPValue::LongString(value.as_str().into())))
        })
        .collect();
    if !trace.is_empty() {
        properties = with_headers(properties, trace);
    }
    (bytes, properties)
}

/// The envelope in a delivery, checked against the kinds the consumer takes (an empty
/// set takes every kind).
pub fn decode(
    properties: &BasicProperties,
    data: &[u8],
    kinds: &BTreeSet<String>,
) -> Result<Envelope, Malformed> {
    let id = properties.message_id().as_ref().map(|id| id.as_str());
    let mut envelope = wire::decode_body(id, data, kinds)?;
    if !envelope.headers.contains_key(TRACEPARENT)
        && let Some(traceparent) = header(properties, TRACEPARENT)
    {
        envelope.headers.insert(TRACEPARENT.to_owned(), traceparent);
        if let Some(tracestate) = header(properties, TRACESTATE) {
            envelope.headers.insert(TRACESTATE.to_owned(), tracestate);
        }
    }
    envelope.published_at = properties.timestamp().and_then(timestamp);
    Ok(envelope)
}

fn timestamp(seconds: u64) -> Option<DateTime<Utc>> {
    Utc.timestamp_opt(i64::try_from(seconds).ok()?, 0).single()
}

/// A string header of `properties`, if present.
pub fn header(properties: &BasicProperties, name: &str) -> Option<String> {
    let headers = properties.headers().as_ref()?;
    match headers.inner().get(name)? {
        AMQPValue::LongString(value) => Some(value.to_string()),
        AMQPValue::ShortString(value) => Some(value.as_str().to_owned()),
        _ => None,
    }
}

/// An integer header of `properties`, if present.
pub fn count_header(properties: &BasicProperties, name: &str) -> Option<u32> {
    let headers = properties.headers().as_ref()?;
    match headers.inner().get(name)? {
        AMQPValue::LongUInt(value) => Some(*value),
        AMQPValue::LongLongInt(value) => u32::try_from(*value).ok(),
        AMQPValue::LongInt(value) => u32::try_from(*value).ok(),
        _ => None,
    }
}

/// `properties` with `headers` set (added to those already there).
pub fn with_headers(
    properties: BasicProperties,
    headers: impl IntoIterator<Item = (&'static str, AMQPValue)>,
) -> BasicProperties {
    let mut table = properties.headers().clone().unwrap_or_default();
    for (name, value) in headers {
        table.insert(name.into(), value);
    }
    properties.with_headers(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::MessageId;
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
        let (body, properties) = encode(&envelope);
        let decoded = decode(&properties, &body, &kinds(&["charge"])).unwrap();
        assert_eq!(decoded, envelope);
    }

    #[test]
    fn each_kind_of_bad_input_has_its_reason() {
        let good = br#"{"kind":"charge","payload":{}}"#;
        let id = |id: &str| BasicProperties::default().with_message_id(id.into());
        let charge = kinds(&["charge"]);
        let cases: Vec<(BasicProperties, &[u8], &str)> = vec![
            (BasicProperties::default(), good, "missing_message_id"),
            (id(""), good, "invalid_message_id"),
            (id("a\nb"), good, "invalid_message_id"),
            (id("m-1"), b"not json", "not_an_envelope"),
            (id("m-1"), br#"{"payload":{}}"#, "not_an_envelope"),
            (id("m-1"), br#"{"kind":"","payload":{}}"#, "not_an_envelope"),
            (
                id("m-1"),
                br#"{"kind":"refund","payload":{}}"#,
                "unknown_kind",
            ),
        ];
        for (properties, body, reason) in cases {
            let error = decode(&properties, body, &charge).unwrap_err();
            assert_eq!(error.reason().as_str(), reason, "{error}");
        }
        assert!(decode(&id("m-1"), good, &charge).is_ok());
        assert!(decode(&id("m-1"), br#"{"kind":"x","payload":1}"#, &BTreeSet::new()).is_ok());
    }

    #[test]
    fn trace_headers_travel_in_the_body_and_the_amqp_headers() {
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let envelope = Envelope::new(MessageId::new_v7(), "charge", json!({}))
            .unwrap()
            .with_header(TRACEPARENT, traceparent)
            .with_header(TRACESTATE, "vendor=1");
        let (body, properties) = encode(&envelope);
        assert_eq!(
            header(&properties, TRACEPARENT).as_deref(),
            Some(traceparent)
        );
        assert_eq!(header(&properties, TRACESTATE).as_deref(), Some("vendor=1"));
        assert_eq!(
            decode(&properties, &body, &BTreeSet::new()).unwrap(),
            envelope
        );

        // A foreign publisher that set only the AMQP headers.
        let plain = Envelope::new(MessageId::new_v7(), "charge", json!({})).unwrap();
        let (body, properties) = encode(&plain);
        assert_eq!(header(&properties, TRACEPARENT), None);
        let properties = with_headers(
            properties,
            [(TRACEPARENT, AMQPValue::LongString(traceparent.into()))],
        );
        let decoded = decode(&properties, &body, &BTreeSet::new()).unwrap();
        assert_eq!(decoded.headers[TRACEPARENT], traceparent);

        // A malformed one is carried as it is and never refuses the message: the
        // handler's span ignores it.
        let junk = plain.clone().with_header(TRACEPARENT, "junk");
        let (body, properties) = encode(&junk);
        assert_eq!(decode(&properties, &body, &BTreeSet::new()).unwrap(), junk);
    }

    #[test]
    fn headers_are_added_and_read() {
        let properties = with_headers(
            BasicProperties::default(),
            [
                ("x-reason", AMQPValue::LongString("bad".into())),
                ("x-attempts", AMQPValue::LongLongInt(3)),
            ],
        );
        assert_eq!(header(&properties, "x-reason").as_deref(), Some("bad"));
        assert_eq!(count_header(&properties, "x-attempts"), Some(3));
        assert_eq!(count_header(&properties, "x-missing"), None);
    }
}
