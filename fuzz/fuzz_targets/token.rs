//! Agent tokens before and after the signature check: the raw string an agent presents (shape,
//! size, header decoding, algorithm choice), and, structure-aware, arbitrary header and claims
//! JSON under a valid HMAC signature, so the claims decoding and checks behind the signature are
//! reached too. The agent's own unverified reading of `exp` and the JWKS parser are covered here as
//! well.
#![no_main]

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use arbitrary::Arbitrary;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::{Algorithm, EncodingKey};
use libfuzzer_sys::fuzz_target;
use tether_gateway::auth::key_store::{KeySource, KeyStore};
use tether_gateway::auth::keys::KeySet;
use tether_gateway::auth::token::{MAX_TOKEN_LEN, TokenVerifier, VerifierSettings};

const SECRET: &[u8] = b"fuzzing-secret-fuzzing-secret-fuzzing-secret";

#[derive(Arbitrary, Debug)]
enum Input<'a> {
    /// The bearer token as sent.
    Raw(&'a str),
    /// Header and claims JSON (arbitrary bytes), signed with the tenant's HMAC key.
    Signed { header: &'a [u8], claims: &'a [u8], alg: u8 },
    /// Claims from parts the fuzzer chooses, with a valid header and signature.
    Claims { sub: &'a str, exp: u64, iss: bool, aud: u8, node: Option<&'a str>, extra: &'a str },
    /// A JWKS document from an issuer.
    Jwks(&'a [u8]),
}

fn verifier() -> TokenVerifier {
    let keys = match KeySet::from_hmac_secret(SECRET) {
        Ok(keys) => keys,
        Err(e) => panic!("the fuzz key: {e}"),
    };
    let settings = VerifierSettings {
        issuer: "https://issuer.fuzz".into(),
        audiences: vec!["tether".into()],
        algorithms: vec![Algorithm::HS256, Algorithm::HS384, Algorithm::RS256],
        allowed_subjects: HashSet::new(),
        leeway: Duration::from_secs(60),
    };
    TokenVerifier::new(settings, Arc::new(KeyStore::new(KeySource::Fixed, keys, Duration::MAX)))
}

fn sign(header: &[u8], claims: &[u8], alg: Algorithm) -> String {
    let message = format!("{}.{}", URL_SAFE_NO_PAD.encode(header), URL_SAFE_NO_PAD.encode(claims));
    let key = match EncodingKey::from_secret(SECRET) {
        Ok(key) => key,
        Err(e) => panic!("the fuzz key: {e}"),
    };
    let signature = match jsonwebtoken::crypto::sign(message.as_bytes(), &key, alg) {
        Ok(s) => s,
        Err(e) => panic!("signing: {e}"),
    };
    format!("{message}.{signature}")
}

fuzz_target!(|input: Input| {
    let verifier = verifier();
    match input {
        Input::Raw(token) => {
            let _ = tether_tunnel::jwt::unverified_expiry(token);
            let result = verifier.verify_cached(token);
            if token.len() > MAX_TOKEN_LEN {
                assert!(result.is_err());
            }
            // Nobody but the key holder signs: a raw token is accepted only if it is one of ours.
            if let Ok(identity) = result {
                panic!("an unsigned token was accepted: {identity:?}");
            }
        }
        Input::Signed { header, claims, alg } => {
            let alg = [Algorithm::HS256, Algorithm::HS384, Algorithm::HS512][usize::from(alg % 3)];
            let token = sign(header, claims, alg);
            let _ = tether_tunnel::jwt::unverified_expiry(&token);
            if let Ok(identity) = verifier.verify_cached(&token) {
                // Accepted tokens carry this tenant's issuer and audience and are unexpired.
                let text = String::from_utf8_lossy(claims);
                assert!(text.contains("https://issuer.fuzz") || text.contains('\\'), "issuer not checked");
                assert!(identity.valid_until > tether_tunnel::jwt::now_unix());
                assert!(alg != Algorithm::HS512, "an algorithm the tenant does not allow was accepted");
            }
        }
        Input::Claims { sub, exp, iss, aud, node, extra } => {
            let mut claims = serde_json::json!({
                "sub": sub,
                "exp": exp,
                "iss": if iss { "https://issuer.fuzz" } else { extra },
                "aud": match aud % 3 { 0 => serde_json::json!("tether"), 1 => serde_json::json!([extra, "tether"]), _ => serde_json::json!(extra) },
            });
            if let Some(node) = node {
                claims["kubernetes.io"] = serde_json::json!({ "node": { "name": node } });
            }
            let header = br#"{"alg":"HS256","typ":"JWT"}"#;
            let token = sign(header, claims.to_string().as_bytes(), Algorithm::HS256);
            // The agent reads `exp` from payloads up to 16 KiB (its tokens are a few hundred bytes).
            if token.split('.').nth(1).is_some_and(|p| p.len() <= 16 * 1024) {
                assert_eq!(tether_tunnel::jwt::unverified_expiry(&token), Some(exp));
            }
            if let Ok(identity) = verifier.verify_cached(&token) {
                assert!(iss || extra == "https://issuer.fuzz", "a token from another issuer was accepted");
                assert_eq!(identity.subject, sub);
                assert_eq!(identity.node_name.as_deref(), node.filter(|n| !n.is_empty()));
            }
        }
        Input::Jwks(json) => {
            if let Ok(keys) = KeySet::from_jwks(json) {
                let _ = keys.len();
            }
        }
    }
});
