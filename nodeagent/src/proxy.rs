//! Which proxy, if any, the agent uses to reach the gateway: the configured URL, or the
//! environment (`HTTPS_PROXY`/`https_proxy`/`ALL_PROXY`, `NO_PROXY`) with curl's rules. Credentials
//! come from the URL, or a user with a password file or `TETHER_PROXY_PASSWORD`; they are never
//! logged.

use http::Uri;
use hyper_util::client::proxy::matcher::Matcher;
use tether_tunnel::proxy::ProxySettings;

use crate::config::ProxyConfig;

/// The proxy settings for reaching `gateway_url`, or `None` to connect directly.
pub fn resolve(config: &ProxyConfig, gateway_url: &Uri) -> anyhow::Result<Option<ProxySettings>> {
    let (url, mut authorization) = match &config.url {
        Some(url) => {
            let intercept = Matcher::builder().all(url.clone()).build().intercept(&as_https(gateway_url)?);
            match intercept {
                Some(intercept) => (intercept.uri().clone(), intercept.basic_auth().cloned()),
                None => anyhow::bail!("gateway.proxy.url: {:?} is not a usable proxy URL", redact(url)),
            }
        }
        None if config.from_environment => match Matcher::from_env().intercept(&as_https(gateway_url)?) {
            Some(intercept) => (intercept.uri().clone(), intercept.basic_auth().cloned()),
            None => return Ok(None),
        },
        None => return Ok(None),
    };
    if url.scheme_str() != Some("http") {
        anyhow::bail!(
            "the proxy {} is not an http:// proxy; only HTTP CONNECT proxies are supported",
            redact(&url.to_string())
        );
    }
    if let Some(user) = &config.username {
        let password = match &config.password_file {
            Some(file) => std::fs::read_to_string(file)
                .map_err(|e| anyhow::anyhow!("gateway.proxy.password_file {}: {e}", file.display()))?
                .trim_end_matches(['\r', '\n'])
                .to_owned(),
            None => std::env::var("TETHER_PROXY_PASSWORD").unwrap_or_default(),
        };
        authorization = ProxySettings::basic_auth(user, &password);
    }
    let mut authorization = authorization;
    if let Some(value) = authorization.as_mut() {
        value.set_sensitive(true);
    }
    Ok(Some(ProxySettings { url, authorization, connect_timeout: config.connect_timeout.0 }))
}

/// `wss://h:p/...` -> `https://h:p/...`, the scheme proxy rules are written for.
fn as_https(gateway_url: &Uri) -> anyhow::Result<Uri> {
    let mut parts = gateway_url.clone().into_parts();
    let secure = matches!(gateway_url.scheme_str(), Some("wss" | "https"));
    parts.scheme = Some(if secure { http::uri::Scheme::HTTPS } else { http::uri::Scheme::HTTP });
    Ok(Uri::from_parts(parts)?)
}

/// A proxy URL with any user and password removed, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => format!("{}://{}", &url[..scheme_end], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: Option<&str>) -> ProxyConfig {
        ProxyConfig { url: url.map(str::to_owned), ..ProxyConfig::default() }
    }

    #[test]
    fn an_explicit_url_with_credentials_becomes_basic_auth() {
        let gateway: Uri = "wss://gw.example.com/v1/tunnel".parse().unwrap();
        let proxy = resolve(&config(Some("http://alice:s3cret@proxy.corp:3128")), &gateway).unwrap().unwrap();
        assert_eq!(proxy.display(), "proxy.corp:3128");
        assert_eq!(proxy.authorization.unwrap().to_str().unwrap(), "Basic YWxpY2U6czNjcmV0");
    }

    #[test]
    fn a_configured_user_and_password_file_override_the_url() {
        let dir = std::env::temp_dir().join(format!("tether-proxy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "fromfile\n").unwrap();
        let gateway: Uri = "wss://gw.example.com/v1/tunnel".parse().unwrap();
        let mut c = config(Some("http://proxy.corp:3128"));
        c.username = Some("bob".into());
        c.password_file = Some(file);
        let proxy = resolve(&c, &gateway).unwrap().unwrap();
        // base64("bob:fromfile")
        assert_eq!(proxy.authorization.unwrap().to_str().unwrap(), "Basic Ym9iOmZyb21maWxl");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn urls_are_redacted_in_messages() {
        assert_eq!(redact("http://alice:s3cret@proxy:3128"), "http://proxy:3128");
        assert_eq!(redact("http://proxy:3128"), "http://proxy:3128");
    }

    #[test]
    fn https_proxies_are_refused_with_a_reason() {
        let gateway: Uri = "wss://gw.example.com/v1/tunnel".parse().unwrap();
        let err = resolve(&config(Some("https://proxy.corp:3129")), &gateway).unwrap_err().to_string();
        assert!(err.contains("only HTTP CONNECT"), "{err}");
    }
}
