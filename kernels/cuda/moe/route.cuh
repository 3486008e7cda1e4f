// The MoE router after the gate linear, operation for operation as deepinfer-model's
// backend::cpu::route_experts: scores s = sqrt(softplus(z)) with the reference's vectorised
// softplus (quant::exp_f32, then quant::log1p_f32: SLEEF's log1pf in double-fp32 arithmetic; above
// 20 the input itself), selection on s + bias (top-k in descending order, f32 total order, ties to
// the lower expert id; or a forced list), weights s_e / (sum + 1e-20) * route_scale (no
// normalisation for a single expert). One block per token: tokens never interact.
#pragma once
#include "common/reference_math.cuh"

namespace moe {

constexpr u32_t THREADS = 128;

// Launch parameters (mirrored by kernels/src/ops/moe.rs `RouteParams`).
struct RouteParams {
    u32_t rows;
    u32_t experts;
    u32_t selected;  // experts chosen per token (top-k clamped to `experts`, or the forced count)
    u32_t forced;    // 0 top-k, 1 every row takes forced_ids[0, selected), 2 row r takes forced_ids[r * selected, (r + 1) * selected)
    float route_scale;
};

// quant::log1p_f32 for the router's inputs (exp_f32 of z <= 20: NaN or [0, 5e8]); the CPU's f64
// fallback for d <= -1 or d > 1e38 is unreachable here, NaN stays NaN.
__device__ float log1p_f32(float d) {
    if (isnan(d)) return d;
    const float LN2_HIGH = 0x1.62e43p-1f;
    const float LN2_LOW = -0x1.05c61p-29f;
    const float dp1 = __fadd_rn(d, 1.0f);
    const int e = (int)((__float_as_uint(__fmul_rn(dp1, 0x1.555556p+0f)) >> 23) & 0xffu) - 127;
    const float t = __int_as_float((int)__float_as_uint(1.0f) - (e << 23));
    const float m = __fmaf_rn(d, t, __fsub_rn(t, 1.0f));
    const float ef = (float)e;
    const float s_head = __fmul_rn(LN2_HIGH, ef);
    const float s_tail = __fmaf_rn(LN2_LOW, ef, __fmaf_rn(LN2_HIGH, ef, -s_head));
    const float den_head = __fadd_rn(2.0f, m);
    const float den_tail = __fadd_rn(__fsub_rn(2.0f, den_head), m);
    const float inv = __fdiv_rn(1.0f, den_head);
    const float x_head = __fmul_rn(m, inv);
    const float residual = __fmaf_rn(inv, m, -x_head);
    const float correction = __fmaf_rn(-den_tail, inv, __fmaf_rn(-den_head, inv, 1.0f));
    const float x_tail = __fmaf_rn(x_head, correction, residual);
    const float x2 = __fmul_rn(x_head, x_head);
    float poly = 0x1.35feb8p-2f;
    poly = __fmaf_rn(poly, x2, 0x1.993394p-2f);
    poly = __fmaf_rn(poly, x2, 0x1.5555b4p-1f);
    const float two_x_head = __fmul_rn(2.0f, x_head);
    const float sum_head = __fadd_rn(s_head, two_x_head);
    const float sum_tail =
        __fadd_rn(__fadd_rn(__fadd_rn(__fsub_rn(s_head, sum_head), two_x_head), s_tail), __fmul_rn(2.0f, x_tail));
    const float cubic = __fmul_rn(__fmul_rn(x2, x_head), poly);
    const float total_head = __fadd_rn(sum_head, cubic);
    const float total_tail = __fadd_rn(__fadd_rn(__fsub_rn(sum_head, total_head), cubic), sum_tail);
    return __fadd_rn(total_head, total_tail);
}

// cpu::softplus.
__device__ __forceinline__ float softplus(float z) { return z > 20.0f ? z : log1p_f32(refmath::exp_f32(z)); }

// Ascending key of the f32 total order (f32::total_cmp).
__device__ __forceinline__ u32_t total_order_key(float v) {
    const u32_t bits = __float_as_uint(v);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ void route_experts(const float* __restrict__ logits, const float* __restrict__ bias,
                              const u32_t* __restrict__ forced_ids, u32_t* __restrict__ experts_out,
                              float* __restrict__ weights_out, RouteParams p) {
    extern __shared__ float shared[];
    float* scores = shared;                        // [experts]
    u32_t* keys = (u32_t*)(shared + p.experts);    // [experts] total-order keys of s + bias
    u32_t* chosen = keys + p.experts;              // [selected]
    const u32_t row = blockIdx.x;
    if (row >= p.rows) return;
    const float* z = logits + (size_t)row * p.experts;
    for (u32_t e = threadIdx.x; e < p.experts; e += THREADS) {
        const float s = __fsqrt_rn(softplus(z[e]));
        scores[e] = s;
        keys[e] = total_order_key(__fadd_rn(s, bias[e]));
    }
    __syncthreads();
    if (p.forced) {
        const u32_t* row_ids = forced_ids + (p.forced == 2u ? (size_t)row * p.selected : 0);
        for (u32_t i = threadIdx.x; i < p.selected; i += THREADS) chosen[i] = row_ids[i];
    } else {
        // Rank of e in "biased descending, lower id first": the experts that precede it.
        for (u32_t e = threadIdx.x; e < p.experts; e += THREADS) {
            const u32_t key = keys[e];
            u32_t rank = 0;
            for (u32_t f = 0; f < p.experts; ++f) rank += (keys[f] > key || (keys[f] == key && f < e)) ? 1u : 0u;
            if (rank < p.selected) chosen[rank] = e;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u32_t* experts = experts_out + (size_t)row * p.selected;
        float* weights = weights_out + (size_t)row * p.selected;
        float sum = 0.0f;
        for (u32_t i = 0; i < p.selected; ++i) sum = __fadd_rn(sum, scores[chosen[i]]);
        sum = __fadd_rn(sum, 1e-20f);
        for (u32_t i = 0; i < p.selected; ++i) {
            float w = scores[chosen[i]];
            if (p.selected > 1u) w = __fdiv_rn(w, sum);
            experts[i] = chosen[i];
            weights[i] = __fmul_rn(w, p.route_scale);
        }
    }
}

}  // namespace moe
