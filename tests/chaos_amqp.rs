//! The crash loop over RabbitMQ: payment, inventory and email as separate `sagabox
//! serve` processes and the orchestrator in the `demo` process; at 20 random moments one
//! of the four, chosen at random, is killed with SIGKILL and started again (the
//! orchestrator with `--resume`). Every invariant holds at the end and nothing was
//! dead-lettered. Its own test binary, so its processes' connections do not add to the
//! other crash loop's. The moments come from a seed, printed on failure; `CHAOS_SEED`
//! replays it.

#![allow(clippy::unwrap_used)]

mod common;

use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::rabbit::Rabbit;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const ORDERS: i64 = 3000;
const KILLS: usize = 20;

use common::chaos::{FINISHED, PLACED, count, demo};

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

    for kill in 0..KILLS {
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..=1500))).await;
        let victim = rng.random_range(0..=ROLES.len());
        let (finished, placed) = (count(&fx, FINISHED).await, count(&fx, PLACED).await);
        if victim == ROLES.len() {
            let running = orchestrator_process[0].try_wait().unwrap().is_none();
            orchestrator_process[0].kill().unwrap(); // SIGKILL
            orchestrator_process[0].wait().unwrap();
            writeln!(
                journal,
                "kill {kill:2}: orchestrator{}, {placed} placed, {finished} finished",
                if running { "" } else { " (had already exited)" }
            )
            .unwrap();
            orchestrator_process[0] = orchestrator(
                &fx,
                &rabbit,
                &["--resume", "--seed", &(seed ^ kill as u64).to_string()],
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        } else {
            let role = ROLES[victim];
            let child = &mut participants[victim];
            assert!(
                child.try_wait().unwrap().is_none(),
                "{journal}the {role} participant exited by itself"
            );
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            writeln!(
                journal,
                "kill {kill:2}: {role}, {placed} placed, {finished} finished"
            )
            .unwrap();
            *child = rabbit.serve(role, &fx.url, seed ^ kill as u64);
        }
    }
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
    for child in participants.iter_mut() {
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }
    for (role, child) in ROLES.iter().zip(participants.iter_mut()) {
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "{journal}{role} did not stop cleanly: {status}"
        );
    }
    writeln!(journal, "finished: {} sagas", count(&fx, FINISHED).await).unwrap();
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
