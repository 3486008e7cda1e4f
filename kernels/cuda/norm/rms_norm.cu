// RMSNorm instantiations on f32 storage (the model's host layout), fp32 math.
#include "common/grid_dependency.cuh"
#include "norm/rms_norm.cuh"

// x and w read as f32, y rounded to bf16 in f32 storage.
extern "C" __global__ void __launch_bounds__(rmsnorm::THREADS)
    rms_norm_f32(const float* x, const float* w, float* y, RmsNormParams p) {
    grid_dependency_sync();
    rmsnorm::rms_norm<true>(x, w, y, p);
}

// f32 storage, fp32 outputs (no rounding).
extern "C" __global__ void __launch_bounds__(rmsnorm::THREADS)
    rms_norm_f32_exact(const float* x, const float* w, float* y, RmsNormParams p) {
    grid_dependency_sync();
    rmsnorm::rms_norm<false>(x, w, y, p);
}

// As rms_norm_f32, and y's FP8 activations in groups of 32 (cols % 32 == 0): the next FP8 GEMM's
// quantisation in the same pass.
extern "C" __global__ void __launch_bounds__(rmsnorm::THREADS)
    rms_norm_act_quant_g32_f32(const float* x, const float* w, float* y, u8_t* codes, float* scales,
                               RmsNormParams p) {
    grid_dependency_sync();
    rmsnorm::rms_norm<true, true>(x, w, y, p, codes, scales);
}
