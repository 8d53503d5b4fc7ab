//! Measurement primitives shared by the data-path scenarios: bulk transfer over N connections for
//! a fixed time, and sequential short-lived dials.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::progress::{Phase, Progress};
use crate::stats::{self, Counter, Sampler};
use crate::target::Route;

/// Bytes in a MiB.
pub const MIB: f64 = 1024.0 * 1024.0;

/// Which way bulk data flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Node-side server to client.
    Download,
    /// Client to node-side server.
    Upload,
}

impl Direction {
    /// `download` / `upload`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Download => "download",
            Self::Upload => "upload",
        }
    }
}

/// One bulk measurement.
#[derive(Debug, Clone)]
pub struct BulkResult {
    /// Average over the run, MiB/s.
    pub mib_s: f64,
    /// Per-second samples, MiB/s.
    pub samples: Vec<f64>,
    /// For uploads: whether the server confirmed the byte count. A tunnel that does not carry
    /// half-close (rathole) cannot answer after the client's end-of-stream; then the figure is
    /// what the client's socket accepted.
    pub confirmed: bool,
    /// CPU seconds this process used per GiB moved (see [`stats::process_cpu_seconds`]).
    pub cpu_s_per_gib: Option<f64>,
}

fn rate_phase(
    progress: &Progress,
    name: &str,
    expected: Duration,
    counter: &Counter,
    scale: f64,
    unit: &'static str,
) -> Phase {
    let counter = counter.clone();
    let started = Instant::now();
    progress.phase(name, expected, move || {
        let secs = started.elapsed().as_secs_f64().max(1e-3);
        format!("{:.1} {unit}", counter.load(Ordering::Relaxed) as f64 / scale / secs)
    })
}

/// Moves bulk data over `streams` connections along `route` for `duration`.
pub async fn bulk(
    route: &Route,
    direction: Direction,
    streams: usize,
    duration: Duration,
    progress: &Progress,
    label: &str,
) -> anyhow::Result<BulkResult> {
    let mut conns = Vec::with_capacity(streams);
    for _ in 0..streams.max(1) {
        conns.push(route.open().await?);
    }
    let counter = stats::counter();
    let phase = rate_phase(progress, label, duration, &counter, MIB, "MiB/s");
    let sampler = Sampler::start(counter.clone(), Duration::from_secs(1));
    let cpu = stats::CpuMeter::start();
    let started = tokio::time::Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for mut conn in conns {
        let counter = counter.clone();
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 256 * 1024];
            match direction {
                Direction::Download => {
                    let mut command = [0u8; 9];
                    command[0] = b'D';
                    command[1..].copy_from_slice(&(u64::MAX / 4).to_be_bytes());
                    conn.write_all(&command).await?;
                    let mut total = 0u64;
                    while let Ok(read) = tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
                        let n = read?;
                        if n == 0 {
                            anyhow::bail!("the bulk server ended the download early");
                        }
                        total += n as u64;
                        counter.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    Ok::<_, anyhow::Error>((total, deadline, true))
                }
                Direction::Upload => {
                    let chunk = crate::backends::pattern(buf.len());
                    conn.write_all(b"U").await?;
                    let mut total = 0u64;
                    while let Ok(written) = tokio::time::timeout_at(deadline, conn.write(&chunk)).await {
                        let n = written? as u64;
                        total += n;
                        counter.fetch_add(n, Ordering::Relaxed);
                    }
                    conn.shutdown().await?;
                    // The server's count is what arrived; the clock stops when it has all arrived.
                    let mut count = [0u8; 8];
                    match tokio::time::timeout(Duration::from_secs(60), conn.read_exact(&mut count)).await {
                        Ok(Ok(_)) => Ok((u64::from_be_bytes(count), tokio::time::Instant::now(), true)),
                        _ => Ok((total, deadline, false)),
                    }
                }
            }
        }));
    }
    let mut bytes = 0u64;
    let mut end = deadline;
    let mut confirmed = true;
    for task in tasks {
        let (n, finished, ok) = task.await??;
        bytes += n;
        end = end.max(finished);
        confirmed &= ok;
    }
    let cpu_s_per_gib = cpu.seconds().filter(|_| bytes > 0).map(|s| s * 1024.0 * MIB / bytes as f64);
    let samples = sampler.finish().await.into_iter().map(|v| v / MIB).collect();
    phase.done().await;
    let secs = end.duration_since(started).as_secs_f64().max(1e-6);
    // Let the far ends notice the closed connections before the next phase starts.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(BulkResult { mib_s: bytes as f64 / MIB / secs, samples, confirmed, cpu_s_per_gib })
}

/// One dial-rate measurement.
pub struct DialResult {
    /// Completed dials per second.
    pub per_second: f64,
    /// Dial latency (open, request, response, close), microseconds.
    pub histogram: Histogram<u64>,
    /// Per-second samples of the rate.
    pub samples: Vec<f64>,
    /// Dials that failed.
    pub errors: u64,
    /// CPU this process used per completed dial, microseconds.
    pub cpu_us_per_dial: Option<f64>,
}

/// Opens connections along `route` one after another (per worker) for `duration`: open, send a
/// 16-byte request, read the 16-byte answer (the echo server), close.
pub async fn dials(
    route: &Route,
    duration: Duration,
    concurrency: usize,
    progress: &Progress,
    label: &str,
) -> anyhow::Result<DialResult> {
    let counter = stats::counter();
    let phase = rate_phase(progress, label, duration, &counter, 1.0, "dials/s");
    let sampler = Sampler::start(counter.clone(), Duration::from_secs(1));
    let cpu = stats::CpuMeter::start();
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + duration;
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let route = route.clone();
        let counter = counter.clone();
        tasks.push(tokio::spawn(async move {
            let mut histogram = crate::latency_histogram();
            let mut errors = 0u64;
            let request = [b'x'; 16];
            let mut answer = [0u8; 16];
            while tokio::time::Instant::now() < deadline {
                let t0 = Instant::now();
                let attempt = async {
                    let mut conn = route.open().await?;
                    conn.write_all(&request).await?;
                    conn.read_exact(&mut answer).await?;
                    anyhow::Ok(())
                };
                match tokio::time::timeout(Duration::from_secs(10), attempt).await {
                    Ok(Ok(())) => {
                        let _ = histogram.record(t0.elapsed().as_micros().max(1) as u64);
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        errors += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            (histogram, errors)
        }));
    }
    let mut histogram = crate::latency_histogram();
    let mut errors = 0;
    for task in tasks {
        let (h, e) = task.await?;
        histogram.add(&h).map_err(|e| anyhow::anyhow!("histogram: {e}"))?;
        errors += e;
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu_us_per_dial = cpu.seconds().filter(|_| !histogram.is_empty()).map(|s| s * 1e6 / histogram.len() as f64);
    let samples = sampler.finish().await;
    phase.done().await;
    anyhow::ensure!(!histogram.is_empty(), "{label}: no dial succeeded ({errors} failed)");
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(DialResult { per_second: histogram.len() as f64 / secs, histogram, samples, errors, cpu_us_per_dial })
}
