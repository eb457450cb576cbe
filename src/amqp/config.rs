//! Where the broker is and how the transport behaves: [`AmqpConfig`], validated before
//! anything connects; [`AmqpError`], the transport's typed errors.

use std::time::Duration;

use crate::database::redact;
use crate::envelope::{ConsumerType, validate_key};

/// How to reach RabbitMQ and how consumers behave.
#[derive(Debug, Clone)]
pub struct AmqpConfig {
    /// `amqp://user:password@host:port/vhost` (the default vhost is `%2f`).
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
        }
    }

    /// Uses `prefix` for queue names.
    pub fn with_queue_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.queue_prefix = prefix.into();
        self
    }

    /// Checks every field; the error says which and what to do.
    pub fn validate(&self) -> Result<(), AmqpError> {
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            return Err(AmqpError::Config(format!(
                "the broker URL {} is not amqp://user:password@host:port/vhost",
                redact(&self.url)
            )));
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
        if self.reconnect_backoff.is_zero() || self.max_reconnect_backoff < self.reconnect_backoff {
            return Err(AmqpError::Config(
                "the reconnect backoff must be above zero and at most its maximum".into(),
            ));
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
        let factor = 2u32.saturating_pow(attempt.min(16));
        self.reconnect_backoff
            .saturating_mul(factor)
            .min(self.max_reconnect_backoff)
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
    /// The broker refused to take a published message (a negative confirm).
    #[error("RabbitMQ did not confirm the message published to {queue}")]
    NotConfirmed {
        /// Where it was published.
        queue: String,
    },
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
    fn backoff_doubles_up_to_the_maximum() {
        let config = AmqpConfig::new("amqp://x");
        assert_eq!(config.backoff(0), Duration::from_millis(100));
        assert_eq!(config.backoff(1), Duration::from_millis(200));
        assert_eq!(config.backoff(40), Duration::from_secs(5));
    }
}
