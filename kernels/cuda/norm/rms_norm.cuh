// RMSNorm over the last axis (v41-architecture.md §3.0): y = bf16(w * (x * rsqrt(mean(x^2) + eps)))
// with fp32 math (the squares summed in f64, as the CPU reference does). One block per row with a
// fixed thread count, so a row's reduction order never depends on the number of rows (batch
// invariance).
#pragma once
#include "common/numerics.cuh"

namespace rmsnorm {

constexpr int THREADS = 256;
constexpr int CACHED = 32;

template <class T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                         RmsNormParams p) {
    __shared__ double warp_sums[THREADS / 32];
    const u32_t row = blockIdx.x;
    if (row >= p.rows) return;
    const T* xr = x + (size_t)row * p.cols;
    T* yr = y + (size_t)row * p.cols;

    // The first CACHED elements of each thread (and their weights) stay in registers between the
    // two passes (a whole row up to THREADS * CACHED = 8192 columns); the loads are unrolled so that
    // they are in flight together. x^2 of a bf16 x is exact in fp32; the squares are summed in f64
    // (thread t: columns t, t + THREADS, ...; then a fixed shuffle tree; then the 8 warp sums in
    // order) and rounded to fp32 once, like deepinfer-model's sum_squares_f32: the f64 sum is exact
    // unless the squares span more than ~40 binades, so the order almost never shows.
    float cached[CACHED];
    float weights[CACHED];  // loaded with x, so that the second pass waits on no memory
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
        const u32_t c = threadIdx.x + i * THREADS;
        cached[i] = c < p.cols ? to_f32(xr[c]) : 0.0f;
        weights[i] = c < p.cols ? to_f32(w[c]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < CACHED; ++i) sum = __dadd_rn(sum, (double)__fmul_rn(cached[i], cached[i]));
    for (u32_t c = threadIdx.x + CACHED * THREADS; c < p.cols; c += THREADS) {
        const float v = to_f32(xr[c]);
        sum = __dadd_rn(sum, (double)__fmul_rn(v, v));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    double total = 0.0;
#pragma unroll
    for (int i = 0; i < THREADS / 32; ++i) total += warp_sums[i];  // every thread, same order
    const float sum_squares = __double2float_rn(total);
    const float inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_squares, (float)p.cols), p.eps)));

#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
        const u32_t c = threadIdx.x + i * THREADS;
        if (c < p.cols) yr[c] = from_f32<T>(__fmul_rn(weights[i], __fmul_rn(cached[i], inv_rms)));
    }
    for (u32_t c = threadIdx.x + CACHED * THREADS; c < p.cols; c += THREADS) {
        const float v = __fmul_rn(to_f32(w[c]), __fmul_rn(to_f32(xr[c]), inv_rms));
        yr[c] = from_f32<T>(v);
    }
}

}  // namespace rmsnorm
