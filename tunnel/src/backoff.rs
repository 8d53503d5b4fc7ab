//! Exponential backoff with full jitter: the n-th delay is uniform in `[0, min(cap, base * 2^n)]`,
//! so thousands of agents that lost the same gateway do not come back in lockstep.

use std::time::Duration;

/// Reconnect delays for one connection.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
    rng: fastrand::Rng,
}

impl Backoff {
    /// Delays start at up to `base` and grow to at most `cap`.
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self { base, cap: cap.max(base), attempt: 0, rng: fastrand::Rng::new() }
    }

    /// The ceiling of the next delay, before jitter.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The next delay; each call raises the ceiling until it reaches the cap.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(self.rng.u64(0..=nanos))
    }

    /// Starts over after a success.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// Failed attempts since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_up_to_the_cap() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut ceilings = Vec::new();
        for _ in 0..10 {
            ceilings.push(b.ceiling().as_millis());
            b.next_delay();
        }
        assert_eq!(ceilings, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000]);
        b.reset();
        assert_eq!(b.ceiling(), Duration::from_millis(100));
    }

    #[test]
    fn delays_are_jittered_across_the_whole_range() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let delays: Vec<Duration> = (0..2000).map(|_| b.next_delay()).collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_secs(1)));
        let low = delays.iter().filter(|d| **d < Duration::from_millis(250)).count();
        let high = delays.iter().filter(|d| **d > Duration::from_millis(750)).count();
        // Full jitter: roughly a quarter in each end, never all at the ceiling.
        assert!(low > 300 && high > 300, "low {low} high {high}");
    }

    #[test]
    fn many_attempts_never_overflow() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        for _ in 0..10_000 {
            assert!(b.next_delay() <= Duration::from_secs(60));
        }
    }
}
