//! Tether gateway: authenticates agents, keeps a registry of their sessions per tenant, and gives
//! each tenant's kube-apiserver a Konnectivity-compatible HTTP CONNECT frontend to its nodes.
//!
//! Data flows one way: [`agent_endpoint`] (upgrade, auth) -> [`agent_session`] (control stream,
//! registration) -> [`registry`] (routing) <- [`dial`] <- [`frontend`] (CONNECT from the KAS).
//! Node -> control-plane streams go from [`agent_session`] to [`forward`] (the tenant's allow list).

#![forbid(unsafe_code)]

pub mod admin;
pub mod agent_endpoint;
pub mod agent_session;
pub mod auth;
pub mod config;
pub mod dial;
pub mod forward;
pub mod frontend;
pub mod https_client;
pub mod metrics;
pub mod peers;
pub mod proxy_protocol;
pub mod registry;
pub mod server;
pub mod target;
pub mod tenant;

pub use config::GatewayConfig;
pub use server::{Gateway, GatewayHandle};
