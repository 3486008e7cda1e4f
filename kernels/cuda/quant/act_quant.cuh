// FP8 activation quantisation Q8 (v41-architecture.md §3.0): per contiguous group of G elements,
// amax = max(max|x|, 1e-4), s = P2(amax * fp32(1/448)), q = e4m3_RNE(clamp(x / s, +-448)).
// One warp per (row, group); the max is order-independent, so the result is exact and does not
// depend on the launch shape.
#pragma once
#include "common/numerics.cuh"

template <int GROUP, class T>
__device__ void act_quant_fp8(const T* __restrict__ x, u8_t* __restrict__ codes,
                              float* __restrict__ scales, ActQuantParams p) {
    static_assert(GROUP % 32 == 0, "a group is a whole number of warps' lanes");
    constexpr int PER_LANE = GROUP / 32;
    const u32_t groups_per_row = p.cols / GROUP;
    const unsigned long long group =
        (unsigned long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (group >= (unsigned long long)p.rows * groups_per_row) return;
    const u32_t lane = threadIdx.x % 32;
    const unsigned long long base = group * GROUP;  // groups tile each row exactly (cols % G == 0)

    float v[PER_LANE];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        v[i] = to_f32(x[base + lane + 32 * i]);
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    amax = fmaxf(amax, 1e-4f);
    const float inv448 = 1.0f / 448.0f;  // the fp32 constant c: multiply, do not divide
    const float s = p2_scale(__fmul_rn(amax, inv448));
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const float q = fminf(fmaxf(__fdiv_rn(v[i], s), -448.0f), 448.0f);
        codes[base + lane + 32 * i] = e4m3_encode(q);
    }
    if (lane == 0) scales[group] = s;
}
