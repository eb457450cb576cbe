//! The inspect report as a table for people: one section per part of the report, each
//! a function of its own. The library gives the facts ([`InspectReport`]); how they read
//! on a terminal is the command's business.

use std::fmt::{self, Display, Formatter};

use chrono::{DateTime, Utc};
use sagabox::inspect::{DuplicateReport, InspectReport};
use serde::Serialize;

/// An [`InspectReport`] that prints as tables (`Display`) and serialises as the report
/// itself (`--json`).
#[derive(Serialize)]
#[serde(transparent)]
pub(crate) struct Text(pub(crate) InspectReport);

impl Display for Text {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let report = &self.0;
        writeln!(
            f,
            "sagabox inspect {} ({}) at {}",
            report.database,
            report.backend,
            report.at.format("%Y-%m-%d %H:%M:%S UTC")
        )?;
        partitions(f, report)?;
        retention(f, report)?;
        duplicates(f, report)?;
        sagas(f, report)?;
        outbox(f, report)?;
        broker_queues(f, report)?;
        warnings(f, report)
    }
}

fn partitions(f: &mut Formatter<'_>, report: &InspectReport) -> fmt::Result {
    writeln!(f, "\ninbox partitions")?;
    writeln!(f, "  {:<9} {:>12} {:>12}", "month", "rows", "size")?;
    for p in &report.partitions {
        writeln!(
            f,
            "  {:<9} {:>12} {:>12}",
            p.month,
            p.rows,
            human_bytes(p.bytes)
        )?;
    }
    let total: i64 = report.partitions.iter().map(|p| p.rows).sum();
    writeln!(f, "  {:<9} {:>12}", "total", total)?;
    let missing = if report.missing_ahead.is_empty() {
        "none".to_owned()
    } else {
        report.missing_ahead.join(", ")
    };
    writeln!(f, "  missing ahead        {missing}")
}

fn retention(f: &mut Formatter<'_>, report: &InspectReport) -> fmt::Result {
    let r = &report.retention;
    writeln!(f, "\nretention")?;
    writeln!(f, "  ttl                  {:.1} days", r.ttl_days)?;
    writeln!(
        f,
        "  broker retention     {:.1} days",
        r.broker_retention_days
    )?;
    match (&r.oldest_partition, r.oldest_partition_age_days) {
        (Some(month), Some(age)) => writeln!(
            f,
            "  oldest partition     {month} (first day {age:.1} days ago)"
        )?,
        _ => writeln!(f, "  oldest partition     none")?,
    }
    writeln!(
        f,
        "  pruned through       {}",
        r.pruned_through.as_deref().unwrap_or("nothing pruned yet")
    )?;
    match (r.covered_from, r.margin_days) {
        (Some(from), Some(margin)) => {
            writeln!(
                f,
                "  deduplicates from    {}",
                from.format("%Y-%m-%d %H:%M UTC")
            )?;
            writeln!(
                f,
                "  margin over broker   {margin:.1} days{}",
                if margin < 0.0 { "  (NEGATIVE)" } else { "" }
            )
        }
        _ => {
            writeln!(
                f,
                "  deduplicates from    the first message (nothing pruned)"
            )?;
            writeln!(f, "  margin over broker   unlimited so far")
        }
    }
}

fn duplicates(f: &mut Formatter<'_>, report: &InspectReport) -> fmt::Result {
    writeln!(
        f,
        "\nduplicate deliveries absorbed (counted on the inbox rows)"
    )?;
    writeln!(
        f,
        "  {:<24} {:>10} {:>10} {:>10}",
        "consumer type", "last hour", "last day", "in inbox"
    )?;
    for d in &report.duplicate_deliveries {
        writeln!(
            f,
            "  {:<24} {:>10} {:>10} {:>10}",
            d.consumer_type, d.last_hour, d.last_day, d.in_inbox
        )?;
    }
    let sum = |pick: fn(&DuplicateReport) -> i64| -> i64 {
        report.duplicate_deliveries.iter().map(pick).sum()
    };
    writeln!(
        f,
        "  {:<24} {:>10} {:>10} {:>10}",
        "total",
        sum(|d| d.last_hour),
        sum(|d| d.last_day),
        sum(|d| d.in_inbox)
    )
}

fn sagas(f: &mut Formatter<'_>, report: &InspectReport) -> fmt::Result {
    /// The states in the order a saga goes through them; any other is listed after.
    const STATES: [&str; 5] = [
        "running",
        "compensating",
        "completed",
        "compensated",
        "parked",
    ];
    writeln!(f, "\nsagas")?;
    for status in STATES {
        let count = report.sagas.by_status.get(status).copied().unwrap_or(0);
        writeln!(f, "  {status:<20} {count}")?;
    }
    for (status, count) in &report.sagas.by_status {
        if !STATES.contains(&status.as_str()) {
            writeln!(f, "  {status:<20} {count}")?;
        }
    }
    match &report.sagas.oldest_unfinished {
        Some(s) => writeln!(
            f,
            "  oldest unfinished    {} ({}, {}, step {}, created {})",
            s.id,
            s.saga_name,
            s.status,
            s.current_step,
            age(report.at, s.created_at)
        ),
        None => writeln!(f, "  oldest unfinished    none"),
    }
}

fn outbox(f: &mut Formatter<'_>, report: &InspectReport) -> fmt::Result {
    writeln!(f, "\noutbox")?;
    writeln!(f, "  pending              {}", report.outbox.pending)?;
    match report.outbox.oldest_pending_at {
        Some(at) => writeln!(f, "  oldest pending       written {}", age(report.at, at)),
        None => writeln!(f, "  oldest pending       none"),
    }
}

fn broker_queues(f: &mut Formatter<'_>, report: &InspectReport) -> fmt::Result {
    if report.broker_queues.is_empty() {
        return Ok(());
    }
    let days = |days: Option<f64>| days.map_or("-".to_owned(), |d| format!("{d:.1} d"));
    writeln!(f, "\nbroker queues (retention measured on the broker)")?;
    writeln!(
        f,
        "  {:<40} {:<8} {:>10} {:>10} {:>10}  ttl covers",
        "queue", "type", "retention", "argument", "policy"
    )?;
    for q in &report.broker_queues {
        writeln!(
            f,
            "  {:<40} {:<8} {:>10} {:>10} {:>10}  {}",
            q.queue,
            q.queue_type.as_deref().unwrap_or("-"),
            q.retention_days
                .map_or("unbounded".to_owned(), |d| format!("{d:.1} d")),
            days(q.argument_days),
            days(q.policy_days),
            if q.covered { "yes" } else { "NO" }
        )?;
    }
    Ok(())
}

fn warnings(f: &mut Formatter<'_>, report: &InspectReport) -> fmt::Result {
    writeln!(f, "\nwarnings")?;
    if report.warnings.is_empty() {
        writeln!(f, "  none")?;
    }
    for warning in &report.warnings {
        writeln!(f, "  ! {warning}")?;
    }
    Ok(())
}

/// A size on disk in the largest unit under 1024 of it; `n/a` when unknown.
fn human_bytes(bytes: Option<i64>) -> String {
    let Some(bytes) = bytes else {
        return "n/a".to_owned();
    };
    let mut value = bytes as f64;
    for unit in ["B", "KiB", "MiB", "GiB"] {
        if value < 1024.0 {
            return if unit == "B" {
                format!("{bytes} B")
            } else {
                format!("{value:.1} {unit}")
            };
        }
        value /= 1024.0;
    }
    format!("{value:.1} TiB")
}

/// How long before `now` `then` was, in the largest unit that keeps it readable.
fn age(now: DateTime<Utc>, then: DateTime<Utc>) -> String {
    let seconds = (now - then).num_seconds().max(0);
    match seconds {
        s if s < 120 => format!("{s} s ago"),
        s if s < 7_200 => format!("{} min ago", s / 60),
        s if s < 172_800 => format!("{} h ago", s / 3_600),
        s => format!("{} days ago", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_well() {
        assert_eq!(human_bytes(None), "n/a");
        assert_eq!(human_bytes(Some(512)), "512 B");
        assert_eq!(human_bytes(Some(8192)), "8.0 KiB");
        assert_eq!(human_bytes(Some(3 * 1024 * 1024)), "3.0 MiB");
    }

    #[test]
    fn ages_read_in_the_largest_fitting_unit() {
        let now = DateTime::parse_from_rfc3339("2026-12-02T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let ago = |seconds: i64| age(now, now - chrono::TimeDelta::seconds(seconds));
        assert_eq!(ago(-5), "0 s ago");
        assert_eq!(ago(90), "90 s ago");
        assert_eq!(ago(3_600), "60 min ago");
        assert_eq!(ago(10_800), "3 h ago");
        assert_eq!(ago(3 * 86_400), "3 days ago");
    }
}
