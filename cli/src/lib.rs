//! The parts of the `sagabox` command that are worth testing on their own: the
//! command line's values, checked with typed errors ([`args`]), and the process's log
//! output ([`telemetry`]). The command itself is `src/main.rs`.

pub mod args;
pub mod telemetry;
