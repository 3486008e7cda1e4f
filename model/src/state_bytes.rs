//! The bytes of a sequence's state as a function of its length, derived from the config, for
//! both families ([`StateBytes`]), and the block arithmetic the runtime's state pool accounts in
//! ([`StateBytes::block_tokens`], [`StateBytes::blocks_for`]).
//!
//! A state is bounded rings (window K=V rows, compressor rows of the pending groups, DSpark
//! context rows, the MTP block's window and streams) plus append-only caches (one compressed-KV
//! entry and one index key per complete compression group of a KV source) plus, with Engram, one
//! history entry per token. Every row is an f32 [`crate::backend::Tensor`], so a row of `w` values
//! takes `4 w` bytes, on the host and on a device alike. [`StateBytes::bytes`] is exact for a
//! sequence fed forward (`held_bytes` of either family's `SequenceState` is what a test compares
//! it with); after a rollback the rings hold fewer rows, so it is an upper bound.
//!
//! Blocks: `block_tokens` is a multiple of every compression ratio, so a block of tokens holds a
//! whole number of entries of every cache, and `block_bytes` is what one block of tokens adds
//! (caches and per-token history). The rings of a sequence, bounded whatever its length, take
//! `ring_blocks` more. `blocks_for(len) · block_bytes >= bytes(len)` for every length.

use crate::config::{ModelConfig, ModelFamily, V4Attention};
use crate::v41::MAX_BACKTRACK;

/// Bytes of one stored value (every state row is f32).
const VALUE_BYTES: u64 = 4;
/// Bytes of one Engram history entry (`Option<u32>`).
const ENGRAM_ENTRY_BYTES: u64 = std::mem::size_of::<Option<u32>>() as u64;
/// Smallest block (tokens); rounded up to a multiple of every compression ratio.
pub const MIN_BLOCK_TOKENS: usize = 64;

/// One component of a state, present `copies` times (layers or stages of one kind).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatePart {
    /// The layer kind it belongs to (`"window-only"`, `"CSA ratio 4"`, `"DSpark stage"` ...).
    pub kind: String,
    /// What it holds (`"window rows"`, `"compressed KV"` ...).
    pub what: &'static str,
    /// How many layers (or stages) hold one.
    pub copies: usize,
    /// Values per row (or per cache entry).
    pub width: usize,
    pub growth: Growth,
}

/// How many rows a [`StatePart`] holds after `len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Growth {
    /// A ring: `min(len − lag, capacity)` rows, of which the next token reads the last `read`
    /// once `len` is a multiple of every compression ratio (what a V4 prefix block keeps).
    Ring {
        capacity: usize,
        lag: usize,
        read: usize,
    },
    /// An append-only cache: `len / ratio` entries.
    PerGroup { ratio: usize },
}

impl StatePart {
    /// Rows held after `len` tokens.
    pub fn rows(&self, len: usize) -> usize {
        match self.growth {
            Growth::Ring { capacity, lag, .. } => len.saturating_sub(lag).min(capacity),
            Growth::PerGroup { ratio } => len / ratio.max(1),
        }
    }

    /// Bytes of one row (or entry).
    pub fn row_bytes(&self) -> u64 {
        if self.what == ENGRAM_WHAT {
            ENGRAM_ENTRY_BYTES
        } else {
            self.width as u64 * VALUE_BYTES
        }
    }

    /// Bytes of all copies after `len` tokens.
    pub fn bytes(&self, len: usize) -> u64 {
        self.copies as u64 * self.rows(len) as u64 * self.row_bytes()
    }

    /// Bytes per token of all copies once the rings are full (0 for a ring).
    pub fn bytes_per_token(&self) -> f64 {
        match self.growth {
            Growth::Ring { .. } => 0.0,
            Growth::PerGroup { ratio } => {
                (self.copies as u64 * self.row_bytes()) as f64 / ratio.max(1) as f64
            }
        }
    }

    /// The most bytes all copies hold whatever the length (rings only; 0 for a cache).
    pub fn ring_bytes(&self) -> u64 {
        match self.growth {
            Growth::Ring { capacity, .. } => {
                self.copies as u64 * capacity as u64 * self.row_bytes()
            }
            Growth::PerGroup { .. } => 0,
        }
    }
}

const ENGRAM_WHAT: &str = "Engram history";

/// The byte model of one model's sequence state ([module docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct StateBytes {
    pub parts: Vec<StatePart>,
    /// Tokens per block (a multiple of every compression ratio and of [`MIN_BLOCK_TOKENS`]).
    pub block_tokens: usize,
}

impl StateBytes {
    /// The byte model of `cfg`'s sequence state.
    pub fn of(cfg: &ModelConfig) -> StateBytes {
        let parts = match cfg.family {
            ModelFamily::V41 => v41_parts(cfg),
            ModelFamily::V4 => v4_parts(cfg),
        };
        let block_tokens = parts
            .iter()
            .filter_map(|p| match p.growth {
                Growth::PerGroup { ratio } => Some(ratio.max(1)),
                Growth::Ring { .. } => None,
            })
            .fold(MIN_BLOCK_TOKENS, lcm);
        StateBytes {
            parts,
            block_tokens,
        }
    }

    /// Exact bytes of a state fed `len` tokens forward (an upper bound after a rollback).
    pub fn bytes(&self, len: usize) -> u64 {
        self.parts.iter().map(|p| p.bytes(len)).sum()
    }

    /// The most bytes the rings of one sequence hold.
    pub fn ring_bytes(&self) -> u64 {
        self.parts.iter().map(StatePart::ring_bytes).sum()
    }

    /// Bytes one block of tokens adds to the caches; never 0 (a model without caches accounts
    /// its rings as one block).
    pub fn block_bytes(&self) -> u64 {
        let caches: u64 = self
            .parts
            .iter()
            .filter(|p| matches!(p.growth, Growth::PerGroup { .. }))
            .map(|p| p.bytes(self.block_tokens))
            .sum();
        if caches > 0 {
            caches
        } else {
            self.ring_bytes().max(1)
        }
    }

    /// Bytes of one V4 prefix block (`v4::PrefixBlock::held_bytes`; the first block of a sequence
    /// may keep a row fewer): the caches of a block of tokens plus, of every ring, the rows of
    /// the block the next token reads after it.
    pub fn prefix_block_bytes(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| match p.growth {
                Growth::Ring { read, .. } => {
                    p.copies as u64 * read.min(self.block_tokens) as u64 * p.row_bytes()
                }
                Growth::PerGroup { .. } => p.bytes(self.block_tokens),
            })
            .sum()
    }

    /// Blocks the rings of one sequence take.
    pub fn ring_blocks(&self) -> usize {
        self.ring_bytes().div_ceil(self.block_bytes()) as usize
    }

    /// Blocks a sequence of `len` tokens takes: its rings plus one per started block of tokens.
    pub fn blocks_for(&self, len: usize) -> usize {
        self.ring_blocks() + len.div_ceil(self.block_tokens)
    }

    /// Bytes per token of the caches once the rings are full.
    pub fn bytes_per_token(&self) -> f64 {
        self.parts.iter().map(StatePart::bytes_per_token).sum()
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

/// The window ring capacity of every layer and DSpark stage.
fn window_capacity(cfg: &ModelConfig) -> usize {
    cfg.window_size + MAX_BACKTRACK
}

/// A ring of `capacity` rows whose last `read` the next token reads after an aligned length.
fn ring(
    kind: &str,
    what: &'static str,
    copies: usize,
    width: usize,
    (capacity, read): (usize, usize),
) -> StatePart {
    StatePart {
        kind: kind.to_string(),
        what,
        copies,
        width,
        growth: Growth::Ring {
            capacity,
            lag: 0,
            read,
        },
    }
}

fn cache(kind: &str, what: &'static str, copies: usize, width: usize, ratio: usize) -> StatePart {
    StatePart {
        kind: kind.to_string(),
        what,
        copies,
        width,
        growth: Growth::PerGroup { ratio },
    }
}

/// The window ring of `layers` layers of one kind.
fn window_rows(kind: &str, layers: usize, cfg: &ModelConfig) -> StatePart {
    let rows = (window_capacity(cfg), cfg.window_size);
    ring(kind, "window rows", layers, cfg.head_dim, rows)
}

/// The backbone layers grouped by `label`, in first-seen order: (label, layers, first layer).
fn layer_kinds(cfg: &ModelConfig, label: impl Fn(usize) -> String) -> Vec<(String, usize, usize)> {
    let mut kinds: Vec<(String, usize, usize)> = Vec::new();
    for l in 0..cfg.n_layers {
        let kind = label(l);
        match kinds.iter_mut().find(|(k, _, _)| *k == kind) {
            Some((_, n, _)) => *n += 1,
            None => kinds.push((kind, 1, l)),
        }
    }
    kinds
}

/// One context ring per DSpark stage (both families), if the model has stages.
fn dspark_part(cfg: &ModelConfig) -> Option<StatePart> {
    let stages = cfg.n_dspark_stages();
    (stages > 0).then(|| {
        ring(
            "DSpark stage",
            "context rows",
            stages,
            cfg.head_dim,
            (window_capacity(cfg), cfg.window_size),
        )
    })
}

/// V4.1 (spec §5.1): every layer a window ring; a KV source of ratio `r > 1` also the rows of
/// its pending group (`kv ‖ gate`, trimmed like the window), and every KV source one entry and
/// one index key per group; DSpark stages a context ring each; Engram one entry per token.
fn v41_parts(cfg: &ModelConfig) -> Vec<StatePart> {
    let (head_dim, capacity) = (cfg.head_dim, window_capacity(cfg));
    let label = |l: usize| match (cfg.compress_ratio(l), cfg.is_kv_source(l)) {
        (0, _) => "window-only".to_string(),
        (r, true) => format!("ratio-{r} KV source"),
        (r, false) => format!("ratio-{r} reader"),
    };
    let mut parts = Vec::new();
    for (kind, layers, l) in layer_kinds(cfg, label) {
        parts.push(window_rows(&kind, layers, cfg));
        let ratio = cfg.compress_ratio(l);
        if !cfg.is_kv_source(l) || ratio == 0 {
            continue;
        }
        if ratio > 1 {
            parts.push(ring(
                &kind,
                "compressor rows",
                layers,
                2 * head_dim,
                (capacity, 0),
            ));
        }
        parts.push(cache(&kind, "compressed KV", layers, head_dim, ratio));
        parts.push(cache(
            &kind,
            "index keys",
            layers,
            cfg.index_head_dim,
            ratio,
        ));
    }
    parts.extend(dspark_part(cfg));
    if cfg.engram.is_some() {
        parts.push(cache("Engram", ENGRAM_WHAT, 1, 1, 1));
    }
    parts
}

/// V4 (v4-architecture.md §3.1, §3.6): every layer a window ring; CSA/HCA a compressor whose
/// ring keeps the `kv ‖ gate` rows of the groups a future entry pools (`2·series·width` values,
/// `windows·ratio + MAX_BACKTRACK` rows) and one entry per group; CSA a second one for the
/// indexer keys; the MTP block its window (one row behind) and the newest streams; DSpark stages
/// a context ring each.
fn v4_parts(cfg: &ModelConfig) -> Vec<StatePart> {
    let (head_dim, capacity, window) = (cfg.head_dim, window_capacity(cfg), cfg.window_size);
    let kind_of = |l: usize| cfg.v4_attention(l).unwrap_or(V4Attention::Sliding);
    let label = |l: usize| match kind_of(l) {
        V4Attention::Sliding => "sliding".to_string(),
        V4Attention::Csa => format!("CSA ratio {}", cfg.compress_ratio(l)),
        V4Attention::Hca => format!("HCA ratio {}", cfg.compress_ratio(l)),
    };
    let compressor = |parts: &mut Vec<StatePart>,
                      kind: &str,
                      (what_rows, what_entries): (&'static str, &'static str),
                      layers: usize,
                      ratio: usize,
                      overlapping: bool,
                      width: usize| {
        let series = if overlapping { 2 } else { 1 };
        let rows = (series * ratio + MAX_BACKTRACK, (series - 1) * ratio);
        parts.push(ring(kind, what_rows, layers, 2 * series * width, rows));
        parts.push(cache(kind, what_entries, layers, width, ratio));
    };
    let mut parts = Vec::new();
    for (kind, layers, l) in layer_kinds(cfg, label) {
        parts.push(window_rows(&kind, layers, cfg));
        let ratio = cfg.compress_ratio(l);
        match kind_of(l) {
            V4Attention::Sliding => {}
            V4Attention::Hca => compressor(
                &mut parts,
                &kind,
                ("compressor rows", "compressed KV"),
                layers,
                ratio,
                false,
                head_dim,
            ),
            V4Attention::Csa => {
                compressor(
                    &mut parts,
                    &kind,
                    ("compressor rows", "compressed KV"),
                    layers,
                    ratio,
                    true,
                    head_dim,
                );
                compressor(
                    &mut parts,
                    &kind,
                    ("indexer rows", "index keys"),
                    layers,
                    ratio,
                    true,
                    cfg.index_head_dim,
                );
            }
        }
    }
    if cfg.n_mtp_layers() > 0 {
        parts.push(StatePart {
            kind: "MTP block".to_string(),
            what: "window rows",
            copies: 1,
            width: head_dim,
            growth: Growth::Ring {
                capacity,
                lag: 1,
                read: window - 1,
            },
        });
        let streams = cfg.hc.mult * cfg.dim;
        parts.push(ring(
            "MTP block",
            "streams",
            1,
            streams,
            (MAX_BACKTRACK + 1, 1),
        ));
    }
    parts.extend(dspark_part(cfg));
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_bytes_of_every_length_and_align_to_every_ratio() {
        for cfg in [ModelConfig::tiny_v41(), ModelConfig::tiny_v4()] {
            let model = StateBytes::of(&cfg);
            for ratio in cfg.compress_ratios.iter().filter(|&&r| r > 0) {
                assert_eq!(model.block_tokens % ratio, 0, "{:?}", cfg.family);
            }
            for len in 0..4 * model.block_tokens {
                let reserved = model.blocks_for(len) as u64 * model.block_bytes();
                assert!(reserved >= model.bytes(len), "{:?} at {len}", cfg.family);
            }
            // A block of tokens adds exactly block_bytes once the rings are full.
            let full = 2 * model.block_tokens + window_capacity(&cfg) + 1024;
            assert_eq!(
                model.bytes(full + model.block_tokens) - model.bytes(full),
                model.block_bytes()
            );
        }
    }
}
