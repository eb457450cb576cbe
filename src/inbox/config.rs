//! [`InboxConfig`]: how long the inbox remembers a message, checked against how long the
//! broker may redeliver it.

use std::time::Duration;

const DAY: Duration = Duration::from_secs(24 * 60 * 60);
const MAX_TTL: Duration = Duration::from_secs(3650 * 24 * 60 * 60);
const MAX_FUTURE_SKEW: Duration = Duration::from_secs(31 * 24 * 60 * 60);

/// A configuration the inbox refuses to run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The TTL is shorter than the broker's redelivery window, so a late redelivery could
    /// find its inbox row already pruned and be applied a second time.
    #[error(
        "inbox ttl of {ttl_days:.1} days is shorter than the broker retention of {retention_days:.1} days: \
         a redelivery could arrive after its inbox row was pruned and be applied twice; \
         set the ttl to at least the broker's maximum redelivery window"
    )]
    TtlShorterThanRetention {
        /// The TTL asked for, in days.
        ttl_days: f64,
        /// The broker retention, in days.
        retention_days: f64,
    },
    /// The broker retention was zero.
    #[error(
        "broker retention is zero: set it to the broker's maximum redelivery window (SQS: 14 days)"
    )]
    ZeroRetention,
    /// A TTL beyond what the inbox can reason about.
    #[error(
        "inbox ttl of {} is longer than the limit of 10 years (3650 days): keep rows for a bounded time",
        in_days(.0)
    )]
    TtlTooLong(Duration),
    /// A future skew beyond a month.
    #[error(
        "max_future_skew of {} is longer than the limit of 31 days: fix the producer's clock instead",
        in_days(.0)
    )]
    SkewTooLarge(Duration),
    /// More partitions ahead than a year.
    #[error("partitions_ahead is {0}: create at most 12 months ahead")]
    TooManyPartitionsAhead(u32),
}

/// `duration` in days, as people give TTLs (`30 days`, `1.5 days`), however large.
fn in_days(duration: &Duration) -> String {
    let secs = duration.as_secs();
    if secs.is_multiple_of(DAY.as_secs()) && duration.subsec_nanos() == 0 {
        format!("{} days", secs / DAY.as_secs())
    } else {
        format!("{:.1} days", duration.as_secs_f64() / DAY.as_secs_f64())
    }
}

/// How long the inbox keeps its rows, and how it treats message times.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct InboxConfig {
    /// How long a message stays deduplicated after the time it is filed under. Must be at
    /// least [`broker_retention`](Self::broker_retention). Defaults to 30 days.
    pub ttl: Duration,
    /// The longest time after publishing that the broker may still deliver a message
    /// (SQS: 14 days; RabbitMQ and Kafka: their retention settings). Defaults to 14 days.
    pub broker_retention: Duration,
    /// How far in the future a message's time may lie (a producer whose clock runs
    /// ahead) before it is refused as [`InboxError::PublishedInFuture`](crate::InboxError).
    /// Defaults to 1 day.
    pub max_future_skew: Duration,
    /// Whether a publish time is stable across every delivery of a message. When `true`,
    /// a message with a plain (non-UUIDv7) id and a publish time is looked up only in its
    /// publish month's partition: one index probe. When `false`, its claim takes the key's
    /// lock first and looks in every live partition, so a publisher that stamps each
    /// publish attempt afresh (a retry at 23:59:59 and again at 00:00:01 on the 1st) is
    /// still deduplicated. Set it when the broker sets the time (SQS `SentTimestamp`,
    /// Kafka `LogAppendTime`). UUIDv7 ids carry their own time and always take the fast
    /// path. Defaults to `false`.
    pub trust_publish_time: bool,
    /// How many months after the current one get their partition created ahead of time
    /// by [`InboxGuard::prepare_partitions`](crate::InboxGuard::prepare_partitions).
    /// Defaults to 2.
    pub partitions_ahead: u32,
    /// Accept a [`ttl`](Self::ttl) shorter than the
    /// [`broker_retention`](Self::broker_retention) — the one check this overrides. A
    /// redelivery later than the TTL is then refused (expired, or its month pruned) and
    /// lost to the consumer, or — a message with no time of its own, filed under the
    /// month it is processed in — applied a second time once its first row was pruned:
    /// only for an operator who knows the broker cannot redeliver that late. The guard logs a warning when it is in
    /// effect. Defaults to `false`.
    pub allow_ttl_below_retention: bool,
}

impl Default for InboxConfig {
    fn default() -> Self {
        Self {
            ttl: 30 * DAY,
            broker_retention: 14 * DAY,
            max_future_skew: DAY,
            trust_publish_time: false,
            partitions_ahead: 2,
            allow_ttl_below_retention: false,
        }
    }
}

impl InboxConfig {
    /// Sets [`ttl`](Self::ttl).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Sets [`broker_retention`](Self::broker_retention).
    pub fn with_broker_retention(mut self, retention: Duration) -> Self {
        self.broker_retention = retention;
        self
    }

    /// Sets [`max_future_skew`](Self::max_future_skew).
    pub fn with_max_future_skew(mut self, skew: Duration) -> Self {
        self.max_future_skew = skew;
        self
    }

    /// Sets [`trust_publish_time`](Self::trust_publish_time).
    pub fn with_trust_publish_time(mut self, trust: bool) -> Self {
        self.trust_publish_time = trust;
        self
    }

    /// Sets [`partitions_ahead`](Self::partitions_ahead).
    pub fn with_partitions_ahead(mut self, months: u32) -> Self {
        self.partitions_ahead = months;
        self
    }

    /// Sets [`allow_ttl_below_retention`](Self::allow_ttl_below_retention).
    pub fn with_ttl_below_retention_allowed(mut self, allow: bool) -> Self {
        self.allow_ttl_below_retention = allow;
        self
    }

    /// Whether the TTL is shorter than the broker retention (accepted only with
    /// [`allow_ttl_below_retention`](Self::allow_ttl_below_retention)).
    pub fn ttl_below_retention(&self) -> bool {
        self.ttl < self.broker_retention
    }

    /// Checks the configuration is safe: the TTL covers the broker's redelivery window.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.broker_retention.is_zero() {
            return Err(ConfigError::ZeroRetention);
        }
        if self.ttl_below_retention() && !self.allow_ttl_below_retention {
            return Err(ConfigError::TtlShorterThanRetention {
                ttl_days: self.ttl.as_secs_f64() / DAY.as_secs_f64(),
                retention_days: self.broker_retention.as_secs_f64() / DAY.as_secs_f64(),
            });
        }
        if self.ttl > MAX_TTL {
            return Err(ConfigError::TtlTooLong(self.ttl));
        }
        if self.max_future_skew > MAX_FUTURE_SKEW {
            return Err(ConfigError::SkewTooLarge(self.max_future_skew));
        }
        if self.partitions_ahead > 12 {
            return Err(ConfigError::TooManyPartitionsAhead(self.partitions_ahead));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_shorter_than_retention_is_refused() {
        let config = InboxConfig::default().with_ttl(7 * DAY);
        let err = config.validate().unwrap_err();
        assert!(matches!(err, ConfigError::TtlShorterThanRetention { .. }));
        assert!(
            err.to_string()
                .contains("shorter than the broker retention of 14.0 days")
        );
        assert!(InboxConfig::default().validate().is_ok());
        assert!(InboxConfig::default().with_ttl(14 * DAY).validate().is_ok());
        let forced = InboxConfig::default()
            .with_ttl(7 * DAY)
            .with_ttl_below_retention_allowed(true);
        assert!(forced.validate().is_ok());
        assert!(matches!(
            InboxConfig::default().with_ttl(Duration::MAX).validate(),
            Err(ConfigError::TtlTooLong(_))
        ));
        assert!(matches!(
            InboxConfig::default()
                .with_max_future_skew(Duration::MAX)
                .validate(),
            Err(ConfigError::SkewTooLarge(_))
        ));
    }

    #[test]
    fn a_huge_ttl_is_quoted_in_days() {
        let refused = InboxConfig::default()
            .with_ttl(Duration::from_secs(99_999_999_999_999 * 86_400))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("inbox ttl of 99999999999999 days is longer"),
            "{refused}"
        );
        let skew = InboxConfig::default()
            .with_max_future_skew(Duration::from_secs(45 * 86_400 + 43_200))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(skew.contains("max_future_skew of 45.5 days"), "{skew}");
    }
}
