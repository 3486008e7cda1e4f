//! The DeepSeek ViT (spec §4.1): patch embedding, pre-norm blocks of full bidirectional attention
//! with 2-D RoPE and a SwiGLU MLP, and a final RMSNorm, with the reference's bf16 rounding points
//! (every linear output, the RoPE'd q/k, the attention output, SiLU and its product, each residual
//! add). The attention itself runs in fp32, as torch's math SDPA does for bf16 inputs.

use super::VIT_NORM_EPS;
use super::preprocess::ImageGrid;
use crate::backend::{Backend, Precision, RmsNorm, Tensor};
use crate::checkpoint::Checkpoint;
use crate::config::VisionConfig;
use crate::error::ModelError;
use crate::layers::rope::rope_table;
use crate::quant::{dot_f32, dot_f32_sgemm, exp_f32, round_bf16};

/// A linear layer `[out, inp]` with an optional bias, bf16 values.
#[derive(Debug, Clone)]
pub struct BiasedLinear {
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub out: usize,
    pub inp: usize,
}

impl BiasedLinear {
    /// Loads `<prefix>.weight` (and `<prefix>.bias` when `bias`).
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<BiasedLinear, ModelError> {
        Ok(BiasedLinear {
            weight: ckpt.bf16(&format!("{prefix}.weight"), &[out, inp])?,
            bias: if bias {
                Some(ckpt.bf16(&format!("{prefix}.bias"), &[out])?)
            } else {
                None
            },
            out,
            inp,
        })
    }

    /// `bf16(x · Wᵀ + b)` over rows of `inp`: each dot product accumulated exactly (f64, rounded
    /// once to fp32), the bias added before the one bf16 rounding. This reproduces the reference's
    /// bf16 GEMMs bit for bit on the fixture (every `vit_out` element), where an fp32 sgemm-order
    /// accumulation ([`crate::backend::Backend::linear_f32`]) leaves 46% of them an ulp off.
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let mut y = Vec::with_capacity(x.len() / self.inp.max(1) * self.out);
        for row in x.chunks_exact(self.inp) {
            for (o, w) in self.weight.chunks_exact(self.inp).enumerate() {
                let bias = self.bias.as_ref().map_or(0.0, |b| b[o]);
                y.push(round_bf16(dot_f32(row, w) + bias));
            }
        }
        y
    }
}

/// One ViT block.
#[derive(Debug, Clone)]
pub struct VitBlock {
    pub norm1: Vec<f32>,
    pub wqkv: BiasedLinear,
    pub wo: BiasedLinear,
    pub norm2: Vec<f32>,
    /// `[2 · inter, dim]`: gate rows then up rows.
    pub w1: BiasedLinear,
    pub w2: BiasedLinear,
}

/// The ViT's parameters.
#[derive(Debug, Clone)]
pub struct VitWeights {
    pub dim: usize,
    pub n_heads: usize,
    pub rope_theta: f64,
    pub patch_embed: BiasedLinear,
    pub blocks: Vec<VitBlock>,
    pub norm: Vec<f32>,
}

impl VitWeights {
    /// Loads `vision.*` (norms may be stored BF16 or F32).
    pub fn load(ckpt: &Checkpoint, cfg: &VisionConfig) -> Result<VitWeights, ModelError> {
        let (dim, inter) = (cfg.dim, cfg.inter_dim);
        let patch_values = 3 * cfg.patch_size * cfg.patch_size;
        let blocks = (0..cfg.n_layers)
            .map(|i| {
                let p = format!("vision.blocks.{i}.");
                Ok(VitBlock {
                    norm1: ckpt.bf16_or_f32(&format!("{p}norm1.weight"), &[dim])?,
                    wqkv: BiasedLinear::load(ckpt, &format!("{p}attn.wqkv"), 3 * dim, dim, true)?,
                    wo: BiasedLinear::load(ckpt, &format!("{p}attn.wo"), dim, dim, true)?,
                    norm2: ckpt.bf16_or_f32(&format!("{p}norm2.weight"), &[dim])?,
                    w1: BiasedLinear::load(ckpt, &format!("{p}mlp.w1"), 2 * inter, dim, false)?,
                    w2: BiasedLinear::load(ckpt, &format!("{p}mlp.w2"), dim, inter, false)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(VitWeights {
            dim,
            n_heads: cfg.n_heads,
            rope_theta: cfg.rope_theta,
            patch_embed: BiasedLinear::load(
                ckpt,
                "vision.patch_embed.proj",
                dim,
                patch_values,
                true,
            )?,
            blocks,
            norm: ckpt.bf16_or_f32("vision.norm.weight", &[dim])?,
        })
    }

    /// `[n_patches, 3·p·p]` bf16 patches → `[n_patches, dim]` bf16 features after the final norm.
    pub fn forward(&self, backend: &dyn Backend, patches: &[f32], grid: &ImageGrid) -> Vec<f32> {
        let dim = self.dim;
        let rope = VisionRope::new(grid, dim / self.n_heads, self.rope_theta);
        let mut x = self.patch_embed.apply(patches);
        for block in &self.blocks {
            let h = backend.rms_norm(&Tensor::from(&x), vit_norm(&block.norm1));
            let attn = block.wo.apply(&self.attention(block, &h, &rope));
            add_bf16(&mut x, &attn);
            let h = backend.rms_norm(&Tensor::from(&x), vit_norm(&block.norm2));
            let gate_up = block.w1.apply(&h);
            let mlp = block.w2.apply(&swiglu(&gate_up, block.w2.inp));
            add_bf16(&mut x, &mlp);
        }
        backend.rms_norm(&x.into(), vit_norm(&self.norm)).into_vec()
    }

    /// Full bidirectional multi-head attention of normed rows `h [n, dim]` → `[n, dim]` bf16.
    fn attention(&self, block: &VitBlock, h: &[f32], rope: &VisionRope) -> Vec<f32> {
        let dim = self.dim;
        let head_dim = dim / self.n_heads;
        let n = h.len() / dim;
        let qkv = block.wqkv.apply(h);
        // q and k RoPE'd (bf16) and scaled by sqrt(1/sqrt(head_dim)) each in fp32, as torch's
        // math SDPA does; v as is. All `[n, dim]`, heads side by side.
        let scale = (1.0 / (head_dim as f64).sqrt()).sqrt() as f32;
        let mut q = Vec::with_capacity(n * dim);
        let mut k = Vec::with_capacity(n * dim);
        let mut v = Vec::with_capacity(n * dim);
        for (t, row) in qkv.chunks_exact(3 * dim).enumerate() {
            for head in 0..self.n_heads {
                let at = head * head_dim..(head + 1) * head_dim;
                q.extend(rope.rotate(&row[at.clone()], t).iter().map(|x| x * scale));
                k.extend(
                    rope.rotate(&row[dim + at.start..dim + at.end], t)
                        .iter()
                        .map(|x| x * scale),
                );
            }
            v.extend_from_slice(&row[2 * dim..]);
        }
        let mut out = vec![0.0f32; n * dim];
        for head in 0..self.n_heads {
            let at = |t: usize| t * dim + head * head_dim..t * dim + (head + 1) * head_dim;
            // This head's values by channel: `[head_dim, n]`.
            let v_columns: Vec<f32> = (0..head_dim)
                .flat_map(|c| (0..n).map(move |key| (key, c)))
                .map(|(key, c)| v[key * dim + head * head_dim + c])
                .collect();
            for query in 0..n {
                let scores: Vec<f32> = (0..n)
                    .map(|key| dot_f32_sgemm(&q[at(query)], &k[at(key)]))
                    .collect();
                let probs = softmax(&scores);
                for (c, column) in v_columns.chunks_exact(n.max(1)).enumerate() {
                    out[query * dim + head * head_dim + c] =
                        round_bf16(dot_f32_sgemm(&probs, column));
                }
            }
        }
        out
    }
}

/// The tower's RMSNorm by `weight` (its own eps, bf16 outputs).
fn vit_norm(weight: &[f32]) -> RmsNorm<'_> {
    RmsNorm {
        weight,
        eps: VIT_NORM_EPS,
        precision: Precision::Bf16,
    }
}

/// fp32 softmax of one row: `exp(x − max)` (the vectorised `exp`), times the reciprocal of the sum.
fn softmax(scores: &[f32]) -> Vec<f32> {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let exps: Vec<f32> = scores.iter().map(|&s| exp_f32(s - max)).collect();
    let inv = 1.0 / exps.iter().fold(0.0f32, |a, &e| a + e);
    exps.iter().map(|e| e * inv).collect()
}

/// `x ← bf16(x + y)` (a bf16 residual add).
fn add_bf16(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a = round_bf16(*a + b);
    }
}

/// `bf16(bf16(silu(gate)) · up)` of rows `[gate; up]` (`[n, 2 · inter]`) → `[n, inter]`.
fn swiglu(gate_up: &[f32], inter: usize) -> Vec<f32> {
    gate_up
        .chunks_exact(2 * inter)
        .flat_map(|row| {
            let (gate, up) = row.split_at(inter);
            gate.iter().zip(up).map(|(&g, &u)| {
                let silu = round_bf16(g / (1.0 + exp_f32(-g)));
                round_bf16(silu * u)
            })
        })
        .collect()
}

/// The ViT's 2-D RoPE: patch `t` at grid (row, col) has the angles
/// `[row·f_0 … row·f_{m−1}, col·f_0 … col·f_{m−1}]` (`m = head_dim / 4`, `f_i = θ^(−4i/head_dim)`,
/// all fp32), and channel `i` of a head rotates with channel `i + head_dim/2` (rotate-half).
#[derive(Debug, Clone)]
struct VisionRope {
    half: usize,
    /// `[n_patches, half]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl VisionRope {
    fn new(grid: &ImageGrid, head_dim: usize, theta: f64) -> VisionRope {
        let half = head_dim / 2;
        let freqs = rope_table(half, theta, None).freqs;
        let mut angles = Vec::with_capacity(grid.n_patches() * half);
        for row in 0..grid.n_vit_h {
            for col in 0..grid.n_vit_w {
                angles.extend(freqs.iter().map(|f| row as f32 * f));
                angles.extend(freqs.iter().map(|f| col as f32 * f));
            }
        }
        VisionRope {
            half,
            cos: angles.iter().map(|&a| f64::from(a).cos() as f32).collect(),
            sin: angles.iter().map(|&a| f64::from(a).sin() as f32).collect(),
        }
    }

    /// One head vector of patch `t` rotated, rounded to bf16.
    fn rotate(&self, x: &[f32], t: usize) -> Vec<f32> {
        let half = self.half;
        let cos = &self.cos[t * half..(t + 1) * half];
        let sin = &self.sin[t * half..(t + 1) * half];
        let (x1, x2) = x.split_at(half);
        let first = (0..half).map(|i| round_bf16(x1[i] * cos[i] - x2[i] * sin[i]));
        let second = (0..half).map(|i| round_bf16(x2[i] * cos[i] + x1[i] * sin[i]));
        first.chain(second).collect()
    }
}
