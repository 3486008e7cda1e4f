//! Reading topology text: a file or a string, optionally layered with `DEEPINFER__SECTION__KEY`
//! environment overrides, through the `config` crate into `RawNodeConfig`, then validated.

use std::collections::HashMap;
use std::path::Path;

use config::{Config, Environment, File, FileFormat};

use crate::error::TopologyError;
use crate::raw::RawNodeConfig;
use crate::validate::NodeConfig;

/// The embedded default topology (CPU backend, demo model): `configs/local.toml`.
pub const EMBEDDED_DEFAULT_TOML: &str = include_str!("../../configs/local.toml");
/// The origin label of the embedded default.
pub const EMBEDDED_DEFAULT_ORIGIN: &str = "configs/local.toml (embedded)";
/// Prefix of environment overrides: `DEEPINFER__SCHEDULER__OVERLAP_DEPTH=1`.
pub const ENV_PREFIX: &str = "DEEPINFER";
/// Separator between prefix, section and key in environment overrides.
pub const ENV_SEPARATOR: &str = "__";

impl NodeConfig {
    /// Reads, parses and validates a topology file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let (text, origin) = read(path.as_ref())?;
        Self::from_toml_str(&text, &origin)
    }

    /// Parses and validates topology text; `origin` names it in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, TopologyError> {
        let raw = parse(text, origin, None)?;
        Self::from_raw(raw, origin)
    }

    /// Like [`NodeConfig::from_file`], then applies the process environment's
    /// `DEEPINFER__<SECTION>__<KEY>` overrides (which are validated like the file).
    pub fn from_file_with_env(path: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let (text, origin) = read(path.as_ref())?;
        Self::from_toml_str_with_env(&text, &origin, std::env::vars())
    }

    /// Parses `text`, overrides it with the `DEEPINFER__<SECTION>__<KEY>` entries among
    /// `vars` (others are ignored), and validates the result.
    pub fn from_toml_str_with_env(
        text: &str,
        origin: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, TopologyError> {
        let prefix = format!("{ENV_PREFIX}{ENV_SEPARATOR}");
        let overrides: HashMap<String, String> = vars
            .into_iter()
            .filter(|(key, _)| key.starts_with(&prefix))
            .collect();
        let origin_with_env = if overrides.is_empty() {
            origin.to_owned()
        } else {
            let mut keys: Vec<&str> = overrides.keys().map(String::as_str).collect();
            keys.sort_unstable();
            format!("{origin} + environment ({})", keys.join(", "))
        };
        let raw = parse(text, &origin_with_env, Some(overrides))?;
        Self::from_raw(raw, &origin_with_env)
    }

    /// The embedded default topology (`configs/local.toml`): CPU backend, demo model.
    pub fn embedded_default() -> Result<Self, TopologyError> {
        Self::from_toml_str(EMBEDDED_DEFAULT_TOML, EMBEDDED_DEFAULT_ORIGIN)
    }

    /// The embedded default with the process environment's `DEEPINFER__<SECTION>__<KEY>`
    /// overrides (validated like a file).
    pub fn embedded_default_with_env() -> Result<Self, TopologyError> {
        Self::from_toml_str_with_env(
            EMBEDDED_DEFAULT_TOML,
            EMBEDDED_DEFAULT_ORIGIN,
            std::env::vars(),
        )
    }
}

fn read(path: &Path) -> Result<(String, String), TopologyError> {
    let origin = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => Ok((text, origin)),
        Err(source) => Err(TopologyError::Read { origin, source }),
    }
}

/// TOML text (plus optional environment overrides) -> `RawNodeConfig`.
fn parse(
    text: &str,
    origin: &str,
    env_overrides: Option<HashMap<String, String>>,
) -> Result<RawNodeConfig, TopologyError> {
    let mut builder = Config::builder().add_source(File::from_str(text, FileFormat::Toml));
    if let Some(vars) = env_overrides {
        builder = builder.add_source(
            Environment::with_prefix(ENV_PREFIX)
                .prefix_separator(ENV_SEPARATOR)
                .separator(ENV_SEPARATOR)
                .try_parsing(true)
                .source(Some(vars.into_iter().collect())),
        );
    }
    builder
        .build()
        .and_then(Config::try_deserialize::<RawNodeConfig>)
        .map_err(|error| TopologyError::from_config(origin, error))
}
