//! The values the `sagabox` command line takes, checked by library functions with typed
//! errors so the binary, its tests and the fuzz targets share one definition: database
//! URLs ([`database_url`], every subcommand's default [`DEFAULT_DATABASE_URL`]), fault
//! rates ([`rate`], [`rate_below_one`]), counts ([`count`], [`at_least_one`],
//! [`prefetch`]) and the pruner's retention settings ([`retention_config`], with the
//! explicit override of the TTL check).
//!
//! Every error that quotes a URL quotes it [`redact`]ed.

use std::time::Duration;

use sagabox::database::{Backend, ConnectError};
use sagabox::inbox::{ConfigError, InboxConfig, InboxError};
use sagabox::logging::redact;
use sagabox::transport::Transport;

/// The longest URL accepted, in bytes: far beyond any real one, and it keeps a pasted
/// file or a runaway variable out of logs.
pub const MAX_URL_BYTES: usize = 4096;

const DAY_SECS: u64 = 86_400;

/// The database every subcommand uses when `--database-url` is not given: one file in
/// the current folder, so that `sagabox demo` and then `sagabox inspect` look at the same
/// data.
pub const DEFAULT_DATABASE_URL: &str = "sqlite:sagabox.db";

/// A command-line value that was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ArgError {
    /// The database URL was empty.
    #[error(
        "the database url is empty: give postgres://user@host:port/db or sqlite:path/to/file.db"
    )]
    EmptyUrl,
    /// The database URL was longer than [`MAX_URL_BYTES`].
    #[error("the database url is {0} bytes long, the limit is {max} bytes", max = MAX_URL_BYTES)]
    UrlTooLong(usize),
    /// The database URL contained a control character (a stray newline, say).
    #[error("the database url {url:?} contains a control character at byte {position}: remove it")]
    UrlControlCharacter {
        /// The URL, password redacted.
        url: String,
        /// Byte offset of the character.
        position: usize,
    },
    /// Neither `postgres://…` nor `sqlite:…`.
    #[error(
        "unsupported database url {0:?}: use postgres://user@host:port/db or sqlite:path/to/file.db"
    )]
    UnsupportedUrl(String),
    /// A PostgreSQL URL that does not parse.
    #[error("invalid database url {url:?}: {reason}")]
    InvalidUrl {
        /// The URL, password redacted.
        url: String,
        /// What the parser said, password redacted.
        reason: String,
    },
    /// A rate that is not a number.
    #[error("{0:?} is not a number: give a rate between 0 and 1, such as 0.1")]
    RateNotANumber(String),
    /// A rate outside `0..=1` (or `0..1` where 1 would never end).
    #[error("rate {} is out of range: {expected}", short(*.value))]
    RateOutOfRange {
        /// The value given.
        value: f64,
        /// What is accepted.
        expected: &'static str,
    },
    /// A clock speed that is not a number.
    #[error("{0:?} is not a number: give a clock speed such as 43200 (a month a minute)")]
    ClockSpeedNotANumber(String),
    /// A clock speed out of range.
    #[error(transparent)]
    ClockSpeed(#[from] sagabox::clock::InvalidClockSpeed),
    /// A count that is not a whole number within its range (negative, zero where at
    /// least one is needed, too large, or not a number at all).
    #[error("{value:?} is not a whole number {expected}")]
    NotACount {
        /// The text given (at most 64 characters of it).
        value: String,
        /// The accepted range, in words.
        expected: &'static str,
    },
    /// Retention settings the inbox refuses.
    #[error("{reason}{hint}")]
    Retention {
        /// Why.
        reason: ConfigError,
        /// What to do about it on the command line.
        hint: &'static str,
    },
}

/// Checks a database URL: not empty, at most [`MAX_URL_BYTES`], no control characters, a
/// `postgres://`/`postgresql://` or `sqlite:` scheme, and — for PostgreSQL — one the
/// driver can parse. Returns it unchanged.
pub fn database_url(url: &str) -> Result<String, ArgError> {
    if url.is_empty() {
        return Err(ArgError::EmptyUrl);
    }
    if url.len() > MAX_URL_BYTES {
        return Err(ArgError::UrlTooLong(url.len()));
    }
    if let Some((position, _)) = url.char_indices().find(|(_, c)| c.is_control()) {
        return Err(ArgError::UrlControlCharacter {
            url: redact(url),
            position,
        });
    }
    match Backend::parse(url) {
        Ok(_) => Ok(url.to_owned()),
        Err(InboxError::Connect(error)) => Err(ArgError::InvalidUrl {
            url: redact(url),
            reason: match *error {
                ConnectError::InvalidUrl { reason, .. } => reason,
                other => other.to_string(),
            },
        }),
        Err(_) => Err(ArgError::UnsupportedUrl(redact(url))),
    }
}

/// `value` as written, unless that is long (Rust writes `1e-300` out in full): then in
/// scientific notation.
fn short(value: f64) -> String {
    let plain = value.to_string();
    if plain.len() > 24 {
        format!("{value:e}")
    } else {
        plain
    }
}

/// Parses a rate within `0..=1` (a share of messages, such as `0.1`).
pub fn rate(text: &str) -> Result<f64, ArgError> {
    let value = parse_rate(text)?;
    if !(0.0..=1.0).contains(&value) {
        return Err(ArgError::RateOutOfRange {
            value,
            expected: "give a value between 0 and 1",
        });
    }
    Ok(value)
}

/// Parses a rate within `0..1`: for faults where 1 would repeat forever (every attempt
/// failing, every reply lost).
pub fn rate_below_one(text: &str) -> Result<f64, ArgError> {
    let value = parse_rate(text)?;
    if !(0.0..1.0).contains(&value) {
        return Err(ArgError::RateOutOfRange {
            value,
            expected: "give a value from 0 up to, but not including, 1 (1 would fail every attempt forever)",
        });
    }
    Ok(value)
}

/// Parses a clock speed for `demo --clock-speed`: a number within `1..=1e9`.
pub fn clock_speed(text: &str) -> Result<f64, ArgError> {
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| ArgError::ClockSpeedNotANumber(text.chars().take(64).collect()))?;
    Ok(sagabox::clock::ScaledClock::check_speed(value)?)
}

/// Parses a count of 0 or more (`--orders`).
pub fn count(text: &str) -> Result<usize, ArgError> {
    whole(text, 0, "of 0 or more")
}

/// Parses a count of at least 1 (`--messages`).
pub fn at_least_one(text: &str) -> Result<usize, ArgError> {
    whole(text, 1, "of 1 or more")
}

/// The most tasks or workers one process runs at once: far above what a database's
/// connections serve, and far below what would exhaust memory or a semaphore.
pub const MAX_PARALLEL: usize = 10_000;

/// Parses a number of tasks or workers run at once (`--concurrency`, `--workers`): 1 to
/// [`MAX_PARALLEL`].
pub fn parallel(text: &str) -> Result<usize, ArgError> {
    let expected = "from 1 to 10000";
    let value = whole(text, 1, expected)?;
    if value > MAX_PARALLEL {
        return Err(ArgError::NotACount {
            value: text.chars().take(64).collect(),
            expected,
        });
    }
    Ok(value)
}

/// Parses a database pool's size: 1 to 1000 connections.
pub fn pool_size(text: &str) -> Result<u32, ArgError> {
    let expected = "from 1 to 1000 connections";
    let value = whole(text, 1, expected)?;
    u32::try_from(value)
        .ok()
        .filter(|value| *value <= 1000)
        .ok_or_else(|| ArgError::NotACount {
            value: text.chars().take(64).collect(),
            expected,
        })
}

/// Parses an AMQP prefetch: 1 to 65535 unacknowledged messages (0 would let the broker
/// send without limit).
pub fn prefetch(text: &str) -> Result<u16, ArgError> {
    let expected = "from 1 to 65535";
    let value = whole(text, 1, expected)?;
    u16::try_from(value).map_err(|_| ArgError::NotACount {
        value: text.chars().take(64).collect(),
        expected,
    })
}

/// `text` as a whole number of at least `min`; `expected` names the range in the error.
fn whole(text: &str, min: usize, expected: &'static str) -> Result<usize, ArgError> {
    text.trim()
        .parse::<usize>()
        .ok()
        .filter(|value| *value >= min)
        .ok_or_else(|| ArgError::NotACount {
            value: text.chars().take(64).collect(),
            expected,
        })
}

fn parse_rate(text: &str) -> Result<f64, ArgError> {
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| ArgError::RateNotANumber(text.chars().take(64).collect()))?;
    if !value.is_finite() {
        return Err(ArgError::RateOutOfRange {
            value,
            expected: "give a finite value between 0 and 1",
        });
    }
    Ok(value)
}

/// The inbox's retention flags of the commands that run the pruner (`serve`,
/// `orchestrate`, `prune`).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct RetentionArgs {
    /// Days a message stays deduplicated; at least the broker's redelivery window. The
    /// pruner drops the months older than this.
    #[arg(long, default_value_t = 30)]
    pub ttl_days: u64,
    /// The broker's maximum redelivery window, in days (SQS: 14).
    #[arg(long, default_value_t = 14)]
    pub broker_retention_days: u64,
    /// Months ahead of the current one to create partitions for.
    #[arg(long, default_value_t = 2)]
    pub partitions_ahead: u32,
    /// Run with a TTL shorter than the broker retention anyway (logged as a
    /// warning): a redelivery later than the TTL is then refused, or applied twice if
    /// it carries no time.
    #[arg(long)]
    pub force_short_ttl: bool,
}

impl RetentionArgs {
    /// The inbox configuration the flags describe ([`retention_config`]).
    pub fn config(&self) -> Result<InboxConfig, ArgError> {
        retention_config(
            self.ttl_days,
            self.broker_retention_days,
            self.partitions_ahead,
            self.force_short_ttl,
        )
    }
}

/// The inbox configuration of a pruner run from the command line: `ttl_days`,
/// `broker_retention_days`, `partitions_ahead`.
///
/// A TTL shorter than the broker retention is refused ([`ConfigError::TtlShorterThanRetention`],
/// with a hint naming `--force-short-ttl`) unless `force_short_ttl` is set; then the
/// configuration is accepted with
/// [`allow_ttl_below_retention`](InboxConfig::allow_ttl_below_retention), and the guard
/// built from it logs a warning. Every other limit still applies.
pub fn retention_config(
    ttl_days: u64,
    broker_retention_days: u64,
    partitions_ahead: u32,
    force_short_ttl: bool,
) -> Result<InboxConfig, ArgError> {
    let days = |n: u64| Duration::from_secs(n.saturating_mul(DAY_SECS));
    let config = InboxConfig::default()
        .with_ttl(days(ttl_days))
        .with_broker_retention(days(broker_retention_days))
        .with_partitions_ahead(partitions_ahead)
        .with_ttl_below_retention_allowed(force_short_ttl);
    config.validate().map_err(|reason| {
        let hint = match reason {
            ConfigError::TtlShorterThanRetention { .. } => {
                " (to run anyway, knowing a late redelivery may be applied twice, pass --force-short-ttl)"
            }
            _ => "",
        };
        ArgError::Retention { reason, hint }
    })?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        assert!(database_url("sqlite:a.db").is_ok());
        assert!(database_url("postgres://u@127.0.0.1:5432/db").is_ok());
        assert_eq!(database_url(""), Err(ArgError::EmptyUrl));
        assert!(matches!(
            database_url("mysql://u:hunter2@h/x"),
            Err(ArgError::UnsupportedUrl(u)) if !u.contains("hunter2")
        ));
        let bad_port = database_url("postgres://u:hunter2@h:99999/x").unwrap_err();
        assert!(
            matches!(bad_port, ArgError::InvalidUrl { .. }),
            "{bad_port}"
        );
        assert!(!bad_port.to_string().contains("hunter2"), "{bad_port}");
        let newline = database_url("sqlite:a.db\n").unwrap_err();
        assert!(matches!(
            newline,
            ArgError::UrlControlCharacter { position: 11, .. }
        ));
        assert!(matches!(
            database_url(&"x".repeat(MAX_URL_BYTES + 1)),
            Err(ArgError::UrlTooLong(_))
        ));
    }

    #[test]
    fn rates_are_checked() {
        assert_eq!(rate("0.25"), Ok(0.25));
        assert_eq!(rate("1"), Ok(1.0));
        assert_eq!(rate(" 0 "), Ok(0.0));
        assert!(matches!(rate("1.5"), Err(ArgError::RateOutOfRange { .. })));
        assert!(matches!(rate("-0.1"), Err(ArgError::RateOutOfRange { .. })));
        assert!(matches!(rate("NaN"), Err(ArgError::RateOutOfRange { .. })));
        assert!(matches!(rate("inf"), Err(ArgError::RateOutOfRange { .. })));
        assert!(matches!(rate("half"), Err(ArgError::RateNotANumber(_))));
        assert!(matches!(
            rate_below_one("1"),
            Err(ArgError::RateOutOfRange { .. })
        ));
        assert_eq!(rate_below_one("0.999"), Ok(0.999));
        // Found by the fuzz target: a tiny negative value was quoted 300 digits long.
        let tiny = rate("-2.4734269389403685e-301").unwrap_err().to_string();
        assert!(tiny.contains("e-301") && tiny.len() < 100, "{tiny}");
    }

    #[test]
    fn counts_are_checked() {
        assert_eq!(count("0"), Ok(0));
        assert_eq!(count(" 12 "), Ok(12));
        assert_eq!(at_least_one("1"), Ok(1));
        assert_eq!(parallel("10000"), Ok(10_000));
        assert_eq!(prefetch("65535"), Ok(65535));
        for (refused, expected) in [
            (count("-5"), "\"-5\" is not a whole number of 0 or more"),
            (count("1.5"), "\"1.5\" is not a whole number of 0 or more"),
            (
                at_least_one("0"),
                "\"0\" is not a whole number of 1 or more",
            ),
            (
                prefetch("0").map(usize::from),
                "\"0\" is not a whole number from 1 to 65535",
            ),
            (prefetch("65536").map(usize::from), "from 1 to 65535"),
            (parallel("0"), "\"0\" is not a whole number from 1 to 10000"),
            (
                parallel("9999999999999999999"),
                "is not a whole number from 1 to 10000",
            ),
        ] {
            let error = refused.unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
        }
    }

    #[test]
    fn a_short_ttl_needs_the_explicit_override() {
        let refused = retention_config(7, 14, 2, false).unwrap_err();
        assert!(matches!(
            refused,
            ArgError::Retention {
                reason: ConfigError::TtlShorterThanRetention { .. },
                ..
            }
        ));
        assert!(
            refused.to_string().contains("--force-short-ttl"),
            "{refused}"
        );
        let forced = retention_config(7, 14, 2, true).unwrap();
        assert_eq!(forced.ttl, Duration::from_secs(7 * DAY_SECS));
        assert!(forced.allow_ttl_below_retention);
        // The override covers that one check only.
        assert!(matches!(
            retention_config(7, 0, 2, true),
            Err(ArgError::Retention {
                reason: ConfigError::ZeroRetention,
                ..
            })
        ));
        assert!(matches!(
            retention_config(u64::MAX, 14, 2, true),
            Err(ArgError::Retention {
                reason: ConfigError::TtlTooLong(_),
                ..
            })
        ));
        assert!(retention_config(30, 14, 2, false).is_ok());
    }
}

/// How the broker's queues or streams are declared and their retention read: `serve`
/// and `orchestrate`.
#[derive(Debug, Clone, clap::Args)]
pub struct BrokerArgs {
    /// Deliveries of one message before it is dead-lettered as retries_exhausted (a
    /// RabbitMQ quorum queue's x-delivery-limit is one less; JetStream's max_deliver).
    /// Every process declaring a queue must give the same number: RabbitMQ refuses a
    /// declare with another limit.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_deliveries: u32,
    /// How sagabox declares the RabbitMQ queues it creates: quorum (replicated; the
    /// broker counts redeliveries and dead-letters at the limit) or classic (for queues
    /// that already exist as classic ones).
    #[arg(long, default_value = "quorum", value_parser = queue_type)]
    pub queue_type: sagabox::amqp::QueueType,
    /// Declare RabbitMQ queues without x-message-ttl: for queues declared without one
    /// before, whose retention a policy sets (message-ttl).
    #[arg(long)]
    pub no_queue_ttl: bool,
    /// The RabbitMQ management API, where the queues' real retention is read
    /// (default: `http://BROKER-HOST:15672`, with the broker URL's credentials).
    #[arg(long, value_name = "URL")]
    pub amqp_management_url: Option<String>,
    /// When the management API is out of reach, take the declared x-message-ttl as
    /// the queues' retention instead of refusing to start.
    #[arg(long)]
    pub trust_declared_retention: bool,
    /// Copies of each queue or stream sagabox creates, on as many nodes of a cluster:
    /// a JetStream stream's replicas (1 to 5; default 1), a RabbitMQ quorum queue's
    /// x-quorum-initial-group-size (default: the broker's). What exists keeps its own.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub replicas: Option<u8>,
}

impl BrokerArgs {
    /// `transport` with these settings (the RabbitMQ ones apply to RabbitMQ only).
    pub fn apply(&self, transport: Transport) -> Transport {
        let transport = match self.replicas {
            Some(replicas) => transport.with_replicas(replicas),
            None => transport,
        };
        match transport.with_max_deliveries(self.max_deliveries) {
            Transport::Amqp(mut config) => {
                config.queue_type = self.queue_type;
                if self.no_queue_ttl {
                    config.message_ttl = None;
                }
                config.management_url = self.amqp_management_url.clone();
                config.trust_declared_retention = self.trust_declared_retention;
                Transport::Amqp(config)
            }
            other => other,
        }
    }
}

/// Parses `--queue-type`.
pub fn queue_type(value: &str) -> Result<sagabox::amqp::QueueType, String> {
    value
        .parse()
        .map_err(|error: sagabox::amqp::AmqpError| error.to_string())
}

/// The broker whose dead letters `dlq` and the console read: `nats_url` when given
/// (`--nats-url`), else `amqp_url` (`--amqp-url`), else none. An error names the flag and
/// what is wrong with its URL.
pub fn dead_letter_broker(
    amqp_url: Option<&str>,
    nats_url: Option<&str>,
) -> Result<Option<Transport>, String> {
    let (flag, url, schemes): (&str, &str, &[&str]) = match (nats_url, amqp_url) {
        (Some(url), _) => ("--nats-url", url, &["nats://", "tls://"]),
        (None, Some(url)) => ("--amqp-url", url, &["amqp://", "amqps://"]),
        (None, None) => return Ok(None),
    };
    if !schemes.iter().any(|scheme| url.starts_with(scheme)) {
        return Err(format!(
            "{flag}: {} does not start with {}",
            redact(url),
            schemes.join(" or ")
        ));
    }
    Transport::from_url(url, "sagabox")
        .and_then(|transport| transport.validate().map(|()| transport))
        .map(Some)
        .map_err(|error| format!("{flag}: {error}"))
}
