//! The `fast` sink attention (`ops::attention::sparse_attention_sink_rows_ptr_fast`, tensor
//! cores) through `CudaBackend::sparse_attention_rows` with `Numerics::Fast` at the bf16
//! rounding points, against the exact kernel (bitwise the CPU reference) within a bound derived
//! from its arithmetic; deterministic and batch invariant; a one-key change is seen.
//!
//! The bound, per output `o` of a head with keys `v_j`: with `s_j` the f64 scores, `m` their max,
//! `p_j = exp(s_j − m)`, `L = Σ p_j + exp(sink − m)`, `A = Σ p_j |v_j| / L`, `n` keys and
//! `δ = (D · 2^-23 + 2^-24) · max_j scale · Σ_d |q_d k_jd|` (fp32 accumulation of D exact bf16
//! products, each addition rounding at most 2^-23 relative, for the fast scores; the exact
//! kernel's f64 scores are exact to 2^-24 after their one rounding):
//! `|o_fast − o_exact| ≤ (2^-8 + 4δ + n · 2^-23) · A + (2^-8 + 2δ + n · 2^-23) · |o_exact|` —
//! the two sides round each weight to bf16 from values that differ by a factor `e^{±2δ}` (2^-8
//! for the two roundings, 2δ for the scores, twice for the weights' and the denominator's share),
//! sum their weights and outputs in fp32 in different orders (n · 2^-23), and round the output to
//! bf16 once each (2^-8 together).
//!
//! Every head block of the launcher (16, 32 or 64 heads sharing each key tile) gives the same
//! bits, with one split and with many (negative control: a scale one ulp off, every score
//! rounded once differently, is seen at the real width).
//!
//! The f32 form (`Rounding::F32`, V4's plain f32 precision: q, the keys and the weights each
//! split into two bf16 pieces, the output unrounded), on f32 data of realistic spreads (q scaled
//! per head from 2^-2 to 2^2, keys of magnitudes 2^-2 to 2, sinks in [-3, 5)), against the f64
//! value of the same attention within the bound derived in kernels/src/ops/attention.rs (per key:
//! the split scores' `δ_j`, the exponentials' factors, the split products and fp32 sums), in both
//! launch forms and for 0 … 700 keys (one tile, one split, 2 to 11 splits); negative control: the
//! bf16 form on the same f32 inputs (operands rounded to bf16, 2^-9 each) leaves that bound.
//! Every head block (16 or 32 heads) and form gives the same bits; a query alone gives its bits
//! among 299 others of other key counts (the whole-query form there, split blocks alone); the
//! backend takes it in `Numerics::Fast` at `Precision::F32` (tensor-core launches), deterministic
//! and batch invariant.

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::attention::{
    AttentionRows, DeviceKeyLists, FastAttentionBlocks, FastHeadBlock,
    sparse_attention_sink_rows_ptr_fast,
};
use deepinfer_kernels::ops::key_table::{DeviceKeyTable, key_row_address};
use deepinfer_model::backend::cuda::{CudaBackend, Numerics};
use deepinfer_model::backend::{
    AttentionQueries, Backend, CpuBackend, Precision, QueryKeys, Tensor,
};

use crate::gpu_support::{Rng, bf16_unit, differing};

/// The shapes the fast kernel serves (head_dim 64 … 512; heads not a multiple of 16 included),
/// and key counts around its 16-key tiles.
const SHAPES: [(usize, usize); 3] = [(4, 64), (6, 128), (64, 512)];
const KEY_COUNTS: [usize; 8] = [0, 1, 15, 16, 17, 100, 333, 700];

fn fast_backend() -> CudaBackend {
    CudaBackend::open(0, Numerics::Fast).expect("the fast attention tests need the CUDA device")
}

/// One batch: `q [n, heads · head_dim]` and each query's key list (every key its own tensor, as
/// a sequence's window and compressed rows are).
#[derive(Clone)]
struct Batch {
    q: Tensor,
    keys: Vec<Vec<Tensor>>,
    sink: Vec<f32>,
    scale: f32,
    precision: Precision,
}

impl Batch {
    /// bf16 values at `Precision::Bf16`; f32 values of realistic spreads at `Precision::F32`
    /// ([`f32_q`], [`f32_key`], [`f32_sink`]).
    fn new(rng: &mut Rng, heads: usize, head_dim: usize, precision: Precision) -> Batch {
        if precision == Precision::F32 {
            let keys: Vec<Vec<Tensor>> = KEY_COUNTS
                .iter()
                .map(|&count| {
                    (0..count)
                        .map(|_| Tensor::from(f32_key(rng, head_dim)))
                        .collect()
                })
                .collect();
            return Batch {
                q: Tensor::from(f32_q(rng, KEY_COUNTS.len(), heads, head_dim)),
                keys,
                sink: f32_sink(rng, heads),
                scale: (head_dim as f32).powf(-0.5),
                precision,
            };
        }
        let keys: Vec<Vec<Tensor>> = KEY_COUNTS
            .iter()
            .map(|&count| {
                (0..count)
                    .map(|_| Tensor::from(bf16_unit(rng, head_dim)))
                    .collect()
            })
            .collect();
        Batch {
            q: Tensor::from(bf16_unit(rng, KEY_COUNTS.len() * heads * head_dim)),
            keys,
            sink: (0..heads).map(|_| 2.0 * rng.uniform()).collect(),
            scale: (head_dim as f32).powf(-0.5),
            precision,
        }
    }

    fn key_refs(&self) -> Vec<QueryKeys<'_>> {
        self.keys
            .iter()
            .map(|list| QueryKeys::listed(list.iter().collect()))
            .collect()
    }

    fn run(&self, backend: &dyn Backend) -> Vec<f32> {
        backend
            .sparse_attention_rows(
                AttentionQueries {
                    q: &self.q,
                    sink: &self.sink,
                    scale: self.scale,
                    precision: self.precision,
                },
                &self.key_refs(),
            )
            .to_vec()
    }
}

/// The bound of the module header for every output of `batch`, around `exact`.
fn bounds(batch: &Batch, heads: usize, head_dim: usize, exact: &[f32]) -> Vec<f64> {
    let width = heads * head_dim;
    let mut bounds = vec![0.0; exact.len()];
    for (t, keys) in batch.keys.iter().enumerate() {
        let n = keys.len();
        for h in 0..heads {
            let q = &batch.q[t * width + h * head_dim..t * width + (h + 1) * head_dim];
            let scale = f64::from(batch.scale);
            let (scores, magnitudes): (Vec<f64>, Vec<f64>) = keys
                .iter()
                .map(|k| {
                    let dot: f64 = q
                        .iter()
                        .zip(&k[..])
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum();
                    let abs: f64 = q
                        .iter()
                        .zip(&k[..])
                        .map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs())
                        .sum();
                    (dot * scale, abs * scale)
                })
                .unzip();
            let delta = (head_dim as f64 * 2f64.powi(-23) + 2f64.powi(-24))
                * magnitudes.iter().copied().fold(0.0, f64::max);
            let max = scores.iter().copied().fold(-1e30, f64::max);
            let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let denominator = p.iter().sum::<f64>() + (f64::from(batch.sink[h]) - max).exp();
            let sums = n as f64 * 2f64.powi(-23);
            for d in 0..head_dim {
                let a: f64 = p
                    .iter()
                    .zip(keys)
                    .map(|(p, k)| p * f64::from(k[d]).abs())
                    .sum::<f64>()
                    / denominator;
                let i = t * width + h * head_dim + d;
                bounds[i] = (2f64.powi(-8) + 4.0 * delta + sums) * a
                    + (2f64.powi(-8) + 2.0 * delta + sums) * f64::from(exact[i]).abs();
            }
        }
    }
    bounds
}

#[test]
fn fast_attention_is_within_its_bound_of_the_exact_kernel() {
    let fast = fast_backend();
    let cpu = CpuBackend::new();
    let mut rng = Rng(7);
    for (heads, head_dim) in SHAPES {
        let batch = Batch::new(&mut rng, heads, head_dim, Precision::Bf16);
        let got = batch.run(&fast);
        let exact = batch.run(&cpu);
        let bound = bounds(&batch, heads, head_dim, &exact);
        let mut worst = 0.0f64;
        for i in 0..got.len() {
            let error = (f64::from(got[i]) - f64::from(exact[i])).abs();
            assert!(
                error <= bound[i],
                "h{heads} d{head_dim} output {i}: fast {} exact {} (error {error:e} > bound {:e})",
                got[i],
                exact[i],
                bound[i]
            );
            if bound[i] > 0.0 {
                worst = worst.max(error / bound[i]);
            }
        }
        // The fast kernel ran (it sums in another order than the exact one, so some bf16
        // outputs differ) and no query was left out.
        let changed = differing(&got, &exact);
        println!(
            "fast attention h{heads} d{head_dim}: {} outputs, {changed} differ from the exact \
             kernel, worst error / bound = {worst:.3}",
            got.len()
        );
        if head_dim == 512 {
            assert!(
                changed > 0,
                "h{heads} d{head_dim}: the fast kernel did not run"
            );
        }
    }
}

#[test]
fn fast_attention_is_deterministic_and_batch_invariant() {
    check_deterministic_and_batch_invariant(Precision::Bf16, 11);
}

/// The f32 form through the backend: `Numerics::Fast` at `Precision::F32` (V4) takes the
/// tensor-core kernel (its launches counted by the op profile), run to run and alone vs in the
/// batch the same bits.
#[test]
fn fast_f32_attention_is_taken_by_the_backend_deterministic_and_batch_invariant() {
    check_deterministic_and_batch_invariant(Precision::F32, 17);
    let fast = fast_backend();
    let batch = Batch::new(&mut Rng(19), 6, 128, Precision::F32);
    let profile = fast.op_profile();
    profile.set_enabled(true);
    batch.run(&fast);
    profile.set_enabled(false);
    let launches = profile
        .take()
        .get("sparse_attention_rows")
        .map_or(0, |s| s.tensor_core_launches);
    assert!(
        launches > 0,
        "the fast backend ran V4's f32 attention off the tensor cores"
    );
}

fn check_deterministic_and_batch_invariant(precision: Precision, seed: u64) {
    let fast = fast_backend();
    let mut rng = Rng(seed);
    for (heads, head_dim) in SHAPES {
        let batch = Batch::new(&mut rng, heads, head_dim, precision);
        let width = heads * head_dim;
        let all = batch.run(&fast);
        assert_eq!(
            differing(&all, &batch.run(&fast)),
            0,
            "h{heads} d{head_dim} {precision:?}: run to run"
        );
        // Every query alone gives the bits it has inside the batch.
        for (t, keys) in batch.keys.iter().enumerate() {
            let alone = Batch {
                q: Tensor::from(batch.q[t * width..(t + 1) * width].to_vec()),
                keys: vec![keys.clone()],
                ..batch.clone()
            };
            assert_eq!(
                differing(&alone.run(&fast), &all[t * width..(t + 1) * width]),
                0,
                "h{heads} d{head_dim} {precision:?} query {t} ({} keys): alone vs in the batch",
                keys.len()
            );
        }
        // Negative control: one key of the longest list changed is seen by that query only.
        let mut changed = batch.clone();
        let last = changed.keys.len() - 1;
        let mut key = changed.keys[last][3].to_vec();
        key.iter_mut().for_each(|v| *v = -*v);
        changed.keys[last][3] = Tensor::from(key);
        let other = changed.run(&fast);
        assert!(
            differing(&other[last * width..], &all[last * width..]) > 0,
            "h{heads} d{head_dim} {precision:?}: a changed key was not seen"
        );
        assert_eq!(
            differing(&other[..last * width], &all[..last * width]),
            0,
            "h{heads} d{head_dim} {precision:?}: a changed key of one query moved another"
        );
    }
}

/// f32 attention inputs of realistic spreads (not bf16 values): q uniform times a per-head
/// scale 2^-2 … 2^2 (score spreads from flat to peaked: [`f32_q`]), key elements uniform times
/// 2^-2 … 2 ([`f32_key`]), sinks in [-3, 5) ([`f32_sink`]).
fn f32_q(rng: &mut Rng, queries: usize, heads: usize, head_dim: usize) -> Vec<f32> {
    (0..queries * heads * head_dim)
        .map(|i| rng.uniform() * 2f32.powi((i / head_dim % heads % 5) as i32 - 2))
        .collect()
}

fn f32_key(rng: &mut Rng, head_dim: usize) -> Vec<f32> {
    (0..head_dim)
        .map(|_| rng.uniform() * 2f32.powi(rng.below(4) as i32 - 2))
        .collect()
}

fn f32_sink(rng: &mut Rng, heads: usize) -> Vec<f32> {
    (0..heads).map(|_| 1.0 + 4.0 * rng.uniform()).collect()
}

/// One launch of the fast kernel on a key buffer's rows through a pointer table, with the
/// rounding (the kernel), the head block and form given (`None`: the launcher's choice) and the
/// scale; the outputs start as NaN.
struct DirectCase {
    heads: usize,
    head_dim: usize,
    q: Vec<f32>,
    sink: Vec<f32>,
    lists: Vec<Vec<u32>>,
    keys: Vec<f32>,
}

impl DirectCase {
    const ROWS: usize = 1500;

    /// bf16 values for `Rounding::Bf16`, f32 values of realistic spreads for `Rounding::F32`.
    fn new(
        rng: &mut Rng,
        heads: usize,
        head_dim: usize,
        key_counts: &[usize],
        data: Rounding,
    ) -> DirectCase {
        let lists = key_counts
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|_| rng.below(Self::ROWS as u64) as u32)
                    .collect()
            })
            .collect();
        let queries = key_counts.len();
        match data {
            Rounding::Bf16 => DirectCase {
                heads,
                head_dim,
                q: bf16_unit(rng, queries * heads * head_dim),
                sink: (0..heads).map(|_| 2.0 * rng.uniform()).collect(),
                lists,
                keys: bf16_unit(rng, Self::ROWS * head_dim),
            },
            Rounding::F32 => DirectCase {
                heads,
                head_dim,
                q: f32_q(rng, queries, heads, head_dim),
                sink: f32_sink(rng, heads),
                lists,
                keys: (0..Self::ROWS)
                    .flat_map(|_| f32_key(rng, head_dim))
                    .collect(),
            },
        }
    }

    fn run(
        &self,
        rt: &KernelRuntime,
        rounding: Rounding,
        blocks: FastAttentionBlocks,
        scale: f32,
    ) -> Vec<f32> {
        self.try_run(rt, rounding, blocks, scale)
            .expect("fast attention")
    }

    fn try_run(
        &self,
        rt: &KernelRuntime,
        rounding: Rounding,
        blocks: FastAttentionBlocks,
        scale: f32,
    ) -> Result<Vec<f32>, deepinfer_kernels::KernelError> {
        let stream = rt.stream();
        let keys = stream.clone_htod(&self.keys).expect("keys");
        let addresses: Vec<u64> = (0..Self::ROWS)
            .map(|r| key_row_address(rt, &keys, r * self.head_dim, self.head_dim).expect("row"))
            .collect();
        // SAFETY: every address is a head_dim row of `keys`, alive until the download below has
        // synchronised the stream.
        let table =
            unsafe { DeviceKeyTable::upload(rt, &addresses, self.head_dim) }.expect("table");
        let lists = DeviceKeyLists::upload(rt, &self.lists, Self::ROWS).expect("lists");
        let q = stream.clone_htod(&self.q).expect("q");
        let sink = stream.clone_htod(&self.sink).expect("sink");
        let mut out = stream
            .clone_htod(&vec![f32::NAN; self.q.len()])
            .expect("out");
        let rows = AttentionRows {
            q: &q,
            lists: &lists,
            sink: &sink,
            head_dim: self.head_dim,
            scale,
            rounding,
        };
        sparse_attention_sink_rows_ptr_fast(rt, rows, &table, &mut out, blocks)?;
        let got = stream.clone_dtoh(&out).expect("download");
        drop(keys);
        Ok(got)
    }

    fn key(&self, row: u32) -> &[f32] {
        let r = row as usize;
        &self.keys[r * self.head_dim..(r + 1) * self.head_dim]
    }

    /// The f64 value of every output and the bound of the f32 form around it
    /// (kernels/src/ops/attention.rs): per query and head, with `S_j = scale · Σ_d |q_d k_jd|`,
    /// `δ_j = (3.01 · 2^-16 + 215 · 2^-23) S_j`, `R = max_j |s_j − M| + |sink − M| + 1` (beyond
    /// every exponential's argument: the fast scores are within δ_j < 1/2 of these),
    /// `c = SPLIT_TILES + splits` exponential factors a weight, `ε_j = δ_j (1 + δ_j) + c (2^-22 +
    /// 2^-24 R)`, `ε_sink = 2^-22 + 2^-24 R`, `e_v = 3.01 · 2^-16 + 215 · 2^-23 + (SPLIT_TILES +
    /// 3 · splits) · 2^-24`, `e_l = (5 + 2 · SPLIT_TILES + 3 · splits) · 2^-24`:
    /// `|ô − o| ≤ (Σ_j p_j ε_j (|v_j| + |o|) + ε_sink σ |o| + e_v Σ_j p_j |v_j| + e_l L |o|) /
    /// (L (1 − ε − e_l)) + 2^-23 |o|`.
    fn f64_values_and_f32_bounds(&self, scale: f32) -> (Vec<f64>, Vec<f64>) {
        const SPLIT_TILES: f64 = 4.0;
        let p2 = |e: i32| 2f64.powi(e);
        let (heads, head_dim) = (self.heads, self.head_dim);
        let width = heads * head_dim;
        let mut values = vec![0.0; self.q.len()];
        let mut bounds = vec![0.0; self.q.len()];
        let scale = f64::from(scale);
        for (t, list) in self.lists.iter().enumerate() {
            let splits = list.len().div_ceil(64).max(1) as f64;
            let e_v = 3.01 * p2(-16) + 215.0 * p2(-23) + (SPLIT_TILES + 3.0 * splits) * p2(-24);
            let e_l = (5.0 + 2.0 * SPLIT_TILES + 3.0 * splits) * p2(-24);
            for h in 0..heads {
                let q = &self.q[t * width + h * head_dim..t * width + (h + 1) * head_dim];
                let (scores, sizes): (Vec<f64>, Vec<f64>) = list
                    .iter()
                    .map(|&row| {
                        let k = self.key(row);
                        let products = q.iter().zip(k).map(|(&a, &b)| f64::from(a) * f64::from(b));
                        let dot: f64 = products.clone().sum();
                        let size: f64 = products.map(f64::abs).sum();
                        (dot * scale, size * scale)
                    })
                    .unzip();
                if list.is_empty() {
                    continue; // only the sink: exactly 0, bound 0
                }
                let sink = f64::from(self.sink[h]);
                let max = scores.iter().copied().fold(f64::MIN, f64::max);
                let r =
                    scores.iter().map(|s| max - s).fold(0.0, f64::max) + (sink - max).abs() + 1.0;
                let c = SPLIT_TILES + splits;
                let eps: Vec<f64> = sizes
                    .iter()
                    .map(|size| {
                        let delta = (3.01 * p2(-16) + 215.0 * p2(-23)) * size;
                        delta * (1.0 + delta) + c * (p2(-22) + p2(-24) * r)
                    })
                    .collect();
                let eps_sink = p2(-22) + p2(-24) * r;
                let eps_max = eps.iter().copied().fold(eps_sink, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sigma = (sink - max).exp();
                let l = p.iter().sum::<f64>() + sigma;
                for d in 0..head_dim {
                    let (mut num, mut weighted, mut eps_weighted, mut eps_p) = (0.0, 0.0, 0.0, 0.0);
                    for (j, &row) in list.iter().enumerate() {
                        let v = f64::from(self.key(row)[d]);
                        num += p[j] * v;
                        weighted += p[j] * v.abs();
                        eps_weighted += p[j] * eps[j] * v.abs();
                        eps_p += p[j] * eps[j];
                    }
                    let o = num / l;
                    let i = t * width + h * head_dim + d;
                    values[i] = o;
                    bounds[i] = (eps_weighted
                        + (eps_p + eps_sink * sigma) * o.abs()
                        + e_v * weighted
                        + e_l * l * o.abs())
                        / (l * (1.0 - eps_max - e_l))
                        + p2(-23) * o.abs();
                }
            }
        }
        (values, bounds)
    }
}

/// The shapes of the head-block tests: heads that fill every block, that leave part of one (40 =
/// 2.5 groups, 6) and fewer than a group (4: the tiny configs); key counts of one split (0 … 64
/// keys, a whole split and a partial tile) and of many (65: 2, 112: 2, 333: 6, 700: 11). The
/// whole-query kernel's rounds of two tiles end one tile short at 1, 16, 33, 48 (a list of odd
/// tiles), 65 and 333 (a last split of one tile) and 112 (a last split of three).
const BLOCK_SHAPES: [(usize, usize); 4] = [(64, 512), (40, 256), (6, 128), (4, 64)];
const BLOCK_KEY_COUNTS: [usize; 11] = [700, 64, 17, 1, 0, 65, 333, 33, 16, 48, 112];

#[test]
fn every_head_block_gives_the_same_bits() {
    check_head_blocks(Rounding::Bf16, 13);
}

/// The f32 kernels' blocks (16 or 32 heads) and both forms give the same bits; 64 heads a block
/// is refused (its two pieces of q and the key tile do not fit the shared memory).
#[test]
fn every_f32_head_block_gives_the_same_bits() {
    check_head_blocks(Rounding::F32, 23);
}

fn check_head_blocks(rounding: Rounding, seed: u64) {
    let rt = crate::open();
    let mut rng = Rng(seed);
    for (heads, head_dim) in BLOCK_SHAPES {
        let case = DirectCase::new(&mut rng, heads, head_dim, &BLOCK_KEY_COUNTS, rounding);
        let scale = (head_dim as f32).powf(-0.5);
        let split_blocks = |heads| FastAttentionBlocks {
            heads,
            whole_queries: Some(false),
        };
        let reference = case.run(
            &rt,
            rounding,
            split_blocks(Some(FastHeadBlock::Heads16)),
            scale,
        );
        assert!(
            reference.iter().all(|v| v.is_finite()),
            "h{heads} d{head_dim} {rounding:?}: an output was left unwritten"
        );
        // Every head block in both forms (a block per split with the combine; a block per query
        // merging its splits itself), and the launcher's own choices.
        for block in FastHeadBlock::ALL.map(Some).into_iter().chain([None]) {
            for whole_queries in [Some(false), Some(true), None] {
                let blocks = FastAttentionBlocks {
                    heads: block,
                    whole_queries,
                };
                if block.is_some_and(|block| !block.fits(rounding)) {
                    assert!(
                        case.try_run(&rt, rounding, blocks, scale).is_err(),
                        "{rounding:?} took {blocks:?}, wider than its kernels' blocks"
                    );
                    continue;
                }
                if whole_queries == Some(true)
                    && block == Some(FastHeadBlock::Heads64)
                    && head_dim == 512
                {
                    continue; // 1024 threads: more than a whole-query block takes (tested below)
                }
                let got = case.run(&rt, rounding, blocks, scale);
                assert_eq!(
                    differing(&got, &reference),
                    0,
                    "h{heads} d{head_dim} {rounding:?} {blocks:?}: differs from 16 heads a \
                     block, split blocks"
                );
            }
        }
        // Negative control: the scale one ulp up moves every score by about one rounding, as a
        // block summing in another order would; at the real width (32 768 outputs a query) some
        // bf16 outputs show it (an emulation saw 2 to 290 of this case's, never 0 in 40 draws).
        // The narrow shapes have too few outputs for a one-rounding change to reach bf16; the
        // f32 form's unrounded outputs show it at every shape.
        let widest = if rounding == Rounding::Bf16 {
            FastHeadBlock::Heads64
        } else {
            FastHeadBlock::Heads32
        };
        let nudged = case.run(
            &rt,
            rounding,
            split_blocks(Some(widest)),
            f32::from_bits(scale.to_bits() + 1),
        );
        let seen = differing(&nudged, &reference);
        println!("h{heads} d{head_dim} {rounding:?}: a one-ulp scale changes {seen} outputs");
        if head_dim == 512 || rounding == Rounding::F32 {
            assert!(
                seen > 0,
                "h{heads} d{head_dim} {rounding:?}: a one-ulp scale was not seen"
            );
        }
    }
}

/// The f32 form against the f64 value of the same attention within its derived bound, in both
/// launch forms (split blocks with the combine, whole queries) and the launcher's choice, for 0,
/// 1, 15, 16 (one tile), 17, 64 (one split), 65, 333 and 700 keys (2, 6, 11 splits). Negative
/// control: the bf16 form on the same f32 inputs (q, keys and weights rounded to bf16, 2^-9
/// each, the output too) leaves the bound — at head_dim ≤ 128, where the bound is tightest, it
/// must: a one-key query's bound in the heads of q scaled 2^-2 is near 2^-12.7 of its output
/// (`S ≈ 0.47`: `2 ε + e_v`), which bf16's output rounding alone (up to 2^-9) exceeds for most
/// values.
#[test]
fn fast_f32_attention_is_within_its_bound_of_the_f64_value() {
    let rt = crate::open();
    let mut rng = Rng(29);
    let key_counts = [0usize, 1, 15, 16, 17, 64, 65, 333, 700];
    for (heads, head_dim) in BLOCK_SHAPES {
        let case = DirectCase::new(&mut rng, heads, head_dim, &key_counts, Rounding::F32);
        let scale = (head_dim as f32).powf(-0.5);
        let (exact, bound) = case.f64_values_and_f32_bounds(scale);
        for whole_queries in [Some(false), Some(true), None] {
            let blocks = FastAttentionBlocks {
                heads: None,
                whole_queries,
            };
            let got = case.run(&rt, Rounding::F32, blocks, scale);
            let mut worst = 0.0f64;
            for i in 0..got.len() {
                let error = (f64::from(got[i]) - exact[i]).abs();
                assert!(
                    error <= bound[i],
                    "h{heads} d{head_dim} {blocks:?} output {i} (query {}): fast {} exact {} \
                     (error {error:e} > bound {:e})",
                    i / (heads * head_dim),
                    got[i],
                    exact[i],
                    bound[i]
                );
                if bound[i] > 0.0 {
                    worst = worst.max(error / bound[i]);
                }
            }
            println!(
                "fast f32 attention h{heads} d{head_dim} {blocks:?}: worst error / bound = \
                 {worst:.4}"
            );
        }
        // Negative control: the bf16 kernel on the same f32 inputs.
        let bf16 = case.run(&rt, Rounding::Bf16, FastAttentionBlocks::default(), scale);
        let outside = (0..bf16.len())
            .filter(|&i| (f64::from(bf16[i]) - exact[i]).abs() > bound[i])
            .count();
        println!(
            "h{heads} d{head_dim}: the bf16 form leaves the f32 bound at {outside} of {} outputs",
            bf16.len()
        );
        if head_dim <= 128 {
            assert!(
                outside > 0,
                "h{heads} d{head_dim}: the bound cannot tell bf16 operands from split ones"
            );
        }
    }
}

/// A query's f32 outputs alone (a decode step: split blocks and the combine) equal its outputs
/// among 299 queries of other key counts (a prefill: the launcher's whole-query form), at
/// V4-Flash's width; negative control: a changed key of that query is seen.
#[test]
fn fast_f32_attention_is_batch_invariant_across_the_launch_forms() {
    let rt = crate::open();
    let mut rng = Rng(31);
    let (heads, head_dim) = (64usize, 512usize);
    let key_counts: Vec<usize> = (0..300)
        .map(|t| {
            if t == 137 {
                333
            } else {
                rng.below(701) as usize
            }
        })
        .collect();
    let case = DirectCase::new(&mut rng, heads, head_dim, &key_counts, Rounding::F32);
    let scale = (head_dim as f32).powf(-0.5);
    let width = heads * head_dim;
    let all = case.run(&rt, Rounding::F32, FastAttentionBlocks::default(), scale);
    let probe = 137;
    let alone = DirectCase {
        heads,
        head_dim,
        q: case.q[probe * width..(probe + 1) * width].to_vec(),
        sink: case.sink.clone(),
        lists: vec![case.lists[probe].clone()],
        keys: case.keys.clone(),
    };
    let got = alone.run(&rt, Rounding::F32, FastAttentionBlocks::default(), scale);
    assert_eq!(
        differing(&got, &all[probe * width..(probe + 1) * width]),
        0,
        "a query's f32 outputs alone differ from its outputs among 299 others"
    );
    let mut changed = alone;
    changed.lists[0][5] = (changed.lists[0][5] + 1) % DirectCase::ROWS as u32;
    assert!(
        differing(
            &changed.run(&rt, Rounding::F32, FastAttentionBlocks::default(), scale),
            &got
        ) > 0,
        "a changed key of the query was not seen"
    );
}
