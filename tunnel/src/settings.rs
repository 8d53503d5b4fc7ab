//! Loading a YAML configuration file with environment overrides (`TETHER__SECTION__KEY`).

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The configuration parsed but is not usable; every problem names its key and the fix.
    #[error("invalid configuration in {source_name}:\n{}", problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        /// The file, or "environment".
        source_name: String,
        /// The problems.
        problems: Vec<String>,
    },
    /// The file could not be read or parsed, or a value has the wrong type.
    #[error("configuration {}: {reason}", path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "(environment only)".into()))]
    Load {
        /// The file, if one was given.
        path: Option<PathBuf>,
        /// What is wrong, naming the key.
        reason: String,
    },
}

/// Reads `file` (YAML) and then the environment: `TETHER__A__B=value` overrides key `a.b`.
///
/// Unknown keys are rejected by the target type (`deny_unknown_fields`), so typos fail loudly.
pub fn load<T: DeserializeOwned>(file: Option<&Path>) -> Result<T, SettingsError> {
    let text = match file {
        Some(path) => Some(std::fs::read_to_string(path).map_err(|e| SettingsError::Load {
            path: Some(path.to_owned()),
            reason: match e.kind() {
                std::io::ErrorKind::NotFound => "file not found; pass an existing file with --config".into(),
                _ => format!("cannot be read: {e}"),
            },
        })?),
        None => None,
    };
    from_yaml(file, text.as_deref())
}

/// Parses `text` (YAML, the contents of `file`, which errors name) and then the environment, as
/// [`load`] does with a file's contents. Any text gives a configuration or an error, never a panic
/// (fuzzed: fuzz/fuzz_targets/config.rs).
pub fn from_yaml<T: DeserializeOwned>(file: Option<&Path>, text: Option<&str>) -> Result<T, SettingsError> {
    let error = |reason: String| SettingsError::Load { path: file.map(Path::to_owned), reason };
    let mut builder = config::Config::builder();
    if let Some(text) = text {
        let parsed = config::Format::parse(&config::FileFormat::Yaml, None, text).map_err(|e| error(e.to_string()))?;
        for (key, value) in &parsed {
            check_key(key, value).map_err(error)?;
        }
        builder = builder.add_source(Parsed(parsed));
    }
    if let Some((name, _)) = std::env::vars_os().find(|(name, _)| {
        let name = name.to_string_lossy();
        name.starts_with("TETHER__") && name.contains(['[', ']'])
    }) {
        return Err(error(format!(
            "environment variable {:?} has brackets; override list entries with a comma-separated value",
            printable(&name.to_string_lossy())
        )));
    }
    builder = builder.add_source(
        config::Environment::with_prefix("TETHER")
            .prefix_separator("__")
            .separator("__")
            .try_parsing(true)
            .list_separator(",")
            .with_list_parse_key("tenants")
            .with_list_parse_key("identifiers.hosts")
            .with_list_parse_key("identifiers.addresses")
            .with_list_parse_key("identifiers.cidrs")
            .ignore_empty(true),
    );
    let merged = builder.build().map_err(|e| error(e.to_string()))?;
    merged.try_deserialize().map_err(|e| error(e.to_string()))
}

/// A file already parsed (to check its keys), handed to the `config` builder as it is instead of
/// being parsed a second time.
#[derive(Debug, Clone)]
struct Parsed(config::Map<String, config::Value>);

impl config::Source for Parsed {
    fn clone_into_box(&self) -> Box<dyn config::Source + Send + Sync> {
        Box::new(self.clone())
    }

    fn collect(&self) -> Result<config::Map<String, config::Value>, config::ConfigError> {
        Ok(self.0.clone())
    }
}

/// The `config` crate reads `[` in a key as an index into a list and grows the list to it: a key
/// like `a[99999999999]` in a file or an environment variable name would allocate without bound or
/// abort (found by fuzz/fuzz_targets/config.rs). No key of Tether's has brackets, so they are
/// refused before the file reaches the crate.
fn check_key(key: &str, value: &config::Value) -> Result<(), String> {
    if key.contains(['[', ']']) {
        return Err(format!("key {:?} has brackets; keys are plain names (lists are YAML sequences)", printable(key)));
    }
    match &value.kind {
        config::ValueKind::Table(table) => {
            for (inner, value) in table {
                check_key(inner, value).map_err(|e| format!("in {}: {e}", printable(key)))?;
            }
        }
        config::ValueKind::Array(items) => {
            for item in items {
                check_key("", item).map_err(|e| format!("in {}: {e}", printable(key)))?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn printable(key: &str) -> String {
    crate::untrusted::printable(key, 64)
}

/// Loads like [`load`], then runs `validate`; any problem it reports fails the load.
pub fn load_validated<T, P, F>(file: Option<&Path>, validate: F) -> Result<T, SettingsError>
where
    T: DeserializeOwned,
    P: std::fmt::Display,
    F: FnOnce(&T) -> Vec<P>,
{
    let config: T = load(file)?;
    let problems: Vec<String> = validate(&config).iter().map(ToString::to_string).collect();
    if problems.is_empty() {
        return Ok(config);
    }
    let source_name = file.map(|p| p.display().to_string()).unwrap_or_else(|| "environment".into());
    Err(SettingsError::Invalid { source_name, problems })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fuzz/artifacts/config/crash-d3cffdd1...: the `config` crate grew a list to the index in the
    /// key and aborted on "capacity overflow".
    #[test]
    fn a_key_with_an_index_is_refused_instead_of_aborting() {
        let crash = ":888[0000000000000000000000000000000000000000000000000003027944083642934179]\t:\nt:";
        let err = from_yaml::<serde_json::Value>(None, Some(crash)).unwrap_err().to_string();
        assert!(err.contains("brackets"), "{err}");
        // A large index that would not overflow but allocate gigabytes, nested.
        let err = from_yaml::<serde_json::Value>(None, Some("a:\n  b[100000000]: 1\n")).unwrap_err().to_string();
        assert!(err.contains("in a: key \"b[100000000]\" has brackets"), "{err}");
        let err = from_yaml::<serde_json::Value>(None, Some("a:\n  - x[9]: 1\n")).unwrap_err().to_string();
        assert!(err.contains("brackets"), "{err}");
        // Plain keys and lists still load.
        let ok: serde_json::Value = from_yaml(None, Some("a:\n  b: [1, 2]\n")).unwrap();
        assert_eq!(ok["a"]["b"][1], 2);
    }
}
