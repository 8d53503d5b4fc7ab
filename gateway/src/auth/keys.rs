//! An issuer's public keys, parsed from a JWKS document once and kept ready for verification.

use std::path::Path;

use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey};

/// One usable verification key.
pub struct VerificationKey {
    /// The key id (`kid`), when the JWKS names one.
    pub kid: Option<String>,
    /// The algorithm the JWKS pins the key to, if any.
    pub alg: Option<Algorithm>,
    /// The key's family (RSA, EC, Ed).
    pub family: AlgorithmFamily,
    /// The key itself.
    pub key: DecodingKey,
}

/// The keys of one issuer.
#[derive(Default)]
pub struct KeySet {
    keys: Vec<VerificationKey>,
}

/// Why a key set could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Not a JWKS document.
    #[error("not a JWKS document: {0}")]
    NotJwks(String),
    /// A key in the document cannot be used.
    #[error("key {kid:?} is unusable: {reason}")]
    Unusable {
        /// Its `kid`, or "(no kid)".
        kid: String,
        /// Why.
        reason: String,
    },
    /// An HMAC secret shorter than 32 bytes.
    #[error("an HMAC secret must be at least 32 bytes")]
    ShortSecret,
    /// The secret could not be used.
    #[error("the HMAC secret is unusable: {0}")]
    Secret(String),
    /// A JWKS file could not be read or parsed.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
}

impl KeySet {
    /// Parses a JWKS document. Keys of unsupported types are skipped; symmetric (`oct`) keys are
    /// refused, because a public document must never hold a shared secret.
    pub fn from_jwks(json: &[u8]) -> Result<Self, KeyError> {
        let set: JwkSet = serde_json::from_slice(json).map_err(|e| KeyError::NotJwks(e.to_string()))?;
        let mut keys = Vec::new();
        for jwk in &set.keys {
            let family = match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => AlgorithmFamily::Rsa,
                AlgorithmParameters::EllipticCurve(_) => AlgorithmFamily::Ec,
                AlgorithmParameters::OctetKeyPair(_) => AlgorithmFamily::Ed,
                _ => continue,
            };
            let key = DecodingKey::from_jwk(jwk).map_err(|e| KeyError::Unusable {
                kid: jwk.common.key_id.clone().unwrap_or_else(|| "(no kid)".into()),
                reason: e.to_string(),
            })?;
            // A key pinned to an algorithm we cannot verify with (e.g. RSA-OAEP) is an encryption
            // key: leave it out rather than let it verify anything.
            let alg = match jwk.common.key_algorithm {
                Some(a) => match Algorithm::try_from(a) {
                    Ok(alg) => Some(alg),
                    Err(_) => continue,
                },
                None => None,
            };
            keys.push(VerificationKey { kid: jwk.common.key_id.clone(), alg, family, key });
        }
        Ok(Self { keys })
    }

    /// A key set holding one shared HMAC secret (only for tenants that configure one).
    pub fn from_hmac_secret(secret: &[u8]) -> Result<Self, KeyError> {
        if secret.len() < 32 {
            return Err(KeyError::ShortSecret);
        }
        let key = DecodingKey::from_secret(secret).map_err(|e| KeyError::Secret(e.to_string()))?;
        Ok(Self { keys: vec![VerificationKey { kid: None, alg: None, family: AlgorithmFamily::Hmac, key }] })
    }

    /// Reads a JWKS file.
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let file_error = |reason: String| KeyError::File { path: path.display().to_string(), reason };
        let bytes = std::fs::read(path).map_err(|e| file_error(format!("cannot read: {e}")))?;
        Self::from_jwks(&bytes).map_err(|e| file_error(e.to_string()))
    }

    /// Keys that may verify a token with this `kid` and algorithm. Without a `kid`, every key of
    /// the algorithm's family is a candidate.
    pub fn candidates<'a>(
        &'a self,
        kid: Option<&'a str>,
        alg: Algorithm,
    ) -> impl Iterator<Item = &'a VerificationKey> + 'a {
        let family = alg.family();
        self.keys.iter().filter(move |k| {
            k.family == family && k.alg.is_none_or(|a| a == alg) && kid.is_none_or(|kid| k.kid.as_deref() == Some(kid))
        })
    }

    /// Number of usable keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether there are no usable keys.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}
