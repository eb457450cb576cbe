//! The checkout example saga and the demo behind `sagabox demo`: payment →
//! inventory → email, with refund and restock as compensations, run by the orchestrator
//! over step pools under injected duplicates, lost replies, failures after the write and
//! declined cards — and a summary whose `double_*` and `stock_drift` figures are read
//! from the business tables by SQL, not counted in memory.
//!
//! The business tables are deliberately not idempotent (append-only ledgers, a stock
//! counter): the inbox is what keeps them exact. `--no-inbox` runs the same saga with
//! every delivery under a new message id ([`FreshIds`]), so the inbox recognises no
//! repeat, to show the damage. Written against the library's public API alone.

mod faults;
mod transport;

pub use faults::FreshIds;

pub use transport::{DemoDispatch, ORCHESTRATOR, SERVE_TARGET, kinds_of};
pub use transport::{Participants, ServeConfig, serve};

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;

use sagabox::clock::{Clock, ScaledClock};
use sagabox::database::{Backend, redact};
use sagabox::inbox::{InboxConfig, InboxError, InboxGuard};
use sagabox::month::Month;
use sagabox::orchestrator::{
    DriveError, DriveStats, Orchestrator, OrchestratorArguments, OrchestratorMessage,
};
use sagabox::pruner::{Maintenance, PrunePass, Pruner, PrunerArguments};
use sagabox::saga::{DefinitionError, SagaDefinition, SagaInstance, SagaStore};
use sagabox::step::{StepError, StepHandler, StepPoolConfig};
use sagabox::supervisor::{ActorDied, Supervision};
use sagabox::testing::FaultyDispatch;

/// The checkout saga, as shipped in `sagas/checkout.toml`.
pub const CHECKOUT_TOML: &str = include_str!("../../../sagas/checkout.toml");

/// Stock keeping units in the demo's inventory.
const SKUS: [&str; 5] = [
    "sku-apple",
    "sku-bread",
    "sku-cheese",
    "sku-dates",
    "sku-eggs",
];

/// How the demo runs.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoConfig {
    /// Orders to place. With `resume`, the run being resumed keeps its own number: the
    /// orders it had not placed yet are placed then. Defaults to 1,000.
    pub orders: usize,
    /// Sagas in flight at once. Defaults to 32.
    pub concurrency: usize,
    /// Share of step commands delivered twice, concurrently. Defaults to 0.
    pub duplicate_rate: f64,
    /// Share of replies dropped after the step committed. Defaults to 0.
    pub lost_reply_rate: f64,
    /// Share of handler runs that fail after writing, before commit. Defaults to 0.
    pub fail_rate: f64,
    /// Share of orders whose card is declined. Defaults to 0.
    pub decline_rate: f64,
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
}

/// The demo over RabbitMQ.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoTransport {
    /// `amqp://user:password@host:port/vhost`.
    pub url: String,
    /// Queue names are `<prefix>.<consumer_type>`. Defaults to `sagabox`.
    pub queue_prefix: String,
    /// The participants run in other processes (`sagabox serve`); this one only places
    /// orders and orchestrates.
    pub external_participants: bool,
}

impl DemoTransport {
    /// RabbitMQ at `url`, participants in this process, the default queue prefix.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            queue_prefix: "sagabox".to_owned(),
            external_participants: false,
        }
    }

    fn amqp(&self) -> sagabox::amqp::AmqpConfig {
        sagabox::amqp::AmqpConfig::new(self.url.clone())
            .with_queue_prefix(self.queue_prefix.clone())
    }
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            orders: 1000,
            concurrency: 32,
            duplicate_rate: 0.0,
            lost_reply_rate: 0.0,
            fail_rate: 0.0,
            decline_rate: 0.0,
            seed: 1,
            no_inbox: false,
            resume: false,
            progress: false,
            transport: None,
            clock_speed: 1.0,
            clock_start: None,
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
        if self.concurrency == 0 {
            return Err(DemoError::Config("--concurrency must be at least 1".into()));
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
            transport.amqp().validate()?;
        }
        Ok(())
    }

    /// The run's clock.
    fn clock(&self) -> Result<ScaledClock, DemoError> {
        ScaledClock::new(self.clock_start.unwrap_or_else(Utc::now), self.clock_speed)
            .map_err(|error| DemoError::Config(format!("--clock-speed: {error}")))
    }

    /// Time between the pruner's passes: an hour of the run's clock, at least 250 ms.
    fn prune_interval(&self) -> Duration {
        Duration::from_secs_f64((3600.0 / self.clock_speed).max(0.25))
    }
}

/// The demo's pruner: a pass of the guard's, keeping the months it dropped for the
/// summary.
#[derive(Debug)]
struct TalliedMaintenance<M> {
    inner: M,
    dropped: Arc<Mutex<Vec<Month>>>,
}

impl<M: Maintenance> Maintenance for TalliedMaintenance<M> {
    async fn run_pass(&self, dry_run: bool) -> Result<PrunePass, InboxError> {
        let pass = self.inner.run_pass(dry_run).await?;
        if !dry_run {
            self.dropped
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(pass.dropped.iter().copied());
        }
        Ok(pass)
    }
}

/// What a run did, with the damage figures read from the business tables.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoSummary {
    /// The database, password redacted.
    pub database: String,
    /// How commands travelled: `in-process`, or the broker URL (password redacted).
    pub transport: String,
    /// Whether the inbox was defeated (every delivery under a new message id).
    pub no_inbox: bool,
    /// Orders in the demo tables.
    pub orders: i64,
    /// Checkout sagas completed.
    pub completed: i64,
    /// Checkout sagas compensated (declined, out of stock, gave up).
    pub compensated: i64,
    /// Checkout sagas neither.
    pub unfinished: i64,
    /// Step commands sent by the orchestrator, retries included.
    pub deliveries: u64,
    /// Replies the orchestrator received that said the step had already applied the
    /// command. Fewer than the duplicate deliveries `inspect` counts on the inbox rows:
    /// the answer to an injected second copy and an answer lost on the way are not
    /// received.
    pub duplicate_replies: u64,
    /// Commands sent again after a timeout, a lost reply or a failure.
    pub retries: u64,
    /// Orders charged more than once (SQL over `payment_charges`).
    pub double_charges: i64,
    /// Orders refunded more than once (SQL over `payment_charges`).
    pub double_refunds: i64,
    /// Orders confirmed by email more than once (SQL over `emails_sent`).
    pub double_emails: i64,
    /// Σ over skus of |on_hand − (initial − quantity of completed orders)| (SQL).
    pub stock_drift: i64,
    /// Compensated orders whose charges and refunds do not net to zero (SQL).
    pub unbalanced_refunds: i64,
    /// Wall time of the run.
    pub elapsed_ms: u64,
    /// Sagas finished per second in this run.
    pub sagas_per_sec: f64,
    /// How many times faster than real time the run's clock went (1: real time).
    pub clock_speed: f64,
    /// The run's clock when it ended.
    pub clock_end: DateTime<Utc>,
    /// Inbox months the pruner dropped during the run (`YYYY-MM`).
    pub months_pruned: Vec<String>,
    /// Inbox months with a partition at the end (`YYYY-MM`).
    pub months_kept: Vec<String>,
    /// What the damage figures add up to: [`Verdict::Ok`] when [`damage`](Self::damage)
    /// is 0.
    pub verdict: Verdict,
}

/// The demo's conclusion, from the damage figures read from the business tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Verdict {
    /// Nothing charged, decremented or sent twice, every compensation balanced.
    Ok,
    /// Side effects applied more than once or not undone.
    Damage,
}

impl Verdict {
    /// The verdict on a sum of damage figures.
    pub fn of(damage: i64) -> Self {
        if damage == 0 {
            Verdict::Ok
        } else {
            Verdict::Damage
        }
    }
}

impl DemoSummary {
    /// The sum of every damage figure: 0 when nothing was applied twice or left undone.
    pub fn damage(&self) -> i64 {
        self.double_charges
            + self.double_refunds
            + self.double_emails
            + self.stock_drift
            + self.unbalanced_refunds
    }
}

impl fmt::Display for DemoSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inbox = if self.no_inbox { "BYPASSED" } else { "on" };
        writeln!(
            f,
            "checkout demo on {} via {} (inbox {inbox})",
            self.database, self.transport
        )?;
        let rows: [(&str, String); 17] = [
            ("orders", self.orders.to_string()),
            ("completed", self.completed.to_string()),
            ("compensated", self.compensated.to_string()),
            ("unfinished", self.unfinished.to_string()),
            ("deliveries", self.deliveries.to_string()),
            ("duplicate replies", self.duplicate_replies.to_string()),
            ("retries", self.retries.to_string()),
            ("double charges", self.double_charges.to_string()),
            ("double refunds", self.double_refunds.to_string()),
            ("double emails", self.double_emails.to_string()),
            ("stock drift", self.stock_drift.to_string()),
            ("unbalanced refunds", self.unbalanced_refunds.to_string()),
            ("elapsed", format!("{} ms", self.elapsed_ms)),
            ("sagas/s", format!("{:.0}", self.sagas_per_sec)),
            (
                "clock",
                if self.clock_speed == 1.0 {
                    "real time".to_owned()
                } else {
                    format!(
                        "{}x real time, ended at {}",
                        self.clock_speed,
                        self.clock_end.format("%Y-%m-%d %H:%M")
                    )
                },
            ),
            (
                "inbox months",
                format!(
                    "kept [{}], pruned during the run [{}]",
                    self.months_kept.join(", "),
                    self.months_pruned.join(", ")
                ),
            ),
            (
                "verdict",
                match self.verdict {
                    Verdict::Ok => "nothing charged, decremented or sent twice".to_owned(),
                    Verdict::Damage => {
                        "DAMAGE: side effects applied more than once or not undone".to_owned()
                    }
                },
            ),
        ];
        for (name, value) in rows {
            writeln!(f, "  {name:<20} {value}")?;
        }
        Ok(())
    }
}

/// Injected handler failures: after the write, before the commit.
#[derive(Debug)]
struct HandlerFaults {
    fail_rate: f64,
    rng: Mutex<StdRng>,
}

impl HandlerFaults {
    fn fail_after_write(&self) -> Result<(), StepError> {
        let fail = self
            .rng
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .random_bool(self.fail_rate);
        if fail {
            Err(StepError::Retryable(
                "injected failure after the write, before commit".into(),
            ))
        } else {
            Ok(())
        }
    }
}

/// The three participants' logic — payment (`charge`, `refund`), inventory
/// (`decrement_stock`, `restock`), email (`send_confirmation`) — as one [`StepHandler`]
/// that dispatches on the message kind. The payload is the order (`order_id`, `sku`,
/// `quantity`, `amount_cents`, `decline`); the tables are [`POSTGRES_TABLES`] /
/// [`SQLITE_TABLES`].
#[derive(Debug, Clone)]
pub struct Checkout {
    faults: Arc<HandlerFaults>,
}

impl Checkout {
    /// The handler; `fail_rate` of its runs fail after writing, before commit (seeded).
    pub fn new(fail_rate: f64, seed: u64) -> Self {
        Self {
            faults: Arc::new(HandlerFaults {
                fail_rate: fail_rate.clamp(0.0, 1.0),
                rng: Mutex::new(StdRng::seed_from_u64(seed)),
            }),
        }
    }
}

fn order_field<'a>(envelope: &'a sagabox::Envelope, name: &str) -> Result<&'a Value, StepError> {
    envelope
        .payload
        .get(name)
        .ok_or_else(|| StepError::Permanent(format!("order payload has no {name:?}")))
}

fn text(value: &Value, name: &str) -> Result<String, StepError> {
    value
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| StepError::Permanent(format!("{name} is not text")))
}

fn number(value: &Value, name: &str) -> Result<i64, StepError> {
    value
        .as_i64()
        .ok_or_else(|| StepError::Permanent(format!("{name} is not an integer")))
}

fn retryable(error: sqlx::Error) -> StepError {
    StepError::Retryable(error.to_string())
}

macro_rules! checkout_handler {
    ($db:ty, $lock_order:expr) => {
        impl StepHandler<$db> for Checkout {
            async fn handle(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                envelope: &sagabox::Envelope,
            ) -> Result<Value, StepError> {
                let order_id = text(order_field(envelope, "order_id")?, "order_id")?;
                let exists = async |conn: &mut <$db as sqlx::Database>::Connection,
                                    sql: &'static str|
                       -> Result<bool, StepError> {
                    let n: i64 = sqlx::query_scalar(sql)
                        .bind(&order_id)
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(retryable)?;
                    Ok(n > 0)
                };
                // One order's commands run one at a time: a charge still running when the
                // orchestrator gave up on it must not interleave with its refund (each
                // would miss the other's uncommitted row). Different message ids, so the
                // inbox's per-key lock does not do this.
                if let Some(lock) = $lock_order {
                    sqlx::query(lock)
                        .bind(&order_id)
                        .execute(&mut *conn)
                        .await
                        .map_err(retryable)?;
                }
                let result = match envelope.kind.as_str() {
                    "charge" => {
                        if envelope.payload.get("decline").and_then(Value::as_bool) == Some(true) {
                            return Err(StepError::Permanent("card declined".into()));
                        }
                        // A charge that arrives after its refund (a late retry) must not land.
                        if exists(conn, "SELECT COUNT(*) FROM payment_charges WHERE order_id = $1 AND kind = 'refund'").await? {
                            return Err(StepError::Permanent("order cancelled".into()));
                        }
                        let amount = number(order_field(envelope, "amount_cents")?, "amount_cents")?;
                        sqlx::query("INSERT INTO payment_charges (order_id, amount_cents, kind) VALUES ($1, $2, 'charge')")
                            .bind(&order_id)
                            .bind(amount)
                            .execute(&mut *conn)
                            .await
                            .map_err(retryable)?;
                        json!({ "charged_cents": amount })
                    }
                    "refund" => {
                        let charged: i64 = sqlx::query_scalar(
                            "SELECT CAST(COALESCE(SUM(amount_cents), 0) AS BIGINT) FROM payment_charges WHERE order_id = $1 AND kind = 'charge'",
                        )
                        .bind(&order_id)
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(retryable)?;
                        // Always leave a refund row (0 when nothing was charged): it also
                        // blocks a charge that arrives late.
                        sqlx::query("INSERT INTO payment_charges (order_id, amount_cents, kind) VALUES ($1, $2, 'refund')")
                            .bind(&order_id)
                            .bind(charged)
                            .execute(&mut *conn)
                            .await
                            .map_err(retryable)?;
                        json!({ "refunded_cents": charged })
                    }
                    "decrement_stock" => {
                        if exists(conn, "SELECT COUNT(*) FROM inventory_moves WHERE order_id = $1 AND kind = 'restock'").await? {
                            return Err(StepError::Permanent("order cancelled".into()));
                        }
                        let sku = text(order_field(envelope, "sku")?, "sku")?;
                        let quantity = number(order_field(envelope, "quantity")?, "quantity")?;
                        let taken = sqlx::query(
                            "UPDATE inventory SET on_hand = on_hand - $1 WHERE sku = $2 AND on_hand >= $1",
                        )
                        .bind(quantity)
                        .bind(&sku)
                        .execute(&mut *conn)
                        .await
                        .map_err(retryable)?
                        .rows_affected();
                        if taken == 0 {
                            return Err(StepError::Permanent(format!("out of stock: {sku}")));
                        }
                        sqlx::query("INSERT INTO inventory_moves (order_id, sku, delta, kind) VALUES ($1, $2, $3, 'decrement')")
                            .bind(&order_id)
                            .bind(&sku)
                            .bind(-quantity)
                            .execute(&mut *conn)
                            .await
                            .map_err(retryable)?;
                        json!({ "sku": sku, "taken": quantity })
                    }
                    "restock" => {
                        let sku = text(order_field(envelope, "sku")?, "sku")?;
                        let taken: i64 = sqlx::query_scalar(
                            "SELECT CAST(COALESCE(-SUM(delta), 0) AS BIGINT) FROM inventory_moves WHERE order_id = $1 AND kind = 'decrement'",
                        )
                        .bind(&order_id)
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(retryable)?;
                        sqlx::query("UPDATE inventory SET on_hand = on_hand + $1 WHERE sku = $2")
                            .bind(taken)
                            .bind(&sku)
                            .execute(&mut *conn)
                            .await
                            .map_err(retryable)?;
                        // Always leave a restock row: it also blocks a late decrement.
                        sqlx::query("INSERT INTO inventory_moves (order_id, sku, delta, kind) VALUES ($1, $2, $3, 'restock')")
                            .bind(&order_id)
                            .bind(&sku)
                            .bind(taken)
                            .execute(&mut *conn)
                            .await
                            .map_err(retryable)?;
                        json!({ "sku": sku, "returned": taken })
                    }
                    "send_confirmation" => {
                        sqlx::query("INSERT INTO emails_sent (order_id, template) VALUES ($1, 'confirmation')")
                            .bind(&order_id)
                            .execute(&mut *conn)
                            .await
                            .map_err(retryable)?;
                        json!({ "email": "confirmation" })
                    }
                    other => return Err(StepError::Permanent(format!("unknown command {other:?}"))),
                };
                self.faults.fail_after_write()?;
                Ok(result)
            }
        }
    };
}

checkout_handler!(
    sqlx::Postgres,
    Some("SELECT 1 FROM demo_orders WHERE id = $1 FOR UPDATE")
);
// SQLite: every claim holds the single write lock (BEGIN IMMEDIATE) until it commits.
checkout_handler!(sqlx::Sqlite, None::<&'static str>);

/// The demo's business tables on PostgreSQL (`CREATE TABLE IF NOT EXISTS`). The
/// statements run as one implicit transaction behind an advisory lock: concurrent
/// `CREATE TABLE IF NOT EXISTS` of one table can fail in PostgreSQL, and `sagabox serve`
/// processes starting together run these at once.
pub const POSTGRES_TABLES: &str = "
SELECT pg_advisory_xact_lock(1398892387);
CREATE TABLE IF NOT EXISTS demo_orders (id TEXT PRIMARY KEY, saga_id TEXT NOT NULL, sku TEXT NOT NULL,
    quantity BIGINT NOT NULL, amount_cents BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS payment_charges (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id TEXT NOT NULL, amount_cents BIGINT NOT NULL, kind TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS payment_charges_order ON payment_charges (order_id);
CREATE TABLE IF NOT EXISTS inventory (sku TEXT PRIMARY KEY, initial BIGINT NOT NULL, on_hand BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS inventory_moves (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id TEXT NOT NULL, sku TEXT NOT NULL, delta BIGINT NOT NULL, kind TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS inventory_moves_order ON inventory_moves (order_id);
CREATE TABLE IF NOT EXISTS emails_sent (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id TEXT NOT NULL, template TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS emails_sent_order ON emails_sent (order_id);
CREATE TABLE IF NOT EXISTS demo_run (singleton BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton),
    orders BIGINT NOT NULL);
";

/// The demo's business tables on SQLite (`CREATE TABLE IF NOT EXISTS`).
pub const SQLITE_TABLES: &str = "
CREATE TABLE IF NOT EXISTS demo_orders (id TEXT PRIMARY KEY, saga_id TEXT NOT NULL, sku TEXT NOT NULL,
    quantity BIGINT NOT NULL, amount_cents BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS payment_charges (id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id TEXT NOT NULL, amount_cents BIGINT NOT NULL, kind TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS payment_charges_order ON payment_charges (order_id);
CREATE TABLE IF NOT EXISTS inventory (sku TEXT PRIMARY KEY, initial BIGINT NOT NULL, on_hand BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS inventory_moves (id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id TEXT NOT NULL, sku TEXT NOT NULL, delta BIGINT NOT NULL, kind TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS inventory_moves_order ON inventory_moves (order_id);
CREATE TABLE IF NOT EXISTS emails_sent (id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id TEXT NOT NULL, template TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS emails_sent_order ON emails_sent (order_id);
CREATE TABLE IF NOT EXISTS demo_run (singleton BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton),
    orders BIGINT NOT NULL);
";

const RESET: &str = "
DELETE FROM demo_orders; DELETE FROM payment_charges; DELETE FROM inventory;
DELETE FROM inventory_moves; DELETE FROM emails_sent; DELETE FROM demo_run;
DELETE FROM saga_instances WHERE saga_name = 'checkout';
";

const SUMMARY_SQL: [(&str, &str); 9] = [
    (
        "unbalanced_refunds",
        "SELECT COUNT(*) FROM demo_orders o JOIN saga_instances s ON s.id = o.saga_id \
        WHERE s.status = 'compensated' AND (SELECT COALESCE(SUM(CASE kind WHEN 'charge' THEN amount_cents ELSE -amount_cents END), 0) \
        FROM payment_charges c WHERE c.order_id = o.id) <> 0",
    ),
    ("orders", "SELECT COUNT(*) FROM demo_orders"),
    (
        "completed",
        "SELECT COUNT(*) FROM saga_instances WHERE saga_name = 'checkout' AND status = 'completed'",
    ),
    (
        "compensated",
        "SELECT COUNT(*) FROM saga_instances WHERE saga_name = 'checkout' AND status = 'compensated'",
    ),
    (
        "unfinished",
        "SELECT COUNT(*) FROM saga_instances WHERE saga_name = 'checkout' AND status IN ('running', 'compensating')",
    ),
    (
        "double_charges",
        "SELECT COUNT(*) FROM (SELECT order_id FROM payment_charges WHERE kind = 'charge' GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "double_refunds",
        "SELECT COUNT(*) FROM (SELECT order_id FROM payment_charges WHERE kind = 'refund' GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "double_emails",
        "SELECT COUNT(*) FROM (SELECT order_id FROM emails_sent GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "stock_drift",
        "SELECT CAST(COALESCE(SUM(ABS(i.on_hand - (i.initial - COALESCE((SELECT SUM(o.quantity) FROM demo_orders o \
        JOIN saga_instances s ON s.id = o.saga_id WHERE o.sku = i.sku AND s.status = 'completed'), 0)))), 0) AS BIGINT) FROM inventory i",
    ),
];

/// How long a run that failed waits for the death of an actor to be reported, to name
/// it as the cause.
const DEATH_REPORT_WITHIN: Duration = Duration::from_millis(500);

/// One order of the run: what goes into `demo_orders` and the saga's data.
fn order(rng: &mut StdRng, decline_rate: f64) -> (String, Value) {
    let order_id = Uuid::now_v7().to_string();
    let sku = SKUS[rng.random_range(0..SKUS.len())];
    let quantity: i64 = rng.random_range(1..=3);
    let amount_cents: i64 = rng.random_range(100..=20_000);
    let decline = rng.random_bool(decline_rate);
    let data = json!({
        "order_id": order_id, "sku": sku, "quantity": quantity,
        "amount_cents": amount_cents, "decline": decline,
    });
    (order_id, data)
}

/// Stock per sku: about 85 % of the expected demand, so some orders run out.
fn initial_stock(orders: usize) -> i64 {
    let expected = (orders as f64 * 2.0 / SKUS.len() as f64).ceil();
    (expected * 0.85).max(1.0) as i64
}

macro_rules! backend_run {
    ($name:ident, $store:ty, $db:ty, $tables:expr) => {
        async fn $name(
            url: &str,
            store: $store,
            config: &DemoConfig,
        ) -> Result<DemoSummary, DemoError> {
            let definition = Arc::new(SagaDefinition::from_toml_str(CHECKOUT_TOML)?);
            let clock = config.clock()?;
            let guard = InboxGuard::new(store.clone(), InboxConfig::default())
                .map_err(InboxError::from)?
                .with_clock(clock);
            guard.migrate().await?;
            // Every actor of the run is linked to one supervisor: if one dies, the run
            // ends with its cause instead of waiting on it. Dropped on any return, it
            // stops them all.
            let supervision = Supervision::start()
                .await
                .map_err(|e| DemoError::Actor(e.to_string()))?;
            // The pruner runs as it would beside a deployment; under a fast clock it is
            // what keeps creating the months ahead and dropping the expired ones.
            let months_pruned = Arc::new(Mutex::new(Vec::new()));
            let (pruner, pruner_handle) = supervision.spawn(
                "pruner",
                Pruner::new(),
                PrunerArguments {
                    maintenance: TalliedMaintenance {
                        inner: guard.clone(),
                        dropped: Arc::clone(&months_pruned),
                    },
                    interval: config.prune_interval(),
                },
            )
            .await
            .map_err(|e| DemoError::Actor(e.to_string()))?;
            let pool = store.pool().clone();
            sqlx::raw_sql($tables).execute(&pool).await?;
            // The run's size is stored, so that `resume` can place what a killed run
            // had not placed yet.
            let target = if config.resume {
                let stored: Option<i64> = sqlx::query_scalar("SELECT orders FROM demo_run")
                    .fetch_optional(&pool)
                    .await?;
                let stored = stored.ok_or_else(|| DemoError::NothingToResume { database: redact(url) })?;
                usize::try_from(stored).unwrap_or(0)
            } else {
                // One transaction: a run killed while setting up is either on record,
                // stocked, or not started at all.
                let mut tx = pool.begin().await?;
                sqlx::raw_sql(RESET).execute(&mut *tx).await?;
                sqlx::query("INSERT INTO demo_run (orders) VALUES ($1)")
                    .bind(i64::try_from(config.orders).unwrap_or(i64::MAX))
                    .execute(&mut *tx)
                    .await?;
                for sku in SKUS {
                    let stock = initial_stock(config.orders);
                    sqlx::query("INSERT INTO inventory (sku, initial, on_hand) VALUES ($1, $2, $2)")
                        .bind(sku)
                        .bind(stock)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                config.orders
            };
            let placed: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM demo_orders")
                .fetch_one(&pool)
                .await?;
            let to_place = target.saturating_sub(usize::try_from(placed).unwrap_or(0));

            let handler = Checkout::new(config.fail_rate, config.seed ^ 0x5eed);
            let pool_config = StepPoolConfig { workers: 4 };
            let dispatch = DemoDispatch::start(
                &guard,
                &definition,
                &handler,
                &pool_config,
                config.transport.as_ref(),
                &supervision,
            )
            .await?;
            let dispatch = Arc::new(dispatch);
            let stats = Arc::new(DriveStats::default());
            let (orchestrator, orchestrator_handle) = supervision.spawn(
                "orchestrator",
                Orchestrator::new(),
                OrchestratorArguments {
                    definition: Arc::clone(&definition),
                    store: store.clone(),
                    dispatch: Arc::new(FaultyDispatch::new(
                        FreshIds::new(Arc::clone(&dispatch), config.no_inbox),
                        config.duplicate_rate,
                        config.lost_reply_rate,
                        config.seed,
                    )),
                    stats: Arc::clone(&stats),
                },
            )
            .await
            .map_err(|e| DemoError::Actor(e.to_string()))?;

            let started = Instant::now();
            let progress = if config.progress {
                ProgressBar::new(0)
            } else {
                ProgressBar::hidden()
            };
            progress.set_style(
                ProgressStyle::with_template("{spinner} {msg} [{bar:40}] {pos}/{len} sagas ({per_sec})")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            let work = async {
            let resumed = if config.resume {
                progress.set_message("resuming");
                let resumed = ractor::call!(orchestrator, OrchestratorMessage::ResumeAll)
                    .map_err(|e| DemoError::Actor(e.to_string()))?
                    .map_err(DemoError::Actor)?;
                progress.set_length((resumed + to_place) as u64);
                resumed
            } else {
                progress.set_message("checkout");
                progress.set_length(to_place as u64);
                0
            };
            let permits = Arc::new(tokio::sync::Semaphore::new(config.concurrency));
            let mut rng = StdRng::seed_from_u64(config.seed);
            let mut running = tokio::task::JoinSet::new();
            for _ in 0..to_place {
                // Reap the sagas already finished: a finished task is kept until joined,
                // so without this the run's memory would grow with every order placed.
                while let Some(joined) = running.try_join_next() {
                    joined.map_err(|e| DemoError::Actor(e.to_string()))??;
                }
                let permit = Arc::clone(&permits)
                    .acquire_owned()
                    .await
                    .map_err(|e| DemoError::Actor(e.to_string()))?;
                let (order_id, data) = order(&mut rng, config.decline_rate);
                // Saga times come from the run's clock: command ids are derived from them.
                let saga = SagaInstance::new(Uuid::now_v7().to_string(), definition.name(), data.clone(), clock.now());
                // The order and its saga commit together: no order without its saga.
                let mut tx = pool.begin().await?;
                sqlx::query("INSERT INTO demo_orders (id, saga_id, sku, quantity, amount_cents) VALUES ($1, $2, $3, $4, $5)")
                    .bind(&order_id)
                    .bind(&saga.id)
                    .bind(data["sku"].as_str())
                    .bind(data["quantity"].as_i64())
                    .bind(data["amount_cents"].as_i64())
                    .execute(&mut *tx)
                    .await?;
                <$store as SagaStore>::insert(&mut tx, &saga).await?;
                tx.commit().await?;
                let (orchestrator, progress) = (orchestrator.clone(), progress.clone());
                running.spawn(async move {
                    let done = ractor::call!(orchestrator, OrchestratorMessage::Run, saga.id);
                    progress.inc(1);
                    drop(permit);
                    done.map_err(|e| DemoError::Actor(e.to_string()))?
                        .map_err(DemoError::from)
                });
            }
            while let Some(joined) = running.join_next().await {
                joined.map_err(|e| DemoError::Actor(e.to_string()))??;
            }
            if config.resume {
                ractor::call!(orchestrator, OrchestratorMessage::WhenIdle)
                    .map_err(|e| DemoError::Actor(e.to_string()))?;
            }
            Ok::<_, DemoError>(resumed + to_place)
            };
            let finished = tokio::select! {
                done = work => match done {
                    Ok(finished) => finished,
                    // An actor that died makes the calls to it fail: its death is the cause.
                    // Its report reaches the supervisor just after those calls fail.
                    Err(error) => {
                        let died = tokio::time::timeout(DEATH_REPORT_WITHIN, supervision.died()).await;
                        return Err(died.map_or(error, DemoError::from));
                    }
                },
                died = supervision.died() => return Err(died.into()),
            };
            progress.finish_and_clear();
            let elapsed = started.elapsed();
            orchestrator.stop(None);
            let _ = orchestrator_handle.await;
            // The orchestrator's state (and its handle on the pools) is gone with it.
            if let Ok(dispatch) = Arc::try_unwrap(dispatch) {
                dispatch.stop().await;
            }
            pruner.stop(None);
            let _ = pruner_handle.await;
            supervision.stop().await;
            let months_pruned = std::mem::take(
                &mut *months_pruned.lock().unwrap_or_else(PoisonError::into_inner),
            );
            let months_kept = guard.partitions().await?;

            let mut figures = std::collections::HashMap::new();
            for (name, sql) in SUMMARY_SQL {
                let value: i64 = sqlx::query_scalar(sql).fetch_one(&pool).await?;
                figures.insert(name, value);
            }
            let figure = |name: &str| figures.get(name).copied().unwrap_or_default();
            let mut summary = DemoSummary {
                database: redact(url),
                transport: config
                    .transport
                    .as_ref()
                    .map_or_else(|| "in-process".to_owned(), |transport| redact(&transport.url)),
                no_inbox: config.no_inbox,
                orders: figure("orders"),
                completed: figure("completed"),
                compensated: figure("compensated"),
                unfinished: figure("unfinished"),
                deliveries: stats.deliveries.load(Relaxed),
                duplicate_replies: stats.duplicates.load(Relaxed),
                retries: stats.retries.load(Relaxed),
                double_charges: figure("double_charges"),
                double_refunds: figure("double_refunds"),
                double_emails: figure("double_emails"),
                stock_drift: figure("stock_drift"),
                unbalanced_refunds: figure("unbalanced_refunds"),
                elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
                sagas_per_sec: finished as f64 / elapsed.as_secs_f64().max(1e-9),
                clock_speed: config.clock_speed,
                clock_end: clock.now(),
                months_pruned: months_pruned.iter().map(Month::to_string).collect(),
                months_kept: months_kept.iter().map(Month::to_string).collect(),
                verdict: Verdict::Ok,
            };
            summary.verdict = Verdict::of(summary.damage());
            Ok(summary)
        }
    };
}

backend_run!(
    run_postgres,
    sagabox::PostgresStore,
    sqlx::Postgres,
    POSTGRES_TABLES
);
backend_run!(
    run_sqlite,
    sagabox::SqliteStore,
    sqlx::Sqlite,
    SQLITE_TABLES
);

/// Runs the checkout demo on the database at `url` (`sqlite:…` or `postgres://…`).
///
/// Without `resume` it first resets the demo's own tables (`demo_orders`,
/// `payment_charges`, `inventory`, `inventory_moves`, `emails_sent`, `demo_run` and the
/// `checkout` rows of `saga_instances`), records the run's size and stocks the
/// inventory. With `resume` it finishes the unfinished sagas of the run on record and
/// places the orders it had not placed yet.
pub async fn run(url: &str, config: &DemoConfig) -> Result<DemoSummary, DemoError> {
    config.validate()?;
    // Nothing to resume where there is no database: do not create one to say so.
    if config.resume && matches!(sagabox::database::missing_sqlite_file(url), Ok(Some(_))) {
        return Err(DemoError::NothingToResume {
            database: redact(url),
        });
    }
    let connections = u32::try_from(config.concurrency.clamp(4, 64)).unwrap_or(16);
    match Backend::of(url)? {
        Backend::Postgres => {
            let store = sagabox::PostgresStore::connect(url, connections).await?;
            run_postgres(url, store, config).await
        }
        Backend::Sqlite => {
            let store = sagabox::SqliteStore::connect(url, connections.min(8)).await?;
            run_sqlite(url, store, config).await
        }
        #[allow(unreachable_patterns)]
        _ => Err(InboxError::UnsupportedUrl(redact(url)).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_checked() {
        let bad = DemoConfig {
            duplicate_rate: 1.5,
            ..DemoConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("--duplicate-rate")
        );
        let forever = DemoConfig {
            fail_rate: 1.0,
            ..DemoConfig::default()
        };
        assert!(forever.validate().is_err());
        assert!(DemoConfig::default().validate().is_ok());
    }

    #[test]
    fn the_shipped_definition_loads() {
        let definition = SagaDefinition::from_toml_str(CHECKOUT_TOML).unwrap();
        assert_eq!(definition.steps().len(), 3);
    }

    #[test]
    fn stock_runs_short_of_demand() {
        assert!(initial_stock(1000) < 400);
        assert!(initial_stock(0) >= 1);
    }
}
