//! Human-readable durations in configuration files: `250ms`, `20s`, `5m`, `1h`, or a bare number
//! of seconds.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer, de};

/// Parses `250ms`, `20s`, `5m`, `1h`, `1h30m` or a bare number of seconds.
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration".into());
    }
    if let Ok(secs) = text.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("{text:?} is not a duration; use e.g. 500ms, 20s, 5m or 1h"));
        }
        let value: f64 = rest[..digits].parse().map_err(|_| format!("bad number in duration {text:?}"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86_400.0,
            other => return Err(format!("unknown unit {other:?} in duration {text:?}; use ms, s, m, h or d")),
        };
        rest = &rest[unit_len..];
        total += Duration::try_from_secs_f64(value * scale).map_err(|e| format!("duration {text:?}: {e}"))?;
    }
    Ok(total)
}

/// Formats a duration the way [`parse`] reads it.
pub fn format(d: Duration) -> String {
    let ms = d.as_millis();
    if !ms.is_multiple_of(1000) { format!("{ms}ms") } else { format!("{}s", d.as_secs()) }
}

/// Serde `deserialize_with` for a [`Duration`] field.
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    struct Visitor;
    impl de::Visitor<'_> for Visitor {
        type Value = Duration;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a duration such as 500ms, 20s, 5m or 1h")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
            parse(v).map_err(E::custom)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
            Ok(Duration::from_secs(v))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
            u64::try_from(v).map(Duration::from_secs).map_err(|_| E::custom("a duration cannot be negative"))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Duration, E> {
            Duration::try_from_secs_f64(v).map_err(E::custom)
        }
    }
    deserializer.deserialize_any(Visitor)
}

/// Serde `serialize_with` for a [`Duration`] field.
pub fn serialize<S: Serializer>(d: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format(*d))
}

/// A [`Duration`] that (de)serialises in the human-readable form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize(deserializer).map(HumanDuration)
    }
}

impl serde::Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serialize(&self.0, serializer)
    }
}

impl From<HumanDuration> for Duration {
    fn from(d: HumanDuration) -> Self {
        d.0
    }
}

impl From<Duration> for HumanDuration {
    fn from(d: Duration) -> Self {
        Self(d)
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_usual_forms() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("42"), Ok(Duration::from_secs(42)));
        assert!(parse("").is_err());
        assert!(parse("fast").is_err());
        assert!(parse("10 parsecs").is_err());
        assert!(parse("-5s").is_err());
    }

    #[test]
    fn formats_round_trip() {
        for d in [Duration::from_millis(1500), Duration::from_secs(20), Duration::ZERO] {
            assert_eq!(parse(&format(d)), Ok(d));
        }
    }
}
