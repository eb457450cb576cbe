//! The crash loop: the built `sagabox demo` on PostgreSQL with 2,000 orders under the
//! saga issue's fault rates, killed with SIGKILL 20 times and restarted with `--resume`
//! each time, with an operator cancelling sagas through `sagabox saga cancel` (and
//! retrying any parked one) while the demo runs and between the kills; then every
//! invariant of the saga is checked by SQL, history agreeing with state included.
//!
//! Each kill lands after a random amount of work (1 to 50 more orders placed, or more
//! sagas finished, counted in the database), not after a span of time: a fast build and
//! a slow one are killed at the same points of the run, and the 20 kills together take
//! well under its orders, so every kill lands while the run has work left. The last
//! `--resume` places the rest. The moments come from a seed, printed with every kill on
//! failure; set `CHAOS_SEED` to replay a run.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::fmt::Write as _;
use std::ops::RangeInclusive;
use std::process::Stdio;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;

const ORDERS: i64 = 2000;
const KILLS: usize = 20;
/// How much more work each kill waits for. The kills take at most 20 × 50 orders, plus
/// per kill the sagas in flight (the demo runs 32) and the few placed between the poll
/// that saw the mark and the signal: some 1,700 in the worst draw, half that in a
/// typical one, so every kill finds orders left to place. Few enough orders that the
/// last resume, which places the rest, stays short in a debug build.
const MORE: RangeInclusive<i64> = 1..=50;

use common::chaos::{FINISHED, Moment, PLACED, UNFINISHED, assert_running, count, demo, kill};
use common::children::Children;

/// A running saga whose step still has a compensation (payment or inventory): one an
/// operator may cancel.
const CANCELLABLE: &str = "SELECT id FROM sagabox_saga_instances WHERE status = 'running' \
    AND parked_reason IS NULL AND current_step <= 1 ORDER BY created_at DESC LIMIT 1";

/// Cancels one cancellable saga with the built `sagabox saga cancel`, as an operator
/// would; returns its id when the command took it. A refusal (the saga moved past its
/// last compensated step, or finished, between the query and the command) is fine: it
/// must say so, exit 1 and change nothing.
async fn cancel_one(fx: &common::Pg, journal: &mut String) -> Option<String> {
    let id: Option<String> = sqlx::query_scalar(CANCELLABLE)
        .fetch_optional(&fx.pool)
        .await
        .unwrap();
    let id = id?;
    let output = std::process::Command::new(common::sagabox_bin())
        .args([
            "saga",
            "cancel",
            &id,
            "--note",
            "chaos operator",
            "--database-url",
            &fx.url,
        ])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    writeln!(
        journal,
        "  cancel {id}: {:?} {}",
        output.status.code(),
        stderr.trim()
    )
    .unwrap();
    match output.status.code() {
        Some(0) => Some(id),
        Some(1) => {
            assert!(
                stderr.contains("cannot be cancelled") || stderr.contains("already"),
                "{journal}an operator's cancel failed for another reason: {stderr}"
            );
            None
        }
        other => panic!("{journal}sagabox saga cancel exited {other:?}: {stderr}"),
    }
}

/// Retries every parked saga, as an operator would after fixing the cause.
async fn retry_parked(fx: &common::Pg, journal: &mut String) {
    let parked: Vec<String> =
        sqlx::query_scalar("SELECT id FROM sagabox_saga_instances WHERE parked_reason IS NOT NULL")
            .fetch_all(&fx.pool)
            .await
            .unwrap();
    for id in parked {
        let output = std::process::Command::new(common::sagabox_bin())
            .args(["saga", "retry", &id, "--database-url", &fx.url])
            .output()
            .unwrap();
        writeln!(journal, "  retry {id}: {:?}", output.status.code()).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_twenty_times_and_resumed_every_invariant_holds() {
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .map(|s| s.parse().expect("CHAOS_SEED is a number"))
        .unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut journal = format!("crash loop seed {seed} (replay with CHAOS_SEED={seed})\n");
    let fx = common::Pg::new().await;
    let loop_started = Instant::now();
    let mut cancelled = Vec::new();

    for kill_no in 0..KILLS {
        // Killed on drop too: a failed test leaves no demo running.
        let mut child = Children::new(vec![
            if kill_no == 0 {
                demo(
                    &fx.url,
                    &["--orders", &ORDERS.to_string(), "--seed", &seed.to_string()],
                )
            } else {
                demo(
                    &fx.url,
                    &["--resume", "--seed", &(seed ^ kill_no as u64).to_string()],
                )
            }
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
        ]);
        let started = Instant::now();
        if kill_no == 0 {
            // A run exists once its size is on record (the setup is one transaction):
            // only from then on can `--resume` finish it.
            let deadline = started + Duration::from_secs(60);
            while count(&fx, "SELECT COUNT(*) FROM demo_run").await == 0 {
                assert_running(&mut child[0], "the first run", &journal);
                assert!(
                    Instant::now() < deadline,
                    "{journal}the first run never started"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        // An operator at work while the demo's orchestrator drives the same sagas. Before
        // the wait for the kill's moment, not between it and the kill: the command takes
        // long enough for the demo to place dozens more orders, and twenty such overshoots
        // used up the run's orders before the last kills on a quiet machine.
        cancelled.extend(cancel_one(&fx, &mut journal).await);
        let moment = Moment::random(&mut rng, MORE);
        let from = moment
            .wait(&fx, &journal, || {
                assert_running(&mut child[0], "the demo", &journal)
            })
            .await;
        let landed = kill(&mut child[0]);
        let (finished, placed) = (count(&fx, FINISHED).await, count(&fx, PLACED).await);
        let unfinished = count(&fx, UNFINISHED).await;
        writeln!(
            journal,
            "kill {kill_no:2}: after {} more {} (from {from}), {} ms after its start: \
             {placed} orders placed, {finished} sagas finished{}",
            moment.more,
            moment.progress,
            started.elapsed().as_millis(),
            if landed { "" } else { " (had already exited)" }
        )
        .unwrap();
        assert!(
            landed,
            "{journal}the demo ended before kill {kill_no}, which lands after an amount of work"
        );
        assert!(
            placed < ORDERS || unfinished > 0,
            "{journal}kill {kill_no} left nothing to resume: the kills took more work than ORDERS"
        );
        // And between the kills, while nothing runs.
        cancelled.extend(cancel_one(&fx, &mut journal).await);
        retry_parked(&fx, &mut journal).await;
    }
    writeln!(
        journal,
        "kills done in {} ms",
        loop_started.elapsed().as_millis()
    )
    .unwrap();

    let resume_started = Instant::now();
    let resumed = demo(&fx.url, &["--resume", "--seed", &seed.to_string()])
        .output()
        .unwrap();
    assert!(
        resumed.status.success(),
        "{journal}final resume failed: {}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&resumed.stdout).unwrap();
    writeln!(
        journal,
        "final resume in {} ms: {summary}",
        resume_started.elapsed().as_millis()
    )
    .unwrap();

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
    // The operator's cancels took effect: each cancelled saga ended compensated, with
    // the cancel in its history.
    assert!(
        !cancelled.is_empty(),
        "{journal}no cancel of the 40 attempted found a saga to cancel"
    );
    for id in &cancelled {
        let (status, cancels): (String, i64) = sqlx::query_as(
            "SELECT s.status, (SELECT COUNT(*) FROM sagabox_saga_events e \
             WHERE e.saga_id = s.id AND e.kind = 'cancelled') FROM sagabox_saga_instances s WHERE s.id = $1",
        )
        .bind(id)
        .fetch_one(&fx.pool)
        .await
        .unwrap();
        assert_eq!(
            (status.as_str(), cancels),
            ("compensated", 1),
            "{journal}saga {id}"
        );
    }
    writeln!(
        journal,
        "{} sagas cancelled by the operator",
        cancelled.len()
    )
    .unwrap();
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
