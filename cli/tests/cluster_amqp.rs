//! The checkout saga on a three-node RabbitMQ cluster of the test's own, quorum queues
//! replicated on all three (`--replicas 3`): the orchestrator (`sagabox demo
//! --external-participants`) and the three participants (`sagabox serve`) each run as a
//! process of their own, given every node's URL. Part-way through the run the node that
//! leads the payment queue is killed with SIGKILL, and later the node then leading the
//! inventory queue; each comes back a few seconds later on its data.
//!
//! The verdict is read from PostgreSQL and from the cluster, not from sagabox's
//! counters: every saga finished, every invariant of the demo holds, each work queue has
//! its three members, nothing is left in a work queue or dead-lettered, and no process
//! was restarted. The stall after each kill (the longest time no saga finished, from the
//! kill until 64 more had) is printed. The moments of the kills come from a seed the
//! output prints; set `CLUSTER_SEED` to replay a run.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/rabbit_cluster.rs"]
#[allow(dead_code, unreachable_pub)]
mod rabbit_cluster;

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use common::cluster_run::{self, ROLES, STALL_WINDOW};
use rabbit_cluster::RabbitCluster;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Orders of a run: a RabbitMQ node takes 9–13 s to start again here, and the 500 or
/// more sagas that finish meanwhile must leave room for the second kill.
const ORDERS: i64 = 2000;

/// The participants' warnings (reconnections) and each subscription, shown if the run
/// stalls.
const SERVE_LOG: &str = "error,sagabox::amqp=info,sagabox::consumer=warn";

/// Waits until no work queue of `prefix` holds a message, the participants alive.
async fn wait_drained(
    cluster: &RabbitCluster,
    prefix: &str,
    processes: &mut [std::process::Child],
    journal: &str,
) {
    let work: Vec<String> = ROLES
        .iter()
        .map(|role| format!("{prefix}.{role}"))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        cluster_run::check_alive(processes, journal);
        let left: Vec<(String, u64)> = cluster
            .queues(prefix)
            .into_iter()
            .filter(|queue| work.contains(&queue.name) && queue.messages > 0)
            .map(|queue| (queue.name, queue.messages))
            .collect();
        if left.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            cluster_run::fail(
                processes,
                &format!(
                    "{journal}messages left in the work queues: {left:?}\n{}",
                    cluster.describe(prefix)
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_three_node_rabbitmq_cluster_loses_two_nodes_in_turn_and_nothing_is_lost_or_doubled() {
    let (seed, mut journal) = cluster_run::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cluster = RabbitCluster::start().await;
    let url = cluster.url();
    let management = cluster.management_url();
    // The management API of the cluster's first node: the default (the broker host's
    // port 15672) is the machine's own broker here. The participants fail 10 % of their
    // runs and a killed node adds a delivery to each message in flight: with the default
    // 5 deliveries, one of the run's ~3,000 commands failing them all has a chance of
    // about 3 %, and it would be dead-lettered. Every process that declares the queues
    // takes the tests' limit.
    let max_deliveries = common::rabbit::MAX_DELIVERIES.to_string();
    let flags = [
        "--amqp-management-url",
        management.as_str(),
        "--max-deliveries",
        max_deliveries.as_str(),
    ];
    let fx = common::Pg::new().await;
    let prefix = format!("sbxc{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let mut processes = common::children::Children::new(
        ROLES
            .iter()
            .map(|role| cluster_run::serve(&url, &prefix, role, &fx.url, seed, &flags, SERVE_LOG))
            .collect(),
    );
    processes.0.push(cluster_run::orchestrator(
        &url,
        &prefix,
        &fx.url,
        (ORDERS, seed),
        &flags,
    ));

    // Each kill lands after a drawn number of sagas finished: the first from the start,
    // the second from when the first node is back.
    let mut stalls = Vec::new();
    for queue_of in ["payment", "inventory"] {
        let at = cluster_run::kill_point(&fx, &mut rng, ORDERS, &journal).await;
        let describe = || cluster.describe(&prefix);
        cluster_run::wait_finished(&fx, at, &mut processes.0, &journal, &describe).await;
        let queue = format!("{prefix}.{queue_of}");
        let (leader, members) = cluster.queue_leader(&queue).await;
        assert_eq!(members, 3, "{journal}{queue} has {members} members");
        let down_for = Duration::from_millis(rng.random_range(1000..=5000));
        writeln!(
            journal,
            "at {at} sagas finished: SIGKILL {leader} (leader of {queue}), back after {down_for:?}"
        )
        .unwrap();
        cluster.kill(&leader);
        let describe = || cluster.describe(&prefix);
        let stalled = cluster_run::stall(&fx, ORDERS, &mut processes.0, &journal, &describe).await;
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

    // A message whose ack was lost with a node is delivered again and answered by the
    // inbox as a duplicate: the participants run until every work queue is empty.
    wait_drained(&cluster, &prefix, &mut processes.0, &journal).await;
    cluster_run::stop_participants(&mut processes.0, &journal);

    // The verdict, from the database and the cluster.
    cluster_run::assert_database_verdict(&fx, ORDERS, &journal).await;
    let queues = cluster.queues(&prefix);
    for role in ROLES {
        let work = format!("{prefix}.{role}");
        let dead = format!("{work}.dead");
        let state = |name: &str| {
            queues
                .iter()
                .find(|queue| queue.name == name)
                .unwrap_or_else(|| panic!("{journal}no queue {name}: {queues:?}"))
                .clone()
        };
        let (work, dead) = (state(&work), state(&dead));
        assert_eq!(work.messages, 0, "{journal}{} drained", work.name);
        assert_eq!(work.members.len(), 3, "{journal}{} members", work.name);
        assert_eq!(
            dead.messages, 0,
            "{journal}{}: nothing dead-lettered",
            dead.name
        );
    }
    eprintln!("{journal}stalls: {stalls:?}");
}
