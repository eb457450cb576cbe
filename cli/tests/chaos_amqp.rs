//! The crash loop over RabbitMQ: payment, inventory and email as separate `sagabox
//! serve` processes and the orchestrator in the `demo` process; 20 times one of the
//! four, chosen at random, is killed with SIGKILL and started again (the orchestrator
//! with `--resume`). Every invariant holds at the end and nothing was dead-lettered. Its
//! own test binary, so its processes' connections do not add to the other crash loop's.
//!
//! Each kill lands after a random amount of work (more orders placed or sagas finished,
//! counted in the database), not after a span of time, so a fast build and a slow one
//! are killed at the same points of the run, and every kill lands while the run still
//! has work. The moments come from a seed, printed on failure; `CHAOS_SEED` replays it.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::fmt::Write as _;
use std::ops::RangeInclusive;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::rabbit::Rabbit;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const ORDERS: i64 = 1500;
const KILLS: usize = 20;
/// How much more work each kill waits for. The kills take at most 20 × 30 orders, plus
/// per kill the sagas in flight (the demo runs 32) and the few placed between the poll
/// that saw the mark and the signal: some 1,300 in the worst draw, half that in a
/// typical one, so every kill finds orders left to place. Few enough orders that the
/// run's end, after the kills, stays short in a debug build.
const MORE: RangeInclusive<i64> = 1..=30;

use common::chaos::{FINISHED, Moment, PLACED, UNFINISHED, assert_running, count, demo, kill};

const ROLES: [&str; 3] = ["payment", "inventory", "email"];

fn orchestrator(fx: &common::Pg, rabbit: &Rabbit, extra: &[&str]) -> Command {
    let mut command = demo(&fx.url, extra);
    command.args([
        "--transport",
        &rabbit.config.url,
        "--queue-prefix",
        &rabbit.config.queue_prefix,
        // The participants inject the handler failures (their --fail-rate); the
        // demo's own --fail-rate has no handler to act on here.
        "--external-participants",
        "--max-deliveries",
        &common::rabbit::MAX_DELIVERIES.to_string(),
    ]);
    command.env_remove("AMQP_URL");
    command
}

async fn wait_consuming(rabbit: &Rabbit, role: &str, journal: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while rabbit.consumers(&rabbit.queue(role)).await == 0 {
        assert!(
            Instant::now() < deadline,
            "{journal}the {role} participant never started consuming"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_random_participant_killed_twenty_times_every_invariant_holds() {
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .map(|s| s.parse().expect("CHAOS_SEED is a number"))
        .unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut journal = format!("RabbitMQ crash loop seed {seed} (replay with CHAOS_SEED={seed})\n");
    let fx = common::Pg::new().await;
    let rabbit = Rabbit::new(&ROLES).await;
    let mut participants = common::children::Children::new(
        ROLES
            .iter()
            .map(|role| rabbit.serve(role, &fx.url, seed))
            .collect(),
    );
    for role in ROLES {
        wait_consuming(&rabbit, role, &journal).await;
    }
    let mut orchestrator_process = common::children::Children::new(vec![
        orchestrator(
            &fx,
            &rabbit,
            &["--orders", &ORDERS.to_string(), "--seed", &seed.to_string()],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    ]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(&fx, "SELECT COUNT(*) FROM demo_run").await == 0 {
        assert!(
            orchestrator_process[0].try_wait().unwrap().is_none(),
            "{journal}the first run ended before it recorded itself"
        );
        assert!(
            Instant::now() < deadline,
            "{journal}the first run never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let loop_started = Instant::now();
    for kill_no in 0..KILLS {
        let moment = Moment::random(&mut rng, MORE);
        let victim = rng.random_range(0..=ROLES.len());
        let from = moment
            .wait(&fx, &journal, || {
                assert_running(&mut orchestrator_process[0], "the orchestrator", &journal);
                for (role, child) in ROLES.iter().zip(participants.iter_mut()) {
                    assert_running(child, &format!("the {role} participant"), &journal);
                }
            })
            .await;
        let (what, landed) = if victim == ROLES.len() {
            let landed = kill(&mut orchestrator_process[0]);
            orchestrator_process[0] = orchestrator(
                &fx,
                &rabbit,
                &["--resume", "--seed", &(seed ^ kill_no as u64).to_string()],
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
            ("orchestrator", landed)
        } else {
            let landed = kill(&mut participants[victim]);
            participants[victim] = rabbit.serve(ROLES[victim], &fx.url, seed ^ kill_no as u64);
            (ROLES[victim], landed)
        };
        // Counted after the kill: orders still to place, or a saga not finished, mean
        // the run had not ended when the signal landed.
        let (finished, placed) = (count(&fx, FINISHED).await, count(&fx, PLACED).await);
        let unfinished = count(&fx, UNFINISHED).await;
        writeln!(
            journal,
            "kill {kill_no:2}: {what} after {} more {} (from {from}): \
             {placed} placed, {finished} finished{}",
            moment.more,
            moment.progress,
            if landed { "" } else { " (had already exited)" }
        )
        .unwrap();
        assert!(
            landed,
            "{journal}the {what} had exited before kill {kill_no}"
        );
        assert!(
            placed < ORDERS || unfinished > 0,
            "{journal}kill {kill_no} landed after the run: the kills took more work than ORDERS"
        );
    }
    writeln!(
        journal,
        "kills done in {} ms",
        loop_started.elapsed().as_millis()
    )
    .unwrap();
    let rest_started = Instant::now();
    // The last orchestrator finishes the run; if it was killed just now, the new one
    // resumes it.
    let finished_at = Instant::now() + Duration::from_secs(600);
    loop {
        if let Some(status) = orchestrator_process[0].try_wait().unwrap() {
            assert!(
                status.success(),
                "{journal}the last orchestrator failed: {status}"
            );
            break;
        }
        for (role, child) in ROLES.iter().zip(participants.iter_mut()) {
            assert!(
                child.try_wait().unwrap().is_none(),
                "{journal}the {role} participant exited by itself"
            );
        }
        assert!(
            Instant::now() < finished_at,
            "{journal}the run did not finish in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for child in participants.iter() {
        common::children::terminate(child);
    }
    for (role, child) in ROLES.iter().zip(participants.iter_mut()) {
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "{journal}{role} did not stop cleanly: {status}"
        );
    }
    writeln!(
        journal,
        "finished: {} sagas, the rest in {} ms",
        count(&fx, FINISHED).await,
        rest_started.elapsed().as_millis()
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
    let broken = common::invariants::violations(&fx.pool).await;
    assert!(broken.is_empty(), "{journal}invariants broken: {broken:?}");
    for role in ROLES {
        assert_eq!(
            rabbit.ready(&rabbit.dead_queue(role)).await,
            0,
            "{journal}{role}: nothing dead-lettered"
        );
    }
    eprintln!("{journal}");
}
