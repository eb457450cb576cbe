//! The one backoff every retry loop waits by — a consumer's reconnects and retryable
//! failures, the relay's failed passes: a first wait, doubled per attempt, up to a cap.

use std::time::Duration;

/// The wait before retry `attempt` (0 for the first): `first` doubled `attempt` times,
/// at most `cap`.
pub(crate) fn doubling(first: Duration, attempt: u32, cap: Duration) -> Duration {
    first
        .saturating_mul(2u32.saturating_pow(attempt.min(16)))
        .min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_doubles_from_the_first_wait_up_to_the_cap() {
        let (first, cap) = (Duration::from_millis(50), Duration::from_millis(3200));
        let waits: Vec<u128> = (0..8)
            .map(|attempt| doubling(first, attempt, cap).as_millis())
            .collect();
        assert_eq!(waits, [50, 100, 200, 400, 800, 1600, 3200, 3200]);
        assert_eq!(doubling(first, u32::MAX, cap), cap);
    }
}
