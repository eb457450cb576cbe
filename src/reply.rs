//! A step's reply, on any transport: [`reply_envelope`] builds it with a stable id
//! derived from the command's, and the dispatch's waiters get each reply to whoever
//! waits for its command.
//!
//! The reply's id is derived from the command's ([`MessageId::derived`]), so a command
//! redelivered after a crash produces the same reply message, and its answer is the
//! step's inbox record, so every copy of a reply says the same. Replies therefore pass
//! no inbox of their own: the saga's row is the orchestrator's record of them. A reply
//! is applied by the driver that waits for its command, in the saga's save, whose
//! version check lets one answer per attempt through; a copy that comes when nobody
//! waits is dropped, and one that answers a resend of the same command says what the
//! first said.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::delivery::Disposition;
use crate::envelope::{Envelope, MessageId};
use crate::step::{StepFailure, StepOutcome, StepPool, StepReply};
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

/// Hands a reply's answer to whoever waits for its command; a reply nobody waits for
/// (its saga moved on, or its waiter gave up) is dropped. Settles it as done, or
/// dead-letters a payload that is not a step reply.
pub(crate) fn take_reply(waiters: &Waiters, reply: &Envelope) -> Disposition {
    let Some((command_id, answer)) = read_reply(&reply.payload) else {
        return Disposition::Reject(format!(
            "the reply's payload is not a step reply (command_id, outcome, duplicate): {}",
            reply.payload
        ));
    };
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

    #[tokio::test]
    async fn a_reply_answers_every_send_of_its_command_and_a_late_copy_nobody() {
        let waiters = Waiters::default();
        let command = Envelope::new(MessageId::new_v7(), "charge", json!({})).unwrap();
        let (first, second) = (waiters.register(&command.id), waiters.register(&command.id));
        let answer = StepReply {
            outcome: StepOutcome::Done(json!({"charged": 700})),
            duplicate: false,
        };
        let reply = reply_envelope(&command, &answer);
        assert_eq!(
            take_reply(&waiters, &reply),
            Disposition::Done { reply: None }
        );
        assert_eq!(first.await.unwrap(), answer);
        assert_eq!(second.await.unwrap(), answer);
        // A second copy of the reply: nobody waits any more, it is settled and dropped.
        assert_eq!(
            take_reply(&waiters, &reply),
            Disposition::Done { reply: None }
        );
        assert!(waiters.0.lock().unwrap().is_empty());
    }

    #[test]
    fn a_reply_that_is_not_a_step_reply_is_dead_lettered() {
        let waiters = Waiters::default();
        let reply = Envelope::new(MessageId::new_v7(), REPLY_KIND, json!({"charged": 1})).unwrap();
        assert!(matches!(
            take_reply(&waiters, &reply),
            Disposition::Reject(reason) if reason.contains("not a step reply")
        ));
    }
}
