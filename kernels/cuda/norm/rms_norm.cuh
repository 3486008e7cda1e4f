// RMSNorm over the last axis (v41-architecture.md §3.0): y = bf16(w * (x * rsqrt(mean(x^2) + eps)))
// with fp32 math, the mean of squares in the order of torch's CPU sum (as the CPU reference). One
// block per row with a fixed thread count, so a row's reduction order never depends on the number
// of rows (batch invariance). With QUANT, the stored outputs are also quantised to FP8 in groups
// of 32 (act_quant.cuh's Q8, the same codes and scales act_quant_fp8_g32 gives y): thread t holds
// the row's elements t + 256 i, so warp w's 32 lanes hold one group, elements 32 w + 256 i ..
// (cols % 32 == 0: a warp's group is wholly inside the row or wholly past it).
#pragma once
#include "common/reference_math.cuh"
#include "quant/act_quant.cuh"

namespace rmsnorm {

constexpr int THREADS = 256;
constexpr int CACHED = 32;

// f32 storage (the model's host layout); y rounded to bf16 when ROUND_BF16, else kept in fp32;
// with QUANT, y's FP8 codes [rows, cols] and scales [rows, cols / 32] as well.
template <bool ROUND_BF16, bool QUANT = false>
__device__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                         RmsNormParams p, u8_t* __restrict__ codes = nullptr,
                         float* __restrict__ scales = nullptr) {
    __shared__ float scratch[refmath::TORCH_SUM_ILP * refmath::TORCH_SUM_LANES + refmath::TORCH_SUM_LANES + 1];
    const u32_t row = blockIdx.x;
    if (row >= p.rows) return;
    const float* xr = x + (size_t)row * p.cols;
    float* yr = y + (size_t)row * p.cols;

    // The first CACHED elements of each thread (and their weights) stay in registers for the
    // output pass (a whole row up to THREADS * CACHED = 8192 columns); the loads are unrolled so
    // that they are in flight together. The mean of squares follows torch's CPU row sum exactly
    // (refmath::torch_sum_block: x^2 rounded to fp32, 8 lanes x 4 accumulators, 4-level cascade),
    // as deepinfer-model's sum_squares_f32_torch: bit-identical to the CPU reference.
    float cached[CACHED];
    float weights[CACHED];
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
        const u32_t c = threadIdx.x + i * THREADS;
        cached[i] = c < p.cols ? xr[c] : 0.0f;
        weights[i] = c < p.cols ? w[c] : 0.0f;
    }
    const float sum_squares = refmath::torch_sum_block<float, true>(xr, p.cols, scratch);
    const float inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_squares, (float)p.cols), p.eps)));

    const size_t row0 = (size_t)row * p.cols;
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
        const u32_t c = threadIdx.x + i * THREADS;
        if (c >= p.cols) continue;  // warp-uniform with QUANT (cols % 32 == 0)
        const float v = store_f32<float, ROUND_BF16>(__fmul_rn(weights[i], __fmul_rn(cached[i], inv_rms)));
        yr[c] = v;
        if constexpr (QUANT) act_quant_g32_one(v, row0 + c, codes, scales);
    }
    for (u32_t c = threadIdx.x + CACHED * THREADS; c < p.cols; c += THREADS) {
        const float v = store_f32<float, ROUND_BF16>(__fmul_rn(w[c], __fmul_rn(xr[c], inv_rms)));
        yr[c] = v;
        if constexpr (QUANT) act_quant_g32_one(v, row0 + c, codes, scales);
    }
}

}  // namespace rmsnorm
