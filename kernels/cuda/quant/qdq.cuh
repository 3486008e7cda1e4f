// The QDQ points of v41-architecture.md §3.0 on f32 storage of bf16 values, in place over a flat
// buffer cut into consecutive groups of G (a shorter last group is allowed, as the CPU reference's
// `chunks`): Q8 (G = 32, UE8M0 scale, E4M3 values), Q4e (G = 32, UE8M0 scale, E2M1 values) and
// Q4m (G = 16, E4M3 scale, E2M1 values). One lane per element; the G lanes of a group take their
// amax with a butterfly (max is order-free), so the result is exact and does not depend on the
// launch shape or on other groups (batch invariant).
#pragma once
#include "common/reference_math.cuh"

namespace qdq {

constexpr int THREADS = 256;

struct Q8 {
    static constexpr int G = 32;
    __device__ static float apply(float v, float amax) {
        amax = fmaxf(amax, 1e-4f);
        const float s = p2_scale(__fmul_rn(amax, 1.0f / 448.0f));
        const u8_t code = e4m3_encode(fminf(fmaxf(__fdiv_rn(v, s), -448.0f), 448.0f));
        return round_bf16_f32(__fmul_rn(e4m3_decode(code), s));
    }
};

struct Q4e {
    static constexpr int G = 32;
    __device__ static float apply(float v, float amax) {
        amax = fmaxf(amax, 6.0f * 0x1p-126f);
        const float s = p2_scale(__fmul_rn(amax, 1.0f / 6.0f));
        const float scaled = fminf(fmaxf(__fdiv_rn(v, s), -6.0f), 6.0f);
        return round_bf16_f32(__fmul_rn(refmath::e2m1_round(scaled), s));
    }
};

struct Q4m {
    static constexpr int G = 16;
    __device__ static float apply(float v, float amax) {
        amax = fmaxf(amax, 6.0f * 0x1p-9f);
        const float s = e4m3_decode(e4m3_encode(fminf(__fdiv_rn(amax, 6.0f), 448.0f)));
        const float scaled = fminf(fmaxf(__fdiv_rn(v, s), -6.0f), 6.0f);
        return round_bf16_f32(__fmul_rn(refmath::e2m1_round(scaled), s));
    }
};

template <class Rule>
__device__ void qdq_in_place(float* __restrict__ x, QdqParams p) {
    static_assert(32 % Rule::G == 0, "a group is a power-of-two part of a warp");
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool valid = i < p.n;
    const float v = valid ? x[i] : 0.0f;
    float amax = fabsf(v);
#pragma unroll
    for (int offset = Rule::G / 2; offset > 0; offset >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if (valid) x[i] = Rule::apply(v, amax);
}

}  // namespace qdq
