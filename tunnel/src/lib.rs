//! Tether's shared tunnel library.
//!
//! Layers, bottom up: [`transport`] (TCP or TLS), [`ws`] (WebSocket as a byte stream, with
//! keepalive), [`mux`] (independent flow-controlled streams), [`protocol`] and [`framed`] (the
//! frames that open each stream and the control messages), [`splice`] (moving bytes between a
//! stream and a socket; [`bulk_window`] gives the socket on the local side a larger receive buffer
//! once it carries bulk data). [`client`] dials a gateway through all of them; [`session_threads`]
//! gives sessions a thread each; [`tls`], [`backoff`], [`duration`], [`settings`] and [`telemetry`]
//! are shared plumbing. No gateway or agent policy lives here.

#![forbid(unsafe_code)]

pub mod backoff;
pub mod bulk_window;
pub mod cli;
pub mod client;
pub mod connect;
pub mod duration;
pub mod framed;
pub mod jwt;
pub mod mux;
pub mod protocol;
pub mod proxy;
pub mod session_threads;
pub mod settings;
pub mod splice;
pub mod telemetry;
pub mod tls;
pub mod transport;
pub mod untrusted;
pub mod ws;
pub mod ws_link;
