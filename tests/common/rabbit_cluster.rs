//! A three-node RabbitMQ cluster of the test's own, on loopback ports of its own beside
//! the machine's broker: [`RabbitCluster`] starts the nodes (each with its own node
//! name, AMQP, distribution and management ports, data folder and an empty `conf.d`, so
//! the machine's configuration and its TLS listeners stay out), joins the second and
//! third to the first, kills a node as a crash would (SIGKILL to its Erlang VM), starts
//! it again on its data, and asks the cluster which node leads a queue. Stopped, and
//! its folder removed, on drop.
//!
//! The nodes run as the `rabbitmq` user, as the packaged server does, and so share its
//! Erlang cookie with `rabbitmqctl`.

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::scrape::free_port;

/// One node: its name, ports and folder, and its processes while it runs.
struct Node {
    name: String,
    amqp_port: u16,
    dist_port: u16,
    management_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Node {
    /// The Erlang VM's process id, from the pid file the server writes.
    fn vm_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("pid"))
            .ok()
            .and_then(|pid| pid.trim().parse().ok())
    }
}

/// The cluster: three nodes named `<run>-r1@localhost`, `-r2`, `-r3`.
pub struct RabbitCluster {
    nodes: Vec<Node>,
    dir: PathBuf,
}

/// One queue as `rabbitmqctl list_queues` reports it.
#[derive(Debug, Clone)]
pub struct QueueState {
    /// Its name.
    pub name: String,
    /// Messages ready and unacknowledged.
    pub messages: u64,
    /// The node leading a quorum queue.
    pub leader: Option<String>,
    /// A quorum queue's members.
    pub members: Vec<String>,
}

impl QueueState {
    /// From one entry of `list_queues --formatter json` (a classic queue reports no
    /// leader nor members, as an empty string or nothing).
    fn from_json(entry: &serde_json::Value) -> Self {
        let text = |field: &str| entry.get(field).and_then(serde_json::Value::as_str);
        Self {
            name: text("name").unwrap_or_default().to_owned(),
            messages: entry
                .get("messages")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or_default(),
            leader: text("leader")
                .filter(|leader| !leader.is_empty())
                .map(str::to_owned),
            members: entry
                .get("members")
                .and_then(serde_json::Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|member| member.as_str().map(str::to_owned))
                .collect(),
        }
    }
}

impl RabbitCluster {
    /// Starts three nodes, joins the second and third to the first, and waits until
    /// the cluster reports all three running.
    pub async fn start() -> Self {
        let run = format!("sbx{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let dir = std::env::temp_dir().join(format!("sagabox-{run}"));
        let nodes = (1..=3)
            .map(|n| Node {
                name: format!("{run}-r{n}@localhost"),
                amqp_port: free_port(),
                dist_port: free_port(),
                management_port: free_port(),
                dir: dir.join(format!("r{n}")),
                child: None,
            })
            .collect();
        let mut cluster = Self { nodes, dir };
        for index in 0..cluster.nodes.len() {
            cluster.prepare(index);
        }
        for index in 0..cluster.nodes.len() {
            cluster.spawn(index);
        }
        for index in 0..cluster.nodes.len() {
            cluster.await_startup(index).await;
        }
        let first = cluster.nodes[0].name.clone();
        for index in 1..cluster.nodes.len() {
            let name = cluster.nodes[index].name.clone();
            cluster.ctl_ok(&name, &["stop_app"]);
            cluster.ctl_ok(&name, &["join_cluster", &first]);
            cluster.ctl_ok(&name, &["start_app"]);
        }
        let running = cluster.ctl_ok(&first, &["cluster_status", "--formatter", "json"]);
        for node in &cluster.nodes {
            assert!(
                running.contains(&node.name),
                "{} is not in the cluster: {running}",
                node.name
            );
        }
        cluster
    }

    /// Every node's AMQP URL, comma-separated, as sagabox takes a cluster.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|node| format!("amqp://guest:guest@127.0.0.1:{}/%2f", node.amqp_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The first node's management API (any node's answers for the whole cluster).
    pub fn management_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.nodes[0].management_port)
    }

    /// The queues named `<prefix>.…`, as a running node reports them.
    pub fn queues(&self, prefix: &str) -> Vec<QueueState> {
        let node = self.running_node();
        let listed = self.ctl_ok(
            &node,
            &[
                "list_queues",
                "-q",
                "name",
                "messages",
                "leader",
                "members",
                "--formatter",
                "json",
            ],
        );
        let queues: Vec<serde_json::Value> = serde_json::from_str(&listed)
            .unwrap_or_else(|error| panic!("list_queues said {listed:?}: {error}"));
        queues
            .iter()
            .map(QueueState::from_json)
            .filter(|queue| queue.name.starts_with(&format!("{prefix}.")))
            .collect()
    }

    /// What the running nodes say of the cluster and of the queues named `<prefix>.…`
    /// (messages ready and unacked, consumers, leader, members online): for a failure's
    /// message.
    pub fn describe(&self, prefix: &str) -> String {
        let mut text = String::new();
        for node in self.nodes.iter().filter(|node| node.child.is_some()) {
            let queues = self.ctl(
                &node.name,
                &[
                    "list_queues",
                    "-q",
                    "name",
                    "type",
                    "messages_ready",
                    "messages_unacknowledged",
                    "consumers",
                    "leader",
                    "online",
                ],
            );
            text.push_str(&format!("--- {} says of the queues ---\n", node.name));
            for line in String::from_utf8_lossy(&queues.stdout).lines() {
                if line.starts_with(&format!("{prefix}.")) {
                    text.push_str(line);
                    text.push('\n');
                }
            }
            text.push_str(&String::from_utf8_lossy(&queues.stderr));
        }
        text
    }

    /// The node leading quorum queue `queue`, and how many members it has (waiting out
    /// an election).
    pub async fn queue_leader(&self, queue: &str) -> (String, usize) {
        let prefix = queue.split('.').next().unwrap_or(queue).to_owned();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let found = self.queues(&prefix).into_iter().find(|q| q.name == queue);
            if let Some(QueueState {
                leader: Some(leader),
                members,
                ..
            }) = found
                && self.nodes.iter().any(|node| node.name == leader)
            {
                return (leader, members.len());
            }
            assert!(Instant::now() < deadline, "queue {queue} has no leader");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Kills node `name`'s Erlang VM at once (SIGKILL), as a crash would.
    pub fn kill(&mut self, name: &str) {
        let index = self.index(name);
        let node = &mut self.nodes[index];
        if let Some(pid) = node.vm_pid() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(node.dir.join("pid"));
    }

    /// Starts node `name` again on its data, and waits until it runs.
    pub async fn restart(&mut self, name: &str) {
        let index = self.index(name);
        self.spawn(index);
        self.await_startup(index).await;
    }

    /// Node `name`'s log so far.
    pub fn log(&self, name: &str) -> String {
        let node = &self.nodes[self.index(name)];
        let mut log = std::fs::read_to_string(node.dir.join("stdout.log")).unwrap_or_default();
        if let Ok(entries) = std::fs::read_dir(node.dir.join("log")) {
            for entry in entries.flatten() {
                log.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
            }
        }
        log
    }

    fn index(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|node| node.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// A node whose VM runs, to ask about the cluster.
    fn running_node(&self) -> String {
        self.nodes
            .iter()
            .find(|node| node.child.is_some())
            .map(|node| node.name.clone())
            .expect("a node of the cluster runs")
    }

    /// Writes node `index`'s configuration and makes its folder the server's.
    fn prepare(&self, index: usize) {
        let node = &self.nodes[index];
        for folder in ["conf.d", "mnesia", "log"] {
            std::fs::create_dir_all(node.dir.join(folder)).expect("node folder");
        }
        std::fs::write(
            node.dir.join("rabbitmq.conf"),
            format!(
                "listeners.tcp.local = 127.0.0.1:{}\nlisteners.ssl = none\nloopback_users = none\n\
                 management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {}\n",
                node.amqp_port, node.management_port
            ),
        )
        .expect("node config");
        std::fs::write(node.dir.join("enabled_plugins"), "[rabbitmq_management].\n")
            .expect("node plugins");
        let owned = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&self.dir)
            .status()
            .expect("run chown");
        assert!(owned.success(), "chown of {} failed", self.dir.display());
    }

    fn spawn(&mut self, index: usize) {
        let node = &mut self.nodes[index];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.dir.join("stdout.log"))
            .expect("node log");
        let child = Command::new("rabbitmq-server")
            .env("RABBITMQ_NODENAME", &node.name)
            .env("RABBITMQ_DIST_PORT", node.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", node.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", node.dir.join("log"))
            .env("RABBITMQ_PID_FILE", node.dir.join("pid"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                node.dir.join("enabled_plugins"),
            )
            .env("RABBITMQ_CONFIG_FILE", node.dir.join("rabbitmq.conf"))
            .env("RABBITMQ_CONFIG_FILES", node.dir.join("conf.d"))
            .stdout(log.try_clone().expect("node log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| {
                panic!("cannot start rabbitmq-server: {error}; is RabbitMQ installed?")
            });
        node.child = Some(child);
    }

    async fn await_startup(&self, index: usize) {
        let node = &self.nodes[index];
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let up = self.ctl(&node.name, &["await_startup", "--timeout", "5"]);
            if up.status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "RabbitMQ node {} did not start: {}\n{}",
                node.name,
                String::from_utf8_lossy(&up.stderr),
                self.log(&node.name)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn ctl(&self, node: &str, args: &[&str]) -> Output {
        Command::new("rabbitmqctl")
            .args(["-n", node])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run rabbitmqctl")
    }

    /// `rabbitmqctl -n node args`, which must succeed; its stdout.
    fn ctl_ok(&self, node: &str, args: &[&str]) -> String {
        let output = self.ctl(node, args);
        assert!(
            output.status.success(),
            "rabbitmqctl -n {node} {args:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        let names: Vec<String> = self.nodes.iter().map(|node| node.name.clone()).collect();
        for name in names {
            self.kill(&name);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
