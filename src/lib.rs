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
//! Around it: step actors in pools of competing consumers, an orchestrator that drives
//! sagas from persisted state and retries freely (the inbox makes retries safe), a
//! pruner that keeps the monthly partitions, a transactional outbox, and the operator's
//! tools — `sagabox inspect`, a Prometheus endpoint, structured logs.
//!
//! # Quick start
//!
//! One message delivered twice, applied once (`cargo run --example quickstart` runs a
//! complete version):
//!
//! ```no_run
//! use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, Outcome, SqliteStore};
//! use serde_json::json;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("sqlite:sagabox.db", 4).await?;
//! sqlx::query("CREATE TABLE IF NOT EXISTS charges (order_id TEXT, cents INTEGER)")
//!     .execute(store.pool())
//!     .await?;
//! let guard = InboxGuard::new(store, InboxConfig::default())?;
//! guard.migrate().await?; // the inbox's tables and this month's partitions + 2 ahead
//!
//! let payment = ConsumerType::new("payment")?;
//! let envelope = Envelope::new(MessageId::new_v7(), "charge", json!({"cents": 4200}))?;
//! for delivery in 1..=2 {
//!     let outcome = guard
//!         .process(&payment, &envelope, async |conn, envelope| {
//!             // Runs inside the claim's transaction: commits with the inbox row or not at all.
//!             sqlx::query("INSERT INTO charges (order_id, cents) VALUES ($1, $2)")
//!                 .bind("order-42")
//!                 .bind(envelope.payload["cents"].as_i64())
//!                 .execute(&mut *conn)
//!                 .await?;
//!             Ok::<_, sqlx::Error>(json!({"charged": 4200}))
//!         })
//!         .await?;
//!     // The second delivery applies nothing and gets the first one's result.
//!     match outcome {
//!         Outcome::Applied(result) => assert_eq!(delivery, 1, "{result}"),
//!         Outcome::Duplicate { result, .. } => assert_eq!(result, json!({"charged": 4200})),
//!     }
//!     // Only now acknowledge the message to the broker.
//! }
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
//! - [`schema`]: [`Schema`] — where sagabox's tables live: a PostgreSQL schema of their
//!   own (`sagabox` unless set), named by every statement, apart from the application's.
//! - [`step`]: a saga step as a [`StepHandler`](step::StepHandler) in a
//!   [`StepPool`](step::StepPool) of competing workers behind the guard.
//! - [`saga`]: saga definitions as data (TOML) and their versions, saga instances, their
//!   history and their store, and the operator's retry and cancel.
//! - [`orchestrator`]: the [`Orchestrator`](orchestrator::Orchestrator) actor — persisted
//!   state, stable command ids, free retries, compensation, resume.
//! - [`gather`]: [`Gather`](gather::Gather) — group commit for anything that runs many
//!   items at once: the orchestrator's saves, a step's claims, a caller's saga starts.
//! - [`outbox`]: the transactional outbox — rows written in the handler's transaction
//!   ([`OutboxWriter`](outbox::OutboxWriter)), claimed and marked by the relay.
//! - [`delivery`]: [`DeliveryHandler`](delivery::DeliveryHandler) and
//!   [`Disposition`](delivery::Disposition) — what every transport's consumer hands a
//!   message to, and how the answer settles it.
//! - [`dead_reason`]: [`DeadReason`](dead_reason::DeadReason) — why a message was
//!   dead-lettered, the codes its headers and the metric carry, on any broker.
//! - `reply` (with a transport): a step's reply with its stable id, on any transport.
//! - [`wire`]: the envelope's JSON body and the reasons a body is refused, on any broker.
//! - [`retention`]: the broker's real retention, read from the broker, checked against the
//!   inbox TTL before a transport consumes.
//! - `amqp` (feature `rabbitmq`): the RabbitMQ transport — a consumer that acks after
//!   commit and dead-letters bad input, the outbox relay with publisher confirms, and the
//!   orchestrator's commands and replies over queues.
//! - `participant` (feature `rabbitmq`): the `Participant` runtime — a team's step
//!   handlers behind RabbitMQ with the relay, the pruner and metrics, drained on shutdown.
//! - [`pruner`]: the [`Pruner`](pruner::Pruner) actor — partitions ahead, expired ones dropped.
//! - [`supervisor`]: [`Supervision`](supervisor::Supervision) — the process's actors linked
//!   to one supervisor, so that a death ends the run with its cause instead of a hang.
//! - [`inspect`]: what `sagabox inspect` reports — partitions, the inbox's reach against
//!   the TTL and the broker, duplicate deliveries absorbed, sagas, the outbox — read by SQL.
//! - [`metrics`]: the metric catalogue ([`CATALOGUE`](metrics::CATALOGUE)) and the
//!   Prometheus endpoint ([`install_prometheus`](metrics::install_prometheus)), which also
//!   answers `/healthz` and `/readyz`.
//! - [`health`]: the process's readiness — its database answers, its consumers consume.
//! - `testing` (feature `testing`): `FaultyDispatch` — duplicated commands and lost
//!   replies on demand, counted, to test a saga's participants against them.
//! - [`logging`]: how the library's log events carry lists ([`json_list`](logging::json_list)),
//!   and URLs without their passwords ([`redact`](logging::redact)).
//! - [`trace`]: W3C trace context in the envelope's headers, so one saga is one trace
//!   across processes (bridged to OpenTelemetry with feature `otel`).
//! - [`tls`]: [`TlsFiles`](tls::TlsFiles) — the CA and client certificate a connection
//!   trusts and presents, read and checked before connecting; [`TlsError`](tls::TlsError).
//! - [`month`]: [`Month`], the partition unit; [`clock`]: [`Clock`], injectable time.
//! - [`database`]: the store a URL names ([`AnyStore`](database::AnyStore), the one
//!   place that picks the database at run time), migrating and pruning by URL, the typed
//!   connection errors.
//!
//! `docs/architecture.md` tables the modules' layers: each imports only from its own
//! layer and those below (`tests/layers.rs` holds it to that).
//!
//! The `sagabox` command (migrate, prune, inspect, saga, dlq, console, serve, orchestrate,
//! demo, bench, bench-broker, bench-saga) is the
//! `sagabox-cli` package in `cli/`; the example sagas are packages of their own under
//! `examples/` (`examples/checkout` is the saga behind `sagabox demo`). They use only
//! this crate's public API.
//!
//! `docs/` has the rest: `architecture.md` (the actors and the path of a message),
//! `guarantees.md` (the contract), `partitioning.md`, `configuration.md` (TTL, TLS,
//! schemas, brokers, clusters, scaling out), `operations.md` (pruning, `inspect`, the
//! metric catalogue and alerts, dead letters, upgrades), `console.md` and
//! `benchmarks.md`.
//!
//! # Features
//!
//! | feature | default | what it adds |
//! | --- | --- | --- |
//! | `postgres` | yes | [`PostgresStore`]: the production inbox, partitioned by month |
//! | `sqlite` | yes | [`SqliteStore`]: the embedded inbox, one table per month (bundled SQLite) |
//! | `rabbitmq` | yes | the RabbitMQ transport (lapin): consumer, outbox relay, broker dispatch |
//! | `nats` | no | the NATS JetStream transport (async-nats): pull consumers, outbox relay, dispatch; the `sagabox` command turns it on |
//! | `prometheus` | yes | [`metrics::install_prometheus`] and `--metrics-addr`: Prometheus text over HTTP, with `/healthz` and `/readyz` |
//! | `otel` | no | [`trace`] reads and writes span contexts through `tracing-opentelemetry` (the OpenTelemetry API only; the application installs the SDK and the exporter) |
//!
//! Without `prometheus` the metrics still go through the `metrics` facade to whatever
//! recorder the application installs.

#[cfg(feature = "rabbitmq")]
pub mod amqp;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
mod backoff;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub mod batching;
pub mod clock;
mod connection;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub mod consumer;
pub mod database;
pub mod dead_reason;
pub mod delivery;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub mod dlq;
pub mod envelope;
pub mod gather;
pub mod health;
pub mod inbox;
pub mod inspect;
pub mod logging;
pub mod metrics;
pub mod month;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub mod orchestrate;
pub mod orchestrator;
pub mod outbox;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub mod participant;
pub mod pruner;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
mod publish;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub mod relay;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub mod reply;
pub mod retention;
pub mod saga;
pub mod schema;
pub mod step;
pub mod store;
pub mod supervisor;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
pub mod trace;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub mod transport;
pub mod wire;

pub use clock::{Clock, InvalidClockSpeed, ManualClock, ScaledClock, SystemClock};
pub use envelope::{ConsumerType, Envelope, KeyError, MAX_KEY_BYTES, MessageId};
pub use inbox::{ConfigError, GuardError, InboxConfig, InboxError, InboxGuard, MAX_BATCH, Outcome};
pub use month::Month;
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub use participant::{Participant, ParticipantError, ParticipantHandle, ParticipantReport};
pub use schema::{Schema, SchemaError};
pub use store::InboxStore;
#[cfg(feature = "postgres")]
pub use store::PostgresStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
