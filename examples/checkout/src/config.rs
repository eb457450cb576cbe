//! How the demo runs ([`DemoConfig`], [`DemoTransport`]) and why it could not
//! ([`DemoError`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sagabox::clock::ScaledClock;
use sagabox::inbox::InboxError;
use sagabox::orchestrator::DriveError;
use sagabox::saga::DefinitionError;
use sagabox::supervisor::ActorDied;

/// How the demo runs.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoConfig {
    /// Orders to place. With `resume`, the run being resumed keeps its own number: the
    /// orders it had not placed yet are placed then. Defaults to 1,000.
    pub orders: usize,
    /// Sagas in flight at once. Defaults to 32.
    pub concurrency: usize,
    /// Orders placed per second at most, evenly spaced; `None` places each as soon as
    /// fewer than `concurrency` sagas are in flight. A paced run measures a saga's time
    /// from start to end without the queueing of a full load. Defaults to `None`.
    pub pace: Option<f64>,
    /// Share of step commands delivered twice, concurrently. Defaults to 0.
    pub duplicate_rate: f64,
    /// Share of replies dropped after the step committed. Defaults to 0.
    pub lost_reply_rate: f64,
    /// Share of handler runs that fail after writing, before commit. Defaults to 0.
    pub fail_rate: f64,
    /// Share of orders whose card is declined. Defaults to 0.
    pub decline_rate: f64,
    /// The most step commands one transaction claims, in process or in the participants
    /// this process runs behind a broker: the commands that arrive while a step's batch
    /// runs go together in its next (one batch at a time per step); 1 claims each alone,
    /// four workers side by side. A handler failure
    /// (`fail_rate`) rolls back its whole batch, whose commands then run one by one.
    /// Defaults to 1.
    pub claim_batch: usize,
    /// Seed of every random choice. Defaults to 1.
    pub seed: u64,
    /// Defeat the inbox, every delivery under a new message id (the control
    /// experiment). Defaults to `false`.
    pub no_inbox: bool,
    /// Resume an interrupted run: finish every unfinished saga, then place the orders
    /// that run had not placed yet. Defaults to `false`.
    pub resume: bool,
    /// Show a progress bar on stderr. Defaults to `false`.
    pub progress: bool,
    /// Send commands and replies through RabbitMQ instead of in process. Defaults to
    /// `None` (in process).
    pub transport: Option<DemoTransport>,
    /// How many times faster than real time the run's clock goes (a soak test mode: 43,200
    /// makes a month pass in a minute, so the pruner creates and drops inbox partitions
    /// while orders flow). Defaults to 1. Use a scratch database: a month dropped under
    /// the fast clock stays pruned for later runs.
    pub clock_speed: f64,
    /// Where the run's clock starts. Defaults to `None`: now.
    pub clock_start: Option<DateTime<Utc>>,
    /// The PostgreSQL schema of sagabox's tables (SQLite has none). Defaults to
    /// `sagabox`.
    pub schema: sagabox::Schema,
}

/// The demo over a broker: RabbitMQ or NATS JetStream.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoTransport {
    /// `amqp://user:password@host:port/vhost` (RabbitMQ) or `nats://host:port` (NATS
    /// JetStream).
    pub url: String,
    /// Queue names are `<prefix>.<consumer_type>`. Defaults to `sagabox`.
    pub queue_prefix: String,
    /// The participants run in other processes (`sagabox serve`); this one only places
    /// orders and orchestrates.
    pub external_participants: bool,
    /// Deliveries of one message before it is dead-lettered
    /// ([`Transport::with_max_deliveries`](sagabox::transport::Transport::with_max_deliveries)).
    /// Defaults to 5; separate participants must be started with the same number.
    pub max_deliveries: u32,
    /// Copies of each queue or stream the run declares, on as many nodes of a cluster
    /// ([`Transport::with_replicas`](sagabox::transport::Transport::with_replicas));
    /// `None` keeps the broker's default.
    pub replicas: Option<u8>,
    /// RabbitMQ's management API, where the queues' retention is read
    /// ([`AmqpConfig::management_url`](sagabox::amqp::AmqpConfig::management_url));
    /// `None`: the broker host's port 15672. Ignored by NATS.
    pub amqp_management_url: Option<String>,
}

impl DemoTransport {
    /// RabbitMQ at `url`, participants in this process, the default queue prefix.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            queue_prefix: "sagabox".to_owned(),
            external_participants: false,
            max_deliveries: 5,
            replicas: None,
            amqp_management_url: None,
        }
    }

    /// The broker the URL names (RabbitMQ or NATS JetStream) under the queue prefix.
    pub(crate) fn transport(&self) -> Result<sagabox::transport::Transport, DemoError> {
        let transport = sagabox::transport::Transport::from_url(&self.url, &self.queue_prefix)?
            .with_max_deliveries(self.max_deliveries);
        let transport = match self.replicas {
            Some(replicas) => transport.with_replicas(replicas),
            None => transport,
        };
        Ok(match transport {
            sagabox::transport::Transport::Amqp(mut config)
                if self.amqp_management_url.is_some() =>
            {
                config.management_url = self.amqp_management_url.clone();
                sagabox::transport::Transport::Amqp(config)
            }
            other => other,
        })
    }
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            orders: 1000,
            concurrency: 32,
            pace: None,
            duplicate_rate: 0.0,
            lost_reply_rate: 0.0,
            fail_rate: 0.0,
            decline_rate: 0.0,
            claim_batch: 1,
            seed: 1,
            no_inbox: false,
            resume: false,
            progress: false,
            transport: None,
            clock_speed: 1.0,
            clock_start: None,
            schema: sagabox::Schema::default(),
        }
    }
}

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// A setting out of range.
    #[error("invalid demo setting: {0}")]
    Config(String),
    /// The saga definition did not load.
    #[error(transparent)]
    Definition(#[from] DefinitionError),
    /// The inbox refused or failed.
    #[error(transparent)]
    Inbox(#[from] InboxError),
    /// The database could not be opened or reached (boxed: it is the largest variant).
    #[error(transparent)]
    Connect(Box<sagabox::database::ConnectError>),
    /// The database failed.
    #[error("database error: {}", sagabox::database::describe(.0))]
    Database(#[from] sqlx::Error),
    /// `resume` was asked on a database with no demo run on record.
    #[error(
        "nothing to resume in {database}: no demo run is on record there; run `sagabox demo` \
         without --resume to start one"
    )]
    NothingToResume {
        /// The database, password redacted.
        database: String,
    },
    /// An actor did not start or answer.
    #[error("actor failure: {0}")]
    Actor(String),
    /// An actor of the run died: the run stopped rather than wait on it.
    #[error(transparent)]
    ActorDied(#[from] ActorDied),
    /// A saga's driver crashed.
    #[error(transparent)]
    Drive(#[from] DriveError),
    /// RabbitMQ failed.
    #[error(transparent)]
    Broker(#[from] sagabox::amqp::AmqpError),
    /// The broker (RabbitMQ or NATS) failed or was refused.
    #[error(transparent)]
    Transport(#[from] sagabox::transport::TransportError),
    /// The participants did not start, or a part of them died.
    #[error(transparent)]
    Participant(#[from] sagabox::ParticipantError),
    /// The orchestrator service did not start, or it ended.
    #[error(transparent)]
    Orchestrate(#[from] sagabox::orchestrate::OrchestrateError),
}

impl From<sagabox::database::ConnectError> for DemoError {
    fn from(error: sagabox::database::ConnectError) -> Self {
        DemoError::Connect(Box::new(error))
    }
}

impl DemoConfig {
    /// Checks every setting.
    pub fn validate(&self) -> Result<(), DemoError> {
        for (name, rate) in [
            ("--duplicate-rate", self.duplicate_rate),
            ("--lost-reply-rate", self.lost_reply_rate),
            ("--fail-rate", self.fail_rate),
            ("--decline-rate", self.decline_rate),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(DemoError::Config(format!(
                    "{name} must be within 0..=1, got {rate}"
                )));
            }
        }
        if self.fail_rate >= 1.0 {
            return Err(DemoError::Config(
                "--fail-rate 1 would fail every attempt forever: use less than 1".into(),
            ));
        }
        if self.lost_reply_rate >= 1.0 {
            return Err(DemoError::Config(
                "--lost-reply-rate 1 would lose every reply forever: use less than 1".into(),
            ));
        }
        if let Some(pace) = self.pace
            && !(pace.is_finite() && pace > 0.0)
        {
            return Err(DemoError::Config(format!(
                "the pace must be a positive number of orders per second, got {pace}"
            )));
        }
        if self.concurrency == 0 {
            return Err(DemoError::Config("--concurrency must be at least 1".into()));
        }
        if !(1..=sagabox::inbox::MAX_BATCH).contains(&self.claim_batch) {
            return Err(DemoError::Config(format!(
                "--claim-batch must be within 1..={}, got {}",
                sagabox::inbox::MAX_BATCH,
                self.claim_batch
            )));
        }
        self.clock()?;
        if self.clock_speed != 1.0 {
            // The fast clock restarts from the real time in every process.
            if self.resume {
                return Err(DemoError::Config(
                    "--clock-speed cannot be combined with --resume: the resumed run's clock \
                     would start behind the times its messages were filed at"
                        .into(),
                ));
            }
            if self
                .transport
                .as_ref()
                .is_some_and(|t| t.external_participants)
            {
                return Err(DemoError::Config(
                    "--clock-speed cannot be combined with --external-participants: the \
                     participants' processes would not share the fast clock"
                        .into(),
                ));
            }
        }
        if let Some(transport) = &self.transport {
            transport.transport()?.validate()?;
        }
        Ok(())
    }

    /// The run's clock.
    pub(crate) fn clock(&self) -> Result<ScaledClock, DemoError> {
        ScaledClock::new(self.clock_start.unwrap_or_else(Utc::now), self.clock_speed)
            .map_err(|error| DemoError::Config(format!("--clock-speed: {error}")))
    }

    /// Time between the pruner's passes: an hour of the run's clock, at least 250 ms.
    pub(crate) fn prune_interval(&self) -> Duration {
        Duration::from_secs_f64((3600.0 / self.clock_speed).max(0.25))
    }
}
