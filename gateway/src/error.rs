//! Why part of a configuration could not be put into service (at start-up or on reload): which
//! key, and why. Configuration *validation* errors are [`crate::config::ConfigError`].

use std::io;

use tether_tunnel::tls::TlsError;

/// A configuration that validated but could not be put into service.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A listener could not be bound.
    #[error("{key}: cannot listen on {address}: {error}")]
    Listen {
        /// The configuration key.
        key: String,
        /// The address or socket path.
        address: String,
        /// Why.
        error: io::Error,
    },
    /// A certificate, key or CA file did not load.
    #[error("{key}: {error}")]
    Tls {
        /// The configuration key.
        key: String,
        /// Why.
        error: TlsError,
    },
    /// A referenced file could not be read or does not hold what it should.
    #[error("{key}: {reason}")]
    File {
        /// The configuration key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A value cannot be used as given.
    #[error("{key}: {reason}")]
    Invalid {
        /// The configuration key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

impl SetupError {
    /// A listener that could not be bound.
    pub fn listen(key: impl Into<String>, address: impl std::fmt::Display, source: io::Error) -> Self {
        Self::Listen { key: key.into(), address: address.to_string(), error: source }
    }

    /// A TLS file that did not load.
    pub fn tls(key: impl Into<String>, source: TlsError) -> Self {
        Self::Tls { key: key.into(), error: source }
    }

    /// A file that could not be used.
    pub fn file(key: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::File { key: key.into(), reason: reason.to_string() }
    }

    /// A value that cannot be used.
    pub fn invalid(key: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::Invalid { key: key.into(), reason: reason.to_string() }
    }
}
