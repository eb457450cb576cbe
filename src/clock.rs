//! Where the inbox gets the time from: the system clock in production, a [`ManualClock`]
//! in tests, so a test can place a delivery in any month, and a [`ScaledClock`] for soak
//! runs that compress months into minutes.

use std::fmt::Debug;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};

/// A source of the current time.
pub trait Clock: Debug + Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> DateTime<Utc>;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that shows the time it was set to; clones share the same time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<DateTime<Utc>>>);

impl ManualClock {
    /// A clock stopped at `now`.
    pub fn new(now: DateTime<Utc>) -> Self {
        Self(Arc::new(Mutex::new(now)))
    }

    /// Moves the clock to `now`.
    pub fn set(&self, now: DateTime<Utc>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = now;
    }

    /// Moves the clock forward by `delta`.
    pub fn advance(&self, delta: TimeDelta) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) += delta;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The largest [`ScaledClock`] speed: a year in about 30 ms.
pub const MAX_CLOCK_SPEED: f64 = 1e9;

/// A [`ScaledClock`] speed that is not a finite number within `1..=1e9`.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error(
    "clock speed must be a number from 1 to 1e9 (1 is real time, 43200 a month a minute), got {}",
    shown(*.0)
)]
pub struct InvalidClockSpeed(pub f64);

/// `value` as written, or in scientific notation when that would run to many digits.
fn shown(value: f64) -> String {
    if value == 0.0 || (1e-3..1e12).contains(&value.abs()) {
        value.to_string()
    } else {
        format!("{value:e}")
    }
}

/// A clock that starts at a given time and runs `speed` times faster than the wall
/// clock: with 43,200 a month passes in a minute. For soak runs that watch the pruner
/// drop months while messages flow; every part that files or expires messages (the
/// guards, the saga times that message ids are derived from, the pruner) must share
/// the same one. Clones share the origin.
#[derive(Debug, Clone, Copy)]
pub struct ScaledClock {
    origin: DateTime<Utc>,
    started: Instant,
    speed: f64,
}

impl ScaledClock {
    /// A clock showing `origin` now and running `speed` times faster than real time.
    pub fn new(origin: DateTime<Utc>, speed: f64) -> Result<Self, InvalidClockSpeed> {
        Ok(Self {
            origin,
            started: Instant::now(),
            speed: Self::check_speed(speed)?,
        })
    }

    /// `speed` if a clock can run at it: a finite number within `1..=`[`MAX_CLOCK_SPEED`].
    pub fn check_speed(speed: f64) -> Result<f64, InvalidClockSpeed> {
        if speed.is_finite() && (1.0..=MAX_CLOCK_SPEED).contains(&speed) {
            Ok(speed)
        } else {
            Err(InvalidClockSpeed(speed))
        }
    }

    /// How many times faster than real time it runs.
    pub fn speed(&self) -> f64 {
        self.speed
    }
}

impl Clock for ScaledClock {
    fn now(&self) -> DateTime<Utc> {
        let scaled = Duration::try_from_secs_f64(self.started.elapsed().as_secs_f64() * self.speed)
            .ok()
            .and_then(|elapsed| TimeDelta::from_std(elapsed).ok())
            .unwrap_or(TimeDelta::MAX);
        self.origin
            .checked_add_signed(scaled)
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_clock_runs_fast_from_its_origin() {
        let origin = DateTime::parse_from_rfc3339("2027-01-31T00:00:00Z")
            .unwrap()
            .to_utc();
        let clock = ScaledClock::new(origin, 86_400.0).unwrap();
        assert!(clock.now() >= origin);
        std::thread::sleep(Duration::from_millis(50));
        let passed = clock.now() - origin;
        // 50 ms of real time is at least 72 minutes at a day per second.
        assert!(passed >= TimeDelta::minutes(72), "{passed}");
        assert!(passed < TimeDelta::days(2), "{passed}");
    }

    #[test]
    fn scaled_clock_refuses_speeds_out_of_range() {
        let origin = Utc::now();
        for speed in [0.0, 0.5, -3.0, f64::NAN, f64::INFINITY, 2e9] {
            assert!(ScaledClock::new(origin, speed).is_err(), "{speed}");
        }
        assert!(ScaledClock::new(origin, 1.0).is_ok());
        let huge = ScaledClock::new(origin, 1e300).unwrap_err().to_string();
        assert!(huge.ends_with("got 1e300"), "{huge}");
        let half = ScaledClock::new(origin, 0.5).unwrap_err().to_string();
        assert!(half.ends_with("got 0.5"), "{half}");
    }
}
