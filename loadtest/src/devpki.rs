//! Development PKI and token issuer: a CA, server and client certificates, and a JWT issuer with
//! a JWKS file, all generated on the spot. For the demo, tests and load tests; never production.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use serde::Serialize;

/// A certificate and key written to PEM files.
#[derive(Debug, Clone)]
pub struct PemPair {
    /// Certificate chain file.
    pub cert: PathBuf,
    /// Private key file.
    pub key: PathBuf,
}

/// A throwaway certificate authority that writes everything it issues into one directory.
pub struct DevCa {
    dir: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// The CA certificate (trust anchor) file.
    pub ca_cert: PathBuf,
}

impl DevCa {
    /// Creates a CA named `name` in `dir`.
    pub fn create(dir: &Path, name: &str) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let ca_cert = dir.join(format!("{name}-ca.crt"));
        std::fs::write(&ca_cert, issuer.pem())?;
        Ok(Self { dir: dir.to_owned(), issuer, ca_cert })
    }

    /// Issues a server certificate for DNS names and IP addresses.
    pub fn server(&self, file_stem: &str, names: &[&str]) -> anyhow::Result<PemPair> {
        self.issue(file_stem, names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// Issues a client certificate with `common_name`.
    pub fn client(&self, file_stem: &str, common_name: &str) -> anyhow::Result<PemPair> {
        self.issue(file_stem, &[common_name], ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// Issues a certificate usable as server and as client (gateway replicas talking to peers).
    pub fn peer(&self, file_stem: &str, names: &[&str]) -> anyhow::Result<PemPair> {
        self.issue_for(file_stem, names, vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth])
    }

    fn issue(&self, file_stem: &str, names: &[&str], usage: ExtendedKeyUsagePurpose) -> anyhow::Result<PemPair> {
        self.issue_for(file_stem, names, vec![usage])
    }

    fn issue_for(
        &self,
        file_stem: &str,
        names: &[&str],
        usages: Vec<ExtendedKeyUsagePurpose>,
    ) -> anyhow::Result<PemPair> {
        let mut params = CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())?;
        params.distinguished_name.push(DnType::CommonName, names.first().copied().unwrap_or(file_stem));
        params.extended_key_usages = usages;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let pair =
            PemPair { cert: self.dir.join(format!("{file_stem}.crt")), key: self.dir.join(format!("{file_stem}.key")) };
        std::fs::write(&pair.cert, cert.pem())?;
        write_private(&pair.key, key.serialize_pem().as_bytes())?;
        Ok(pair)
    }
}

/// Signature algorithm of a [`DevIssuer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IssuerKey {
    /// ECDSA P-256 (fast; the default).
    Es256,
    /// RSA 2048 (what kube-apiserver uses by default).
    Rs256,
}

/// A JWT issuer with its JWKS written to a file, minting Kubernetes-shaped tokens.
pub struct DevIssuer {
    /// The `iss` claim.
    pub issuer: String,
    /// The JWKS file for the gateway's `auth.jwks_file`.
    pub jwks_file: PathBuf,
    /// The key id.
    pub kid: String,
    /// The algorithm.
    pub algorithm: Algorithm,
    key: EncodingKey,
    /// The public key as a JWK (for building other JWKS documents in tests).
    pub jwk: Jwk,
    /// The private key PEM (for tests that need to forge with it).
    pub private_pem: String,
}

/// Claims of a ServiceAccount-shaped token.
#[derive(Debug, Clone, Serialize)]
pub struct TokenClaims {
    /// Issuer.
    pub iss: String,
    /// Subject.
    pub sub: String,
    /// Audiences.
    pub aud: Vec<String>,
    /// Expiry (Unix seconds).
    pub exp: u64,
    /// Issued at.
    pub iat: u64,
    /// Not before.
    pub nbf: u64,
    /// The `kubernetes.io` claim of bound tokens.
    #[serde(rename = "kubernetes.io", skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<serde_json::Value>,
}

impl DevIssuer {
    /// Creates an issuer; its JWKS goes to `<dir>/<stem>-jwks.json`.
    pub fn create(dir: &Path, stem: &str, issuer: &str, kind: IssuerKey) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let (key_pair, algorithm) = match kind {
            IssuerKey::Es256 => (KeyPair::generate()?, Algorithm::ES256),
            IssuerKey::Rs256 => {
                (KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_2048)?, Algorithm::RS256)
            }
        };
        let private_pem = key_pair.serialize_pem();
        let key = match kind {
            IssuerKey::Es256 => EncodingKey::from_ec_pem(private_pem.as_bytes()),
            IssuerKey::Rs256 => EncodingKey::from_rsa_pem(private_pem.as_bytes()),
        }
        .context("dev issuer key")?;
        let kid = format!("{stem}-{:08x}", fastrand::u32(..));
        let mut jwk = Jwk::from_encoding_key(&key, algorithm).context("dev issuer JWK")?;
        jwk.common.key_id = Some(kid.clone());
        let jwks_file = dir.join(format!("{stem}-jwks.json"));
        std::fs::write(&jwks_file, serde_json::to_vec_pretty(&JwkSet { keys: vec![jwk.clone()] })?)?;
        Ok(Self { issuer: issuer.to_owned(), jwks_file, kid, algorithm, key, jwk, private_pem })
    }

    /// Signs arbitrary claims with this issuer's key and kid.
    pub fn sign<T: Serialize>(&self, claims: &T) -> anyhow::Result<String> {
        let mut header = Header::new(self.algorithm);
        header.kid = Some(self.kid.clone());
        Ok(jsonwebtoken::encode(&header, claims, &self.key)?)
    }

    /// Claims for a ServiceAccount token valid for `ttl` from now.
    pub fn claims(&self, namespace: &str, name: &str, audience: &str, ttl: Duration) -> TokenClaims {
        let now = now();
        TokenClaims {
            iss: self.issuer.clone(),
            sub: format!("system:serviceaccount:{namespace}:{name}"),
            aud: vec![audience.to_owned()],
            exp: now + ttl.as_secs(),
            iat: now,
            nbf: now.saturating_sub(1),
            kubernetes: Some(serde_json::json!({
                "namespace": namespace,
                "serviceaccount": { "name": name, "uid": "00000000-0000-0000-0000-000000000001" },
            })),
        }
    }

    /// A ServiceAccount token, optionally bound to a node (`kubernetes.io.node.name`).
    pub fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
        audience: &str,
        ttl: Duration,
        node: Option<&str>,
    ) -> anyhow::Result<String> {
        let mut claims = self.claims(namespace, name, audience, ttl);
        if let (Some(node), Some(k8s)) = (node, claims.kubernetes.as_mut()) {
            k8s["node"] = serde_json::json!({ "name": node, "uid": "00000000-0000-0000-0000-000000000002" });
        }
        self.sign(&claims)
    }
}

/// Seconds since the Unix epoch.
pub fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()
}

/// Writes a secret file readable only by its owner.
pub fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    file.write_all(bytes)?;
    Ok(())
}
