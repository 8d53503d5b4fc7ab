//! TLS helpers: rustls with the aws-lc-rs provider (the faster of aws-lc's and ring's AES-GCM for
//! records), PEM loading with errors that name the file, a server certificate that can be
//! reloaded without a restart, and client configurations.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// ALPN protocol id for HTTP/1.1; WebSocket upgrades need HTTP/1.1, so ingresses must not pick h2.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// What went wrong setting up TLS; always names the file involved.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("cannot read {what} from {path}: {reason}")]
    Pem {
        /// What was expected in the file.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        reason: String,
    },
    /// The certificate and key do not form a usable pair.
    #[error("certificate {cert} with key {key} is unusable: {reason}")]
    KeyPair {
        /// Certificate file.
        cert: PathBuf,
        /// Key file.
        key: PathBuf,
        /// Why.
        reason: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration error: {0}")]
    Config(String),
}

/// The crypto provider used everywhere: aws-lc-rs, with the AES-GCM record cipher taken from
/// whichever of aws-lc and ring is the faster on this CPU.
///
/// Key exchange (including the post-quantum hybrid), signatures, certificate checks and the
/// choice and order of suites are aws-lc-rs's defaults. Only the record protection of the
/// AES-GCM suites (a fifth of a tunnel process's CPU under bulk traffic) may come from ring:
/// on CPUs with VAES but without AVX-512, ring's VAES/AVX2 code seals and opens records in
/// about half aws-lc's time; with AVX-512 (and VAES, VPCLMULQDQ) aws-lc's own code is the
/// faster by about a seventh (docs/benchmarks.md, "The record cipher"). Without VAES both run
/// the same AES-NI code. The bytes on the wire are the same either way.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(tether_provider())
}

fn tether_provider() -> CryptoProvider {
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    if !aws_lc_has_avx512_gcm() {
        for suite in &mut provider.cipher_suites {
            if let Some(faster) = ring_aes_gcm(suite.suite()) {
                *suite = faster;
            }
        }
    }
    provider
}

/// Whether aws-lc uses its AVX-512 AES-GCM on this CPU (it checks for exactly these features),
/// the one case where its records are faster than ring's.
fn aws_lc_has_avx512_gcm() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("vaes")
            && std::arch::is_x86_feature_detected!("vpclmulqdq")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// ring's implementation of an AES-GCM suite, by its id; `None` for every other suite.
fn ring_aes_gcm(id: rustls::CipherSuite) -> Option<rustls::SupportedCipherSuite> {
    use rustls::CipherSuite as Id;
    match id {
        Id::TLS13_AES_128_GCM_SHA256
        | Id::TLS13_AES_256_GCM_SHA384
        | Id::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        | Id::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
        | Id::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
        | Id::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => {
            rustls::crypto::ring::ALL_CIPHER_SUITES.iter().find(|s| s.suite() == id).copied()
        }
        _ => None,
    }
}

/// Installs Tether's provider (see [`provider`]) as the process default (harmless if one is
/// already installed). rustls is built with two providers, so code that builds a configuration
/// without naming one needs this first.
pub fn install_default_provider() {
    let _ = tether_provider().install_default();
}

/// Reads every certificate in a PEM file.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_error = |reason: String| TlsError::Pem { what: "certificates", path: path.to_owned(), reason };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_error(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem_error("no CERTIFICATE block found".into()));
    }
    Ok(certs)
}

/// Reads the first private key (PKCS#8, PKCS#1 or SEC1) in a PEM file.
pub fn load_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Pem {
        what: "a private key",
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// Builds a root store from a PEM bundle.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|e| TlsError::Pem {
            what: "CA certificates",
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// A server certificate and key read from files, swappable at run time (certificate rotation).
pub struct ReloadableCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: ArcSwap<CertifiedKey>,
}

impl fmt::Debug for ReloadableCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadableCert").field("cert", &self.cert_path).field("key", &self.key_path).finish()
    }
}

impl ReloadableCert {
    /// Loads the pair once; fails if either file is missing or they do not match.
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Arc<Self>, TlsError> {
        let key = certified_key(cert_path, key_path)?;
        Ok(Arc::new(Self {
            cert_path: cert_path.to_owned(),
            key_path: key_path.to_owned(),
            current: ArcSwap::from_pointee(key),
        }))
    }

    /// Re-reads the files; on error the previous certificate stays in use.
    pub fn reload(&self) -> Result<(), TlsError> {
        let key = certified_key(&self.cert_path, &self.key_path)?;
        self.current.store(Arc::new(key));
        Ok(())
    }

    /// The certificate and key files.
    pub fn files(&self) -> [&Path; 2] {
        [&self.cert_path, &self.key_path]
    }

    /// The certificate chain now in use.
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.current.load().cert.clone()
    }
}

impl ResolvesServerCert for ReloadableCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

fn certified_key(cert_path: &Path, key_path: &Path) -> Result<CertifiedKey, TlsError> {
    let certs = load_certs(cert_path)?;
    let key = load_private_key(key_path)?;
    let key_pair_error =
        |reason: String| TlsError::KeyPair { cert: cert_path.to_owned(), key: key_path.to_owned(), reason };
    let certified = CertifiedKey::from_der(certs, key, &provider()).map_err(|e| key_pair_error(e.to_string()))?;
    Ok(certified)
}

/// A server configuration with the given certificate source; with `client_ca`, clients must
/// present a certificate signed by it (mutual TLS).
pub fn server_config(
    cert: Arc<dyn ResolvesServerCert>,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
) -> Result<ServerConfig, TlsError> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match client_ca {
        Some(ca) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(load_roots(ca)?), provider())
                .build()
                .map_err(|e| TlsError::Config(format!("client CA {}: {e}", ca.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(cert);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// Where a client takes its trusted roots from.
#[derive(Debug, Clone, Default)]
pub struct ClientRoots {
    /// A PEM bundle of CAs to trust.
    pub ca_file: Option<PathBuf>,
    /// Also trust the operating system's roots (on top of `ca_file`, or alone).
    pub system_roots: bool,
}

/// A client configuration trusting `roots`, optionally presenting a client certificate.
pub fn client_config(
    roots: &ClientRoots,
    client_cert: Option<(&Path, &Path)>,
    alpn: &[&[u8]],
) -> Result<ClientConfig, TlsError> {
    let mut store = RootCertStore::empty();
    if let Some(ca) = &roots.ca_file {
        store = load_roots(ca)?;
    }
    if roots.system_roots {
        let native = rustls_native_certs::load_native_certs();
        for cert in native.certs {
            // Individual unusable system certificates are skipped, as browsers and curl do.
            let _ = store.add(cert);
        }
    }
    if store.is_empty() {
        return Err(TlsError::Config(
            "no trusted CA certificates: set a CA bundle file or enable the system roots".into(),
        ));
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(store);
    let mut config = match client_cert {
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_private_key(key)?)
            .map_err(|e| TlsError::KeyPair { cert: cert.to_owned(), key: key.to_owned(), reason: e.to_string() })?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aead(suite: &rustls::SupportedCipherSuite) -> *const () {
        match suite {
            rustls::SupportedCipherSuite::Tls13(s) => std::ptr::from_ref(s.aead_alg).cast(),
            rustls::SupportedCipherSuite::Tls12(s) => std::ptr::from_ref(s.aead_alg).cast(),
        }
    }

    /// What the kernel says of the CPU (`/proc/cpuinfo`), independently of the standard library's
    /// detection: whether aws-lc will use its AVX-512 AES-GCM here.
    fn cpuinfo_has_aws_lc_avx512_gcm() -> bool {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else { return false };
        let Some(flags) = info.lines().find(|l| l.starts_with("flags")) else { return false };
        let flags: Vec<&str> = flags.split_whitespace().collect();
        cfg!(target_arch = "x86_64")
            && ["avx512f", "avx512dq", "avx512bw", "avx512vl", "vaes", "vpclmulqdq"].iter().all(|f| flags.contains(f))
    }

    #[test]
    fn aes_gcm_records_come_from_the_faster_crate_and_all_else_from_aws_lc() {
        let ours = provider();
        let aws = rustls::crypto::aws_lc_rs::default_provider();
        let ring = rustls::crypto::ring::default_provider();
        let (faster, name) = if cpuinfo_has_aws_lc_avx512_gcm() { (&aws, "aws-lc-rs's") } else { (&ring, "ring's") };
        // The same suites in the same order as aws-lc-rs's defaults.
        let ids = |p: &CryptoProvider| p.cipher_suites.iter().map(|s| s.suite()).collect::<Vec<_>>();
        assert_eq!(ids(&ours), ids(&aws));
        let mut swapped = 0;
        for suite in &ours.cipher_suites {
            let from = |p: &CryptoProvider| p.cipher_suites.iter().find(|s| s.suite() == suite.suite()).map(aead);
            if format!("{:?}", suite.suite()).contains("AES") {
                assert_eq!(Some(aead(suite)), from(faster), "{:?} should be {name} on this CPU", suite.suite());
                swapped += 1;
            } else {
                assert_eq!(Some(aead(suite)), from(&aws), "{:?} should be aws-lc-rs's", suite.suite());
            }
        }
        assert!(swapped >= 2, "the TLS 1.3 AES-GCM suites are among the defaults");
        // Key exchange (with the post-quantum hybrid ring lacks) and signatures stay aws-lc-rs's.
        let groups = |p: &CryptoProvider| p.kx_groups.iter().map(|g| g.name()).collect::<Vec<_>>();
        assert_eq!(groups(&ours), groups(&aws));
        assert!(groups(&ours).contains(&rustls::NamedGroup::X25519MLKEM768));
        assert_eq!(
            format!("{:?}", ours.signature_verification_algorithms),
            format!("{:?}", aws.signature_verification_algorithms)
        );
    }
}
