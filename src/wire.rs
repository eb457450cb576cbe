//! An [`Envelope`]'s body on any broker: a JSON object `{"kind", "saga_id"?, "payload",
//! "headers"?}`, with the message id outside it (AMQP's `message_id` property, NATS's
//! `Nats-Msg-Id` header). [`decode_body`] turns a body and its id into an envelope or a
//! [`Malformed`] reason that goes into the dead-letter header, so a bad message is set
//! aside with a cause, never retried.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::dead_reason::DeadReason;
use crate::envelope::{Envelope, KeyError, MessageId};

/// The body of a message on the wire.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    saga_id: Option<String>,
    payload: Value,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    headers: BTreeMap<String, String>,
}

/// Why a delivery is not a message this consumer can take. Each is dead-lettered at once
/// with [`Malformed::reason`] in the `x-sagabox-dead-reason` header.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Malformed {
    /// No message id (AMQP's `message_id` property, NATS's `Nats-Msg-Id` header): the inbox has nothing stable to deduplicate on.
    #[error(
        "the message has no message id (AMQP message_id property, NATS Nats-Msg-Id header); publish it with a stable id"
    )]
    MissingMessageId,
    /// The message id is empty, too long or holds control characters.
    #[error("the message id is not valid: {0}")]
    InvalidMessageId(KeyError),
    /// The body is not the JSON envelope `{"kind", "saga_id"?, "payload"}`.
    #[error("the body is not a sagabox envelope (JSON with kind and payload): {0}")]
    NotAnEnvelope(String),
    /// The kind is not one this consumer handles.
    #[error("unknown message kind {kind:?}; this consumer takes {expected}")]
    UnknownKind {
        /// The kind in the message.
        kind: String,
        /// The kinds the consumer takes, listed.
        expected: String,
    },
}

impl Malformed {
    /// The reason written to the dead-letter header and metrics.
    pub fn reason(&self) -> DeadReason {
        match self {
            Malformed::MissingMessageId => DeadReason::MissingMessageId,
            Malformed::InvalidMessageId(_) => DeadReason::InvalidMessageId,
            Malformed::NotAnEnvelope(_) => DeadReason::NotAnEnvelope,
            Malformed::UnknownKind { .. } => DeadReason::UnknownKind,
        }
    }
}

/// The JSON body of `envelope` (everything but its id and publish time).
pub fn encode_body(envelope: &Envelope) -> Vec<u8> {
    let body = Body {
        kind: envelope.kind.clone(),
        saga_id: envelope.saga_id.clone(),
        payload: envelope.payload.clone(),
        headers: envelope.headers.clone(),
    };
    // Serialising a struct of strings and a JSON value cannot fail.
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The envelope with message id `id` and body `data`, checked against the kinds the
/// consumer takes (an empty set takes every kind). Its publish time is the transport's
/// to set.
pub fn decode_body(
    id: Option<&str>,
    data: &[u8],
    kinds: &BTreeSet<String>,
) -> Result<Envelope, Malformed> {
    let id = MessageId::new(id.ok_or(Malformed::MissingMessageId)?)
        .map_err(Malformed::InvalidMessageId)?;
    let body: Body = serde_json::from_slice(data)
        .map_err(|error| Malformed::NotAnEnvelope(error.to_string()))?;
    let mut envelope = Envelope::new(id, body.kind, body.payload)
        .map_err(|error| Malformed::NotAnEnvelope(error.to_string()))?;
    if !kinds.is_empty() && !kinds.contains(&envelope.kind) {
        return Err(Malformed::UnknownKind {
            kind: envelope.kind,
            expected: kinds.iter().cloned().collect::<Vec<_>>().join(", "),
        });
    }
    envelope.saga_id = body.saga_id;
    envelope.headers = body.headers;
    Ok(envelope)
}
