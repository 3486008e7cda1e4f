//! Test data of the block-scaled GEMMs shared by the GPU test binaries: wide-range bf16
//! activations and random FP8 / FP4 weights (`deepinfer_tests::data`), bf16 uploads and
//! downloads.

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use half::bf16;

// Each binary uses its own subset of these.
#[allow(unused_imports)]
pub use deepinfer_tests::data::{
    activation, activations, e4m3, e8m0, random_fp4_weight, random_fp8_weight,
};

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
