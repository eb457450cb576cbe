//! What travels between saga participants: the [`Envelope`] and the validated keys
//! ([`MessageId`], [`ConsumerType`]) the inbox deduplicates on.
//!
//! Keys are checked once, in their constructors, so every other part of the crate can
//! rely on them: a key is never empty, never longer than [`MAX_KEY_BYTES`], and never
//! contains NUL or other control characters (which would break log lines, AMQP
//! properties and the lock key the PostgreSQL store derives from them).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The longest key, in bytes of UTF-8, that [`MessageId`] and [`ConsumerType`] accept.
pub const MAX_KEY_BYTES: usize = 255;

/// Why a [`MessageId`], [`ConsumerType`] or message kind was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The value was empty.
    #[error("{what} is empty: give every message a stable, non-empty value")]
    Empty {
        /// Which key was refused (`message id`, `consumer type`, `message kind`).
        what: &'static str,
    },
    /// The value was longer than [`MAX_KEY_BYTES`].
    #[error("{what} is {len} bytes long, the limit is {max} bytes: use a shorter stable id (a UUID is 36)", max = MAX_KEY_BYTES)]
    TooLong {
        /// Which key was refused.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// The value contained NUL or another control character.
    #[error(
        "{what} contains the control character {character:?} at byte {position}: keys must be printable text"
    )]
    ControlCharacter {
        /// Which key was refused.
        what: &'static str,
        /// The offending character.
        character: char,
        /// Its byte offset in the value.
        position: usize,
    },
}

/// The key rules, for text that is not a newtype (message kinds, saga step names):
/// non-empty, at most [`MAX_KEY_BYTES`] bytes, no control characters.
pub(crate) fn validate_key(what: &'static str, value: &str) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty { what });
    }
    if value.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong {
            what,
            len: value.len(),
        });
    }
    if let Some((position, character)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(KeyError::ControlCharacter {
            what,
            character,
            position,
        });
    }
    Ok(())
}

macro_rules! validated_key {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Validates `value`: non-empty, at most [`MAX_KEY_BYTES`] bytes, no control
            /// characters.
            pub fn new(value: impl Into<String>) -> Result<Self, KeyError> {
                let value = value.into();
                validate_key($what, &value)?;
                Ok(Self(value))
            }

            /// The key as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }

        impl FromStr for $name {
            type Err = KeyError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = KeyError;
            fn try_from(value: String) -> Result<Self, Self::Error> {
                Self::new(value)
            }
        }

        impl TryFrom<&str> for $name {
            type Error = KeyError;
            fn try_from(value: &str) -> Result<Self, Self::Error> {
                Self::new(value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

validated_key!(
    /// The stable identity of one message, set once by its publisher and carried unchanged
    /// by every redelivery (the AMQP `message_id`, the SQS `MessageId`, an outbox row's
    /// UUID). Never a delivery tag.
    ///
    /// A UUIDv7 id also tells the inbox when the message was created (see
    /// [`Envelope::dedup_time`]), which keeps the claim on its fast path: one partition.
    MessageId,
    "message id"
);

validated_key!(
    /// The name of a consumer (a saga step such as `payment`): the inbox deduplicates per
    /// `(consumer_type, message_id)`, so two consumers of one message each apply it once.
    ConsumerType,
    "consumer type"
);

impl MessageId {
    /// A new UUIDv7 id: unique, time-ordered, and carrying its creation time.
    pub fn new_v7() -> Self {
        Self(Uuid::now_v7().to_string())
    }

    /// A UUIDv7 id whose time is `at` and whose other bits are a hash of `name`: the same
    /// `(at, name)` always gives the same id, so every retry or redelivery of a derived
    /// message is the same message to the inbox, and its time places it in `at`'s month.
    pub fn derive_v7(at: DateTime<Utc>, name: &str) -> Self {
        let mut bytes = *Uuid::new_v5(&Uuid::NAMESPACE_OID, name.as_bytes()).as_bytes();
        let millis = u64::try_from(at.timestamp_millis()).unwrap_or(0);
        bytes[..6].copy_from_slice(&millis.to_be_bytes()[2..]);
        bytes[6] = (bytes[6] & 0x0f) | 0x70;
        bytes[8] = (bytes[8] & 0x3f) | 0x80;
        Self(Uuid::from_bytes(bytes).to_string())
    }

    /// The id of a message derived from this one (a reply, say) under `label`: stable,
    /// distinct per label, and a UUIDv7 at this id's time when this id has one (else a
    /// UUIDv5, which the inbox places by its slower, time-less path).
    pub fn derived(&self, label: &str) -> Self {
        let name = format!("{}\u{1f}{label}", self.0);
        match self.uuid_v7_time() {
            Some(at) => Self::derive_v7(at, &name),
            None => Self(Uuid::new_v5(&Uuid::NAMESPACE_OID, name.as_bytes()).to_string()),
        }
    }

    /// The creation time inside the id when it is a UUIDv7, else `None`.
    pub fn uuid_v7_time(&self) -> Option<DateTime<Utc>> {
        let uuid = Uuid::parse_str(&self.0).ok()?;
        if uuid.get_version_num() != 7 {
            return None;
        }
        let (secs, nanos) = uuid.get_timestamp()?.to_unix();
        Utc.timestamp_opt(i64::try_from(secs).ok()?, nanos).single()
    }
}

/// One message as it travels: a stable id, a kind that says what it asks for, the saga
/// it belongs to, a JSON payload, when it was published, and free-form headers.
///
/// ```
/// use sagabox::{Envelope, MessageId};
/// let envelope = Envelope::new(MessageId::new("order-42/charge")?, "charge", serde_json::json!({"cents": 4200}))?;
/// let text = serde_json::to_string(&envelope)?;
/// assert_eq!(serde_json::from_str::<Envelope>(&text)?, envelope);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// The stable message id the inbox deduplicates on.
    pub id: MessageId,
    /// What the message asks for (`charge`, `refund`, …); never empty.
    #[serde(deserialize_with = "deserialize_kind")]
    pub kind: String,
    /// The saga instance this message belongs to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saga_id: Option<String>,
    /// The message body.
    #[serde(default)]
    pub payload: serde_json::Value,
    /// When the publisher created the message. It must be stable across redeliveries
    /// (set once at publish time); `None` when the publisher did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published_at: Option<DateTime<Utc>>,
    /// Free-form headers (tracing context, content type, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

fn deserialize_kind<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let kind = String::deserialize(deserializer)?;
    validate_key("message kind", &kind).map_err(serde::de::Error::custom)?;
    Ok(kind)
}

impl Envelope {
    /// An envelope with no saga, no publish time and no headers. The kind is validated
    /// like a key (non-empty, at most [`MAX_KEY_BYTES`] bytes, no control characters).
    pub fn new(
        id: MessageId,
        kind: impl Into<String>,
        payload: serde_json::Value,
    ) -> Result<Self, KeyError> {
        let kind = kind.into();
        validate_key("message kind", &kind)?;
        Ok(Self {
            id,
            kind,
            saga_id: None,
            payload,
            published_at: None,
            headers: BTreeMap::new(),
        })
    }

    /// A copy of everything but the payload: what a reply is built from, without the
    /// cost of copying a command's body.
    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    pub(crate) fn without_payload(&self) -> Envelope {
        Envelope {
            id: self.id.clone(),
            kind: self.kind.clone(),
            saga_id: self.saga_id.clone(),
            payload: serde_json::Value::Null,
            published_at: self.published_at,
            headers: self.headers.clone(),
        }
    }

    /// Sets the saga this message belongs to.
    pub fn with_saga_id(mut self, saga_id: impl Into<String>) -> Self {
        self.saga_id = Some(saga_id.into());
        self
    }

    /// Sets the publish time. It must be the same on every redelivery.
    pub fn with_published_at(mut self, published_at: DateTime<Utc>) -> Self {
        self.published_at = Some(published_at);
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The time the inbox files this message under (its partition month, and the time
    /// its expiry is measured from): the timestamp inside a UUIDv7 id (part of the
    /// identity itself, so it cannot drift between deliveries), else the publish time,
    /// else `None`. See [`InboxConfig::trust_publish_time`](crate::InboxConfig) for when
    /// a publish time alone keeps the claim on its fast path.
    pub fn dedup_time(&self) -> Option<DateTime<Utc>> {
        self.id.uuid_v7_time().or(self.published_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_refuse_bad_input() {
        assert_eq!(
            MessageId::new(""),
            Err(KeyError::Empty { what: "message id" })
        );
        assert_eq!(
            ConsumerType::new("x".repeat(256)),
            Err(KeyError::TooLong {
                what: "consumer type",
                len: 256
            })
        );
        assert!(matches!(
            MessageId::new("a\0b"),
            Err(KeyError::ControlCharacter { position: 1, .. })
        ));
        assert!(MessageId::new("x".repeat(255)).is_ok());
        assert!(MessageId::new("'); DROP TABLE inbox;--").is_ok());
    }

    #[test]
    fn too_long_counts_bytes_not_chars() {
        // 128 two-byte characters: 128 chars but 256 bytes.
        assert!(matches!(
            MessageId::new("é".repeat(128)),
            Err(KeyError::TooLong { len: 256, .. })
        ));
    }

    #[test]
    fn deserialization_validates() {
        let bad = r#"{"id": "", "kind": "charge", "payload": null}"#;
        let err = serde_json::from_str::<Envelope>(bad).unwrap_err();
        assert!(err.to_string().contains("message id is empty"), "{err}");
        let bad_kind = r#"{"id": "m1", "kind": "", "payload": null}"#;
        assert!(serde_json::from_str::<Envelope>(bad_kind).is_err());
    }

    #[test]
    fn dedup_time_prefers_the_uuid_v7_timestamp() {
        let published = Utc.with_ymd_and_hms(2026, 11, 30, 23, 59, 59).unwrap();
        let plain = Envelope::new(MessageId::new("m1").unwrap(), "k", serde_json::Value::Null)
            .unwrap()
            .with_published_at(published);
        assert_eq!(plain.dedup_time(), Some(published));

        let v7 = MessageId::new_v7();
        let created = v7.uuid_v7_time().unwrap();
        assert!((Utc::now() - created).num_seconds().abs() < 5);
        let enveloped = Envelope::new(v7, "k", serde_json::Value::Null)
            .unwrap()
            .with_published_at(published);
        assert_eq!(enveloped.dedup_time(), Some(created));

        let v4 = MessageId::new(Uuid::new_v4().to_string()).unwrap();
        assert_eq!(v4.uuid_v7_time(), None);
    }
}
