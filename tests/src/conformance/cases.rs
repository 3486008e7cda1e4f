//! The op cases of the conformance harness, one function per op family: odd shapes, both
//! precisions, empty inputs, edge values (ties, ±0, ±∞, NaN, subnormal scales), each case's
//! inputs drawn from its own seed when the case is built. A batch's rows are also checked against
//! the op on each row alone (batch invariance, on every backend).

use deepinfer_model::backend::weights::Linear;
use deepinfer_model::backend::{
    AttentionQueries, Backend, CandidateMask, Candidates, CompressedKeys, CpuBackend, DenseWeight,
    ExpertSelection, HcCollapse, HcExpand, HcMix, HcMixes, HcMixing, HcParams, IndexQueries,
    KeyList, PositionRing, Precision, QdqPoint, QueryKeys, RmsNorm, RopeTable, Rotation, Routing,
    SelectFrom, SelectPart, Selection, Tensor,
};
use deepinfer_model::quant;
use deepinfer_model::weights::{Fp4Weight, Fp8Weight};

use super::{Case, Op, Outputs};
use crate::data::{Rng, activations, bf16_unit, fp32_values, random_fp4_weight, random_fp8_weight};

/// Both precisions of the model's activations.
pub const PRECISIONS: [Precision; 2] = [Precision::Bf16, Precision::F32];

/// Token counts of the row-batched cases: one, a few, and more than a warp's worth.
const ROW_COUNTS: [usize; 3] = [1, 3, 17];

fn abs(values: &[f32]) -> Vec<f32> {
    values.iter().map(|v| v.abs()).collect()
}

/// `w` with every E4M3 code's sign cleared: `|W|` at the same scales.
fn abs_fp8(w: &Fp8Weight) -> Fp8Weight {
    Fp8Weight {
        data: w.data.iter().map(|b| b & 0x7f).collect(),
        ..w.clone()
    }
}

/// `w` with every E2M1 code's sign cleared: `|W|` at the same scales.
fn abs_fp4(w: &Fp4Weight) -> Fp4Weight {
    Fp4Weight {
        packed: w.packed.iter().map(|b| b & 0x77).collect(),
        ..w.clone()
    }
}

/// `Σ |x| |w|` of every output of the dense `x · Wᵀ` (the fast linears' magnitude).
fn dense_magnitude(x: &[f32], w: DenseWeight<'_>) -> Vec<f32> {
    let w_abs = abs(w.values);
    CpuBackend
        .linear_f32(
            &Tensor::from(abs(x)),
            DenseWeight {
                values: &w_abs,
                ..w
            },
        )
        .into_vec()
}

/// The linears over dense weights: `inp` above, at and below the 256-product sgemm block, with
/// ragged last blocks; a weight with fewer rows than `out` yields the rows it has.
pub fn linears() -> Vec<Case> {
    let mut rng = Rng(11);
    let mut cases = Vec::new();
    let shapes = [
        (5usize, 100usize),
        (37, 256),
        (9, 600),
        (130, 1030),
        (4, 1700),
        (2, 2100),
    ];
    for (out, inp) in shapes {
        let w = fp32_values(&mut rng, out * inp);
        for rows in [1usize, 3, 7] {
            let x = fp32_values(&mut rng, rows * inp);
            let name = format!("[{rows}x{inp}]·[{inp}x{out}]");
            let (xc, wc) = (x.clone(), w.clone());
            cases.push(Case::new(
                format!("linear_f32 {name}"),
                Op::LinearF32,
                move |b, out_| {
                    let w = DenseWeight {
                        values: &wc,
                        out,
                        inp,
                    };
                    out_.values("y", b.linear_f32(&Tensor::from(&xc), w));
                },
            ));
            let weight = DenseWeight {
                values: &w,
                out,
                inp,
            };
            let m = dense_magnitude(&x, weight);
            let wc = w.clone();
            cases.push(Case::new(
                format!("linear_bf16 {name}"),
                Op::LinearBf16 { inp },
                move |b, o| {
                    let w = DenseWeight {
                        values: &wc,
                        out,
                        inp,
                    };
                    o.bounded("y", b.linear_bf16(&Tensor::from(&x), w), &m);
                },
            ));
        }
    }
    let w = fp32_values(&mut rng, 3 * 64);
    let x = fp32_values(&mut rng, 2 * 64);
    cases.push(Case::new(
        "linear_f32 short weight (3 of 5 rows)",
        Op::LinearF32,
        move |b, o| {
            let w = DenseWeight {
                values: &w,
                out: 5,
                inp: 64,
            };
            o.values("y", b.linear_f32(&Tensor::from(&x), w));
        },
    ));
    cases
}

/// The activations a GEMM weight of `inp` columns runs on, each with its rows: 1, 7 and 64 rows
/// of wide-range bf16 values, and with `f32` 3 rows of fp32 values.
fn gemm_inputs(rng: &mut Rng, inp: usize, f32: bool) -> Vec<(String, Vec<f32>)> {
    let mut inputs: Vec<(String, Vec<f32>)> = [1usize, 7, 64]
        .iter()
        .map(|&rows| (rows.to_string(), activations(rng, rows, inp)))
        .collect();
    if f32 {
        inputs.push(("3 f32".into(), fp32_values(rng, 3 * inp)));
    }
    inputs
}

/// The block-scaled GEMMs on 1, 7 and 64 rows of wide-range bf16 activations: FP8 at both weight
/// blocks (t32, t128; K a multiple of 32 but not of 128 where the block allows; N not a multiple
/// of the tile or of the 8 columns a GPU block computes) and FP4; and on fp32 activations (V4's
/// float32 path quantises them from f32 storage).
pub fn gemms() -> Vec<Case> {
    let mut rng = Rng(2);
    let mut cases = Vec::new();
    let fp8 = |w: Fp8Weight, x: Vec<f32>, what: &str| {
        let m = CpuBackend
            .gemm_fp8(&Tensor::from(abs(&x)), &abs_fp8(&w))
            .into_vec();
        let name = format!(
            "gemm_fp8 t{} [{what}x{}]·[{}x{}]",
            w.block, w.inp, w.inp, w.out
        );
        let op = Op::GemmFp8 {
            group: w.block,
            inp: w.inp,
        };
        Case::new(name, op, move |b, o| {
            o.bounded("y", b.gemm_fp8(&Tensor::from(&x), &w), &m);
        })
    };
    let fp4 = |w: Fp4Weight, x: Vec<f32>, what: &str| {
        let m = CpuBackend
            .gemm_fp4(&Tensor::from(abs(&x)), &abs_fp4(&w))
            .into_vec();
        let name = format!("gemm_fp4 [{what}x{}]·[{}x{}]", w.inp, w.inp, w.out);
        Case::new(name, Op::GemmFp4 { inp: w.inp }, move |b, o| {
            o.bounded("y", b.gemm_fp4(&Tensor::from(&x), &w), &m);
        })
    };
    for (block, out, inp) in [
        (32usize, 100usize, 160usize),
        (32, 203, 544),
        (32, 64, 1056),
        (128, 200, 384),
        (128, 131, 640),
    ] {
        let w = random_fp8_weight(&mut rng, out, inp, block);
        for (what, x) in gemm_inputs(&mut rng, inp, out == 203) {
            cases.push(fp8(w.clone(), x, &what));
        }
    }
    for (out, inp) in [(100usize, 160usize), (203, 544), (72, 2304)] {
        let w = random_fp4_weight(&mut rng, out, inp);
        for (what, x) in gemm_inputs(&mut rng, inp, out == 72) {
            cases.push(fp4(w.clone(), x, &what));
        }
    }
    cases
}

/// `Σ (|a| + 2^-13 amax) |w|` of every output of V4's `linear` over the quantised `w`, amax the
/// largest |a| of `a`'s activation group of `group` values (the fast bound's magnitude).
fn quantised_magnitude(x: &[f32], inp: usize, group: usize, w_abs: &Linear) -> Vec<f32> {
    let widened: Vec<f32> = x
        .chunks(inp)
        .flat_map(|row| {
            row.chunks(group).flat_map(|g| {
                let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
                g.iter().map(move |v| v.abs() + amax * 2f32.powi(-13))
            })
        })
        .collect();
    CpuBackend.linear(&Tensor::from(widened), w_abs).into_vec()
}

/// V4's fp32 `linear` over FP8 and FP4 weights (dequantised exactly by the reference): 320 inputs
/// = 2 sgemm blocks; 8200 × 8192 > 2^26 values = 2 dequantisation blocks on the device.
pub fn quantised_linears() -> Vec<Case> {
    let mut rng = Rng(18);
    let mut cases = Vec::new();
    let mut push = |name: String, w: Linear, abs_w: Linear, group: usize, x: Vec<f32>| {
        let inp = match &w {
            Linear::Fp8(w) => w.inp,
            Linear::Fp4(w) => w.inp,
            Linear::Dense { inp, .. } => *inp,
        };
        let m = quantised_magnitude(&x, inp, group, &abs_w);
        cases.push(Case::new(
            name,
            Op::LinearQuantised { group },
            move |b, o| o.bounded("y", b.linear(&Tensor::from(&x), &w), &m),
        ));
    };
    for (out, inp, block, rows) in [
        (1100usize, 96usize, 32usize, &[1usize, 3][..]),
        (70, 320, 32, &[1, 3]),
        (131, 384, 128, &[1, 3]),
        (8200, 8192, 128, &[2]),
    ] {
        let w = random_fp8_weight(&mut rng, out, inp, block);
        for &rows in rows {
            let x = fp32_values(&mut rng, rows * inp);
            push(
                format!("linear FP8 [{rows}x{inp}]·[{inp}x{out}] t{block}"),
                Linear::Fp8(w.clone()),
                Linear::Fp8(abs_fp8(&w)),
                block,
                x,
            );
        }
    }
    for (out, inp) in [(70usize, 320usize), (1030, 64)] {
        let w = random_fp4_weight(&mut rng, out, inp);
        let x = fp32_values(&mut rng, 2 * inp);
        push(
            format!("linear FP4 [2x{inp}]·[{inp}x{out}]"),
            Linear::Fp4(w.clone()),
            Linear::Fp4(abs_fp4(&w)),
            32,
            x,
        );
    }
    let (out, inp) = (33usize, 200usize);
    let values = fp32_values(&mut rng, out * inp);
    let x = fp32_values(&mut rng, 3 * inp);
    let m = dense_magnitude(
        &x,
        DenseWeight {
            values: &values,
            out,
            inp,
        },
    );
    let w = Linear::Dense { out, inp, values };
    cases.push(Case::new(
        "linear dense [3x200]·[200x33]",
        Op::LinearDense { inp },
        move |b, o| o.bounded("y", b.linear(&Tensor::from(&x), &w), &m),
    ));
    cases
}

/// RMSNorm over 3 … 9000 columns (past 8192 the CUDA kernel sums from memory, not its registers),
/// one and five rows, fp32-valued rows (the compressor's pooled rows) and bf16 ones, both
/// precisions.
pub fn rms_norms() -> Vec<Case> {
    let mut rng = Rng(12);
    let mut cases = Vec::new();
    for precision in PRECISIONS {
        for cols in [3usize, 64, 333, 2048, 7000, 9000] {
            let weight: Vec<f32> = (0..cols)
                .map(|_| quant::round_bf16(1.0 + 0.5 * rng.uniform()))
                .collect();
            for rows in [1usize, 5] {
                let bf16_rows = if cols >= 64 {
                    activations(&mut rng, rows, cols)
                } else {
                    bf16_unit(&mut rng, rows * cols)
                };
                for (kind, x) in [
                    ("f32", fp32_values(&mut rng, rows * cols)),
                    ("bf16", bf16_rows),
                ] {
                    let weight = weight.clone();
                    cases.push(Case::new(
                        format!("rms_norm {rows}x{cols} {kind} values {precision:?}"),
                        Op::RmsNorm,
                        move |b, o| {
                            let norm = RmsNorm {
                                weight: &weight,
                                eps: 1e-6,
                                precision,
                            };
                            o.values("y", b.rms_norm(&Tensor::from(&x), norm));
                        },
                    ));
                }
            }
        }
    }
    cases
}

/// RoPE, forward and inverse, both precisions, positions up to 70 000, 1 … 4 vectors a row.
pub fn ropes() -> Vec<Case> {
    let mut rng = Rng(6);
    let table = RopeTable {
        freqs: (0..8)
            .map(|i| 1.0f32 / 10000f32.powf(i as f32 / 8.0))
            .collect(),
    };
    let mut cases = Vec::new();
    for precision in PRECISIONS {
        for inverse in [false, true] {
            for (rows, vectors, stride) in [(1usize, 1usize, 16usize), (5, 3, 48), (9, 4, 64)] {
                let x = fp32_values(&mut rng, rows * vectors * stride);
                let positions: Vec<usize> = (0..rows).map(|_| rng.below(70_000) as usize).collect();
                let table = table.clone();
                cases.push(Case::new(
                    format!("rope {rows}x{vectors}x{stride} inverse={inverse} {precision:?}"),
                    Op::Rope,
                    move |b, o| {
                        let rotation = Rotation {
                            table: &table,
                            positions: &positions,
                            inverse,
                            precision,
                        };
                        o.values("y", b.rope(Tensor::from(&x), (stride, vectors), &rotation));
                    },
                ));
            }
        }
    }
    cases
}

/// The three QDQ points over whole groups and a short last group; wide magnitudes, tiny groups
/// (amax floors) and zeros. Each changes its input (on every backend).
pub fn qdqs() -> Vec<Case> {
    let mut rng = Rng(13);
    let mut cases = Vec::new();
    for n in [32usize, 16 * 7 + 5, 32 * 5 + 7, 512, 4096 + 19] {
        let mut x = activations(&mut rng, 1, n.max(64))[..n].to_vec();
        for v in x.iter_mut().take(16) {
            *v = quant::round_bf16(*v * 1e-6);
        }
        for point in QDQ_POINTS {
            let x = x.clone();
            cases.push(Case::new(
                format!("{point:?} qdq n={n}"),
                Op::Qdq,
                move |b, o| {
                    // One row of n values, nothing rotated: the QDQ alone.
                    let table = RopeTable { freqs: Vec::new() };
                    let rotation = Rotation::new(&table, &[0], Precision::Bf16);
                    let y = b
                        .rope_qdq(Tensor::from(&x), None, (n, 1), &rotation, point)
                        .into_vec();
                    o.holds("the QDQ changes its input", y != x);
                    o.values("y", y);
                },
            ));
        }
    }
    cases
}

const QDQ_POINTS: [QdqPoint; 3] = [QdqPoint::Q8, QdqPoint::Q4e, QdqPoint::Q4m];

/// The rotated, quantised rows of caches and indexes (`rope_qdq`): with and without the norm, every
/// QDQ point, forward and inverse, both precisions, 1 … 64 vectors a row (one block of 512
/// columns a row up to 18: 9 × 1024 values), positions up to 70 000.
pub fn rope_qdqs() -> Vec<Case> {
    let mut rng = Rng(14);
    let table = RopeTable {
        freqs: (0..32)
            .map(|i| 1.0f32 / 10000f32.powf(i as f32 / 32.0))
            .collect(),
    };
    let mut cases = Vec::new();
    let shapes = [
        (1usize, 1usize, 512usize),
        (5, 1, 128),
        (3, 64, 128),
        (2, 9, 1024),
    ];
    for (i, (rows, vectors, stride)) in shapes.into_iter().enumerate() {
        for point in QDQ_POINTS {
            for normed in [false, true] {
                // f32 on one shape (the separate launches), bf16 (the model's) on the rest.
                let precision = PRECISIONS[usize::from(i == 1)];
                let inverse = normed && i % 3 == 0;
                let x = activations(&mut rng, rows, vectors * stride);
                let weight: Vec<f32> = (0..vectors * stride)
                    .map(|_| quant::round_bf16(0.5 + rng.uniform()))
                    .collect();
                let positions: Vec<usize> = (0..rows).map(|_| rng.below(70_000) as usize).collect();
                let table = table.clone();
                cases.push(Case::new(
                    format!(
                        "rope_qdq {rows}x{vectors}x{stride} {point:?} norm={normed} \
                         inverse={inverse} {precision:?}"
                    ),
                    Op::Qdq,
                    move |b, o| {
                        let norm = normed.then_some(RmsNorm {
                            weight: &weight,
                            eps: 1e-6,
                            precision,
                        });
                        let rotation = Rotation {
                            table: &table,
                            positions: &positions,
                            inverse,
                            precision,
                        };
                        let y =
                            b.rope_qdq(Tensor::from(&x), norm, (stride, vectors), &rotation, point);
                        o.values("y", y);
                    },
                ));
            }
        }
    }
    cases
}

/// The most `scale · Σ_d |q_d k_d|` of any head of any query over its keys (the fast attention
/// bound's score).
fn max_score(q: &[f32], keys: &[Vec<&[f32]>], head_dim: usize, scale: f32) -> f64 {
    let width = q.len() / keys.len().max(1);
    let mut worst = 0f64;
    for (t, list) in keys.iter().enumerate() {
        for head in q[t * width..(t + 1) * width].chunks(head_dim) {
            for k in list {
                let s: f64 = head
                    .iter()
                    .zip(k.iter())
                    .map(|(a, b)| f64::from((a * b).abs()))
                    .sum();
                worst = worst.max(s * f64::from(scale));
            }
        }
    }
    worst
}

/// The attention's magnitude: per output channel, the largest |value| of its query's keys.
fn attention_magnitude(keys: &[Vec<&[f32]>], heads: usize, head_dim: usize) -> Vec<f32> {
    keys.iter()
        .flat_map(|list| {
            let per_channel: Vec<f32> = (0..head_dim)
                .map(|d| list.iter().fold(0f32, |m, k| m.max(k[d].abs())))
                .collect();
            (0..heads).flat_map(move |_| per_channel.clone())
        })
        .collect()
}

/// An attention case over host data: `q [n, heads · head_dim]` and each query's keys as indices
/// into `pool` (K = V); with `alone`, every row also equals the op on that query alone.
struct AttentionData {
    q: Vec<f32>,
    /// The keys the queries' lists index.
    pool: Vec<Vec<f32>>,
    /// Each query's keys, in order.
    lists: Vec<Vec<usize>>,
    /// One sink logit a head.
    sink: Vec<f32>,
    heads: usize,
    head_dim: usize,
}

impl AttentionData {
    fn case(self, name: String, precision: Precision, alone: bool) -> Case {
        let scale = (self.head_dim as f32).powf(-0.5);
        let key_lists: Vec<Vec<&[f32]>> = self
            .lists
            .iter()
            .map(|l| l.iter().map(|&i| self.pool[i].as_slice()).collect())
            .collect();
        let op = Op::Attention {
            precision,
            keys: self.lists.iter().map(Vec::len).max().unwrap_or(0),
            head_dim: self.head_dim,
            score: max_score(&self.q, &key_lists, self.head_dim, scale),
            sink: self
                .sink
                .iter()
                .fold(0f64, |m, &s| m.max(f64::from(s).abs())),
        };
        let m = attention_magnitude(&key_lists, self.heads, self.head_dim);
        Case::new(name, op, move |b, o| {
            let pool: Vec<Tensor> = self.pool.iter().map(Tensor::from).collect();
            let keys: Vec<QueryKeys<'_>> = self
                .lists
                .iter()
                .map(|l| QueryKeys::listed(l.iter().map(|&i| &pool[i]).collect()))
                .collect();
            let q = Tensor::from(&self.q);
            let queries = AttentionQueries {
                q: &q,
                sink: &self.sink,
                scale,
                precision,
            };
            let rows = b.sparse_attention_rows(queries, &keys).into_vec();
            if alone && keys.len() > 1 {
                let width = self.heads * self.head_dim;
                for (t, list) in keys.iter().enumerate() {
                    let one = Tensor::from(&self.q[t * width..(t + 1) * width]);
                    let single = b.sparse_attention_rows(
                        AttentionQueries { q: &one, ..queries },
                        std::slice::from_ref(list),
                    );
                    o.same(
                        format!("query {t} ({} keys) alone", list.len()),
                        &rows[t * width..(t + 1) * width],
                        &single,
                    );
                }
            }
            o.bounded("y", rows, &m);
        })
    }
}

/// One query's sparse attention over 0 … 200 keys (one and ragged 64-key blocks), wide-range
/// queries at 65 keys, three head shapes, both precisions.
pub fn attention_one() -> Vec<Case> {
    let mut rng = Rng(14);
    let mut cases = Vec::new();
    for precision in PRECISIONS {
        for (heads, head_dim) in [(1usize, 64usize), (3, 96), (4, 512)] {
            for n_keys in [0usize, 1, 63, 64, 65, 200] {
                let wide = n_keys == 65;
                let q = if wide {
                    activations(&mut rng, heads, head_dim)
                } else {
                    bf16_unit(&mut rng, heads * head_dim)
                };
                let pool: Vec<Vec<f32>> =
                    (0..n_keys).map(|_| bf16_unit(&mut rng, head_dim)).collect();
                let sink: Vec<f32> = (0..heads).map(|_| 2.0 * rng.uniform()).collect();
                let data = AttentionData {
                    q,
                    pool,
                    lists: vec![(0..n_keys).collect()],
                    sink,
                    heads,
                    head_dim,
                };
                let name = format!("attention h{heads} d{head_dim} n{n_keys} {precision:?}");
                cases.push(data.case(name, precision, false));
            }
        }
    }
    cases
}

/// Per-query key counts for `n` queries: 0, short, exactly one 64-key block, ragged blocks.
fn key_counts(rng: &mut Rng, n: usize) -> Vec<usize> {
    const COUNTS: [usize; 7] = [0, 1, 5, 63, 64, 65, 131];
    (0..n)
        .map(|t| {
            if t < COUNTS.len() {
                COUNTS[(t + n) % COUNTS.len()]
            } else {
                rng.below(140) as usize
            }
        })
        .collect()
}

/// Row-batched sparse attention: 1, 3 and 17 queries over 0 … 140 keys each, from a pool they
/// share (a window, the compressed cache) with keys of their own spliced in between (order
/// matters); every row equals the op on its query alone.
pub fn attention_rows() -> Vec<Case> {
    let mut rng = Rng(42);
    let mut cases = Vec::new();
    for (heads, head_dim) in [(1usize, 64usize), (3, 96), (4, 512)] {
        let shared = 150;
        let mut pool: Vec<Vec<f32>> = (0..shared).map(|_| bf16_unit(&mut rng, head_dim)).collect();
        let sink: Vec<f32> = (0..heads).map(|_| 2.0 * rng.uniform()).collect();
        for n in ROW_COUNTS {
            let counts = key_counts(&mut rng, n);
            let lists: Vec<Vec<usize>> = counts
                .iter()
                .map(|&c| {
                    let own: Vec<usize> = (0..c / 3)
                        .map(|_| {
                            pool.push(bf16_unit(&mut rng, head_dim));
                            pool.len() - 1
                        })
                        .collect();
                    let from_pool = c - own.len();
                    let offset = rng.below((shared - from_pool + 1) as u64) as usize;
                    let mut list: Vec<usize> = (offset..offset + from_pool).collect();
                    let at = list.len() / 2;
                    list.splice(at..at, own);
                    list
                })
                .collect();
            let q = bf16_unit(&mut rng, n * heads * head_dim);
            for precision in PRECISIONS {
                let data = AttentionData {
                    q: q.clone(),
                    pool: pool.clone(),
                    lists: lists.clone(),
                    sink: sink.clone(),
                    heads,
                    head_dim,
                };
                let name = format!("attention rows h{heads} d{head_dim} n{n} {precision:?}");
                cases.push(data.case(name, precision, true));
            }
        }
    }
    cases
}

/// Index scores of `n` queries (`q [n, heads · head_dim]`, `w [n, heads]`) over `keys`, query `t`
/// seeing `visible[t]`; with `alone`, each query also equals the op on that query alone.
struct IndexData {
    q: Vec<f32>,
    w: Vec<f32>,
    keys: Vec<f32>,
    visible: Vec<usize>,
    heads: usize,
    head_dim: usize,
}

impl IndexData {
    fn case(self, name: String, precision: Precision, alone: bool) -> Case {
        Case::new(name, Op::IndexScores, move |b, o| {
            let d = self.head_dim;
            let rows = Tensor::from(&self.keys).split_rows(d);
            let keys = KeyList::from(rows.clone());
            let (q, w) = (Tensor::from(&self.q), Tensor::from(&self.w));
            let queries = IndexQueries {
                q: &q,
                weights: &w,
                head_dim: d,
                precision,
            };
            let part = SelectPart {
                keys: &keys,
                visible: &self.visible,
            };
            let scores = b.index_scores_rows_at(queries, part);
            o.holds(
                format!(
                    "{} score rows for {} queries",
                    scores.len(),
                    self.visible.len()
                ),
                scores.len() == self.visible.len(),
            );
            for (t, row) in scores.iter().enumerate() {
                if alone && self.visible.len() > 1 {
                    let width = self.heads * d;
                    let one_q = Tensor::from(&self.q[t * width..(t + 1) * width]);
                    let one_w = Tensor::from(&self.w[t * self.heads..(t + 1) * self.heads]);
                    let seen = [self.visible[t].min(keys.len())];
                    let seen_keys = KeyList::from(rows[..seen[0]].to_vec());
                    let single = b.index_scores_rows_at(
                        IndexQueries {
                            q: &one_q,
                            weights: &one_w,
                            ..queries
                        },
                        SelectPart {
                            keys: &seen_keys,
                            visible: &seen,
                        },
                    );
                    o.same(format!("query {t} alone"), row, &single.concat());
                }
                o.values(format!("query {t}"), row.clone());
            }
        })
    }
}

/// One query's index scores over 0 … 130 keys, 1 … 64 heads, both precisions.
pub fn index_scores_one() -> Vec<Case> {
    let mut rng = Rng(16);
    let mut cases = Vec::new();
    for precision in PRECISIONS {
        for (heads, head_dim) in [(1usize, 32usize), (5, 32), (64, 128)] {
            for n in [0usize, 1, 17, 130] {
                let data = IndexData {
                    q: bf16_unit(&mut rng, heads * head_dim),
                    w: (0..heads)
                        .map(|_| quant::round_bf16(rng.uniform()))
                        .collect(),
                    keys: bf16_unit(&mut rng, n * head_dim),
                    visible: vec![n],
                    heads,
                    head_dim,
                };
                let name = format!("index_scores h{heads} d{head_dim} n{n} {precision:?}");
                cases.push(data.case(name, precision, false));
            }
        }
    }
    cases
}

/// Row-batched index scores: 1, 3 and 17 queries seeing 0 keys, all, beyond them (clamped) and
/// everything in between; each query equals the op on it alone.
pub fn index_scores_rows() -> Vec<Case> {
    let mut rng = Rng(43);
    let mut cases = Vec::new();
    for (heads, head_dim) in [(1usize, 32usize), (5, 32), (64, 128)] {
        for n_keys in [0usize, 1, 37, 130] {
            let keys = bf16_unit(&mut rng, n_keys * head_dim);
            for n in ROW_COUNTS {
                let visible: Vec<usize> = (0..n)
                    .map(|t| match t % 4 {
                        0 => 0,
                        1 => n_keys,
                        2 => n_keys + 3,
                        _ => rng.below(n_keys as u64 + 1) as usize,
                    })
                    .map(|v| if n == 1 { n_keys.min(7) } else { v })
                    .collect();
                let q = bf16_unit(&mut rng, n * heads * head_dim);
                let w: Vec<f32> = (0..n * heads)
                    .map(|_| quant::round_bf16(rng.uniform()))
                    .collect();
                for precision in PRECISIONS {
                    let data = IndexData {
                        q: q.clone(),
                        w: w.clone(),
                        keys: keys.clone(),
                        visible: visible.clone(),
                        heads,
                        head_dim,
                    };
                    let name =
                        format!("index rows h{heads} d{head_dim} keys{n_keys} n{n} {precision:?}");
                    cases.push(data.case(name, precision, true));
                }
            }
        }
    }
    cases
}

/// Random mHC parameters of `hc` streams of `dim`.
fn hc_params(rng: &mut Rng, hc: usize, dim: usize) -> HcParams {
    let projections = (2 + hc) * hc;
    HcParams {
        proj: (0..projections * hc * dim)
            .map(|_| 0.05 * rng.uniform())
            .collect(),
        base: (0..projections).map(|_| 0.5 * rng.uniform()).collect(),
        scale: vec![0.7, 0.3, 1.9],
    }
}

fn random_mix(rng: &mut Rng, hc: usize) -> HcMix {
    HcMix {
        pre: (0..hc).map(|_| rng.uniform()).collect(),
        post: (0..hc).map(|_| 2.0 * rng.uniform()).collect(),
        comb: (0..hc * hc).map(|_| rng.uniform()).collect(),
    }
}

fn push_mix(o: &mut Outputs, what: &str, mix: &HcMix) {
    o.values(format!("{what} pre"), mix.pre.clone());
    o.values(format!("{what} post"), mix.post.clone());
    o.values(format!("{what} comb"), mix.comb.clone());
}

/// The mHC ops of `n` tokens: the mixes of `x [n, hc · dim]` (`iters` Sinkhorn rounds), the
/// collapse and the expansion of `streams` with `mixes` at both precisions; with `alone`, every
/// token also equals the one-token ops.
struct HcData {
    hc: usize,
    dim: usize,
    params: HcParams,
    /// The streams the mixes are computed of, and the Sinkhorn rounds.
    x: Vec<f32>,
    iters: usize,
    /// One mix a token, for the collapse (`pre`) and the expansion.
    mixes: Vec<HcMix>,
    /// The collapsed and expanded streams and the expansion's `y`, one of each a precision.
    streams: Vec<Vec<f32>>,
    ys: Vec<Vec<f32>>,
}

impl HcData {
    /// `n` tokens of `hc` streams of `dim` with random inputs: wide-range bf16 activations (bf16
    /// values in [-1, 1) below one 32-group), a mix a token, fp32 streams, bf16 `y`.
    fn random(
        rng: &mut Rng,
        params: &HcParams,
        (hc, dim): (usize, usize),
        n: usize,
        iters: usize,
    ) -> HcData {
        let x = if dim >= 32 {
            activations(rng, n * hc, dim)
        } else {
            bf16_unit(rng, n * hc * dim)
        };
        let mixes = (0..n).map(|_| random_mix(rng, hc)).collect();
        let streams = PRECISIONS.map(|_| fp32_values(rng, n * hc * dim)).to_vec();
        let ys = PRECISIONS.map(|_| bf16_unit(rng, n * dim)).to_vec();
        HcData {
            hc,
            dim,
            params: params.clone(),
            x,
            iters,
            mixes,
            streams,
            ys,
        }
    }

    fn case(self, name: String, alone: bool) -> Case {
        Case::new(name, Op::Hc, move |b, o| {
            let (hc, dim) = (self.hc, self.dim);
            let width = hc * dim;
            let mixing = HcMixing {
                hc,
                sinkhorn_iters: self.iters,
                hc_eps: 1e-6,
                norm_eps: 1e-6,
            };
            let rows = b.hc_mixes_rows(&Tensor::from(&self.x), &self.params, &mixing);
            o.holds(
                format!("{} tokens of mixes", rows.tokens()),
                rows.tokens() * width == self.x.len(),
            );
            for t in 0..rows.tokens() {
                let mix = rows.token(t);
                if alone {
                    let token = Tensor::from(&self.x[t * width..(t + 1) * width]);
                    let one = b.hc_mixes_rows(&token, &self.params, &mixing).token(0);
                    o.same(format!("token {t} pre alone"), &mix.pre, &one.pre);
                    o.same(format!("token {t} post alone"), &mix.post, &one.post);
                    o.same(format!("token {t} comb alone"), &mix.comb, &one.comb);
                }
                push_mix(o, &format!("mixes token {t}"), &mix);
            }
            let weights = Tensor::from(
                self.mixes
                    .iter()
                    .flat_map(|m| m.pre.clone())
                    .collect::<Vec<f32>>(),
            );
            let step_mixes = HcMixes::from_host(hc, &self.mixes);
            for (precision, (streams, y)) in PRECISIONS
                .into_iter()
                .zip(self.streams.iter().zip(&self.ys))
            {
                let streams_t = Tensor::from(streams);
                let collapse = HcCollapse {
                    weights: &weights,
                    hc,
                    precision,
                };
                let collapsed = b.hc_collapse_rows_at(&streams_t, collapse).into_vec();
                let expand = HcExpand {
                    residual: &streams_t,
                    mixes: &step_mixes,
                    precision,
                };
                let expanded = b.hc_expand_rows_at(&Tensor::from(y), expand).into_vec();
                if alone {
                    for (t, mix) in self.mixes.iter().enumerate() {
                        let token = Tensor::from(&streams[t * width..(t + 1) * width]);
                        let pre = Tensor::from(&mix.pre);
                        let one = b.hc_collapse_rows_at(
                            &token,
                            HcCollapse {
                                weights: &pre,
                                ..collapse
                            },
                        );
                        o.same(
                            format!("collapse {precision:?} token {t} alone"),
                            &collapsed[t * dim..(t + 1) * dim],
                            &one,
                        );
                        let one_mix = HcMixes::from_host(hc, std::slice::from_ref(mix));
                        let one = b.hc_expand_rows_at(
                            &Tensor::from(&y[t * dim..(t + 1) * dim]),
                            HcExpand {
                                residual: &token,
                                mixes: &one_mix,
                                precision,
                            },
                        );
                        o.same(
                            format!("expand {precision:?} token {t} alone"),
                            &expanded[t * width..(t + 1) * width],
                            &one,
                        );
                    }
                }
                o.values(format!("collapse {precision:?}"), collapsed);
                o.values(format!("expand {precision:?}"), expanded);
            }
        })
    }
}

/// The mHC cases of every `(hc, dim)` of `shapes`, one a `(tokens, Sinkhorn rounds)` of
/// `runs(dim)`, with random parameters a shape; with `alone`, every token also equals the
/// one-token ops.
fn hc_cases(
    seed: u64,
    shapes: &[(usize, usize)],
    runs: impl Fn(usize) -> Vec<(usize, usize)>,
    alone: bool,
) -> Vec<Case> {
    let mut rng = Rng(seed);
    let mut cases = Vec::new();
    for &(hc, dim) in shapes {
        let params = hc_params(&mut rng, hc, dim);
        for (n, iters) in runs(dim) {
            let data = HcData::random(&mut rng, &params, (hc, dim), n, iters);
            let name = format!("mhc hc{hc} dim{dim} n{n} iters{iters}");
            cases.push(data.case(name, alone));
        }
    }
    cases
}

/// The mHC ops of one token: (4, 5120) the real V4.1 width (64 K chains, two rounds of the split
/// sum of squares); (4, 8192) 128 K chains (four partials a lane in the CUDA kernel's tree);
/// (5, 3500) 35 projections, K chains of 273 and 274 (a partial last K tile), leftover vectors
/// and values in the torch sum; 0, 1 and 20 Sinkhorn rounds.
pub fn hc_one() -> Vec<Case> {
    let shapes = [
        (1, 5),
        (4, 64),
        (4, 100),
        (2, 1000),
        (4, 4096),
        (4, 5120),
        (4, 8192),
        (5, 3500),
    ];
    hc_cases(15, &shapes, |_| vec![(1, 0), (1, 1), (1, 20)], false)
}

/// The mHC ops of 1, 3 and 17 tokens, and at the wider shapes also of 40, 64 and 70: past 32
/// tokens the partials launch takes 64-token tiles in registers for hc <= 4 (40: one part tile,
/// 64: one full, 70: a full one and a last part of 6 in the 32-token mapping) and keeps 32-token
/// tiles for hc 5 and 8 (two and three tiles); K chains of 257 to 386 products, most ending in a
/// part pass. Every token equals the one-token ops.
pub fn hc_rows() -> Vec<Case> {
    let shapes = [
        (4, 100),
        (1, 7),
        (3, 257),
        (4, 1030),
        (1, 700),
        (5, 230),
        (8, 70),
    ];
    let runs = |dim: usize| {
        let counts: &[usize] = if [257, 1030, 700, 230, 70].contains(&dim) {
            &[1, 3, 17, 40, 64, 70]
        } else {
            &ROW_COUNTS
        };
        counts.iter().map(|&n| (n, 1 + n % 20)).collect()
    };
    hc_cases(41, &shapes, runs, true)
}

/// The MoE router over 1 … 600 experts (past 512 the CUDA kernel ranks in two passes): logits
/// across softplus's threshold (20) and far below, a row of exact ties, coarse and zero biases,
/// top-1, top-6, top-k beyond the experts and a forced list (with an unknown expert), two route
/// scales. Each case also checks, on every backend, that another bias moves some token's
/// selection (the comparison can fail) and that an all-ties row picks the lowest ids.
pub fn routers() -> Vec<Case> {
    let mut rng = Rng(32);
    let mut cases = Vec::new();
    for (n_experts, rows) in [(1usize, 3usize), (7, 5), (256, 33), (300, 4), (600, 2)] {
        let mut logits: Vec<f32> = (0..rows * n_experts)
            .map(|_| rng.uniform() * 2f32.powi(rng.below(6) as i32))
            .collect();
        logits[..n_experts].fill(0.375);
        logits[n_experts - 1] = 25.0;
        let coarse: Vec<f32> = (0..n_experts)
            .map(|_| (rng.below(4) as f32 - 2.0) / 8.0)
            .collect();
        for (bias_name, bias) in [("coarse", coarse), ("zero", vec![0.0f32; n_experts])] {
            let logits = logits.clone();
            cases.push(Case::new(
                format!("route_experts {n_experts} experts {rows} rows {bias_name} bias"),
                Op::RouteExperts,
                move |b, o| {
                    let x = Tensor::from(&logits);
                    let forced = [n_experts - 1, 0, n_experts + 5, n_experts / 2];
                    for selection in [
                        ExpertSelection::TopK(1),
                        ExpertSelection::TopK(6),
                        ExpertSelection::TopK(n_experts + 2),
                        ExpertSelection::Forced(&forced),
                    ] {
                        for route_scale in [1.0f32, 2.5] {
                            let routing = Routing {
                                bias: &bias,
                                selection,
                                route_scale,
                            };
                            let routes = b.route_experts(&x, routing);
                            o.holds(format!("{} routes", routes.len()), routes.len() == rows);
                            for (r, route) in routes.iter().enumerate() {
                                let what = format!("{selection:?} scale {route_scale} row {r}");
                                let experts = route.experts.iter().map(|&e| e as u32).collect();
                                o.ids(format!("{what} experts"), experts);
                                o.values(format!("{what} weights"), route.weights.clone());
                            }
                        }
                    }
                    if n_experts > 6 {
                        let top6 = |bias: &[f32]| {
                            b.route_experts(
                                &x,
                                Routing {
                                    bias,
                                    selection: ExpertSelection::TopK(6),
                                    route_scale: 1.0,
                                },
                            )
                        };
                        let shifted: Vec<f32> = (0..n_experts).map(|e| e as f32 * 0.01).collect();
                        let zero = vec![0.0f32; n_experts];
                        o.holds(
                            "another bias moves a selection",
                            top6(&zero) != top6(&shifted),
                        );
                    }
                    let tied = b.route_experts(
                        &Tensor::from(vec![0.5; 8]),
                        Routing {
                            bias: &[0.0; 8],
                            selection: ExpertSelection::TopK(3),
                            route_scale: 1.0,
                        },
                    );
                    o.holds("all ties pick ids 0, 1, 2", tied[0].experts == [0, 1, 2]);
                },
            ));
        }
    }
    cases
}

/// The index keys and queries of a step of two sequences (parts) for the indexer's selection.
#[derive(Clone)]
struct SelectData {
    keys: [Vec<f32>; 2],
    visible: [Vec<usize>; 2],
    q: Vec<f32>,
    w: Vec<f32>,
    head_dim: usize,
}

impl SelectData {
    fn random(rng: &mut Rng, heads: usize, head_dim: usize, n_keys: [usize; 2]) -> SelectData {
        let keys = n_keys.map(|n| bf16_unit(rng, n * head_dim));
        // Per part: no key, all of them, beyond them (clamped), and counts in between.
        let visible = n_keys.map(|n| {
            (0..5)
                .map(|t| match t {
                    0 => 0,
                    1 => n,
                    2 => n + 3,
                    _ => rng.below(n as u64 + 1) as usize,
                })
                .collect::<Vec<usize>>()
        });
        let queries = visible.iter().map(Vec::len).sum::<usize>();
        SelectData {
            keys,
            visible,
            q: bf16_unit(rng, queries * heads * head_dim),
            w: (0..queries * heads)
                .map(|_| quant::round_bf16(rng.uniform()))
                .collect(),
            head_dim,
        }
    }

    /// `select_rows` of every query at `k` under `candidates`.
    fn select(
        &self,
        b: &dyn Backend,
        k: usize,
        candidates: Candidates<'_>,
    ) -> (Selection, Option<CandidateMask>) {
        let lists = self
            .keys
            .each_ref()
            .map(|keys| KeyList::from(Tensor::from(keys).split_rows(self.head_dim)));
        let parts = [0, 1].map(|p| SelectPart {
            keys: &lists[p],
            visible: &self.visible[p],
        });
        let (q, w) = (Tensor::from(&self.q), Tensor::from(&self.w));
        let queries = IndexQueries {
            q: &q,
            weights: &w,
            head_dim: self.head_dim,
            precision: Precision::Bf16,
        };
        b.select_rows(
            queries,
            SelectFrom {
                parts: &parts,
                k,
                candidates,
            },
        )
    }
}

impl SelectData {
    /// The sparse attention of every query (2 heads of `head_dim`) over its window (3 positions
    /// of its part's ring, sliding by one per query), one key listed on its own, and compressed
    /// entries of its part (the part's key rows): those `selection` picks, or without one the
    /// first `visible` of them (clamped to the part's, as a layer without an indexer reads
    /// them); and each output's magnitude (the largest |value| of any key the query may read).
    /// Without a selection every row also equals the same keys listed one by one.
    fn attention_compressed(
        &self,
        b: &dyn Backend,
        selection: Option<&Selection>,
        precision: Precision,
        o: &mut Outputs,
    ) -> (Vec<f32>, Vec<f32>) {
        let d = self.head_dim;
        let mut rng = Rng(46);
        let queries = self.visible.iter().map(Vec::len).sum::<usize>();
        let q = Tensor::from(bf16_unit(&mut rng, queries * 2 * d));
        let part_of = |t: usize| usize::from(t >= self.visible[0].len());
        // Query t is its part's query i = t - first[part], whose window is positions i..=i+2.
        let first = [0, self.visible[0].len()];
        let rings = [0, 1].map(|p| {
            let mut ring = PositionRing::starting_at(0);
            for _ in 0..self.visible[p].len() + 2 {
                ring.push(Tensor::from(bf16_unit(&mut rng, d)));
            }
            ring
        });
        let own: Vec<Tensor> = (0..queries)
            .map(|_| Tensor::from(bf16_unit(&mut rng, d)))
            .collect();
        let compressed = self
            .keys
            .each_ref()
            .map(|keys| KeyList::from(Tensor::from(keys).split_rows(d)));
        let window = |t: usize| {
            let (p, i) = (part_of(t), t - first[part_of(t)]);
            rings[p].window(i, i + 2)
        };
        let entries = |t: usize| {
            let (p, i) = (part_of(t), t - first[part_of(t)]);
            let entries = &compressed[p];
            match selection {
                Some(selection) => CompressedKeys::selected(entries, selection, t),
                None => CompressedKeys::prefix(entries, self.visible[p][i].min(entries.len())),
            }
        };
        let keys: Vec<QueryKeys<'_>> = (0..queries)
            .map(|t| QueryKeys {
                window: Some(window(t)),
                listed: vec![&own[t]],
                compressed: Some(entries(t)),
            })
            .collect();
        let sink = [0.25f32, -0.5];
        let attention = AttentionQueries {
            q: &q,
            sink: &sink,
            scale: (d as f32).powf(-0.5),
            precision,
        };
        let y = b.sparse_attention_rows(attention, &keys).into_vec();
        if selection.is_none() {
            let listed: Vec<QueryKeys<'_>> = (0..queries)
                .map(|t| QueryKeys {
                    window: Some(window(t)),
                    listed: [&own[t]].into_iter().chain(entries(t).keys()).collect(),
                    compressed: None,
                })
                .collect();
            let width = 2 * d;
            let one_by_one = b.sparse_attention_rows(attention, &listed).into_vec();
            for t in 0..queries {
                let rows = t * width..(t + 1) * width;
                o.same(
                    format!("query {t}: its prefix listed one by one"),
                    &y[rows.clone()],
                    &one_by_one[rows],
                );
            }
        }
        let m = (0..queries)
            .flat_map(|t| {
                let readable = window(t)
                    .rows()
                    .chain([&own[t]])
                    .chain(&compressed[part_of(t)]);
                let per_channel: Vec<f32> = (0..d)
                    .map(|c| readable.clone().fold(0f32, |m, k| m.max(k[c].abs())))
                    .collect();
                [per_channel.clone(), per_channel].concat()
            })
            .collect();
        (y, m)
    }
}

/// Every query's selected positions as ids, and their counts.
fn push_selection(o: &mut Outputs, what: &str, selection: &Selection) {
    o.ids(
        format!("{what} counts"),
        selection.counts.iter().map(|&c| c as u32).collect(),
    );
    for (t, row) in selection.rows().iter().enumerate() {
        o.ids(
            format!("{what} query {t}"),
            row.iter().map(|&i| i as u32).collect(),
        );
    }
}

/// The indexer's selection (`select_rows`) of two sequences' queries seeing no key, all, beyond
/// them and counts in between, at k = 1, 7 and more than the keys: plain; as the two-level top-k's
/// candidate source (blocks of 8, the best 3; its mask has each query's visible count); and a
/// later source under that mask (read where the backend keeps it); at k = 7 the masked selection
/// differs from the plain one somewhere (on every backend: the mask is seen). And the sparse
/// attention of each query over a window of listed keys and the compressed entries its plain
/// k = 7 selection picks (`sparse_attention_rows`, the selection read where it is), or the first
/// entries it sees (a prefix of the list, each row also equal to the same keys listed one by
/// one), at both precisions.
pub fn selections() -> Vec<Case> {
    let mut rng = Rng(45);
    let mut cases = Vec::new();
    for (heads, head_dim, n_keys) in [(1usize, 32usize, [5usize, 40]), (4, 64, [130, 77])] {
        let data = SelectData::random(&mut rng, heads, head_dim, n_keys);
        for k in [1usize, 7, 150] {
            let name = format!("select_rows h{heads} d{head_dim} keys {n_keys:?} k{k}");
            let data = data.clone();
            cases.push(Case::new(name, Op::IndexScores, move |b, o| {
                let (plain, none) = data.select(b, k, Candidates::None);
                o.holds("no mask without candidates", none.is_none());
                push_selection(o, "plain", &plain);
                let produce = Candidates::Produce {
                    block_size: 8,
                    topk_blocks: 3,
                };
                let (first, mask) = data.select(b, k, produce);
                push_selection(o, "candidate source", &first);
                let Some(mask) = mask else {
                    o.holds("the candidate source returns its mask", false);
                    return;
                };
                let visible = mask.visible.iter().map(|&v| v as u32).collect();
                o.ids("mask visible counts", visible);
                let (masked, _) = data.select(b, k, Candidates::Apply(&mask));
                if k == 7 {
                    o.holds(
                        "the mask changes some selection",
                        masked.rows() != plain.rows(),
                    );
                }
                push_selection(o, "masked", &masked);
            }));
        }
        // The compressed keys through a selection of 7, or as a prefix of the list.
        for (form, selected, extra_keys) in [("selected", true, 3), ("prefix", false, 4)] {
            for precision in PRECISIONS {
                let name = format!("attention_{form} h2 d{head_dim} keys {n_keys:?} {precision:?}");
                let op = Op::Attention {
                    precision,
                    keys: extra_keys + n_keys[0].max(n_keys[1]),
                    head_dim,
                    // |q|, |k| < 1: scale · Σ_d |q_d k_d| < head_dim^-1/2 · head_dim.
                    score: (head_dim as f64).sqrt(),
                    // The sinks of attention_compressed.
                    sink: 0.5,
                };
                let data = data.clone();
                cases.push(Case::new(name, op, move |b, o| {
                    let selection = selected.then(|| data.select(b, 7, Candidates::None).0);
                    let (y, m) = data.attention_compressed(b, selection.as_ref(), precision, o);
                    o.bounded("y", y, &m);
                }));
            }
        }
    }
    cases
}
