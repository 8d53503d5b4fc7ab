//! Small statistics: medians, histogram percentiles, linear fits, and per-interval sampling of a
//! live counter.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The percentiles every latency report shows.
pub const PERCENTILES: [(&str, f64); 4] = [("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9)];

/// The median of `values` (the mean of the middle two for an even count); 0 when empty.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return 0.0;
    }
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) { (sorted[mid - 1] + sorted[mid]) / 2.0 } else { sorted[mid] }
}

/// The median of the values given, or `None` when there are none.
pub fn median_of(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let values: Vec<f64> = values.into_iter().collect();
    (!values.is_empty()).then(|| median(&values))
}

/// Index of the value closest to the median (to pick a representative repetition).
pub fn median_index(values: &[f64]) -> usize {
    let m = median(values);
    values.iter().enumerate().min_by(|a, b| (a.1 - m).abs().total_cmp(&(b.1 - m).abs())).map(|(i, _)| i).unwrap_or(0)
}

/// `a / b`, or 0 when `b` is 0.
pub fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { 0.0 } else { a / b }
}

/// Latency percentiles of a histogram of microseconds: `(name, value)` for [`PERCENTILES`].
pub fn percentiles(histogram: &Histogram<u64>) -> Vec<(&'static str, f64)> {
    PERCENTILES.iter().map(|(name, q)| (*name, histogram.value_at_quantile(q / 100.0) as f64)).collect()
}

/// Points of the latency distribution for plotting: (percentile, microseconds).
pub fn distribution(histogram: &Histogram<u64>) -> Vec<[f64; 2]> {
    const QUANTILES: [f64; 13] = [0.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99, 99.999, 100.0];
    if histogram.is_empty() {
        return Vec::new();
    }
    QUANTILES.iter().map(|q| [*q, histogram.value_at_quantile(q / 100.0) as f64]).collect()
}

/// Least-squares slope of y over x (0 with fewer than two distinct x).
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    if sxx == 0.0 { 0.0 } else { sxy / sxx }
}

/// A counter that load tasks bump and a sampler reads.
pub type Counter = Arc<AtomicU64>;

/// A new zeroed counter.
pub fn counter() -> Counter {
    Arc::new(AtomicU64::new(0))
}

/// Samples a counter's increase every `interval` until stopped; the result is the rate per second
/// of each interval.
pub struct Sampler {
    stop: CancellationToken,
    task: JoinHandle<Vec<f64>>,
}

impl Sampler {
    /// Starts sampling `counter`.
    pub fn start(counter: Counter, interval: Duration) -> Self {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            let mut last = counter.load(Ordering::Relaxed);
            let mut last_at = tokio::time::Instant::now();
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    () = token.cancelled() => return samples,
                }
                let now = tokio::time::Instant::now();
                let value = counter.load(Ordering::Relaxed);
                let secs = now.duration_since(last_at).as_secs_f64();
                if secs > 0.0 {
                    samples.push(value.saturating_sub(last) as f64 / secs);
                }
                last = value;
                last_at = now;
            }
        });
        Self { stop, task }
    }

    /// Stops and returns the per-second rates of the completed intervals.
    pub async fn finish(self) -> Vec<f64> {
        self.stop.cancel();
        self.task.await.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median_index(&[10.0, 30.0, 20.0]), 2);
    }

    #[test]
    fn slope_of_a_line() {
        let points: Vec<(f64, f64)> = (0..5).map(|i| (i as f64 * 100.0, 7.0 + i as f64 * 250.0)).collect();
        assert!((slope(&points) - 2.5).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 1.0)]), 0.0);
    }
}

/// CPU time (user + system, all threads) this process has used so far, in seconds; `None` where
/// `/proc/self/stat` cannot be read. With the in-process deployment this covers the load
/// generator, the servers, the gateway and the agent: CPU per byte or per request is then the
/// whole tunnel's cost, a steadier figure than a rate on a shared machine.
pub fn process_cpu_seconds() -> Option<f64> {
    /// `/proc` reports clock ticks of USER_HZ, which Linux fixes at 100 for user space.
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces; count fields after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let user: f64 = fields.next()?.parse().ok()?;
    let system: f64 = fields.next()?.parse().ok()?;
    Some((user + system) / TICKS_PER_SECOND)
}

/// Measures the CPU this process uses between [`CpuMeter::start`] and [`CpuMeter::seconds`].
#[derive(Debug, Clone, Copy)]
pub struct CpuMeter(Option<f64>);

impl CpuMeter {
    /// Starts measuring now.
    pub fn start() -> Self {
        Self(process_cpu_seconds())
    }

    /// CPU seconds used since the start, if the platform tells.
    pub fn seconds(&self) -> Option<f64> {
        Some(process_cpu_seconds()? - self.0?)
    }
}
