//! Tether gateway: authenticates agents, keeps a registry of their sessions per tenant, and gives
//! each tenant's kube-apiserver a Konnectivity-compatible HTTP CONNECT frontend to its nodes.
//!
//! Top down:
//! - [`server`] is the composition root: it binds the listeners, wires the parts below together,
//!   serves, and drains ([`lifecycle`]); [`reload`] applies a new configuration as one transaction.
//! - Agents come in through [`agent_endpoint`] (tenant from SNI/Host, upgrade checks, the token:
//!   [`auth`]) into [`agent_session`] (Hello/Welcome, registration, token deadline, drain; the rules
//!   are the state machine in [`session_life`]), which registers them in the tenant's [`registry`], which admits
//!   what they claim to reach by the rules of [`claims`].
//! - A kube-apiserver's CONNECT comes in through [`frontend`] and goes to [`dial`], which opens the
//!   routes [`router`] decides - **where a dial is routed is `router.rs`, `Router::route`** - on a
//!   local agent session or through a peer replica ([`peers`] finds them, [`peer_endpoint`] serves
//!   them).
//! - Node -> control-plane streams go from [`agent_session`] to [`forward`] (the tenant's allow list).
//! - Shared below: [`tenant`] (configuration, verifier, registry and limits of one tenant),
//!   [`settings`], [`config`], [`certs`], [`error`], [`metrics`], [`target`], [`admin`].

#![forbid(unsafe_code)]

pub mod admin;
pub mod admission;
pub mod agent_endpoint;
pub mod agent_session;
pub mod audit;
pub mod auth;
pub mod certs;
pub mod claims;
pub mod config;
pub mod dial;
pub mod error;
pub mod forward;
pub mod frontend;
pub mod https_client;
pub mod lifecycle;
pub mod metrics;
pub mod peer_endpoint;
pub mod peers;
pub mod proxy_protocol;
pub mod registry;
pub mod reload;
pub mod router;
pub mod server;
pub mod session_life;
pub mod settings;
pub mod target;
pub mod tenant;

pub use config::GatewayConfig;
pub use server::{Gateway, GatewayHandle};
