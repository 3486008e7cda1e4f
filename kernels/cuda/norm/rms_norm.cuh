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

// 1 / sqrt(mean(x^2) + eps) of the row xr of `cols` (every thread of the block calls it): the mean
// of squares in torch's CPU row sum order (refmath::torch_sum_block: x^2 rounded to fp32, 8 lanes
// x 4 accumulators, 4-level cascade), as deepinfer-model's sum_squares_f32_torch.
__device__ __forceinline__ float inv_rms(const float* __restrict__ xr, u32_t cols, float eps) {
    __shared__ float scratch[refmath::TORCH_SUM_ILP * refmath::TORCH_SUM_LANES + refmath::TORCH_SUM_LANES + 1];
    const float sum_squares = refmath::torch_sum_block<float, true>(xr, cols, scratch);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_squares, (float)cols), eps)));
}

// One normed output, w * (x * inv_rms), rounded to bf16 when ROUND_BF16.
template <bool ROUND_BF16>
__device__ __forceinline__ float normed(float w, float x, float inv_rms) {
    return store_f32<float, ROUND_BF16>(__fmul_rn(w, __fmul_rn(x, inv_rms)));
}

// f32 storage (the model's host layout); y rounded to bf16 when ROUND_BF16, else kept in fp32;
// with QUANT, y's FP8 codes [rows, cols] and scales [rows, cols / 32] as well.
template <bool ROUND_BF16, bool QUANT = false>
__device__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                         RmsNormParams p, u8_t* __restrict__ codes = nullptr,
                         float* __restrict__ scales = nullptr) {
    const u32_t row = blockIdx.x;
    if (row >= p.rows) return;
    const float* xr = x + (size_t)row * p.cols;
    float* yr = y + (size_t)row * p.cols;

    // The first CACHED elements of each thread (and their weights) stay in registers for the
    // output pass (a whole row up to THREADS * CACHED = 8192 columns); the loads are unrolled so
    // that they are in flight together.
    float cached[CACHED];
    float weights[CACHED];
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
        const u32_t c = threadIdx.x + i * THREADS;
        cached[i] = c < p.cols ? xr[c] : 0.0f;
        weights[i] = c < p.cols ? w[c] : 0.0f;
    }
    const float inv = inv_rms(xr, p.cols, p.eps);

    const size_t row0 = (size_t)row * p.cols;
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
        const u32_t c = threadIdx.x + i * THREADS;
        if (c >= p.cols) continue;  // warp-uniform with QUANT (cols % 32 == 0)
        const float v = normed<ROUND_BF16>(weights[i], cached[i], inv);
        yr[c] = v;
        if constexpr (QUANT) act_quant_g32_one(v, row0 + c, codes, scales);
    }
    for (u32_t c = threadIdx.x + CACHED * THREADS; c < p.cols; c += THREADS) {
        const float v = normed<ROUND_BF16>(w[c], xr[c], inv);
        yr[c] = v;
        if constexpr (QUANT) act_quant_g32_one(v, row0 + c, codes, scales);
    }
}

}  // namespace rmsnorm
