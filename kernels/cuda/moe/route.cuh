// The MoE router after the gate linear, operation for operation as deepinfer-model's
// backend::cpu::route_experts: scores s = sqrt(softplus(z)) with the reference's vectorised
// softplus (quant::exp_f32, then quant::log1p_f32: SLEEF's log1pf in double-fp32 arithmetic; above
// 20 the input itself), selection on s + bias (top-k in descending order, f32 total order, ties to
// the lower expert id; or a forced list), weights s_e / (sum + 1e-20) * route_scale (no
// normalisation for a single expert). One block per token: tokens never interact.
//
// A thread per expert (THREADS covers V4.1's 384 in one pass). The top-k in two steps, each a
// count of the experts above one in the selection order (`order_of`, total: the order above):
// every warp ranks its GROUP experts among themselves and keeps its best min(k, GROUP) as
// candidates; then each candidate counts the candidates above it, which is its rank among all
// experts for the k chosen (see the merge). Each of the first k threads adds the k chosen scores
// in order from 0 itself and divides its own weight.
// The bits are the reference's: every score, key, sum and weight is the same f32 operations on
// the same operands in the same order (only which thread computes it changed), and the chosen
// ranks are the same function of the keys.
#pragma once
#include "common/reference_math.cuh"

namespace moe {

constexpr u32_t THREADS = 512;
// Experts a warp ranks among themselves before the block merges the groups' best.
constexpr u32_t GROUP = 32;

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

// An expert's place in the selection order as one integer: the key above, the complemented id
// below, so that "greater" is "biased higher, or tied and a lower id". Distinct for distinct ids.
__device__ __forceinline__ unsigned long long order_of(u32_t key, u32_t expert) {
    return ((unsigned long long)key << 32) | (u32_t)~expert;
}

// Candidate slots of each group of GROUP experts (top-k; none for a forced list).
__device__ __forceinline__ u32_t candidates_per_group(const RouteParams& p) {
    return p.forced ? 0u : min(p.selected, GROUP);
}

__device__ void route_experts(const float* __restrict__ logits, const float* __restrict__ bias,
                              const u32_t* __restrict__ forced_ids, u32_t* __restrict__ experts_out,
                              float* __restrict__ weights_out, RouteParams p) {
    extern __shared__ __align__(16) u32_t shared[];
    const u32_t row = blockIdx.x;
    if (row >= p.rows) return;
    const u32_t padded = (p.experts + GROUP - 1) / GROUP * GROUP;
    const u32_t per_group = candidates_per_group(p);
    const u32_t n_candidates = padded / GROUP * per_group;
    const u32_t slots = (n_candidates + 3) / 4 * 4;  // the candidates and zeros (below every one)
    unsigned long long* candidates = (unsigned long long*)shared;  // [slots] order_of values
    u32_t* keys = shared + 2 * slots;                                // [padded] keys of s + bias
    float* scores = (float*)(keys + padded);                         // [experts]
    u32_t* chosen = (u32_t*)(scores + p.experts);                    // [selected]
    const u32_t* row_ids = forced_ids + (p.forced == 2u ? (size_t)row * p.selected : 0);
    // A forced list's first ids load beside the logits.
    const u32_t first_id = p.forced && threadIdx.x < p.selected ? row_ids[threadIdx.x] : 0u;
    const float* z = logits + (size_t)row * p.experts;
    const u32_t lane = threadIdx.x % 32;
    // Whole warps take whole groups (THREADS and padded are multiples of GROUP = 32).
    for (u32_t e = threadIdx.x; e < padded; e += THREADS) {
        u32_t key = 0;  // a padding expert: below every expert (key 0 and a higher id)
        if (e < p.experts) {
            const float z_e = z[e], bias_e = bias[e];  // both loads in flight before the chain
            const float s = __fsqrt_rn(softplus(z_e));
            scores[e] = s;
            key = total_order_key(__fadd_rn(s, bias_e));
        }
        if (p.forced) continue;
        // e's rank within its group; the group's best per_group become candidates, in order.
        keys[e] = key;
        __syncwarp();
        // Within the group, lane j's place stands in for its id (the same order).
        const unsigned long long mine = order_of(key, lane);
        const u32_t base = e - lane;
        u32_t above[4] = {0, 0, 0, 0};  // four independent counts
#pragma unroll
        for (u32_t j = 0; j < GROUP; j += 4) {
            const uint4 four = *(const uint4*)(keys + base + j);
            above[0] += order_of(four.x, j) > mine;
            above[1] += order_of(four.y, j + 1) > mine;
            above[2] += order_of(four.z, j + 2) > mine;
            above[3] += order_of(four.w, j + 3) > mine;
        }
        const u32_t rank = (above[0] + above[1]) + (above[2] + above[3]);
        if (rank < per_group) candidates[base / GROUP * per_group + rank] = order_of(key, e);
    }
    if (threadIdx.x < slots - n_candidates) candidates[n_candidates + threadIdx.x] = 0;
    if (p.forced) {
        if (threadIdx.x < p.selected) chosen[threadIdx.x] = first_id;
        for (u32_t i = threadIdx.x + THREADS; i < p.selected; i += THREADS) chosen[i] = row_ids[i];
    }
    __syncthreads();
    if (!p.forced) {
        // An expert of the top `selected` has fewer than `selected` experts above it, so it is its
        // group's candidate, and so is every expert above it: its rank among the candidates is its
        // rank among all. Any other candidate has the top `selected` above it.
        for (u32_t c = threadIdx.x; c < n_candidates; c += THREADS) {
            const unsigned long long mine = candidates[c];
            u32_t above[4] = {0, 0, 0, 0};
            for (u32_t d = 0; d < slots; d += 4) {
                const ulonglong2 pair0 = *(const ulonglong2*)(candidates + d);
                const ulonglong2 pair1 = *(const ulonglong2*)(candidates + d + 2);
                above[0] += pair0.x > mine;
                above[1] += pair0.y > mine;
                above[2] += pair1.x > mine;
                above[3] += pair1.y > mine;
            }
            const u32_t rank = (above[0] + above[1]) + (above[2] + above[3]);
            if (rank < p.selected) chosen[rank] = ~(u32_t)mine;
        }
        __syncthreads();
    }
    // Each writer adds the selected scores itself, in order from 0, as the reference does; the
    // loads go eight at a time ahead of the adds.
    if (threadIdx.x < p.selected) {
        float sum = 0.0f;
        for (u32_t i = 0; i < p.selected; i += 8) {
            float eight[8];
#pragma unroll
            for (u32_t k = 0; k < 8; ++k) eight[k] = i + k < p.selected ? scores[chosen[i + k]] : 0.0f;
#pragma unroll
            for (u32_t k = 0; k < 8; ++k)
                if (i + k < p.selected) sum = __fadd_rn(sum, eight[k]);
        }
        sum = __fadd_rn(sum, 1e-20f);
        u32_t* experts = experts_out + (size_t)row * p.selected;
        float* weights = weights_out + (size_t)row * p.selected;
        for (u32_t i = threadIdx.x; i < p.selected; i += THREADS) {
            float w = scores[chosen[i]];
            if (p.selected > 1u) w = __fdiv_rn(w, sum);
            experts[i] = chosen[i];
            weights[i] = __fmul_rn(w, p.route_scale);
        }
    }
}

}  // namespace moe
