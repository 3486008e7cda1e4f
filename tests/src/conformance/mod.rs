//! The one conformance harness of the [`Backend`] ops (ARCHITECTURE.md §3; candle's
//! `test_device!`): a [`Case`] states an op once — its inputs, drawn from a seeded generator when
//! the case is built, and its calls through the `Backend` trait — and [`check`] runs it on the
//! reference (`CpuBackend`) and on a device backend. In `exact` numerics every value must be the
//! reference's bits; in `fast` numerics every value must lie within the op's bound
//! ([`fast_bound`]: one table, the reason beside each bound), and an op whose fast path is its
//! exact path still gives the reference's bits. Ids, token log-probabilities and errors are equal
//! in both modes. A case may also state invariants that hold on every backend on its own (a row of
//! a batch equals the op on that row alone). The cases of every op: [`cases`].

use std::fmt::Write as _;

use deepinfer_model::backend::{Backend, Precision};

pub mod cases;
pub mod rows;
pub mod sampling;

/// The numerics a device backend runs (ARCHITECTURE.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Bitwise the reference.
    Exact,
    /// Within each op's bound of the reference ([`fast_bound`]).
    Fast,
}

/// The op a case exercises, with what its `fast` bound depends on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    /// `linear_f32` and `sample_linear` (the fp32 linears).
    LinearF32,
    /// `linear_bf16` over dot products of `inp` terms.
    LinearBf16 {
        inp: usize,
    },
    /// `gemm_fp8` with activation groups (= weight blocks) of `group` over `inp` terms.
    GemmFp8 {
        group: usize,
        inp: usize,
    },
    /// `gemm_fp4` over `inp` terms (activation groups of 32).
    GemmFp4 {
        inp: usize,
    },
    /// V4's `linear` over a dense weight of `inp` columns.
    LinearDense {
        inp: usize,
    },
    /// V4's `linear` over an FP8 (activation group = its block) or FP4 (group 32) weight.
    LinearQuantised {
        group: usize,
    },
    /// `sparse_attention_rows` at `precision` with at most `keys` keys a query, `head_dim`
    /// channels, at most `score` for `scale · Σ_d |q_d k_d|` of any head and key and `sink` for
    /// any |sink|.
    Attention {
        precision: Precision,
        keys: usize,
        head_dim: usize,
        score: f64,
        sink: f64,
    },
    RmsNorm,
    Rope,
    /// `rope_qdq` (the QDQ points, after a norm and a rotation or alone).
    Qdq,
    /// `hc_mixes_rows`, `hc_collapse_rows_at`, `hc_expand_rows_at`.
    Hc,
    IndexScores,
    /// `sample_rows`, `sample_masked`, `token_logprobs_masked`.
    Sampling,
    RouteExperts,
    EngramGather,
    TableRows,
    ScaleAt,
    StreamMeans,
    GatedPool,
    EngramInject,
    /// V4's `hyper_head_weights_rows`.
    HyperHead,
}

/// How far a `fast` value may be from the reference's: `|fast − reference| ≤ of_magnitude · m +
/// of_value · |reference|`, with `m` the value's magnitude as its case states it (the op's sum of
/// absolute terms); [`Bound::Bitwise`]: the same bits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bound {
    Bitwise,
    Within { of_magnitude: f64, of_value: f64 },
}

/// The `fast` numerics' bound of `op` against the reference, and why it holds.
pub fn fast_bound(op: Op) -> (Bound, &'static str) {
    let p = |e: i32| 2f64.powi(e);
    match op {
        Op::LinearBf16 { inp } => (
            Bound::Within {
                of_magnitude: (1.0 + p(-8)) * dense_terms(inp),
                of_value: p(-8),
            },
            "ops::linear_fast: x and W rounded to bf16 (2^-9 relative each), its sum within \
             (17·⌈K/16⌉ + PARTS)·2^-23·Σ|x w| (kernels/src/ops/linear_fast.rs), the reference's \
             fp32 sum within K·2^-24·Σ|x w|; each side rounds the output to bf16 once (2^-8 |y| \
             together, 2^-8 of the sum's error)",
        ),
        Op::LinearDense { inp } => (
            Bound::Within {
                of_magnitude: dense_terms(inp),
                of_value: p(-23),
            },
            "the fast bf16 linear with f32 outputs: x and W rounded to bf16, its sum and the \
             reference's fp32 sum as for linear_bf16; no bf16 rounding of the output",
        ),
        Op::GemmFp8 { group, inp } => (gemm_within(group, inp), GEMM_REASON),
        Op::GemmFp4 { inp } => (gemm_within(32, inp), GEMM_REASON),
        Op::LinearQuantised { group } => (
            Bound::Within {
                of_magnitude: p(-4) + (group as f64 - 1.0) * p(-13) * (1.0 + p(-4)) + p(-10),
                of_value: p(-22),
            },
            "the fast path quantises the activations to E4M3 in groups where the reference keeps \
             them f32: |â − a| ≤ 2^-4 |a| + 2^-10 s ≤ 2^-4 (|a| + 2^-13 amax) (s ≥ amax/448 a \
             power of two below amax/224), the case's magnitude M is Σ (|a| + 2^-13 amax) |w|; \
             then the tensor core's in-group sum ((G − 1)·2^-13 of Σ |â w| ≤ (1 + 2^-4) M), the \
             fp32 sums of its parts and the reference's fp32 sum of K products (K·2^-24: 2^-10 \
             covers both to K = 2^13); f32 outputs",
        ),
        Op::Attention {
            precision: Precision::Bf16,
            keys,
            head_dim,
            score,
            ..
        } => {
            let delta = (head_dim as f64 * p(-23) + p(-24)) * score;
            let order = keys as f64 * p(-23);
            (
                Bound::Within {
                    of_magnitude: p(-8) + 4.0 * delta + order,
                    of_value: p(-8) + 2.0 * delta + order,
                },
                "tests/tests/fast_attention/mod.rs: the two sides round each weight to bf16 from \
                 scores that differ by δ = (D·2^-23 + 2^-24)·max scale·Σ|q k| (2^-8 for the two \
                 roundings, 2δ for the scores, twice for the weights' and the denominator's \
                 share), sum in fp32 in different orders (n·2^-23) and round the output to bf16 \
                 once each (2^-8); the case's magnitude max_j |v_j| bounds A = Σ p_j |v_j| / L",
            )
        }
        Op::Attention {
            precision: Precision::F32,
            keys,
            score,
            sink,
            ..
        } => (
            f32_attention_within(keys, score, sink),
            "kernels/src/ops/attention.rs: the fast f32 attention's weights within 1 ± ε of the \
             exact ones (its split scores within δ = (3.01·2^-16 + 215·2^-23)·score, c = 4 + \
             splits exponentials of arguments within R = 2·score + |sink| + 1, each 2^-22 + 2^-24·R), \
             its p·V within e_v = 3.01·2^-16 + (215 + 4 + 3·splits)·2^-23 of A, its denominator \
             within (13 + 3·splits)·2^-24; the reference's (f32 scores, 2^-23·score; 1 + blocks \
             exponentials; f32 products, sums of 64 and the block chain) added; the case's \
             magnitude max_j |v_j| bounds A",
        ),
        Op::HyperHead => (
            Bound::Within {
                of_magnitude: 6.0 * p(-23),
                of_value: 6.0 * p(-23),
            },
            "the fast kernel sums a row's squares by a fixed tree (kernels/src/ops/v4.rs, \
             SquaresOrder): its f64 sum and the reference's in-order one are within \
             width·2^-52 of the sum, so their f32 roundings are equal or one ulp (2^-23) apart \
             (width < 2^24); through the mean, + eps, the square root and the reciprocal (each \
             side rounding once) inv moves ≤ 3.5·2^-23, t = dot·inv·scale ≤ 5.5·2^-23·|t| (the \
             dot products are the same bits), the logit by that and 2^-23·|logit| (rounding); \
             σ' ≤ σ; each side's sigmoid (exp_f32 within 1 ulp, the add and the divide) within \
             2^-22 of its value and its + hc_eps within 2^-24 (5·2^-23 of the value together; \
             the last 2^-23 and the magnitude's 0.5·2^-23 for second-order terms and the f64 \
             magnitude's difference from the f32 path): the case's magnitude is σ·(|t| + \
             |logit|) from its f64 values",
        ),
        Op::LinearF32 => (
            Bound::Bitwise,
            "the fp32 linears (and the head of sample_linear) stay on the exact sgemm order",
        ),
        Op::RmsNorm
        | Op::Rope
        | Op::Qdq
        | Op::Hc
        | Op::IndexScores
        | Op::Sampling
        | Op::RouteExperts
        | Op::EngramGather
        | Op::TableRows
        | Op::ScaleAt
        | Op::StreamMeans
        | Op::GatedPool
        | Op::EngramInject => (
            Bound::Bitwise,
            "no fast path: the fast numerics run the exact kernel of this op",
        ),
    }
}

/// The f32 attention's bound ([`fast_bound`]) over at most `keys` keys, `score` the largest
/// `scale · Σ_d |q_d k_d|` and `sink` the largest |sink|: the fast side's (kernels/src/ops/
/// attention.rs, with `ε` its largest weight error) and the reference's, each of the weighted
/// magnitude `A ≤ max_j |v_j|` and of the value, the fast side's over `1 − ε − e_l`.
fn f32_attention_within(keys: usize, score: f64, sink: f64) -> Bound {
    let p = |e: i32| 2f64.powi(e);
    // Splits of 64 keys (fast) and blocks of 64 keys (the reference's chain).
    let splits = keys.div_ceil(64).max(1) as f64;
    // |s − M| ≤ 2 score, |sink − M| ≤ |sink| + score, and 1 for the fast scores' δ.
    let r = 2.0 * score + sink + 1.0;
    let delta = (3.01 * p(-16) + 215.0 * p(-23)) * score;
    let fast_eps = delta * (1.0 + delta) + (4.0 + splits) * (p(-22) + p(-24) * r);
    let fast_v = 3.01 * p(-16) + (219.0 + 3.0 * splits) * p(-23);
    let fast_l = (13.0 + 3.0 * splits) * p(-24);
    // The reference: f32 scores (one rounding of the f64 dot, one of the scale), correctly
    // rounded exponentials of rounded differences (one a key and one per later block), f32
    // products summed in f64 per block of 64 (one rounding to f32 a block, then the running
    // output's product and sum), the weights' fp32 sums of 64 and the denominator's chain.
    let ref_eps = p(-23) * score + (1.0 + splits) * (p(-24) + p(-24) * r);
    let ref_v = (1.0 + 3.0 * splits) * p(-24);
    let ref_l = (65.0 + 2.0 * splits) * p(-24);
    let quotient = 1.0 / (1.0 - fast_eps - fast_l);
    Bound::Within {
        of_magnitude: quotient * (fast_eps + fast_v) + 1.01 * (ref_eps + ref_v),
        of_value: quotient * (fast_eps + fast_l) + 1.01 * (ref_eps + ref_l) + p(-22),
    }
}

/// The summation and operand-rounding share of the fast bf16 linear over `inp` terms (see
/// [`fast_bound`]): 2^-8 for the bf16 operands, `(17·⌈K/16⌉ + PARTS)·2^-23` for its sum
/// (`PARTS` = 8), `K·2^-24` for the reference's.
fn dense_terms(inp: usize) -> f64 {
    let k = inp as f64;
    2f64.powi(-8) + (17.0 * (k / 16.0).ceil() + 8.0) * 2f64.powi(-23) + k * 2f64.powi(-24)
}

const GEMM_REASON: &str = "both sides quantise the activations to the same E4M3 codes; the \
     tensor core's in-group sum keeps ≥ 13 fraction bits ((G − 1)·2^-13·S), its part sums and \
     the reference's group sums add in fp32 (≤ 3·(K/G)·2^-24·S together), S = Σ s_a s_w |a w| \
     the case's magnitude (as the reference GEMM of |x| and |W| computes it, 2^-8 margin for its \
     own rounding); each side rounds the output to bf16 once (kernels/src/ops/gemm_fast.rs)";

/// The block-scaled GEMM bound of activation groups `group` over `inp` terms ([`GEMM_REASON`]).
fn gemm_within(group: usize, inp: usize) -> Bound {
    let p = |e: i32| 2f64.powi(e);
    let groups = inp.div_ceil(group) as f64;
    Bound::Within {
        of_magnitude: (1.0 + p(-8))
            * ((group as f64 - 1.0) * p(-13) + 3.0 * groups * p(-24) * (1.0 + p(-8))),
        of_value: p(-8),
    }
}

/// What a case read back from one backend.
#[derive(Debug, Clone, PartialEq)]
enum Values {
    F32(Vec<f32>),
    /// Token or expert ids, compared for equality in both modes.
    Ids(Vec<u32>),
    /// Anything else compared for equality in both modes (errors, log-probabilities' bits).
    Text(String),
}

#[derive(Debug, Clone)]
struct Output {
    what: String,
    values: Values,
    /// Each value's magnitude for a [`Bound::Within`] (none: 0, the value-relative term alone).
    magnitude: Option<Vec<f32>>,
}

/// The outputs of one run of a case on one backend, and the invariants it found broken there.
#[derive(Debug, Default)]
pub struct Outputs {
    list: Vec<Output>,
    broken: Vec<String>,
}

impl Outputs {
    /// Values compared bitwise (`exact`) or within the op's bound with magnitude 0 (`fast`).
    pub fn values(&mut self, what: impl Into<String>, values: impl Into<Vec<f32>>) {
        self.push(what.into(), Values::F32(values.into()), None);
    }

    /// Values with the magnitude of each (the op's sum of absolute terms) for its fast bound.
    pub fn bounded(&mut self, what: impl Into<String>, values: impl Into<Vec<f32>>, m: &[f32]) {
        self.push(what.into(), Values::F32(values.into()), Some(m.to_vec()));
    }

    /// Ids, equal in both modes.
    pub fn ids(&mut self, what: impl Into<String>, ids: Vec<u32>) {
        self.push(what.into(), Values::Ids(ids), None);
    }

    /// A result compared by its debug text in both modes (an error, a value's bits).
    pub fn text(&mut self, what: impl Into<String>, value: impl std::fmt::Debug) {
        self.push(what.into(), Values::Text(format!("{value:?}")), None);
    }

    /// An invariant of this backend on its own: `got` bitwise equals `want` (a row of a batch and
    /// the op on that row alone).
    pub fn same(&mut self, what: impl Into<String>, got: &[f32], want: &[f32]) {
        if let Some(message) = bitwise_difference(got, want) {
            self.broken.push(format!("{}: {message}", what.into()));
        }
    }

    /// An invariant of this backend on its own that `holds`.
    pub fn holds(&mut self, what: impl Into<String>, holds: bool) {
        if !holds {
            self.broken.push(what.into());
        }
    }

    fn push(&mut self, what: String, values: Values, magnitude: Option<Vec<f32>>) {
        self.list.push(Output {
            what,
            values,
            magnitude,
        });
    }
}

type Run = Box<dyn Fn(&dyn Backend, &mut Outputs) + Send + Sync>;

/// One op case: a name, the op (its bound), and its calls on a backend, its inputs captured.
pub struct Case {
    pub name: String,
    pub op: Op,
    run: Run,
}

impl Case {
    pub fn new(
        name: impl Into<String>,
        op: Op,
        run: impl Fn(&dyn Backend, &mut Outputs) + Send + Sync + 'static,
    ) -> Case {
        Case {
            name: name.into(),
            op,
            run: Box::new(run),
        }
    }

    /// The case's outputs on `backend`.
    pub fn outputs(&self, backend: &dyn Backend) -> Outputs {
        let mut outputs = Outputs::default();
        (self.run)(backend, &mut outputs);
        outputs
    }
}

/// What [`check`] compared: values, and the worst `|error| / bound` of bounded values.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Checked {
    pub values: usize,
    pub worst: f64,
}

/// Runs `case` on `reference` and `device` and compares every output in `mode`; the failures
/// named, one line each.
pub fn check(
    case: &Case,
    reference: &dyn Backend,
    device: &dyn Backend,
    mode: Mode,
) -> Result<Checked, Vec<String>> {
    let want = case.outputs(reference);
    let got = case.outputs(device);
    let bound = match mode {
        Mode::Exact => Bound::Bitwise,
        Mode::Fast => fast_bound(case.op).0,
    };
    let mut failures: Vec<String> = Vec::new();
    for broken in &want.broken {
        failures.push(format!("reference {}: {broken}", reference.name()));
    }
    for broken in &got.broken {
        failures.push(format!("device {}: {broken}", device.name()));
    }
    if got.list.len() != want.list.len() {
        failures.push(format!(
            "{} outputs on the device, {} on the reference",
            got.list.len(),
            want.list.len()
        ));
    }
    let mut checked = Checked::default();
    for (g, w) in got.list.iter().zip(&want.list) {
        if g.what != w.what {
            failures.push(format!(
                "output {} on the device, {} on the reference",
                g.what, w.what
            ));
            continue;
        }
        let compared = match (&g.values, &w.values) {
            (Values::F32(g_values), Values::F32(w_values)) => {
                compare_f32(g_values, w_values, w.magnitude.as_deref(), bound)
            }
            (g_values, w_values) if g_values == w_values => Ok((count(g_values), 0.0)),
            (g_values, w_values) => Err(format!(
                "device {} reference {}",
                clip(&format!("{g_values:?}")),
                clip(&format!("{w_values:?}"))
            )),
        };
        match compared {
            Ok((values, worst)) => {
                checked.values += values;
                checked.worst = checked.worst.max(worst);
            }
            Err(message) => failures.push(format!("{}: {message}", w.what)),
        }
    }
    if failures.is_empty() {
        Ok(checked)
    } else {
        Err(failures)
    }
}

/// Checks every case of `cases`; panics naming every failing case and output, else returns the
/// totals (and prints them, with each case's worst ratio in `fast`).
pub fn assert_conforms(
    cases: &[Case],
    reference: &dyn Backend,
    device: &dyn Backend,
    mode: Mode,
) -> Checked {
    assert!(!cases.is_empty(), "no cases to check");
    let mut total = Checked::default();
    let mut report = String::new();
    for case in cases {
        match check(case, reference, device, mode) {
            Ok(checked) => {
                total.values += checked.values;
                total.worst = total.worst.max(checked.worst);
            }
            Err(failures) => {
                let _ = writeln!(report, "{} ({mode:?}):", case.name);
                for failure in failures {
                    let _ = writeln!(report, "  {failure}");
                }
            }
        }
    }
    assert!(
        report.is_empty(),
        "{} on {} against {}:\n{report}",
        cases[0].name,
        device.name(),
        reference.name()
    );
    println!(
        "{} cases ({} …) {mode:?} on {}: {} values conform (worst |error| / bound {:.3})",
        cases.len(),
        cases[0].name,
        device.name(),
        total.values,
        total.worst
    );
    total
}

fn count(values: &Values) -> usize {
    match values {
        Values::F32(v) => v.len(),
        Values::Ids(v) => v.len(),
        Values::Text(_) => 1,
    }
}

fn clip(text: &str) -> String {
    const MAX: usize = 200;
    match text.char_indices().nth(MAX) {
        Some((at, _)) => format!("{} …", &text[..at]),
        None => text.to_string(),
    }
}

/// The first bitwise difference of `got` and `want`, described; `None` when they are equal.
fn bitwise_difference(got: &[f32], want: &[f32]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} values, {} wanted", got.len(), want.len()));
    }
    let differ = |i: usize| got[i].to_bits() != want[i].to_bits();
    let first = (0..got.len()).find(|&i| differ(i))?;
    Some(format!(
        "{} of {} values differ; first at {first}: {:e} ({:#010x}) wanted {:e} ({:#010x})",
        (0..got.len()).filter(|&i| differ(i)).count(),
        got.len(),
        got[first],
        got[first].to_bits(),
        want[first],
        want[first].to_bits()
    ))
}

/// Compares `got` with the reference's `want` under `bound`: (values, worst |error| / bound).
fn compare_f32(
    got: &[f32],
    want: &[f32],
    magnitude: Option<&[f32]>,
    bound: Bound,
) -> Result<(usize, f64), String> {
    let Bound::Within {
        of_magnitude,
        of_value,
    } = bound
    else {
        return match bitwise_difference(got, want) {
            None => Ok((got.len(), 0.0)),
            Some(message) => Err(message),
        };
    };
    if got.len() != want.len() {
        return Err(format!("{} values, {} wanted", got.len(), want.len()));
    }
    if let Some(m) = magnitude
        && m.len() != want.len()
    {
        return Err(format!("{} magnitudes for {} values", m.len(), want.len()));
    }
    let (mut worst, mut outside, mut first) = (0f64, 0usize, None);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() == w.to_bits() {
            continue;
        }
        let m = magnitude.map_or(0.0, |m| f64::from(m[i].abs()));
        let allowed = of_magnitude * m + of_value * f64::from(w).abs();
        let error = (f64::from(g) - f64::from(w)).abs();
        let ratio = error / allowed.max(f64::MIN_POSITIVE);
        if error.is_nan() || error > allowed {
            outside += 1;
            first.get_or_insert((i, g, w, allowed));
        } else {
            worst = worst.max(ratio);
        }
    }
    match first {
        None => Ok((got.len(), worst)),
        Some((i, g, w, allowed)) => Err(format!(
            "{outside} of {} values outside the bound; first at {i}: {g:e} wanted {w:e} \
             (allowed ±{allowed:e})",
            got.len()
        )),
    }
}
