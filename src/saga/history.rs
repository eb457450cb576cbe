//! A saga's history: one [`SagaEvent`] per thing that happened to it — started, a step's
//! command sent and its reply, a compensation, completed or compensated, parked, an
//! operator's action. The store writes a save's events in the same statement (or
//! transaction) as the saga state the save changes, under the version that save gives the
//! saga ([`HistoryEntry::version`]), so history and state never disagree: the newest
//! event of a saga always carries the saga's current version.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;

use crate::saga::Direction;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// The saga was stored, at its first step.
    Started,
    /// A step's command (or, backward, its compensation) was sent: attempt `attempt`.
    Sent,
    /// The step applied the command: this delivery ran the handler.
    Applied,
    /// The step answered with the result of an earlier delivery of the same command
    /// (its inbox absorbed this one).
    Duplicate,
    /// The step refused the command for good (a permanent error).
    Refused,
    /// The step failed and asked to be tried again, or could not be reached.
    Failed,
    /// No answer within the step's timeout.
    TimedOut,
    /// The step's inbox refused the command (expired, no such step): retrying cannot help.
    Rejected,
    /// A step without a compensation was passed over while compensating.
    Skipped,
    /// The saga turned to compensating its completed steps.
    Compensating,
    /// Every step done.
    Completed,
    /// Every completed step undone.
    Compensated,
    /// The saga cannot move on its own and waits for an operator.
    Parked,
    /// The saga's deadline passed while it was running.
    DeadlinePassed,
    /// An operator sent a parked saga on from where it stopped.
    Retried,
    /// An operator cancelled the saga: its completed steps are compensated.
    Cancelled,
}

impl EventKind {
    /// Every kind, in the order of the saga's life.
    pub const ALL: [EventKind; 16] = [
        EventKind::Started,
        EventKind::Sent,
        EventKind::Applied,
        EventKind::Duplicate,
        EventKind::Refused,
        EventKind::Failed,
        EventKind::TimedOut,
        EventKind::Rejected,
        EventKind::Skipped,
        EventKind::Compensating,
        EventKind::Completed,
        EventKind::Compensated,
        EventKind::Parked,
        EventKind::DeadlinePassed,
        EventKind::Retried,
        EventKind::Cancelled,
    ];

    /// The text stored in `sagabox_saga_events.kind`.
    pub const fn as_str(self) -> &'static str {
        match self {
            EventKind::Started => "started",
            EventKind::Sent => "sent",
            EventKind::Applied => "applied",
            EventKind::Duplicate => "duplicate",
            EventKind::Refused => "refused",
            EventKind::Failed => "failed",
            EventKind::TimedOut => "timed_out",
            EventKind::Rejected => "rejected",
            EventKind::Skipped => "skipped",
            EventKind::Compensating => "compensating",
            EventKind::Completed => "completed",
            EventKind::Compensated => "compensated",
            EventKind::Parked => "parked",
            EventKind::DeadlinePassed => "deadline_passed",
            EventKind::Retried => "retried",
            EventKind::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event kind text that is not one of [`EventKind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown saga event kind {0:?}")]
pub struct UnknownEventKind(String);

impl FromStr for EventKind {
    type Err = UnknownEventKind;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| UnknownEventKind(s.to_owned()))
    }
}

/// One thing that happened to a saga.
#[derive(Debug, Clone, PartialEq)]
pub struct SagaEvent {
    /// When it happened.
    pub at: DateTime<Utc>,
    /// What happened.
    pub kind: EventKind,
    /// The step it concerns, if any.
    pub step: Option<String>,
    /// Whether it concerns the step's command or its compensation.
    pub direction: Option<Direction>,
    /// The attempt of the step's command it concerns (from 1).
    pub attempt: Option<i32>,
    /// How long the attempt waited for its answer.
    pub duration: Option<Duration>,
    /// The error, the reason, or an operator's note.
    pub detail: Option<String>,
}

impl SagaEvent {
    /// An event of `kind` at `at`, about no step.
    pub fn new(kind: EventKind, at: DateTime<Utc>) -> Self {
        Self {
            at,
            kind,
            step: None,
            direction: None,
            attempt: None,
            duration: None,
            detail: None,
        }
    }

    /// About `step`, going `direction`.
    pub fn step(mut self, step: impl Into<String>, direction: Direction) -> Self {
        self.step = Some(step.into());
        self.direction = Some(direction);
        self
    }

    /// About attempt `attempt` of the step's command.
    pub fn attempt(mut self, attempt: i32) -> Self {
        self.attempt = Some(attempt);
        self
    }

    /// The attempt waited `duration` for its answer.
    pub fn duration(mut self, duration: Duration) -> Self {
        self.duration = Some(duration);
        self
    }

    /// With an error, a reason or a note.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }
}

/// An event as stored: with the version of the saga that the save which wrote it gave.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryEntry {
    /// The saga's version after the save that wrote this event.
    pub version: i64,
    /// The event.
    pub event: SagaEvent,
}

/// One event as the store's SQL reads it from a JSON array (`jsonb_to_recordset`,
/// `json_each`), serialised straight from the event's fields.
#[derive(Debug, Serialize)]
pub(crate) struct EventRow<'a> {
    /// Its place among the events of one save.
    ordinal: usize,
    /// Written as sqlx writes a time to SQLite, so both databases read it back alike.
    at: String,
    kind: &'static str,
    step: Option<&'a str>,
    direction: Option<&'static str>,
    attempt: Option<i32>,
    duration_ms: Option<i64>,
    detail: Option<&'a str>,
}

/// A save's events, in order, as the rows the store's SQL reads (bound as one JSON array).
pub(crate) fn rows(events: &[SagaEvent]) -> Vec<EventRow<'_>> {
    events
        .iter()
        .enumerate()
        .map(|(ordinal, event)| EventRow {
            ordinal,
            at: event.at.to_rfc3339_opts(SecondsFormat::AutoSi, false),
            kind: event.kind.as_str(),
            step: event.step.as_deref(),
            direction: event.direction.map(Direction::as_str),
            attempt: event.attempt,
            duration_ms: event
                .duration
                .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            detail: event.detail.as_deref(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_their_text() {
        for kind in EventKind::ALL {
            assert_eq!(kind.as_str().parse::<EventKind>(), Ok(kind));
        }
        assert!("exploded".parse::<EventKind>().is_err());
    }

    #[test]
    fn a_save_s_events_become_ordered_rows() {
        let at = Utc::now();
        let events = [
            SagaEvent::new(EventKind::Sent, at)
                .step("payment", Direction::Forward)
                .attempt(1),
            SagaEvent::new(EventKind::Applied, at)
                .step("payment", Direction::Forward)
                .attempt(1)
                .duration(Duration::from_millis(12)),
        ];
        let rows = serde_json::to_value(rows(&events)).unwrap();
        assert_eq!(rows[0]["ordinal"], 0);
        assert_eq!(rows[1]["ordinal"], 1);
        assert_eq!(rows[1]["kind"], "applied");
        assert_eq!(rows[1]["direction"], "forward");
        assert_eq!(rows[1]["duration_ms"], 12);
        assert_eq!(rows[0]["duration_ms"], serde_json::Value::Null);
    }
}
