//! The built `sagabox` binary as the crash loops drive it, and counting that tolerates a
//! table not created yet.

use std::process::Command;

/// `sagabox demo` on `url` with the saga issue's fault rates and `--json`, plus `extra`.
pub fn demo(url: &str, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sagabox"));
    command
        .args([
            "demo",
            "--database-url",
            url,
            "--concurrency",
            "32",
            "--duplicate-rate",
            "0.5",
            "--lost-reply-rate",
            "0.1",
            "--fail-rate",
            "0.1",
            "--decline-rate",
            "0.05",
            "--json",
        ])
        .args(extra)
        .env_remove("DATABASE_URL")
        .env_remove("SAGABOX_DATABASE_URL")
        .env("RUST_LOG", "error");
    command
}

/// `sql`'s count, or 0 while its table does not exist yet.
pub async fn count(fx: &super::Pg, sql: &'static str) -> i64 {
    // The table may not exist yet in the first moments of the first run.
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(&fx.pool)
        .await
        .unwrap_or(0)
}

/// Sagas in a terminal state.
pub const FINISHED: &str =
    "SELECT COUNT(*) FROM saga_instances WHERE status IN ('completed', 'compensated')";
/// Orders placed.
pub const PLACED: &str = "SELECT COUNT(*) FROM demo_orders";
