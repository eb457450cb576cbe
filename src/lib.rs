//! # sagabox
//!
//! Saga participants as actors that process every message **effectively exactly once**
//! over at-least-once brokers.
//!
//! Every message a step consumes passes an [`InboxGuard`]: in one database transaction
//! the guard claims `(consumer_type, message_id)`, runs the step's handler with that same
//! transaction, records the handler's result, and commits. A redelivery finds the key
//! taken, applies nothing, and gets the first delivery's result. Acknowledge to the
//! source only after the guard returned `Ok`.
//!
//! ```no_run
//! use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, Outcome, SqliteStore};
//! use serde_json::json;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("sqlite:sagabox.db", 4).await?;
//! let guard = InboxGuard::new(store, InboxConfig::default())?;
//! guard.migrate().await?;
//!
//! let payment = ConsumerType::new("payment")?;
//! let envelope = Envelope::new(MessageId::new("order-42/charge")?, "charge", json!({"cents": 4200}))?;
//! let outcome = guard
//!     .process(&payment, &envelope, async |conn, envelope| {
//!         sqlx::query("INSERT INTO charges (order_id, cents) VALUES ($1, $2)")
//!             .bind("order-42")
//!             .bind(envelope.payload["cents"].as_i64())
//!             .execute(&mut *conn)
//!             .await?;
//!         Ok::<_, sqlx::Error>(json!({"charged": 4200}))
//!     })
//!     .await?;
//! assert!(matches!(outcome, Outcome::Applied(_)));
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//!
//! - [`envelope`]: [`Envelope`], [`MessageId`], [`ConsumerType`] — what travels, validated.
//! - [`inbox`]: [`InboxGuard`] — claim, handler, record, commit; [`Outcome`], errors, config.
//! - [`store`]: the SQL per database — [`PostgresStore`] (monthly partitions, global
//!   uniqueness across them) and [`SqliteStore`] (monthly tables, the embedded default).
//! - [`step`]: a saga step as a [`StepHandler`](step::StepHandler) in a
//!   [`StepPool`](step::StepPool) of competing workers behind the guard.
//! - [`saga`]: saga definitions as data (TOML), saga instances and their store.
//! - [`orchestrator`]: the [`Orchestrator`](orchestrator::Orchestrator) actor — persisted
//!   state, stable command ids, free retries, compensation, resume.
//! - [`outbox`]: the transactional outbox, write side ([`OutboxWriter`](outbox::OutboxWriter)).
//! - [`pruner`]: the [`Pruner`](pruner::Pruner) actor — partitions ahead, expired ones dropped.
//! - [`demo`]: the checkout saga behind `sagabox demo`.
//! - [`month`]: [`Month`], the partition unit; [`clock`]: [`Clock`], injectable time.
//! - [`metrics`]: the metric names emitted.
//! - [`database`]: opening a store from a URL; [`redact`](database::redact) for logs.
//!
//! # Features
//!
//! | feature | default | what it adds |
//! | --- | --- | --- |
//! | `postgres` | yes | [`PostgresStore`] |
//! | `sqlite` | yes | [`SqliteStore`] |

pub mod clock;
pub mod database;
pub mod demo;
pub mod envelope;
pub mod inbox;
pub mod metrics;
pub mod month;
pub mod orchestrator;
pub mod outbox;
pub mod pruner;
pub mod saga;
pub mod step;
pub mod store;

pub use clock::{Clock, ManualClock, SystemClock};
pub use envelope::{ConsumerType, Envelope, KeyError, MAX_KEY_BYTES, MessageId};
pub use inbox::{ConfigError, GuardError, InboxConfig, InboxError, InboxGuard, MAX_BATCH, Outcome};
pub use month::Month;
#[cfg(feature = "postgres")]
pub use store::PostgresStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
pub use store::{BatchClaim, FirstDelivery, InboxStore, PartitionCreation};
