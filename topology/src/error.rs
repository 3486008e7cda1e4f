//! `TopologyError`: everything that can go wrong reading, parsing and validating a topology
//! file. Every message starts with the file (or origin) and names the offending field.

use std::io;

/// A topology file could not be read, parsed or validated, or does not fit this machine.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// The file could not be read.
    #[error("{origin}: cannot read the topology file: {source}")]
    Read {
        /// The path as given.
        origin: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },

    /// The text is not valid TOML, has an unknown key, a missing key or a value of the wrong type.
    #[error("{origin}: {detail}")]
    Parse {
        /// The file (or other origin) of the text.
        origin: String,
        /// The dotted key the parser blamed (`parallel.dp`), when it named one.
        field: Option<String>,
        /// What the parser said, prefixed with the key when known.
        detail: String,
    },

    /// A value is out of range or contradicts another field.
    #[error("{origin}: {field}: {problem}")]
    Invalid {
        /// The file (or other origin) of the config.
        origin: String,
        /// The dotted key of the field at fault (`parallel.dp`).
        field: &'static str,
        /// What is wrong and what bound it breaks.
        problem: String,
    },

    /// The topology needs more GPUs than this machine has.
    #[error(
        "{origin}: needs {required} GPUs ({nodes} node(s) x {gpus_per_node} GPUs per node), \
         but only {available} are available here"
    )]
    NotEnoughGpus {
        /// The file (or other origin) of the config.
        origin: String,
        /// The GPUs this process drives (`NodeConfig::gpus_here`: `nodes * gpus_per_node`).
        required: usize,
        /// What the caller found on this machine.
        available: usize,
        /// The nodes whose ranks this process runs: `device.nodes`, or 1 on one node of a
        /// deployment of one process per node (`cluster.bootstrap`).
        nodes: u16,
        /// `device.gpus_per_node`.
        gpus_per_node: u16,
    },
}

impl TopologyError {
    /// The dotted field name this error blames, if any.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Parse { field, .. } => field.as_deref(),
            Self::Invalid { field, .. } => Some(field),
            Self::Read { .. } | Self::NotEnoughGpus { .. } => None,
        }
    }

    /// Converts a `config` crate error into a `Parse` error that keeps the key path.
    pub(crate) fn from_config(origin: &str, error: config::ConfigError) -> Self {
        let (field, message) = split_config_error(error);
        let detail = match &field {
            Some(key) => format!("{key}: {message}"),
            None => message,
        };
        Self::Parse {
            origin: origin.to_owned(),
            field,
            detail,
        }
    }
}

/// Splits a `config` error into the key path it carries and the bare message.
fn split_config_error(error: config::ConfigError) -> (Option<String>, String) {
    use config::ConfigError as E;
    match error {
        E::At { error, key, .. } => {
            let (inner_key, message) = split_config_error(*error);
            let field = match (key, inner_key) {
                (Some(outer), Some(inner)) => Some(format!("{outer}.{inner}")),
                (outer, inner) => outer.or(inner),
            };
            (field, message)
        }
        E::Type {
            unexpected,
            expected,
            key,
            ..
        } => (
            key,
            format!("invalid type: {unexpected}, expected {expected}"),
        ),
        E::NotFound(key) => (Some(key), "missing field".to_owned()),
        E::FileParse { cause, .. } => (None, format!("not valid TOML: {cause}")),
        other => (None, other.to_string()),
    }
}

/// Bad input to the expert placement solver (`eplb`), naming what and where.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlacementError {
    /// The load table has no layers.
    #[error("loads: no MoE layers (expected [[load per logical expert] per layer])")]
    NoLayers,
    /// The first layer has no experts.
    #[error("loads[0]: no logical experts")]
    NoExperts,
    /// More logical experts than `ExpertId` can name.
    #[error("loads[0]: {experts} logical experts, at most {max} are supported")]
    TooManyExperts {
        /// Experts in the first row.
        experts: usize,
        /// The limit.
        max: usize,
    },
    /// A layer's row length differs from the first layer's.
    #[error("loads[{layer}]: {got} experts, but loads[0] has {expected} (ragged rows)")]
    RaggedLoads {
        /// The layer index.
        layer: usize,
        /// Experts in `loads[0]`.
        expected: usize,
        /// Experts in this row.
        got: usize,
    },
    /// A load is negative, NaN or infinite.
    #[error("loads[{layer}][{expert}]: {value} is not a finite load >= 0")]
    BadLoad {
        /// The layer index.
        layer: usize,
        /// The logical expert index.
        expert: usize,
        /// The offending value.
        value: f64,
    },
    /// The JSON text is not an array of arrays of numbers.
    #[error("loads JSON{at}: {problem}")]
    Json {
        /// Where (`[2][5]`), empty for the whole document.
        at: String,
        /// What is wrong.
        problem: String,
    },
    /// A count parameter is zero.
    #[error("{name}: must be >= 1, got 0")]
    ZeroCount {
        /// `num_replicas`, `num_groups`, `num_nodes` or `num_gpus`.
        name: &'static str,
    },
    /// Fewer physical slots than logical experts.
    #[error("num_replicas: {replicas} physical slots cannot hold {experts} logical experts")]
    TooFewReplicas {
        /// Physical slots per layer.
        replicas: usize,
        /// Logical experts per layer.
        experts: usize,
    },
    /// Two counts that must divide do not.
    #[error("{dividend_name} = {dividend} is not a multiple of {divisor_name} = {divisor}")]
    NotDivisible {
        /// The field that must be a multiple (`num_replicas`).
        dividend_name: &'static str,
        /// Its value.
        dividend: usize,
        /// The field that must divide it (`num_gpus`).
        divisor_name: &'static str,
        /// Its value.
        divisor: usize,
    },
}
