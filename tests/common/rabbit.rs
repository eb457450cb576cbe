//! A RabbitMQ namespace per test: a unique queue prefix, and the queues it used deleted
//! when the fixture drops (also after a panic).
//!
//! RabbitMQ is found at `AMQP_URL`, else `amqp://guest:guest@127.0.0.1:5672/%2f`. A test
//! that cannot reach it fails with a message that says so; it never skips.

use std::sync::Mutex;

use lapin::options::{
    BasicGetOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sagabox::ConsumerType;
use sagabox::amqp::AmqpConfig;
use sagabox::transport::{Sender, TransportError};

/// The default broker for tests.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Deliveries of one message before it is dead-lettered, in the tests that run
/// `sagabox serve` with injected handler failures (`--fail-rate 0.1`). With the default
/// 5, a message fails all its deliveries with a chance of 0.1^5 = 1e-5 — over the few
/// thousand commands of a run, about one run in thirty would dead-letter one (its saga
/// still completes: the orchestrator sends the command again), and a participant killed
/// with deliveries in flight adds one to each on a quorum queue. 20 makes it 1e-20.
/// Every process that declares the queues (participants and orchestrator) must use it.
pub const MAX_DELIVERIES: u32 = 20;

/// The broker URL tests use.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.to_owned())
}

/// Declares `consumer_type`'s queues as `config` says, as a producer does (through a
/// [`Sender`] of its own).
pub async fn declare(
    config: &AmqpConfig,
    consumer_type: &ConsumerType,
) -> Result<(), TransportError> {
    let mut sender = Sender::connect(&config.clone().into(), "declare").await?;
    let declared = sender.declare(consumer_type).await;
    sender.close().await;
    declared
}

/// A unique queue prefix on the test broker, and a plain AMQP client on it.
pub struct Rabbit {
    pub config: AmqpConfig,
    pub connection: Connection,
    pub channel: Channel,
    queues: Mutex<Vec<String>>,
}

impl std::fmt::Debug for Rabbit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rabbit")
            .field("prefix", &self.config.queue_prefix)
            .finish()
    }
}

impl Rabbit {
    /// Connects; queues of `consumer_types` (and their dead-letter queues) are deleted
    /// on drop.
    pub async fn new(consumer_types: &[&str]) -> Self {
        let url = amqp_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "cannot connect to RabbitMQ at {url}: {error}\n\
                     start it (rabbitmq-server -detached) or point AMQP_URL at a broker"
                )
            });
        let channel = connection.create_channel().await.expect("channel");
        // Confirms, so that a message published here is in its queue when the publish
        // returns: a test that reads the queue next, over another connection, sees it.
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        let prefix = format!("sagabox-test-{}", uuid::Uuid::new_v4().simple());
        let config = AmqpConfig::new(url).with_queue_prefix(prefix);
        let mut queues = Vec::new();
        for consumer_type in consumer_types {
            let consumer_type = ConsumerType::new(*consumer_type).expect("consumer type");
            queues.push(config.queue(&consumer_type));
            queues.push(config.dead_queue(&consumer_type));
        }
        Self {
            config,
            connection,
            channel,
            queues: Mutex::new(queues),
        }
    }

    /// The queue of `consumer_type`.
    pub fn queue(&self, consumer_type: &str) -> String {
        self.config
            .queue(&ConsumerType::new(consumer_type).expect("consumer type"))
    }

    /// The dead-letter queue of `consumer_type`.
    pub fn dead_queue(&self, consumer_type: &str) -> String {
        self.config
            .dead_queue(&ConsumerType::new(consumer_type).expect("consumer type"))
    }

    /// Declares `consumer_type`'s queues as the library does.
    pub async fn declare(&self, consumer_type: &str) {
        self.declare_with(&self.config, consumer_type).await;
    }

    /// The arguments the broker holds for `queue`, as `rabbitmqctl list_queues` prints
    /// them.
    #[allow(dead_code)]
    pub fn queue_arguments(&self, queue: &str) -> String {
        let listed = std::process::Command::new("rabbitmqctl")
            .args(["list_queues", "--silent", "name", "arguments"])
            .output()
            .expect("run rabbitmqctl (is RabbitMQ installed here?)");
        assert!(
            listed.status.success(),
            "rabbitmqctl list_queues failed: {listed:?}"
        );
        String::from_utf8_lossy(&listed.stdout)
            .lines()
            .find_map(|line| {
                let (name, arguments) = line.split_once('\t')?;
                (name == queue).then(|| arguments.to_owned())
            })
            .unwrap_or_else(|| panic!("no queue {queue} on the broker"))
    }

    /// Declares `consumer_type`'s queues as `config` says (its type and TTL).
    #[allow(dead_code)]
    pub async fn declare_with(&self, config: &AmqpConfig, consumer_type: &str) {
        declare(
            config,
            &ConsumerType::new(consumer_type).expect("consumer type"),
        )
        .await
        .expect("declare");
    }

    /// Publishes raw bytes to `queue` as a plain AMQP client would.
    pub async fn publish_raw(&self, queue: &str, body: &[u8], properties: BasicProperties) {
        let confirmation = self
            .channel
            .basic_publish(
                "".into(),
                queue.into(),
                Default::default(),
                body,
                properties,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(
            confirmation.is_ack(),
            "the broker refused a message to {queue}"
        );
    }

    /// Consumers subscribed to `queue` (0 if it does not exist yet).
    pub async fn consumers(&self, queue: &str) -> u32 {
        // A passive declare of a missing queue closes the channel: use a throwaway one.
        let channel = self.connection.create_channel().await.expect("channel");
        let declared = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
        let count = declared.map(|queue| queue.consumer_count()).unwrap_or(0);
        let _ = channel.close(200, "bye".into()).await;
        count
    }

    /// Closes, from the broker's side, every connection whose name (set by sagabox as
    /// `<prefix>/<role>`) is this fixture's prefix followed by `/` and `role`; returns how
    /// many it closed. What a broker restart or a network cut does to a client.
    pub fn close_connections(&self, role: &str) -> usize {
        self.close_matching(&format!(
            "{{\"connection_name\",\"{}/{role}\"}}",
            self.config.queue_prefix
        ))
    }

    /// Closes every connection sagabox opened under this fixture's prefix (consumers,
    /// relays, dispatchers, in any process); returns how many.
    pub fn close_all_connections(&self) -> usize {
        self.close_matching(&format!(
            "{{\"connection_name\",\"{}/",
            self.config.queue_prefix
        ))
    }

    fn close_matching(&self, needle: &str) -> usize {
        let listed = std::process::Command::new("rabbitmqctl")
            .args(["list_connections", "--silent", "pid", "client_properties"])
            .output()
            .expect("run rabbitmqctl (is RabbitMQ installed here?)");
        assert!(
            listed.status.success(),
            "rabbitmqctl list_connections failed: {listed:?}"
        );
        // One `rabbitmqctl` per connection, all at once: run one after the other, each
        // taking its own start-up, the last close would come long after the first.
        let mut closing = Vec::new();
        for line in String::from_utf8_lossy(&listed.stdout).lines() {
            let Some((pid, properties)) = line.split_once('\t') else {
                continue;
            };
            if properties.contains(needle) {
                closing.push(
                    std::process::Command::new("rabbitmqctl")
                        .args(["close_connection", pid.trim(), "closed by a sagabox test"])
                        .stdout(std::process::Stdio::piped())
                        .stderr(std::process::Stdio::piped())
                        .spawn()
                        .expect("rabbitmqctl close_connection"),
                );
            }
        }
        let closed = closing.len();
        for child in closing {
            let status = child
                .wait_with_output()
                .expect("rabbitmqctl close_connection");
            assert!(status.status.success(), "{status:?}");
        }
        closed
    }

    /// Starts `sagabox serve --role role` on the database at `database_url` and this
    /// fixture's queues, failing 10 % of handler runs (seeded). Its stderr is piped, for a
    /// test to show when the process dies.
    pub fn serve(&self, role: &str, database_url: &str, seed: u64) -> std::process::Child {
        std::process::Command::new(super::sagabox_bin())
            .args([
                "serve",
                "--role",
                role,
                "--database-url",
                database_url,
                "--transport",
                &self.config.url,
                "--queue-prefix",
                &self.config.queue_prefix,
                "--fail-rate",
                "0.1",
                "--seed",
                &seed.to_string(),
                "--max-deliveries",
                &MAX_DELIVERIES.to_string(),
            ])
            .env_remove("DATABASE_URL")
            .env_remove("SAGABOX_DATABASE_URL")
            .env_remove("AMQP_URL")
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start sagabox serve")
    }

    /// Messages ready in `queue`.
    pub async fn ready(&self, queue: &str) -> u32 {
        let declared = self
            .channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("passive declare");
        declared.message_count()
    }

    /// Whether `queue` exists (asked on a channel of its own: a refused passive declare
    /// closes its channel).
    pub async fn exists(&self, queue: &str) -> bool {
        let channel = self.connection.create_channel().await.expect("channel");
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await;
        if declared.is_ok() {
            let _ = channel.close(200, "asked".into()).await;
        }
        declared.is_ok()
    }

    /// Takes every message ready in `queue` (acknowledged).
    pub async fn drain(&self, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
        let mut taken = Vec::new();
        while let Some(message) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic_get")
        {
            taken.push(message);
        }
        taken
    }

    /// Waits until `queue` holds `count` ready messages; panics after 20 s.
    pub async fn wait_ready(&self, queue: &str, count: u32) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let ready = self.ready(queue).await;
            if ready == count {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{queue} holds {ready} messages, expected {count}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        let queues = std::mem::take(&mut *self.queues.lock().unwrap_or_else(|e| e.into_inner()));
        let url = amqp_url();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
                let channel = connection.create_channel().await?;
                for queue in queues {
                    channel
                        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                        .await?;
                }
                connection.close(200, "bye".into()).await
            })
        })
        .join();
    }
}
