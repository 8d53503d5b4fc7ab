//! Checking an agent's bearer token: a JWT (normally a Kubernetes ServiceAccount token) signed by
//! the tenant's issuer. Every check is explicit: algorithm allow-list, key id, signature, issuer,
//! audience, expiry, not-before, subject. Tokens never appear in errors or logs.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use base64::Engine;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};
use serde::Deserialize;

use super::keys::KeySet;

/// Largest token accepted; Kubernetes tokens are about 1 KiB.
pub const MAX_TOKEN_LEN: usize = 16 * 1024;

/// Why a token was refused. The label is a bounded metric label; the message is safe to log and
/// to send to the agent (it never contains the token).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    #[error("no bearer token")]
    Missing,
    /// Longer than [`MAX_TOKEN_LEN`].
    #[error("token too large")]
    TooLarge,
    /// Not a JWT.
    #[error("malformed token")]
    Malformed,
    /// The header names an algorithm the tenant does not accept (`none`, HMAC, ...).
    #[error("algorithm {0} is not accepted")]
    AlgorithmNotAllowed(String),
    /// No key with the token's `kid`.
    #[error("unknown signing key")]
    UnknownKey,
    /// The signature does not verify.
    #[error("bad signature")]
    BadSignature,
    /// `exp` is in the past.
    #[error("token expired")]
    Expired,
    /// `nbf` is in the future.
    #[error("token not yet valid")]
    NotYetValid,
    /// `aud` does not include an accepted audience.
    #[error("wrong audience")]
    WrongAudience,
    /// `iss` is not the tenant's issuer.
    #[error("wrong issuer")]
    WrongIssuer,
    /// A required claim is absent or has the wrong type.
    #[error("missing or invalid claim {0}")]
    BadClaim(String),
    /// The subject is not on the tenant's list.
    #[error("subject not allowed")]
    SubjectNotAllowed,
}

impl AuthError {
    /// A short, bounded label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::TooLarge => "too_large",
            Self::Malformed => "malformed",
            Self::AlgorithmNotAllowed(_) => "algorithm_not_allowed",
            Self::UnknownKey => "unknown_key",
            Self::BadSignature => "bad_signature",
            Self::Expired => "expired",
            Self::NotYetValid => "not_yet_valid",
            Self::WrongAudience => "wrong_audience",
            Self::WrongIssuer => "wrong_issuer",
            Self::BadClaim(_) => "bad_claim",
            Self::SubjectNotAllowed => "subject_not_allowed",
        }
    }
}

/// What a verified token proves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The `sub` claim.
    pub subject: String,
    /// `exp`, seconds since the Unix epoch.
    pub expires_at: u64,
    /// The node a bound ServiceAccount token was issued for (`kubernetes.io.node.name`).
    pub node_name: Option<String>,
}

impl Identity {
    /// Time left before the token expires (zero if it already has).
    pub fn remaining(&self) -> Duration {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        Duration::from_secs(self.expires_at.saturating_sub(now))
    }
}

/// The settings of one tenant's token checks.
#[derive(Debug, Clone)]
pub struct VerifierSettings {
    /// Expected `iss`.
    pub issuer: String,
    /// Accepted `aud` values.
    pub audiences: Vec<String>,
    /// Accepted algorithms.
    pub algorithms: Vec<Algorithm>,
    /// Subjects allowed to connect; empty means any subject of the issuer.
    pub allowed_subjects: HashSet<String>,
    /// Clock skew tolerated on `exp` and `nbf`.
    pub leeway: Duration,
}

/// Verifies tokens of one tenant against its current keys.
pub struct TokenVerifier {
    settings: VerifierSettings,
    keys: ArcSwap<KeySet>,
}

impl fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenVerifier").field("issuer", &self.settings.issuer).finish()
    }
}

#[derive(Deserialize)]
struct RawHeader {
    alg: String,
    #[serde(default)]
    kid: Option<String>,
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
    exp: u64,
    #[serde(default, rename = "kubernetes.io")]
    kubernetes: Option<KubernetesClaims>,
}

#[derive(Deserialize)]
struct KubernetesClaims {
    #[serde(default)]
    node: Option<NamedRef>,
}

#[derive(Deserialize)]
struct NamedRef {
    name: String,
}

impl TokenVerifier {
    /// A verifier with an initial key set.
    pub fn new(settings: VerifierSettings, keys: KeySet) -> Self {
        Self { settings, keys: ArcSwap::from_pointee(keys) }
    }

    /// Replaces the key set (key rotation).
    pub fn set_keys(&self, keys: KeySet) {
        self.keys.store(Arc::new(keys));
    }

    /// The current key set.
    pub fn keys(&self) -> Arc<KeySet> {
        self.keys.load_full()
    }

    /// The token's `kid`, if the header is readable (used to decide whether to refresh keys).
    pub fn kid_of(token: &str) -> Option<String> {
        parse_header(token).ok().and_then(|h| h.kid)
    }

    /// Checks `token` and returns what it proves.
    pub fn verify(&self, token: &str) -> Result<Identity, AuthError> {
        if token.is_empty() {
            return Err(AuthError::Missing);
        }
        if token.len() > MAX_TOKEN_LEN {
            return Err(AuthError::TooLarge);
        }
        let header = parse_header(token)?;
        let alg = Algorithm::from_str(&header.alg)
            .ok()
            .filter(|alg| self.settings.algorithms.contains(alg))
            .ok_or_else(|| AuthError::AlgorithmNotAllowed(printable(&header.alg)))?;

        let mut validation = Validation::new(alg);
        validation.set_issuer(&[&self.settings.issuer]);
        validation.set_audience(&self.settings.audiences);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.validate_nbf = true;
        validation.leeway = self.settings.leeway.as_secs();

        let keys = self.keys.load();
        let mut result = Err(AuthError::UnknownKey);
        for candidate in keys.candidates(header.kid.as_deref(), alg) {
            result = jsonwebtoken::decode::<Claims>(token, &candidate.key, &validation).map_err(map_error);
            if !matches!(result, Err(AuthError::BadSignature)) {
                break;
            }
        }
        let claims = result?.claims;
        if !self.settings.allowed_subjects.is_empty() && !self.settings.allowed_subjects.contains(&claims.sub) {
            return Err(AuthError::SubjectNotAllowed);
        }
        let node_name = claims.kubernetes.and_then(|k| k.node).map(|n| n.name).filter(|n| !n.is_empty());
        Ok(Identity { subject: claims.sub, expires_at: claims.exp, node_name })
    }
}

fn parse_header(token: &str) -> Result<RawHeader, AuthError> {
    let encoded = token.split('.').next().ok_or(AuthError::Malformed)?;
    if token.split('.').count() != 3 {
        return Err(AuthError::Malformed);
    }
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded.trim_end_matches('='))
        .map_err(|_| AuthError::Malformed)?;
    serde_json::from_slice(&json).map_err(|_| AuthError::Malformed)
}

fn map_error(e: jsonwebtoken::errors::Error) -> AuthError {
    match e.into_kind() {
        ErrorKind::InvalidSignature => AuthError::BadSignature,
        ErrorKind::ExpiredSignature => AuthError::Expired,
        ErrorKind::ImmatureSignature => AuthError::NotYetValid,
        ErrorKind::InvalidAudience => AuthError::WrongAudience,
        ErrorKind::InvalidIssuer => AuthError::WrongIssuer,
        ErrorKind::InvalidSubject => AuthError::SubjectNotAllowed,
        ErrorKind::MissingRequiredClaim(claim) | ErrorKind::InvalidClaimFormat(claim) => {
            AuthError::BadClaim(printable(&claim))
        }
        ErrorKind::InvalidAlgorithm => AuthError::AlgorithmNotAllowed("for this key".into()),
        ErrorKind::Json(_) => AuthError::BadClaim("claims".into()),
        // Key-type mismatches and crypto failures mean the token was not signed by this key.
        ErrorKind::InvalidEcdsaKey
        | ErrorKind::InvalidEddsaKey
        | ErrorKind::InvalidRsaKey(_)
        | ErrorKind::InvalidKeyFormat => AuthError::BadSignature,
        _ => AuthError::Malformed,
    }
}

/// Attacker-controlled text trimmed to something safe to log.
fn printable(s: &str) -> String {
    s.chars().filter(|c| c.is_ascii_graphic()).take(32).collect()
}
