//! `sagabox inspect`: what an operator needs to know about a database, read from its
//! tables — the inbox's monthly partitions (rows, size on disk), how far back the inbox
//! still deduplicates against the TTL and the broker's retention, partitions missing
//! ahead, duplicate deliveries absorbed per consumer type, sagas by status and the oldest
//! unfinished one, and the outbox's backlog. [`inspect`] returns an [`InspectReport`]:
//! the facts, and the warnings a person should act on; `serde` writes it as one JSON
//! object for scripts (the `sagabox` command renders it as tables).
//!
//! Everything is counted by SQL at the moment of the call (nothing from any process's
//! memory), so the figures match what a `SELECT COUNT(*)` would say. Counting reads
//! every inbox row once: on a very large inbox it takes as long as a sequential scan.
//! Nothing is written.
//!
//! Duplicate deliveries are counted on the inbox rows themselves: every delivery the
//! guard finds already applied adds one to the first delivery's row (`duplicates`) and
//! stamps `last_duplicate_at`, whether or not anyone waited for its answer — so the
//! total is at least the demo's *duplicate replies*, which counts only the answers the
//! orchestrator received and flagged as duplicates. The
//! last-hour and last-day figures therefore count every duplicate of the messages whose
//! *latest* duplicate fell in the window — an upper bound when one message was
//! redelivered both before and inside the window. Rows in pruned months take their
//! counts with them.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;

use crate::database::{OnStore, Store};
use crate::inbox::{ConfigError, InboxConfig, InboxError};
use crate::logging::redact;
use crate::month::Month;
use crate::schema::Schema;

#[cfg(feature = "postgres")]
mod postgres;
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;

/// Why a database could not be inspected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InspectError {
    /// The URL names no supported database (password redacted).
    #[error("unsupported database url {0}; use postgres://… or sqlite:…")]
    UnsupportedUrl(String),
    /// The database is missing or has not had sagabox's migrations (all of them).
    #[error(
        "{url} is not a sagabox database at the current version ({what}); run `sagabox migrate --database-url …` first"
    )]
    NotMigrated {
        /// The database, password redacted.
        url: String,
        /// What was missing.
        what: String,
    },
    /// The options given are unsafe or inconsistent.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The database could not be opened or reached (boxed: it is the largest variant).
    #[error(transparent)]
    Connect(Box<crate::connection::ConnectError>),
    /// The database could not be opened for another reason (boxed: it is large).
    #[error(transparent)]
    Open(Box<InboxError>),
    /// The database refused a query.
    #[error("database error while inspecting {url}: {}", crate::connection::describe(.source))]
    Database {
        /// The database, password redacted.
        url: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

impl From<crate::connection::ConnectError> for InspectError {
    fn from(error: crate::connection::ConnectError) -> Self {
        InspectError::Connect(Box::new(error))
    }
}

/// What `inspect` compares the database against.
#[derive(Debug, Clone)]
pub struct InspectOptions {
    /// The TTL, broker retention and partitions ahead the inbox is run with.
    /// Defaults to [`InboxConfig::default`].
    pub config: InboxConfig,
    /// A margin between the inbox's reach and the broker's redelivery window below this
    /// is reported as thin. Defaults to 7 days.
    pub thin_margin: Duration,
    /// An unfinished saga created longer ago than this is reported as stuck.
    /// Defaults to 1 hour.
    pub stuck_after: Duration,
    /// A pending outbox row older than this is reported as a stalled relay.
    /// Defaults to 5 minutes.
    pub outbox_stalled_after: Duration,
    /// The schema holding sagabox's tables on PostgreSQL (SQLite ignores it). Defaults
    /// to `sagabox`.
    pub schema: Schema,
}

impl Default for InspectOptions {
    fn default() -> Self {
        Self {
            config: InboxConfig::default(),
            thin_margin: Duration::from_secs(7 * 86_400),
            stuck_after: Duration::from_secs(3_600),
            outbox_stalled_after: Duration::from_secs(300),
            schema: Schema::default(),
        }
    }
}

/// One monthly inbox partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PartitionReport {
    /// The month, `YYYY-MM`.
    pub month: String,
    /// Rows in it (exact).
    pub rows: i64,
    /// Bytes on disk, indexes included; `None` where the database cannot say.
    pub bytes: Option<i64>,
    /// When its oldest row was processed; `None` when it is empty.
    pub oldest_at: Option<DateTime<Utc>>,
    /// When its newest row was processed; `None` when it is empty.
    pub newest_at: Option<DateTime<Utc>>,
}

/// Duplicate deliveries the inbox absorbed for one consumer type, from its rows: every
/// delivery of a message already applied, answered or not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DuplicateReport {
    /// The consumer type.
    pub consumer_type: String,
    /// Duplicates on messages whose latest duplicate was in the last hour.
    pub last_hour: i64,
    /// Duplicates on messages whose latest duplicate was in the last 24 hours.
    pub last_day: i64,
    /// Every duplicate counted on the rows still in the inbox.
    pub in_inbox: i64,
}

/// How far back the inbox deduplicates, against the TTL and the broker.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RetentionReport {
    /// The configured TTL, in days.
    pub ttl_days: f64,
    /// The broker's maximum redelivery window, in days.
    pub broker_retention_days: f64,
    /// The oldest partition still present, `YYYY-MM`.
    pub oldest_partition: Option<String>,
    /// Age of the oldest partition's first instant, in days.
    pub oldest_partition_age_days: Option<f64>,
    /// The newest month pruned, `YYYY-MM`; `None` when nothing was ever pruned.
    pub pruned_through: Option<String>,
    /// Messages filed at or after this are still deduplicated; `None`: everything
    /// since the inbox was created (nothing pruned).
    pub covered_from: Option<DateTime<Utc>>,
    /// How many days further back than the broker's window the inbox reaches; `None`
    /// when nothing was pruned (no limit yet). Negative: redeliveries the broker may
    /// still make would be refused as filed in a pruned month.
    pub margin_days: Option<f64>,
}

/// An unfinished saga.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SagaRow {
    /// The saga instance id.
    pub id: String,
    /// Its definition's name.
    pub saga_name: String,
    /// `running` or `compensating`.
    pub status: String,
    /// The step it is at.
    pub current_step: i64,
    /// Attempts of that step so far.
    pub attempts: i64,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// Its last failure.
    pub last_error: Option<String>,
}

/// Sagas by status.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SagaReport {
    /// Instances per status (`running`, `compensating`, `completed`, `compensated`),
    /// parked ones counted apart under `parked`.
    pub by_status: BTreeMap<String, i64>,
    /// The unfinished instance created first, parked ones left out.
    pub oldest_unfinished: Option<SagaRow>,
}

/// The outbox's backlog.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutboxReport {
    /// Rows not yet published.
    pub pending: i64,
    /// When the oldest of them was written.
    pub oldest_pending_at: Option<DateTime<Utc>>,
}

/// Everything `sagabox inspect` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InspectReport {
    /// The database, password redacted.
    pub database: String,
    /// `postgres` or `sqlite`.
    pub backend: &'static str,
    /// When it was inspected.
    pub at: DateTime<Utc>,
    /// The inbox's partitions, oldest first.
    pub partitions: Vec<PartitionReport>,
    /// Months from the current one to `partitions_ahead` later with no partition.
    pub missing_ahead: Vec<String>,
    /// Reach of the inbox against the TTL and the broker.
    pub retention: RetentionReport,
    /// Duplicate deliveries the inbox absorbed, per consumer type (those with any).
    pub duplicate_deliveries: Vec<DuplicateReport>,
    /// Sagas by status.
    pub sagas: SagaReport,
    /// The outbox's backlog.
    pub outbox: OutboxReport,
    /// What needs a person's attention, one sentence each; empty when all is well.
    pub warnings: Vec<String>,
    /// The broker's queues with their measured retention, when a broker was given
    /// ([`InspectReport::with_broker`]); empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub broker_queues: Vec<QueueReport>,
}

/// One broker queue's retention as measured on the broker, beside the inbox TTL.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueReport {
    /// The queue (or JetStream stream).
    pub queue: String,
    /// Its type (`quorum`, `classic`, as the broker reports it; `stream` on JetStream).
    pub queue_type: Option<String>,
    /// What the broker applies, in days; `None`: unbounded.
    pub retention_days: Option<f64>,
    /// Its `x-message-ttl` argument (a stream's `max_age`), in days.
    pub argument_days: Option<f64>,
    /// The lowest `message-ttl` of the policies applied to it, in days.
    pub policy_days: Option<f64>,
    /// Whether the inbox TTL covers the retention (a redelivery cannot outlive the
    /// inbox's memory of the message).
    pub covered: bool,
}

#[cfg(feature = "nats")]
impl InspectReport {
    /// Adds the retention (`max_age`) of every work stream of `nats`'s prefix, with a
    /// warning for each one the inbox TTL (`inbox`) does not cover.
    pub async fn with_streams(
        mut self,
        nats: &crate::nats::NatsConfig,
        inbox: &InboxConfig,
    ) -> Result<Self, crate::nats::NatsError> {
        for (stream, retention) in crate::nats::prefixed_streams(nats).await? {
            let covered = matches!(retention, crate::retention::Retention::Bounded(kept) if kept <= inbox.ttl);
            if !covered {
                self.warnings.push(format!(
                    "stream {stream} keeps messages for {retention}, beyond the inbox ttl of \
                     {:.1} days: a consumer of it refuses to start; lower its max_age \
                     (nats stream edit {stream} --max-age …) or raise the ttl",
                    inbox.ttl.as_secs_f64() / 86_400.0
                ));
            }
            self.broker_queues.push(QueueReport {
                retention_days: retention.days(),
                argument_days: retention.days(),
                policy_days: None,
                queue: stream,
                queue_type: Some("stream".to_owned()),
                covered,
            });
        }
        Ok(self)
    }
}

#[cfg(feature = "rabbitmq")]
impl InspectReport {
    /// Adds the retention of every durable queue of `amqp`'s prefix, measured through
    /// the management API, with a warning for each one the inbox TTL (`inbox`) does not
    /// cover.
    pub async fn with_broker(
        mut self,
        amqp: &crate::amqp::AmqpConfig,
        inbox: &InboxConfig,
    ) -> Result<Self, crate::amqp::AmqpError> {
        let day = |duration: Duration| duration.as_secs_f64() / 86_400.0;
        for queue in crate::amqp::prefixed_queues(amqp).await? {
            let covered = matches!(queue.retention, crate::retention::Retention::Bounded(retention) if retention <= inbox.ttl);
            if !covered {
                self.warnings.push(format!(
                    "queue {} keeps messages for {}, beyond the inbox ttl of {:.1} days: a \
                     consumer of it refuses to start; lower its x-message-ttl or policy, or \
                     raise the ttl (see \"Choosing the TTL\" in docs/configuration.md)",
                    queue.queue,
                    queue.retention,
                    day(inbox.ttl)
                ));
            }
            self.broker_queues.push(QueueReport {
                retention_days: queue.retention.days(),
                argument_days: queue.argument.map(day),
                policy_days: queue.policy.map(day),
                queue: queue.queue,
                queue_type: queue.queue_type,
                covered,
            });
        }
        Ok(self)
    }
}

/// What a backend reads; [`assess`] turns it into a report.
#[derive(Debug, Clone, Default)]
struct Facts {
    partitions: Vec<(Month, i64, Option<i64>)>,
    /// The first and last processing time of each month's rows (months with rows).
    spans: Vec<(Month, DateTime<Utc>, DateTime<Utc>)>,
    pruned_through: Option<Month>,
    duplicates: Vec<DuplicateReport>,
    sagas_by_status: BTreeMap<String, i64>,
    oldest_unfinished: Option<SagaRow>,
    outbox_pending: i64,
    oldest_pending_at: Option<DateTime<Utc>>,
}

/// Inspects the database at `url` now. See [`inspect_at`].
pub async fn inspect(url: &str, options: &InspectOptions) -> Result<InspectReport, InspectError> {
    inspect_at(url, options, Utc::now()).await
}

/// Inspects the database at `url` as of `now` (windows, ages and margins are measured
/// from it). Reads only; refuses a database without sagabox's current migrations.
pub async fn inspect_at(
    url: &str,
    options: &InspectOptions,
    now: DateTime<Utc>,
) -> Result<InspectReport, InspectError> {
    options.config.validate()?;
    let windows = [now - TimeDelta::hours(1), now - TimeDelta::days(1)];
    let store = crate::database::open_migrated(url, &options.schema, 2)
        .await
        .map_err(|error| opening_error(url, error))?;
    let name = store.backend();
    let facts = store
        .run(ReadAll { windows })
        .await
        .map_err(database_error(url))?;
    Ok(assess(redact(url), name, facts, options, now))
}

/// A store `inspect` reads its figures from, all in one read-only snapshot.
trait ReadFacts: Store {
    /// Every figure; `windows` are the starts of the last hour and the last day.
    fn facts(
        &self,
        windows: [DateTime<Utc>; 2],
    ) -> impl Future<Output = Result<Facts, sqlx::Error>> + Send;
}

/// [`inspect_at`]'s reading, on the store the URL named.
struct ReadAll {
    windows: [DateTime<Utc>; 2],
}

impl<S: ReadFacts> OnStore<S> for ReadAll {
    type Output = Result<Facts, sqlx::Error>;

    async fn run(self, store: S) -> Self::Output {
        store.facts(self.windows).await
    }
}

/// Why the database at `url` could not be opened for inspection.
fn opening_error(url: &str, error: InboxError) -> InspectError {
    match error {
        InboxError::NotMigrated { url, what } => InspectError::NotMigrated { url, what },
        InboxError::Connect(error) => InspectError::Connect(error),
        InboxError::UnsupportedUrl(url) => InspectError::UnsupportedUrl(url),
        InboxError::Database(source) => InspectError::Database {
            url: redact(url),
            source,
        },
        other => InspectError::Open(Box::new(other)),
    }
}

/// The error for a failed query on `url`.
fn database_error(url: &str) -> impl Fn(sqlx::Error) -> InspectError + '_ {
    move |source| InspectError::Database {
        url: redact(url),
        source,
    }
}

fn days(delta: TimeDelta) -> f64 {
    delta.num_seconds() as f64 / 86_400.0
}

fn to_delta(duration: Duration) -> TimeDelta {
    TimeDelta::from_std(duration).unwrap_or(TimeDelta::MAX)
}

/// The policy: figures from facts, and a warning for each thing a person should act on.
fn assess(
    database: String,
    backend: &'static str,
    facts: Facts,
    options: &InspectOptions,
    now: DateTime<Utc>,
) -> InspectReport {
    let config = &options.config;
    let ttl = to_delta(config.ttl);
    let retention = to_delta(config.broker_retention);
    let present: Vec<Month> = facts.partitions.iter().map(|(m, ..)| *m).collect();
    let missing_ahead = missing_ahead(&facts, &present, config.partitions_ahead, now);
    let oldest = present.first().copied();
    let covered_from = facts.pruned_through.map(Month::end);
    let margin = covered_from.map(|from| (now - retention) - from);

    let mut warnings = Vec::new();
    if !missing_ahead.is_empty() {
        let list: Vec<String> = missing_ahead.iter().map(ToString::to_string).collect();
        warnings.push(format!(
            "partitions missing for {}: claims will create them on demand; run `sagabox prune` \
             (or start the pruner) to create them ahead",
            list.join(", ")
        ));
    }
    warnings.extend(retention_warnings(
        covered_from,
        margin,
        (ttl, retention),
        options,
    ));
    // Grace of a day: the pruner runs on an interval, not at the instant a month expires.
    if let Some(month) = oldest
        && month.end() + TimeDelta::days(1) <= now - ttl
    {
        warnings.push(format!(
            "partition {month} expired more than a day ago and is still here: is the pruner \
             running? Run `sagabox prune` by hand and check its errors"
        ));
    }
    warnings.extend(saga_warnings(&facts, options, now));
    if let Some(at) = facts.oldest_pending_at
        && now - at > to_delta(options.outbox_stalled_after)
    {
        warnings.push(format!(
            "{} outbox rows pending, the oldest written {}: is the relay running? \
             See \"growing outbox\" in docs/operations.md",
            facts.outbox_pending,
            at.to_rfc3339()
        ));
    }

    InspectReport {
        database,
        backend,
        at: now,
        partitions: partition_reports(&facts),
        missing_ahead: missing_ahead.iter().map(ToString::to_string).collect(),
        retention: RetentionReport {
            ttl_days: days(ttl),
            broker_retention_days: days(retention),
            oldest_partition: oldest.map(|m| m.to_string()),
            oldest_partition_age_days: oldest.map(|m| days(now - m.start())),
            pruned_through: facts.pruned_through.map(|m| m.to_string()),
            covered_from,
            margin_days: margin.map(days),
        },
        duplicate_deliveries: facts.duplicates,
        sagas: SagaReport {
            by_status: facts.sagas_by_status,
            oldest_unfinished: facts.oldest_unfinished,
        },
        outbox: OutboxReport {
            pending: facts.outbox_pending,
            oldest_pending_at: facts.oldest_pending_at,
        },
        warnings,
        broker_queues: Vec::new(),
    }
}

/// The months from the current one to `ahead` months on that have no partition and were
/// not pruned.
fn missing_ahead(facts: &Facts, present: &[Month], ahead: u32, now: DateTime<Utc>) -> Vec<Month> {
    let Ok(current) = Month::of(now) else {
        return Vec::new();
    };
    current
        .through(current.plus(ahead))
        .filter(|month| !present.contains(month))
        .filter(|month| facts.pruned_through.is_none_or(|through| *month > through))
        .collect()
}

/// Warnings about how far back the inbox deduplicates (from `covered_from`, `margin`
/// over the broker's window) against `(ttl, retention)`.
fn retention_warnings(
    covered_from: Option<DateTime<Utc>>,
    margin: Option<TimeDelta>,
    (ttl, retention): (TimeDelta, TimeDelta),
    options: &InspectOptions,
) -> Vec<String> {
    let mut warnings = Vec::new();
    if let Some(margin) = margin {
        if margin < TimeDelta::zero() {
            warnings.push(format!(
                "the inbox no longer covers the broker's redelivery window: messages filed \
                 before {} were pruned, but the broker may redeliver messages up to {:.1} \
                 days old; they would be refused as pruned. Raise the TTL",
                covered_from.map_or_else(String::new, |t| t.to_rfc3339()),
                days(retention)
            ));
        } else if margin < to_delta(options.thin_margin) {
            warnings.push(format!(
                "thin retention margin: the inbox reaches only {:.1} days further back than \
                 the broker's {:.1}-day redelivery window; raise the TTL",
                days(margin),
                days(retention)
            ));
        }
    }
    if ttl - retention < to_delta(options.thin_margin) {
        warnings.push(format!(
            "the TTL ({:.1} days) leaves less than {:.1} days over the broker retention \
             ({:.1} days): a late pruner or clock skew eats the margin",
            days(ttl),
            days(to_delta(options.thin_margin)),
            days(retention)
        ));
    }
    warnings
}

/// Warnings about a saga unfinished for too long and sagas parked for an operator.
fn saga_warnings(facts: &Facts, options: &InspectOptions, now: DateTime<Utc>) -> Vec<String> {
    let mut warnings = Vec::new();
    if let Some(saga) = &facts.oldest_unfinished
        && now - saga.created_at > to_delta(options.stuck_after)
    {
        warnings.push(format!(
            "saga {} ({}) has been {} since {} (step {}, {} attempts; last error: {}): \
             see \"stuck saga\" in docs/operations.md",
            saga.id,
            saga.saga_name,
            saga.status,
            saga.created_at.to_rfc3339(),
            saga.current_step,
            saga.attempts,
            saga.last_error.as_deref().unwrap_or("none")
        ));
    }
    if let Some(&parked) = facts.sagas_by_status.get("parked")
        && parked > 0
    {
        warnings.push(format!(
            "{parked} saga(s) parked, waiting for an operator: list them with `sagabox saga list \
             --status parked`, then retry or cancel each; see \"a saga is stuck or parked\" in \
             docs/operations.md"
        ));
    }
    warnings
}

/// Each partition's rows and size, with the span of its rows' times.
fn partition_reports(facts: &Facts) -> Vec<PartitionReport> {
    facts
        .partitions
        .iter()
        .map(|(month, rows, bytes)| {
            let span = facts.spans.iter().find(|(m, ..)| m == month);
            PartitionReport {
                month: month.to_string(),
                rows: *rows,
                bytes: *bytes,
                oldest_at: span.map(|(_, oldest, _)| *oldest),
                newest_at: span.map(|(.., newest)| *newest),
            }
        })
        .collect()
}

/// Adds `(consumer_type, last_hour, last_day, in_inbox)` counts into `into`, keeping it
/// sorted by consumer type (backends that read month by month call it per month).
fn merge_duplicates(into: &mut Vec<DuplicateReport>, row: DuplicateReport) {
    match into
        .iter_mut()
        .find(|known| known.consumer_type == row.consumer_type)
    {
        Some(known) => {
            known.last_hour += row.last_hour;
            known.last_day += row.last_day;
            known.in_inbox += row.in_inbox;
        }
        None => {
            into.push(row);
            into.sort_by(|a, b| a.consumer_type.cmp(&b.consumer_type));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }

    fn month(text: &str) -> Month {
        text.parse()
            .unwrap_or_else(|_| Month::of(Utc::now()).unwrap_or_else(|_| unreachable!()))
    }

    fn healthy(now: DateTime<Utc>) -> Facts {
        let current = Month::of(now).unwrap_or_else(|_| unreachable!());
        Facts {
            partitions: current
                .through(current.plus(2))
                .map(|m| (m, 10, Some(8192)))
                .collect(),
            ..Facts::default()
        }
    }

    #[test]
    fn a_fresh_inbox_with_partitions_ahead_has_no_warnings() {
        let now = at("2026-12-02T12:00:00Z");
        let report = assess(
            "db".into(),
            "sqlite",
            healthy(now),
            &InspectOptions::default(),
            now,
        );
        assert_eq!(report.warnings, Vec::<String>::new());
        assert!(report.missing_ahead.is_empty());
        assert_eq!(
            report.retention.margin_days, None,
            "nothing pruned: no limit"
        );
        assert_eq!(
            report.retention.oldest_partition.as_deref(),
            Some("2026-12")
        );
    }

    #[test]
    fn missing_months_ahead_are_listed_and_warned() {
        let now = at("2026-12-02T12:00:00Z");
        let mut facts = healthy(now);
        facts.partitions.truncate(1);
        let report = assess(
            "db".into(),
            "sqlite",
            facts,
            &InspectOptions::default(),
            now,
        );
        assert_eq!(report.missing_ahead, ["2027-01", "2027-02"]);
        assert!(
            report.warnings[0].contains("2027-01, 2027-02"),
            "{:?}",
            report.warnings
        );
    }

    #[test]
    fn the_margin_is_measured_from_the_newest_pruned_month() {
        // TTL 30 d, broker 14 d; pruned through October: covered from 1 November.
        let now = at("2026-12-20T00:00:00Z");
        let mut facts = healthy(now);
        facts.pruned_through = Some(month("2026-10"));
        let report = assess(
            "db".into(),
            "sqlite",
            facts.clone(),
            &InspectOptions::default(),
            now,
        );
        // 20 Dec − 14 d = 6 Dec; 6 Dec − 1 Nov = 35 days.
        assert_eq!(report.retention.margin_days, Some(35.0));
        assert!(report.warnings.is_empty(), "{:?}", report.warnings);

        // Pruned through November, 3 December: 6 Dec − 1 Dec = 5 days < 7: thin.
        facts.pruned_through = Some(month("2026-11"));
        let report = assess(
            "db".into(),
            "sqlite",
            facts.clone(),
            &InspectOptions::default(),
            now,
        );
        assert_eq!(report.retention.margin_days, Some(5.0));
        assert!(
            report
                .warnings
                .iter()
                .any(|w| w.contains("thin retention margin")),
            "{:?}",
            report.warnings
        );

        // Inspected on 10 December: 26 Nov − 1 Dec < 0.
        let now = at("2026-12-10T00:00:00Z");
        let report = assess(
            "db".into(),
            "sqlite",
            facts,
            &InspectOptions::default(),
            now,
        );
        assert!(report.retention.margin_days.is_some_and(|m| m < 0.0));
        assert!(
            report
                .warnings
                .iter()
                .any(|w| w.contains("no longer covers")),
            "{:?}",
            report.warnings
        );
    }

    #[test]
    fn a_ttl_barely_over_the_broker_retention_is_warned() {
        let now = at("2026-12-02T12:00:00Z");
        let options = InspectOptions {
            config: InboxConfig::default().with_ttl(Duration::from_secs(15 * 86_400)),
            ..InspectOptions::default()
        };
        let report = assess("db".into(), "sqlite", healthy(now), &options, now);
        assert!(
            report
                .warnings
                .iter()
                .any(|w| w.contains("less than 7.0 days over")),
            "{:?}",
            report.warnings
        );
    }

    #[test]
    fn an_expired_partition_still_present_points_at_the_pruner() {
        let now = at("2026-12-02T12:00:00Z");
        let mut facts = healthy(now);
        facts.partitions.insert(0, (month("2026-09"), 5, None));
        let report = assess(
            "db".into(),
            "sqlite",
            facts,
            &InspectOptions::default(),
            now,
        );
        assert!(
            report
                .warnings
                .iter()
                .any(|w| w.contains("2026-09") && w.contains("pruner")),
            "{:?}",
            report.warnings
        );
    }

    #[test]
    fn stuck_sagas_and_a_stalled_outbox_are_warned() {
        let now = at("2026-12-02T12:00:00Z");
        let mut facts = healthy(now);
        facts.oldest_unfinished = Some(SagaRow {
            id: "s-1".into(),
            saga_name: "checkout".into(),
            status: "compensating".into(),
            current_step: 0,
            attempts: 40,
            created_at: at("2026-12-02T09:00:00Z"),
            updated_at: at("2026-12-02T11:59:00Z"),
            last_error: Some("undo payment: timeout".into()),
        });
        facts.outbox_pending = 3;
        facts.oldest_pending_at = Some(at("2026-12-02T11:00:00Z"));
        let report = assess(
            "db".into(),
            "sqlite",
            facts,
            &InspectOptions::default(),
            now,
        );
        assert_eq!(report.warnings.len(), 2, "{:?}", report.warnings);
        assert!(
            report.warnings[0].contains("s-1")
                && report.warnings[0].contains("undo payment: timeout")
        );
        assert!(report.warnings[1].contains("3 outbox rows pending"));
    }

    #[test]
    fn duplicates_merge_per_consumer_type() {
        let mut all = Vec::new();
        for (ct, n) in [("payment", 2), ("email", 1), ("payment", 3)] {
            merge_duplicates(
                &mut all,
                DuplicateReport {
                    consumer_type: ct.into(),
                    last_hour: n,
                    last_day: n,
                    in_inbox: n,
                },
            );
        }
        let totals: Vec<(&str, i64)> = all
            .iter()
            .map(|d| (d.consumer_type.as_str(), d.in_inbox))
            .collect();
        assert_eq!(totals, [("email", 1), ("payment", 5)]);
    }
}
