//! Tether's load-test harness and local deployments.
//!
//! [`local`] runs a complete deployment in-process (the demo, the tests and the default load-test
//! target use it); [`devpki`] makes the throwaway certificates and tokens it needs; [`backends`]
//! are the node-side servers; [`connect_client`] speaks HTTP CONNECT like kube-apiserver.
//!
//! The harness (`tether-loadtest`): [`scenarios`] are the measurements, one module each;
//! [`target`] is what the data-path scenarios send traffic through ([`delay`] emulates a long
//! link), [`sim_agent`] simulated agents,
//! [`procs`] the real binaries as child processes; [`report`] (JSON and tables), [`svg`] (charts),
//! [`progress`] and [`stats`] present the results.

#![forbid(unsafe_code)]

pub mod backends;
pub mod connect_client;
pub mod delay;
pub mod devpki;
pub mod grpc_client;
pub mod local;
pub mod procs;
pub mod progress;
pub mod report;
pub mod scenarios;
pub mod sim_agent;
pub mod stats;
pub mod svg;
pub mod target;

/// A histogram of microseconds from 1 us to 1 hour with 3 significant digits.
pub fn latency_histogram() -> hdrhistogram::Histogram<u64> {
    // The bounds are constants that hdrhistogram accepts; this cannot fail at run time.
    #[allow(clippy::expect_used)]
    hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}
