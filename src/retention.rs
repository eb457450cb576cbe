//! What a broker really keeps a message for, read from the broker itself, checked against
//! the inbox TTL before a transport starts consuming.
//!
//! The inbox is safe only while it remembers a message at least as long as the broker may
//! redeliver it. [`InboxConfig::broker_retention`] is the retention sagabox *sets* when it
//! declares a queue or a stream; a transport reads back what the broker actually applies
//! (a RabbitMQ queue's `x-message-ttl` or its policy, a JetStream stream's `max_age`) as a
//! [`Retention`], and [`check`] refuses a retention longer than the TTL, or none at all,
//! unless the operator forced it ([`InboxConfig::allow_ttl_below_retention`]), which is
//! then logged as a warning.

use std::fmt;
use std::time::Duration;

use crate::inbox::InboxConfig;

const DAY_SECS: f64 = 86_400.0;

/// How long a broker keeps a message it may still deliver, as measured on the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Messages older than this are dropped (or dead-lettered) by the broker, so none is
    /// delivered later.
    Bounded(Duration),
    /// Nothing bounds the redelivery window: a message may come back at any age.
    Unbounded,
}

impl Retention {
    /// The retention in days, `None` when unbounded.
    pub fn days(&self) -> Option<f64> {
        match self {
            Retention::Bounded(duration) => Some(duration.as_secs_f64() / DAY_SECS),
            Retention::Unbounded => None,
        }
    }
}

impl fmt::Display for Retention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.days() {
            Some(days) => write!(f, "{days:.1} days"),
            None => f.write_str("unbounded"),
        }
    }
}

/// A broker retention the inbox cannot cover.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RetentionError {
    /// The broker keeps messages longer than the inbox remembers them.
    #[error(
        "{source_name} keeps messages for {retention_days:.1} days, longer than the inbox ttl of \
         {ttl_days:.1} days: a redelivery after the ttl would be applied twice; raise the inbox \
         ttl to at least {retention_days:.1} days (--ttl-days), or lower the broker's retention \
         to at most the ttl ({what}), or pass --force-short-ttl to run anyway"
    )]
    LongerThanTtl {
        /// The queue or stream measured.
        source_name: String,
        /// What the broker applies, in days.
        retention_days: f64,
        /// The inbox TTL, in days.
        ttl_days: f64,
        /// Where that retention is set on this broker.
        what: &'static str,
    },
    /// Nothing bounds how late the broker may deliver a message.
    #[error(
        "{source_name} keeps messages without limit ({what} is not set), so a redelivery may \
         come after the inbox ttl of {ttl_days:.1} days and be applied twice; set a retention \
         of at most the ttl ({what}; sagabox sets --broker-retention-days on what it declares), \
         or pass --force-short-ttl to run anyway"
    )]
    Unbounded {
        /// The queue or stream measured.
        source_name: String,
        /// The inbox TTL, in days.
        ttl_days: f64,
        /// Where that retention is set on this broker.
        what: &'static str,
    },
}

/// Checks the retention measured on `source_name` against `inbox`'s TTL. `what` names the
/// broker's setting (`x-message-ttl or a message-ttl policy`, `the stream's max_age`).
///
/// A retention longer than the TTL, or none, is an error unless
/// [`InboxConfig::allow_ttl_below_retention`] is set; then it is logged as a warning and
/// accepted.
pub fn check(
    source_name: &str,
    measured: Retention,
    inbox: &InboxConfig,
    what: &'static str,
) -> Result<(), RetentionError> {
    let ttl_days = inbox.ttl.as_secs_f64() / DAY_SECS;
    let refused = match measured {
        Retention::Bounded(retention) if retention <= inbox.ttl => return Ok(()),
        Retention::Bounded(retention) => RetentionError::LongerThanTtl {
            source_name: source_name.to_owned(),
            retention_days: retention.as_secs_f64() / DAY_SECS,
            ttl_days,
            what,
        },
        Retention::Unbounded => RetentionError::Unbounded {
            source_name: source_name.to_owned(),
            ttl_days,
            what,
        },
    };
    if inbox.allow_ttl_below_retention {
        tracing::warn!(
            source = source_name,
            retention = %measured,
            ttl_days,
            "the broker's retention is not covered by the inbox ttl, forced: {refused}"
        );
        return Ok(());
    }
    Err(refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn a_retention_within_the_ttl_passes() {
        let inbox = InboxConfig::default().with_ttl(30 * DAY);
        assert_eq!(
            check("q", Retention::Bounded(30 * DAY), &inbox, "x-message-ttl"),
            Ok(())
        );
        assert_eq!(
            check("q", Retention::Bounded(DAY), &inbox, "x-message-ttl"),
            Ok(())
        );
    }

    #[test]
    fn a_longer_retention_names_both_numbers_and_the_fix() {
        let inbox = InboxConfig::default().with_ttl(30 * DAY);
        let error = check(
            "sagabox.payment",
            Retention::Bounded(45 * DAY),
            &inbox,
            "max_age",
        )
        .unwrap_err();
        let text = error.to_string();
        for part in [
            "sagabox.payment",
            "45.0 days",
            "30.0 days",
            "--ttl-days",
            "max_age",
        ] {
            assert!(text.contains(part), "{part} missing from: {text}");
        }
    }

    #[test]
    fn no_retention_is_refused_unless_forced() {
        let inbox = InboxConfig::default();
        let error = check("s", Retention::Unbounded, &inbox, "max_age").unwrap_err();
        assert!(matches!(error, RetentionError::Unbounded { .. }));
        assert!(error.to_string().contains("--force-short-ttl"), "{error}");
        let forced = inbox.with_ttl_below_retention_allowed(true);
        assert_eq!(check("s", Retention::Unbounded, &forced, "max_age"), Ok(()));
        assert_eq!(
            check("s", Retention::Bounded(90 * DAY), &forced, "max_age"),
            Ok(())
        );
    }

    #[test]
    fn retention_prints_in_days() {
        assert_eq!(Retention::Bounded(14 * DAY).to_string(), "14.0 days");
        assert_eq!(Retention::Unbounded.to_string(), "unbounded");
    }
}
