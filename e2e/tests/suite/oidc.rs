//! Tenant auth against a real OIDC issuer (nginx serving the discovery document and JWKS over
//! TLS from files), with the real gateway binary: the bad-token matrix, issuer outages, key
//! rotation, and no token ever in a log line.

use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use tether_e2e::bins::{Process, free_port, http_get, metric_sum, wait_ready};
use tether_e2e::nginx::{Nginx, wait_listening};
use tether_loadtest::devpki::{DevCa, DevIssuer, IssuerKey, now};
use tether_loadtest::local::{AUDIENCE, ScratchDir};
use tether_tunnel::client::{self, ClientSettings, ConnectError};

struct Issuer {
    dir: std::path::PathBuf,
    addr: SocketAddr,
    cert: tether_loadtest::devpki::PemPair,
    url: String,
}

impl Issuer {
    /// Writes the discovery document and `keys` as the JWKS, and serves them with nginx.
    fn serve(&self, keys: &[&DevIssuer]) -> Nginx {
        let www = self.dir.join("www");
        std::fs::create_dir_all(www.join(".well-known")).unwrap();
        std::fs::create_dir_all(www.join("openid/v1")).unwrap();
        let discovery = serde_json::json!({
            "issuer": self.url,
            "jwks_uri": format!("{}/openid/v1/jwks", self.url),
            "response_types_supported": ["id_token"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
        });
        std::fs::write(www.join(".well-known/openid-configuration"), discovery.to_string()).unwrap();
        let set = JwkSet { keys: keys.iter().map(|k| k.jwk.clone()).collect() };
        std::fs::write(www.join("openid/v1/jwks"), serde_json::to_vec(&set).unwrap()).unwrap();
        Nginx::start(
            &self.dir.join("nginx"),
            &format!(
                "http {{\n{}\nserver {{\n listen {} ssl;\n ssl_certificate {};\n ssl_certificate_key {};\n root {};\n default_type application/json;\n}}\n}}",
                Nginx::http_preamble(),
                self.addr,
                self.cert.cert.display(),
                self.cert.key.display(),
                www.display()
            ),
            None,
        )
    }
}

fn settings(agents: SocketAddr, ca: &std::path::Path, host: &str) -> ClientSettings {
    let roots = tether_tunnel::tls::ClientRoots { ca_file: Some(ca.to_owned()), system_roots: false };
    let tls = tether_tunnel::tls::client_config(&roots, None, &[tether_tunnel::tls::ALPN_HTTP11]).unwrap();
    ClientSettings {
        url: format!("wss://{agents}/v1/tunnel").parse().unwrap(),
        tls: Some(std::sync::Arc::new(tls)),
        tls_server_name: Some(host.into()),
        connect_timeout: Duration::from_secs(5),
        handshake_timeout: Duration::from_secs(10),
        ws: tether_tunnel::ws::WsSettings::default(),
        user_agent: "tether-test".into(),
        proxy: None,
    }
}

async fn outcome(settings: &ClientSettings, token: Option<&str>) -> Result<(), (u16, String)> {
    match client::connect(settings, token).await {
        Ok(_) => Ok(()),
        Err(ConnectError::Rejected { status, reason, .. }) => Err((status, reason)),
        Err(e) => Err((0, e.to_string())),
    }
}

fn b64(json: &serde_json::Value) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_discovery_bad_tokens_outages_and_key_rotation() {
    let dir = ScratchDir::new("tether-oidc").unwrap();
    let ca = DevCa::create(dir.path(), "oidc").unwrap();
    let ip = format!("127.0.{}.{}", fastrand::u8(1..250), fastrand::u8(1..250));
    let addr: SocketAddr = format!("{ip}:{}", free_port()).parse().unwrap();
    let issuer = Issuer {
        dir: dir.path().join("issuer"),
        addr,
        cert: ca.server("issuer", &[&ip]).unwrap(),
        url: format!("https://{addr}"),
    };
    // The tenant's KAS signs with RSA, as kube-apiserver does by default.
    let first_key = DevIssuer::create(dir.path(), "kas-1", &issuer.url, IssuerKey::Rs256).unwrap();
    let other = DevIssuer::create(dir.path(), "other", "https://other.issuer.local", IssuerKey::Rs256).unwrap();
    let mut nginx = issuer.serve(&[&first_key]);
    assert!(wait_listening(addr, Duration::from_secs(10)).await, "nginx did not start");

    let gateway_cert = ca.server("gateway", &["oidc.tether.local", "other.tether.local"]).unwrap();
    let agents = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let config = serde_json::json!({
        "listen": { "agents": agents.to_string(), "admin": admin.to_string() },
        "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
        "tenants": [
            {
                "name": "oidc",
                "hosts": ["oidc.tether.local"],
                "auth": {
                    "issuer": issuer.url,
                    "audiences": [AUDIENCE],
                    "algorithms": ["RS256"],
                    "oidc_discovery": true,
                    "fetch": { "ca_file": ca.ca_cert, "min_refresh_interval": "1s" },
                    "leeway": "5s",
                },
                "frontend": { "uds": dir.path().join("oidc.sock") },
            },
            {
                "name": "other",
                "hosts": ["other.tether.local"],
                "auth": { "issuer": other.issuer, "audiences": [AUDIENCE], "jwks_file": other.jwks_file, "algorithms": ["RS256"] },
                "frontend": { "uds": dir.path().join("other.sock") },
            },
        ],
    });
    let file = dir.path().join("gateway.yaml");
    std::fs::write(&file, config.to_string()).unwrap();
    let gateway =
        Process::spawn("tether-gateway", &["-c", file.to_str().unwrap()], &[], dir.path(), "gateway").unwrap();
    assert!(wait_ready(admin, "/readyz", Duration::from_secs(20)).await, "{}", gateway.log_text());
    let oidc = settings(agents, &ca.ca_cert, "oidc.tether.local");

    // A bound ServiceAccount token from the real issuer is accepted.
    let good = first_key
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600), Some("node-1"))
        .unwrap();
    assert_eq!(outcome(&oidc, Some(&good)).await, Ok(()));

    // The bad-token matrix: every one is refused with 401 before any upgrade, under its reason.
    let claims = || first_key.claims("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600));
    let mut expired = claims();
    (expired.exp, expired.iat, expired.nbf) = (now() - 3600, now() - 7200, now() - 7200);
    let mut not_yet = claims();
    (not_yet.nbf, not_yet.exp) = (now() + 3600, now() + 7200);
    let mut wrong_audience = claims();
    wrong_audience.aud = vec!["kubernetes".into()];
    let mut wrong_issuer = claims();
    wrong_issuer.iss = "https://evil.example.com".into();
    let other_tenant =
        other.service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600), None).unwrap();
    let none = format!(
        "{}.{}.",
        b64(&serde_json::json!({"alg":"none","typ":"JWT"})),
        b64(&serde_json::to_value(claims()).unwrap())
    );
    // The classic confusion attack: HS256 keyed with the issuer's RSA public key.
    let public_pem = rcgen::KeyPair::from_pem(&first_key.private_pem).unwrap().public_key_pem();
    let mut hs_header = Header::new(Algorithm::HS256);
    hs_header.kid = Some(first_key.kid.clone());
    let confused =
        jsonwebtoken::encode(&hs_header, &claims(), &EncodingKey::from_secret(public_pem.as_bytes()).unwrap()).unwrap();
    let mut unknown_kid_header = Header::new(Algorithm::RS256);
    unknown_kid_header.kid = Some("no-such-key".into());
    let unknown_kid = jsonwebtoken::encode(
        &unknown_kid_header,
        &claims(),
        &EncodingKey::from_rsa_pem(first_key.private_pem.as_bytes()).unwrap(),
    )
    .unwrap();
    let mut tampered = good.clone();
    let cut = tampered.rfind('.').unwrap() + 5;
    tampered.replace_range(cut..cut + 4, if &tampered[cut..cut + 4] == "AAAA" { "BBBB" } else { "AAAA" });

    let cases: Vec<(&str, Option<String>, &str)> = vec![
        ("expired", Some(first_key.sign(&expired).unwrap()), "expired"),
        ("not yet valid", Some(first_key.sign(&not_yet).unwrap()), "not_yet_valid"),
        ("wrong audience", Some(first_key.sign(&wrong_audience).unwrap()), "wrong_audience"),
        ("wrong issuer", Some(first_key.sign(&wrong_issuer).unwrap()), "wrong_issuer"),
        ("another tenant's issuer", Some(other_tenant.clone()), "unknown_key"),
        ("alg none", Some(none), "algorithm_not_allowed"),
        ("HS256 with the RSA public key", Some(confused), "algorithm_not_allowed"),
        ("unknown kid", Some(unknown_kid), "unknown_key"),
        ("tampered signature", Some(tampered), "bad_signature"),
        ("oversized", Some(format!("{}.{}", good, "x".repeat(20_000))), "too_large"),
        ("missing", None, "missing"),
    ];
    let mut tokens = vec![good.clone(), other_tenant.clone()];
    for (name, token, reason) in &cases {
        let (status, body) = outcome(&oidc, token.as_deref()).await.expect_err(name);
        assert_eq!(status, 401, "{name}: {body}");
        if let Some(token) = token {
            tokens.push(token.clone());
        }
        let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
        let counted = metric_sum(
            &metrics,
            "tether_gateway_agent_connects_total",
            &format!("tenant=\"oidc\",result=\"{reason}\""),
        );
        assert!(counted >= 1.0, "{name}: not counted under {reason}:\n{metrics}");
    }

    // The issuer goes down: cached keys keep agents connecting.
    nginx.stop();
    assert_eq!(outcome(&oidc, Some(&good)).await, Ok(()), "cached keys must serve while the issuer is down");

    // Key rotation: the issuer comes back with a second key; a token signed with it is accepted
    // after one refresh triggered by its unknown kid.
    let second_key = DevIssuer::create(dir.path(), "kas-2", &issuer.url, IssuerKey::Rs256).unwrap();
    let _nginx = issuer.serve(&[&first_key, &second_key]);
    assert!(wait_listening(addr, Duration::from_secs(10)).await);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let rotated = second_key
        .service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600), None)
        .unwrap();
    tokens.push(rotated.clone());
    assert_eq!(outcome(&oidc, Some(&rotated)).await, Ok(()), "{}", gateway.log_text());
    assert_eq!(outcome(&oidc, Some(&good)).await, Ok(()), "the old key still works");

    // No log line contains a token, or even its signature.
    let log = gateway.log_text();
    for token in &tokens {
        let signature = token.rsplit('.').next().unwrap_or_default();
        assert!(!log.contains(token.as_str()), "a token appears in the log");
        if signature.len() > 16 {
            assert!(!log.contains(signature), "a token signature appears in the log");
        }
    }
    assert!(log.contains("signing keys refreshed"), "{log}");
}

/// While a tenant's signing keys cannot be loaded (its issuer is down at start-up), every agent of
/// that tenant would be refused: the gateway reports unready, naming the tenant, and turns ready
/// once a retry fetches the keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_every_tenants_signing_keys() {
    let dir = ScratchDir::new("tether-oidc-ready").unwrap();
    let ca = DevCa::create(dir.path(), "oidc").unwrap();
    let ip = format!("127.0.{}.{}", fastrand::u8(1..250), fastrand::u8(1..250));
    let addr: SocketAddr = format!("{ip}:{}", free_port()).parse().unwrap();
    let issuer = Issuer {
        dir: dir.path().join("issuer"),
        addr,
        cert: ca.server("issuer", &[&ip]).unwrap(),
        url: format!("https://{addr}"),
    };
    let key = DevIssuer::create(dir.path(), "kas", &issuer.url, IssuerKey::Rs256).unwrap();
    let gateway_cert = ca.server("gateway", &["late.tether.local"]).unwrap();
    let agents = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let config = serde_json::json!({
        "listen": { "agents": agents.to_string(), "admin": admin.to_string() },
        "tls": { "cert_file": gateway_cert.cert, "key_file": gateway_cert.key },
        "tenants": [{
            "name": "late",
            "hosts": ["late.tether.local"],
            "auth": {
                "issuer": issuer.url,
                "audiences": [AUDIENCE],
                "algorithms": ["RS256"],
                "oidc_discovery": true,
                "fetch": { "ca_file": ca.ca_cert, "min_refresh_interval": "1s", "timeout": "1s" },
            },
            "frontend": { "uds": dir.path().join("late.sock") },
        }],
    });
    let file = dir.path().join("gateway.yaml");
    std::fs::write(&file, config.to_string()).unwrap();
    let gateway =
        Process::spawn("tether-gateway", &["-c", file.to_str().unwrap()], &[], dir.path(), "gateway").unwrap();
    assert!(tether_e2e::nginx::wait_listening(admin, Duration::from_secs(20)).await, "{}", gateway.log_text());
    // Up, but not ready, for as long as the issuer is down (a few retries).
    for _ in 0..3 {
        let (status, body) = http_get(admin, "/readyz").await.unwrap();
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("tenant late: no signing keys"), "{body}");
        let (status, body) = http_get(admin, "/readyz/tenant/late").await.unwrap();
        assert_eq!(status, 503, "{body}");
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let _nginx = issuer.serve(&[&key]);
    assert!(wait_listening(addr, Duration::from_secs(10)).await, "nginx did not start");
    assert!(wait_ready(admin, "/readyz", Duration::from_secs(20)).await, "{}", gateway.log_text());
    let token =
        key.service_account_token("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600), None).unwrap();
    let late = settings(agents, &ca.ca_cert, "late.tether.local");
    assert_eq!(outcome(&late, Some(&token)).await, Ok(()));

    // A flood of tokens with unknown key ids (each would trigger a key refresh) costs the issuer
    // at most one JWKS fetch per min_refresh_interval (1 s), not one per token.
    let jwks_fetches = || {
        std::fs::read_to_string(issuer.dir.join("nginx/access.log"))
            .unwrap_or_default()
            .matches("/openid/v1/jwks")
            .count()
    };
    let before = jwks_fetches();
    assert!(before >= 1, "nginx's access log shows the first fetch");
    let forged = |i: usize| {
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(format!("rogue-{i}"));
        let claims = key.claims("kube-system", "tether-agent", AUDIENCE, Duration::from_secs(600));
        jsonwebtoken::encode(&header, &claims, &EncodingKey::from_rsa_pem(key.private_pem.as_bytes()).unwrap()).unwrap()
    };
    let tokens: Vec<String> = (0..30).map(forged).collect();
    let answers = futures::future::join_all(tokens.iter().map(|t| outcome(&late, Some(t)))).await;
    assert!(answers.iter().all(|a| matches!(a, Err((401, _)))), "{answers:?}");
    let fetched = jwks_fetches() - before;
    assert!(fetched <= 2, "{fetched} JWKS fetches for 30 unknown key ids");
}
