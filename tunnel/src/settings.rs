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
        builder = builder.add_source(config::File::from_str(text, config::FileFormat::Yaml).required(true));
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
