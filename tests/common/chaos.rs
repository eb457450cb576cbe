//! The built `sagabox` binary as the crash loops drive it, counting that tolerates a
//! table not created yet, and kills placed by the work done rather than by the clock.
//!
//! A kill waits for an amount of work read from the database (orders placed or sagas
//! finished), never for a span of time: the same seed then puts the kills at the same
//! points of the run on a fast machine and on a slow one, in a debug build and in a
//! release build. Whether a kill found its process still running is read from the
//! process's exit status, not guessed.

use std::ops::RangeInclusive;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use rand::RngExt;
use rand::rngs::StdRng;

/// `sagabox demo` on `url` with the saga issue's fault rates and `--json`, plus `extra`.
pub fn demo(url: &str, extra: &[&str]) -> Command {
    let mut command = Command::new(super::sagabox_bin());
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
    "SELECT COUNT(*) FROM sagabox_saga_instances WHERE status IN ('completed', 'compensated')";
/// Orders placed.
pub const PLACED: &str = "SELECT COUNT(*) FROM demo_orders";
/// Sagas not in a terminal state.
pub const UNFINISHED: &str =
    "SELECT COUNT(*) FROM sagabox_saga_instances WHERE status NOT IN ('completed', 'compensated')";

/// How long a run may go without any progress before a test gives up on it. Far above
/// what a resume takes to get going in a debug build on a busy machine; reached only
/// when the run is stuck.
pub const STALL: Duration = Duration::from_secs(180);

/// The work a kill waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Orders placed (an order and its saga commit together).
    Placed,
    /// Sagas finished (completed or compensated). Moves while a resumed run finishes
    /// the sagas of the run before it, when no order is placed yet.
    Finished,
}

impl Progress {
    /// The count, 0 while its table does not exist yet.
    pub async fn count(self, fx: &super::Pg) -> i64 {
        count(
            fx,
            match self {
                Progress::Placed => PLACED,
                Progress::Finished => FINISHED,
            },
        )
        .await
    }
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Progress::Placed => "orders placed",
            Progress::Finished => "sagas finished",
        })
    }
}

/// Where a kill lands: once `more` further units of `progress` are done.
#[derive(Debug, Clone, Copy)]
pub struct Moment {
    /// What is counted.
    pub progress: Progress,
    /// How many more, from the count when the wait starts.
    pub more: i64,
}

impl Moment {
    /// A moment drawn from `rng`: either kind of progress, `more` within `range`.
    pub fn random(rng: &mut StdRng, range: RangeInclusive<i64>) -> Self {
        let progress = if rng.random_bool(0.5) {
            Progress::Placed
        } else {
            Progress::Finished
        };
        Self {
            progress,
            more: rng.random_range(range),
        }
    }

    /// Waits until the moment has come: `more` units of progress past the count now.
    /// `alive` is called at every poll and panics when a process the run needs has
    /// exited; the test fails (with `journal`) when the run makes no progress for
    /// [`STALL`]. Returns the count the wait started from.
    pub async fn wait(&self, fx: &super::Pg, journal: &str, mut alive: impl FnMut()) -> i64 {
        let from = self.progress.count(fx).await;
        let target = from + self.more;
        let mut last = from;
        let mut moved = Instant::now();
        loop {
            alive();
            let now = self.progress.count(fx).await;
            if now >= target {
                return from;
            }
            if now > last {
                (last, moved) = (now, Instant::now());
            }
            assert!(
                moved.elapsed() < STALL,
                "{journal}no progress for {STALL:?}: {now} {} of the {target} awaited",
                self.progress
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// Kills `child` with SIGKILL and reaps it. Returns whether the kill is what ended it:
/// `false` when it had exited on its own before the signal arrived.
pub fn kill(child: &mut Child) -> bool {
    const SIGKILL: i32 = 9;
    // Signalling a child that exited but is not reaped yet is not an error; its exit
    // status then tells.
    child.kill().expect("send SIGKILL");
    let status = child.wait().expect("reap the killed process");
    status.signal() == Some(SIGKILL)
}

/// Panics (with `journal`) if `child` has exited; `what` names it.
pub fn assert_running(child: &mut Child, what: &str, journal: &str) {
    if let Some(status) = child.try_wait().expect("poll a child") {
        panic!("{journal}{what} exited by itself: {status}");
    }
}
