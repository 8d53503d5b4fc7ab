//! The load-test scenarios, one module each. Every scenario returns an [`Outcome`]: the JSON
//! report, a table for the terminal and its charts.

pub mod agents;
pub mod compare;
pub mod dial_rate;
pub mod latency;
pub mod measure;
pub mod mux_compare;
pub mod peer;
pub mod reconnect;
pub mod rps;
pub mod soak;
pub mod streams;
pub mod throughput;

use crate::report::Report;

/// What a scenario produced.
pub struct Outcome {
    /// The result document.
    pub report: Report,
    /// The human-readable summary.
    pub table: String,
    /// Charts: (file name, SVG text).
    pub charts: Vec<(String, String)>,
}
