//! The saga driver's decisions as a pure state machine: given a saga and its definition,
//! [`next`] says what to do (nothing, save a change, send a step's command), and
//! [`answer`] turns the reply to that command into the saga's next state. Neither does
//! I/O or reads a clock: the orchestrator's driver loop performs what they decide (saves,
//! sends, sleeps, metrics), so every rule of a saga's life is here, testable without a
//! database or a broker.
//!
//! Both change the [`SagaInstance`] in place and return the history events that led to
//! the change, which the driver saves with it. A change that moves the saga to another
//! step or direction starts that step's command at round 0 again
//! ([`SagaInstance::command_round`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;
use serde_json::{Value, json};

use crate::envelope::Envelope;
use crate::metrics::CompensationTrigger;
use crate::saga::{
    Direction, EventKind, SagaDefinition, SagaEvent, SagaInstance, SagaStatus, StepDefinition,
};
use crate::step::{StepFailure, StepOutcome, StepReply};

/// What the driver does next for a saga.
#[derive(Debug)]
pub(crate) enum Next<'d> {
    /// Nothing: the saga is finished, or parked for an operator.
    Idle,
    /// The saga changed in place: save it with the change's events, then ask again.
    Save(Change),
    /// Send this step's command and give its reply to [`answer`].
    Send(Command<'d>),
}

/// A change of a saga's state, to be saved with the events that led to it.
#[derive(Debug, Default)]
pub(crate) struct Change {
    /// The history's events, in order.
    pub events: Vec<SagaEvent>,
    /// The saga turned to compensate, for this reason.
    pub compensating: Option<CompensationTrigger>,
    /// The step's command is tried again after this delay (once the change is saved).
    pub backoff: Option<Duration>,
}

impl Change {
    /// A change with these events, no compensation and no backoff (a completion, a
    /// skipped undo, a park).
    pub(crate) fn of(events: Vec<SagaEvent>) -> Self {
        Self {
            events,
            ..Self::default()
        }
    }
}

/// One attempt of a step's command, as [`next`] decided it.
#[derive(Debug)]
pub(crate) struct Command<'d> {
    /// The step's index in the definition.
    pub index: usize,
    /// The step.
    pub step: &'d StepDefinition,
    /// The step itself or its compensation.
    pub direction: Direction,
    /// The command's kind: the step's command or its compensation.
    pub kind: &'d str,
    /// The attempt's number, from 1.
    pub attempt: i32,
    /// When it was decided: the time of the history's `sent` event.
    pub at: DateTime<Utc>,
}

impl Command<'_> {
    /// The message to send: the step's stable command id (the same on every attempt of
    /// a round), the saga's data as the payload, the saga's id.
    pub(crate) fn envelope(&self, saga: &SagaInstance) -> Envelope {
        match Envelope::new(
            saga.command_id(self.index, self.direction),
            self.kind,
            saga.data.clone(),
        ) {
            Ok(envelope) => envelope.with_saga_id(saga.id.clone()),
            Err(error) => unreachable!("kinds are validated with the definition: {error}"),
        }
    }
}

/// Whether parking a saga renews its step's command id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renew {
    /// The inbox recorded a refusal of the command: the next one gets a new id.
    Command,
    /// The command may have applied, or was never sent: it keeps its id.
    Nothing,
}

/// What to do next for `saga`, running `definition` (the version it started under), at
/// `now`. A finished or parked saga is left alone; a running saga past its deadline with
/// a step left is compensated from that step, or parked when the step has no
/// compensation; a saga past its last step (or, compensating, below its first) is
/// finished; a compensated step without compensation is skipped; otherwise the step's
/// command goes out, its attempt counted on `saga`.
pub(crate) fn next<'d>(
    saga: &mut SagaInstance,
    definition: &'d SagaDefinition,
    now: DateTime<Utc>,
) -> Next<'d> {
    if saga.status.is_terminal() || saga.parked.is_some() {
        return Next::Idle;
    }
    let from = position(saga);
    let steps = definition.steps();
    let index = usize::try_from(saga.current_step)
        .ok()
        .filter(|&i| i < steps.len());
    let next = match (saga.status, index) {
        (SagaStatus::Running, Some(i)) if saga.deadline_at.is_some_and(|at| at <= now) => {
            deadline_passed(saga, &steps[i], i, now)
        }
        (SagaStatus::Running, Some(i)) => {
            let kind = steps[i].command();
            return send(saga, &steps[i], i, (Direction::Forward, kind), now);
        }
        (SagaStatus::Running, None) => {
            saga.status = SagaStatus::Completed;
            Next::Save(Change::of(vec![SagaEvent::new(EventKind::Completed, now)]))
        }
        (_, Some(i)) => match steps[i].compensation() {
            Some(kind) => return send(saga, &steps[i], i, (Direction::Backward, kind), now),
            None => {
                // Nothing to undo for this step.
                saga.current_step -= 1;
                saga.attempts = 0;
                let skipped = SagaEvent::new(EventKind::Skipped, now)
                    .step(steps[i].name(), Direction::Backward);
                Next::Save(Change::of(vec![skipped]))
            }
        },
        (_, None) => {
            saga.status = SagaStatus::Compensated;
            Next::Save(Change::of(vec![SagaEvent::new(
                EventKind::Compensated,
                now,
            )]))
        }
    };
    moved(saga, from);
    next
}

/// The next attempt of step `index`'s command of `kind` in `direction`.
fn send<'d>(
    saga: &mut SagaInstance,
    step: &'d StepDefinition,
    index: usize,
    (direction, kind): (Direction, &'d str),
    now: DateTime<Utc>,
) -> Next<'d> {
    saga.attempts += 1;
    Next::Send(Command {
        index,
        step,
        direction,
        kind,
        attempt: saga.attempts,
        at: now,
    })
}

/// The deadline of running `saga` passed while it is at `step` (index `index`):
/// compensate it from that step (whose command may have gone out), or park it when that
/// step has no compensation.
fn deadline_passed<'d>(
    saga: &mut SagaInstance,
    step: &StepDefinition,
    index: usize,
    now: DateTime<Utc>,
) -> Next<'d> {
    let passed = SagaEvent::new(EventKind::DeadlinePassed, now);
    if step.compensation().is_none() {
        let why = format!(
            "deadline passed at step `{}`, which has no compensation: the saga can only go \
             forward; retry it to let it finish",
            step.name()
        );
        return Next::Save(Change::of(park(
            saga,
            vec![passed],
            why,
            now,
            Renew::Nothing,
        )));
    }
    saga.status = SagaStatus::Compensating;
    saga.current_step = i32::try_from(index).unwrap_or(i32::MAX);
    saga.attempts = 0;
    saga.last_error = Some("deadline passed".to_owned());
    Next::Save(Change {
        events: vec![passed, compensating(CompensationTrigger::Deadline, now)],
        compensating: Some(CompensationTrigger::Deadline),
        backoff: None,
    })
}

/// The reply to `command` (which [`next`] returned for `saga`), answered at `at` after
/// `waited`: the saga moves on, turns to compensate, retries after a backoff (its jitter
/// drawn from `rng`) or is parked.
///
/// - a forward step done: its result is recorded under `data.steps`, the saga goes to
///   the next step;
/// - a forward step refused: nothing applied there; the steps before are compensated;
/// - a forward step rejected by the inbox, or out of attempts: it may have applied with
///   its reply lost, so it is compensated too, and the steps before it;
/// - a forward step failing with attempts left: the same command again after a backoff;
/// - a compensation done: the step before is next;
/// - a compensation refused: parked, its next command renewed (the inbox recorded the
///   refusal, so the same id would be refused again);
/// - a compensation rejected by the inbox: parked, its command unchanged;
/// - a compensation failing otherwise: again after a backoff, until it succeeds.
pub(crate) fn answer<R: Rng + ?Sized>(
    saga: &mut SagaInstance,
    command: &Command<'_>,
    reply: Result<StepReply, StepFailure>,
    at: DateTime<Utc>,
    waited: Duration,
    rng: &mut R,
) -> Change {
    let from = position(saga);
    let step = command.step;
    let (kind, detail) = answered(&reply);
    let mut answer = SagaEvent::new(kind, at)
        .step(step.name(), command.direction)
        .attempt(command.attempt)
        .duration(waited);
    if let Some(detail) = detail {
        answer = answer.detail(detail);
    }
    let sent = SagaEvent::new(EventKind::Sent, command.at)
        .step(step.name(), command.direction)
        .attempt(command.attempt);
    let mut change = Change::of(vec![sent, answer]);
    let attempts = u32::try_from(command.attempt).unwrap_or(u32::MAX);
    match (command.direction, reply) {
        (Direction::Forward, Ok(reply)) => match reply.outcome {
            StepOutcome::Done(result) => {
                record_result(&mut saga.data, step.name(), result);
                saga.current_step += 1;
                saga.attempts = 0;
                // A transient failure of an earlier attempt no longer holds the saga
                // up; the history keeps every attempt.
                saga.last_error = None;
            }
            StepOutcome::Refused(reason) => {
                saga.status = SagaStatus::Compensating;
                saga.current_step -= 1;
                saga.attempts = 0;
                saga.last_error = Some(format!("{} refused: {reason}", step.name()));
                turn_to_compensate(&mut change, CompensationTrigger::Refused, at);
            }
        },
        (Direction::Forward, Err(failure)) => {
            saga.last_error = Some(format!("{}: {failure}", step.name()));
            let rejected = matches!(failure, StepFailure::Rejected(_));
            if rejected || !step.retry().allows(attempts.saturating_add(1)) {
                saga.status = SagaStatus::Compensating;
                saga.attempts = 0;
                let trigger = if rejected {
                    CompensationTrigger::Rejected
                } else {
                    CompensationTrigger::Exhausted
                };
                turn_to_compensate(&mut change, trigger, at);
            } else {
                change.backoff = Some(step.retry().delay(attempts, rng));
            }
        }
        (Direction::Backward, Ok(reply)) => match reply.outcome {
            StepOutcome::Done(_) => {
                saga.current_step -= 1;
                saga.attempts = 0;
            }
            StepOutcome::Refused(reason) => {
                // Not undone: park the saga for an operator rather than call it
                // compensated.
                let why = format!("undo {} refused: {reason}", step.name());
                change.events = park(saga, change.events, why, at, Renew::Command);
            }
        },
        (Direction::Backward, Err(StepFailure::Rejected(reason))) => {
            // Retrying cannot help (expired, no such step): park it for an operator. The
            // command keeps its id: an earlier attempt that timed out may have applied,
            // and the inbox checks a message's age before its record, so a new id could
            // undo the step twice. (A new id would be as old as this one anyway.)
            let why = format!("undo {}: {reason}", step.name());
            change.events = park(saga, change.events, why, at, Renew::Nothing);
        }
        (Direction::Backward, Err(failure)) => {
            // Compensations run until they succeed.
            saga.last_error = Some(format!("undo {}: {failure}", step.name()));
            change.backoff = Some(step.retry().delay(attempts, rng));
        }
    }
    moved(saga, from);
    change
}

/// `change` (what [`answer`] returned for `saga`) with the changes that follow it
/// without a command folded in, so that they are saved together: a saga past its last
/// step completes, a compensating saga below its first step is compensated, a step with
/// nothing to undo is skipped, a deadline that passed turns the saga to compensate — each
/// in the save of the reply that led to it rather than in a save of its own. A change
/// with a backoff is returned as it is: its next command waits, so nothing follows at
/// once.
pub(crate) fn settle(
    saga: &mut SagaInstance,
    definition: &SagaDefinition,
    mut change: Change,
    now: DateTime<Utc>,
) -> Change {
    if change.backoff.is_some() {
        return change;
    }
    loop {
        // On a copy: a `Send` counts its attempt on the saga it is asked for.
        let mut ahead = saga.clone();
        match next(&mut ahead, definition, now) {
            Next::Save(more) => {
                *saga = ahead;
                change.events.extend(more.events);
                change.compensating = change.compensating.or(more.compensating);
            }
            Next::Idle | Next::Send(_) => return change,
        }
    }
}

/// Parks `saga` with `reason`, after `events`: it waits for an operator. With
/// [`Renew::Command`] (the step's inbox recorded a refusal of the command, so no attempt
/// of it applied), the step's next command gets a new id, so that once an operator has
/// fixed the cause and retried the saga, the inbox does not answer with the recorded
/// refusal again. Returns the events to save.
pub(crate) fn park(
    saga: &mut SagaInstance,
    mut events: Vec<SagaEvent>,
    reason: String,
    at: DateTime<Utc>,
    renew: Renew,
) -> Vec<SagaEvent> {
    events.push(SagaEvent::new(EventKind::Parked, at).detail(reason.clone()));
    saga.last_error = Some(reason.clone());
    saga.parked = Some(reason);
    saga.attempts = 0;
    if renew == Renew::Command {
        saga.command_round += 1;
    }
    events
}

/// A saga's status and step: where it stands.
type Position = (SagaStatus, i32);

fn position(saga: &SagaInstance) -> Position {
    (saga.status, saga.current_step)
}

/// A saga that moved to another step or direction starts that step's command at round 0.
fn moved(saga: &mut SagaInstance, from: Position) {
    if position(saga) != from {
        saga.command_round = 0;
    }
}

fn turn_to_compensate(change: &mut Change, trigger: CompensationTrigger, at: DateTime<Utc>) {
    change.events.push(compensating(trigger, at));
    change.compensating = Some(trigger);
}

/// The history's event of a saga turning to compensate, its trigger as the detail.
fn compensating(trigger: CompensationTrigger, at: DateTime<Utc>) -> SagaEvent {
    SagaEvent::new(EventKind::Compensating, at).detail(trigger.as_str())
}

/// What one attempt of a step's command answered, for the saga's history.
fn answered(reply: &Result<StepReply, StepFailure>) -> (EventKind, Option<String>) {
    match reply {
        Ok(StepReply {
            outcome: StepOutcome::Done(_),
            duplicate: true,
        }) => (EventKind::Duplicate, None),
        Ok(StepReply {
            outcome: StepOutcome::Done(_),
            duplicate: false,
        }) => (EventKind::Applied, None),
        Ok(StepReply {
            outcome: StepOutcome::Refused(reason),
            ..
        }) => (EventKind::Refused, Some(reason.clone())),
        Err(StepFailure::Rejected(reason)) => (EventKind::Rejected, Some(reason.clone())),
        Err(failure @ StepFailure::Timeout(_)) => (EventKind::TimedOut, Some(failure.to_string())),
        Err(failure @ StepFailure::Retryable(_)) => (EventKind::Failed, Some(failure.to_string())),
    }
}

/// Records a forward step's result under `data.steps.<step>`; data that is not an object
/// moves under `data.input` first.
fn record_result(data: &mut Value, step: &str, result: Value) {
    if !data.is_object() {
        *data = json!({ "input": data.take() });
    }
    if let Some(object) = data.as_object_mut() {
        let steps = object.entry("steps").or_insert_with(|| json!({}));
        if let Some(steps) = steps.as_object_mut() {
            steps.insert(step.to_owned(), result);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use chrono::TimeZone;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::envelope::MessageId;
    use crate::saga::operator::{cancelled, retried};

    /// A definition with `compensable` steps that have a compensation (their attempts
    /// capped by `max_attempts`, in order) followed by `forward_only` steps without one.
    fn definition(max_attempts: &[Option<u32>], forward_only: usize) -> SagaDefinition {
        let mut toml = String::from("name = \"model\"\ndeadline = \"1h\"\n");
        for (i, max) in max_attempts.iter().enumerate() {
            toml.push_str(&format!(
                "[[steps]]\nname = \"s{i}\"\nconsumer_type = \"c{i}\"\ncommand = \"do{i}\"\n\
                 compensation = \"undo{i}\"\ntimeout = \"1s\"\n"
            ));
            if let Some(max) = max {
                toml.push_str(&format!("[steps.retry]\nmax_attempts = {max}\n"));
            }
        }
        for i in max_attempts.len()..max_attempts.len() + forward_only {
            toml.push_str(&format!(
                "[[steps]]\nname = \"s{i}\"\nconsumer_type = \"c{i}\"\ncommand = \"do{i}\"\n\
                 timeout = \"1s\"\n"
            ));
        }
        toml.parse().expect("a valid model definition")
    }

    fn start() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 12, 6, 12, 0, 0).unwrap()
    }

    fn done(result: Value) -> Result<StepReply, StepFailure> {
        Ok(StepReply {
            outcome: StepOutcome::Done(result),
            duplicate: false,
        })
    }

    fn refused(reason: &str) -> Result<StepReply, StepFailure> {
        Ok(StepReply {
            outcome: StepOutcome::Refused(reason.to_owned()),
            duplicate: false,
        })
    }

    /// Sends the command `next` decides and answers it with `reply`.
    fn step(
        saga: &mut SagaInstance,
        definition: &SagaDefinition,
        reply: Result<StepReply, StepFailure>,
    ) -> (usize, Direction, Change) {
        let mut rng = StdRng::seed_from_u64(1);
        match next(saga, definition, start()) {
            Next::Send(command) => {
                let (index, direction) = (command.index, command.direction);
                let change = answer(saga, &command, reply, start(), Duration::ZERO, &mut rng);
                (index, direction, change)
            }
            other => panic!("expected a command, got {other:?}"),
        }
    }

    /// The step and direction a command went to.
    fn sent_to((index, direction, _): (usize, Direction, Change)) -> (usize, Direction) {
        (index, direction)
    }

    fn kinds(change: &Change) -> Vec<EventKind> {
        change.events.iter().map(|event| event.kind).collect()
    }

    /// Answers the command `next` decides with `reply`, then settles the change.
    fn step_settled(
        saga: &mut SagaInstance,
        definition: &SagaDefinition,
        reply: Result<StepReply, StepFailure>,
    ) -> Change {
        let (_, _, change) = step(saga, definition, reply);
        settle(saga, definition, change, start())
    }

    #[test]
    fn the_save_that_ends_a_saga_is_the_last_reply_s() {
        let definition = definition(&[None], 1);
        let mut saga = SagaInstance::under(&definition, "s-1", json!({}), start());
        let first = step_settled(&mut saga, &definition, done(json!(1)));
        assert_eq!(kinds(&first), [EventKind::Sent, EventKind::Applied]);
        assert!(matches!(
            next(&mut saga.clone(), &definition, start()),
            Next::Send(_)
        ));
        let last = step_settled(&mut saga, &definition, done(json!(2)));
        assert_eq!(
            kinds(&last),
            [EventKind::Sent, EventKind::Applied, EventKind::Completed]
        );
        assert_eq!(saga.status, SagaStatus::Completed);
        assert!(matches!(next(&mut saga, &definition, start()), Next::Idle));
    }

    #[test]
    fn a_refusal_skips_the_steps_with_nothing_to_undo_in_its_own_save() {
        // s0 has a compensation, s1 and s2 have none: s2's refusal skips s1's undo.
        let definition = definition(&[None], 2);
        let mut saga = SagaInstance::under(&definition, "s-1", json!({}), start());
        step_settled(&mut saga, &definition, done(json!(1)));
        step_settled(&mut saga, &definition, done(json!(2)));
        let refusal = step_settled(&mut saga, &definition, refused("no"));
        assert_eq!(
            kinds(&refusal),
            [
                EventKind::Sent,
                EventKind::Refused,
                EventKind::Compensating,
                EventKind::Skipped
            ]
        );
        assert_eq!(refusal.compensating, Some(CompensationTrigger::Refused));
        assert_eq!(
            (saga.status, saga.current_step),
            (SagaStatus::Compensating, 0)
        );
        let undone = step_settled(&mut saga, &definition, done(json!(null)));
        assert_eq!(
            kinds(&undone),
            [EventKind::Sent, EventKind::Applied, EventKind::Compensated]
        );
        assert_eq!(saga.status, SagaStatus::Compensated);
    }

    #[test]
    fn a_retry_is_settled_as_it_is() {
        let definition = definition(&[Some(3)], 0);
        let mut saga = SagaInstance::under(&definition, "s-1", json!({}), start());
        let (_, _, change) = step(
            &mut saga,
            &definition,
            Err(StepFailure::Retryable("later".into())),
        );
        assert!(change.backoff.is_some());
        let before = saga.clone();
        let settled = settle(&mut saga, &definition, change, start());
        assert_eq!(kinds(&settled), [EventKind::Sent, EventKind::Failed]);
        assert_eq!(
            saga, before,
            "the next attempt is not counted before its backoff"
        );
    }

    #[test]
    fn a_refused_step_compensates_the_ones_before_in_reverse_and_ends_compensated() {
        let definition = definition(&[None, None, None], 0);
        let mut saga = SagaInstance::under(&definition, "s-1", json!({}), start());
        assert_eq!(step(&mut saga, &definition, done(json!(1))).0, 0);
        assert_eq!(step(&mut saga, &definition, done(json!(2))).0, 1);
        let (at, _, change) = step(&mut saga, &definition, refused("out of stock"));
        assert_eq!(at, 2);
        assert_eq!(
            kinds(&change),
            [EventKind::Sent, EventKind::Refused, EventKind::Compensating]
        );
        assert_eq!(change.compensating, Some(CompensationTrigger::Refused));
        assert_eq!(saga.last_error.as_deref(), Some("s2 refused: out of stock"));
        assert_eq!(saga.data["steps"], json!({"s0": 1, "s1": 2}));
        // The refused step applied nothing: the undo starts at the one before it.
        assert_eq!(
            sent_to(step(&mut saga, &definition, done(json!(null)))),
            (1, Direction::Backward)
        );
        assert_eq!(
            sent_to(step(&mut saga, &definition, done(json!(null)))),
            (0, Direction::Backward)
        );
        let Next::Save(change) = next(&mut saga, &definition, start()) else {
            panic!("a saga below its first step is finished");
        };
        assert_eq!(kinds(&change), [EventKind::Compensated]);
        assert_eq!(saga.status, SagaStatus::Compensated);
        assert!(matches!(next(&mut saga, &definition, start()), Next::Idle));
    }

    #[test]
    fn a_step_out_of_attempts_is_compensated_too_and_retries_back_off() {
        let definition = definition(&[Some(2)], 0);
        let mut saga = SagaInstance::under(&definition, "s-2", json!({}), start());
        let (_, _, first) = step(
            &mut saga,
            &definition,
            Err(StepFailure::Timeout(Duration::from_secs(1))),
        );
        assert!(
            first.backoff.is_some(),
            "attempt 2 is allowed: wait, then again"
        );
        assert_eq!(saga.attempts, 1);
        let (_, _, second) = step(
            &mut saga,
            &definition,
            Err(StepFailure::Retryable("down".into())),
        );
        assert_eq!(second.compensating, Some(CompensationTrigger::Exhausted));
        assert_eq!(
            (saga.status, saga.current_step, saga.attempts),
            (SagaStatus::Compensating, 0, 0)
        );
        // Its reply may have been lost after it applied: its own undo goes out.
        assert_eq!(
            sent_to(step(&mut saga, &definition, done(json!(null)))),
            (0, Direction::Backward)
        );
    }

    #[test]
    fn a_refused_compensation_parks_the_saga_with_a_new_command_id() {
        let definition = definition(&[None], 0);
        let mut saga = SagaInstance::under(&definition, "s-3", json!({}), start());
        step(
            &mut saga,
            &definition,
            Err(StepFailure::Rejected("expired".into())),
        );
        let before = saga.command_id(0, Direction::Backward);
        let (_, _, change) = step(&mut saga, &definition, refused("already shipped"));
        assert_eq!(
            kinds(&change),
            [EventKind::Sent, EventKind::Refused, EventKind::Parked]
        );
        assert_eq!(
            saga.parked.as_deref(),
            Some("undo s0 refused: already shipped")
        );
        assert!(matches!(next(&mut saga, &definition, start()), Next::Idle));
        retried(&mut saga, "fixed by hand", start()).expect("a parked saga is retried");
        assert_ne!(saga.command_id(0, Direction::Backward), before);
    }

    /// A compensation whose reply was lost (it applied), then rejected by the inbox
    /// (the inbox checks a message's age before its record): parked, and the operator's
    /// retry sends the same message, which the inbox can still answer as a duplicate.
    #[test]
    fn a_rejected_compensation_parks_the_saga_and_keeps_its_command_id() {
        let definition = definition(&[None], 0);
        let mut saga = SagaInstance::under(&definition, "s-6", json!({}), start());
        step(
            &mut saga,
            &definition,
            Err(StepFailure::Rejected("bad".into())),
        );
        let before = saga.command_id(0, Direction::Backward);
        step(
            &mut saga,
            &definition,
            Err(StepFailure::Timeout(Duration::from_secs(1))),
        );
        let (_, _, change) = step(
            &mut saga,
            &definition,
            Err(StepFailure::Rejected("expired".into())),
        );
        assert_eq!(
            kinds(&change),
            [EventKind::Sent, EventKind::Rejected, EventKind::Parked]
        );
        retried(&mut saga, "looked at it", start()).expect("a parked saga is retried");
        assert_eq!(saga.command_id(0, Direction::Backward), before);
    }

    #[test]
    fn a_deadline_compensates_from_the_current_step_or_parks_at_one_without_undo() {
        let definition = definition(&[None], 1);
        let later = start() + chrono::TimeDelta::hours(2);
        let mut saga = SagaInstance::under(&definition, "s-4", json!({}), start());
        let Next::Save(change) = next(&mut saga, &definition, later) else {
            panic!("past the deadline the saga changes");
        };
        assert_eq!(
            kinds(&change),
            [EventKind::DeadlinePassed, EventKind::Compensating]
        );
        assert_eq!(
            (saga.status, saga.current_step),
            (SagaStatus::Compensating, 0)
        );

        let mut saga = SagaInstance::under(&definition, "s-5", json!({}), start());
        step(&mut saga, &definition, done(json!(null)));
        let Next::Save(change) = next(&mut saga, &definition, later) else {
            panic!("past the deadline the saga changes");
        };
        assert_eq!(
            kinds(&change),
            [EventKind::DeadlinePassed, EventKind::Parked]
        );
        assert_eq!((saga.status, saga.current_step), (SagaStatus::Running, 1));
        assert!(saga.parked.is_some());
    }

    /// What the model's world does at one turn.
    #[derive(Debug, Clone, Copy)]
    enum Turn {
        /// The participant applies the command and replies.
        Apply,
        /// The participant refuses it for good (recorded in its inbox).
        Refuse,
        /// It applies, and the reply is lost: the orchestrator times out.
        ApplyLoseReply,
        /// Nothing arrives: a timeout with nothing applied.
        Lose,
        /// A retryable failure, nothing applied.
        Fail,
        /// The inbox rejects the command (dead-lettered), nothing applied.
        Reject,
        /// The saga's deadline passes.
        Deadline,
        /// An operator cancels the saga (refused when it cannot be).
        Cancel,
        /// An operator retries the saga (refused unless it is parked).
        Retry,
    }

    fn turns() -> impl Strategy<Value = Vec<Turn>> {
        let turn = prop_oneof![
            6 => Just(Turn::Apply),
            2 => Just(Turn::Refuse),
            2 => Just(Turn::ApplyLoseReply),
            2 => Just(Turn::Lose),
            2 => Just(Turn::Fail),
            1 => Just(Turn::Reject),
            1 => Just(Turn::Deadline),
            1 => Just(Turn::Cancel),
            2 => Just(Turn::Retry),
        ];
        prop::collection::vec(turn, 0..60)
    }

    /// The participants' side: one inbox for all, keyed by message id.
    #[derive(Default)]
    struct World {
        /// What each command id was answered with the first time it was processed.
        inbox: HashMap<MessageId, StepOutcome>,
        /// Every side effect applied, in order: (step, direction).
        effects: Vec<(usize, Direction)>,
        /// Every command sent, in order.
        sent: Vec<(usize, Direction)>,
    }

    impl World {
        /// The reply to `envelope`'s command under `turn`.
        fn deliver(
            &mut self,
            command: &Command<'_>,
            envelope: &Envelope,
            turn: Turn,
        ) -> Result<StepReply, StepFailure> {
            self.sent.push((command.index, command.direction));
            let timeout = StepFailure::Timeout(Duration::from_secs(1));
            match turn {
                Turn::Lose => return Err(timeout),
                Turn::Fail => return Err(StepFailure::Retryable("connection reset".into())),
                Turn::Reject => return Err(StepFailure::Rejected("expired".into())),
                _ => {}
            }
            if let Some(first) = self.inbox.get(&envelope.id) {
                return Ok(StepReply {
                    outcome: first.clone(),
                    duplicate: true,
                });
            }
            let outcome = match turn {
                Turn::Refuse => StepOutcome::Refused("no".into()),
                _ => {
                    self.effects.push((command.index, command.direction));
                    StepOutcome::Done(json!(command.index))
                }
            };
            self.inbox.insert(envelope.id.clone(), outcome.clone());
            match turn {
                Turn::ApplyLoseReply => Err(timeout),
                _ => Ok(StepReply {
                    outcome,
                    duplicate: false,
                }),
            }
        }
    }

    /// Runs a saga of `definition` through `script` (then a world without faults, and an
    /// operator who retries what is parked) and checks the saga's invariants on the way
    /// and at its end.
    fn run(definition: &SagaDefinition, script: &[Turn]) -> Result<(), TestCaseError> {
        let steps = definition.steps();
        let mut saga = SagaInstance::under(definition, "model-1", json!({}), start());
        let mut world = World::default();
        let mut rng = StdRng::seed_from_u64(7);
        let mut now = start();
        let mut script = script.iter().copied();
        let mut turned_back = false;
        for _ in 0..400 {
            let turn = script.next();
            match turn {
                Some(Turn::Deadline) => {
                    now = start() + chrono::TimeDelta::hours(2);
                    continue;
                }
                Some(Turn::Cancel) => {
                    let before = saga.clone();
                    if cancelled(definition, &mut saga, "model", now).is_err() {
                        prop_assert_eq!(&saga, &before, "a refused cancel changes nothing");
                    }
                    continue;
                }
                Some(Turn::Retry) => {
                    let _ = retried(&mut saga, "model", now);
                    continue;
                }
                _ => {}
            }
            if saga.status.is_terminal() {
                break;
            }
            let before = saga.clone();
            match next(&mut saga, definition, now) {
                Next::Idle => {
                    prop_assert!(saga.parked.is_some(), "only a parked saga idles unfinished");
                    prop_assert_eq!(&saga, &before, "an idle saga does not change");
                    if turn.is_none() {
                        // The script is over: the operator retries what is parked.
                        retried(&mut saga, "model", now)
                            .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    }
                }
                Next::Save(_) => {}
                Next::Send(command) => {
                    let (index, direction) = (command.index, command.direction);
                    prop_assert!(index < steps.len());
                    if direction == Direction::Backward {
                        turned_back = true;
                        prop_assert!(
                            steps[index].compensation().is_some(),
                            "only steps with an undo are undone"
                        );
                    } else {
                        prop_assert!(
                            !turned_back,
                            "a saga never goes forward once it compensates"
                        );
                    }
                    let envelope = command.envelope(&saga);
                    let reply = world.deliver(&command, &envelope, turn.unwrap_or(Turn::Apply));
                    let change = answer(&mut saga, &command, reply, now, Duration::ZERO, &mut rng);
                    prop_assert_eq!(change.events[0].kind, EventKind::Sent);
                }
            }
        }
        prop_assert!(
            saga.status.is_terminal(),
            "the saga finishes once faults stop: {saga:?}"
        );

        // Each step is applied at most once each way, forward in order, undone in reverse.
        let forward: Vec<usize> = world
            .effects
            .iter()
            .filter(|(_, d)| *d == Direction::Forward)
            .map(|(i, _)| *i)
            .collect();
        let backward: Vec<usize> = world
            .effects
            .iter()
            .filter(|(_, d)| *d == Direction::Backward)
            .map(|(i, _)| *i)
            .collect();
        prop_assert_eq!(
            &forward,
            &(0..forward.len()).collect::<Vec<_>>(),
            "forward effects: each step once, in order"
        );
        prop_assert!(
            backward.windows(2).all(|pair| pair[0] > pair[1]),
            "undone once each, in reverse: {backward:?}"
        );
        let first_undo = world
            .effects
            .iter()
            .position(|(_, d)| *d == Direction::Backward);
        if let Some(first_undo) = first_undo {
            prop_assert!(
                world.effects[first_undo..]
                    .iter()
                    .all(|(_, d)| *d == Direction::Backward)
            );
        }
        match saga.status {
            SagaStatus::Completed => {
                prop_assert_eq!(forward.len(), steps.len(), "completed: every step applied");
                prop_assert!(backward.is_empty(), "completed: nothing undone");
            }
            SagaStatus::Compensated => {
                let undone: HashSet<usize> = backward.iter().copied().collect();
                for &i in &forward {
                    prop_assert!(
                        steps[i].compensation().is_none() || undone.contains(&i),
                        "compensated, yet step {} applied and was not undone",
                        i
                    );
                }
            }
            status => prop_assert!(false, "not finished: {status}"),
        }

        // A finished saga never moves.
        let finished = saga.clone();
        prop_assert!(matches!(next(&mut saga, definition, now), Next::Idle));
        prop_assert!(retried(&mut saga, "late", now).is_err());
        prop_assert!(cancelled(definition, &mut saga, "late", now).is_err());
        prop_assert_eq!(&saga, &finished);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn any_order_of_replies_faults_and_operators_keeps_the_saga_invariants(
            max_attempts in prop::collection::vec(prop::option::of(1u32..=3), 0..=3),
            forward_only in 0usize..=2,
            script in turns(),
        ) {
            prop_assume!(!max_attempts.is_empty() || forward_only > 0);
            run(&definition(&max_attempts, forward_only), &script)?;
        }
    }
}
