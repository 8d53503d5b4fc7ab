//! A one-line progress display on stderr: redrawn in place on a terminal, one line per phase
//! otherwise (so logs of CI runs stay readable).

use std::io::{IsTerminal as _, Write as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

/// Shows what is running and how far along it is.
pub struct Progress {
    scenario: String,
    terminal: bool,
    quiet: bool,
}

/// A running phase; drop or [`Phase::done`] ends its line.
pub struct Phase {
    stop: Arc<AtomicBool>,
    task: Option<JoinHandle<()>>,
}

impl Progress {
    /// Progress for `scenario`; `quiet` suppresses everything.
    pub fn new(scenario: &str, quiet: bool) -> Self {
        Self { scenario: scenario.to_owned(), terminal: std::io::stderr().is_terminal(), quiet }
    }

    /// Starts a phase expected to take `expected` (a bar fills over that time); `detail` is
    /// called once a second for a live figure (e.g. the current rate).
    pub fn phase<F>(&self, name: &str, expected: Duration, detail: F) -> Phase
    where
        F: Fn() -> String + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        if self.quiet {
            return Phase { stop, task: None };
        }
        let label = format!("[{}] {name}", self.scenario);
        if !self.terminal {
            eprintln!("{label} ...");
            return Phase { stop, task: None };
        }
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            loop {
                let elapsed = started.elapsed();
                let fraction =
                    if expected.is_zero() { 0.0 } else { (elapsed.as_secs_f64() / expected.as_secs_f64()).min(1.0) };
                let filled = (fraction * 24.0).round() as usize;
                let bar = format!("{}{}", "#".repeat(filled), ".".repeat(24 - filled));
                let line = format!("\r\x1b[2K{label} [{bar}] {:>5.1}s  {}", elapsed.as_secs_f64(), detail());
                let finished = flag.load(Ordering::Relaxed);
                {
                    let mut err = std::io::stderr().lock();
                    let _ = err.write_all(line.as_bytes());
                    if finished {
                        let _ = err.write_all(b"\n");
                    }
                    let _ = err.flush();
                }
                if finished {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
        Phase { stop, task: Some(task) }
    }

    /// A one-off message line.
    pub fn note(&self, message: &str) {
        if !self.quiet {
            eprintln!("[{}] {message}", self.scenario);
        }
    }
}

impl Phase {
    /// Ends the phase and waits for its last redraw.
    pub async fn done(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Phase {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
