//! The checkout saga on a three-node NATS JetStream cluster of the test's own, streams
//! replicated on all three (`--replicas 3`): the orchestrator (`sagabox demo
//! --external-participants`) and the three participants (`sagabox serve`) each run as a
//! process of their own, given every node's URL. Part-way through the run the node that
//! leads the payment stream is killed with SIGKILL, and later the node then leading the
//! inventory stream; each comes back a few seconds later on its store.
//!
//! The verdict is read from PostgreSQL and from the cluster, not from sagabox's
//! counters: every saga finished, every invariant of the demo holds, each stream has its
//! three replicas, every consumer has settled every message of its stream (nothing left
//! to deliver, nothing delivered and unacknowledged), nothing is dead-lettered, and no
//! process was restarted. nats-server 2.9 can keep a message its consumer acknowledged in
//! a replicated work queue across a leader change: such messages are counted and
//! printed, not failed. The stall after each kill (the longest time no saga finished, from the kill
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
use std::time::{Duration, Instant};

use common::cluster_run::{self, ORDERS, ROLES, STALL_WINDOW};
use jetstream::Js;
use nats_cluster::NatsCluster;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// The stalled-consumer watchdog's warnings, counted at the end.
const SERVE_LOG: &str = "error,sagabox::nats=warn";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_three_node_jetstream_cluster_loses_two_nodes_in_turn_and_nothing_is_lost_or_doubled() {
    let (seed, mut journal) = cluster_run::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cluster = NatsCluster::start().await;
    let url = cluster.url();
    let fx = common::Pg::new().await;
    let js = Js::on(&url, &ROLES).await;
    let prefix = js.config.prefix.clone();
    let mut processes = common::children::Children::new(
        ROLES
            .iter()
            .map(|role| cluster_run::serve(&url, &prefix, role, &fx.url, seed, &[], SERVE_LOG))
            .collect(),
    );
    processes.0.push(cluster_run::orchestrator(
        &url,
        &prefix,
        &fx.url,
        (ORDERS, seed),
        &[],
    ));

    // Each kill lands after a drawn number of sagas finished: the first from the start,
    // the second from when the first node is back.
    let mut stalls = Vec::new();
    for stream_of in ["payment", "inventory"] {
        let at = cluster_run::kill_point(&fx, &mut rng, ORDERS, &journal).await;
        cluster_run::wait_finished(&fx, at, &mut processes.0, &journal, &String::new).await;
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
        let stalled =
            cluster_run::stall(&fx, ORDERS, &mut processes.0, &journal, &String::new).await;
        writeln!(
            journal,
            "  longest pause in the next {STALL_WINDOW} sagas finished: {stalled:?}"
        )
        .unwrap();
        stalls.push(stalled);
        tokio::time::sleep(down_for.saturating_sub(stalled)).await;
        let restarting = Instant::now();
        cluster.restart(&leader).await;
        cluster_run::journal_restart(&fx, &mut journal, &leader, restarting).await;
    }

    // The orchestrator ends when every saga has finished; its summary is its stdout.
    cluster_run::orchestrator_summary(&fx, &mut processes.0, &journal).await;

    // An ack sent to a node as it died is lost with it: JetStream redelivers that message
    // after ack_wait and the inbox answers it as a duplicate. The participants run until
    // every consumer has settled every message of its stream.
    let kept = js
        .wait_settled(&ROLES, Duration::from_secs(120), &journal, || {
            cluster_run::check_alive(&mut processes.0, &journal);
        })
        .await;
    // Settled, yet still in a stream: the server's leak, not a message left undone.
    writeln!(journal, "acknowledged messages the streams kept: {kept}").unwrap();
    let stderr = cluster_run::stop_participants(&mut processes.0, &journal);
    let step_downs = stderr.matches("asking its leader to step down").count();
    writeln!(journal, "stalled consumers stepped down: {step_downs}").unwrap();

    // The verdict, from the database and the cluster.
    cluster_run::assert_database_verdict(&fx, ORDERS, &journal).await;
    for role in ROLES {
        assert_eq!(
            js.unsettled(role).await,
            0,
            "{journal}{role}: every message settled"
        );
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
