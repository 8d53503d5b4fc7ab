//! Process-wide settings, read once from the configuration (changing them needs a restart), cut
//! into what each part uses: agent sessions and CONNECT frontends.

use std::time::Duration;

use tether_tunnel::mux::MuxSettings;
use tether_tunnel::ws::{KeepaliveSettings, WsSettings};

use crate::config::GatewayConfig;

/// What agent sessions need: identity of this replica, transport tuning, timeouts.
#[derive(Debug, Clone)]
pub struct SessionSettings {
    /// This replica's id (sent in Welcome).
    pub server_id: String,
    /// WebSocket settings of agent connections.
    pub ws: WsSettings,
    /// Multiplexer settings of agent sessions.
    pub mux: MuxSettings,
    /// How often both ends ping (announced in Welcome).
    pub ping_interval: Duration,
    /// Time for TLS, the upgrade and the Hello.
    pub handshake_timeout: Duration,
    /// How long agents are given to move when the gateway drains or a tenant is removed.
    pub drain_grace_period: Duration,
}

impl SessionSettings {
    /// The session settings a configuration implies.
    pub fn from_config(config: &GatewayConfig) -> Self {
        let keepalive = KeepaliveSettings {
            ping_interval: config.keepalive.ping_interval.0,
            ping_timeout: config.keepalive.ping_timeout.0,
        };
        Self {
            server_id: config.server_id(),
            ws: WsSettings {
                read_buffer_size: config.limits.ws_read_buffer_size,
                keepalive: Some(keepalive),
                ..WsSettings::default()
            },
            mux: MuxSettings {
                max_streams: config.limits.max_streams_per_agent,
                window_growth: config.limits.window_growth_per_agent_mib << 20,
                ..MuxSettings::default()
            },
            ping_interval: config.keepalive.ping_interval.0,
            handshake_timeout: config.limits.handshake_timeout.0,
            drain_grace_period: config.drain_grace_period.0,
        }
    }
}

/// What the CONNECT frontends need.
#[derive(Debug, Clone, Copy)]
pub struct FrontendSettings {
    /// Time for a client to send its CONNECT request.
    pub connect_request_timeout: Duration,
    /// Time for a client's TLS handshake.
    pub handshake_timeout: Duration,
}

impl FrontendSettings {
    /// The frontend settings a configuration implies.
    pub fn from_config(config: &GatewayConfig) -> Self {
        Self {
            connect_request_timeout: config.limits.connect_request_timeout.0,
            handshake_timeout: config.limits.handshake_timeout.0,
        }
    }
}
