//! The stalled-consumer watchdog: a JetStream cluster can leave a durable consumer
//! believing it has nothing to deliver while its work stream holds messages stored after
//! the last one it delivered. Seen on a three-node cluster (nats-server 2.9) after the
//! stream's or the consumer's leader was killed: the consumer reported `num_pending` 0,
//! the stream kept the messages, and neither a new pull nor a new client changed it; a
//! step-down of the consumer's leader did, the new leader delivering them at once.
//!
//! [`watch`] reads both states every [`CHECK_EVERY`] and, when the consumer has been
//! stalled so for two checks in a row (its delivered sequence unchanged, nothing pending
//! or awaiting an ack, the stream's last message past what it delivered), asks the
//! consumer's leader to step down. A false alarm costs one election, a pause of a
//! second or two; nothing is delivered twice by it that ack-after-commit does not already
//! absorb.

use std::time::Duration;

use async_nats::Client;
use serde_json::Value;

/// How often the watchdog compares the consumer with its stream.
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(10);

/// What one check read: the consumer's delivered stream sequence, and whether it was
/// stalled with messages past it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reading {
    delivered: u64,
    stalled: bool,
}

impl Reading {
    /// The reading of a stream's and its consumer's info, as the JetStream API answers
    /// them (`$JS.API.STREAM.INFO`, `$JS.API.CONSUMER.INFO`); `None` when either is an
    /// error or lacks a field.
    pub(crate) fn of(stream: &Value, consumer: &Value) -> Option<Self> {
        let number = |value: &Value, path: &[&str]| {
            path.iter()
                .try_fold(value, |value, key| value.get(key))
                .and_then(Value::as_u64)
        };
        let messages = number(stream, &["state", "messages"])?;
        let last = number(stream, &["state", "last_seq"])?;
        let delivered = number(consumer, &["delivered", "stream_seq"])?;
        let pending = number(consumer, &["num_pending"])?;
        let awaiting_ack = number(consumer, &["num_ack_pending"])?;
        Some(Self {
            delivered,
            stalled: pending == 0 && awaiting_ack == 0 && messages > 0 && last > delivered,
        })
    }

    /// Whether this reading, after `previous`, calls for a step-down: stalled both times
    /// at the same delivered sequence.
    pub(crate) fn confirms(&self, previous: Option<Reading>) -> bool {
        self.stalled && previous == Some(*self)
    }
}

/// Watches the durable consumer `consumer` of `stream` through `client` until the task
/// is aborted (with the subscription it watches).
pub(crate) async fn watch(client: Client, stream: String, consumer: String) {
    let mut previous = None;
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.tick().await;
    loop {
        tick.tick().await;
        let stream_info = request(&client, format!("$JS.API.STREAM.INFO.{stream}")).await;
        let consumer_info = request(
            &client,
            format!("$JS.API.CONSUMER.INFO.{stream}.{consumer}"),
        )
        .await;
        let reading = match (stream_info, consumer_info) {
            (Some(stream), Some(consumer)) => Reading::of(&stream, &consumer),
            _ => None,
        };
        let Some(reading) = reading else {
            previous = None;
            continue;
        };
        if reading.confirms(previous) {
            tracing::warn!(
                stream,
                delivered = reading.delivered,
                "the JetStream consumer reports nothing pending while its stream holds \
                 messages past the last it delivered; asking its leader to step down"
            );
            request(
                &client,
                format!("$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}"),
            )
            .await;
            previous = None;
        } else {
            previous = Some(reading);
        }
    }
}

/// The JSON answer to a JetStream API request, `None` when it failed or is an error.
async fn request(client: &Client, subject: String) -> Option<Value> {
    let answer = client.request(subject, "".into()).await.ok()?;
    let value: Value = serde_json::from_slice(&answer.payload).ok()?;
    value.get("error").is_none().then_some(value)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn stream(messages: u64, last_seq: u64) -> Value {
        json!({ "state": { "messages": messages, "last_seq": last_seq } })
    }

    fn consumer(delivered: u64, pending: u64, awaiting_ack: u64) -> Value {
        json!({
            "delivered": { "stream_seq": delivered },
            "num_pending": pending,
            "num_ack_pending": awaiting_ack,
        })
    }

    #[test]
    fn a_consumer_behind_its_stream_with_nothing_pending_is_stalled() {
        let stalled = Reading::of(&stream(34, 609), &consumer(575, 0, 0)).unwrap();
        assert!(stalled.stalled);
        assert!(!stalled.confirms(None), "one reading is not enough");
        assert!(stalled.confirms(Some(stalled)));
    }

    #[test]
    fn a_consumer_at_work_or_caught_up_is_not() {
        for (stream, consumer) in [
            // Pending messages: it is delivering them.
            (stream(34, 609), consumer(575, 34, 0)),
            // Awaiting acks: handlers are at work.
            (stream(34, 609), consumer(575, 0, 3)),
            // Caught up: what is left lies below its delivered sequence.
            (stream(5, 575), consumer(575, 0, 0)),
            // Empty.
            (stream(0, 609), consumer(575, 0, 0)),
        ] {
            let reading = Reading::of(&stream, &consumer).unwrap();
            assert!(!reading.confirms(Some(reading)), "{stream} {consumer}");
        }
    }

    #[test]
    fn progress_between_readings_is_not_a_stall() {
        let before = Reading::of(&stream(34, 609), &consumer(570, 0, 0)).unwrap();
        let after = Reading::of(&stream(34, 609), &consumer(575, 0, 0)).unwrap();
        assert!(!after.confirms(Some(before)));
    }

    #[test]
    fn an_error_answer_is_no_reading() {
        assert_eq!(
            Reading::of(&json!({ "error": { "code": 404 } }), &consumer(1, 0, 0)),
            None
        );
    }
}
