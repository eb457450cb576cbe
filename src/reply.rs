//! A step's reply, on any transport: [`reply_envelope`] builds it with a stable id
//! derived from the command's, and the dispatch's waiters get each reply that passed the
//! orchestrator's inbox to whoever waits for its command.
//!
//! The reply's id is derived from the command's ([`MessageId::derived`]), so a command
//! redelivered after a crash produces the same reply message; replies pass the
//! orchestrator's own inbox, which answers a repeated reply with the first one's record.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::delivery::Disposition;
use crate::envelope::{ConsumerType, Envelope, MessageId};
use crate::inbox::{GuardError, InboxGuard, Outcome};
use crate::step::{StepFailure, StepOutcome, StepPool, StepReply};
use crate::store::InboxStore;
use crate::trace;

/// The kind of a step's reply message.
pub const REPLY_KIND: &str = "step_reply";

/// The reply to `command`: a stable id derived from the command's, the step's answer
/// and the command id it answers, in the payload. It carries the current span's trace
/// context (the consumer's, when called from a handler), else the command's, so the
/// reply stays in the saga's trace either way.
pub fn reply_envelope(command: &Envelope, reply: &StepReply) -> Envelope {
    let mut envelope = reply_in_context(command, reply);
    trace::inject_current(&mut envelope.headers);
    envelope
}

/// [`reply_envelope`] with the command's own trace context only: for a batch, which runs
/// in one delivery's task on behalf of all of them.
fn reply_in_context(command: &Envelope, reply: &StepReply) -> Envelope {
    let payload = json!({
        "command_id": command.id.as_str(),
        "outcome": reply.outcome.to_record(),
        "duplicate": reply.duplicate,
    });
    let headers: std::collections::BTreeMap<String, String> = command
        .headers
        .iter()
        .filter(|(name, _)| [trace::TRACEPARENT, trace::TRACESTATE].contains(&name.as_str()))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    Envelope {
        id: command.id.derived("reply"),
        kind: REPLY_KIND.to_owned(),
        saga_id: command.saga_id.clone(),
        payload,
        published_at: None,
        headers,
    }
}

/// The command id and answer in a reply's payload.
fn read_reply(payload: &Value) -> Option<(String, StepReply)> {
    let command_id = payload.get("command_id")?.as_str()?.to_owned();
    let outcome = StepOutcome::from_record(payload.get("outcome")?);
    let duplicate = payload.get("duplicate")?.as_bool()?;
    Some((command_id, StepReply { outcome, duplicate }))
}

/// Runs `command` through `pool`, waiting up to `timeout`, and says how to settle it:
/// done with its reply, dead-lettered when refused by the inbox, retried otherwise.
pub(crate) async fn step_disposition(
    pool: &StepPool,
    command: Envelope,
    timeout: Duration,
) -> Disposition {
    // The reply needs the command's id, saga and headers, not its payload.
    let head = command.without_payload();
    match pool.deliver(command, timeout).await {
        Ok(reply) => Disposition::Done {
            reply: Some(reply_envelope(&head, &reply)),
        },
        Err(StepFailure::Rejected(reason)) => Disposition::Reject(reason),
        Err(failure) => Disposition::Retry(failure.to_string()),
    }
}

/// Runs `commands` as one batch through `pool` (one transaction), waiting up to
/// `timeout`, and settles each by its own answer: done with its reply, dead-lettered
/// when refused by the inbox, retried otherwise; a batch that failed as a whole retries
/// every command.
pub(crate) async fn batch_dispositions(
    pool: &StepPool,
    commands: Vec<Envelope>,
    timeout: Duration,
) -> Vec<Disposition> {
    match pool.deliver_batch(commands.clone(), timeout).await {
        Ok(answers) => commands
            .iter()
            .zip(answers)
            .map(|(command, answer)| match answer {
                Ok(reply) => Disposition::Done {
                    reply: Some(reply_in_context(command, &reply)),
                },
                Err(StepFailure::Rejected(reason)) => Disposition::Reject(reason),
                Err(failure) => Disposition::Retry(failure.to_string()),
            })
            .collect(),
        Err(failure) => commands
            .iter()
            .map(|_| Disposition::Retry(failure.to_string()))
            .collect(),
    }
}

/// The senders waiting for the reply to each command id.
#[derive(Debug, Clone, Default)]
pub(crate) struct Waiters(Arc<Mutex<HashMap<String, Vec<oneshot::Sender<StepReply>>>>>);

impl Waiters {
    /// Waits for the reply to `id`: several sends of one command each get it.
    pub(crate) fn register(&self, id: &MessageId) -> oneshot::Receiver<StepReply> {
        let (sender, receiver) = oneshot::channel();
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(id.as_str().to_owned())
            .or_default()
            .push(sender);
        receiver
    }

    /// Drops the waiters of `id` whose receivers are gone (this send's, once it gave
    /// up), keeping those of concurrent sends of the same command.
    pub(crate) fn forget(&self, id: &MessageId) {
        let mut waiters = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(senders) = waiters.get_mut(id.as_str()) {
            senders.retain(|sender| !sender.is_closed());
            if senders.is_empty() {
                waiters.remove(id.as_str());
            }
        }
    }

    /// A dispatch on any broker: sends `command` with `send` (in the caller's span,
    /// whose trace context the command carries) and waits up to `timeout` for the reply
    /// to its id. A send that fails is retryable; no reply in time is a timeout.
    pub(crate) async fn send_and_wait<E, F>(
        &self,
        mut command: Envelope,
        timeout: Duration,
        send: impl FnOnce(Envelope) -> F,
    ) -> Result<StepReply, StepFailure>
    where
        E: std::fmt::Display,
        F: Future<Output = Result<(), E>>,
    {
        // The orchestrator calls this inside its `saga.step` span: the step's span in the
        // other process becomes that span's child.
        trace::inject_current(&mut command.headers);
        let id = command.id.clone();
        let receiver = self.register(&id);
        if let Err(error) = send(command).await {
            drop(receiver);
            self.forget(&id);
            return Err(StepFailure::Retryable(error.to_string()));
        }
        match tokio::time::timeout(timeout, receiver).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(StepFailure::Retryable(
                "the reply waiter was dropped before a reply came".into(),
            )),
            Err(_) => {
                self.forget(&id);
                Err(StepFailure::Timeout(timeout))
            }
        }
    }

    fn answer(&self, command_id: &str, answer: &StepReply) {
        let waiting = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(command_id);
        for waiter in waiting.into_iter().flatten() {
            let _ = waiter.send(answer.clone());
        }
    }
}

/// Passes a reply through the orchestrator's inbox and hands the (first) answer to
/// whoever waits for its command.
pub(crate) async fn take_reply<S: InboxStore>(
    guard: &InboxGuard<S>,
    consumer_type: &ConsumerType,
    waiters: &Waiters,
    reply: Envelope,
) -> Disposition {
    let processed = guard
        .process(consumer_type, &reply, async |_conn, reply| {
            Ok::<_, Infallible>(reply.payload.clone())
        })
        .await;
    // A repeated reply carries the first reply's answer (the inbox record); whether the
    // step saw this delivery as a duplicate is this reply's own news.
    let (record, this_duplicate) = match processed {
        Ok(Outcome::Applied(record)) => (record, None),
        Ok(Outcome::Duplicate { result, .. }) => (
            result,
            reply.payload.get("duplicate").and_then(Value::as_bool),
        ),
        Err(GuardError::Inbox(error)) if error.is_retryable() => {
            return Disposition::Retry(error.to_string());
        }
        Err(error) => return Disposition::Reject(error.to_string()),
    };
    let Some((command_id, mut answer)) = read_reply(&record) else {
        return Disposition::Reject(format!(
            "the reply's payload is not a step reply (command_id, outcome, duplicate): {record}"
        ));
    };
    if let Some(duplicate) = this_duplicate {
        answer.duplicate = duplicate;
    }
    waiters.answer(&command_id, &answer);
    Disposition::Done { reply: None }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_has_a_stable_id_and_round_trips() {
        let command = Envelope::new(MessageId::new_v7(), "charge", json!({})).unwrap();
        let reply = StepReply {
            outcome: StepOutcome::Refused("declined".into()),
            duplicate: true,
        };
        let first = reply_envelope(&command, &reply);
        let again = reply_envelope(&command, &reply);
        assert_eq!(first.id, again.id);
        assert_ne!(first.id, command.id);
        assert_eq!(first.id.uuid_v7_time(), command.id.uuid_v7_time());
        let (command_id, read) = read_reply(&first.payload).unwrap();
        assert_eq!(command_id, command.id.as_str());
        assert_eq!(read, reply);
    }
}
