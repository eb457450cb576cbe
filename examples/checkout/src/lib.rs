//! The checkout example saga and the demo behind `sagabox demo`: payment →
//! inventory → email, with refund and restock as compensations.
//!
//! - The participants, each written once for PostgreSQL and SQLite against the
//!   library's public API, as a `StepHandler` generic over the database (what differs
//!   between the two is [`OrderDb`]'s lock): [`Payment`], [`Inventory`], [`Email`]
//!   ([`CheckoutStep`] picks one by consumer type), on the tables of
//!   [`POSTGRES_TABLES`] / [`SQLITE_TABLES`] ([`CheckoutTables`]). The tables are deliberately not idempotent (append-only
//!   ledgers, a stock counter): the inbox is what keeps them exact.
//! - [`run`]: the demo, the orchestrator over step pools (or RabbitMQ) under injected
//!   duplicates, lost replies, failures after the write and declined cards, and a
//!   [`DemoSummary`] whose `double_*` and `stock_drift` figures are read from the
//!   business tables by SQL, not counted in memory. `--no-inbox` runs the same saga with
//!   every delivery under a new message id ([`FreshIds`]) to show the damage.
//! - [`run_floor`]: the same saga written by hand in plain SQL on PostgreSQL, the floor
//!   `sagabox bench-saga` measures the demo's saga against.
//! - [`serve`]: the participants as a long-running service on the
//!   [`Participant`](sagabox::Participant) runtime, behind `sagabox serve`.

mod config;
mod email;
mod faults;
mod floor;
mod inventory;
mod order;
mod payment;
mod runner;
mod schema;
mod step;
mod summary;
mod transport;

pub use config::{DemoConfig, DemoError, DemoTransport};
pub use email::Email;
pub use faults::{FailAfterWrite, FreshIds};
pub use floor::{FLOOR_SAGA, FloorSummary, run_floor};
pub use inventory::Inventory;
pub use order::OrderDb;
pub use payment::Payment;
pub use runner::run;
pub use schema::{CheckoutTables, POSTGRES_TABLES, SQLITE_TABLES};
pub use step::CheckoutStep;
pub use summary::{DemoSummary, Verdict};
pub use transport::{DemoDispatch, ORCHESTRATOR, SERVE_TARGET, ServeConfig, serve};

/// The checkout saga, as shipped in `sagas/checkout.toml`.
pub const CHECKOUT_TOML: &str = include_str!("../../../sagas/checkout.toml");

/// The consumer types and command kinds of the three participants.
pub mod names {
    pub use crate::email::{CONSUMER as EMAIL, SEND_CONFIRMATION};
    pub use crate::inventory::{CONSUMER as INVENTORY, DECREMENT, RESTOCK};
    pub use crate::payment::{CHARGE, CONSUMER as PAYMENT, REFUND};
}
