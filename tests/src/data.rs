//! Seeded test data shared by the conformance cases and the GPU test binaries: the SplitMix64
//! generator and the value distributions the ops are compared over (bf16 values in [-1, 1),
//! wide-range fp32 and bf16 activations, random FP8 / FP4 block-scaled weights).

use deepinfer_model::quant;
use deepinfer_model::weights::{Fp4Weight, Fp8Weight};

/// SplitMix64: a small deterministic generator for test data. A test file adds distributions of
/// its own as functions taking `&mut Rng`.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// `n` bf16 values uniform in [-1, 1).
pub fn bf16_unit(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| quant::round_bf16(rng.uniform())).collect()
}

/// `n` fp32 values (not bf16-representable) of magnitudes 2^-8 .. 2^4.
pub fn fp32_values(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.uniform() * 2f32.powi(rng.below(13) as i32 - 8))
        .collect()
}

/// An fp32 value `uniform · 2^e`, e in `lo..=hi` (not bf16-representable).
pub fn spread(rng: &mut Rng, lo: i32, hi: i32) -> f32 {
    let e = lo + rng.below((hi - lo + 1) as u64) as i32;
    rng.uniform() * 2f32.powi(e)
}

/// A bf16 activation with a wide dynamic range (magnitudes 2^-12 .. 2^6, some exact zeros).
pub fn activation(rng: &mut Rng) -> f32 {
    if rng.below(50) == 0 {
        return 0.0;
    }
    let exponent = rng.below(19) as i32 - 12;
    quant::round_bf16(rng.uniform() * 2f32.powi(exponent))
}

/// `rows × cols` bf16 activations; one row in four has a group of tiny values (amax floor) and
/// one group per row is all zeros when there is room.
pub fn activations(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..rows * cols).map(|_| activation(rng)).collect();
    for r in 0..rows {
        let row = &mut x[r * cols..(r + 1) * cols];
        if r % 4 == 1 {
            for v in row[..32.min(cols)].iter_mut() {
                *v = quant::round_bf16(*v * 1e-5);
            }
        }
        if cols >= 64 && r % 3 == 0 {
            row[32..64].fill(0.0);
        }
    }
    x
}

/// A finite E4M3 byte (never 0x7f / 0xff, the NaN codes).
pub fn e4m3(rng: &mut Rng) -> u8 {
    loop {
        let b = rng.below(256) as u8;
        if b & 0x7f != 0x7f {
            return b;
        }
    }
}

/// A UE8M0 scale byte around 2^0 (2^-12 .. 2^4).
pub fn e8m0(rng: &mut Rng) -> u8 {
    (115 + rng.below(17)) as u8
}

/// A random FP8 weight `[out, inp]` with `block × block` scales.
pub fn random_fp8_weight(rng: &mut Rng, out: usize, inp: usize, block: usize) -> Fp8Weight {
    let scales = out.div_ceil(block) * inp.div_ceil(block);
    Fp8Weight {
        out,
        inp,
        block,
        data: (0..out * inp).map(|_| e4m3(rng)).collect(),
        scales: (0..scales).map(|_| e8m0(rng)).collect(),
    }
}

/// A random FP4 weight `[out, inp]` with one scale per 32 values.
pub fn random_fp4_weight(rng: &mut Rng, out: usize, inp: usize) -> Fp4Weight {
    Fp4Weight {
        out,
        inp,
        packed: (0..out * inp / 2).map(|_| rng.below(256) as u8).collect(),
        scales: (0..out * inp / 32).map(|_| e8m0(rng)).collect(),
    }
}
