//! [`SagaDefinition`]: the steps of a saga, their consumers, commands, compensations,
//! timeouts and retry policies, read from TOML and validated once.
//!
//! The TOML is first read into private raw structs that mirror the file, then checked
//! and converted into the public types. The public types have no other constructor, so
//! a [`SagaDefinition`] that exists is a valid one: the orchestrator never re-checks it.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use rand::RngExt;
use serde::{Deserialize, Serialize};

use crate::envelope::{ConsumerType, KeyError, validate_key};

/// Why a saga definition was refused.
///
/// Every variant about a step names the saga and the step, and says how to fix it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DefinitionError {
    /// The definition file could not be read.
    #[error("cannot read saga definition {}: {source}; check the path and its permissions", path.display())]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid TOML, or does not have the shape of a saga definition (a
    /// missing or unknown field, a value of the wrong type, a malformed duration).
    #[error("{} is invalid, fix it where shown: {message}", origin(path.as_deref()))]
    Syntax {
        /// The file the text came from, when it came from a file.
        path: Option<PathBuf>,
        /// The parser's message, with the line and column of the problem.
        message: String,
    },
    /// The saga's name is empty or blank.
    #[error("saga name is empty: set `name = \"…\"` at the top of the definition")]
    EmptySagaName,
    /// The saga's name is too long or contains a control character.
    #[error("saga name {name:?} is invalid: {source}")]
    InvalidSagaName {
        /// The refused name.
        name: String,
        /// What is wrong with it.
        #[source]
        source: KeyError,
    },
    /// The saga has no steps.
    #[error("saga `{saga}` has no steps: add at least one `[[steps]]` table")]
    NoSteps {
        /// The saga.
        saga: String,
    },
    /// The saga's version is 0.
    #[error("saga `{saga}` has version 0: versions count from 1 (leave `version` out for 1)")]
    ZeroVersion {
        /// The saga.
        saga: String,
    },
    /// The saga's deadline is zero.
    #[error(
        "saga `{saga}` has a zero deadline, which would cancel every saga at once: \
         set a duration such as `deadline = \"15m\"`, or leave it out for none"
    )]
    ZeroDeadline {
        /// The saga.
        saga: String,
    },
    /// A step's name is empty, too long or contains a control character.
    #[error("step #{position} of saga `{saga}` has an invalid name: {source}")]
    InvalidStepName {
        /// The saga.
        saga: String,
        /// The step's position in the saga, counted from 1.
        position: usize,
        /// What is wrong with the name.
        #[source]
        source: KeyError,
    },
    /// Two steps have the same name.
    #[error("saga `{saga}` has more than one step named `{step}`: give every step a unique name")]
    DuplicateStep {
        /// The saga.
        saga: String,
        /// The repeated name.
        step: String,
    },
    /// A step's `consumer_type` is not a valid [`ConsumerType`].
    #[error(
        "step `{step}` of saga `{saga}` has an invalid consumer_type: {source}; \
         set it to the name of the consumer that runs the step"
    )]
    InvalidConsumerType {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
        /// What is wrong with the consumer type.
        #[source]
        source: KeyError,
    },
    /// A step's `command` is not a valid message kind.
    #[error(
        "step `{step}` of saga `{saga}` has an invalid command: {source}; \
         set it to the message kind the step's consumer handles"
    )]
    InvalidCommand {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
        /// What is wrong with the command.
        #[source]
        source: KeyError,
    },
    /// A step's `compensation` is not a valid message kind.
    #[error(
        "step `{step}` of saga `{saga}` has an invalid compensation: {source}; \
         set it to the message kind that undoes the step, or remove it"
    )]
    InvalidCompensation {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
        /// What is wrong with the compensation.
        #[source]
        source: KeyError,
    },
    /// A step's timeout is zero.
    #[error(
        "step `{step}` of saga `{saga}` has a zero timeout: every attempt would time out at once; \
         set `timeout` to how long the step may take (for example \"5s\")"
    )]
    ZeroTimeout {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
    },
    /// A step's `max_attempts` is zero.
    #[error(
        "step `{step}` of saga `{saga}` has max_attempts = 0, so it could never run: \
         set it to at least 1, or remove it to retry until success"
    )]
    ZeroMaxAttempts {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
    },
    /// A step's initial backoff is zero.
    #[error(
        "step `{step}` of saga `{saga}` has a zero initial_backoff: retries would hammer the consumer; \
         set it to at least a few milliseconds"
    )]
    ZeroInitialBackoff {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
    },
    /// A step's initial backoff is longer than its maximum backoff.
    #[error(
        "step `{step}` of saga `{saga}` has initial_backoff {initial:?} above max_backoff {max:?}: \
         lower initial_backoff or raise max_backoff"
    )]
    InitialBackoffAboveMax {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
        /// The initial backoff.
        initial: Duration,
        /// The maximum backoff.
        max: Duration,
    },
    /// A step's backoff multiplier is below 1, infinite or not a number.
    #[error(
        "step `{step}` of saga `{saga}` has backoff multiplier {multiplier}: \
         it must be a finite number of at least 1 (2.0 doubles each delay)"
    )]
    InvalidMultiplier {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
        /// The refused multiplier.
        multiplier: f64,
    },
    /// A step's jitter is outside `0..=1`.
    #[error(
        "step `{step}` of saga `{saga}` has jitter {jitter}: it is the fraction of each delay \
         that is randomised and must lie between 0 and 1 (0.2 is typical)"
    )]
    InvalidJitter {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
        /// The refused jitter.
        jitter: f64,
    },
    /// A step without a compensation comes before a step with one: if the later step
    /// failed for good, the earlier one could not be undone.
    #[error(
        "step `{step}` of saga `{saga}` has no compensation but the later step `{compensated_step}` has one: \
         if `{compensated_step}` failed for good, `{step}` could not be undone; \
         give `{step}` a compensation, or move it after every step that has one"
    )]
    MissingCompensation {
        /// The saga.
        saga: String,
        /// The step without a compensation.
        step: String,
        /// The first later step that has a compensation.
        compensated_step: String,
    },
    /// A step without a compensation has a bounded number of attempts: once it gave up,
    /// the saga could neither finish nor be undone.
    #[error(
        "step `{step}` of saga `{saga}` has no compensation, so it must be retried until it succeeds, \
         but max_attempts is {max_attempts}: remove max_attempts, or give the step a compensation"
    )]
    BoundedRetryWithoutCompensation {
        /// The saga.
        saga: String,
        /// The step.
        step: String,
        /// The refused bound.
        max_attempts: u32,
    },
}

fn origin(path: Option<&Path>) -> String {
    match path {
        Some(path) => format!("saga definition {}", path.display()),
        None => "saga definition".to_owned(),
    }
}

/// A validated saga: its name and its steps, in the order they run.
///
/// Steps with a compensation come first and steps without one come last; a step without
/// a compensation is retried until it succeeds. The only constructors,
/// [`from_toml_str`](Self::from_toml_str) and [`load`](Self::load), enforce this and the
/// rest of the rules listed on [`DefinitionError`].
///
/// ```
/// use sagabox::saga::SagaDefinition;
///
/// let saga = SagaDefinition::from_toml_str(r#"
///     name = "greet"
///
///     [[steps]]
///     name = "hello"
///     consumer_type = "greeter"
///     command = "say_hello"
///     timeout = "2s"
/// "#)?;
/// assert_eq!(saga.name(), "greet");
/// assert_eq!(saga.steps()[0].retry().max_attempts, None);
/// # Ok::<(), sagabox::saga::DefinitionError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SagaDefinition {
    name: String,
    version: u32,
    deadline: Option<Duration>,
    steps: Vec<StepDefinition>,
}

/// One validated step of a [`SagaDefinition`].
#[derive(Debug, Clone, PartialEq)]
pub struct StepDefinition {
    name: String,
    consumer_type: ConsumerType,
    command: String,
    compensation: Option<String>,
    timeout: Duration,
    retry: RetryPolicy,
}

/// How a step's command is retried after a timeout or a retryable error: exponential
/// backoff with a cap and jitter.
///
/// The delay before attempt `n` (counted from 1) is
/// `initial_backoff * multiplier^(n - 1)`, capped at `max_backoff`, then multiplied by a
/// random factor in `[1 - jitter, 1]`; see [`delay`](Self::delay).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// How many attempts in total, the first included; `None` retries until success.
    /// Defaults to `None`.
    pub max_attempts: Option<u32>,
    /// The delay before the second attempt. Defaults to 100 ms.
    pub initial_backoff: Duration,
    /// The longest delay between two attempts. Defaults to 10 s.
    pub max_backoff: Duration,
    /// The factor from one delay to the next; at least 1. Defaults to 2.0.
    pub multiplier: f64,
    /// The fraction of each delay that is randomised, in `0..=1`: 0.2 waits between 80 %
    /// and 100 % of the computed delay. Defaults to 0.2.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: None,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// Whether attempt number `attempt` (counted from 1; 0 is treated as 1) may run.
    pub fn allows(&self, attempt: u32) -> bool {
        let attempt = attempt.max(1);
        self.max_attempts.is_none_or(|max| attempt <= max)
    }

    /// The delay to wait before attempt number `attempt` (counted from 1; 0 is treated as
    /// 1): `initial_backoff * multiplier^(attempt - 1)`, capped at `max_backoff`, then
    /// multiplied by a uniform random factor in `[1 - jitter, 1]`, so it never exceeds
    /// `max_backoff`.
    ///
    /// It never overflows or panics, whatever the attempt number. A policy built by hand
    /// with out-of-range values is read leniently: a multiplier below 1 or not finite
    /// counts as 1, a jitter outside `0..=1` is clamped into it.
    pub fn delay<R: rand::Rng + ?Sized>(&self, attempt: u32, rng: &mut R) -> Duration {
        let exponent = attempt.max(1) - 1;
        let multiplier = if self.multiplier.is_finite() && self.multiplier >= 1.0 {
            self.multiplier
        } else {
            1.0
        };
        let exponent = i32::try_from(exponent).unwrap_or(i32::MAX);
        // Infinity when it overflows, which the cap below absorbs.
        let uncapped = self.initial_backoff.as_secs_f64() * multiplier.powi(exponent);
        let capped = uncapped.min(self.max_backoff.as_secs_f64());
        let jitter = if self.jitter.is_nan() {
            0.0
        } else {
            self.jitter.clamp(0.0, 1.0)
        };
        let factor = if jitter > 0.0 {
            rng.random_range(1.0 - jitter..=1.0)
        } else {
            1.0
        };
        // Rounding in the float round trip may land a few nanoseconds above the cap (or
        // overflow at `Duration::MAX`): the cap wins.
        Duration::try_from_secs_f64(capped * factor)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }
}

impl StepDefinition {
    /// The step's name, unique within its saga.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The consumer that runs the step; the inbox deduplicates its messages per
    /// `(consumer_type, message_id)`.
    pub fn consumer_type(&self) -> &ConsumerType {
        &self.consumer_type
    }

    /// The message kind sent to run the step.
    pub fn command(&self) -> &str {
        &self.command
    }

    /// The message kind sent to undo the step, or `None` for a step at the end of the
    /// saga that is retried until it succeeds.
    pub fn compensation(&self) -> Option<&str> {
        self.compensation.as_deref()
    }

    /// How long to wait for the step's reply before sending the command again.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How the step's command is retried.
    pub fn retry(&self) -> &RetryPolicy {
        &self.retry
    }
}

impl SagaDefinition {
    /// Parses and validates a saga definition written in TOML.
    pub fn from_toml_str(text: &str) -> Result<Self, DefinitionError> {
        parse(text, None)
    }

    /// Reads, parses and validates the saga definition in the TOML file at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, DefinitionError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| DefinitionError::Io {
            path: path.to_owned(),
            source,
        })?;
        parse(&text, Some(path))
    }

    /// The saga's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The definition's version (`version = N`, 1 when left out). A saga runs on the
    /// version it started under; change the steps under a new version number, so that
    /// sagas already running finish on the old ones.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// How long a saga may run (`deadline = "15m"`): past it, a saga still running is
    /// compensated, or parked for an operator when a step without compensation already
    /// ran. `None` when the definition sets none.
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// The definition in canonical TOML: every field written out, defaults included, in
    /// one order, without comments. Two files that define the same saga give the same
    /// text, and [`from_toml_str`](Self::from_toml_str) reads it back to an equal
    /// definition. This is what the orchestrator stores for each version it runs.
    pub fn to_canonical_toml(&self) -> String {
        let raw = RawSaga {
            name: self.name.clone(),
            version: Some(self.version),
            deadline: self.deadline,
            steps: self.steps.iter().map(RawStep::from).collect(),
        };
        // Every field is a string, a number or a table of them: serialising cannot fail.
        toml::to_string(&raw).unwrap_or_else(|error| format!("# unserialisable: {error}"))
    }

    /// A fingerprint of the definition's content: the hex SHA-1 name hash (a UUIDv5) of
    /// its [canonical TOML](Self::to_canonical_toml). Equal definitions have equal
    /// fingerprints, whatever their comments or layout.
    pub fn fingerprint(&self) -> String {
        uuid::Uuid::new_v5(&FINGERPRINT_NAMESPACE, self.to_canonical_toml().as_bytes())
            .simple()
            .to_string()
    }

    /// The steps, in the order they run.
    pub fn steps(&self) -> &[StepDefinition] {
        &self.steps
    }

    /// The step named `name`, if there is one.
    pub fn step_by_name(&self, name: &str) -> Option<&StepDefinition> {
        self.steps.iter().find(|step| step.name == name)
    }

    /// The position (from 0) of the step named `name`, if there is one.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.steps.iter().position(|step| step.name == name)
    }

    /// The consumer types of the steps, each once, in order of name: the participants a
    /// deployment of this saga needs.
    pub fn consumer_types(&self) -> Vec<ConsumerType> {
        let types: std::collections::BTreeSet<&ConsumerType> = self
            .steps
            .iter()
            .map(StepDefinition::consumer_type)
            .collect();
        types.into_iter().cloned().collect()
    }

    /// The message kinds `consumer_type` takes in this saga: its steps' commands and
    /// compensations — what its participant's step should accept
    /// (`StepOptions::kinds`).
    pub fn kinds_for(&self, consumer_type: &ConsumerType) -> std::collections::BTreeSet<String> {
        self.steps_of(consumer_type)
            .flat_map(|step| {
                std::iter::once(step.command().to_owned())
                    .chain(step.compensation().map(str::to_owned))
            })
            .collect()
    }

    /// The longest timeout of `consumer_type`'s steps: how long the orchestrator waits
    /// for one of its commands, so how long a participant may let one run. `None` when
    /// no step is `consumer_type`'s.
    pub fn timeout_for(&self, consumer_type: &ConsumerType) -> Option<Duration> {
        self.steps_of(consumer_type)
            .map(StepDefinition::timeout)
            .max()
    }

    fn steps_of<'a>(
        &'a self,
        consumer_type: &'a ConsumerType,
    ) -> impl Iterator<Item = &'a StepDefinition> {
        self.steps
            .iter()
            .filter(move |step| step.consumer_type() == consumer_type)
    }
}

impl FromStr for SagaDefinition {
    type Err = DefinitionError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::from_toml_str(text)
    }
}

impl fmt::Display for SagaDefinition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)?;
        for (index, step) in self.steps.iter().enumerate() {
            let arrow = if index == 0 { ": " } else { " → " };
            write!(f, "{arrow}{}", step.name)?;
        }
        Ok(())
    }
}

/// The namespace of definition fingerprints (a UUIDv5 name space of its own).
const FINGERPRINT_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x5a6a_b0c5_d3f1_4e0b_9a51_7c0d_e1f1_a7e5);

/// The file as written, before validation; also the shape of the canonical TOML.
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawSaga {
    #[serde(default)]
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    version: Option<u32>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    deadline: Option<Duration>,
    #[serde(default)]
    steps: Vec<RawStep>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawStep {
    #[serde(default)]
    name: String,
    consumer_type: String,
    command: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    compensation: Option<String>,
    #[serde(with = "humantime_serde")]
    timeout: Duration,
    #[serde(default)]
    retry: RawRetry,
}

#[derive(Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawRetry {
    #[serde(skip_serializing_if = "Option::is_none")]
    max_attempts: Option<u32>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    initial_backoff: Option<Duration>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    max_backoff: Option<Duration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    multiplier: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    jitter: Option<f64>,
}

impl From<&StepDefinition> for RawStep {
    fn from(step: &StepDefinition) -> Self {
        Self {
            name: step.name.clone(),
            consumer_type: step.consumer_type.as_str().to_owned(),
            command: step.command.clone(),
            compensation: step.compensation.clone(),
            timeout: step.timeout,
            retry: RawRetry {
                max_attempts: step.retry.max_attempts,
                initial_backoff: Some(step.retry.initial_backoff),
                max_backoff: Some(step.retry.max_backoff),
                multiplier: Some(step.retry.multiplier),
                jitter: Some(step.retry.jitter),
            },
        }
    }
}

fn parse(text: &str, path: Option<&Path>) -> Result<SagaDefinition, DefinitionError> {
    let raw: RawSaga = toml::from_str(text).map_err(|error| DefinitionError::Syntax {
        path: path.map(Path::to_owned),
        message: error.to_string().trim_end().to_owned(),
    })?;
    validate(raw)
}

fn validate(raw: RawSaga) -> Result<SagaDefinition, DefinitionError> {
    if raw.name.trim().is_empty() {
        return Err(DefinitionError::EmptySagaName);
    }
    if let Err(source) = validate_key("saga name", &raw.name) {
        return Err(DefinitionError::InvalidSagaName {
            name: raw.name,
            source,
        });
    }
    let saga = raw.name;
    if raw.steps.is_empty() {
        return Err(DefinitionError::NoSteps { saga });
    }
    let version = raw.version.unwrap_or(1);
    if version == 0 {
        return Err(DefinitionError::ZeroVersion { saga });
    }
    if raw.deadline.is_some_and(|deadline| deadline.is_zero()) {
        return Err(DefinitionError::ZeroDeadline { saga });
    }

    let mut names = HashSet::new();
    let mut steps = Vec::with_capacity(raw.steps.len());
    for (index, raw_step) in raw.steps.into_iter().enumerate() {
        let step = validate_step(&saga, index, raw_step)?;
        if !names.insert(step.name.clone()) {
            return Err(DefinitionError::DuplicateStep {
                saga,
                step: step.name,
            });
        }
        steps.push(step);
    }

    // Compensated steps first, uncompensated ones last: the first uncompensated step must
    // not be followed by a compensated one.
    if let Some(first_uncompensated) = steps.iter().position(|s| s.compensation.is_none())
        && let Some(compensated) = steps[first_uncompensated..]
            .iter()
            .find(|s| s.compensation.is_some())
    {
        return Err(DefinitionError::MissingCompensation {
            step: steps[first_uncompensated].name.clone(),
            compensated_step: compensated.name.clone(),
            saga,
        });
    }
    // Once past the compensated steps the saga can only go forward: every step left must
    // be retried until it succeeds.
    if let Some((step, max_attempts)) = steps
        .iter()
        .filter(|s| s.compensation.is_none())
        .find_map(|s| Some((s, s.retry.max_attempts?)))
    {
        return Err(DefinitionError::BoundedRetryWithoutCompensation {
            step: step.name.clone(),
            max_attempts,
            saga,
        });
    }

    Ok(SagaDefinition {
        name: saga,
        version,
        deadline: raw.deadline,
        steps,
    })
}

fn validate_step(
    saga: &str,
    index: usize,
    raw: RawStep,
) -> Result<StepDefinition, DefinitionError> {
    validate_key("step name", &raw.name).map_err(|source| DefinitionError::InvalidStepName {
        saga: saga.to_owned(),
        position: index + 1,
        source,
    })?;
    let name = raw.name;
    let at = || (saga.to_owned(), name.clone());

    let consumer_type = ConsumerType::new(raw.consumer_type).map_err(|source| {
        let (saga, step) = at();
        DefinitionError::InvalidConsumerType { saga, step, source }
    })?;
    validate_key("message kind", &raw.command).map_err(|source| {
        let (saga, step) = at();
        DefinitionError::InvalidCommand { saga, step, source }
    })?;
    if let Some(compensation) = &raw.compensation {
        validate_key("message kind", compensation).map_err(|source| {
            let (saga, step) = at();
            DefinitionError::InvalidCompensation { saga, step, source }
        })?;
    }
    if raw.timeout.is_zero() {
        let (saga, step) = at();
        return Err(DefinitionError::ZeroTimeout { saga, step });
    }

    let defaults = RetryPolicy::default();
    let retry = RetryPolicy {
        max_attempts: raw.retry.max_attempts,
        initial_backoff: raw
            .retry
            .initial_backoff
            .unwrap_or(defaults.initial_backoff),
        max_backoff: raw.retry.max_backoff.unwrap_or(defaults.max_backoff),
        multiplier: raw.retry.multiplier.unwrap_or(defaults.multiplier),
        jitter: raw.retry.jitter.unwrap_or(defaults.jitter),
    };
    if retry.max_attempts == Some(0) {
        let (saga, step) = at();
        return Err(DefinitionError::ZeroMaxAttempts { saga, step });
    }
    if retry.initial_backoff.is_zero() {
        let (saga, step) = at();
        return Err(DefinitionError::ZeroInitialBackoff { saga, step });
    }
    if retry.initial_backoff > retry.max_backoff {
        let (saga, step) = at();
        return Err(DefinitionError::InitialBackoffAboveMax {
            saga,
            step,
            initial: retry.initial_backoff,
            max: retry.max_backoff,
        });
    }
    if !(retry.multiplier.is_finite() && retry.multiplier >= 1.0) {
        let (saga, step) = at();
        return Err(DefinitionError::InvalidMultiplier {
            saga,
            step,
            multiplier: retry.multiplier,
        });
    }
    if !(0.0..=1.0).contains(&retry.jitter) {
        let (saga, step) = at();
        return Err(DefinitionError::InvalidJitter {
            saga,
            step,
            jitter: retry.jitter,
        });
    }

    Ok(StepDefinition {
        name,
        consumer_type,
        command: raw.command,
        compensation: raw.compensation,
        timeout: raw.timeout,
        retry,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    const CHECKOUT: &str = include_str!("../../sagas/checkout.toml");

    /// A valid saga `order` of two steps, `first` (compensated) then `second` (not), with
    /// `first_extra` and `second_extra` appended to their tables.
    fn saga_with(first_extra: &str, second_extra: &str) -> String {
        format!(
            r#"
            name = "order"

            [[steps]]
            name = "first"
            consumer_type = "payment"
            command = "charge"
            compensation = "refund"
            timeout = "5s"
            {first_extra}

            [[steps]]
            name = "second"
            consumer_type = "email"
            command = "send"
            timeout = "5s"
            {second_extra}
            "#
        )
    }

    fn refused(text: &str) -> DefinitionError {
        match SagaDefinition::from_toml_str(text) {
            Ok(saga) => panic!("accepted an invalid definition: {saga:?}"),
            Err(error) => error,
        }
    }

    fn assert_names(error: &DefinitionError, step: &str) {
        let message = error.to_string();
        assert!(message.contains("saga `order`"), "{message}");
        assert!(message.contains(&format!("step `{step}`")), "{message}");
    }

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: None,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(2),
            multiplier: 2.0,
            jitter: 0.0,
        }
    }

    #[test]
    fn a_definition_names_its_participants_their_kinds_and_timeouts() {
        let saga: SagaDefinition = r#"
            name = "trip"
            [[steps]]
            name = "flight"
            consumer_type = "travel"
            command = "book_flight"
            compensation = "cancel_flight"
            timeout = "5s"
            [[steps]]
            name = "hotel"
            consumer_type = "travel"
            command = "book_hotel"
            compensation = "cancel_hotel"
            timeout = "9s"
            [[steps]]
            name = "notify"
            consumer_type = "mail"
            command = "send_itinerary"
            timeout = "2s"
        "#
        .parse()
        .unwrap();
        let (travel, mail) = (
            ConsumerType::new("travel").unwrap(),
            ConsumerType::new("mail").unwrap(),
        );
        assert_eq!(saga.consumer_types(), [mail.clone(), travel.clone()]);
        assert_eq!(
            saga.kinds_for(&travel).into_iter().collect::<Vec<_>>(),
            ["book_flight", "book_hotel", "cancel_flight", "cancel_hotel"]
        );
        assert_eq!(
            saga.kinds_for(&mail).into_iter().collect::<Vec<_>>(),
            ["send_itinerary"]
        );
        assert_eq!(saga.timeout_for(&travel), Some(Duration::from_secs(9)));
        assert_eq!(saga.timeout_for(&ConsumerType::new("bank").unwrap()), None);
    }

    #[test]
    fn the_canonical_toml_reads_back_and_its_fingerprint_ignores_comments_and_layout() {
        let saga = SagaDefinition::from_toml_str(CHECKOUT).unwrap();
        assert_eq!((saga.version(), saga.deadline()), (1, None));
        let canonical = saga.to_canonical_toml();
        assert!(!canonical.contains('#'), "no comments: {canonical}");
        let again = SagaDefinition::from_toml_str(&canonical).unwrap();
        assert_eq!(again, saga, "the canonical text is the same definition");
        assert_eq!(again.to_canonical_toml(), canonical);
        assert_eq!(again.fingerprint(), saga.fingerprint());

        // Comments, blank lines and defaults written out change nothing.
        let bare: String = CHECKOUT
            .lines()
            .filter(|line| !line.trim_start().starts_with('#') && !line.trim().is_empty())
            .map(|line| format!("{line}\n"))
            .collect();
        let bare = SagaDefinition::from_toml_str(&bare).unwrap();
        assert_eq!(bare.fingerprint(), saga.fingerprint());
        let implicit = saga_with("", "");
        let explicit = implicit.replacen("name = \"order\"", "name = \"order\"\nversion = 1", 1);
        assert_eq!(
            SagaDefinition::from_toml_str(&explicit)
                .unwrap()
                .fingerprint(),
            SagaDefinition::from_toml_str(&implicit)
                .unwrap()
                .fingerprint()
        );

        // Any setting does.
        let fingerprint = |text: &str| SagaDefinition::from_toml_str(text).unwrap().fingerprint();
        let base = fingerprint(&implicit);
        for changed in [
            implicit.replacen("timeout = \"5s\"", "timeout = \"6s\"", 1),
            implicit.replacen("name = \"order\"", "name = \"order\"\nversion = 2", 1),
            implicit.replacen(
                "name = \"order\"",
                "name = \"order\"\ndeadline = \"15m\"",
                1,
            ),
            saga_with("[steps.retry]\nmax_attempts = 3", ""),
        ] {
            assert_ne!(fingerprint(&changed), base, "{changed}");
        }
    }

    #[test]
    fn a_version_and_a_deadline_are_read_and_zero_refused() {
        let text = saga_with("", "").replacen(
            "name = \"order\"",
            "name = \"order\"\nversion = 3\ndeadline = \"15m\"",
            1,
        );
        let saga = SagaDefinition::from_toml_str(&text).unwrap();
        assert_eq!(
            (saga.version(), saga.deadline()),
            (3, Some(Duration::from_secs(900)))
        );
        let zero =
            saga_with("", "").replacen("name = \"order\"", "name = \"order\"\nversion = 0", 1);
        assert!(matches!(
            refused(&zero),
            DefinitionError::ZeroVersion { .. }
        ));
        let zero = saga_with("", "").replacen(
            "name = \"order\"",
            "name = \"order\"\ndeadline = \"0s\"",
            1,
        );
        assert!(matches!(
            refused(&zero),
            DefinitionError::ZeroDeadline { .. }
        ));
    }

    #[test]
    fn checkout_loads() {
        let saga = SagaDefinition::from_toml_str(CHECKOUT).unwrap();
        assert_eq!(saga.name(), "checkout");
        let names: Vec<_> = saga.steps().iter().map(StepDefinition::name).collect();
        assert_eq!(names, ["payment", "inventory", "email"]);
        assert_eq!(saga.to_string(), "checkout: payment → inventory → email");

        let payment = saga.step_by_name("payment").unwrap();
        assert_eq!(payment.consumer_type().as_str(), "payment");
        assert_eq!(payment.command(), "charge");
        assert_eq!(payment.compensation(), Some("refund"));
        assert_eq!(payment.timeout(), Duration::from_secs(5));
        assert_eq!(
            payment.retry(),
            &RetryPolicy {
                max_attempts: Some(8),
                jitter: 0.2,
                ..policy()
            }
        );
        let inventory = saga.step_by_name("inventory").unwrap();
        assert_eq!(inventory.command(), "decrement_stock");
        assert_eq!(inventory.compensation(), Some("restock"));
        let email = saga.step_by_name("email").unwrap();
        assert_eq!(email.command(), "send_confirmation");
        assert_eq!(email.compensation(), None);
        assert_eq!(email.retry().max_attempts, None);

        assert_eq!(saga.index_of("inventory"), Some(1));
        assert_eq!(saga.index_of("shipping"), None);
        assert!(saga.step_by_name("shipping").is_none());
    }

    #[test]
    fn checkout_loads_from_its_file() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("sagas/checkout.toml");
        let loaded = SagaDefinition::load(&path).unwrap();
        assert_eq!(loaded, CHECKOUT.parse().unwrap());
    }

    #[test]
    fn retry_fields_default() {
        let saga = SagaDefinition::from_toml_str(&saga_with("", "")).unwrap();
        assert_eq!(saga.steps()[0].retry(), &RetryPolicy::default());
        let saga = SagaDefinition::from_toml_str(&saga_with(
            "[steps.retry]\nmax_attempts = 3\nmultiplier = 3\njitter = 0",
            "",
        ))
        .unwrap();
        let retry = saga.steps()[0].retry();
        assert_eq!(retry.max_attempts, Some(3));
        assert_eq!(retry.multiplier, 3.0);
        assert_eq!(retry.jitter, 0.0);
        assert_eq!(
            retry.initial_backoff,
            RetryPolicy::default().initial_backoff
        );
    }

    #[test]
    fn missing_file_is_an_io_error_with_the_path() {
        let error = SagaDefinition::load("/nonexistent/sagas/nope.toml").unwrap_err();
        assert!(matches!(error, DefinitionError::Io { .. }), "{error:?}");
        assert!(
            error.to_string().contains("/nonexistent/sagas/nope.toml"),
            "{error}"
        );
    }

    #[test]
    fn syntax_error_keeps_line_and_column() {
        let error = refused("name = \"order\"\n[[steps]]\nname = payment\n");
        assert!(
            matches!(error, DefinitionError::Syntax { path: None, .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains("line 3, column 8"), "{error}");
    }

    #[test]
    fn unknown_and_missing_fields_are_syntax_errors() {
        let error = refused(&saga_with("compensate = \"undo\"", ""));
        assert!(matches!(error, DefinitionError::Syntax { .. }), "{error:?}");
        assert!(error.to_string().contains("compensate"), "{error}");
        let error = refused(&saga_with("", "[steps.retry]\nmax_attempt = 3"));
        assert!(error.to_string().contains("max_attempt"), "{error}");
        let error = refused(
            "name = \"order\"\n[[steps]]\nname = \"a\"\nconsumer_type = \"c\"\ntimeout = \"1s\"\n",
        );
        assert!(error.to_string().contains("command"), "{error}");
        let error = refused(&saga_with("", "[steps.retry]\ninitial_backoff = \"soon\""));
        assert!(matches!(error, DefinitionError::Syntax { .. }), "{error:?}");
    }

    #[test]
    fn empty_saga_name() {
        let text = saga_with("", "").replace("name = \"order\"", "name = \" \"");
        assert!(matches!(refused(&text), DefinitionError::EmptySagaName));
        let text = saga_with("", "").replace("name = \"order\"", "");
        assert!(matches!(refused(&text), DefinitionError::EmptySagaName));
    }

    #[test]
    fn invalid_saga_name() {
        let text = saga_with("", "").replace("name = \"order\"", "name = \"or\\u0000der\"");
        let error = refused(&text);
        assert!(
            matches!(
                error,
                DefinitionError::InvalidSagaName {
                    source: KeyError::ControlCharacter { position: 2, .. },
                    ..
                }
            ),
            "{error:?}"
        );
    }

    #[test]
    fn no_steps() {
        let error = refused("name = \"order\"");
        assert!(
            matches!(error, DefinitionError::NoSteps { .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains("saga `order`"), "{error}");
    }

    #[test]
    fn invalid_step_name() {
        let text = saga_with("", "").replace("name = \"second\"", "name = \"\"");
        let error = refused(&text);
        assert!(
            matches!(
                error,
                DefinitionError::InvalidStepName {
                    position: 2,
                    source: KeyError::Empty { .. },
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("step #2 of saga `order`"),
            "{error}"
        );
    }

    #[test]
    fn duplicate_step_name() {
        let text = saga_with("", "").replace("name = \"second\"", "name = \"first\"");
        let error = refused(&text);
        assert!(
            matches!(error, DefinitionError::DuplicateStep { .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains("`first`"), "{error}");
        assert!(error.to_string().contains("saga `order`"), "{error}");
    }

    #[test]
    fn invalid_consumer_type() {
        let text = saga_with("", "").replace("\"email\"", &format!("\"{}\"", "e".repeat(256)));
        let error = refused(&text);
        assert!(
            matches!(
                error,
                DefinitionError::InvalidConsumerType {
                    source: KeyError::TooLong { len: 256, .. },
                    ..
                }
            ),
            "{error:?}"
        );
        assert_names(&error, "second");
    }

    #[test]
    fn invalid_command() {
        let text = saga_with("", "").replace("\"send\"", "\"\"");
        let error = refused(&text);
        assert!(
            matches!(
                error,
                DefinitionError::InvalidCommand {
                    source: KeyError::Empty { .. },
                    ..
                }
            ),
            "{error:?}"
        );
        assert_names(&error, "second");
    }

    #[test]
    fn invalid_compensation() {
        let text = saga_with("", "").replace("\"refund\"", "\"re\\nfund\"");
        let error = refused(&text);
        assert!(
            matches!(
                error,
                DefinitionError::InvalidCompensation {
                    source: KeyError::ControlCharacter { .. },
                    ..
                }
            ),
            "{error:?}"
        );
        assert_names(&error, "first");
    }

    #[test]
    fn zero_timeout() {
        let text = saga_with("", "").replacen("\"5s\"", "\"0s\"", 1);
        let error = refused(&text);
        assert!(
            matches!(error, DefinitionError::ZeroTimeout { .. }),
            "{error:?}"
        );
        assert_names(&error, "first");
    }

    #[test]
    fn zero_max_attempts() {
        let error = refused(&saga_with("[steps.retry]\nmax_attempts = 0", ""));
        assert!(
            matches!(error, DefinitionError::ZeroMaxAttempts { .. }),
            "{error:?}"
        );
        assert_names(&error, "first");
    }

    #[test]
    fn zero_initial_backoff() {
        let error = refused(&saga_with("[steps.retry]\ninitial_backoff = \"0ms\"", ""));
        assert!(
            matches!(error, DefinitionError::ZeroInitialBackoff { .. }),
            "{error:?}"
        );
        assert_names(&error, "first");
    }

    #[test]
    fn initial_backoff_above_max() {
        let error = refused(&saga_with(
            "[steps.retry]\ninitial_backoff = \"3s\"\nmax_backoff = \"2s\"",
            "",
        ));
        assert!(
            matches!(error, DefinitionError::InitialBackoffAboveMax { .. }),
            "{error:?}"
        );
        assert_names(&error, "first");
    }

    #[test]
    fn invalid_multiplier() {
        for multiplier in ["0.5", "nan", "inf"] {
            let error = refused(&saga_with(
                "",
                &format!("[steps.retry]\nmultiplier = {multiplier}"),
            ));
            assert!(
                matches!(error, DefinitionError::InvalidMultiplier { .. }),
                "{error:?}"
            );
            assert_names(&error, "second");
        }
    }

    #[test]
    fn invalid_jitter() {
        for jitter in ["-0.1", "1.5", "nan"] {
            let error = refused(&saga_with("", &format!("[steps.retry]\njitter = {jitter}")));
            assert!(
                matches!(error, DefinitionError::InvalidJitter { .. }),
                "{error:?}"
            );
            assert_names(&error, "second");
        }
    }

    #[test]
    fn missing_compensation() {
        // `first` has none, `second` has one: `first` could not be undone.
        let text =
            saga_with("", "compensation = \"unsend\"").replace("compensation = \"refund\"", "");
        let error = refused(&text);
        assert!(
            matches!(
                &error,
                DefinitionError::MissingCompensation { step, compensated_step, .. }
                    if step == "first" && compensated_step == "second"
            ),
            "{error:?}"
        );
        assert_names(&error, "first");
    }

    #[test]
    fn bounded_retry_without_compensation() {
        let error = refused(&saga_with("", "[steps.retry]\nmax_attempts = 5"));
        assert!(
            matches!(
                error,
                DefinitionError::BoundedRetryWithoutCompensation {
                    max_attempts: 5,
                    ..
                }
            ),
            "{error:?}"
        );
        assert_names(&error, "second");
    }

    #[test]
    fn every_step_may_be_compensated() {
        let text = saga_with(
            "",
            "compensation = \"unsend\"\n[steps.retry]\nmax_attempts = 5",
        );
        let saga = SagaDefinition::from_toml_str(&text).unwrap();
        assert_eq!(saga.steps()[1].compensation(), Some("unsend"));
    }

    #[test]
    fn allows_counts_attempts_from_one() {
        let bounded = RetryPolicy {
            max_attempts: Some(3),
            ..policy()
        };
        assert!(bounded.allows(0));
        assert!(bounded.allows(1));
        assert!(bounded.allows(3));
        assert!(!bounded.allows(4));
        assert!(policy().allows(u32::MAX));
    }

    #[test]
    fn delay_doubles_until_the_cap() {
        let mut rng = StdRng::seed_from_u64(7);
        let policy = policy();
        let delays: Vec<_> = (0..=12)
            .map(|attempt| policy.delay(attempt, &mut rng))
            .collect();
        assert_eq!(delays[0], Duration::from_millis(20));
        assert_eq!(delays[1], Duration::from_millis(20));
        assert_eq!(delays[2], Duration::from_millis(40));
        assert_eq!(delays[7], Duration::from_millis(1280));
        assert_eq!(delays[8], Duration::from_secs(2));
        assert!(
            delays.windows(2).all(|pair| pair[0] <= pair[1]),
            "{delays:?}"
        );
        assert!(delays.iter().all(|delay| *delay <= policy.max_backoff));
    }

    #[test]
    fn huge_attempts_do_not_panic() {
        let mut rng = StdRng::seed_from_u64(7);
        let extreme = RetryPolicy {
            max_backoff: Duration::MAX,
            multiplier: f64::MAX,
            jitter: 1.0,
            ..policy()
        };
        for attempt in [u32::MAX - 1, u32::MAX, 1 << 31, 64, 1100] {
            assert!(policy().delay(attempt, &mut rng) <= Duration::from_secs(2));
            assert!(extreme.delay(attempt, &mut rng) <= Duration::MAX);
        }
        assert_eq!(
            RetryPolicy {
                jitter: 0.0,
                ..extreme
            }
            .delay(u32::MAX, &mut rng),
            Duration::MAX
        );
    }

    #[test]
    fn hand_built_out_of_range_policies_are_read_leniently() {
        let mut rng = StdRng::seed_from_u64(7);
        let odd = RetryPolicy {
            initial_backoff: Duration::from_secs(5),
            max_backoff: Duration::from_secs(1),
            multiplier: f64::NAN,
            jitter: f64::NAN,
            ..policy()
        };
        assert_eq!(odd.delay(3, &mut rng), Duration::from_secs(1));
        let shrinking = RetryPolicy {
            multiplier: 0.1,
            jitter: 7.0,
            ..policy()
        };
        assert!(shrinking.delay(5, &mut rng) <= Duration::from_millis(20));
    }

    proptest! {
        #[test]
        fn delay_stays_within_the_jitter_band_and_the_cap(
            attempt in any::<u32>(),
            initial_ms in 1u64..10_000,
            extra_ms in 0u64..100_000,
            multiplier in 1.0f64..10.0,
            jitter in 0.0f64..=1.0,
            seed in any::<u64>(),
        ) {
            let policy = RetryPolicy {
                max_attempts: None,
                initial_backoff: Duration::from_millis(initial_ms),
                max_backoff: Duration::from_millis(initial_ms + extra_ms),
                multiplier,
                jitter,
            };
            let unjittered = RetryPolicy { jitter: 0.0, ..policy.clone() };
            let mut rng = StdRng::seed_from_u64(seed);
            let full = unjittered.delay(attempt, &mut rng);
            let delay = policy.delay(attempt, &mut rng);
            prop_assert!(full <= policy.max_backoff);
            prop_assert!(delay <= full);
            // One microsecond of slack for float rounding.
            let floor = full.as_secs_f64() * (1.0 - jitter) - 1e-6;
            prop_assert!(delay.as_secs_f64() >= floor, "{delay:?} below {floor}");
            if attempt > 1 {
                prop_assert!(unjittered.delay(attempt - 1, &mut rng) <= full);
            }
        }
    }
}
