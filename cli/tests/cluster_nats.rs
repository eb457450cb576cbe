//! The checkout saga on a three-node NATS JetStream cluster of the test's own, streams
//! replicated on all three (`--replicas 3`): the orchestrator (`sagabox demo
//! --external-participants`) and the three participants (`sagabox serve`) each run as a
//! process of their own, given every node's URL. Part-way through the run the node that
//! leads the payment stream is killed with SIGKILL, and later the node then leading the
//! inventory stream; each comes back a few seconds later on its store.
//!
//! The verdict is read from PostgreSQL and from the cluster, not from sagabox's
//! counters: every saga finished, every invariant of the demo holds, each stream has its
//! three replicas, nothing is left in a work stream or dead-lettered, and no process was
//! restarted. The stall after each kill (the longest time no saga finished, from the kill
//! until 64 more had) is printed, and so is how many stalled consumers the watchdog
//! stepped down. The moments of the kills come from a seed the output prints; set
//! `CLUSTER_SEED` to replay a run.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;
#[path = "../../tests/common/nats_cluster.rs"]
#[allow(dead_code, unreachable_pub)]
mod nats_cluster;

use std::fmt::Write as _;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::chaos::{FINISHED, STALL, count};
use jetstream::Js;
use nats_cluster::NatsCluster;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const ROLES: [&str; 3] = ["payment", "inventory", "email"];
const ORDERS: i64 = 400;

/// `sagabox serve --role role` on the cluster, streams created with three replicas,
/// failing 10 % of handler runs (seeded).
fn serve(cluster: &str, prefix: &str, role: &str, database_url: &str, seed: u64) -> Child {
    common::sagabox_command(&[
        "serve",
        "--role",
        role,
        "--database-url",
        database_url,
        "--transport",
        cluster,
        "--queue-prefix",
        prefix,
        "--replicas",
        "3",
        "--fail-rate",
        "0.1",
        "--seed",
        &seed.to_string(),
    ])
    // The stalled-consumer watchdog's warnings, counted at the end.
    .env("RUST_LOG", "error,sagabox::nats=warn")
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start sagabox serve")
}

/// The orchestrator: `sagabox demo` placing the orders, its participants elsewhere.
fn orchestrator(cluster: &str, prefix: &str, database_url: &str, seed: u64) -> Child {
    common::sagabox_command(&[
        "demo",
        "--database-url",
        database_url,
        "--orders",
        &ORDERS.to_string(),
        "--concurrency",
        "32",
        "--duplicate-rate",
        "0.5",
        "--lost-reply-rate",
        "0.1",
        "--decline-rate",
        "0.05",
        "--seed",
        &seed.to_string(),
        "--transport",
        cluster,
        "--queue-prefix",
        prefix,
        "--external-participants",
        "--replicas",
        "3",
        "--json",
    ])
    .env("RUST_LOG", "error")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start sagabox demo")
}

/// Panics with its stderr when a process the run needs has exited.
fn check_alive(processes: &mut [Child], journal: &str) {
    for child in processes.iter_mut() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                std::io::Read::read_to_string(&mut pipe, &mut stderr).unwrap();
            }
            panic!("{journal}a process exited ({status}): {stderr}");
        }
    }
}

/// Waits until `target` sagas have finished, the participants alive.
async fn wait_finished(fx: &common::Pg, target: i64, participants: &mut [Child], journal: &str) {
    let mut last = (count(fx, FINISHED).await, Instant::now());
    loop {
        check_alive(participants, journal);
        let finished = count(fx, FINISHED).await;
        if finished >= target {
            return;
        }
        if finished > last.0 {
            last = (finished, Instant::now());
        }
        assert!(
            last.1.elapsed() < STALL,
            "{journal}no saga finished for {STALL:?} ({finished} of {target} awaited)"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The stall a kill caused: the longest time no saga finished, from the kill until
/// [`STALL_WINDOW`] more sagas have finished (or every saga has).
async fn stall(fx: &common::Pg, participants: &mut [Child], journal: &str) -> Duration {
    let at_kill = count(fx, FINISHED).await;
    let target = (at_kill + STALL_WINDOW).min(ORDERS);
    let (mut last, mut moved, mut longest) = (at_kill, Instant::now(), Duration::ZERO);
    while last < target {
        check_alive(participants, journal);
        let finished = count(fx, FINISHED).await;
        longest = longest.max(moved.elapsed());
        if finished > last {
            (last, moved) = (finished, Instant::now());
        }
        assert!(
            moved.elapsed() < STALL,
            "{journal}no saga finished for {STALL:?} after a kill"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    longest
}

/// How many sagas finishing after a kill its stall is measured over: more than run at
/// once (the demo's concurrency, 32), so every saga in flight at the kill is among them.
const STALL_WINDOW: i64 = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_three_node_jetstream_cluster_loses_two_nodes_in_turn_and_nothing_is_lost_or_doubled() {
    let seed: u64 = std::env::var("CLUSTER_SEED")
        .ok()
        .map(|s| s.parse().expect("CLUSTER_SEED is a number"))
        .unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut journal = format!("cluster seed {seed} (replay with CLUSTER_SEED={seed})\n");
    eprintln!("{journal}");
    let mut cluster = NatsCluster::start().await;
    let url = cluster.url();
    let fx = common::Pg::new().await;
    let js = Js::on(&url, &ROLES).await;
    let prefix = js.config.prefix.clone();
    let mut processes = common::children::Children::new(
        ROLES
            .iter()
            .map(|role| serve(&url, &prefix, role, &fx.url, seed))
            .collect(),
    );
    processes.0.push(orchestrator(&url, &prefix, &fx.url, seed));

    // Each kill lands after a drawn number of finished sagas; the second well after the
    // first node is back.
    let first_at = rng.random_range(40..=120);
    let second_at = first_at + rng.random_range(100..=160);
    let mut stalls = Vec::new();
    for (at, stream_of) in [(first_at, "payment"), (second_at, "inventory")] {
        wait_finished(&fx, at, &mut processes.0, &journal).await;
        let stream = js.config.stream(&Js::consumer_type(stream_of));
        let (leader, replicas) = cluster.stream_leader(&stream).await;
        assert_eq!(replicas, 3, "{journal}{stream} has {replicas} replicas");
        let down_for = Duration::from_millis(rng.random_range(1000..=5000));
        writeln!(
            journal,
            "at {at} sagas finished: SIGKILL {leader} (leader of {stream}), back after {down_for:?}"
        )
        .unwrap();
        cluster.kill(&leader);
        let stalled = stall(&fx, &mut processes.0, &journal).await;
        writeln!(
            journal,
            "  longest pause in the next {STALL_WINDOW} sagas finished: {stalled:?}"
        )
        .unwrap();
        stalls.push(stalled);
        tokio::time::sleep(down_for.saturating_sub(stalled)).await;
        cluster.restart(&leader).await;
    }

    // The orchestrator ends when every saga has finished; its summary is its stdout.
    let mut orchestrator = processes.0.pop().unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    while orchestrator.try_wait().unwrap().is_none() {
        check_alive(&mut processes.0, &journal);
        assert!(
            Instant::now() < deadline,
            "{journal}the run did not finish within 10 minutes ({} sagas finished)",
            count(&fx, FINISHED).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let output = orchestrator.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{journal}the orchestrator failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    eprintln!("{journal}{summary}");

    // An ack sent to a node as it died is lost with it: JetStream redelivers that message
    // after ack_wait and the inbox answers it as a duplicate. The participants run until
    // every stream is empty.
    js.wait_drained(&ROLES, Duration::from_secs(120), &journal, || {
        check_alive(&mut processes.0, &journal);
    })
    .await;
    for child in processes.0.iter() {
        common::children::terminate(child);
    }
    let mut step_downs = 0;
    for child in std::mem::take(&mut processes.0) {
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "{journal}a participant did not stop cleanly: {stderr}"
        );
        step_downs += stderr.matches("asking its leader to step down").count();
    }
    writeln!(journal, "stalled consumers stepped down: {step_downs}").unwrap();

    // The verdict, from the database and the cluster.
    assert_eq!(
        fx.scalar("SELECT COUNT(*) FROM demo_orders").await,
        ORDERS,
        "{journal}orders placed"
    );
    assert_eq!(
        count(&fx, FINISHED).await,
        ORDERS,
        "{journal}every saga finished"
    );
    let broken = common::invariants::violations(&fx.pool).await;
    assert!(broken.is_empty(), "{journal}invariants broken: {broken:?}");
    for role in ROLES {
        assert_eq!(js.pending(role).await, 0, "{journal}{role} stream drained");
        assert_eq!(
            js.dead(role).await,
            0,
            "{journal}{role}: nothing dead-lettered: {:?}",
            js.dead_headers(role).await
        );
        let (_, replicas) = cluster
            .stream_leader(&js.config.stream(&Js::consumer_type(role)))
            .await;
        assert_eq!(replicas, 3, "{journal}{role}'s stream replicas");
    }
    eprintln!("{journal}stalls: {stalls:?}");
}
