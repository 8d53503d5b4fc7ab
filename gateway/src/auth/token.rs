//! Checking an agent's bearer token: a JWT (normally a Kubernetes ServiceAccount token) signed by
//! the tenant's issuer. Every check is explicit: algorithm allow-list, key id, signature, issuer,
//! audience, expiry, not-before, subject. Tokens never appear in errors or logs.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};
use serde::Deserialize;

use super::key_store::{KeySource, KeyStore};
use super::keys::KeySet;
use super::token_review::TokenReviewer;

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
    /// The tenant's kube-apiserver did not authenticate the token (TokenReview).
    #[error("token review rejected the token")]
    ReviewRejected,
    /// The tenant's kube-apiserver could not be asked (TokenReview); retry later.
    #[error("token review unavailable")]
    Unavailable,
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
            Self::ReviewRejected => "review_rejected",
            Self::Unavailable => "unavailable",
        }
    }

    /// The HTTP status an agent gets: 503 when the check could not be made, else 401.
    pub fn status(&self) -> u16 {
        if matches!(self, Self::Unavailable) { 503 } else { 401 }
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

/// Verifies tokens of one tenant: locally against the issuer's keys, or by asking the tenant's
/// kube-apiserver (TokenReview).
pub struct TokenVerifier {
    settings: VerifierSettings,
    keys: Arc<KeyStore>,
    review: Option<TokenReviewer>,
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
    /// A verifier checking signatures locally with `keys`.
    pub fn new(settings: VerifierSettings, keys: Arc<KeyStore>) -> Self {
        Self { settings, keys, review: None }
    }

    /// A verifier that asks the tenant's kube-apiserver (TokenReview) instead of checking locally.
    pub fn with_token_review(settings: VerifierSettings, review: TokenReviewer) -> Self {
        let keys = Arc::new(KeyStore::new(KeySource::Fixed, KeySet::default(), Duration::MAX));
        Self { settings, keys, review: Some(review) }
    }

    /// The key store.
    pub fn key_store(&self) -> &Arc<KeyStore> {
        &self.keys
    }

    /// Checks `token`; an unknown `kid` refreshes the keys (rate-limited) and tries once more.
    pub async fn verify(&self, token: &str) -> Result<Identity, AuthError> {
        if let Some(review) = &self.review {
            check_shape(token)?;
            let identity = review.review(token).await?;
            return self.check_subject(identity);
        }
        match self.verify_cached(token) {
            Err(AuthError::UnknownKey) if self.keys.refresh_if_due().await => self.verify_cached(token),
            other => other,
        }
    }

    fn check_subject(&self, identity: Identity) -> Result<Identity, AuthError> {
        if !self.settings.allowed_subjects.is_empty() && !self.settings.allowed_subjects.contains(&identity.subject) {
            return Err(AuthError::SubjectNotAllowed);
        }
        Ok(identity)
    }

    /// The token's `kid`, if the header is readable (used to decide whether to refresh keys).
    pub fn kid_of(token: &str) -> Option<String> {
        parse_header(token).ok().and_then(|h| h.kid)
    }

    /// Checks `token` against the cached keys only.
    pub fn verify_cached(&self, token: &str) -> Result<Identity, AuthError> {
        check_shape(token)?;
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

        let keys = self.keys.current();
        let mut result = Err(AuthError::UnknownKey);
        for candidate in keys.candidates(header.kid.as_deref(), alg) {
            result = jsonwebtoken::decode::<Claims>(token, &candidate.key, &validation).map_err(map_error);
            if !matches!(result, Err(AuthError::BadSignature)) {
                break;
            }
        }
        let claims = result?.claims;
        let node_name = claims.kubernetes.and_then(|k| k.node).map(|n| n.name).filter(|n| !n.is_empty());
        self.check_subject(Identity { subject: claims.sub, expires_at: claims.exp, node_name })
    }
}

fn check_shape(token: &str) -> Result<(), AuthError> {
    if token.is_empty() {
        return Err(AuthError::Missing);
    }
    if token.len() > MAX_TOKEN_LEN {
        return Err(AuthError::TooLarge);
    }
    Ok(())
}

/// The `exp` claim of a token whose authenticity was established elsewhere (TokenReview).
pub fn unverified_expiry(token: &str) -> Option<u64> {
    #[derive(Deserialize)]
    struct Exp {
        exp: u64,
    }
    let payload = token.split('.').nth(1)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')).ok()?;
    serde_json::from_slice::<Exp>(&json).ok().map(|e| e.exp)
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
