//! Bit-exact quantisation primitives of the V4.1 reference (spec §3.0): bf16 round-to-nearest-even,
//! E4M3 encode/decode, UE8M0 power-of-two scales, E2M1 rounding, the three QDQ points (`Q8`, `Q4e`,
//! `Q4m`), FP8 activation quantisation and the block-scaled FP8 / FP4 GEMMs that consume it.
//!
//! Every value these functions take and return is an `f32`; "bf16" means an `f32` whose low 16 bits
//! are zero (see [`round_bf16`]). The GEMMs accumulate each 32-element block exactly as the reference
//! does (fp32, sequential inside the block), add the scaled block partials in K order and round the
//! result to bf16.

use std::sync::OnceLock;

use crate::weights::{Fp4Weight, Fp8Weight, e2m1_to_f32, e4m3_to_f32, e8m0_to_f32};

/// Largest finite E4M3 magnitude.
pub const FP8_MAX: f32 = 448.0;
/// Largest E2M1 magnitude.
pub const FP4_MAX: f32 = 6.0;
/// Activation group of every FP8/FP4 GEMM input and of the window-KV QDQ.
pub const ACT_GROUP: usize = 32;

/// The E2M1 grid, indexed by the 3-bit magnitude code.
pub const E2M1_GRID: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
/// Midpoints between consecutive grid values; at an exact tie the value goes up only when the upper
/// code is even (0.75, 1.75, 3.5), i.e. round-to-nearest, ties to the even code.
const E2M1_MIDS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
const E2M1_TIE_UP: [bool; 7] = [false, true, false, true, false, true, false];

/// Rounds an f32 to the nearest bf16 value (ties to even), returned as f32. NaN stays NaN.
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7fff + lsb) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// Rounds every element of `xs` to bf16 in place.
pub fn round_bf16_slice(xs: &mut [f32]) {
    for x in xs {
        *x = round_bf16(*x);
    }
}

/// The smallest power of two ≥ `v` for a positive finite `v`, computed from the IEEE fields exactly
/// like the reference's `fast_round_scale`: `2^(e − 127 + [mantissa ≠ 0])`.
pub fn p2_scale(v: f32) -> f32 {
    let bits = v.to_bits();
    let exponent = ((bits >> 23) & 0xff) as i32;
    let mantissa = bits & 0x007f_ffff;
    let log2_ceil = exponent - 127 + i32::from(mantissa != 0);
    f32::from_bits(((log2_ceil + 127) as u32) << 23)
}

/// Encodes an f32 as an E4M3 ("fn") byte with round-to-nearest-even, saturating to ±448.
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let magnitude = x.abs().min(FP8_MAX);
    let min_normal = 2f32.powi(-6);
    let code = if magnitude < min_normal {
        // Subnormal range: quantum 2^-9; 8 quanta is exactly the smallest normal (code 0x08).
        let quanta = magnitude * 512.0;
        round_half_even(quanta) as u8
    } else {
        let bits = magnitude.to_bits();
        let mut exponent = ((bits >> 23) & 0xff) as i32 - 127;
        let mantissa = bits & 0x007f_ffff;
        let mut kept = mantissa >> 20;
        let rest = mantissa & 0x000f_ffff;
        let half = 0x0008_0000;
        if rest > half || (rest == half && kept & 1 == 1) {
            kept += 1;
            if kept == 8 {
                kept = 0;
                exponent += 1;
            }
        }
        (((exponent + 7) as u8) << 3) | kept as u8
    };
    sign | code
}

/// Round half to even for non-negative values far below 2^23.
fn round_half_even(v: f32) -> f32 {
    let floor = v.floor();
    let diff = v - floor;
    if diff > 0.5 || (diff == 0.5 && (floor as i64) % 2 == 1) {
        floor + 1.0
    } else {
        floor
    }
}

/// The 256-entry E4M3 decode table.
pub fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|code| e4m3_to_f32(code as u8)))
}

/// Rounds an f32 to the nearest E4M3 value (RNE, saturating), returned as f32.
pub fn e4m3_round(x: f32) -> f32 {
    e4m3_table()[usize::from(e4m3_encode(x))]
}

/// Rounds a value in [-6, 6] to the E2M1 grid (ties to the even code); the sign of zero is kept.
pub fn e2m1_round(v: f32) -> f32 {
    let magnitude = v.abs();
    let mut code = 0;
    for (mid, tie_up) in E2M1_MIDS.iter().zip(E2M1_TIE_UP) {
        if magnitude > *mid || (magnitude == *mid && tie_up) {
            code += 1;
        }
    }
    let value = E2M1_GRID[code];
    if v.is_sign_negative() { -value } else { value }
}

/// FP8 quantisation of one activation row in groups of `group`: returns the E4M3 codes and the
/// power-of-two scale of each group (`Q8` of spec §3.0). Input values must be bf16.
pub fn quantize_act_fp8(x: &[f32], group: usize) -> (Vec<u8>, Vec<f32>) {
    let inv_max = 1.0f32 / FP8_MAX;
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len().div_ceil(group));
    for chunk in x.chunks(group) {
        let amax = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
        let scale = p2_scale(amax * inv_max);
        codes.extend(
            chunk
                .iter()
                .map(|v| e4m3_encode((v / scale).clamp(-FP8_MAX, FP8_MAX))),
        );
        scales.push(scale);
    }
    (codes, scales)
}

/// `Q8` QDQ in place (groups of 32, UE8M0 scales): the window-KV quantisation point.
pub fn q8_qdq_group32(x: &mut [f32]) {
    let (codes, scales) = quantize_act_fp8(x, ACT_GROUP);
    let table = e4m3_table();
    for (i, value) in x.iter_mut().enumerate() {
        *value = round_bf16(table[usize::from(codes[i])] * scales[i / ACT_GROUP]);
    }
}

/// `Q4e` QDQ in place (groups of 32, UE8M0 scales): indexer queries and index keys.
pub fn q4_qdq_e8m0_group32(x: &mut [f32]) {
    let inv_max = 1.0f32 / FP4_MAX;
    for chunk in x.chunks_mut(32) {
        let amax = chunk
            .iter()
            .fold(0.0f32, |m, v| m.max(v.abs()))
            .max(6.0 * 2f32.powi(-126));
        let scale = p2_scale(amax * inv_max);
        for value in chunk.iter_mut() {
            let v = (*value / scale).clamp(-FP4_MAX, FP4_MAX);
            *value = round_bf16(e2m1_round(v) * scale);
        }
    }
}

/// `Q4m` QDQ in place (groups of 16, E4M3 scales): compressed KV entries.
pub fn q4_qdq_e4m3_group16(x: &mut [f32]) {
    for chunk in x.chunks_mut(16) {
        let amax = chunk
            .iter()
            .fold(0.0f32, |m, v| m.max(v.abs()))
            .max(6.0 * 2f32.powi(-9));
        let scale = e4m3_round((amax / FP4_MAX).min(FP8_MAX));
        for value in chunk.iter_mut() {
            let v = (*value / scale).clamp(-FP4_MAX, FP4_MAX);
            *value = round_bf16(e2m1_round(v) * scale);
        }
    }
}

/// `y = x · Wᵀ` for an FP8 weight with an FP8-quantised input: `x` is `[rows, w.inp]` (bf16
/// values), the result `[rows, w.out]` is bf16. Activation groups are the weight's block size.
pub fn gemm_fp8(x: &[f32], w: &Fp8Weight) -> Vec<f32> {
    let block = w.block;
    let rows = x.len() / w.inp;
    let table = e4m3_table();
    let weight_values: Vec<f32> = w.data.iter().map(|&c| table[usize::from(c)]).collect();
    let weight_scales: Vec<f32> = w.scales.iter().map(|&s| e8m0_to_f32(s)).collect();
    let k_blocks = w.inp / block;
    let mut y = vec![0.0f32; rows * w.out];
    for r in 0..rows {
        let (codes, act_scales) = quantize_act_fp8(&x[r * w.inp..(r + 1) * w.inp], block);
        let act: Vec<f32> = codes.iter().map(|&c| table[usize::from(c)]).collect();
        for n in 0..w.out {
            let w_row = &weight_values[n * w.inp..(n + 1) * w.inp];
            let scale_row = &weight_scales[(n / block) * w.scale_cols()..];
            let mut acc = 0.0f32;
            for kb in 0..k_blocks {
                let range = kb * block..(kb + 1) * block;
                let partial = dot_f32(&act[range.clone()], &w_row[range]);
                acc += partial * act_scales[kb] * scale_row[kb];
            }
            y[r * w.out + n] = round_bf16(acc);
        }
    }
    y
}

/// `y = x · Wᵀ` for a packed FP4 weight with an FP8-quantised input (activation groups of 32, one
/// weight scale per row and 32 columns). `x` is `[rows, w.inp]` bf16; the result is bf16.
pub fn gemm_fp4(x: &[f32], w: &Fp4Weight) -> Vec<f32> {
    const GROUP: usize = 32;
    let rows = x.len() / w.inp;
    let table = e4m3_table();
    let nibbles: [f32; 16] = std::array::from_fn(|c| e2m1_to_f32(c as u8));
    let half = w.inp / 2;
    let k_blocks = w.inp / GROUP;
    let activations: Vec<(Vec<f32>, Vec<f32>)> = x
        .chunks_exact(w.inp)
        .map(|row| {
            let (codes, scales) = quantize_act_fp8(row, GROUP);
            (
                codes.iter().map(|&c| table[usize::from(c)]).collect(),
                scales,
            )
        })
        .collect();
    let mut y = vec![0.0f32; rows * w.out];
    let mut w_row = vec![0.0f32; w.inp];
    for n in 0..w.out {
        for (k, byte) in w.packed[n * half..(n + 1) * half].iter().enumerate() {
            w_row[2 * k] = nibbles[usize::from(byte & 0x0f)];
            w_row[2 * k + 1] = nibbles[usize::from(byte >> 4)];
        }
        let scale_row = &w.scales[n * k_blocks..(n + 1) * k_blocks];
        for (r, (act, act_scales)) in activations.iter().enumerate() {
            let mut acc = 0.0f32;
            for kb in 0..k_blocks {
                let range = kb * GROUP..(kb + 1) * GROUP;
                let partial = dot_f32(&act[range.clone()], &w_row[range]);
                acc += partial * act_scales[kb] * e8m0_to_f32(scale_row[kb]);
            }
            y[r * w.out + n] = round_bf16(acc);
        }
    }
    y
}

/// Shortest FMA chain of the fp32 CPU GEMM (MKL `sgemm`) behind the reference's fp32 `F.linear`:
/// a dot product of `k` products is split into [`sgemm_chains`] equal chains of at least this many.
pub const SGEMM_MIN_CHAIN: usize = 256;

/// How many FMA chains the reference's CPU GEMM splits a dot product of `k` products into: the
/// largest power of two that keeps every chain at least [`SGEMM_MIN_CHAIN`] long (1 below
/// 512 products; 2 chains of 384 at K = 768; 4 of 256 at K = 1024).
pub fn sgemm_chains(k: usize) -> usize {
    let mut chains = 1;
    while k >= 2 * SGEMM_MIN_CHAIN * chains {
        chains *= 2;
    }
    chains
}

/// An fp32 dot product in the summation order of the reference's fp32 `F.linear` on CPU: the K
/// products split into [`sgemm_chains`] equal chains (chain `i` starts at `i · k / chains`), each
/// a sequence of fused multiply-adds from 0, and the chain partials added as a pairwise tree in
/// K order (`(c0 + c1) + (c2 + c3)`, the way a GEMM whose K is split across threads reduces its
/// parts). The order matters where a sum lands near a bf16 midpoint: it reproduces the
/// reference's mHC `pre` coefficients bit for bit on the v41-tiny fixture (K = 1024: 4 chains of
/// 256) and on v41-odd (K = 768: 2 chains of 384, where 3 chains of 256 leave half of them an
/// ulp off and flip the FFN input of row 8 of block 0). Independent of how many rows a call
/// holds, so chunking invariance is kept.
pub fn dot_f32_sgemm(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports FMA, checked just above.
        return unsafe { dot_f32_sgemm_with_fma(a, b) };
    }
    sgemm_order_sum(a, b)
}

/// [`sgemm_order_sum`] compiled with hardware fused multiply-adds (the same exactly rounded
/// operation as the portable `mul_add`, which falls back to a libm call without this feature).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn dot_f32_sgemm_with_fma(a: &[f32], b: &[f32]) -> f32 {
    sgemm_order_sum(a, b)
}

#[inline(always)]
fn sgemm_order_sum(a: &[f32], b: &[f32]) -> f32 {
    let k = a.len();
    let chains = sgemm_chains(k);
    pairwise_chains(a, b, 0, chains, k, chains)
}

/// The pairwise sum of chains `first .. first + count` of a `k`-product dot split into `chains`.
#[inline(always)]
fn pairwise_chains(
    a: &[f32],
    b: &[f32],
    first: usize,
    count: usize,
    k: usize,
    chains: usize,
) -> f32 {
    if count == 1 {
        let range = first * k / chains..(first + 1) * k / chains;
        return a[range.clone()]
            .iter()
            .zip(&b[range])
            .fold(0.0f32, |acc, (x, y)| x.mul_add(*y, acc));
    }
    let half = count / 2;
    pairwise_chains(a, b, first, half, k, chains)
        + pairwise_chains(a, b, first + half, half, k, chains)
}

/// K block of the reference's bf16 CPU GEMM (`F.linear` / `einsum` on bf16 tensors: `wo_a`, the
/// indexer's head weights, the ratio-1 compressor, the index keys): each block of this many
/// products is accumulated in fp32 from 0, the block partials added in K order.
pub const BF16_GEMM_K_BLOCK: usize = 32;

/// An fp32 dot product in the summation order of the reference's bf16 CPU GEMM (rounded to bf16
/// by the caller): [`BF16_GEMM_K_BLOCK`]-product chains of fused multiply-adds from 0 (exact
/// products for bf16 inputs), added in K order. On the fixtures this order, not one chain and not
/// an exactly rounded sum, reproduces every `wo_a` output bit for bit (v41-tiny block 9 row 72
/// and v41-odd blocks 4-9 flip otherwise).
pub fn dot_bf16_gemm(a: &[f32], b: &[f32]) -> f32 {
    a.chunks(BF16_GEMM_K_BLOCK)
        .zip(b.chunks(BF16_GEMM_K_BLOCK))
        .fold(0.0f32, |acc, (x, y)| acc + dot_f32_sgemm(x, y))
}

/// `e^x` in fp32 as the reference's vectorised CPU kernels compute it (torch's `Vectorized::exp`,
/// i.e. SLEEF `expf_u10` with fused multiply-adds): Cody-Waite reduction by ln 2, a degree-6
/// polynomial, scaling by `2^q` in two steps. Within 1 ulp of the true value, and bit-identical to
/// the reference where a correctly rounded `exp` would differ by that ulp (sigmoids of the mHC
/// coefficients and the Engram gate, SiLU, softplus). The reference's standalone `torch.exp` is
/// [`exp_f32_accurate`].
pub fn exp_f32(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HIGH: f32 = 0.693_145_75;
    const LN2_LOW: f32 = 1.428_606_8e-6;
    const POLY: [f32; 6] = [
        1.985_276_2e-4,
        1.393_043_6e-3,
        8.333_361e-3,
        4.166_648_5e-2,
        0.166_666_67,
        0.5,
    ];
    if x.is_nan() {
        return x;
    }
    if x < -104.0 {
        return 0.0;
    }
    if x > 100.0 {
        return f32::INFINITY;
    }
    let q = (x * LOG2_E).round_ties_even();
    let s = q.mul_add(-LN2_LOW, q.mul_add(-LN2_HIGH, x));
    let poly = POLY[1..].iter().fold(POLY[0], |acc, &c| acc.mul_add(s, c));
    let mantissa = 1.0 + (s * s).mul_add(poly, s);
    let q = q as i32;
    let half = q >> 1;
    mantissa * power_of_two(half) * power_of_two(q - half)
}

/// `e^x` in fp32, correctly rounded (evaluated in f64 and rounded once). This stands in for the
/// reference's standalone `torch.exp` on CPU, which runs MKL's vector math (`vsExp`) in its
/// high-accuracy mode rather than the vectorised [`exp_f32`] of torch's fused elementwise kernels
/// (sigmoid, SiLU, softplus): the row softmax of the mHC `comb`. With [`exp_f32`] there instead,
/// 16 more elements of the fixture's per-block streams round the other way (block-local mHC
/// expand flips). MKL's high-accuracy `exp` is itself not correctly rounded (errors up to about
/// 0.55 ulp, in a closed, CPU-dependent algorithm); its 5 other-way roundings on the fixture are
/// the 5 expand flips left (see tests/tests/golden_v41.rs).
pub fn exp_f32_accurate(x: f32) -> f32 {
    f64::from(x).exp() as f32
}

/// `ln(1 + d)` in fp32 as the reference's vectorised CPU kernels compute it (torch's
/// `Vectorized::log1p`, i.e. SLEEF `log1pf_u10` with fused multiply-adds): `1 + d` is split as
/// `2^e · (1 + m)` with `(1 + m)` in [0.75, 1.5), then `e·ln 2 + 2·atanh(m / (2 + m))` is evaluated
/// in double-fp32 (head + tail) arithmetic with a degree-2 polynomial in `x²`. Within 1 ulp of the
/// true value but not always correctly rounded: routing weights of the sqrt-softplus router follow
/// its last bit. Inputs above `1e38` (beyond the core approximation) or at most -1 go through the
/// f64 `ln_1p`.
pub fn log1p_f32(d: f32) -> f32 {
    // ln 2 as its fp32 rounding plus the (negative) remainder.
    const LN2_HIGH: f32 = std::f32::consts::LN_2;
    const LN2_LOW: f32 = -1.904_654_3e-9;
    const POLY: [f32; 3] = [0.302_729_5, 0.399_610_82, 0.666_669_5];
    if d.is_nan() || d <= -1.0 || d > 1e38 {
        return f64::from(d).ln_1p() as f32;
    }
    let dp1 = d + 1.0;
    // Exponent of (1 + d) / 0.75, so that the reduced argument stays in [0.75, 1.5).
    let e = ((dp1 * (1.0f32 / 0.75)).to_bits() >> 23 & 0xff) as i32 - 127;
    let t = f32::from_bits((1.0f32.to_bits() as i32 - (e << 23)) as u32);
    let m = d.mul_add(t, t - 1.0);
    // e · ln 2 as a head + tail pair.
    let e = e as f32;
    let s_head = LN2_HIGH * e;
    let s_tail = LN2_LOW.mul_add(e, LN2_HIGH.mul_add(e, -s_head));
    // x = m / (2 + m) as a head + tail pair (the denominator itself kept as head + tail).
    let den_head = 2.0 + m;
    let den_tail = (2.0 - den_head) + m;
    let inv = 1.0 / den_head;
    let x_head = m * inv;
    let residual = inv.mul_add(m, -x_head);
    let correction = (-den_tail).mul_add(inv, (-den_head).mul_add(inv, 1.0));
    let x_tail = x_head.mul_add(correction, residual);
    let x2 = x_head * x_head;
    let poly = POLY[1..].iter().fold(POLY[0], |acc, &c| acc.mul_add(x2, c));
    // (s_head, s_tail) + 2x, then + x³ · poly, each as head + tail.
    let sum_head = s_head + 2.0 * x_head;
    let sum_tail = (((s_head - sum_head) + 2.0 * x_head) + s_tail) + 2.0 * x_tail;
    let cubic = (x2 * x_head) * poly;
    let total_head = sum_head + cubic;
    let total_tail = ((sum_head - total_head) + cubic) + sum_tail;
    total_head + total_tail
}

/// `2^e` for an exponent in the normal range.
fn power_of_two(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Dot product accumulated in f64 and rounded once to f32: independent of summation order (for the
/// lengths and magnitudes here it is the correctly rounded sum, up to rare double rounding). Used
/// where the reference's order is not known or does not matter (32-element block partials of
/// exact FP8 products, attention and index scores); the reference's fp32 `F.linear` order is
/// [`dot_f32_sgemm`].
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f64, |acc, (x, y)| acc + f64::from(*x) * f64::from(*y)) as f32
}

/// `Σ x²` accumulated in f64 (products rounded to f32 first, as `x.square()` does), rounded to f32.
pub fn sum_squares_f32(xs: &[f32]) -> f32 {
    xs.iter().fold(0.0f64, |acc, x| acc + f64::from(x * x)) as f32
}

/// `Σ x` accumulated in f64, rounded to f32.
pub fn sum_f32(xs: impl IntoIterator<Item = f32>) -> f32 {
    xs.into_iter().fold(0.0f64, |acc, x| acc + f64::from(x)) as f32
}

/// fp32 lanes of the vector registers the reference's torch CPU reductions ran with (its AVX2
/// kernels): the lane count decides which elements share a partial sum in [`sum_f32_torch`].
pub const TORCH_SUM_LANES: usize = 8;

/// Independent accumulators (instruction-level parallelism) of torch's CPU row sum.
const TORCH_SUM_ILP: usize = 4;

/// Cascade levels of torch's CPU row sum.
const TORCH_SUM_LEVELS: usize = 4;

/// `Σ x` of one contiguous fp32 row in the summation order of the reference's torch CPU `sum`
/// over an innermost dimension (also behind `mean`, which divides the sum by the count): rows of
/// at least [`TORCH_SUM_LANES`] elements are summed as vectors of that many lanes by
/// [`TORCH_SUM_ILP`] interleaved accumulators with a [`TORCH_SUM_LEVELS`]-level cascade, the
/// leftover elements are added to 0 one by one and the lanes after them; shorter rows take the
/// same scheme with one lane. This is the mean of squares of every RMSNorm, of the mHC mixes and
/// of the Engram gate, and the gate's dot product: an exactly rounded sum differs from it in the
/// last ulp often enough to flip bf16 roundings downstream.
pub fn sum_f32_torch(xs: &[f32]) -> f32 {
    if xs.len() < TORCH_SUM_LANES {
        return torch_row_sum::<1>(xs)[0];
    }
    let lanes = torch_row_sum::<TORCH_SUM_LANES>(xs);
    let vectorised = xs.len() / TORCH_SUM_LANES * TORCH_SUM_LANES;
    let leftover = xs[vectorised..].iter().fold(0.0f32, |acc, &x| acc + x);
    lanes.iter().fold(leftover, |acc, &lane| acc + lane)
}

/// `Σ x²` with each square rounded to fp32 first (as `x.square()` does), summed like
/// [`sum_f32_torch`].
pub fn sum_squares_f32_torch(xs: &[f32]) -> f32 {
    let squares: Vec<f32> = xs.iter().map(|x| x * x).collect();
    sum_f32_torch(&squares)
}

/// The per-lane partial sums of torch's row sum over the `xs.len() / W` whole vectors of `xs`
/// (`W` lanes each): vector `i` goes to accumulator `i % ILP`; every `2^p` groups of ILP vectors
/// (`p = max(4, ⌈log2 groups⌉ / LEVELS)`) the level-0 accumulators are carried up the cascade;
/// the levels are then folded down, the vectors left over after the last whole group are added to
/// accumulator 0, and accumulators 1.. are added to it in order.
fn torch_row_sum<const W: usize>(xs: &[f32]) -> [f32; W] {
    const ILP: usize = TORCH_SUM_ILP;
    let vectors = xs.len() / W;
    let groups = vectors / ILP;
    let mut acc = [[[0.0f32; W]; ILP]; TORCH_SUM_LEVELS];
    let level_power = 4.max(ceil_log2(groups) / TORCH_SUM_LEVELS);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let add_group = |acc: &mut [[f32; W]; ILP], group: usize| {
        for (k, lanes) in acc.iter_mut().enumerate() {
            let vector = &xs[(group * ILP + k) * W..(group * ILP + k + 1) * W];
            for (lane, &x) in lanes.iter_mut().zip(vector) {
                *lane += x;
            }
        }
    };
    let add_into = |to: &mut [[f32; W]; ILP], from: &[[f32; W]; ILP]| {
        for (to, from) in to.iter_mut().zip(from) {
            for (t, f) in to.iter_mut().zip(from) {
                *t += f;
            }
        }
    };
    let mut group = 0;
    while group + level_step <= groups {
        for _ in 0..level_step {
            add_group(&mut acc[0], group);
            group += 1;
        }
        for level in 1..TORCH_SUM_LEVELS {
            let below = std::mem::replace(&mut acc[level - 1], [[0.0; W]; ILP]);
            add_into(&mut acc[level], &below);
            if group & (level_mask << (level * level_power)) != 0 {
                break;
            }
        }
    }
    while group < groups {
        add_group(&mut acc[0], group);
        group += 1;
    }
    for level in 1..TORCH_SUM_LEVELS {
        let upper = acc[level];
        add_into(&mut acc[0], &upper);
    }
    let [first, rest @ ..] = acc[0];
    let mut total = first;
    for vector in groups * ILP..vectors {
        for (lane, &x) in total.iter_mut().zip(&xs[vector * W..(vector + 1) * W]) {
            *lane += x;
        }
    }
    for partial in rest {
        for (lane, p) in total.iter_mut().zip(partial) {
            *lane += p;
        }
    }
    total
}

/// `⌈log2 v⌉` (0 for v ≤ 1).
fn ceil_log2(v: usize) -> usize {
    if v <= 1 {
        0
    } else {
        (usize::BITS - (v - 1).leading_zeros()) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_sum_follows_lanes_accumulators_cascade_and_leftovers() {
        let big = 2f32.powi(24);
        let in_order = |xs: &[f32]| xs.iter().fold(0.0f32, |acc, x| acc + x);
        // Below one vector: four scalar accumulators, x0 + x4 meet first (a tie to even).
        let short = [1.0, 1.0, 1.0, 1.0, big];
        assert_eq!(sum_f32_torch(&short), big);
        assert_eq!(in_order(&short), big + 4.0);
        // Elements 1 and 9 share lane 1 (sum 2) before meeting 2^24 in lane 0.
        let mut row = vec![0.0f32; 16];
        (row[0], row[1], row[9]) = (big, 1.0, 1.0);
        assert_eq!(sum_f32_torch(&row), big + 2.0);
        assert_eq!(in_order(&row), big);
        // Leftovers after the last whole vector are summed first, then the lanes.
        let mut row = vec![0.0f32; 18];
        (row[0], row[16], row[17]) = (big, 1.0, 1.0);
        assert_eq!(sum_f32_torch(&row), big + 2.0);
        assert_eq!(in_order(&row), big);
        // 1024 elements: 32 groups of 4 vectors, a cascade level every 16 groups, so elements 512
        // and 544 (second half, lane 0 of accumulator 0) meet element 0 only as a pair.
        let mut row = vec![0.0f32; 1024];
        (row[0], row[512], row[544]) = (big, 1.0, 1.0);
        assert_eq!(sum_f32_torch(&row), big + 2.0);
        assert_eq!(sum_squares_f32_torch(&[3.0, 4.0, 12.0]), 169.0);
    }

    #[test]
    fn sgemm_order_adds_chain_partials_pairwise() {
        // K = 1024: four chains of 256 with sums 2^24, 1, 1, 1. Pairwise: (2^24 + 1) + (1 + 1) =
        // 2^24 + 2 (the first pair is a tie that rounds to even); in K order every +1 rounds away
        // (2^24); exactly rounded, 2^24 + 3 is a tie that goes to 2^24 + 4.
        assert_eq!(sgemm_chains(1024), 4);
        let mut a = vec![0.0f32; 1024];
        for (chain, value) in [2f32.powi(24), 1.0, 1.0, 1.0].into_iter().enumerate() {
            a[chain * 256] = value;
        }
        let b = vec![1.0f32; a.len()];
        assert_eq!(dot_f32_sgemm(&a, &b), 2f32.powi(24) + 2.0);
        assert_eq!(dot_f32(&a, &b), 2f32.powi(24) + 4.0);
    }

    #[test]
    fn sgemm_order_splits_768_products_into_two_chains_of_384() {
        // 2^24 at 0, ones at 256 and 384. Two chains of 384: the first is 2^24 + 1, a tie that
        // rounds to 2^24, and adding the second's 1 ties again: 2^24. Three chains of 256 would
        // give 2^24 + (1 + 1) = 2^24 + 2.
        assert_eq!(
            (sgemm_chains(511), sgemm_chains(512), sgemm_chains(768)),
            (1, 2, 2)
        );
        let mut a = vec![0.0f32; 768];
        (a[0], a[256], a[384]) = (2f32.powi(24), 1.0, 1.0);
        let b = vec![1.0f32; a.len()];
        assert_eq!(dot_f32_sgemm(&a, &b), 2f32.powi(24));
    }

    #[test]
    fn sgemm_order_sums_each_chain_sequentially() {
        // K = 512, two chains of 256. Chain 0: 2^24 then 255 ones; each +1 is a tie at 2^24 and
        // rounds back (sequential fp32). Chain 1: 256 ones, exact. An exactly rounded sum would
        // keep the first chain's 255.
        let mut a = vec![1.0f32; 512];
        a[0] = 2f32.powi(24);
        let b = vec![1.0f32; 512];
        assert_eq!(dot_f32_sgemm(&a, &b), 2f32.powi(24) + 256.0);
        assert_eq!(dot_f32(&a, &b), 2f32.powi(24) + 512.0);
    }

    #[test]
    fn bf16_gemm_order_adds_32_product_blocks_in_k_order() {
        // 2^24 at 0 and ones at 32 and 33: block 0 is 2^24, block 1 is 2 (exact), and 2^24 + 2 is
        // exact. One FMA chain adds the ones to 2^24 one at a time (each a tie that rounds to even).
        let mut a = vec![0.0f32; 64];
        (a[0], a[32], a[33]) = (2f32.powi(24), 1.0, 1.0);
        let b = vec![1.0f32; 64];
        assert_eq!(dot_bf16_gemm(&a, &b), 2f32.powi(24) + 2.0);
        assert_eq!(dot_f32_sgemm(&a, &b), 2f32.powi(24));
    }

    #[test]
    fn hardware_fma_path_equals_the_portable_sum() {
        // A fused multiply-add is one exactly rounded operation however it is computed.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for len in [1, 31, 256, 257, 1000] {
            let a: Vec<f32> = (0..len).map(|_| next() * 1e3).collect();
            let b: Vec<f32> = (0..len).map(|_| next()).collect();
            assert_eq!(
                dot_f32_sgemm(&a, &b).to_bits(),
                sgemm_order_sum(&a, &b).to_bits()
            );
        }
    }

    #[test]
    fn vectorised_exp_is_within_one_ulp_and_saturates() {
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert_eq!(exp_f32(200.0), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        let mut differs = 0;
        for i in -4000..=4000 {
            let x = i as f32 * 0.021;
            let exact = f64::from(x).exp();
            let ours = exp_f32(x);
            let ulp = f64::from(f32::from_bits(ours.to_bits() + 1) - ours);
            assert!(
                (f64::from(ours) - exact).abs() <= ulp,
                "exp({x}) = {ours}, exact {exact}"
            );
            differs += usize::from(ours != exact as f32);
        }
        // Not the correctly rounded exp: the reference's kernel is off by an ulp now and then.
        assert!(differs > 0);
    }

    #[test]
    fn log1p_is_within_one_ulp_and_exact_at_simple_points() {
        assert_eq!(log1p_f32(0.0), 0.0);
        assert_eq!(log1p_f32(1.0), std::f32::consts::LN_2);
        assert_eq!(log1p_f32(2f32.powi(-30)), 2f32.powi(-30));
        let (mut x, mut off_by_one, mut total) = (1e-6f32, 0, 0);
        while x < 1e8 {
            let exact = f64::from(x).ln_1p() as f32;
            let ulps = (log1p_f32(x).to_bits() as i64 - exact.to_bits() as i64).abs();
            assert!(ulps <= 1, "log1p({x}) is {ulps} ulps off");
            off_by_one += usize::from(ulps == 1);
            total += 1;
            x = f32::from_bits(x.to_bits() + 997);
        }
        // Not the correctly rounded function: SLEEF's last bit differs on a small fraction.
        assert!(
            off_by_one > 0 && off_by_one * 100 < total,
            "{off_by_one} of {total} off by one ulp"
        );
    }

    #[test]
    fn accurate_exp_is_correctly_rounded_where_the_vectorised_one_is_not() {
        let (mut x, mut differ) = (-20.0f32, 0);
        while x < 0.0 {
            let accurate = exp_f32_accurate(x);
            assert_eq!(accurate, (f64::from(x).exp()) as f32);
            let ulps = (exp_f32(x).to_bits() as i64 - accurate.to_bits() as i64).abs();
            assert!(ulps <= 1, "exp({x}): vectorised is {ulps} ulps off");
            differ += usize::from(ulps == 1);
            x += 0.001_3;
        }
        assert!(differ > 0, "the two exps never differ");
        assert_eq!(exp_f32_accurate(0.0), 1.0);
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        assert_eq!(round_bf16(1.0), 1.0);
        // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: goes up.
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(
            round_bf16(1.0 + 2f32.powi(-8) + 2f32.powi(-20)),
            1.0 + 2f32.powi(-7)
        );
        assert!(round_bf16(f32::NAN).is_nan());
    }

    #[test]
    fn p2_scale_is_the_smallest_power_of_two_not_below() {
        assert_eq!(p2_scale(1.0), 1.0);
        assert_eq!(p2_scale(1.0001), 2.0);
        assert_eq!(p2_scale(0.3), 0.5);
        assert_eq!(p2_scale(2f32.powi(-20)), 2f32.powi(-20));
    }

    #[test]
    fn e4m3_encode_inverts_decode_and_rounds_to_even() {
        for code in 0u8..=255 {
            let value = e4m3_to_f32(code);
            if value.is_nan() || (value == 0.0 && code == 0x80) {
                continue;
            }
            assert_eq!(e4m3_encode(value), code, "code {code:#x} value {value}");
        }
        assert_eq!(e4m3_round(1000.0), 448.0);
        assert_eq!(e4m3_round(-460.0), -448.0);
        // 1.0625 is halfway between 1.0 (mantissa 0) and 1.125 (mantissa 1): to even, 1.0.
        assert_eq!(e4m3_round(1.0625), 1.0);
        // 1.1875 is halfway between 1.125 (odd) and 1.25: up.
        assert_eq!(e4m3_round(1.1875), 1.25);
        // subnormal halfway 1.5 quanta of 2^-9 -> 2 quanta.
        assert_eq!(e4m3_round(1.5 * 2f32.powi(-9)), 2.0 * 2f32.powi(-9));
    }

    #[test]
    fn e2m1_ties_follow_the_reference_table() {
        assert_eq!(e2m1_round(0.25), 0.0);
        assert_eq!(e2m1_round(0.75), 1.0);
        assert_eq!(e2m1_round(1.25), 1.0);
        assert_eq!(e2m1_round(1.75), 2.0);
        assert_eq!(e2m1_round(2.5), 2.0);
        assert_eq!(e2m1_round(3.5), 4.0);
        assert_eq!(e2m1_round(5.0), 4.0);
        assert_eq!(e2m1_round(-5.01), -6.0);
        assert_eq!(e2m1_round(0.26), 0.5);
    }

    #[test]
    fn q8_qdq_keeps_representable_values_and_uses_a_power_of_two_scale() {
        let mut x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.25).collect();
        x[0] = 448.0 * 0.0078125; // amax 3.5 -> scale p2(3.5/448) = 2^-7
        let before = x.clone();
        q8_qdq_group32(&mut x);
        assert_eq!(x, before); // all values are multiples of 2^-7 with ≤ 4 significant bits
        let mut y = vec![0.0f32; 32];
        y[0] = 1.0;
        y[1] = 0.01;
        q8_qdq_group32(&mut y);
        // scale 2^-8: 0.01 / 2^-8 = 2.56 -> e4m3 2.5 -> 0.009765625
        assert_eq!(y[1], 2.5 * 2f32.powi(-8));
    }

    #[test]
    fn q4_variants_quantise_to_the_grid() {
        let mut x = vec![0.0f32; 32];
        x[0] = 3.0;
        x[1] = 1.3;
        q4_qdq_e8m0_group32(&mut x);
        // scale p2(3/6) = 0.5: 1.3/0.5 = 2.6 -> 3 -> 1.5
        assert_eq!(x[0], 3.0);
        assert_eq!(x[1], 1.5);
        let mut z = vec![0.0f32; 16];
        z[0] = 3.3;
        z[1] = -1.0;
        q4_qdq_e4m3_group16(&mut z);
        // scale e4m3(0.55) = 0.5625: 1/0.5625 = 1.78 -> 2 -> 1.125; 3.3/0.5625 = 5.87 -> 6
        assert_eq!(z[1], -1.125);
        assert_eq!(z[0], round_bf16(6.0 * 0.5625));
    }

    #[test]
    fn gemms_match_the_dequantised_definition() {
        // 2 x 64 FP8 weight, 1 x 64 input that is exactly representable after quantisation.
        let data: Vec<u8> = (0..128)
            .map(|i| [0x38u8, 0xb8, 0x30, 0x40][i % 4])
            .collect();
        let w = Fp8Weight {
            out: 2,
            inp: 64,
            block: 32,
            data,
            scales: vec![127, 126],
        };
        let x: Vec<f32> = (0..64).map(|i| (i % 8) as f32 * 0.5).collect();
        let y = gemm_fp8(&x, &w);
        let dense = w.to_f32();
        for n in 0..2 {
            let expect: f32 = (0..64).map(|k| x[k] * dense[n * 64 + k]).sum();
            assert_eq!(y[n], round_bf16(expect));
        }
        let fp4 = Fp4Weight {
            out: 1,
            inp: 64,
            packed: (0..32).map(|i| (i as u8 % 16) | 0x20).collect(),
            scales: vec![128, 125],
        };
        let y4 = gemm_fp4(&x, &fp4);
        let dense4 = fp4.to_f32();
        let expect4: f32 = (0..64).map(|k| x[k] * dense4[k]).sum();
        assert_eq!(y4[0], round_bf16(expect4));
    }
}
