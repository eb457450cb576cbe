//! A NATS JetStream namespace per test: a unique subject prefix, the streams it used
//! deleted when the fixture drops (also after a panic); and [`OwnServer`], a
//! `nats-server` of the test's own on a free port, for tests that stop the server.
//!
//! NATS is found at `NATS_URL`, else `nats://127.0.0.1:4222`. A test that cannot reach
//! it fails with a message that says so; it never skips.

use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, Context};
use sagabox::ConsumerType;
use sagabox::nats::NatsConfig;

/// The default server for tests.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// The server URL tests use.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| DEFAULT_NATS_URL.to_owned())
}

/// The servers of `url`, a comma-separated list for a cluster.
fn servers(url: &str) -> Vec<String> {
    url.split(',')
        .map(|server| server.trim().to_owned())
        .collect()
}

/// A unique prefix on a NATS server, and a plain JetStream client on it.
pub struct Js {
    pub config: NatsConfig,
    pub client: async_nats::Client,
    pub context: Context,
    streams: Mutex<Vec<String>>,
}

impl Js {
    /// Connects to the shared test server; the streams of `consumer_types` are deleted
    /// on drop.
    pub async fn new(consumer_types: &[&str]) -> Self {
        Self::on(&nats_url(), consumer_types).await
    }

    /// Connects to the server at `url`.
    pub async fn on(url: &str, consumer_types: &[&str]) -> Self {
        let client = async_nats::connect(servers(url))
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "cannot connect to NATS at {url}: {error}\n\
                 start it (nats-server -js) or point NATS_URL at a server with JetStream"
                )
            });
        let prefix = format!("sagabox-test-{}", uuid::Uuid::new_v4().simple());
        let mut config = NatsConfig::new(url).with_prefix(prefix);
        // Redeliveries of unacked messages within a test's patience.
        config.ack_wait = Duration::from_secs(2);
        let mut streams = Vec::new();
        for consumer_type in consumer_types {
            let consumer_type = ConsumerType::new(*consumer_type).expect("consumer type");
            streams.push(config.stream(&consumer_type));
            streams.push(config.dead_stream(&consumer_type));
        }
        Self {
            config,
            context: jetstream::new(client.clone()),
            client,
            streams: Mutex::new(streams),
        }
    }

    /// `consumer_type` as the library's type.
    pub fn consumer_type(consumer_type: &str) -> ConsumerType {
        ConsumerType::new(consumer_type).expect("consumer type")
    }

    /// The subject of `consumer_type`.
    pub fn subject(&self, consumer_type: &str) -> String {
        self.config.subject(&Self::consumer_type(consumer_type))
    }

    /// Creates `consumer_type`'s streams as the library does.
    pub async fn declare(&self, consumer_type: &str) {
        let transport = self.config.clone().into();
        let mut sender = sagabox::transport::Sender::connect(&transport, "declare")
            .await
            .expect("connect");
        sender
            .declare(&Self::consumer_type(consumer_type))
            .await
            .expect("declare");
        sender.close().await;
    }

    /// Publishes `body` with `headers` as a plain JetStream client would; `true` when the
    /// server dropped it as a duplicate.
    pub async fn publish_raw(&self, subject: &str, headers: HeaderMap, body: Vec<u8>) -> bool {
        self.context
            .publish_with_headers(subject.to_owned(), headers, body.into())
            .await
            .expect("publish")
            .await
            .expect("stored")
            .duplicate
    }

    /// Messages left in `stream` (for a work queue: not yet acked).
    pub async fn messages(&self, stream: &str) -> u64 {
        let mut stream = self.context.get_stream(stream).await.expect("stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// Messages left in `consumer_type`'s work stream.
    pub async fn pending(&self, consumer_type: &str) -> u64 {
        self.messages(&self.config.stream(&Self::consumer_type(consumer_type)))
            .await
    }

    /// What the server says of `consumer_type`'s work stream and its durable consumer,
    /// raw: for a failure's message.
    pub async fn describe(&self, consumer_type: &str) -> String {
        let stream = self.config.stream(&Self::consumer_type(consumer_type));
        let mut text = String::new();
        for subject in [
            format!("$JS.API.STREAM.INFO.{stream}"),
            format!("$JS.API.CONSUMER.INFO.{stream}.{stream}"),
        ] {
            let answer = match self.client.request(subject.clone(), "".into()).await {
                Ok(answer) => String::from_utf8_lossy(&answer.payload).into_owned(),
                Err(error) => error.to_string(),
            };
            text.push_str(&format!("{subject}: {answer}\n"));
        }
        text
    }

    /// Waits until the work streams of `consumer_types` are empty, calling `alive` at
    /// every poll (it panics when a process the streams need has exited); fails after
    /// `within`, with `context` and what the server says of each stream and consumer.
    pub async fn wait_drained(
        &self,
        consumer_types: &[&str],
        within: Duration,
        context: &str,
        mut alive: impl FnMut(),
    ) {
        let deadline = std::time::Instant::now() + within;
        loop {
            let mut left = 0;
            for consumer_type in consumer_types {
                left += self.pending(consumer_type).await;
            }
            if left == 0 {
                return;
            }
            alive();
            if std::time::Instant::now() > deadline {
                let mut state = String::new();
                for consumer_type in consumer_types {
                    state.push_str(&self.describe(consumer_type).await);
                }
                panic!(
                    "{context}{left} messages still in the work streams after {within:?}\n{state}"
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// How far `consumer_type`'s durable consumer is from having settled every message
    /// of its work stream — messages not delivered yet, delivered and unacknowledged, and
    /// sequences stored after its ack floor (a stalled consumer reports nothing pending
    /// while its stream holds such) — and, once that is 0, how many messages the stream
    /// still holds although the consumer acknowledged them. `Err` is what the server
    /// answered instead: a cluster that just lost a node answers "JetStream system
    /// temporarily unavailable" for a while.
    pub async fn settlement(&self, consumer_type: &str) -> Result<(u64, u64), String> {
        let name = self.config.stream(&Self::consumer_type(consumer_type));
        let mut stream = self
            .context
            .get_stream(&name)
            .await
            .map_err(|error| format!("stream {name}: {error}"))?;
        let state = stream
            .info()
            .await
            .map_err(|error| format!("stream info {name}: {error}"))?
            .state
            .clone();
        if state.messages == 0 {
            return Ok((0, 0));
        }
        let info = stream
            .consumer_info(&name)
            .await
            .map_err(|error| format!("consumer info {name}: {error}"))?;
        let unsettled = info.num_pending
            + u64::try_from(info.num_ack_pending).expect("a count")
            + state
                .last_sequence
                .saturating_sub(info.ack_floor.stream_sequence);
        let kept = if unsettled == 0 { state.messages } else { 0 };
        Ok((unsettled, kept))
    }

    /// Messages of `consumer_type`'s work stream its consumer has yet to settle (see
    /// [`settlement`](Self::settlement)).
    pub async fn unsettled(&self, consumer_type: &str) -> u64 {
        self.settlement(consumer_type)
            .await
            .expect("the server answers")
            .0
    }

    /// Waits until the durable consumers of `consumer_types` have settled every message
    /// of their work streams ([`settlement`](Self::settlement)), calling `alive` at every
    /// poll (it panics when a process the streams need has exited); fails after `within`,
    /// with `context` and what the server says of each stream and consumer. Returns how
    /// many messages the streams still hold although their consumer acknowledged them:
    /// nats-server 2.9 can keep such a message in a replicated work queue across a leader
    /// change.
    pub async fn wait_settled(
        &self,
        consumer_types: &[&str],
        within: Duration,
        context: &str,
        mut alive: impl FnMut(),
    ) -> u64 {
        let deadline = std::time::Instant::now() + within;
        loop {
            let (mut left, mut kept) = (0, 0);
            let mut unanswered = Vec::new();
            for consumer_type in consumer_types {
                match self.settlement(consumer_type).await {
                    Ok((unsettled, acknowledged)) => {
                        left += unsettled;
                        kept += acknowledged;
                    }
                    // Asked again at the next poll, until the deadline.
                    Err(error) => unanswered.push(error),
                }
            }
            if left == 0 && unanswered.is_empty() {
                return kept;
            }
            alive();
            if std::time::Instant::now() > deadline {
                let mut state = String::new();
                for consumer_type in consumer_types {
                    state.push_str(&self.describe(consumer_type).await);
                }
                panic!(
                    "{context}{left} messages unsettled after {within:?}, unanswered: {unanswered:?}\n{state}"
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Messages in `consumer_type`'s dead-letter stream.
    pub async fn dead(&self, consumer_type: &str) -> u64 {
        self.messages(&self.config.dead_stream(&Self::consumer_type(consumer_type)))
            .await
    }

    /// The dead letters of `consumer_type`: each one's headers.
    pub async fn dead_headers(&self, consumer_type: &str) -> Vec<HeaderMap> {
        let dead = self.config.dead_stream(&Self::consumer_type(consumer_type));
        self.stored(&dead)
            .await
            .into_iter()
            .map(|message| message.headers)
            .collect()
    }

    /// Every message `stream` holds, by sequence, left in place.
    pub async fn stored(&self, stream: &str) -> Vec<jetstream::message::StreamMessage> {
        let stream = self.context.get_stream(stream).await.expect("the stream");
        let mut all = Vec::new();
        let mut sequence = 1;
        while let Ok(message) = stream.get_raw_message(sequence).await {
            all.push(message);
            sequence += 1;
        }
        all
    }
}

impl Drop for Js {
    fn drop(&mut self) {
        let streams = std::mem::take(&mut *self.streams.lock().unwrap_or_else(|e| e.into_inner()));
        let url = self.config.url.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let Ok(client) = async_nats::connect(servers(&url)).await else {
                    return;
                };
                let context = jetstream::new(client);
                for stream in streams {
                    let _ = context.delete_stream(stream).await;
                }
            })
        })
        .join();
    }
}

/// A `nats-server -js` of the test's own, on a free port, storing in a temporary
/// folder; stopped (and the folder removed) on drop. `stop` and `start` again keep the
/// folder, as a server restart does.
pub struct OwnServer {
    pub port: u16,
    /// Its HTTP monitoring port (`/connz`, `/varz`).
    pub monitor_port: u16,
    store: PathBuf,
    child: Option<Child>,
    /// The certificate and key it serves TLS with (`--tls`), when it does.
    tls: Option<(String, String)>,
}

/// A port free on loopback now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a free port")
        .local_addr()
        .expect("its address")
        .port()
}

use std::path::PathBuf;

impl OwnServer {
    /// Starts one and waits until it answers.
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// Starts one that requires TLS (`--tls`) with `cert` and `key`, and waits until its
    /// monitoring port answers.
    pub async fn start_tls(cert: &str, key: &str) -> Self {
        Self::start_with(Some((cert.to_owned(), key.to_owned()))).await
    }

    async fn start_with(tls: Option<(String, String)>) -> Self {
        let store =
            std::env::temp_dir().join(format!("sagabox-nats-{}", uuid::Uuid::new_v4().simple()));
        let mut server = Self {
            port: free_port(),
            monitor_port: free_port(),
            store,
            child: None,
            tls,
        };
        server.restart().await;
        server
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills it at once, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops it as an operator's restart does (SIGTERM: it finishes writing its state).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            let _ = child.wait();
        }
    }

    /// Stops it and starts it again on the same port and store, and waits until it
    /// answers.
    pub async fn restart(&mut self) {
        self.stop();
        let child = Command::new(server_binary())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-m",
                &self.monitor_port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.store)
            .args(self.tls.iter().flat_map(|(cert, key)| {
                [
                    "--tls",
                    "--tlscert",
                    cert.as_str(),
                    "--tlskey",
                    key.as_str(),
                ]
            }))
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(self.store.with_extension("log")).expect("server log"),
            ))
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot start {}: {error}; is nats-server installed?",
                    server_binary()
                )
            });
        self.child = Some(child);
        for _ in 0..100 {
            if self.tls.is_some() {
                // Its clients need the test CA; its monitoring port says it is up.
                if tokio::net::TcpStream::connect(("127.0.0.1", self.monitor_port))
                    .await
                    .is_ok()
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            let probe = async {
                let client = async_nats::connect(self.url()).await.ok()?;
                // JetStream answers a little after the port does.
                client.request("$JS.API.INFO", "".into()).await.ok()
            };
            if let Ok(Some(_)) = tokio::time::timeout(Duration::from_secs(1), probe).await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "nats-server on port {} did not come up; its log: {}",
            self.port,
            std::fs::read_to_string(self.store.with_extension("log")).unwrap_or_default()
        );
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
        let _ = std::fs::remove_file(self.store.with_extension("log"));
    }
}

/// The `nats-server` to run: `NATS_SERVER`, else Debian's.
pub fn server_binary() -> String {
    std::env::var("NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".to_owned())
}
