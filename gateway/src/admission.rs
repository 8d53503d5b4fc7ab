//! Limits in front of the agent endpoint, before any token is checked: how many connections may
//! be in their handshake at once, and how fast one source address may open new ones. A flood of
//! TCP connections or TLS handshakes then costs a counter increment each, not a TLS handshake and a
//! signature check.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::metrics::CONNECTIONS_REFUSED;

/// Source addresses whose rate is tracked at most; past it, idle ones are forgotten.
const MAX_SOURCES: usize = 100_000;

/// The admission limits of the agent endpoint.
pub struct Admission {
    handshakes: Arc<Semaphore>,
    per_source: Option<SourceRates>,
}

/// Why a connection was closed before its handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// `limits.max_handshakes` connections are in their handshake already.
    TooManyHandshakes,
    /// The source opened more than `limits.handshakes_per_source` per second.
    SourceRate,
}

impl Refused {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::TooManyHandshakes => "too_many_handshakes",
            Self::SourceRate => "source_rate",
        }
    }
}

impl Admission {
    /// At most `max_handshakes` at once; `per_source` new connections per second per address
    /// (0: unlimited), with a burst of twice that.
    pub fn new(max_handshakes: usize, per_source: u32) -> Self {
        Self {
            handshakes: Arc::new(Semaphore::new(max_handshakes)),
            per_source: (per_source > 0).then(|| SourceRates::new(per_source)),
        }
    }

    /// A slot for one connection's handshake, held until it is upgraded or closed.
    pub fn handshake_slot(&self) -> Result<OwnedSemaphorePermit, Refused> {
        self.handshakes.clone().try_acquire_owned().map_err(|_| refused(Refused::TooManyHandshakes))
    }

    /// Whether `source` may open another connection now.
    pub fn check_source(&self, source: IpAddr) -> Result<(), Refused> {
        match &self.per_source {
            Some(rates) if !rates.take(source) => Err(refused(Refused::SourceRate)),
            _ => Ok(()),
        }
    }
}

fn refused(reason: Refused) -> Refused {
    metrics::counter!(CONNECTIONS_REFUSED, "reason" => reason.label()).increment(1);
    reason
}

/// A token bucket per source address.
struct SourceRates {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<IpAddr, (f64, Instant)>>,
}

impl SourceRates {
    fn new(rate: u32) -> Self {
        Self { rate: f64::from(rate), burst: f64::from(rate) * 2.0, buckets: Mutex::new(HashMap::new()) }
    }

    fn take(&self, source: IpAddr) -> bool {
        let Ok(mut buckets) = self.buckets.lock() else { return true };
        let now = Instant::now();
        if buckets.len() >= MAX_SOURCES && !buckets.contains_key(&source) {
            // Forget sources whose bucket has refilled: they are as good as new.
            let (rate, burst) = (self.rate, self.burst);
            buckets.retain(|_, (tokens, at)| *tokens + now.duration_since(*at).as_secs_f64() * rate < burst);
            if buckets.len() >= MAX_SOURCES {
                return false;
            }
        }
        let (tokens, at) = buckets.entry(source).or_insert((self.burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.rate).min(self.burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn handshake_slots_are_bounded_and_come_back() {
        let admission = Admission::new(2, 0);
        let a = admission.handshake_slot().unwrap();
        let _b = admission.handshake_slot().unwrap();
        assert_eq!(admission.handshake_slot().unwrap_err(), Refused::TooManyHandshakes);
        drop(a);
        assert!(admission.handshake_slot().is_ok());
    }

    #[tokio::test]
    async fn each_source_has_its_own_rate() {
        let admission = Admission::new(10, 5);
        let (one, other): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let allowed = (0..20).filter(|_| admission.check_source(one).is_ok()).count();
        assert_eq!(allowed, 10, "a burst of twice the rate");
        assert!(admission.check_source(other).is_ok(), "another source is not affected");
        assert!(Admission::new(10, 0).check_source(one).is_ok());
    }
}
