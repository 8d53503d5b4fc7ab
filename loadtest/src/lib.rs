//! Tether's load-test harness and local deployments.
//!
//! [`local`] runs a complete deployment in-process (the demo, the tests and the default load-test
//! target use it); [`devpki`] makes the throwaway certificates and tokens it needs; [`backends`]
//! are the node-side servers; [`connect_client`] speaks HTTP CONNECT like kube-apiserver.

#![forbid(unsafe_code)]

pub mod backends;
pub mod connect_client;
pub mod devpki;
pub mod local;
