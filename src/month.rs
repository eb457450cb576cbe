//! [`Month`]: the unit the inbox is partitioned by, and the only thing partition table
//! names are built from (so dynamic DDL never contains outside text).

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Datelike, NaiveDate, TimeZone, Utc};

/// The earliest year a [`Month`] can name.
pub const MIN_YEAR: i32 = 1970;
/// The latest year a [`Month`] can name: table names carry a four-digit year.
pub const MAX_YEAR: i32 = 9999;

/// A calendar month in UTC, between [`MIN_YEAR`] and [`MAX_YEAR`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Month {
    year: i32,
    month: u32,
}

/// A month that cannot be represented.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MonthError {
    /// Year or month out of range.
    #[error(
        "month {year}-{month:02} is out of range: the year must be {MIN_YEAR}..={MAX_YEAR} and the month 1..=12"
    )]
    OutOfRange {
        /// The year given.
        year: i32,
        /// The month given.
        month: u32,
    },
    /// Text that is not `YYYY-MM`.
    #[error("{0:?} is not a month: write it as YYYY-MM, e.g. 2026-12")]
    Unparsable(String),
}

impl Month {
    /// The month `year`-`month` (1-based).
    pub fn new(year: i32, month: u32) -> Result<Self, MonthError> {
        if !(MIN_YEAR..=MAX_YEAR).contains(&year) || !(1..=12).contains(&month) {
            return Err(MonthError::OutOfRange { year, month });
        }
        Ok(Self { year, month })
    }

    /// The month containing `time`, or an error outside the supported years.
    pub fn of(time: DateTime<Utc>) -> Result<Self, MonthError> {
        Self::new(time.year(), time.month())
    }

    /// The year.
    pub fn year(self) -> i32 {
        self.year
    }

    /// The month of the year, 1-based.
    pub fn month(self) -> u32 {
        self.month
    }

    /// The first day of the month.
    pub fn first_day(self) -> NaiveDate {
        // In range by construction.
        NaiveDate::from_ymd_opt(self.year, self.month, 1).unwrap_or(NaiveDate::MIN)
    }

    /// The first instant of the month.
    pub fn start(self) -> DateTime<Utc> {
        Utc.from_utc_datetime(&self.first_day().and_time(chrono::NaiveTime::MIN))
    }

    /// The first instant after the month: every time in it is strictly earlier.
    pub fn end(self) -> DateTime<Utc> {
        let (year, month) = if self.month == 12 {
            (self.year + 1, 1)
        } else {
            (self.year, self.month + 1)
        };
        let first = NaiveDate::from_ymd_opt(year, month, 1).unwrap_or(NaiveDate::MAX);
        Utc.from_utc_datetime(&first.and_time(chrono::NaiveTime::MIN))
    }

    /// The following month, or `None` after December of [`MAX_YEAR`].
    pub fn next(self) -> Option<Self> {
        if self.month == 12 {
            Self::new(self.year + 1, 1).ok()
        } else {
            Self::new(self.year, self.month + 1).ok()
        }
    }

    /// The months from `self` to `last`, both included (empty when `last < self`).
    pub fn through(self, last: Month) -> impl Iterator<Item = Month> {
        std::iter::successors(Some(self), |m| m.next()).take_while(move |m| *m <= last)
    }

    /// The month `n` months later, saturating at the last supported month.
    pub fn plus(self, n: u32) -> Self {
        (0..n).fold(self, |m, _| m.next().unwrap_or(m))
    }

    /// The table suffix for this month, `YYYY_MM`.
    pub fn suffix(self) -> String {
        format!("{:04}_{:02}", self.year, self.month)
    }

    /// Parses the suffix written by [`Month::suffix`] off the end of `name` after
    /// `prefix`, e.g. `sagabox_inbox_2026_11`.
    pub fn from_table_name(prefix: &str, name: &str) -> Option<Self> {
        let rest = name.strip_prefix(prefix)?;
        let (year, month) = rest.split_once('_')?;
        if year.len() != 4 || month.len() != 2 {
            return None;
        }
        Self::new(year.parse().ok()?, month.parse().ok()?).ok()
    }
}

impl fmt::Display for Month {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-{:02}", self.year, self.month)
    }
}

impl FromStr for Month {
    type Err = MonthError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let unparsable = || MonthError::Unparsable(s.to_owned());
        let (year, month) = s.split_once('-').ok_or_else(unparsable)?;
        if year.len() != 4 || month.len() != 2 {
            return Err(unparsable());
        }
        Self::new(
            year.parse().map_err(|_| unparsable())?,
            month.parse().map_err(|_| unparsable())?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries() {
        let nov = Month::new(2026, 11).unwrap();
        let t = Utc.with_ymd_and_hms(2026, 11, 30, 23, 59, 59).unwrap();
        assert_eq!(Month::of(t).unwrap(), nov);
        assert_eq!(
            nov.end(),
            Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap()
        );
        let dec = nov.next().unwrap();
        assert_eq!(dec.next().unwrap(), Month::new(2027, 1).unwrap());
        assert_eq!(
            dec.end(),
            Utc.with_ymd_and_hms(2027, 1, 1, 0, 0, 0).unwrap()
        );
        assert_eq!(nov.through(Month::new(2027, 2).unwrap()).count(), 4);
        assert_eq!(nov.plus(2), Month::new(2027, 1).unwrap());
    }

    #[test]
    fn names_round_trip() {
        let m = Month::new(2026, 8).unwrap();
        assert_eq!(m.suffix(), "2026_08");
        assert_eq!(Month::from_table_name("inbox_", "inbox_2026_08"), Some(m));
        assert_eq!(Month::from_table_name("inbox_", "inbox_2026_13"), None);
        assert_eq!(Month::from_table_name("inbox_", "inbox_x"), None);
        assert_eq!("2026-08".parse::<Month>().unwrap(), m);
        assert!("2026-8".parse::<Month>().is_err());
        assert!(Month::new(12345, 1).is_err());
    }
}
