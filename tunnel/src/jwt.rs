//! Reading a JWT's expiry without checking its signature: what an agent needs to know whether its
//! token is worth presenting, and what a gateway reads once a TokenReview has vouched for a token.
//! Nothing here decides whether a token is valid.

use base64::Engine;
use serde::Deserialize;

/// The `exp` claim (seconds since the Unix epoch) of a compact JWT, if it has one.
pub fn unverified_expiry(token: &str) -> Option<u64> {
    #[derive(Deserialize)]
    struct Exp {
        exp: u64,
    }
    let mut parts = token.split('.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || payload.len() > 16 * 1024 {
        return None;
    }
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')).ok()?;
    serde_json::from_slice::<Exp>(&json).ok().map(|e| e.exp)
}

/// Seconds since the Unix epoch, now.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs()
}

/// A Unix time as an RFC 3339 UTC timestamp (`2026-12-03T09:49:57Z`), for log lines.
pub fn rfc3339(unix: u64) -> String {
    let days = unix / 86_400;
    let secs = unix % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs / 60 % 60, secs % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token_with(payload: &str) -> String {
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("{}.{}.sig", b64(r#"{"alg":"RS256"}"#), b64(payload))
    }

    #[test]
    fn the_expiry_is_read_from_the_payload() {
        assert_eq!(unverified_expiry(&token_with(r#"{"sub":"a","exp":1767225600}"#)), Some(1_767_225_600));
        assert_eq!(unverified_expiry(&token_with(r#"{"sub":"a"}"#)), None);
        assert_eq!(unverified_expiry("not a jwt"), None);
        assert_eq!(unverified_expiry("a.b.c.d"), None);
        assert_eq!(unverified_expiry("a.!!!.c"), None);
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_291_397), "2026-12-03T09:49:57Z");
    }
}
