//! The inbox: the guard that makes a consumer apply each message once, its
//! configuration, its outcomes and its errors.

mod batch;
mod config;
mod error;
mod guard;
mod outcome;

pub use batch::MAX_BATCH;
pub use config::{ConfigError, InboxConfig};
pub use error::{GuardError, InboxError};
pub use guard::InboxGuard;
pub use outcome::Outcome;
