// FP8 activation quantisation Q8 (v41-architecture.md §3.0): per contiguous group of G elements,
// amax = max(max|x|, 1e-4), s = P2(amax * fp32(1/448)), q = e4m3_RNE(clamp(x / s, +-448)).
// A lane holds 4 consecutive elements (one 16- or 8-byte load), a warp 128 elements: four 32-groups
// (8 lanes each) or one 128-group. The max is order-independent and x / s is computed as x * (1/s),
// the same correctly rounded value for a power-of-two s (1/s is exact: s is in [2^-22, 2^120], or
// +inf, whose reciprocal 0 gives what the division gives), so the result is exact and does not
// depend on the launch shape.
#pragma once
#include "common/numerics.cuh"

constexpr u32_t ACT_QUANT_PER_LANE = 4;
constexpr u32_t ACT_QUANT_PER_WARP = 32 * ACT_QUANT_PER_LANE;

// The 4 elements at x[i..i + 4) as f32.
__device__ __forceinline__ float4 load4_f32(const float* x, unsigned long long i) {
    return *reinterpret_cast<const float4*>(x + i);
}
__device__ __forceinline__ float4 load4_f32(const __nv_bfloat16* x, unsigned long long i) {
    const uint2 raw = *reinterpret_cast<const uint2*>(x + i);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// This lane's elements of `total` in act_quant's layout: warp w takes [128 w, 128 w + 128), each
// lane 4 from `base` (`valid`: inside `total`). False when the warp has none (uniform over the
// warp: it returns, every lane with it).
__device__ __forceinline__ bool act_quant_span(unsigned long long total, unsigned long long& base, bool& valid) {
    const unsigned long long warp = (unsigned long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    base = warp * ACT_QUANT_PER_WARP + (threadIdx.x % 32) * ACT_QUANT_PER_LANE;
    valid = base < total;
    return warp * ACT_QUANT_PER_WARP < total;
}

// The scale of a group whose largest magnitude is amax: P2(max(amax, 1e-4) * fp32(1/448)).
__device__ __forceinline__ float act_quant_scale(float amax) {
    const float inv448 = 1.0f / 448.0f;  // the fp32 constant c: multiply, do not divide
    return p2_scale(__fmul_rn(fmaxf(amax, 1e-4f), inv448));
}

// The E4M3 code of v in a group of scale s, given inv_s = 1/s.
__device__ __forceinline__ u8_t act_quant_code(float v, float inv_s) {
    return e4m3_encode(fminf(fmaxf(__fmul_rn(v, inv_s), -448.0f), 448.0f));
}

// 1/s for a scale s of act_quant_scale, exactly __frcp_rn(s) (the same bits) without its
// special-case branch: s = 2^e with e in [-22, 120], whose reciprocal 2^-e is a normal float with
// exponent field 254 minus s's, or s = +inf (amax = +inf), whose reciprocal is +0 (the field
// difference is negative there, clamped to 0). Integer operations only, so the quantisation of
// several groups in a row has no branch between them.
__device__ __forceinline__ float act_quant_inverse_scale(float s) {
    return __int_as_float(max(0x7f000000 - __float_as_int(s), 0));
}

// Quantises a lane's N values v[j], element index + 32 j of the rows-major activations, each in a
// 32-group that is the warp's 32 lanes (lane i holds element i of every group); groups j < groups
// are stored, the others (past the row) not. Every lane of the warp calls it. The group max is
// one redux.sync over the lanes' |v| bit patterns, the same maximum as an fmaxf tree: |v| >= +0
// orders as its bits, and a NaN (which fmaxf skips) enters as +0, so a group of NaNs gets +0
// where fmaxf gives NaN, both 1e-4 after act_quant_scale's fmaxf: the same scale. The N groups'
// reductions and scales are independent, so they overlap.
template <u32_t N>
__device__ __forceinline__ void act_quant_g32_lanes(const float (&v)[N], u32_t groups, unsigned long long index,
                                                    u8_t* __restrict__ codes, float* __restrict__ scales) {
    float s[N];
    u8_t q[N];
#pragma unroll
    for (u32_t j = 0; j < N; ++j) {
        const u32_t amax = __reduce_max_sync(0xffffffffu, __float_as_uint(fmaxf(fabsf(v[j]), 0.0f)));
        s[j] = act_quant_scale(__uint_as_float(amax));
        q[j] = act_quant_code(v[j], act_quant_inverse_scale(s[j]));
    }
    const bool first_lane = threadIdx.x % 32 == 0;
#pragma unroll
    for (u32_t j = 0; j < N; ++j) {
        if (j < groups) codes[index + 32 * j] = q[j];
        if (j < groups && first_lane) scales[index / 32 + j] = s[j];
    }
}

// Quantises a lane's 4 values v, elements [base, base + 4) of the rows-major activations (groups
// tile each row exactly: cols % GROUP == 0, so every group is wholly inside or wholly past the
// end). Every lane of the warp calls it (the group max is a shuffle over GROUP / 4
// lanes); a lane past the end (`valid` false, v zeros) writes nothing.
template <int GROUP>
__device__ __forceinline__ void act_quant_lane(const float (&v)[ACT_QUANT_PER_LANE], bool valid,
                                               unsigned long long base, u8_t* __restrict__ codes,
                                               float* __restrict__ scales) {
    static_assert(GROUP == 32 || GROUP == 128, "32- or 128-groups");
    constexpr u32_t LANES = GROUP / ACT_QUANT_PER_LANE;  // lanes of one group
    const u32_t lane = threadIdx.x % 32;
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (u32_t offset = LANES / 2; offset > 0; offset >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if (!valid) return;
    const float s = act_quant_scale(amax);
    const float inv_s = __frcp_rn(s);
    u32_t packed = 0;
#pragma unroll
    for (u32_t i = 0; i < ACT_QUANT_PER_LANE; ++i) packed |= (u32_t)act_quant_code(v[i], inv_s) << (8 * i);
    *reinterpret_cast<u32_t*>(codes + base) = packed;
    if (lane % LANES == 0) scales[base / GROUP] = s;
}

// Warp w quantises elements [128 w, 128 w + 128) of the rows-major x.
template <int GROUP, class T>
__device__ void act_quant_fp8(const T* __restrict__ x, u8_t* __restrict__ codes,
                              float* __restrict__ scales, ActQuantParams p) {
    unsigned long long base;
    bool valid;
    if (!act_quant_span((unsigned long long)p.rows * p.cols, base, valid)) return;
    float v[ACT_QUANT_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (valid) {
        const float4 f = load4_f32(x, base);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    }
    act_quant_lane<GROUP>(v, valid, base, codes, scales);
}
