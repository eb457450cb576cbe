//! `sagabox saga`: list sagas, show one's timeline from its history, and retry or cancel
//! a stuck one — through the library's [`SagaStore`] and [`sagabox::saga::operator`], so
//! each action is safe while orchestrators run.

use std::collections::HashMap;
use std::fmt::{self, Display};

use chrono::{DateTime, Utc};
use clap::{Subcommand, ValueEnum};
use sagabox::InboxError;
use sagabox::database::open_migrated;
use sagabox::saga::operator::{self, OperatorError};
use sagabox::saga::versions::stored_definition;
use sagabox::saga::{
    HistoryEntry, SagaDefinition, SagaFilter, SagaInstance, SagaState, SagaStatus, SagaStore,
};
use serde::Serialize;

use crate::args::DEFAULT_DATABASE_URL;

/// Connections an operator command needs.
const CONNECTIONS: u32 = 2;

/// What `sagabox saga` does.
#[derive(Debug, Subcommand)]
pub(crate) enum SagaCommand {
    /// List sagas, newest first: id, definition, state, step, attempts, age, last error.
    List {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// Only sagas in this state.
        #[arg(long)]
        status: Option<StateArg>,
        /// Only sagas of this definition (its `name`).
        #[arg(long, value_name = "NAME")]
        saga: Option<String>,
        /// At most this many (1 to 10000).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one saga and its timeline: each step's attempts, replies, durations and errors.
    Show {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// The saga's id.
        id: String,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Send a parked saga on from where it stopped (after fixing what parked it); the
    /// next orchestrator resume pass drives it.
    Retry {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// The saga's id.
        id: String,
        /// Why, recorded in the saga's history with who did it.
        #[arg(long, default_value = "retried by hand")]
        note: String,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a saga: compensate the steps it completed, in reverse order, then end it
    /// `compensated`. Refused once a step without compensation may have run.
    Cancel {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
        database_url: String,
        /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
        /// installation sharing a database its own.
        #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
        db_schema: sagabox::Schema,
        /// The saga's id.
        id: String,
        /// Why, recorded in the saga's history with who did it.
        #[arg(long, default_value = "cancelled by hand")]
        note: String,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

impl SagaCommand {
    /// The database the command works on.
    pub(crate) fn database_url(&self) -> &String {
        match self {
            SagaCommand::List { database_url, .. }
            | SagaCommand::Show { database_url, .. }
            | SagaCommand::Retry { database_url, .. }
            | SagaCommand::Cancel { database_url, .. } => database_url,
        }
    }

    /// The schema of sagabox's tables.
    pub(crate) fn schema(&self) -> &sagabox::Schema {
        match self {
            SagaCommand::List { db_schema, .. }
            | SagaCommand::Show { db_schema, .. }
            | SagaCommand::Retry { db_schema, .. }
            | SagaCommand::Cancel { db_schema, .. } => db_schema,
        }
    }

    /// Whether the answer is to be JSON.
    pub(crate) fn json(&self) -> bool {
        match self {
            SagaCommand::List { json, .. }
            | SagaCommand::Show { json, .. }
            | SagaCommand::Retry { json, .. }
            | SagaCommand::Cancel { json, .. } => *json,
        }
    }
}

/// A state to list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum StateArg {
    /// Running its steps, not parked.
    Running,
    /// Undoing its steps, not parked.
    Compensating,
    /// Every step done.
    Completed,
    /// Every completed step undone.
    Compensated,
    /// Waiting for an operator.
    Parked,
}

impl From<StateArg> for SagaState {
    fn from(state: StateArg) -> Self {
        match state {
            StateArg::Running => SagaState::Status(SagaStatus::Running),
            StateArg::Compensating => SagaState::Status(SagaStatus::Compensating),
            StateArg::Completed => SagaState::Status(SagaStatus::Completed),
            StateArg::Compensated => SagaState::Status(SagaStatus::Compensated),
            StateArg::Parked => SagaState::Parked,
        }
    }
}

/// Why a `saga` command failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SagaCommandError {
    /// The database could not be opened.
    #[error(transparent)]
    Open(#[from] InboxError),
    /// A query failed.
    #[error("cannot read the sagas: {0}")]
    Store(#[from] sqlx::Error),
    /// The saga is not there.
    #[error("no saga with id {0}: check the id with `sagabox saga list`")]
    NotFound(String),
    /// The operator's action was refused.
    #[error(transparent)]
    Refused(#[from] OperatorError),
}

/// Runs `command`; its answer prints as text or JSON.
pub(crate) async fn run(command: SagaCommand) -> Result<Answer, SagaCommandError> {
    let store = open_migrated(command.database_url(), command.schema(), CONNECTIONS).await?;
    on(&store, command).await
}

async fn on<St: SagaStore>(store: &St, command: SagaCommand) -> Result<Answer, SagaCommandError> {
    let mut steps = StepNames::default();
    match command {
        SagaCommand::List {
            status,
            saga,
            limit,
            ..
        } => {
            let filter = SagaFilter {
                state: status.map(SagaState::from),
                saga_name: saga,
                limit,
                ..SagaFilter::default()
            };
            let mut lines = Vec::new();
            for saga in store.list(&filter).await? {
                let step = steps.of(store, &saga).await;
                lines.push(SagaLine::new(&saga, step));
            }
            Ok(Answer::List(SagaList { sagas: lines }))
        }
        SagaCommand::Show { id, .. } => {
            let saga = store
                .load(&id)
                .await?
                .ok_or_else(|| SagaCommandError::NotFound(id.clone()))?;
            let history = store.history(&id).await?;
            let step = steps.of(store, &saga).await;
            Ok(Answer::Show(Box::new(SagaView::new(&saga, step, &history))))
        }
        SagaCommand::Retry { id, note, .. } => {
            let saga = operator::retry(store, &id, &signed(&note), Utc::now()).await?;
            let step = steps.of(store, &saga).await;
            Ok(Answer::Acted(Acted::new("retried", &saga, step)))
        }
        SagaCommand::Cancel { id, note, .. } => {
            let saga = operator::cancel(store, &id, &signed(&note), Utc::now()).await?;
            let step = steps.of(store, &saga).await;
            Ok(Answer::Acted(Acted::new("cancelled", &saga, step)))
        }
    }
}

/// The operator's note with who wrote it: the login name, as far as the process knows it.
pub(crate) fn signed(note: &str) -> String {
    let who = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "an operator".to_owned());
    format!("{who}: {note}")
}

/// Step names by definition version, read once each.
#[derive(Default)]
pub(crate) struct StepNames(HashMap<(String, u32), Option<SagaDefinition>>);

impl StepNames {
    /// The name of the step `saga` is at, when its definition version is stored.
    pub(crate) async fn of<St: SagaStore>(
        &mut self,
        store: &St,
        saga: &SagaInstance,
    ) -> Option<String> {
        let key = (saga.saga_name.clone(), saga.definition_version);
        if !self.0.contains_key(&key) {
            let definition = stored_definition(store, &key.0, key.1).await.ok();
            self.0.insert(key.clone(), definition);
        }
        let definition = self.0.get(&key)?.as_ref()?;
        let index = usize::try_from(saga.current_step).ok()?;
        definition
            .steps()
            .get(index)
            .map(|step| step.name().to_owned())
    }
}

/// What a `saga` command answers.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum Answer {
    /// `saga list`.
    List(SagaList),
    /// `saga show`.
    Show(Box<SagaView>),
    /// `saga retry`, `saga cancel`.
    Acted(Acted),
}

impl Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::List(list) => list.fmt(f),
            Answer::Show(view) => view.fmt(f),
            Answer::Acted(acted) => acted.fmt(f),
        }
    }
}

/// One saga in a list.
#[derive(Debug, Serialize)]
pub(crate) struct SagaLine {
    id: String,
    saga: String,
    definition_version: u32,
    state: &'static str,
    current_step: i32,
    step: Option<String>,
    attempts: i32,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    deadline_at: Option<DateTime<Utc>>,
    parked_reason: Option<String>,
    last_error: Option<String>,
}

impl SagaLine {
    fn new(saga: &SagaInstance, step: Option<String>) -> Self {
        Self {
            id: saga.id.clone(),
            saga: saga.saga_name.clone(),
            definition_version: saga.definition_version,
            state: saga.state().as_str(),
            current_step: saga.current_step,
            step,
            attempts: saga.attempts,
            created_at: saga.created_at,
            updated_at: saga.updated_at,
            deadline_at: saga.deadline_at,
            parked_reason: saga.parked.clone(),
            last_error: saga.last_error.clone(),
        }
    }

    fn step_text(&self) -> String {
        match (&self.step, self.state) {
            (_, "completed" | "compensated") => "-".to_owned(),
            (Some(step), _) => step.clone(),
            (None, _) => format!("#{}", self.current_step),
        }
    }
}

/// `saga list`'s answer.
#[derive(Debug, Serialize)]
pub(crate) struct SagaList {
    sagas: Vec<SagaLine>,
}

impl Display for SagaList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.sagas.is_empty() {
            return writeln!(f, "no sagas match");
        }
        writeln!(
            f,
            "{:<36}  {:<12} {:<12} {:<12} {:>8}  {:<20}  last error",
            "id", "saga", "state", "step", "attempts", "updated"
        )?;
        for line in &self.sagas {
            let error = line
                .parked_reason
                .as_deref()
                .or(line.last_error.as_deref())
                .unwrap_or("");
            writeln!(
                f,
                "{:<36}  {:<12} {:<12} {:<12} {:>8}  {:<20}  {}",
                line.id,
                format!("{} v{}", line.saga, line.definition_version),
                line.state,
                line.step_text(),
                line.attempts,
                line.updated_at.format("%Y-%m-%d %H:%M:%S"),
                shorten(error, 80)
            )?;
        }
        Ok(())
    }
}

/// One event of a timeline.
#[derive(Debug, Serialize)]
pub(crate) struct TimelineEntry {
    at: DateTime<Utc>,
    /// Milliseconds since the saga started.
    offset_ms: i64,
    version: i64,
    kind: &'static str,
    step: Option<String>,
    direction: Option<&'static str>,
    attempt: Option<i32>,
    duration_ms: Option<u128>,
    detail: Option<String>,
}

/// `saga show`'s answer.
#[derive(Debug, Serialize)]
pub(crate) struct SagaView {
    saga: SagaLine,
    data: serde_json::Value,
    timeline: Vec<TimelineEntry>,
}

impl SagaView {
    fn new(saga: &SagaInstance, step: Option<String>, history: &[HistoryEntry]) -> Self {
        let timeline = history
            .iter()
            .map(|entry| {
                let event = &entry.event;
                TimelineEntry {
                    at: event.at,
                    offset_ms: (event.at - saga.created_at).num_milliseconds(),
                    version: entry.version,
                    kind: event.kind.as_str(),
                    step: event.step.clone(),
                    direction: event.direction.map(|d| d.as_str()),
                    attempt: event.attempt,
                    duration_ms: event.duration.map(|d| d.as_millis()),
                    detail: event.detail.clone(),
                }
            })
            .collect();
        Self {
            saga: SagaLine::new(saga, step),
            data: saga.data.clone(),
            timeline,
        }
    }
}

impl Display for SagaView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.saga;
        writeln!(f, "saga {} ({} v{})", s.id, s.saga, s.definition_version)?;
        writeln!(f, "  state      {}", s.state)?;
        writeln!(
            f,
            "  step       {} (attempts {})",
            s.step_text(),
            s.attempts
        )?;
        writeln!(f, "  created    {}", s.created_at.to_rfc3339())?;
        writeln!(f, "  updated    {}", s.updated_at.to_rfc3339())?;
        if let Some(deadline) = s.deadline_at {
            writeln!(f, "  deadline   {}", deadline.to_rfc3339())?;
        }
        if let Some(reason) = &s.parked_reason {
            writeln!(f, "  parked     {reason}")?;
        }
        if let Some(error) = &s.last_error {
            writeln!(f, "  last error {error}")?;
        }
        writeln!(f, "  data       {}", self.data)?;
        writeln!(f, "timeline")?;
        if self.timeline.is_empty() {
            writeln!(f, "  (no history recorded)")?;
        }
        for entry in &self.timeline {
            let what = match (&entry.step, entry.direction) {
                (Some(step), Some("backward")) => format!("undo {step}: {}", entry.kind),
                (Some(step), _) => format!("{step}: {}", entry.kind),
                (None, _) => entry.kind.to_owned(),
            };
            let mut notes = Vec::new();
            if let Some(attempt) = entry.attempt {
                notes.push(format!("attempt {attempt}"));
            }
            if let Some(ms) = entry.duration_ms {
                notes.push(format!("{ms} ms"));
            }
            if let Some(detail) = &entry.detail {
                notes.push(detail.clone());
            }
            let notes = if notes.is_empty() {
                String::new()
            } else {
                format!("  ({})", notes.join(", "))
            };
            writeln!(
                f,
                "  {:>+10.3}s  {what}{notes}",
                entry.offset_ms as f64 / 1000.0
            )?;
        }
        Ok(())
    }
}

/// `saga retry` / `saga cancel`'s answer: the saga as the action left it.
#[derive(Debug, Serialize)]
pub(crate) struct Acted {
    action: &'static str,
    saga: SagaLine,
}

impl Acted {
    fn new(action: &'static str, saga: &SagaInstance, step: Option<String>) -> Self {
        Self {
            action,
            saga: SagaLine::new(saga, step),
        }
    }
}

impl Display for Acted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "saga {} {}: now {} at step {}; an orchestrator's next resume pass drives it",
            self.saga.id,
            self.action,
            self.saga.state,
            self.saga.step_text()
        )
    }
}

/// `text`, cut to `max` characters with an ellipsis.
fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let cut: String = text.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}
