//! Where the NATS server is and how the JetStream transport behaves: [`NatsConfig`],
//! validated before anything connects, the names of its streams, subjects and durable
//! consumers; [`NatsError`], the transport's typed errors.

use std::time::Duration;

use crate::envelope::{ConsumerType, validate_key};
use crate::logging::redact;
use crate::retention::RetentionError;
use crate::tls::{LoadedTls, TlsError, TlsFiles};

/// How to reach NATS and how JetStream consumers behave.
///
/// Each consumer type has a work-queue stream `<prefix>_<consumer_type>` (dots made
/// underscores) on the subject `<prefix>.<consumer_type>`, read by one durable pull
/// consumer of the same name that every process serving that type shares (competing
/// consumers), and a dead-letter stream `<prefix>_<consumer_type>_dead` on
/// `<prefix>.<consumer_type>.dead` that keeps its messages until an operator takes them.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// `nats://host:port` (or `nats://user:password@host:port`), or `tls://host:port`
    /// to require TLS (a `nats://` connection also turns to TLS when the server requires
    /// it). For a cluster, every node's URL, comma-separated
    /// (`nats://a:4222,nats://b:4222,nats://c:4222`), as NATS's own tools take them: the
    /// client connects to one it can reach and, when that node is lost, reconnects to
    /// another (also to the nodes the cluster announced since). The query may name a CA file to trust beside the system's roots
    /// (`cacertfile=/path/ca.pem`) and a client certificate (`certfile=…&keyfile=…`),
    /// all PEM, in the names RabbitMQ's URLs use; see [`TlsFiles`](crate::tls::TlsFiles).
    pub url: String,
    /// Subjects are `<prefix>.<consumer_type>`, streams `<prefix>_<consumer_type>`.
    /// Defaults to `sagabox`; a test or a second environment on one server uses its own.
    pub prefix: String,
    /// Unacknowledged messages a consumer holds at once (the durable consumer's
    /// `max_ack_pending`, shared by every process on it). Defaults to 32.
    pub prefetch: u16,
    /// How long JetStream waits for an ack before it redelivers (the consumer's
    /// `ack_wait`). Longer than the slowest handler. Defaults to 30 s.
    pub ack_wait: Duration,
    /// Deliveries of one message before it is dead-lettered (`retries_exhausted`):
    /// after a retryable failure, or on arrival when earlier deliveries were never acked
    /// (a consumer that died each time). Defaults to 5.
    pub max_deliver: u32,
    /// The `max_age` of the work streams sagabox creates: how long JetStream keeps a
    /// message it may still deliver. Set it from the inbox's
    /// [`broker_retention`](crate::InboxConfig::broker_retention); an existing stream
    /// keeps its own, which the consumer measures and checks against the inbox TTL.
    /// Defaults to 14 days.
    pub retention: Duration,
    /// JetStream's duplicate window on the streams sagabox creates: a message published
    /// again with the same `Nats-Msg-Id` within it is dropped by the server (the inbox
    /// absorbs what it misses). Defaults to 2 minutes.
    pub duplicate_window: Duration,
    /// Copies of each stream sagabox creates, on as many nodes of a JetStream cluster
    /// (its `num_replicas`, 1 to 5): with 3, a stream survives the loss of one node and
    /// goes on once a new leader is elected. An existing stream keeps its own. Defaults
    /// to 1, for a single server.
    pub replicas: usize,
}

impl NatsConfig {
    /// The defaults, for the server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: "sagabox".to_owned(),
            prefetch: 32,
            ack_wait: Duration::from_secs(30),
            max_deliver: 5,
            retention: Duration::from_secs(14 * 24 * 60 * 60),
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
        }
    }

    /// Uses `prefix` for subjects and streams.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Creates work streams with `retention` as their `max_age`.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Creates streams with `replicas` copies, on as many nodes of a cluster.
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// The TLS files the URL's query names (`cacertfile`, `certfile`, `keyfile`).
    pub fn tls_files(&self) -> TlsFiles {
        TlsFiles::split_url(&self.url).1
    }

    /// The URL without its TLS files, as the client takes it.
    pub(crate) fn client_url(&self) -> String {
        TlsFiles::split_url(&self.url).0
    }

    /// The servers the client may connect to, as the client takes them (TLS files
    /// removed).
    pub(crate) fn servers(&self) -> Vec<String> {
        self.client_url()
            .split(',')
            .map(|server| server.trim().to_owned())
            .collect()
    }

    /// "NATS at host:port", for messages.
    pub(crate) fn server(&self) -> String {
        format!("NATS at {}", self.host_port())
    }

    /// The URL's `host:port` (the part after the scheme and any credentials), each
    /// server's for a list.
    pub(crate) fn host_port(&self) -> String {
        self.servers()
            .iter()
            .map(|url| {
                let rest = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest);
                let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
                rest.split(['/', '?', '#'])
                    .next()
                    .unwrap_or(rest)
                    .to_owned()
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The URL's TLS files, read and checked.
    pub(crate) fn load_tls(&self) -> Result<LoadedTls, NatsError> {
        Ok(self
            .tls_files()
            .load(&self.server(), ("certfile", "keyfile"))?)
    }

    /// Checks every field; the error says which and what to do.
    pub fn validate(&self) -> Result<(), NatsError> {
        let config = |reason: String| Err(NatsError::Config(reason));
        if self
            .servers()
            .iter()
            .any(|server| !(server.starts_with("nats://") || server.starts_with("tls://")))
        {
            return config(format!(
                "the server URL {} is not nats://host:port (or a comma-separated list of them)",
                redact(&self.url)
            ));
        }
        if !(1..=5).contains(&self.replicas) {
            return config(format!(
                "replicas is {}: JetStream keeps 1 to 5 copies of a stream",
                self.replicas
            ));
        }
        self.load_tls()?;
        validate_key("subject prefix", &self.prefix)
            .map_err(|error| NatsError::Config(error.to_string()))?;
        if self
            .prefix
            .chars()
            .any(|c| matches!(c, '.' | '*' | '>' | '/' | '\\') || c.is_whitespace())
        {
            return config(format!(
                "the prefix {:?} may not hold '.', '*', '>', slashes or spaces: it names streams",
                self.prefix
            ));
        }
        if self.prefix.len() > 100 {
            return config("the prefix is over 100 bytes: stream names must stay short".into());
        }
        if self.prefetch == 0 {
            return config("prefetch is 0: a consumer must hold at least 1 message".into());
        }
        if self.ack_wait < Duration::from_secs(1) {
            return config(
                "ack_wait is under 1 s: JetStream would redeliver work in flight".into(),
            );
        }
        if self.max_deliver == 0 {
            return config("max_deliver is 0: a message must be delivered at least once".into());
        }
        if self.retention.is_zero() {
            return config(
                "the stream retention is zero, which JetStream reads as unbounded; \
                 set it to the broker retention (--broker-retention-days)"
                    .into(),
            );
        }
        if self.duplicate_window.is_zero() || self.duplicate_window > self.retention {
            return config(
                "the duplicate window must be above zero and within the retention".into(),
            );
        }
        Ok(())
    }

    /// The subject `consumer_type`'s messages are published to.
    pub fn subject(&self, consumer_type: &ConsumerType) -> String {
        format!("{}.{}", self.prefix, consumer_type)
    }

    /// The subject `consumer_type`'s bad messages go to.
    pub fn dead_subject(&self, consumer_type: &ConsumerType) -> String {
        format!("{}.{}.dead", self.prefix, consumer_type)
    }

    /// The work stream of `consumer_type` (also its durable consumer's name).
    pub fn stream(&self, consumer_type: &ConsumerType) -> String {
        stream_name(&self.subject(consumer_type))
    }

    /// The dead-letter stream of `consumer_type`.
    pub fn dead_stream(&self, consumer_type: &ConsumerType) -> String {
        stream_name(&self.dead_subject(consumer_type))
    }
}

/// A stream or durable consumer name for `subject`: names may not hold dots.
pub(crate) fn stream_name(subject: &str) -> String {
    subject.replace('.', "_")
}

/// What went wrong in the NATS transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// The configuration was refused before connecting.
    #[error("invalid NATS configuration: {0}")]
    Config(String),
    /// The server could not be reached.
    #[error("cannot connect to NATS at {url}: {reason}; is nats-server running (with -js)?")]
    Connect {
        /// The URL, password redacted.
        url: String,
        /// The cause.
        reason: String,
    },
    /// A TLS file named in the URL cannot be used.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The TLS session with the server could not be set up: its certificate was refused,
    /// or it does not speak TLS.
    #[error("TLS to NATS at {url} failed: {reason}")]
    TlsHandshake {
        /// The URL, password redacted.
        url: String,
        /// What was refused, and what to change.
        reason: String,
    },
    /// A JetStream operation failed (JetStream off, a stream of that name with other
    /// subjects, the server gone).
    #[error("NATS {operation} failed: {reason}")]
    Broker {
        /// What was being done.
        operation: &'static str,
        /// The cause.
        reason: String,
    },
    /// The server stored a published message nowhere, or did not say it did.
    #[error("JetStream did not acknowledge the message published to {subject}: {reason}")]
    NotAcknowledged {
        /// Where it was published.
        subject: String,
        /// The cause.
        reason: String,
    },
    /// The stream's retention is longer than the inbox TTL, or unbounded.
    #[error(transparent)]
    Retention(#[from] RetentionError),
}

impl NatsError {
    pub(crate) fn broker<E: std::fmt::Display>(operation: &'static str) -> impl FnOnce(E) -> Self {
        move |error| NatsError::Broker {
            operation,
            reason: error.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_refused_with_the_reason() {
        assert!(NatsConfig::new("nats://127.0.0.1:4222").validate().is_ok());
        let error = NatsConfig::new("amqp://guest:secret@x")
            .validate()
            .unwrap_err();
        assert!(error.to_string().contains("nats://"), "{error}");
        assert!(!error.to_string().contains("secret"), "{error}");
        for prefix in ["", "a.b", "a b", "a>"] {
            let config = NatsConfig::new("nats://x").with_prefix(prefix);
            assert!(config.validate().is_err(), "{prefix:?} accepted");
        }
        let mut config = NatsConfig::new("nats://x");
        config.max_deliver = 0;
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("max_deliver")
        );
        let config = NatsConfig::new("nats://x").with_retention(Duration::ZERO);
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("unbounded")
        );
    }

    #[test]
    fn names_follow_the_prefix() {
        let config = NatsConfig::new("nats://x");
        let start = ConsumerType::new("checkout.start").unwrap();
        assert_eq!(config.subject(&start), "sagabox.checkout.start");
        assert_eq!(config.dead_subject(&start), "sagabox.checkout.start.dead");
        assert_eq!(config.stream(&start), "sagabox_checkout_start");
        assert_eq!(config.dead_stream(&start), "sagabox_checkout_start_dead");
    }

    #[test]
    fn a_cluster_is_a_comma_separated_list_of_servers() {
        let config = NatsConfig::new(
            "nats://u:secret@a:4222, nats://b:4223,tls://c:4224?cacertfile=/ca.pem",
        );
        assert_eq!(
            config.servers(),
            ["nats://u:secret@a:4222", "nats://b:4223", "tls://c:4224"]
        );
        assert_eq!(config.host_port(), "a:4222,b:4223,c:4224");
        let error = NatsConfig::new("nats://a:4222,amqp://b:5672")
            .validate()
            .unwrap_err();
        assert!(error.to_string().contains("comma-separated"), "{error}");
    }

    #[test]
    fn replicas_are_one_to_five() {
        assert_eq!(NatsConfig::new("nats://x").replicas, 1);
        assert!(
            NatsConfig::new("nats://x")
                .with_replicas(3)
                .validate()
                .is_ok()
        );
        for replicas in [0, 6] {
            let error = NatsConfig::new("nats://x")
                .with_replicas(replicas)
                .validate()
                .unwrap_err();
            assert!(error.to_string().contains("1 to 5"), "{error}");
        }
    }
}
