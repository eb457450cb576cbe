//! A three-node NATS JetStream cluster of the test's own, on loopback ports of its own:
//! [`NatsCluster`] starts the nodes (each with its own store folder, all routed to each
//! other), kills one as a crash would (SIGKILL), starts it again on its store, and asks
//! the cluster which node leads a stream. Stopped, and its folders removed, on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;

use super::jetstream::{free_port, server_binary};

/// One node: its name, ports and store, and its process while it runs.
struct Node {
    name: String,
    port: u16,
    cluster_port: u16,
    store: PathBuf,
    child: Option<Child>,
}

/// The cluster: three nodes named `n1`, `n2`, `n3`.
pub struct NatsCluster {
    nodes: Vec<Node>,
    name: String,
}

impl NatsCluster {
    /// Starts three nodes and waits until JetStream answers on the cluster (a meta
    /// leader is elected).
    pub async fn start() -> Self {
        let name = format!("sagabox-{}", uuid::Uuid::new_v4().simple());
        let nodes = (1..=3)
            .map(|n| Node {
                name: format!("n{n}"),
                port: free_port(),
                cluster_port: free_port(),
                store: std::env::temp_dir().join(format!("{name}-n{n}")),
                child: None,
            })
            .collect();
        let mut cluster = Self { nodes, name };
        for node in 0..cluster.nodes.len() {
            cluster.spawn(node);
        }
        cluster.wait_for_jetstream(Duration::from_secs(60)).await;
        cluster
    }

    /// Every node's URL, comma-separated, as sagabox and NATS's tools take a cluster.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|node| format!("nats://127.0.0.1:{}", node.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Every node's URL.
    fn servers(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| format!("nats://127.0.0.1:{}", node.port))
            .collect()
    }

    fn index(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|node| node.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    fn spawn(&mut self, index: usize) {
        let routes = self
            .nodes
            .iter()
            .map(|node| format!("nats://127.0.0.1:{}", node.cluster_port))
            .collect::<Vec<_>>()
            .join(",");
        let node = &mut self.nodes[index];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.store.with_extension("log"))
            .expect("node log");
        let child = Command::new(server_binary())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &node.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&node.store)
            .args([
                "-n",
                &node.name,
                "--cluster_name",
                &self.name,
                "--cluster",
                &format!("nats://127.0.0.1:{}", node.cluster_port),
                "--routes",
                &routes,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot start {}: {error}; is nats-server installed?",
                    server_binary()
                )
            });
        node.child = Some(child);
    }

    /// Kills node `name` at once (SIGKILL), as a crash would.
    pub fn kill(&mut self, name: &str) {
        let index = self.index(name);
        if let Some(mut child) = self.nodes[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts node `name` again on its store and ports, and waits until it answers.
    pub async fn restart(&mut self, name: &str) {
        let index = self.index(name);
        self.spawn(index);
        let url = format!("nats://127.0.0.1:{}", self.nodes[index].port);
        let deadline = Instant::now() + Duration::from_secs(30);
        while async_nats::connect(url.as_str()).await.is_err() {
            assert!(
                Instant::now() < deadline,
                "node {name} did not come back; its log:\n{}",
                self.log(name)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Node `name`'s log so far.
    pub fn log(&self, name: &str) -> String {
        let node = &self.nodes[self.index(name)];
        std::fs::read_to_string(node.store.with_extension("log")).unwrap_or_default()
    }

    /// A client of the cluster's JetStream, connected to whichever node answers.
    pub async fn jetstream(&self) -> jetstream::Context {
        let client = async_nats::connect(self.servers())
            .await
            .unwrap_or_else(|error| panic!("cannot connect to the cluster: {error}"));
        jetstream::new(client)
    }

    /// The node that leads `stream`, and how many replicas the stream has, as the
    /// cluster reports them (waiting out an election).
    pub async fn stream_leader(&self, stream: &str) -> (String, usize) {
        let context = self.jetstream().await;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut handle) = context.get_stream(stream).await
                && let Ok(info) = handle.info().await
                && let Some(leader) = info.cluster.as_ref().and_then(|c| c.leader.clone())
            {
                return (leader, info.config.num_replicas);
            }
            assert!(Instant::now() < deadline, "stream {stream} has no leader");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn wait_for_jetstream(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let probe = async {
                let client = async_nats::connect(self.servers())
                    .await
                    .map_err(|e| e.to_string())?;
                // The raw API: this client's typed answer does not parse every server's.
                let answer = client
                    .request("$JS.API.INFO", "".into())
                    .await
                    .map_err(|e| e.to_string())?;
                let answer = String::from_utf8_lossy(&answer.payload).into_owned();
                if answer.contains("\"error\"") {
                    Err(answer)
                } else {
                    Ok(())
                }
            };
            if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(2), probe).await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the NATS cluster's JetStream did not come up; n1's log:\n{}",
                self.log("n1")
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            let _ = std::fs::remove_dir_all(&node.store);
            let _ = std::fs::remove_file(node.store.with_extension("log"));
        }
    }
}
