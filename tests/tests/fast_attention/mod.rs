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

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::ops::attention::{
    DeviceKeyLists, FastAttentionBlocks, FastHeadBlock, sparse_attention_sink_rows_ptr_fast,
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
struct Batch {
    q: Tensor,
    keys: Vec<Vec<Tensor>>,
    sink: Vec<f32>,
    scale: f32,
}

impl Batch {
    fn new(rng: &mut Rng, heads: usize, head_dim: usize) -> Batch {
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
                    precision: Precision::Bf16,
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
        let batch = Batch::new(&mut rng, heads, head_dim);
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
    let fast = fast_backend();
    let mut rng = Rng(11);
    for (heads, head_dim) in SHAPES {
        let batch = Batch::new(&mut rng, heads, head_dim);
        let width = heads * head_dim;
        let all = batch.run(&fast);
        assert_eq!(
            differing(&all, &batch.run(&fast)),
            0,
            "h{heads} d{head_dim}: run to run"
        );
        // Every query alone gives the bits it has inside the batch.
        for (t, keys) in batch.keys.iter().enumerate() {
            let alone = Batch {
                q: Tensor::from(batch.q[t * width..(t + 1) * width].to_vec()),
                keys: vec![keys.clone()],
                sink: batch.sink.clone(),
                scale: batch.scale,
            };
            assert_eq!(
                differing(&alone.run(&fast), &all[t * width..(t + 1) * width]),
                0,
                "h{heads} d{head_dim} query {t} ({} keys): alone vs in the batch",
                keys.len()
            );
        }
        // Negative control: one key of the longest list changed is seen by that query only.
        let mut changed = Batch {
            q: batch.q.clone(),
            keys: batch.keys.clone(),
            sink: batch.sink.clone(),
            scale: batch.scale,
        };
        let last = changed.keys.len() - 1;
        let mut key = changed.keys[last][3].to_vec();
        key.iter_mut().for_each(|v| *v = -*v);
        changed.keys[last][3] = Tensor::from(key);
        let other = changed.run(&fast);
        assert!(
            differing(&other[last * width..], &all[last * width..]) > 0,
            "h{heads} d{head_dim}: a changed key was not seen"
        );
        assert_eq!(
            differing(&other[..last * width], &all[..last * width]),
            0,
            "h{heads} d{head_dim}: a changed key of one query moved another"
        );
    }
}

/// One launch of the fast kernel on a key buffer's rows through a pointer table, with the head
/// block given (`None`: the launcher's choice) and the scale; the outputs start as NaN.
struct DirectCase {
    head_dim: usize,
    q: Vec<f32>,
    sink: Vec<f32>,
    lists: Vec<Vec<u32>>,
    keys: Vec<f32>,
}

impl DirectCase {
    const ROWS: usize = 1500;

    fn new(rng: &mut Rng, heads: usize, head_dim: usize, key_counts: &[usize]) -> DirectCase {
        let lists = key_counts
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|_| rng.below(Self::ROWS as u64) as u32)
                    .collect()
            })
            .collect();
        DirectCase {
            head_dim,
            q: bf16_unit(rng, key_counts.len() * heads * head_dim),
            sink: (0..heads).map(|_| 2.0 * rng.uniform()).collect(),
            lists,
            keys: bf16_unit(rng, Self::ROWS * head_dim),
        }
    }

    fn run(&self, rt: &KernelRuntime, blocks: FastAttentionBlocks, scale: f32) -> Vec<f32> {
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
        sparse_attention_sink_rows_ptr_fast(
            rt,
            &q,
            &table,
            &lists,
            &sink,
            &mut out,
            self.head_dim,
            scale,
            blocks,
        )
        .expect("fast attention");
        let got = stream.clone_dtoh(&out).expect("download");
        drop(keys);
        got
    }
}

#[test]
fn every_head_block_gives_the_same_bits() {
    let rt = crate::open();
    let mut rng = Rng(13);
    // Heads that fill every block, that leave part of one (40 = 2.5 groups, 6) and fewer than a
    // group (4: the tiny configs); key counts of one split (0 … 64 keys, a whole split and a
    // partial tile) and of many (65: 2, 333: 6, 700: 11).
    let shapes = [(64usize, 512usize), (40, 256), (6, 128), (4, 64)];
    let key_counts = [700usize, 64, 17, 1, 0, 65, 333, 33];
    for (heads, head_dim) in shapes {
        let case = DirectCase::new(&mut rng, heads, head_dim, &key_counts);
        let scale = (head_dim as f32).powf(-0.5);
        let split_blocks = |heads| FastAttentionBlocks {
            heads,
            whole_queries: Some(false),
        };
        let reference = case.run(&rt, split_blocks(Some(FastHeadBlock::Heads16)), scale);
        assert!(
            reference.iter().all(|v| v.is_finite()),
            "h{heads} d{head_dim}: an output was left unwritten"
        );
        // Every head block in both forms (a block per split with the combine; a block per query
        // merging its splits itself), and the launcher's own choices.
        for block in FastHeadBlock::ALL.map(Some).into_iter().chain([None]) {
            for whole_queries in [Some(false), Some(true), None] {
                let blocks = FastAttentionBlocks {
                    heads: block,
                    whole_queries,
                };
                if whole_queries == Some(true)
                    && block == Some(FastHeadBlock::Heads64)
                    && head_dim == 512
                {
                    continue; // 1024 threads: more than a whole-query block takes (tested below)
                }
                let got = case.run(&rt, blocks, scale);
                assert_eq!(
                    differing(&got, &reference),
                    0,
                    "h{heads} d{head_dim} {blocks:?}: differs from 16 heads a block, split blocks"
                );
            }
        }
        // Negative control: the scale one ulp up moves every score by about one rounding, as a
        // block summing in another order would; at the real width (32 768 outputs a query) some
        // bf16 outputs show it (an emulation saw 2 to 290 of this case's, never 0 in 40 draws).
        // The narrow shapes have too few outputs for a one-rounding change to reach bf16.
        let nudged = case.run(
            &rt,
            split_blocks(Some(FastHeadBlock::Heads64)),
            f32::from_bits(scale.to_bits() + 1),
        );
        let seen = differing(&nudged, &reference);
        println!("h{heads} d{head_dim}: a one-ulp scale changes {seen} outputs");
        if head_dim == 512 {
            assert!(
                seen > 0,
                "h{heads} d{head_dim}: a one-ulp scale was not seen"
            );
        }
    }
}
