//! Checking an agent's bearer token: a JWT (normally a Kubernetes ServiceAccount token) signed by
//! the tenant's issuer. Every check is explicit: algorithm allow-list, key id, signature, issuer,
//! audience, expiry, not-before, subject. Tokens never appear in errors or logs.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tether_tunnel::untrusted::printable;

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
    /// Until when the token is accepted: `exp` plus the tenant's leeway. The one expiry rule, for
    /// admission (a token is accepted only before this instant) and for a live session (it ends
    /// at this instant unless refreshed), so no session is admitted only to be closed at once.
    pub valid_until: u64,
    /// The node a bound ServiceAccount token was issued for (`kubernetes.io.node.name`).
    pub node_name: Option<String>,
}

/// `exp + leeway`, the end of a token's acceptance (see [`Identity::valid_until`]).
pub fn valid_until(expires_at: u64, leeway: Duration) -> u64 {
    expires_at.saturating_add(leeway.as_secs())
}

/// Refuses a token whose acceptance has ended (`now >= exp + leeway`).
fn check_not_expired(identity: Identity) -> Result<Identity, AuthError> {
    if identity.valid_until <= tether_tunnel::jwt::now_unix() { Err(AuthError::Expired) } else { Ok(identity) }
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

    /// Whether this verifier can accept any token: it asks a TokenReview API, or holds at least
    /// one signing key (a tenant whose keys never loaded refuses every agent).
    pub fn has_keys(&self) -> bool {
        self.review.is_some() || !self.keys.current().is_empty()
    }

    /// The key store.
    pub fn key_store(&self) -> &Arc<KeyStore> {
        &self.keys
    }

    /// Checks `token`; an unknown `kid` refreshes the keys (rate-limited) and tries once more.
    pub async fn verify(&self, token: &str) -> Result<Identity, AuthError> {
        if let Some(review) = &self.review {
            check_shape(token)?;
            let identity = check_not_expired(review.review(token, self.settings.leeway).await?)?;
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

    /// Checks `token` against the cached keys only.
    pub fn verify_cached(&self, token: &str) -> Result<Identity, AuthError> {
        check_shape(token)?;
        let header = parse_header(token)?;
        let alg = Algorithm::from_str(&header.alg)
            .ok()
            .filter(|alg| self.settings.algorithms.contains(alg))
            .ok_or_else(|| AuthError::AlgorithmNotAllowed(printable(&header.alg, 32)))?;

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
        let valid_until = valid_until(claims.exp, self.settings.leeway);
        let identity =
            check_not_expired(Identity { subject: claims.sub, expires_at: claims.exp, valid_until, node_name })?;
        self.check_subject(identity)
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
            AuthError::BadClaim(printable(&claim, 32))
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

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header, encode};
    use tether_tunnel::jwt::now_unix;

    const SECRET: &[u8] = b"a test secret that is long enough";

    fn verifier(leeway: Duration) -> TokenVerifier {
        let keys = KeySet::from_hmac_secret(SECRET).unwrap();
        let settings = VerifierSettings {
            issuer: "https://issuer.test".into(),
            audiences: vec!["tether".into()],
            algorithms: vec![Algorithm::HS256],
            allowed_subjects: HashSet::new(),
            leeway,
        };
        TokenVerifier::new(settings, Arc::new(KeyStore::new(KeySource::Fixed, keys, Duration::from_secs(1))))
    }

    fn token(exp: u64) -> String {
        let claims = serde_json::json!({
            "iss": "https://issuer.test", "aud": "tether", "sub": "system:serviceaccount:kube-system:tether-agent",
            "exp": exp, "iat": exp.saturating_sub(600), "nbf": exp.saturating_sub(600),
        });
        encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(SECRET).unwrap()).unwrap()
    }

    #[tokio::test]
    async fn admission_and_the_session_deadline_follow_one_expiry_rule() {
        let now = now_unix();
        let verifier = verifier(Duration::from_secs(30));
        // Expired 5 s ago, within the 30 s leeway: accepted, and the session may live until
        // exp + leeway - not closed the moment it starts.
        let identity = verifier.verify(&token(now - 5)).await.unwrap();
        assert_eq!(identity.valid_until, now - 5 + 30);
        assert!(identity.valid_until > now_unix());
        // Beyond the leeway: refused as expired, never a session.
        assert_eq!(verifier.verify(&token(now - 40)).await, Err(AuthError::Expired));
        // Without leeway a token at its expiry is refused, not admitted with no time left.
        let strict = super::tests::verifier(Duration::ZERO);
        assert_eq!(strict.verify(&token(now)).await, Err(AuthError::Expired));
        assert!(strict.verify(&token(now + 60)).await.is_ok());
        assert_eq!(AuthError::Expired.status(), 401);
        assert_eq!(AuthError::Expired.label(), "expired");
    }
}
