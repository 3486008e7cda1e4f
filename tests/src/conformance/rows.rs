//! The row ops of the conformance harness (`scale_at`, `stream_means_at`, `gated_pool_rows`,
//! `engram_inject`, `engram_gather`, `table_rows`, V4's `hyper_head_weights_rows`) and the row-batched ops past one launch's
//! grid: inputs on the host, resident on the backend (`Backend::gather`), and views into a
//! resident buffer; a shared input is left unchanged; each case has a negative control that shows
//! the compared quantity is visible (another scale, fold order, member, eps, table row).

use deepinfer_model::backend::{
    AttentionQueries, Backend, EngramInjection, HcCollapse, HcExpand, HcMix, HcMixes, HyperHead,
    IndexQueries, KeyList, Precision, QueryKeys, SelectPart, StreamShape, Tensor,
};
use deepinfer_model::engram::{EngramGate, EngramTable};
use deepinfer_model::quant::round_bf16;

use super::cases::PRECISIONS;
use super::{Case, Op};
use crate::data::{Rng, activation, bf16_unit, e4m3, e8m0, fp32_values, spread};

/// `values` resident on `b` (a device tensor on a device backend).
fn resident(b: &dyn Backend, values: &[f32]) -> Tensor {
    b.gather(&[(&Tensor::from(values), 0)], values.len())
}

/// How many of `a` and `b` differ bitwise.
fn differing(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// `scale_at` over 1 … 37 tokens of 1 … 64 heads with weights from 2^-130 to 2^120, ±0, ∞, a
/// subnormal and 3e38, both precisions; from the host, resident, and through a view (the viewed
/// buffer unchanged); another scale changes some value; empty stays empty.
pub fn scale_at() -> Vec<Case> {
    let mut rng = Rng(21);
    let mut cases = Vec::new();
    for (heads, head_dim, n) in [(1usize, 1usize, 1usize), (3, 32, 5), (64, 128, 37)] {
        let scale = (head_dim as f32).powf(-0.5) * (heads as f32).powf(-0.5);
        let mut w: Vec<f32> = (0..n * heads)
            .map(|_| spread(&mut rng, -130, 120))
            .collect();
        w.extend([0.0, -0.0, f32::INFINITY, f32::MIN_POSITIVE / 3.0, 3.0e38]);
        cases.push(Case::new(
            format!("scale_at {n} tokens of {heads} heads"),
            Op::ScaleAt,
            move |b, o| {
                for precision in PRECISIONS {
                    let host = b.scale_at(Tensor::from(&w), scale, precision);
                    let whole = b.scale_at(resident(b, &w), scale, precision);
                    let padded: Vec<f32> = [7.0].iter().chain(&w).copied().collect();
                    let shared = resident(b, &padded);
                    let view = b.scale_at(shared.range(1..padded.len()), scale, precision);
                    o.same("the viewed buffer is unchanged", &shared, &padded);
                    o.values(format!("{precision:?} host"), host);
                    o.values(format!("{precision:?} resident"), whole);
                    o.values(format!("{precision:?} view"), view);
                }
                let other = b.scale_at(Tensor::from(&w), scale * 1.001, Precision::F32);
                let this = b.scale_at(Tensor::from(&w), scale, Precision::F32);
                o.holds("another scale is visible", differing(&other, &this) > 0);
                o.holds(
                    "empty stays empty",
                    b.scale_at(Tensor::empty(), 2.0, Precision::Bf16).is_empty(),
                );
            },
        ));
    }
    cases
}

/// V4's hyper-head weights over (rows, hc, width) — width = hc · dim, as the head's streams — from
/// one FMA chain of the dot products (width < 512) to V4-Flash's 64 chains of 256 (4 × 4096) and
/// an odd width whose chains start mid-vector (3 × 1001: 2 chains); activations of magnitudes
/// 2^-12 … 2^6 with zeros; from the host and resident; rows past the first block of a launch
/// equal those rows alone; another projection row changes only its own weight.
pub fn hyper_heads() -> Vec<Case> {
    let mut rng = Rng(29);
    let mut cases = Vec::new();
    for (rows, hc, dim) in [
        (1usize, 1usize, 64usize),
        (3, 4, 1001),
        (37, 4, 256),
        (2, 4, 4096),
    ] {
        let width = hc * dim;
        let x: Vec<f32> = (0..rows * width).map(|_| activation(&mut rng)).collect();
        let proj: Vec<f32> = (0..hc * width).map(|_| spread(&mut rng, -14, -4)).collect();
        let base: Vec<f32> = (0..hc).map(|_| spread(&mut rng, -3, 1)).collect();
        cases.push(Case::new(
            format!("hyper_head_weights_rows {rows} rows of {hc} x {dim}"),
            Op::HyperHead,
            move |b, o| {
                let head = HyperHead {
                    proj: &proj,
                    base: &base,
                    scale: 0.5,
                    hc_eps: 1e-6,
                    norm_eps: 1e-6,
                };
                let host = b
                    .hyper_head_weights_rows(&Tensor::from(&x), &head)
                    .into_vec();
                o.holds("hc weights a row", host.len() == rows * hc);
                let last = &x[(rows - 1) * width..];
                let alone = b
                    .hyper_head_weights_rows(&Tensor::from(last), &head)
                    .into_vec();
                o.same("the last row alone", &alone, &host[(rows - 1) * hc..]);
                let mut other = proj.clone();
                other[..width].iter_mut().for_each(|v| *v = -*v);
                let changed = b
                    .hyper_head_weights_rows(
                        &Tensor::from(&x),
                        &HyperHead {
                            proj: &other,
                            ..head
                        },
                    )
                    .into_vec();
                let moved: Vec<bool> = changed.iter().zip(&host).map(|(a, b)| a != b).collect();
                o.holds(
                    "another projection row moves its own weight only",
                    moved.iter().enumerate().all(|(i, &m)| m == (i % hc == 0)),
                );
                let m = hyper_head_magnitudes(&x, &head);
                o.bounded("host", host, &m);
                o.bounded(
                    "resident",
                    b.hyper_head_weights_rows(&resident(b, &x), &head),
                    &m,
                );
            },
        ));
    }
    cases
}

/// Each hyper-head weight's magnitude for its fast bound ([`super::fast_bound`]): `σ (|t| +
/// |logit|)` with `t = dot(x_r, proj_k) · inv_r · scale`, `logit = t + base_k` and `σ` the sigmoid
/// of the logit, all in f64.
fn hyper_head_magnitudes(x: &[f32], head: &HyperHead<'_>) -> Vec<f32> {
    let hc = head.base.len();
    let width = head.proj.len() / hc;
    x.chunks_exact(width)
        .flat_map(|row| {
            let squares: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let inv = 1.0 / (squares / width as f64 + f64::from(head.norm_eps)).sqrt();
            head.proj
                .chunks_exact(width)
                .zip(head.base)
                .map(move |(proj, &base)| {
                    let dot: f64 = row
                        .iter()
                        .zip(proj)
                        .map(|(&a, &w)| f64::from(a) * f64::from(w))
                        .sum();
                    let t = dot * inv * f64::from(head.scale);
                    let logit = t + f64::from(base);
                    let sigmoid = 1.0 / (1.0 + (-logit).exp());
                    (sigmoid * (t.abs() + logit.abs())) as f32
                })
        })
        .collect()
}

/// The stream means' shapes: (tokens, hc, dim).
pub const STREAM_SHAPES: [(usize, usize, usize); 5] = [
    (1, 1, 1),
    (3, 4, 37),
    (7, 3, 129),
    (2, 8, 1000),
    (65, 4, 64),
];

/// The stream means of `streams [tokens, hc, dim]` folded in reverse stream order (in f32): the
/// negative control of the fold order.
pub fn reversed_stream_means(streams: &[f32], hc: usize, dim: usize) -> Vec<f32> {
    streams
        .chunks_exact(hc * dim)
        .flat_map(|token| {
            (0..dim)
                .map(move |d| (0..hc).rev().fold(0.0f32, |a, k| a + token[k * dim + d]) / hc as f32)
        })
        .collect()
}

/// `stream_means_at` of 1 … 65 tokens of 1 … 8 streams, values 2^-20 … 2^20, both precisions;
/// from the host, resident, and the last tokens through a view; at f32 the reversed fold differs
/// from the op somewhere across the cases (counted in the last case's check).
pub fn stream_means() -> Vec<Case> {
    let mut rng = Rng(22);
    let mut cases = Vec::new();
    for (n, hc, dim) in STREAM_SHAPES {
        let streams: Vec<f32> = (0..n * hc * dim)
            .map(|_| spread(&mut rng, -20, 20))
            .collect();
        cases.push(Case::new(
            format!("stream_means {n} tokens hc{hc} dim{dim}"),
            Op::StreamMeans,
            move |b, o| {
                let shape = StreamShape { hc, dim };
                for precision in PRECISIONS {
                    let host = b.stream_means_at(&Tensor::from(&streams), shape, precision);
                    let device = resident(b, &streams);
                    let whole = b.stream_means_at(&device, shape, precision);
                    let tail =
                        b.stream_means_at(&device.rows(n / 2..n, hc * dim), shape, precision);
                    o.same("the tail view", &tail, &whole[n / 2 * dim..]);
                    o.values(format!("{precision:?} host"), host);
                    o.values(format!("{precision:?} resident"), whole);
                }
            },
        ));
    }
    // The fold order is visible: the streams folded in reverse differ from the op somewhere.
    let (n, hc, dim) = (65usize, 4usize, 64usize);
    let streams: Vec<f32> = (0..n * hc * dim)
        .map(|_| spread(&mut rng, -20, 20))
        .collect();
    cases.push(Case::new(
        "stream_means fold order is visible",
        Op::StreamMeans,
        move |b, o| {
            let means = b.stream_means_at(
                &Tensor::from(&streams),
                StreamShape { hc, dim },
                Precision::F32,
            );
            let reversed = reversed_stream_means(&streams, hc, dim);
            o.holds("the reverse fold differs", differing(&means, &reversed) > 0);
            o.values("means", means);
        },
    ));
    cases
}

/// `rows` rows of `kv ‖ gate` (`2 · head_dim` values each) as the compressor stores them: bf16
/// values, gates over a wide range (some far below the others: exp underflows) with ties.
fn pooling_rows(rng: &mut Rng, rows: usize, head_dim: usize) -> Vec<f32> {
    let width = 2 * head_dim;
    (0..rows * width)
        .map(|i| {
            if i % width < head_dim {
                activation(rng)
            } else if rng.below(20) == 0 {
                -150.0 + rng.uniform()
            } else if rng.below(10) == 0 {
                1.5
            } else {
                spread(rng, -6, 5)
            }
        })
        .collect()
}

/// Where a member row of a pooling group comes from, as a ring holds them.
#[derive(Clone, Copy)]
enum Member {
    /// Row `r` of an earlier step's resident buffer (a view).
    View(usize),
    /// A resident row of its own.
    Own,
    /// A host row.
    Host,
}

/// `gated_pool_rows` of groups of one size (the model's `ratio`: 1, 2, 4, 128) and of mixed sizes
/// with an empty group, members from views, resident rows and host rows; replacing the last
/// member of every group changes the result; no group, no values.
pub fn gated_pool() -> Vec<Case> {
    let mut rng = Rng(23);
    let mut cases = Vec::new();
    let shapes: [(&[usize], usize); 5] = [
        (&[1], 1),
        (&[2, 2, 2], 33),
        (&[4; 5], 128),
        (&[128, 128], 64),
        (&[4, 4, 3, 0, 1, 4, 4], 96),
    ];
    for (sizes, head_dim) in shapes {
        let sizes = sizes.to_vec();
        let width = 2 * head_dim;
        let members: usize = sizes.iter().sum();
        let buffer_rows = members.max(1);
        let earlier = pooling_rows(&mut rng, buffer_rows, head_dim);
        let rows: Vec<Vec<f32>> = (0..members)
            .map(|_| pooling_rows(&mut rng, 1, head_dim))
            .collect();
        let kinds: Vec<Member> = (0..members)
            .map(|_| match rng.below(3) {
                0 => Member::View(rng.below(buffer_rows as u64) as usize),
                1 => Member::Own,
                _ => Member::Host,
            })
            .collect();
        let other = pooling_rows(&mut rng, 1, head_dim);
        cases.push(Case::new(
            format!("gated_pool_rows groups {sizes:?} head_dim {head_dim}"),
            Op::GatedPool,
            move |b, o| {
                let views = resident(b, &earlier).split_rows(width);
                let placed: Vec<Tensor> = rows
                    .iter()
                    .zip(&kinds)
                    .map(|(row, kind)| match kind {
                        Member::View(r) => views[*r].clone(),
                        Member::Own => resident(b, row),
                        Member::Host => Tensor::from(row),
                    })
                    .collect();
                let mut groups: Vec<Vec<&Tensor>> = Vec::new();
                let mut at = 0;
                for &size in &sizes {
                    groups.push(placed[at..at + size].iter().collect());
                    at += size;
                }
                let pooled = b.gated_pool_rows(&groups, head_dim);
                o.holds("one row a group", pooled.len() == sizes.len() * head_dim);
                let other = resident(b, &other);
                let replaced: Vec<Vec<&Tensor>> = groups
                    .iter()
                    .map(|g| {
                        let mut g = g.clone();
                        if let Some(last) = g.last_mut() {
                            *last = &other;
                        }
                        g
                    })
                    .collect();
                let changed = differing(&b.gated_pool_rows(&replaced, head_dim), &pooled);
                o.holds("a replaced member is visible", changed > 0);
                o.holds("no group, no values", b.gated_pool_rows(&[], 8).is_empty());
                o.values("pooled", pooled);
            },
        ));
    }
    cases
}

/// The Engram injections' shapes: (tokens, hc, dim, kv values past the gate's, eps).
pub const INJECT_SHAPES: [(usize, usize, usize, usize, f32); 5] = [
    (1, 1, 1, 0, 1e-6),
    (5, 4, 7, 0, 1e-6),
    (6, 4, 64, 3, 1e-6),
    (3, 2, 1031, 0, 1e-20),
    (9, 4, 5120, 0, 1e-20),
];

/// An Engram injection's inputs: the shape, the gate's `q` and `k` (bf16, 2^-3 … 2^1), the
/// streams of the tokens (bf16 activations, the first stream zeros: d = 0, the gate at its clamp),
/// the live tokens (every token but each third from the second) and their `kv` rows.
pub struct InjectData {
    /// (tokens, hc, dim, kv values past the gate's, eps): one of [`INJECT_SHAPES`].
    pub shape: (usize, usize, usize, usize, f32),
    /// `q` and `k`, `[hc, dim]` each.
    pub gate: [Vec<f32>; 2],
    pub streams: Vec<f32>,
    /// The live tokens, each with its row of `kv`.
    pub live: Vec<usize>,
    pub kv: Vec<f32>,
}

impl InjectData {
    pub fn random(rng: &mut Rng, shape: (usize, usize, usize, usize, f32)) -> InjectData {
        let (tokens, hc, dim, extra_kv, _) = shape;
        let gate = [0, 1].map(|_| {
            (0..hc * dim)
                .map(|_| round_bf16(spread(rng, -3, 1)))
                .collect::<Vec<f32>>()
        });
        let mut streams: Vec<f32> = (0..tokens * hc * dim).map(|_| activation(rng)).collect();
        streams[..dim].fill(0.0);
        let live: Vec<usize> = (0..tokens).filter(|t| t % 3 != 1).collect();
        let kv_stride = (hc + 1) * dim + extra_kv;
        let kv = (0..live.len() * kv_stride)
            .map(|_| activation(rng))
            .collect();
        InjectData {
            shape,
            gate,
            streams,
            live,
            kv,
        }
    }

    /// The gate with `eps` for its `d`.
    pub fn gate_with(&self, eps: f32) -> EngramGate {
        let (_, hc, dim, _, _) = self.shape;
        EngramGate::new(dim, hc, &self.gate[0], &self.gate[1], eps).expect("gate shapes")
    }

    /// The width of each live token's `kv` row: the `hc` keys and the value, then the values the
    /// gate skips.
    pub fn kv_stride(&self) -> usize {
        let (_, hc, dim, extra_kv, _) = self.shape;
        (hc + 1) * dim + extra_kv
    }
}

/// `engram_inject` of 1 … 9 tokens of 1 … 4 streams of 1 … 5120 (kv rows wider than the gate
/// reads, one stream of zeros: the gate at its clamp, tokens left out), from the host, resident
/// streams shared with another holder (left unchanged) and resident streams injected in place;
/// live tokens change, another eps changes some value (at the real width, 5120); no live token
/// leaves the streams as they are.
pub fn engram_inject() -> Vec<Case> {
    let mut rng = Rng(24);
    let mut cases = Vec::new();
    for shape in INJECT_SHAPES {
        let data = InjectData::random(&mut rng, shape);
        let (tokens, hc, dim, _, eps) = shape;
        let (gate, other) = (data.gate_with(eps), data.gate_with(eps * 1.5 + 1e-3));
        let InjectData {
            streams, live, kv, ..
        } = data;
        cases.push(Case::new(
            format!("engram_inject {tokens} tokens hc{hc} dim{dim}"),
            Op::EngramInject,
            move |b, o| {
                let kv_host = Tensor::from(&kv);
                let injection = EngramInjection {
                    kv: &kv_host,
                    live: &live,
                    gate: &gate,
                };
                let host = b.engram_inject(Tensor::from(&streams), injection);
                o.holds("live tokens change", differing(&host, &streams) > 0);
                let kv_resident = resident(b, &kv);
                let injection = EngramInjection {
                    kv: &kv_resident,
                    ..injection
                };
                let shared = resident(b, &streams);
                let kept = shared.clone();
                let copied = b.engram_inject(shared, injection);
                let in_place = b.engram_inject(resident(b, &streams), injection);
                o.same("the shared streams are unchanged", &kept, &streams);
                let with_other = b.engram_inject(
                    Tensor::from(&streams),
                    EngramInjection {
                        gate: &other,
                        ..injection
                    },
                );
                if dim == 5120 {
                    o.holds("another eps is visible", differing(&with_other, &host) > 0);
                }
                o.values("host", host);
                o.values("shared", copied);
                o.values("in place", in_place);
            },
        ));
    }
    cases.push(Case::new(
        "engram_inject no live token",
        Op::EngramInject,
        |b, o| {
            let gate = EngramGate::new(2, 1, &[1.0; 2], &[1.0; 2], 1e-6).expect("gate shapes");
            let same = b.engram_inject(
                Tensor::from(vec![1.0, 2.0]),
                EngramInjection {
                    kv: &Tensor::empty(),
                    live: &[],
                    gate: &gate,
                },
            );
            o.same("the streams as they are", &same, &[1.0, 2.0]);
            o.values("streams", same);
        },
    ));
    cases
}

/// `engram_gather` of 1, 7 and 300 ids of a 1021-row table (a 2^-127 scale: subnormal products;
/// a 2^73 one), ids past the table and `u32::MAX` giving zeros.
pub fn engram_gather() -> Vec<Case> {
    let mut rng = Rng(33);
    let (table_rows, head_dim) = (1021usize, 96usize);
    let codes: Vec<u8> = (0..table_rows * head_dim).map(|_| e4m3(&mut rng)).collect();
    let mut scales: Vec<u8> = (0..table_rows * head_dim / 32)
        .map(|_| e8m0(&mut rng))
        .collect();
    scales[0] = 0;
    scales[1] = 200;
    let table = EngramTable::new("test", table_rows, head_dim, codes, scales).expect("table");
    let mut cases = Vec::new();
    for n in [1usize, 7, 300] {
        let mut ids: Vec<u32> = (0..n)
            .map(|_| rng.below(table_rows as u64) as u32)
            .collect();
        ids[0] = 0;
        if n > 2 {
            ids[1] = table_rows as u32;
            ids[2] = u32::MAX;
        }
        let table = table.clone();
        cases.push(Case::new(
            format!("engram_gather {n} ids"),
            Op::EngramGather,
            move |b, o| {
                let rows = b.engram_gather(&table, &ids).into_vec();
                if n > 2 {
                    let foreign = &rows[head_dim..3 * head_dim];
                    o.holds("foreign ids give zeros", foreign.iter().all(|&v| v == 0.0));
                }
                o.values("rows", rows);
            },
        ));
    }
    cases
}

/// `table_rows`: a step's token embeddings, repeated ids included, twice (the second call reads
/// the table the first one placed).
pub fn table_rows() -> Vec<Case> {
    let (rows, width) = (37, 96);
    let table = fp32_values(&mut Rng(37), rows * width);
    vec![Case::new(
        "table_rows 6 ids of 37 rows",
        Op::TableRows,
        move |b, o| {
            let ids = [36u32, 0, 5, 5, 17, 36];
            let first = b.table_rows(&table, width, &ids).into_vec();
            let again = b.table_rows(&table, width, &ids[..2]);
            o.same("the second call", &again, &first[..2 * width]);
            o.same(
                "row 5 twice",
                &first[2 * width..3 * width],
                &first[3 * width..4 * width],
            );
            o.values("rows", first);
        },
    )]
}

/// The row-batched ops over 66 536 rows, more than one launch's grid.y (65 535): the backend
/// splits the call (the collapse and expansion of 2 streams of 3, attention over 0 … 3 of 9
/// shared keys, index scores seeing 0 … 6 of 5 keys).
pub fn split_launches() -> Vec<Case> {
    let mut rng = Rng(44);
    let n = 65_535 + 1_001;
    let (hc, dim) = (2usize, 3usize);
    let streams = fp32_values(&mut rng, n * hc * dim);
    let weights = fp32_values(&mut rng, n * hc);
    let y = bf16_unit(&mut rng, n * dim);
    let mixes: Vec<HcMix> = (0..n)
        .map(|_| HcMix {
            pre: vec![0.0; hc],
            post: fp32_values(&mut rng, hc),
            comb: fp32_values(&mut rng, hc * hc),
        })
        .collect();
    let head_dim = 4;
    let pool: Vec<Vec<f32>> = (0..9).map(|_| bf16_unit(&mut rng, head_dim)).collect();
    let q = bf16_unit(&mut rng, n * head_dim);
    let heads = 2;
    let index_keys = bf16_unit(&mut rng, 5 * head_dim);
    let iq = bf16_unit(&mut rng, n * heads * head_dim);
    let iw = bf16_unit(&mut rng, n * heads);
    let hc_case = Case::new(format!("mhc rows over {n} rows"), Op::Hc, move |b, o| {
        let streams = Tensor::from(&streams);
        let collapse = HcCollapse {
            weights: &Tensor::from(&weights),
            hc,
            precision: Precision::Bf16,
        };
        o.values("collapse", b.hc_collapse_rows_at(&streams, collapse));
        let mixes = HcMixes::from_host(hc, &mixes);
        let expand = HcExpand {
            residual: &streams,
            mixes: &mixes,
            precision: Precision::F32,
        };
        o.values("expand", b.hc_expand_rows_at(&Tensor::from(&y), expand));
    });
    let attention = Case::new(
        format!("attention rows over {n} rows"),
        Op::Attention {
            precision: Precision::Bf16,
            keys: 3,
            head_dim,
            score: head_dim as f64 * 0.5,
            // The sink of this case (below).
            sink: 0.5,
        },
        move |b, o| {
            let pool: Vec<Tensor> = pool.iter().map(Tensor::from).collect();
            let keys: Vec<Vec<&Tensor>> = (0..n)
                .map(|t| pool[t % 5..t % 5 + t % 4].iter().collect())
                .collect();
            let magnitude: Vec<f32> = keys
                .iter()
                .flat_map(|list| {
                    (0..head_dim).map(|d| list.iter().fold(0f32, |m, k| m.max(k[d].abs())))
                })
                .collect();
            let q = Tensor::from(&q);
            let queries = AttentionQueries {
                q: &q,
                sink: &[0.5],
                scale: 0.5,
                precision: Precision::Bf16,
            };
            let keys: Vec<QueryKeys<'_>> = keys.iter().cloned().map(QueryKeys::listed).collect();
            let rows = b.sparse_attention_rows(queries, &keys);
            o.bounded("attention", rows, &magnitude);
        },
    );
    let index = Case::new(
        format!("index scores over {n} rows"),
        Op::IndexScores,
        move |b, o| {
            let keys = KeyList::from(Tensor::from(&index_keys).split_rows(head_dim));
            let visible: Vec<usize> = (0..n).map(|t| t % 7).collect();
            let (iq, iw) = (Tensor::from(&iq), Tensor::from(&iw));
            let queries = IndexQueries {
                q: &iq,
                weights: &iw,
                head_dim,
                precision: Precision::Bf16,
            };
            let scores = b.index_scores_rows_at(
                queries,
                SelectPart {
                    keys: &keys,
                    visible: &visible,
                },
            );
            o.holds("one score row a query", scores.len() == n);
            o.ids(
                "per-query lengths",
                scores.iter().map(|s| s.len() as u32).collect(),
            );
            o.values("scores", scores.concat());
        },
    );
    vec![hc_case, attention, index]
}
