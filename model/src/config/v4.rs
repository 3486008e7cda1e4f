//! The DeepSeek-V4 family (V4-Flash, V4-Flash-0731) on the shared [`ModelConfig`]: the V4-only
//! types ([`V4Config`]: per-layer attention and MLP types, CSA/HCA rates, plain MTP depth, QAT
//! groups) and parsing of the flat `config.json` in both spellings (spec v4-architecture.md §1.1):
//!
//! - the official/legacy keys: `compress_ratios` (one entry per backbone layer, then one per MTP /
//!   DSpark layer; 0 = sliding, 4 = CSA, 128 = HCA), `num_hash_layers`, `rope_scaling` (YaRN of the
//!   compress rope), `quantization_config` (FP8 E4M3, square UE8M0 blocks), top-level `expert_dtype`,
//!   DSpark keys (0731);
//! - the transformers keys: `layer_types` + `compress_rates`, `mlp_layer_types`, `rope_parameters`
//!   (`main` / `compress`), as written by transformers 5.17 (the v4-tiny fixture).
//!
//! MTP / DSpark depth: in the legacy spelling it is the number of `compress_ratios` entries after
//! the backbone (0731 lists 3 DSpark stages while `num_nextn_predict_layers` keeps the raw value 1);
//! in the transformers spelling it is `num_nextn_predict_layers`. With `dspark_*` keys those layers
//! are DSpark stages, otherwise plain MTP blocks.
//!
//! When both spellings are present the transformers keys win and the legacy ones must agree.
//! `architectures` is not checked (one third-party note lists another class name, spec §9.9).
//! `norm_topk_prob` is ignored like transformers does (it always normalises).

use serde_json::Value;

use super::fields::Fields;
use super::parse::{parse_dspark, speculative_ratios_are_zero, yarn_values};
use super::{
    ExpertDtype, FamilyFields, ModelConfig, ModelFamily, QuantConfig, RopeConfig, YarnConfig,
};
use crate::backend::Precision;
use crate::error::ModelError;

/// `layer_types` value of a window-only layer.
pub const SLIDING_ATTENTION: &str = "sliding_attention";
/// `layer_types` value of a CSA layer (overlapping compressor + Lightning Indexer).
pub const COMPRESSED_SPARSE_ATTENTION: &str = "compressed_sparse_attention";
/// `layer_types` value of an HCA layer (heavy non-overlapping compression, no indexer).
pub const HEAVILY_COMPRESSED_ATTENTION: &str = "heavily_compressed_attention";
/// `mlp_layer_types` value of a hash-routed MoE (`tid2eid`).
pub const HASH_MOE: &str = "hash_moe";
/// `mlp_layer_types` value of a top-k MoE with a bias-corrected router.
pub const TOPK_MOE: &str = "moe";

/// The `layer_types` spelling of each attention type.
pub(super) const ATTENTION_TYPES: [(&str, V4Attention); 3] = [
    (SLIDING_ATTENTION, V4Attention::Sliding),
    (COMPRESSED_SPARSE_ATTENTION, V4Attention::Csa),
    (HEAVILY_COMPRESSED_ATTENTION, V4Attention::Hca),
];
/// The `mlp_layer_types` spelling of each MLP type.
pub(super) const MLP_TYPES: [(&str, V4Mlp); 2] =
    [(HASH_MOE, V4Mlp::HashMoe), (TOPK_MOE, V4Mlp::TopkMoe)];

/// Legacy `compress_ratios` value of a CSA layer.
pub const LEGACY_CSA_RATIO: usize = 4;
/// Legacy `compress_ratios` value of an HCA layer.
pub const LEGACY_HCA_RATIO: usize = 128;

/// Attention type of one V4 backbone layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4Attention {
    /// Raw window only, main rope.
    Sliding,
    /// Compressed sparse attention: two-series overlapping compressor at `csa_ratio`, indexer,
    /// top-`index_topk` selection, compress rope.
    Csa,
    /// Heavily compressed attention: one-series compressor at `hca_ratio`, every entry visible,
    /// compress rope.
    Hca,
}

/// MLP type of one V4 backbone layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4Mlp {
    /// Experts chosen by `ffn.gate.tid2eid[token]`, weighted by the gate scores (no bias).
    HashMoe,
    /// Experts chosen by top-k of score + `ffn.gate.bias`.
    TopkMoe,
}

/// Group sizes of the official V4 quantisation simulation ("QAT", spec §2.11). They are not in
/// `config.json`; transformers applies none of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct V4Qat {
    /// FP8 (UE8M0) simulation group on the nope channels of window and compressed KV.
    pub kv_nope_fp8_group: usize,
    /// FP4 simulation group of the indexer queries and keys (after the Hadamard rotation).
    pub index_fp4_group: usize,
    /// FP8 activation-quantisation group of FP8/FP4 linear inputs.
    pub act_fp8_group: usize,
}

impl V4Qat {
    /// The official V4 values: 64, 32, 128.
    pub const OFFICIAL: V4Qat = V4Qat {
        kv_nope_fp8_group: 64,
        index_fp4_group: 32,
        act_fp8_group: 128,
    };
}

/// The V4-only part of a [`ModelConfig`] (`None` for V4.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct V4Config {
    /// Attention type per backbone layer (`compress_ratios[l]` is 0, `csa_ratio` or `hca_ratio`).
    pub attention: Vec<V4Attention>,
    /// MLP type per backbone layer.
    pub mlp: Vec<V4Mlp>,
    /// Compression rate m of CSA layers (`compress_rates.compressed_sparse_attention`).
    pub csa_ratio: usize,
    /// Compression rate m' of HCA layers (`compress_rates.heavily_compressed_attention`).
    pub hca_ratio: usize,
    /// Plain MTP blocks in the `mtp.*` namespace (V4-Flash: 1). 0 when the namespace is a DSpark
    /// drafter (then [`ModelConfig::dspark`] says how many stages).
    pub mtp_layers: usize,
    /// The official quantisation-simulation groups.
    pub qat: V4Qat,
}

impl V4Config {
    /// Number of hash-routed layers (`num_hash_layers`).
    pub fn n_hash_layers(&self) -> usize {
        self.mlp
            .iter()
            .filter(|&&mlp| mlp == V4Mlp::HashMoe)
            .count()
    }
}

/// How the weights of a checkpoint are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightStorage {
    /// The official format: FP8 E4M3 dense weights with UE8M0 block scales, routed experts per
    /// [`QuantConfig::expert_dtype`], the rest BF16/F32 (every V4.1 checkpoint, official V4).
    Quantized,
    /// Every tensor in float32 (a transformers `save_pretrained` without `quantization_config`,
    /// e.g. the v4-tiny fixture); `quant` is then unused.
    Float32,
    /// Every floating tensor in bfloat16 (no `quantization_config`, `dtype: bfloat16`).
    Bfloat16,
}

impl ModelConfig {
    /// Where the forward pass rounds activations: V4.1 at DeepSeek's bf16 reference points, V4 in
    /// plain float32 like its transformers reference (no bf16 rounding, no QAT simulation).
    pub fn precision(&self) -> Precision {
        match self.family {
            ModelFamily::V41 => Precision::Bf16,
            ModelFamily::V4 => Precision::F32,
        }
    }
}

/// Parses the flat V4 layout (top level already known to say `deepseek_v4`).
pub(crate) fn parse_v4(top: &Fields<'_>) -> Result<ModelConfig, ModelError> {
    top.expect_str("hidden_act", "silu")?;
    let kv_heads = top.usize("num_key_value_heads")?;
    if kv_heads != 1 {
        return Err(top.error(
            "num_key_value_heads",
            format!("expected 1 (one shared K=V head), found {kv_heads}"),
        ));
    }
    for flag in ["attention_bias", "mlp_bias", "tie_word_embeddings"] {
        if top.optional(flag).is_some() {
            top.expect_bool(flag, false)?;
        }
    }
    if top.optional("scoring_func").is_some() {
        top.expect_str("scoring_func", "sqrtsoftplus")?;
    }
    if top.optional("topk_method").is_some() {
        top.expect_str("topk_method", "noaux_tc")?;
    }

    let n_layers = top.usize("num_hidden_layers")?;
    let head_dim = top.usize("head_dim")?;
    let rope_head_dim = parse_rope_head_dim(top, head_dim)?;
    let schedule = parse_schedule(top, n_layers)?;
    let (quant, storage) = parse_storage(top)?;

    let dspark = match top.optional("dspark_block_size") {
        None => None,
        Some(_) => Some(parse_dspark(top, schedule.speculative_layers, || {
            Ok((
                optional_usize(top, "dspark_n_routed_experts")?
                    .map_or_else(|| top.usize("n_routed_experts"), Ok)?,
                optional_usize(top, "dspark_num_experts_per_tok")?
                    .map_or_else(|| top.usize("num_experts_per_tok"), Ok)?,
            ))
        })?),
    };
    let mtp_layers = if dspark.is_some() {
        0
    } else {
        schedule.speculative_layers
    };

    let compress_ratios = schedule
        .attention
        .iter()
        .map(|attention| match attention {
            V4Attention::Sliding => 0,
            V4Attention::Csa => schedule.csa_ratio,
            V4Attention::Hca => schedule.hca_ratio,
        })
        .collect::<Vec<_>>();
    // Every compressed layer owns its compressor; only CSA layers run an indexer.
    let kv_source_layers = (0..n_layers)
        .filter(|&layer| compress_ratios[layer] != 0)
        .collect();
    let index_source_layers = (0..n_layers)
        .filter(|&layer| schedule.attention[layer] == V4Attention::Csa)
        .collect();

    let family = FamilyFields {
        family: ModelFamily::V4,
        n_layers,
        head_dim,
        rope_head_dim,
        rope: parse_rope(top)?,
        compress_ratios,
        kv_source_layers,
        index_source_layers,
        candidate: None,
        engram: None,
        dspark,
        quant,
        storage,
        v4: Some(V4Config {
            attention: schedule.attention,
            mlp: schedule.mlp,
            csa_ratio: schedule.csa_ratio,
            hca_ratio: schedule.hca_ratio,
            mtp_layers,
            qat: V4Qat::OFFICIAL,
        }),
        image_token_id: None,
        vision: None,
    };
    ModelConfig::from_family(top, top, family)
}

fn optional_usize(fields: &Fields<'_>, key: &str) -> Result<Option<usize>, ModelError> {
    match fields.optional(key) {
        None => Ok(None),
        Some(_) => fields.usize(key).map(Some),
    }
}

/// `qk_rope_head_dim`, or `partial_rotary_factor · head_dim`; both must agree when both are given.
fn parse_rope_head_dim(top: &Fields<'_>, head_dim: usize) -> Result<usize, ModelError> {
    let from_factor = match top.optional("partial_rotary_factor") {
        None => None,
        Some(_) => {
            let factor = top.f64("partial_rotary_factor")?;
            let channels = factor * head_dim as f64;
            if channels.fract() != 0.0 || channels <= 0.0 {
                return Err(top.error(
                    "partial_rotary_factor",
                    format!(
                        "{factor} x head_dim {head_dim} = {channels} is not a positive whole number of channels"
                    ),
                ));
            }
            Some(channels as usize)
        }
    };
    match (optional_usize(top, "qk_rope_head_dim")?, from_factor) {
        (Some(explicit), Some(derived)) if explicit != derived => Err(top.error(
            "qk_rope_head_dim",
            format!("{explicit} disagrees with partial_rotary_factor x head_dim = {derived}"),
        )),
        (Some(explicit), _) => Ok(explicit),
        (None, Some(derived)) => Ok(derived),
        (None, None) => Err(top.error(
            "qk_rope_head_dim",
            "missing required field (or partial_rotary_factor)",
        )),
    }
}

/// Per-layer attention / MLP types and the compression rates.
struct Schedule {
    attention: Vec<V4Attention>,
    mlp: Vec<V4Mlp>,
    csa_ratio: usize,
    hca_ratio: usize,
    /// MTP / DSpark layers after the backbone.
    speculative_layers: usize,
}

fn parse_schedule(top: &Fields<'_>, n_layers: usize) -> Result<Schedule, ModelError> {
    let (attention, csa_ratio, hca_ratio, legacy_trailing) =
        if top.optional("layer_types").is_some() {
            let (attention, csa, hca) = parse_layer_types(top, n_layers)?;
            if top.optional("compress_ratios").is_some() {
                // The legacy list must describe the same backbone schedule.
                let (legacy, _) = parse_compress_ratios(top, n_layers)?;
                if legacy != attention {
                    return Err(top.error(
                        "compress_ratios",
                        "disagrees with layer_types on the backbone layers",
                    ));
                }
            }
            (attention, csa, hca, None)
        } else if top.optional("compress_ratios").is_some() {
            let (attention, trailing) = parse_compress_ratios(top, n_layers)?;
            (
                attention,
                LEGACY_CSA_RATIO,
                LEGACY_HCA_RATIO,
                Some(trailing),
            )
        } else {
            return Err(top.error(
                "layer_types",
                "missing: a V4 config needs layer_types (+ compress_rates) or the legacy \
                 compress_ratios list",
            ));
        };

    let mlp = match top.optional("mlp_layer_types") {
        Some(value) => parse_mlp_types(top, value, n_layers)?,
        None => {
            let hash = top.usize("num_hash_layers")?;
            if hash > n_layers {
                return Err(top.error(
                    "num_hash_layers",
                    format!("{hash} exceeds num_hidden_layers {n_layers}"),
                ));
            }
            (0..n_layers)
                .map(|layer| {
                    if layer < hash {
                        V4Mlp::HashMoe
                    } else {
                        V4Mlp::TopkMoe
                    }
                })
                .collect()
        }
    };

    let declared = optional_usize(top, "num_nextn_predict_layers")?;
    let speculative_layers = match legacy_trailing {
        Some(trailing) => {
            // V4-Flash: one trailing entry = 1 MTP block. 0731: three entries for a 3-stage DSpark
            // drafter while `num_nextn_predict_layers` keeps the raw value 1 (spec §1.1).
            let dspark = top.optional("dspark_block_size").is_some();
            if let Some(declared) = declared
                && !dspark
                && declared != trailing
            {
                return Err(top.error(
                    "compress_ratios",
                    format!(
                        "has {trailing} entries after the {n_layers} backbone layers, but \
                         num_nextn_predict_layers is {declared}"
                    ),
                ));
            }
            trailing
        }
        None => declared.unwrap_or(0),
    };
    Ok(Schedule {
        attention,
        mlp,
        csa_ratio,
        hca_ratio,
        speculative_layers,
    })
}

/// The legacy list: backbone entries 0/4/128, then MTP/DSpark entries that must be 0.
fn parse_compress_ratios(
    top: &Fields<'_>,
    n_layers: usize,
) -> Result<(Vec<V4Attention>, usize), ModelError> {
    let ratios = top.usize_list("compress_ratios")?;
    if ratios.len() < n_layers {
        return Err(top.error(
            "compress_ratios",
            format!(
                "expected at least num_hidden_layers = {n_layers} entries, found {}",
                ratios.len()
            ),
        ));
    }
    let mut attention = Vec::with_capacity(n_layers);
    for (layer, &ratio) in ratios[..n_layers].iter().enumerate() {
        attention.push(match ratio {
            0 => V4Attention::Sliding,
            LEGACY_CSA_RATIO => V4Attention::Csa,
            LEGACY_HCA_RATIO => V4Attention::Hca,
            other => {
                return Err(top.error(
                    "compress_ratios",
                    format!(
                        "entry {layer} is {other}; the legacy list only knows 0 (sliding), \
                         {LEGACY_CSA_RATIO} (CSA) and {LEGACY_HCA_RATIO} (HCA) — use layer_types \
                         + compress_rates for other rates"
                    ),
                ));
            }
        });
    }
    speculative_ratios_are_zero(top, &ratios, n_layers, "MTP/DSpark layer")?;
    Ok((attention, ratios.len() - n_layers))
}

/// `layer_types` + `compress_rates` (transformers spelling).
fn parse_layer_types(
    top: &Fields<'_>,
    n_layers: usize,
) -> Result<(Vec<V4Attention>, usize, usize), ModelError> {
    let value = top.value("layer_types")?;
    let attention = parse_type_list(
        top,
        ("layer_types", "a list of layer type names"),
        value,
        n_layers,
        &ATTENTION_TYPES,
    )?;
    let (csa, hca) = match top.optional("compress_rates") {
        None => (LEGACY_CSA_RATIO, LEGACY_HCA_RATIO),
        Some(value) => {
            let rates = Fields::new(value, "compress_rates.", top.file)?;
            (
                rates.usize(COMPRESSED_SPARSE_ATTENTION)?,
                rates.usize(HEAVILY_COMPRESSED_ATTENTION)?,
            )
        }
    };
    Ok((attention, csa, hca))
}

/// A per-layer list of type names (`layer_types`, `mlp_layer_types`): one entry per backbone
/// layer, each one of `names`' spellings. `(key, what)` names the key and what it must hold.
fn parse_type_list<T: Copy>(
    top: &Fields<'_>,
    (key, what): (&str, &str),
    value: &Value,
    n_layers: usize,
    names: &[(&'static str, T)],
) -> Result<Vec<T>, ModelError> {
    let items = value
        .as_array()
        .ok_or_else(|| top.mismatch(key, what, value))?;
    if items.len() != n_layers {
        return Err(top.error(
            key,
            format!(
                "expected one entry per backbone layer ({n_layers}), found {}",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(layer, item)| {
            let known = names.iter().find(|(name, _)| item.as_str() == Some(*name));
            known.map(|&(_, kind)| kind).ok_or_else(|| {
                top.error(
                    key,
                    format!(
                        "entry {layer} is {item}; expected {}",
                        quoted_choices(names)
                    ),
                )
            })
        })
        .collect()
}

/// `"a", "b" or "c"`: the spellings of `names`, for an error.
fn quoted_choices<T>(names: &[(&str, T)]) -> String {
    let quoted: Vec<String> = names
        .iter()
        .map(|(name, _)| format!("\"{name}\""))
        .collect();
    match quoted.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

fn parse_mlp_types(
    top: &Fields<'_>,
    value: &Value,
    n_layers: usize,
) -> Result<Vec<V4Mlp>, ModelError> {
    let mlp = parse_type_list(
        top,
        ("mlp_layer_types", "a list of MLP type names"),
        value,
        n_layers,
        &MLP_TYPES,
    )?;
    if let Some(hash) = optional_usize(top, "num_hash_layers")? {
        let counted = mlp.iter().filter(|&&m| m == V4Mlp::HashMoe).count();
        if counted != hash {
            return Err(top.error(
                "num_hash_layers",
                format!(
                    "{hash} disagrees with the {counted} \"{HASH_MOE}\" entries of mlp_layer_types"
                ),
            ));
        }
    }
    Ok(mlp)
}

/// Main and compress rope: `rope_parameters.{main,compress}` (transformers) or `rope_theta` +
/// `compress_rope_theta` + `rope_scaling` (official). V4 applies no YaRN mscale, so a compress
/// `attention_factor` other than 1 is rejected.
fn parse_rope(top: &Fields<'_>) -> Result<RopeConfig, ModelError> {
    let Some(parameters) = top.optional("rope_parameters") else {
        let yarn = match top.optional("rope_scaling") {
            None => None,
            Some(value) => Some(parse_yarn(&Fields::new(value, "rope_scaling.", top.file)?)?),
        };
        return Ok(RopeConfig {
            theta: top.f64("rope_theta")?,
            compress_theta: top.f64("compress_rope_theta")?,
            yarn,
        });
    };
    let parameters = Fields::new(parameters, "rope_parameters.", top.file)?;
    let main = Fields::new(parameters.value("main")?, "rope_parameters.main.", top.file)?;
    main.expect_str("rope_type", "default")?;
    let compress = Fields::new(
        parameters.value("compress")?,
        "rope_parameters.compress.",
        top.file,
    )?;
    let theta = main.f64("rope_theta")?;
    let compress_theta = compress.f64("rope_theta")?;
    for (key, value) in [
        ("rope_theta", theta),
        ("compress_rope_theta", compress_theta),
    ] {
        if top.optional(key).is_some() && top.f64(key)? != value {
            return Err(top.error(
                key,
                format!("{} disagrees with rope_parameters ({value})", top.f64(key)?),
            ));
        }
    }
    let yarn = match compress.str("rope_type")? {
        "default" => None,
        "yarn" => Some(parse_yarn(&compress)?),
        other => {
            return Err(compress.error(
                "rope_type",
                format!("expected \"yarn\" or \"default\", found \"{other}\""),
            ));
        }
    };
    Ok(RopeConfig {
        theta,
        compress_theta,
        yarn,
    })
}

/// A YaRN dict: `rope_type` (or the legacy `type`) = yarn, factor, original length, betas.
fn parse_yarn(fields: &Fields<'_>) -> Result<YarnConfig, ModelError> {
    if fields.optional("rope_type").is_none() && fields.optional("type").is_some() {
        fields.expect_str("type", "yarn")?;
    } else {
        fields.expect_str("rope_type", "yarn")?;
    }
    if fields.optional("attention_factor").is_some() {
        let factor = fields.f64("attention_factor")?;
        if factor != 1.0 {
            return Err(fields.error(
                "attention_factor",
                format!("V4 applies no YaRN mscale: expected 1.0, found {factor}"),
            ));
        }
    }
    yarn_values(fields)
}

/// `quantization_config` + `expert_dtype`, or the storage dtype of an unquantised save.
fn parse_storage(top: &Fields<'_>) -> Result<(QuantConfig, WeightStorage), ModelError> {
    let Some(value) = top.optional("quantization_config") else {
        let key = if top.optional("dtype").is_some() {
            "dtype"
        } else {
            "torch_dtype"
        };
        let storage = match top.str(key)? {
            "float32" => WeightStorage::Float32,
            "bfloat16" => WeightStorage::Bfloat16,
            other => {
                return Err(top.error(
                    key,
                    format!(
                        "an unquantised V4 checkpoint must be \"float32\" or \"bfloat16\", found \"{other}\""
                    ),
                ));
            }
        };
        let unused = QuantConfig {
            weight_block: [V4_WEIGHT_BLOCK, V4_WEIGHT_BLOCK],
            expert_dtype: ExpertDtype::Fp8,
        };
        return Ok((unused, storage));
    };
    let quant = Fields::new(value, "quantization_config.", top.file)?;
    quant.expect_str("quant_method", "fp8")?;
    if quant.optional("fmt").is_some() {
        quant.expect_str("fmt", "e4m3")?;
    }
    quant.expect_str("scale_fmt", "ue8m0")?;
    if quant.optional("activation_scheme").is_some() {
        quant.expect_str("activation_scheme", "dynamic")?;
    }
    let block = quant.usize_list("weight_block_size")?;
    let weight_block = match block.as_slice() {
        &[rows, cols] if rows == cols && rows > 0 => [rows, cols],
        _ => {
            return Err(quant.error(
                "weight_block_size",
                format!("expected a square block such as [128, 128], found {block:?}"),
            ));
        }
    };
    // Official V4 keeps `expert_dtype` at the top level; accept it inside the quantisation dict too.
    let holder = if top.optional(EXPERT_DTYPE).is_some() {
        top
    } else {
        &quant
    };
    let expert_dtype = match holder.optional(EXPERT_DTYPE) {
        None => ExpertDtype::Fp8,
        Some(_) => match holder.str(EXPERT_DTYPE)? {
            "fp4" => ExpertDtype::Fp4,
            "fp8" => ExpertDtype::Fp8,
            other => {
                return Err(holder.error(
                    EXPERT_DTYPE,
                    format!("expected \"fp4\" or \"fp8\", found \"{other}\""),
                ));
            }
        },
    };
    Ok((
        QuantConfig {
            weight_block,
            expert_dtype,
        },
        WeightStorage::Quantized,
    ))
}

/// Key of the routed-expert storage format (`fp4` or `fp8`; absent means FP8 like the dense weights).
const EXPERT_DTYPE: &str = "expert_dtype";

/// Tile edge of the dense FP8 weight scales in official V4 checkpoints.
pub const V4_WEIGHT_BLOCK: usize = 128;
