//! [`DeadLetterStream`]: the dead letters of a JetStream subject — the stream on
//! `<subject>.dead` — behind [`DeadLetters`](crate::dlq::DeadLetters).
//!
//! The dead-letter stream keeps its messages until an operator takes them, so a listing
//! reads them by sequence number and takes none, and a replay deletes from the stream
//! exactly the ones it republished, each after JetStream acknowledged its copy: the
//! others keep their place and their order. A replayed copy goes out under a fresh
//! `Nats-Msg-Id` with the message id in `x-sagabox-message-id`, which the consumer reads
//! first ([`codec`](super::codec)): under its old `Nats-Msg-Id` the work stream's
//! duplicate window could drop it as the message it once was. A replay considers only
//! the letters in the stream when it starts, so one the consumer dead-letters again is
//! not replayed a second time by the same call.

use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use async_nats::jetstream::{Context, ErrorCode};
use async_nats::{Client, HeaderMap};
use chrono::{DateTime, Utc};

use super::codec::{MESSAGE_ID_HEADER, PUBLISHED_AT_HEADER, header};
use super::config::{NatsConfig, NatsError, stream_name};
use super::jetstream;
use crate::dead_reason::{DEAD_DETAIL_HEADER, DEAD_REASON_HEADER};
use crate::delivery::ATTEMPTS_HEADER;
use crate::dlq::{
    DeadLetter, DeadLetterList, DlqError, REPLAYED_HEADER, ReplayOptions, ReplayReport, queue_names,
};
use crate::logging::redact;

/// The broker's name in errors.
const BROKER: &str = "NATS JetStream";

/// A connection to NATS, for reading and replaying one subject's dead letters.
#[derive(Debug)]
pub struct DeadLetterStream {
    client: Client,
    context: Context,
    url: String,
    /// The subject the letters came from, and where a replay publishes them.
    source: String,
    /// The dead-letter subject.
    dead: String,
}

impl DeadLetterStream {
    /// Connects to the server in `config` (only its URL matters) and checks that the
    /// dead-letter stream of `queue` exists. `queue` is the source subject, such as
    /// `sagabox.payment`, or the dead-letter subject (see [`queue_names`]).
    pub async fn open(config: &NatsConfig, queue: &str) -> Result<Self, DlqError> {
        let (source, dead) = queue_names(queue)?;
        check_subject(queue, &source)?;
        config.validate()?;
        let client = jetstream::connect(config, &format!("dlq {source}")).await?;
        let opened = Self {
            context: jetstream::context(&client),
            client,
            url: redact(&config.url),
            source,
            dead,
        };
        opened.stream(&opened.dead).await?;
        Ok(opened)
    }

    /// The source subject: where a replay sends the letters.
    pub fn source_subject(&self) -> &str {
        &self.source
    }

    /// The dead-letter subject.
    pub fn dead_subject(&self) -> &str {
        &self.dead
    }

    /// Dead letters in the stream.
    pub async fn count(&self) -> Result<u32, DlqError> {
        let stream = self.stream(&self.dead).await?;
        Ok(saturating_u32(stream.cached_info().state.messages))
    }

    /// Shows up to `limit` dead letters (all of them with `None`), oldest first. Nothing
    /// is taken: the stream is read by sequence number.
    pub async fn list(&self, limit: Option<usize>) -> Result<DeadLetterList, DlqError> {
        let stream = self.stream(&self.dead).await?;
        let state = &stream.cached_info().state;
        let (total, last) = (saturating_u32(state.messages), state.last_sequence);
        let now = Utc::now();
        let mut messages = Vec::new();
        let mut next = state.first_sequence;
        while messages.len() < limit.unwrap_or(usize::MAX) {
            let Some(message) = self.read_from(&stream, next, last).await? else {
                break;
            };
            next = message.sequence + 1;
            messages.push(read_letter(&message, now));
        }
        Ok(DeadLetterList {
            queue: self.dead.clone(),
            source_queue: self.source.clone(),
            total,
            messages,
        })
    }

    /// Republishes the dead letters `options` selects to the source subject: the body
    /// and headers unchanged but for the dead-letter reason, detail and attempt count
    /// (dropped), `x-sagabox-replayed` (one more) and a fresh `Nats-Msg-Id` (the id kept
    /// in `x-sagabox-message-id`). Each is deleted from the dead-letter stream once
    /// JetStream acknowledged its copy; the others stay untouched.
    ///
    /// The source subject's stream must exist ([`DlqError::QueueNotFound`] otherwise,
    /// before anything is read).
    pub async fn replay(&self, options: &ReplayOptions) -> Result<ReplayReport, DlqError> {
        self.stream(&self.source).await?;
        let stream = self.stream(&self.dead).await?;
        let last = stream.cached_info().state.last_sequence;
        let now = Utc::now();
        let mut replayed = Vec::new();
        let mut next = stream.cached_info().state.first_sequence;
        let run = async {
            while options.limit.is_none_or(|limit| replayed.len() < limit) {
                let Some(message) = self.read_from(&stream, next, last).await? else {
                    break;
                };
                next = message.sequence + 1;
                let letter = read_letter(&message, now);
                if !options.matches(&letter) {
                    continue;
                }
                // A failure from here leaves the letter in the dead-letter stream; if
                // its copy was stored, the inbox absorbs the second replay.
                jetstream::publish(
                    &self.context,
                    &self.source,
                    replay_headers(&message.headers),
                    message.payload.to_vec(),
                )
                .await?;
                stream
                    .delete_message(message.sequence)
                    .await
                    .map_err(NatsError::broker("delete the replayed dead letter"))?;
                replayed.push(letter);
            }
            Ok::<_, DlqError>(())
        }
        .await;
        run.map_err(|source| source.after_replaying(&self.dead, &self.source, replayed.len()))?;
        Ok(ReplayReport {
            queue: self.dead.clone(),
            source_queue: self.source.clone(),
            reason: options.reason.map(|reason| reason.as_str().to_owned()),
            replayed: replayed.len(),
            left: self.count().await?,
            messages: replayed,
        })
    }

    /// Closes the connection.
    pub async fn close(self) {
        let _ = self.client.drain().await;
    }

    /// The stream on `subject`, fresh from the server, or [`DlqError::QueueNotFound`].
    async fn stream(&self, subject: &str) -> Result<Stream, DlqError> {
        let name = stream_name(subject);
        match self.context.get_stream(&name).await {
            Ok(stream) => Ok(stream),
            Err(error)
                if matches!(error.kind(), GetStreamErrorKind::JetStream(ref js)
                    if js.error_code() == ErrorCode::STREAM_NOT_FOUND) =>
            {
                Err(DlqError::QueueNotFound {
                    broker: BROKER,
                    what: "stream",
                    queue: format!("{name} (subject {subject})"),
                    url: self.url.clone(),
                })
            }
            Err(error) => Err(NatsError::broker("look up the stream")(error).into()),
        }
    }

    /// The first letter at sequence `from` or later, up to `last` (the stream's last
    /// sequence when the call started); `None` past it.
    async fn read_from(
        &self,
        stream: &Stream,
        from: u64,
        last: u64,
    ) -> Result<Option<StreamMessage>, DlqError> {
        if from > last || from == 0 {
            return Ok(None);
        }
        match stream
            .get_first_raw_message_by_subject(&self.dead, from)
            .await
        {
            Ok(message) if message.sequence <= last => Ok(Some(message)),
            Ok(_) => Ok(None),
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(error) => Err(NatsError::broker("read the dead-letter stream")(error).into()),
        }
    }
}

/// Refuses a name that cannot be a NATS subject naming a stream.
fn check_subject(given: &str, subject: &str) -> Result<(), DlqError> {
    if jetstream::unfit_for_subject(subject) {
        return Err(DlqError::InvalidQueue {
            name: given.to_owned(),
            reason: "it cannot name a NATS subject: use letters, digits, '-', '_' and single dots"
                .to_owned(),
        });
    }
    Ok(())
}

/// What `message` says about itself, its age measured at `now`.
fn read_letter(message: &StreamMessage, now: DateTime<Utc>) -> DeadLetter {
    let headers = &message.headers;
    let published_at = header(headers, PUBLISHED_AT_HEADER)
        .and_then(|at| DateTime::parse_from_rfc3339(&at).ok())
        .map(|at| at.with_timezone(&Utc));
    DeadLetter {
        message_id: header(headers, MESSAGE_ID_HEADER)
            .or_else(|| header(headers, NATS_MESSAGE_ID.as_ref())),
        reason: header(headers, DEAD_REASON_HEADER),
        detail: header(headers, DEAD_DETAIL_HEADER),
        attempts: count(headers, ATTEMPTS_HEADER),
        replayed: count(headers, REPLAYED_HEADER),
        published_at,
        age_seconds: published_at.map(|at| u64::try_from((now - at).num_seconds()).unwrap_or(0)),
        ..DeadLetter::from_body(&message.payload)
    }
}

/// A header holding a count, if present and a number.
fn count(headers: &HeaderMap, name: &str) -> Option<u32> {
    header(headers, name).and_then(|value| value.trim().parse().ok())
}

/// The headers of a replayed copy: the letter's, without the dead-letter reason, detail
/// and attempt count, with one more replay counted, under a fresh `Nats-Msg-Id` and the
/// message id in `x-sagabox-message-id`.
fn replay_headers(old: &HeaderMap) -> HeaderMap {
    const DROPPED: [&str; 6] = [
        DEAD_REASON_HEADER,
        DEAD_DETAIL_HEADER,
        ATTEMPTS_HEADER,
        REPLAYED_HEADER,
        MESSAGE_ID_HEADER,
        "Nats-Msg-Id",
    ];
    let id = header(old, MESSAGE_ID_HEADER).or_else(|| header(old, NATS_MESSAGE_ID.as_ref()));
    let replays = count(old, REPLAYED_HEADER).unwrap_or(0).saturating_add(1);
    let mut headers = HeaderMap::new();
    for (name, values) in old.iter() {
        if DROPPED
            .iter()
            .any(|dropped| AsRef::<str>::as_ref(name) == *dropped)
        {
            continue;
        }
        for value in values {
            headers.append(name.clone(), value.clone());
        }
    }
    if let Some(id) = id {
        headers.insert(MESSAGE_ID_HEADER, id.as_str());
    }
    headers.insert(NATS_MESSAGE_ID, uuid::Uuid::new_v4().to_string().as_str());
    headers.insert(REPLAYED_HEADER, replays.to_string().as_str());
    headers
}

fn saturating_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replayed_copy_drops_the_dead_letter_headers_and_keeps_the_id_apart() {
        let mut headers = HeaderMap::new();
        headers.insert(NATS_MESSAGE_ID, "m-1");
        headers.insert(DEAD_REASON_HEADER, "rejected");
        headers.insert(DEAD_DETAIL_HEADER, "too old");
        headers.insert("traceparent", "00-abc");
        let first = replay_headers(&headers);
        assert_eq!(header(&first, MESSAGE_ID_HEADER).as_deref(), Some("m-1"));
        let fresh = header(&first, NATS_MESSAGE_ID.as_ref()).unwrap();
        assert_ne!(
            fresh, "m-1",
            "a fresh Nats-Msg-Id passes the duplicate window"
        );
        assert_eq!(header(&first, DEAD_REASON_HEADER), None);
        assert_eq!(header(&first, DEAD_DETAIL_HEADER), None);
        assert_eq!(header(&first, "traceparent").as_deref(), Some("00-abc"));
        assert_eq!(count(&first, REPLAYED_HEADER), Some(1));
        let second = replay_headers(&first);
        assert_eq!(header(&second, MESSAGE_ID_HEADER).as_deref(), Some("m-1"));
        assert_eq!(count(&second, REPLAYED_HEADER), Some(2));
    }

    #[test]
    fn a_name_that_cannot_be_a_subject_is_refused() {
        for bad in [
            "sagabox.*",
            "a b",
            "sagabox..payment",
            ".payment",
            "sagabox/payment",
        ] {
            let error = check_subject(bad, bad).unwrap_err();
            assert!(matches!(error, DlqError::InvalidQueue { .. }), "{error}");
        }
        assert!(check_subject("sagabox.payment", "sagabox.payment").is_ok());
    }
}
