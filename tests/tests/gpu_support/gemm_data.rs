//! Test data of the block-scaled GEMMs shared by the GPU test binaries: wide-range bf16
//! activations, random FP8 / FP4 weights, bf16 uploads and downloads.

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_model::quant;
use deepinfer_model::weights::{Fp4Weight, Fp8Weight};
use half::bf16;

use super::Rng;

/// A bf16 activation with a wide dynamic range (magnitudes 2^-12 .. 2^6, some exact zeros).
pub fn activation(rng: &mut Rng) -> f32 {
    if rng.below(50) == 0 {
        return 0.0;
    }
    let exponent = rng.below(19) as i32 - 12;
    quant::round_bf16(rng.uniform() * 2f32.powi(exponent))
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

/// `rows × cols` bf16 activations; one row in four has a group of tiny values (amax floor) and
/// one group per row is all zeros when there is room.
pub fn activations(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..rows * cols).map(|_| activation(rng)).collect();
    for r in 0..rows {
        let row = &mut x[r * cols..(r + 1) * cols];
        if r % 4 == 1 {
            for v in row[..32].iter_mut() {
                *v = quant::round_bf16(*v * 1e-5);
            }
        }
        if cols >= 64 && r % 3 == 0 {
            row[32..64].fill(0.0);
        }
    }
    x
}

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

pub fn random_fp4_weight(rng: &mut Rng, out: usize, inp: usize) -> Fp4Weight {
    Fp4Weight {
        out,
        inp,
        packed: (0..out * inp / 2).map(|_| rng.below(256) as u8).collect(),
        scales: (0..out * inp / 32).map(|_| e8m0(rng)).collect(),
    }
}

pub fn upload_bf16(rt: &KernelRuntime, values: &[f32]) -> CudaSlice<bf16> {
    let host: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    rt.stream().clone_htod(&host).expect("upload")
}

pub fn download_bf16(rt: &KernelRuntime, values: &CudaSlice<bf16>) -> Vec<f32> {
    rt.stream()
        .clone_dtoh(values)
        .expect("download")
        .iter()
        .map(|v| v.to_f32())
        .collect()
}
