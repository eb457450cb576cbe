//! Saga instances as the orchestrator persists them (`saga_instances`), the stable ids of
//! their commands, and the idempotent start of a saga from a start message
//! ([`SagaInstance::from_start`], [`SagaStore::create_if_absent`]).

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::envelope::{Envelope, MessageId};
use crate::saga::SagaDefinition;
#[cfg(doc)]
use crate::saga::SagaStore;

/// Where a saga instance stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SagaStatus {
    /// Running its steps forward.
    Running,
    /// Undoing its completed steps after a step failed for good.
    Compensating,
    /// Every step done.
    Completed,
    /// Every completed step undone.
    Compensated,
}

impl SagaStatus {
    /// The text stored in `saga_instances.status`.
    pub const fn as_str(self) -> &'static str {
        match self {
            SagaStatus::Running => "running",
            SagaStatus::Compensating => "compensating",
            SagaStatus::Completed => "completed",
            SagaStatus::Compensated => "compensated",
        }
    }

    /// Whether the saga is finished.
    pub fn is_terminal(self) -> bool {
        matches!(self, SagaStatus::Completed | SagaStatus::Compensated)
    }
}

impl fmt::Display for SagaStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A status text that is not one of the four.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown saga status {0:?}: expected running, compensating, completed or compensated")]
pub struct UnknownStatus(String);

impl FromStr for SagaStatus {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "running" => Ok(SagaStatus::Running),
            "compensating" => Ok(SagaStatus::Compensating),
            "completed" => Ok(SagaStatus::Completed),
            "compensated" => Ok(SagaStatus::Compensated),
            other => Err(UnknownStatus(other.to_owned())),
        }
    }
}

/// Where a saga stands for an operator: a [`SagaStatus`], or parked (waiting for an
/// operator, whatever its status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SagaState {
    /// In this status and not parked.
    Status(SagaStatus),
    /// Waiting for an operator (see [`crate::saga::operator`]).
    Parked,
}

impl SagaState {
    /// `parked`, or the status's text.
    pub const fn as_str(self) -> &'static str {
        match self {
            SagaState::Status(status) => status.as_str(),
            SagaState::Parked => "parked",
        }
    }
}

impl fmt::Display for SagaState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SagaState {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "parked" => Ok(SagaState::Parked),
            other => other.parse().map(SagaState::Status),
        }
    }
}

/// Why a saga was not started from a start message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The start message's kind is not the name of the saga it was given to: it was sent
    /// to the wrong orchestrator, or it starts another saga.
    #[error(
        "a start message of kind `{kind}` does not start saga `{saga}`: \
         a start message's kind is the name of the saga it starts"
    )]
    WrongSaga {
        /// The saga the message was given to.
        saga: String,
        /// The message's kind.
        kind: String,
    },
    /// The start message names a saga id. A started saga's id is derived from the start
    /// message's id, so that a redelivered start finds the saga it started.
    #[error(
        "a start message must not carry a saga id (it has {saga_id:?}): the saga's id is \
         derived from the message id; leave `saga_id` out"
    )]
    SagaIdGiven {
        /// The saga id the message carried.
        saga_id: String,
    },
    /// The saga could not be stored or read back. Nothing or the whole saga was stored:
    /// send the same start message again.
    #[error(
        "cannot store the saga started by message {message_id}: {source}; send the start again, it is idempotent"
    )]
    Store {
        /// The start message's id.
        message_id: MessageId,
        /// The database's error.
        #[source]
        source: sqlx::Error,
    },
}

/// Which way a command goes: the step itself, or its compensation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The step's command.
    Forward,
    /// The step's compensation.
    Backward,
}

impl Direction {
    /// `forward` or `backward`, as the saga history stores it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Direction::Forward => "forward",
            Direction::Backward => "backward",
        }
    }
}

/// A direction text that is neither `forward` nor `backward`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown step direction {0:?}: expected forward or backward")]
pub struct UnknownDirection(String);

impl FromStr for Direction {
    type Err = UnknownDirection;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "forward" => Ok(Direction::Forward),
            "backward" => Ok(Direction::Backward),
            other => Err(UnknownDirection(other.to_owned())),
        }
    }
}

/// One saga instance, as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SagaInstance {
    /// The saga instance's id.
    pub id: String,
    /// The definition it runs.
    pub saga_name: String,
    /// Where it stands.
    pub status: SagaStatus,
    /// Running: the step being run. Compensating: the step being undone (−1 when none
    /// is left).
    pub current_step: i32,
    /// Attempts of the current step so far.
    pub attempts: i32,
    /// The saga's input and, under `"steps"`, each step's result.
    pub data: Value,
    /// When the instance was created; also the time inside its command ids.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// The failure that holds the saga up, or that made it compensate, for people. A
    /// forward step that completes clears it (its failed attempts stay in the history);
    /// a compensating, parked or cancelled saga keeps its cause.
    pub last_error: Option<String>,
    /// How many saves this copy has seen; a save from an older copy is refused.
    pub version: i64,
    /// The version of its definition the saga runs on ([`SagaDefinition::version`]).
    pub definition_version: u32,
    /// Why the saga waits for an operator, or `None`. A parked saga is not driven until
    /// an operator retries or cancels it (see [`crate::saga::operator`]).
    pub parked: Option<String>,
    /// When a saga still running is compensated instead ([`SagaDefinition::deadline`]).
    pub deadline_at: Option<DateTime<Utc>>,
    /// How many times the command of the step the saga is at was renewed: 0 normally;
    /// raised when the saga was parked because the step's inbox recorded a refusal of
    /// its compensation (nothing applied), so that its next command, after an
    /// operator's retry, is a new message rather than the one the inbox answered. Back
    /// to 0 whenever the saga moves to another step or direction.
    pub command_round: u32,
}

impl SagaInstance {
    /// A new running instance at its first step, on version 1 of its definition and
    /// without a deadline. [`under`](Self::under) takes both from the definition.
    pub fn new(
        id: impl Into<String>,
        saga_name: impl Into<String>,
        data: Value,
        now: DateTime<Utc>,
    ) -> Self {
        Self {
            id: id.into(),
            saga_name: saga_name.into(),
            status: SagaStatus::Running,
            current_step: 0,
            attempts: 0,
            data,
            created_at: now,
            updated_at: now,
            last_error: None,
            version: 0,
            definition_version: 1,
            parked: None,
            deadline_at: None,
            command_round: 0,
        }
    }

    /// A new running instance of `definition` at its first step: on the definition's
    /// version, with its deadline counted from `now`.
    pub fn under(
        definition: &SagaDefinition,
        id: impl Into<String>,
        data: Value,
        now: DateTime<Utc>,
    ) -> Self {
        let deadline_at = definition
            .deadline()
            .and_then(|deadline| chrono::TimeDelta::from_std(deadline).ok())
            .and_then(|deadline| now.checked_add_signed(deadline));
        Self {
            definition_version: definition.version(),
            deadline_at,
            ..Self::new(id, definition.name(), data, now)
        }
    }

    /// Where the saga stands for an operator: its status, or parked.
    pub fn state(&self) -> SagaState {
        if self.parked.is_some() {
            SagaState::Parked
        } else {
            SagaState::Status(self.status)
        }
    }

    /// The instance that the start message `start` asks for, running `definition` from
    /// its first step: what an orchestrator does with a request to start a saga.
    ///
    /// Starting is idempotent by the message's id: the saga's id is derived from
    /// `start.id` and the saga's name ([`SagaInstance::start_id`]), so a redelivered
    /// start (the same id) gives the same saga id, and
    /// [`SagaStore::create_if_absent`] stores it once.
    ///
    /// The start message's envelope:
    ///
    /// | field | value |
    /// | --- | --- |
    /// | `id` | the request's stable id, the same on every redelivery: it decides which saga the request starts |
    /// | `kind` | the saga's name ([`SagaDefinition::name`]), e.g. `trip` |
    /// | `payload` | the saga's data: every step's command carries it as its payload |
    /// | `saga_id` | absent: the saga's id is derived from `id` |
    /// | `published_at`, `headers` | free; not read |
    ///
    /// `now` becomes the saga's creation time, the time inside its command ids. Of two
    /// starts of one message only the first stored keeps its `now` and payload.
    ///
    /// ```
    /// use chrono::Utc;
    /// use sagabox::saga::{SagaDefinition, SagaInstance};
    /// use sagabox::{Envelope, MessageId};
    /// use serde_json::json;
    ///
    /// let definition: SagaDefinition = r#"
    ///     name = "trip"
    ///     [[steps]]
    ///     name = "notify"
    ///     consumer_type = "notify"
    ///     command = "send_itinerary"
    ///     timeout = "5s"
    /// "#.parse()?;
    /// let start = Envelope::new(MessageId::new("booking-request-42")?, "trip", json!({"trip_id": "t-42"}))?;
    /// let first = SagaInstance::from_start(&definition, &start, Utc::now())?;
    /// let again = SagaInstance::from_start(&definition, &start, Utc::now())?;
    /// assert_eq!(first.id, again.id);
    /// assert_eq!(first.data, json!({"trip_id": "t-42"}));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_start(
        definition: &SagaDefinition,
        start: &Envelope,
        now: DateTime<Utc>,
    ) -> Result<Self, StartError> {
        if start.kind != definition.name() {
            return Err(StartError::WrongSaga {
                saga: definition.name().to_owned(),
                kind: start.kind.clone(),
            });
        }
        if let Some(saga_id) = &start.saga_id {
            return Err(StartError::SagaIdGiven {
                saga_id: saga_id.clone(),
            });
        }
        Ok(Self::under(
            definition,
            Self::start_id(definition.name(), &start.id),
            start.payload.clone(),
            now,
        ))
    }

    /// The id of the saga `saga_name` started by the message `start_id`: a UUID derived
    /// from both (a UUIDv7 at the message's time when its id is a UUIDv7), the same on
    /// every call. The saga name is part of it, so one message may start sagas of two
    /// definitions without their ids meeting.
    pub fn start_id(saga_name: &str, start_id: &MessageId) -> String {
        start_id
            .derived(&format!("start\u{1f}{saga_name}"))
            .to_string()
    }

    /// The id of the command for `step` in `direction`: the same on every attempt, so a
    /// retry is the same message and the step's inbox applies it once.
    ///
    /// A UUIDv7 whose time is the saga's creation time (so the inbox files every command
    /// of a saga under one stable month, on its fast path) and whose other bits are a
    /// SHA-1 name hash of `(saga id, step, direction)`.
    ///
    /// A renewed command ([`command_round`](Self::command_round) above 0) adds its round:
    /// it applies to the step the saga is at, whose id this is. (A saga's definition
    /// version is not part of the name: a saga runs on one version to its end, and its id
    /// already tells its commands from every other saga's.)
    pub fn command_id(&self, step: usize, direction: Direction) -> MessageId {
        let direction = match direction {
            Direction::Forward => "do",
            Direction::Backward => "undo",
        };
        let mut name = format!("{}\u{1f}{step}\u{1f}{direction}", self.id);
        if self.command_round > 0 {
            name.push_str(&format!("\u{1f}r{}", self.command_round));
        }
        MessageId::derive_v7(self.created_at, &name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn command_ids_are_stable_distinct_uuid_v7_at_the_saga_start() {
        let created = Utc.with_ymd_and_hms(2026, 11, 30, 23, 59, 59).unwrap();
        let saga = SagaInstance::new("saga-1", "checkout", Value::Null, created);
        let forward = saga.command_id(0, Direction::Forward);
        assert_eq!(forward, saga.command_id(0, Direction::Forward));
        assert_ne!(forward, saga.command_id(0, Direction::Backward));
        assert_ne!(forward, saga.command_id(1, Direction::Forward));
        let other = SagaInstance::new("saga-2", "checkout", Value::Null, created);
        assert_ne!(forward, other.command_id(0, Direction::Forward));
        assert_eq!(forward.uuid_v7_time(), Some(created));

        // A renewed command is another message, at the same time; each round its own.
        let mut renewed = saga.clone();
        renewed.command_round = 1;
        let round_one = renewed.command_id(0, Direction::Forward);
        assert_ne!(round_one, forward);
        assert_eq!(round_one.uuid_v7_time(), Some(created));
        renewed.command_round = 2;
        assert_ne!(renewed.command_id(0, Direction::Forward), round_one);
        // The definition version is not part of it: a saga keeps one version.
        let mut other_version = saga.clone();
        other_version.definition_version = 2;
        assert_eq!(other_version.command_id(0, Direction::Forward), forward);
    }

    fn two_steps() -> SagaDefinition {
        "name = \"trip\"\n[[steps]]\nname = \"flight\"\nconsumer_type = \"flight\"\n\
         command = \"book_flight\"\ncompensation = \"cancel_flight\"\ntimeout = \"5s\"\n\
         [[steps]]\nname = \"notify\"\nconsumer_type = \"notify\"\ncommand = \"send\"\ntimeout = \"5s\"\n"
            .parse()
            .unwrap()
    }

    #[test]
    fn a_start_message_gives_one_saga_id_per_message_and_saga() {
        let definition = two_steps();
        let v7 = MessageId::new_v7();
        let start =
            Envelope::new(v7.clone(), "trip", serde_json::json!({"trip_id": "t-1"})).unwrap();
        let earlier = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let first = SagaInstance::from_start(&definition, &start, earlier).unwrap();
        let again = SagaInstance::from_start(&definition, &start, Utc::now()).unwrap();
        assert_eq!(
            first.id, again.id,
            "a redelivered start names the same saga"
        );
        assert_eq!(first.id, SagaInstance::start_id("trip", &v7));
        assert_ne!(first.id, SagaInstance::start_id("checkout", &v7));
        assert_ne!(
            first.id,
            SagaInstance::start_id("trip", &MessageId::new_v7()),
            "another request, another saga"
        );
        // A UUIDv7 start keeps its time in the saga id, a plain id gives a UUID too.
        let saga_uuid = uuid::Uuid::parse_str(&first.id).unwrap();
        assert_eq!(saga_uuid.get_version_num(), 7);
        let plain = SagaInstance::start_id("trip", &MessageId::new("order-42").unwrap());
        assert!(uuid::Uuid::parse_str(&plain).is_ok(), "{plain}");
        assert_eq!(
            (
                first.saga_name.as_str(),
                first.status,
                first.current_step,
                first.version
            ),
            ("trip", SagaStatus::Running, 0, 0)
        );
        assert_eq!(first.data, start.payload);
        assert_eq!(first.created_at, earlier);
    }

    #[test]
    fn a_start_message_for_another_saga_or_with_a_saga_id_is_refused() {
        let definition = two_steps();
        let wrong = Envelope::new(MessageId::new_v7(), "checkout", Value::Null).unwrap();
        let error = SagaInstance::from_start(&definition, &wrong, Utc::now()).unwrap_err();
        assert!(
            matches!(&error, StartError::WrongSaga { saga, kind } if saga == "trip" && kind == "checkout"),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("kind is the name of the saga"),
            "{error}"
        );
        let with_id = Envelope::new(MessageId::new_v7(), "trip", Value::Null)
            .unwrap()
            .with_saga_id("mine");
        let error = SagaInstance::from_start(&definition, &with_id, Utc::now()).unwrap_err();
        assert!(matches!(error, StartError::SagaIdGiven { .. }), "{error:?}");
    }

    #[test]
    fn statuses_round_trip() {
        for status in [
            SagaStatus::Running,
            SagaStatus::Compensating,
            SagaStatus::Completed,
            SagaStatus::Compensated,
        ] {
            assert_eq!(status.as_str().parse::<SagaStatus>(), Ok(status));
            let state = SagaState::Status(status);
            assert_eq!(state.to_string().parse::<SagaState>(), Ok(state));
        }
        assert_eq!("parked".parse::<SagaState>(), Ok(SagaState::Parked));
        assert!("done".parse::<SagaStatus>().is_err());
        assert!("stuck".parse::<SagaState>().is_err());
    }
}
