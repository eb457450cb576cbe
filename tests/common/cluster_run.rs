//! The checkout saga run across a broker cluster of a test's own, as the cluster tests
//! run it: the three participants as `sagabox serve` processes and the orchestrator as
//! `sagabox demo --external-participants`, each given every node's URL; waiting for a
//! number of finished sagas, measuring the stall a node's loss causes, and reading the
//! verdict from the database. The broker is the caller's: the helpers take its URL and
//! the flags it needs.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use super::Pg;
use super::chaos::{FINISHED, STALL, count};

/// The participants' roles.
pub const ROLES: [&str; 3] = ["payment", "inventory", "email"];
/// Orders a run places unless it needs more: enough that the sagas finishing while a
/// killed node is down and starts again leave room for the next kill (see
/// [`kill_point`]).
pub const ORDERS: i64 = 1000;
/// How many sagas finishing after a kill its stall is measured over: more than run at
/// once (the demo's concurrency, 32), so every saga in flight at the kill is among them.
pub const STALL_WINDOW: i64 = 64;
/// Sagas that still finish after a kill's stall window: the orchestrator (which ends
/// with the last saga) must outlive the window, or the run could end inside it.
const AFTER_WINDOW: i64 = 40;

/// Where the next kill lands: once 40 to 240 more sagas (drawn) have finished than now,
/// but no later than leaves [`STALL_WINDOW`] and a margin of `orders` to finish after
/// it. A run too far gone for that (a node's restart outlasting most of it) fails with
/// what to change.
pub async fn kill_point(fx: &Pg, rng: &mut impl rand::Rng, orders: i64, journal: &str) -> i64 {
    let finished = count(fx, FINISHED).await;
    let latest = orders - STALL_WINDOW - AFTER_WINDOW;
    assert!(
        finished + 40 <= latest,
        "{journal}{finished} of {orders} sagas had finished when the next kill was due: \
         too few left to measure its stall; place more orders (ORDERS)"
    );
    finished + rand::RngExt::random_range(rng, 40..=240.min(latest - finished))
}

/// The run's seed (`CLUSTER_SEED`, or drawn) and the journal that starts with it.
pub fn seed() -> (u64, String) {
    let seed: u64 = std::env::var("CLUSTER_SEED")
        .ok()
        .map(|s| s.parse().expect("CLUSTER_SEED is a number"))
        .unwrap_or_else(rand::random);
    let journal = format!("cluster seed {seed} (replay with CLUSTER_SEED={seed})\n");
    eprintln!("{journal}");
    (seed, journal)
}

/// `sagabox serve --role role` on the cluster, queues or streams created with three
/// replicas, failing 10 % of handler runs (seeded), with the broker's own `flags` and
/// `RUST_LOG=log`.
pub fn serve(
    cluster: &str,
    prefix: &str,
    role: &str,
    database_url: &str,
    seed: u64,
    flags: &[&str],
    log: &str,
) -> Child {
    let seed = seed.to_string();
    let mut args = vec![
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
        &seed,
    ];
    args.extend_from_slice(flags);
    super::sagabox_command(&args)
        .env("RUST_LOG", log)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sagabox serve")
}

/// The orchestrator: `sagabox demo` placing `orders` orders under duplicates and lost
/// replies, its participants elsewhere, with the broker's own `flags`.
pub fn orchestrator(
    cluster: &str,
    prefix: &str,
    database_url: &str,
    (orders, seed): (i64, u64),
    flags: &[&str],
) -> Child {
    let (orders, seed) = (orders.to_string(), seed.to_string());
    let mut args = vec![
        "demo",
        "--database-url",
        database_url,
        "--orders",
        &orders,
        "--concurrency",
        "32",
        "--duplicate-rate",
        "0.5",
        "--lost-reply-rate",
        "0.1",
        "--decline-rate",
        "0.05",
        "--seed",
        &seed,
        "--transport",
        cluster,
        "--queue-prefix",
        prefix,
        "--external-participants",
        "--replicas",
        "3",
        "--json",
    ];
    args.extend_from_slice(flags);
    super::sagabox_command(&args)
        .env("RUST_LOG", ORCHESTRATOR_LOG)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sagabox demo")
}

/// The orchestrator's log: its reconnections, and when each consumer subscribes again.
const ORCHESTRATOR_LOG: &str = "error,sagabox::amqp=info,sagabox::nats=warn,sagabox::consumer=warn";

/// Notes in the journal how long node `node` took to start again (since `restarting`)
/// and how many sagas had finished by then.
pub async fn journal_restart(fx: &Pg, journal: &mut String, node: &str, restarting: Instant) {
    let took = restarting.elapsed();
    let finished = count(fx, FINISHED).await;
    journal.push_str(&format!(
        "  {node} up again after {took:?}, at {finished} sagas finished\n"
    ));
}

/// Panics with its stderr when a process the run needs has exited.
pub fn check_alive(processes: &mut [Child], journal: &str) {
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

/// Kills the processes and panics with `what` and what each wrote to stderr.
pub fn fail(processes: &mut [Child], what: &str) -> ! {
    let mut report = String::from(what);
    for child in processes.iter_mut() {
        let _ = child.kill();
        let mut stderr = String::new();
        if let Some(mut pipe) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
        }
        report.push_str(&format!("\n--- process {} ---\n{stderr}", child.id()));
    }
    panic!("{report}");
}

/// Waits until `target` sagas have finished, the processes alive; a stall fails with
/// what `describe` says of the brokers.
pub async fn wait_finished(
    fx: &Pg,
    target: i64,
    processes: &mut [Child],
    journal: &str,
    describe: &dyn Fn() -> String,
) {
    let mut last = (count(fx, FINISHED).await, Instant::now());
    loop {
        check_alive(processes, journal);
        let finished = count(fx, FINISHED).await;
        if finished >= target {
            return;
        }
        if finished > last.0 {
            last = (finished, Instant::now());
        }
        if last.1.elapsed() >= STALL {
            fail(
                processes,
                &format!(
                    "{journal}no saga finished for {STALL:?} ({finished} of {target} awaited)\n{}",
                    describe()
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The stall a kill caused: the longest time no saga finished, from the kill until
/// [`STALL_WINDOW`] more sagas have finished (or all `orders` have). A stall past
/// [`STALL`] fails with what `describe` says of the brokers.
pub async fn stall(
    fx: &Pg,
    orders: i64,
    processes: &mut [Child],
    journal: &str,
    describe: &dyn Fn() -> String,
) -> Duration {
    let at_kill = count(fx, FINISHED).await;
    let target = (at_kill + STALL_WINDOW).min(orders);
    let (mut last, mut moved, mut longest) = (at_kill, Instant::now(), Duration::ZERO);
    while last < target {
        check_alive(processes, journal);
        let finished = count(fx, FINISHED).await;
        longest = longest.max(moved.elapsed());
        if finished > last {
            (last, moved) = (finished, Instant::now());
        }
        if moved.elapsed() >= STALL {
            fail(
                processes,
                &format!(
                    "{journal}no saga finished for {STALL:?} after a kill\n{}",
                    describe()
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    longest
}

/// Waits for the orchestrator (the last of `processes`) to end, the participants alive,
/// and returns its JSON summary.
pub async fn orchestrator_summary(
    fx: &Pg,
    processes: &mut Vec<Child>,
    journal: &str,
) -> serde_json::Value {
    let mut orchestrator = processes
        .pop()
        .expect("the orchestrator is the last process");
    let deadline = Instant::now() + Duration::from_secs(600);
    while orchestrator.try_wait().unwrap().is_none() {
        check_alive(processes, journal);
        assert!(
            Instant::now() < deadline,
            "{journal}the run did not finish within 10 minutes ({} sagas finished)",
            count(fx, FINISHED).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let output = orchestrator.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{journal}the orchestrator failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary = serde_json::from_slice(&output.stdout).unwrap();
    eprintln!("{journal}{summary}");
    summary
}

/// Stops the participants with SIGTERM; each must exit cleanly. Returns their stderr.
pub fn stop_participants(processes: &mut Vec<Child>, journal: &str) -> String {
    for child in processes.iter() {
        super::children::terminate(child);
    }
    let mut stderr = String::new();
    for child in std::mem::take(processes) {
        let output = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "{journal}a participant did not stop cleanly: {text}"
        );
        stderr.push_str(&text);
    }
    stderr
}

/// The verdict read from the database: all `orders` placed, every saga finished, every
/// invariant of the demo holds.
pub async fn assert_database_verdict(fx: &Pg, orders: i64, journal: &str) {
    assert_eq!(
        fx.scalar("SELECT COUNT(*) FROM demo_orders").await,
        orders,
        "{journal}orders placed"
    );
    assert_eq!(
        count(fx, FINISHED).await,
        orders,
        "{journal}every saga finished"
    );
    let broken = super::invariants::violations(&fx.pool).await;
    assert!(broken.is_empty(), "{journal}invariants broken: {broken:?}");
}
