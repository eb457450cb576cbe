//! Where the broker is and how the transport behaves: [`AmqpConfig`], validated before
//! anything connects; [`QueueType`], how its queues are declared; [`AmqpError`], the
//! transport's typed errors.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::envelope::{ConsumerType, validate_key};
use crate::inbox::InboxConfig;
use crate::logging::redact;
use crate::retention::RetentionError;
use crate::tls::{LoadedTls, TlsError, TlsFiles};

/// How sagabox declares the durable queue of a consumer type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum QueueType {
    /// A quorum queue (`x-queue-type=quorum`): replicated, and it counts redeliveries
    /// itself (`x-delivery-limit`), dead-lettering a message that reaches the limit. A
    /// retryable failure is a `basic.nack` with requeue. The default for new queues.
    #[default]
    Quorum,
    /// A classic queue, as sagabox declared them before quorum queues: a retryable failure
    /// is published again with an `x-sagabox-attempts` count, since the queue counts
    /// nothing. For queues that already exist as classic ones.
    Classic,
}

impl QueueType {
    /// `quorum` or `classic`.
    pub const fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

impl fmt::Display for QueueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for QueueType {
    type Err = AmqpError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "quorum" => Ok(QueueType::Quorum),
            "classic" => Ok(QueueType::Classic),
            other => Err(AmqpError::Config(format!(
                "unknown queue type {other:?}: use quorum or classic"
            ))),
        }
    }
}

/// How to reach RabbitMQ and how consumers behave.
#[derive(Debug, Clone)]
pub struct AmqpConfig {
    /// `amqp://user:password@host:port/vhost` (the default vhost is `%2f`), or
    /// `amqps://…` for TLS (port 5671 unless given). A TLS URL may name, in its query as
    /// RabbitMQ's URI specification does, a CA file to trust beside the system's roots
    /// (`cacertfile=/path/ca.pem`) and a client certificate (`certfile=…&keyfile=…`), all
    /// PEM; see [`TlsFiles`](crate::tls::TlsFiles).
    ///
    /// For a cluster, the URLs of its nodes separated by commas, each whole
    /// (`amqp://u:p@node1:5672/%2f,amqp://u:p@node2:5672/%2f`), all `amqp://` or all
    /// `amqps://` (a comma inside a password is written `%2C`). Each new connection tries
    /// them in turn, starting one node further along the list than the connection before,
    /// so connections spread over the nodes and a reconnection after a node is lost starts
    /// at another one.
    pub url: String,
    /// Queues are named `<prefix>.<consumer_type>` and `<prefix>.<consumer_type>.dead`.
    /// Defaults to `sagabox`; a test or a second environment on one broker uses its own.
    pub queue_prefix: String,
    /// Unacknowledged deliveries a consumer holds at once (AMQP QoS). Defaults to 32.
    pub prefetch: u16,
    /// Deliveries of one message that fail retryably before it is dead-lettered.
    /// Defaults to 5.
    pub max_redeliveries: u32,
    /// The first wait before reconnecting after a lost connection; doubled up to
    /// `max_reconnect_backoff`. Defaults to 100 ms.
    pub reconnect_backoff: Duration,
    /// The longest wait between reconnection attempts. Defaults to 5 s.
    pub max_reconnect_backoff: Duration,
    /// How the consumer types' queues are declared. An existing queue keeps its type: a
    /// declare with another one is refused ([`AmqpError::QueueMismatch`]). Defaults to
    /// [`QueueType::Quorum`].
    pub queue_type: QueueType,
    /// The `x-message-ttl` set on every consumer type's queue (not on its `.dead`
    /// queue, whose letters wait for an operator): the broker's retention, which the inbox
    /// TTL must cover. `None` declares none, for queues declared without one before, whose
    /// retention a policy sets. A [`Participant`](crate::Participant) sets it to its
    /// [`InboxConfig::broker_retention`]. Defaults to 14 days
    /// (`InboxConfig::default().broker_retention`).
    pub message_ttl: Option<Duration>,
    /// The management HTTP API, `http://host:port` or `https://host[:port]`, where a
    /// queue's real retention (its arguments and policies) is read. The credentials and
    /// the vhost are the AMQP URL's; over HTTPS it trusts what the AMQP URL's TLS trusts
    /// (its `cacertfile`) and presents its client certificate. Defaults to `None`: the
    /// AMQP URL's host on port 15672 (`http`), or on 15671 (`https`) for an `amqps://` URL.
    /// Managed brokers (Amazon MQ, CloudAMQP) serve it on `https://host` (port 443).
    pub management_url: Option<String>,
    /// When the management API cannot be reached, take the queue's retention to be the
    /// `x-message-ttl` declared ([`message_ttl`](Self::message_ttl)) instead of refusing
    /// to start. Safe when one is declared: RabbitMQ refuses a declare whose
    /// `x-message-ttl` differs from the queue's, and a policy can only lower it. Defaults
    /// to `false`.
    pub trust_declared_retention: bool,
    /// The inbox whose TTL must cover the retention of every durable queue a consumer
    /// reads: checked when the consumer starts ([`check_retention`](super::check_retention)),
    /// which then refuses to start. `None` skips the check (a consumer without an inbox).
    /// A [`Participant`](crate::Participant) sets it to its own. Defaults to
    /// `Some(InboxConfig::default())`.
    pub retention_check: Option<InboxConfig>,
    /// Nodes a quorum queue sagabox declares is replicated on
    /// (`x-quorum-initial-group-size`); `None` leaves it to the broker's default. An
    /// existing queue keeps its own. Defaults to `None`.
    pub replicas: Option<u8>,
}

impl AmqpConfig {
    /// The defaults, for the broker at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            queue_prefix: "sagabox".to_owned(),
            prefetch: 32,
            max_redeliveries: 5,
            reconnect_backoff: Duration::from_millis(100),
            max_reconnect_backoff: Duration::from_secs(5),
            queue_type: QueueType::default(),
            message_ttl: Some(InboxConfig::default().broker_retention),
            management_url: None,
            trust_declared_retention: false,
            retention_check: Some(InboxConfig::default()),
            replicas: None,
        }
    }

    /// Declares the queues as `queue_type`.
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Declares and checks the queues for `inbox`: `x-message-ttl` set to its
    /// [`broker_retention`](InboxConfig::broker_retention) (unless
    /// [`message_ttl`](Self::message_ttl) is `None`: a policy's), and every consumer's
    /// queue retention checked against its TTL.
    pub fn with_inbox(mut self, inbox: &InboxConfig) -> Self {
        self.set_inbox(inbox);
        self
    }

    pub(crate) fn set_inbox(&mut self, inbox: &InboxConfig) {
        if self.message_ttl.is_some() {
            self.message_ttl = Some(inbox.broker_retention);
        }
        self.retention_check = Some(inbox.clone());
    }

    /// The configuration of each node of a cluster's URL list (`url` split at its commas),
    /// or of the one node. Each node's URL is a whole URL of its own.
    pub(crate) fn nodes(&self) -> Vec<AmqpConfig> {
        let urls: Vec<&str> = self
            .url
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .collect();
        if urls.len() <= 1 {
            return vec![self.clone()];
        }
        urls.into_iter()
            .map(|url| AmqpConfig {
                url: url.to_owned(),
                ..self.clone()
            })
            .collect()
    }

    /// The management API's base URL: the configured one, or the AMQP URL's host on port
    /// 15672 (`http://`), or 15671 (`https://`) for an `amqps://` URL (the first node's,
    /// for a list; the API of any node of a cluster answers for all of it).
    pub fn management_base(&self) -> String {
        if let Some(url) = &self.management_url {
            return url.trim_end_matches('/').to_owned();
        }
        let first = self.url.split(',').next().unwrap_or_default().trim();
        let host = first
            .parse::<lapin::uri::AMQPUri>()
            .map(|uri| uri.authority.host)
            .unwrap_or_else(|_| "127.0.0.1".to_owned());
        if self.is_tls() {
            format!("https://{host}:15671")
        } else {
            format!("http://{host}:15672")
        }
    }

    /// Whether the URL is `amqps://`.
    pub fn is_tls(&self) -> bool {
        self.url.starts_with("amqps://")
    }

    /// The TLS files the URL's query names (`cacertfile`, `certfile`, `keyfile`).
    pub fn tls_files(&self) -> TlsFiles {
        TlsFiles::split_url(&self.url).1
    }

    /// "RabbitMQ at host:port", for messages.
    pub(crate) fn server(&self) -> String {
        match self.url.parse::<lapin::uri::AMQPUri>() {
            Ok(uri) => format!("RabbitMQ at {}:{}", uri.authority.host, uri.authority.port),
            Err(_) => format!("RabbitMQ at {}", redact(&self.url)),
        }
    }

    /// The URL's TLS files, read and checked (none for a plain `amqp://` URL).
    pub(crate) fn load_tls(&self) -> Result<LoadedTls, AmqpError> {
        Ok(self
            .tls_files()
            .load(&self.server(), ("certfile", "keyfile"))?)
    }

    /// Uses `prefix` for queue names.
    pub fn with_queue_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.queue_prefix = prefix.into();
        self
    }

    /// Checks one node's URL: its scheme, and its TLS files.
    fn validate_url(&self) -> Result<(), AmqpError> {
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            return Err(AmqpError::Config(format!(
                "the broker URL {} is not amqp://user:password@host:port/vhost",
                redact(&self.url)
            )));
        }
        let files = self.tls_files();
        if !files.is_empty() && !self.is_tls() {
            return Err(AmqpError::Config(format!(
                "the broker URL {} names TLS files but is not amqps://: use amqps:// (port 5671) \
                 for TLS, or drop cacertfile, certfile and keyfile",
                redact(&self.url)
            )));
        }
        self.load_tls()?;
        Ok(())
    }

    /// Checks every field; the error says which and what to do.
    pub fn validate(&self) -> Result<(), AmqpError> {
        if self.replicas == Some(0) {
            return Err(AmqpError::Config(
                "replicas is 0: a quorum queue lives on at least 1 node".into(),
            ));
        }
        let nodes = self.nodes();
        if nodes.len() > 1 && nodes.iter().any(|node| node.is_tls() != self.is_tls()) {
            return Err(AmqpError::Config(format!(
                "the broker URL list {} mixes amqp:// and amqps://: give every node the same",
                redact(&self.url)
            )));
        }
        for node in &nodes {
            node.validate_url()?;
        }
        validate_key("queue prefix", &self.queue_prefix)
            .map_err(|error| AmqpError::Config(error.to_string()))?;
        if self.queue_prefix.len() > 200 {
            return Err(AmqpError::Config(
                "the queue prefix is over 200 bytes: queue names must stay under 255".into(),
            ));
        }
        if self.prefetch == 0 {
            return Err(AmqpError::Config(
                "prefetch is 0, which lets the broker send without limit; use 1 or more".into(),
            ));
        }
        if self.max_redeliveries == 0 {
            return Err(AmqpError::Config(
                "max_redeliveries is 0: a message must be delivered at least once; use 1 or more"
                    .into(),
            ));
        }
        if self.reconnect_backoff.is_zero() || self.max_reconnect_backoff < self.reconnect_backoff {
            return Err(AmqpError::Config(
                "the reconnect backoff must be above zero and at most its maximum".into(),
            ));
        }
        if let Some(ttl) = self.message_ttl
            && (ttl.as_millis() == 0 || ttl.as_millis() > u128::from(u32::MAX))
        {
            return Err(AmqpError::Config(format!(
                "the queue message ttl of {ttl:?} is outside what RabbitMQ takes: give 1 ms \
                 to about 49 days (x-message-ttl is in milliseconds, at most 2^32 - 1)"
            )));
        }
        if let Some(url) = &self.management_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(AmqpError::Config(format!(
                "the management API URL {} is not http://host:port or https://host[:port]",
                redact(url)
            )));
        }
        Ok(())
    }

    /// The queue `consumer_type` consumes from.
    pub fn queue(&self, consumer_type: &ConsumerType) -> String {
        format!("{}.{}", self.queue_prefix, consumer_type)
    }

    /// Where `consumer_type`'s bad messages go.
    pub fn dead_queue(&self, consumer_type: &ConsumerType) -> String {
        format!("{}.{}.dead", self.queue_prefix, consumer_type)
    }

    /// The wait before reconnection attempt `attempt` (0-based).
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        crate::backoff::doubling(self.reconnect_backoff, attempt, self.max_reconnect_backoff)
    }
}

/// What went wrong in the transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmqpError {
    /// The configuration was refused before connecting.
    #[error("invalid RabbitMQ configuration: {0}")]
    Config(String),
    /// The broker could not be reached.
    #[error(
        "cannot connect to RabbitMQ at {url}: {source}; is it running and are the credentials right?"
    )]
    Connect {
        /// The URL, password redacted.
        url: String,
        /// The cause.
        source: lapin::Error,
    },
    /// None of the nodes of a cluster's URL list could be connected to.
    #[error("none of the {nodes} RabbitMQ nodes of the URL list answered; the last: {last}")]
    NoNodeAnswered {
        /// How many nodes were tried.
        nodes: usize,
        /// Why the last one tried could not be connected to.
        last: Box<AmqpError>,
    },
    /// Nothing accepted a TCP connection at the broker's host and port.
    #[error(
        "cannot connect to RabbitMQ at {url}: {source}; is it running and are the host and port right?"
    )]
    Unreachable {
        /// The URL, password redacted.
        url: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A TLS file named in the URL cannot be used.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The TLS session with the broker could not be set up: its certificate was refused,
    /// or it does not speak TLS on that port.
    #[error("TLS to RabbitMQ at {url} failed: {reason}")]
    TlsHandshake {
        /// The URL, password redacted.
        url: String,
        /// What was refused, and what to change.
        reason: String,
    },
    /// The broker did not complete the connection in time.
    #[error("RabbitMQ at {url} did not accept the connection within {after:?}")]
    ConnectTimeout {
        /// The URL, password redacted.
        url: String,
        /// The time allowed.
        after: Duration,
    },
    /// A broker operation failed (the connection or channel is likely gone).
    #[error("RabbitMQ {operation} failed: {source}")]
    Broker {
        /// What was being done.
        operation: &'static str,
        /// The cause.
        source: lapin::Error,
    },
    /// The broker did not answer an operation in time (a node that accepts connections
    /// but does not serve them, a confirm that never comes); the connection is dropped
    /// and the operation is tried again on a new one.
    #[error("RabbitMQ did not answer within {after:?} to {operation}")]
    NoAnswer {
        /// What was being done.
        operation: &'static str,
        /// How long it waited.
        after: Duration,
    },
    /// The broker refused to take a published message (a negative confirm).
    #[error("RabbitMQ did not confirm the message published to {queue}")]
    NotConfirmed {
        /// Where it was published.
        queue: String,
    },
    /// The queue exists with other arguments than those sagabox declares (another queue
    /// type, `x-message-ttl` or delivery limit): RabbitMQ refused the declare
    /// (`PRECONDITION_FAILED`).
    #[error(
        "queue {queue} exists with other arguments than sagabox declares ({queue_type} queue, \
         {ttl}): RabbitMQ said \"{detail}\"; declare it as it is (--queue-type classic for a \
         classic queue, --broker-retention-days matching its x-message-ttl, --no-queue-ttl for \
         one without), or move it: see \"Moving a classic queue to quorum\" in \
         docs/configuration.md"
    )]
    QueueMismatch {
        /// The queue.
        queue: String,
        /// The type sagabox declared.
        queue_type: QueueType,
        /// The `x-message-ttl` sagabox declared, in words.
        ttl: String,
        /// The broker's explanation.
        detail: String,
    },
    /// The management API did not say what a queue's retention is.
    #[error(
        "cannot read the retention of queue {queue} from the RabbitMQ management API at {url}: \
         {reason}; enable it (rabbitmq-plugins enable rabbitmq_management), point \
         --amqp-management-url at it, or pass --trust-declared-retention to take the \
         x-message-ttl sagabox declares as the retention"
    )]
    Management {
        /// The management API's base URL.
        url: String,
        /// The queue measured.
        queue: String,
        /// What went wrong.
        reason: String,
    },
    /// A queue keeps messages longer than the inbox remembers them, or without limit.
    #[error(transparent)]
    Retention(#[from] RetentionError),
}

impl AmqpError {
    pub(crate) fn broker(operation: &'static str) -> impl FnOnce(lapin::Error) -> Self {
        move |source| AmqpError::Broker { operation, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_replicas_are_refused() {
        let mut config = AmqpConfig::new("amqp://127.0.0.1:5672/%2f");
        config.replicas = Some(0);
        let error = config.validate().unwrap_err();
        assert!(error.to_string().contains("replicas is 0"), "{error}");
        config.replicas = Some(3);
        assert!(config.validate().is_ok());
    }

    #[test]
    fn bad_settings_are_refused_with_the_reason() {
        assert!(
            AmqpConfig::new("amqp://127.0.0.1:5672/%2f")
                .validate()
                .is_ok()
        );
        let error = AmqpConfig::new("http://guest:secret@x")
            .validate()
            .unwrap_err();
        assert!(error.to_string().contains("amqp://"), "{error}");
        assert!(!error.to_string().contains("secret"), "{error}");
        let mut config = AmqpConfig::new("amqp://x");
        config.prefetch = 0;
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("prefetch")
        );
        let mut config = AmqpConfig::new("amqp://x");
        config.max_redeliveries = 0;
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("max_redeliveries is 0")
        );
        let config = AmqpConfig::new("amqp://x").with_queue_prefix("");
        assert!(config.validate().is_err());
    }

    #[test]
    fn queue_names_follow_the_prefix() {
        let config = AmqpConfig::new("amqp://x");
        let payment = ConsumerType::new("payment").unwrap();
        assert_eq!(config.queue(&payment), "sagabox.payment");
        assert_eq!(config.dead_queue(&payment), "sagabox.payment.dead");
    }

    #[test]
    fn queues_are_quorum_with_the_inbox_retention_as_ttl() {
        let config = AmqpConfig::new("amqp://x");
        assert_eq!(config.queue_type, QueueType::Quorum);
        assert_eq!("classic".parse::<QueueType>().unwrap(), QueueType::Classic);
        assert!("lazy".parse::<QueueType>().is_err());
        let inbox = InboxConfig::default().with_broker_retention(Duration::from_secs(86_400));
        let config = config.with_inbox(&inbox);
        assert_eq!(config.message_ttl, Some(Duration::from_secs(86_400)));
        assert_eq!(
            config.retention_check.as_ref().map(|i| i.ttl),
            Some(inbox.ttl)
        );
        let mut without = AmqpConfig::new("amqp://x");
        without.message_ttl = None;
        assert_eq!(
            without.with_inbox(&inbox).message_ttl,
            None,
            "a policy's, kept"
        );
        let mut long = AmqpConfig::new("amqp://x");
        long.message_ttl = Some(Duration::from_secs(60 * 86_400));
        assert!(long.validate().unwrap_err().to_string().contains("49 days"));
    }

    #[test]
    fn backoff_doubles_up_to_the_maximum() {
        let config = AmqpConfig::new("amqp://x");
        assert_eq!(config.backoff(0), Duration::from_millis(100));
        assert_eq!(config.backoff(1), Duration::from_millis(200));
        assert_eq!(config.backoff(40), Duration::from_secs(5));
    }
}
