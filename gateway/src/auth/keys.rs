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

impl KeySet {
    /// Parses a JWKS document. Keys of unsupported types are skipped; symmetric (`oct`) keys are
    /// refused, because a public document must never hold a shared secret.
    pub fn from_jwks(json: &[u8]) -> Result<Self, String> {
        let set: JwkSet = serde_json::from_slice(json).map_err(|e| format!("not a JWKS document: {e}"))?;
        let mut keys = Vec::new();
        for jwk in &set.keys {
            let family = match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => AlgorithmFamily::Rsa,
                AlgorithmParameters::EllipticCurve(_) => AlgorithmFamily::Ec,
                AlgorithmParameters::OctetKeyPair(_) => AlgorithmFamily::Ed,
                _ => continue,
            };
            let key = DecodingKey::from_jwk(jwk).map_err(|e| {
                format!("key {:?} is unusable: {e}", jwk.common.key_id.as_deref().unwrap_or("(no kid)"))
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
    pub fn from_hmac_secret(secret: &[u8]) -> Result<Self, String> {
        if secret.len() < 32 {
            return Err("an HMAC secret must be at least 32 bytes".into());
        }
        let key = DecodingKey::from_secret(secret).map_err(|e| e.to_string())?;
        Ok(Self { keys: vec![VerificationKey { kid: None, alg: None, family: AlgorithmFamily::Hmac, key }] })
    }

    /// Reads a JWKS file.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::from_jwks(&bytes).map_err(|e| format!("{}: {e}", path.display()))
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

    /// Whether a key with this id is present.
    pub fn has_kid(&self, kid: &str) -> bool {
        self.keys.iter().any(|k| k.kid.as_deref() == Some(kid))
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
