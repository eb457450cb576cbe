//! The crash loop: the built `sagabox demo` on PostgreSQL with 5,000 orders under the
//! saga issue's fault rates, killed with SIGKILL at 20 random moments and restarted with
//! `--resume` each time; then every invariant of the saga is checked by SQL.
//!
//! The moments come from a seed, printed with every kill on failure; set `CHAOS_SEED`
//! to replay a run (the moments replay exactly; where they land in the work depends on
//! the machine's speed).

#![allow(clippy::unwrap_used)]

mod common;

use std::fmt::Write as _;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const ORDERS: i64 = 5000;
const KILLS: usize = 20;

use common::chaos::{FINISHED, PLACED, count, demo};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_twenty_times_and_resumed_every_invariant_holds() {
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .map(|s| s.parse().expect("CHAOS_SEED is a number"))
        .unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut journal = format!("crash loop seed {seed} (replay with CHAOS_SEED={seed})\n");
    let fx = common::Pg::new().await;

    for kill in 0..KILLS {
        let mut child: Child = if kill == 0 {
            demo(
                &fx.url,
                &["--orders", &ORDERS.to_string(), "--seed", &seed.to_string()],
            )
        } else {
            demo(
                &fx.url,
                &["--resume", "--seed", &(seed ^ kill as u64).to_string()],
            )
        }
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
        let started = Instant::now();
        if kill == 0 {
            // A run exists once its size is on record (the setup is one transaction):
            // only from then on can `--resume` finish it.
            let deadline = started + Duration::from_secs(60);
            while count(&fx, "SELECT COUNT(*) FROM demo_run").await == 0 {
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "{journal}the first run ended before it recorded itself"
                );
                assert!(
                    Instant::now() < deadline,
                    "{journal}the first run never started"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let moment = Duration::from_millis(rng.random_range(100..=1500));
        tokio::time::sleep(moment.saturating_sub(started.elapsed())).await;
        let running = child.try_wait().unwrap().is_none();
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let (finished, placed) = (count(&fx, FINISHED).await, count(&fx, PLACED).await);
        writeln!(
            journal,
            "kill {kill:2}: {} ms after start, {placed} orders placed, {finished} sagas finished{}",
            started.elapsed().as_millis(),
            if running { "" } else { " (had already exited)" }
        )
        .unwrap();
        assert!(
            running,
            "{journal}the demo ended before kill {kill}: raise ORDERS so that every kill lands mid-run"
        );
    }
    let unfinished_at_last_kill = count(
        &fx,
        "SELECT COUNT(*) FROM saga_instances WHERE status NOT IN ('completed', 'compensated')",
    )
    .await;
    let placed_at_last_kill = count(&fx, PLACED).await;

    let resumed = demo(&fx.url, &["--resume", "--seed", &seed.to_string()])
        .output()
        .unwrap();
    assert!(
        resumed.status.success(),
        "{journal}final resume failed: {}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&resumed.stdout).unwrap();
    writeln!(journal, "final resume: {summary}").unwrap();

    assert!(
        unfinished_at_last_kill > 0 || placed_at_last_kill < ORDERS,
        "{journal}the last kill left nothing to resume"
    );
    assert_eq!(
        fx.scalar(PLACED).await,
        ORDERS,
        "{journal}every order placed"
    );
    assert_eq!(
        fx.scalar(FINISHED).await,
        ORDERS,
        "{journal}every saga finished"
    );
    assert_eq!(summary["unfinished"], 0, "{journal}");
    assert_eq!(summary["orders"], ORDERS, "{journal}");
    let broken = common::invariants::violations(&fx.pool).await;
    assert!(broken.is_empty(), "{journal}invariants broken: {broken:?}");
    // Every order's charge went through the inbox (declines are recorded as refusals).
    let inbox_rows = fx
        .scalar(
            "SELECT COUNT(*) FROM sagabox_inbox WHERE consumer_type IN ('payment', 'inventory', 'email')",
        )
        .await;
    assert!(
        inbox_rows >= ORDERS,
        "{journal}every charge on record in the inbox: {inbox_rows}"
    );
    eprintln!("{journal}");
}
