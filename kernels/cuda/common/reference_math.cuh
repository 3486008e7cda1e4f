// Scalar math of deepinfer-model's CPU reference (quant.rs), reproduced operation for operation
// with explicit round-to-nearest intrinsics (no contraction), so that each result is bit-identical:
// the vectorised exp (SLEEF expf_u10 as torch's CPU kernels use it), the correctly rounded exp of
// the reference's standalone torch.exp, the sequential f64 dot product
// (`dot_f32`), E2M1 rounding with ties to the even code, and the sgemm-order fp32 dot product
// (`dot_f32_sgemm`: K split into sgemm_chains(K) equal chains, a power of two, each of at least
// 256 products and each a sequential FMA chain from 0; the chain partials added as a perfect
// pairwise tree in K order: `(c0 + c1) + (c2 + c3)`),
// and torch's CPU row sum (`sum_f32_torch`: 8 lanes x 4 interleaved accumulators with a 4-level
// cascade), behind every mean of squares (RMSNorm, mHC).
#pragma once
#include "common/numerics.cuh"

namespace refmath {

// quant::SGEMM_MIN_CHAIN: the shortest FMA chain of the sgemm order; chains are shorter than twice it.
constexpr u32_t SGEMM_MIN_CHAIN = 256;

// quant::sgemm_chains: the largest power of two that keeps every chain of n products at least
// SGEMM_MIN_CHAIN long (1 below 512).
__device__ __forceinline__ u32_t sgemm_chains(u32_t n) {
    u32_t chains = 1;
    while (n >= 2 * SGEMM_MIN_CHAIN * chains) chains *= 2;
    return chains;
}

// Where chain i of n products split into `chains` starts (chain i ends where chain i + 1 starts).
__device__ __forceinline__ u32_t sgemm_chain_start(u32_t i, u32_t n, u32_t chains) {
    return (u32_t)((unsigned long long)i * n / chains);
}

// quant::BF16_GEMM_K_BLOCK: the chain length of the reference's bf16 GEMM order (quant::dot_bf16_gemm:
// chains of 32 products from 0, the chain partials added in K order).
constexpr u32_t BF16_GEMM_K_BLOCK = 32;

__device__ __forceinline__ float power_of_two(int e) { return __uint_as_float((u32_t)(e + 127) << 23); }

// quant::exp_f32: Cody-Waite reduction by ln 2, degree-6 polynomial, scaling by 2^q in two steps.
__device__ __forceinline__ float exp_f32(float x) {
    if (isnan(x)) return x;
    if (x < -104.0f) return 0.0f;
    if (x > 100.0f) return __uint_as_float(0x7f800000u);
    const float LOG2_E = 1.44269504088896341f;
    const float LN2_HIGH = 0.69314575f;
    const float LN2_LOW = 1.4286068e-6f;
    const float q = rintf(__fmul_rn(x, LOG2_E));  // ties to even
    const float s = __fmaf_rn(q, -LN2_LOW, __fmaf_rn(q, -LN2_HIGH, x));
    float poly = 1.9852762e-4f;
    poly = __fmaf_rn(poly, s, 1.3930436e-3f);
    poly = __fmaf_rn(poly, s, 8.333361e-3f);
    poly = __fmaf_rn(poly, s, 4.1666485e-2f);
    poly = __fmaf_rn(poly, s, 0.16666667f);
    poly = __fmaf_rn(poly, s, 0.5f);
    const float mantissa = __fadd_rn(1.0f, __fmaf_rn(__fmul_rn(s, s), poly, s));
    const int qi = (int)q;
    const int half = qi >> 1;
    return __fmul_rn(__fmul_rn(mantissa, power_of_two(half)), power_of_two(qi - half));
}

// quant::exp_f32_accurate: e^x correctly rounded (f64 then rounded once), the reference's
// standalone torch.exp (attention softmax, mHC comb softmax).
__device__ __forceinline__ float exp_accurate(float x) { return (float)exp((double)x); }

// 1 / (1 + exp(-x)) as the reference's mHC sigmoid.
__device__ __forceinline__ float sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-x)));
}

// quant::dot_f32: f64 products (exact for f32 inputs) added in sequence, rounded once to f32.
__device__ __forceinline__ float dot_f64_sequential(const float* a, const float* b, u32_t n) {
    double acc = 0.0;
#pragma unroll 16
    for (u32_t i = 0; i < n; ++i) acc = __dadd_rn(acc, __dmul_rn((double)a[i], (double)b[i]));
    return __double2float_rn(acc);
}

// dot_f64_sequential with `a` already widened to f64 (the same products and sums).
__device__ __forceinline__ float dot_f64_sequential_wide(const double* a, const float* b, u32_t n) {
    double acc = 0.0;
#pragma unroll 16
    for (u32_t i = 0; i < n; ++i) acc = __dadd_rn(acc, __dmul_rn(a[i], (double)b[i]));
    return __double2float_rn(acc);
}

// One chain of quant::dot_f32_sgemm: sequential FMAs over a[0..n) · b[0..n) from 0.
__device__ __forceinline__ float fma_chain(const float* a, const float* b, u32_t n) {
    float acc = 0.0f;
#pragma unroll 16
    for (u32_t i = 0; i < n; ++i) acc = __fmaf_rn(a[i], b[i], acc);
    return acc;
}

// The pairwise tree of quant::dot_f32_sgemm over chain partials pushed in K order (a power of two
// of them, so one perfect tree). A binary counter builds the tree as the partials arrive (merging
// equal sizes: (c0 + c1) + (c2 + c3)); finish() adds what is left from the right. fp32 addition
// commutes, so only the grouping matters.
struct PairwiseSum {
    float value[32];
    u32_t size[32];
    int top = 0;
    __device__ __forceinline__ void push(float v) {
        u32_t s = 1;
        while (top > 0 && size[top - 1] == s) {
            v = __fadd_rn(value[top - 1], v);
            s *= 2;
            --top;
        }
        value[top] = v;
        size[top] = s;
        ++top;
    }
    __device__ __forceinline__ float finish() const {
        if (top == 0) return 0.0f;
        float r = value[top - 1];
        for (int i = top - 2; i >= 0; --i) r = __fadd_rn(value[i], r);
        return r;
    }
};

// quant::dot_f32_sgemm in one thread.
__device__ __forceinline__ float dot_sgemm_order(const float* a, const float* b, u32_t n) {
    PairwiseSum sum;
    const u32_t chains = sgemm_chains(n);
    for (u32_t i = 0; i < chains; ++i) {
        const u32_t start = sgemm_chain_start(i, n, chains);
        sum.push(fma_chain(a + start, b + start, sgemm_chain_start(i + 1, n, chains) - start));
    }
    return sum.finish();
}

// quant::e2m1_round: a value in [-6, 6] to the E2M1 grid, ties to the even code, sign kept.
__device__ __forceinline__ float e2m1_round(float v) {
    const float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    const bool tie_up[7] = {false, true, false, true, false, true, false};
    const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float magnitude = fabsf(v);
    int code = 0;
#pragma unroll
    for (int i = 0; i < 7; ++i)
        if (magnitude > mids[i] || (magnitude == mids[i] && tie_up[i])) ++code;
    return signbit(v) ? -grid[code] : grid[code];
}

// --- torch's CPU row sum (deepinfer-model quant::sum_f32_torch / torch_row_sum) ---------------
constexpr u32_t TORCH_SUM_LANES = 8;
constexpr u32_t TORCH_SUM_ILP = 4;
constexpr u32_t TORCH_SUM_LEVELS = 4;
constexpr u32_t TORCH_SUM_CHAINS = TORCH_SUM_ILP * TORCH_SUM_LANES;  // 32 chains of W = 8 lanes
// Shared floats of torch_sum_block's scratch: the chain sums and the total.
constexpr u32_t TORCH_SUM_BLOCK_SCRATCH = TORCH_SUM_CHAINS + 1;

__device__ __forceinline__ u32_t ceil_log2(u32_t v) { return v <= 1u ? 0u : 32u - (u32_t)__clz(v - 1u); }

// Element i of the summed row: x[i], or its square rounded to fp32 (x.square()).
template <class T, bool SQUARE>
__device__ __forceinline__ float torch_sum_element(const T* x, u32_t i) {
    const float v = to_f32(x[i]);
    return SQUARE ? __fmul_rn(v, v) : v;
}

// Accumulator (lane, k) of torch_row_sum<W> over x[0..n), cascade levels folded into level 0.
// The ILP x W accumulators never mix before the final combination, so each is its own chain.
template <class T, bool SQUARE>
__device__ float torch_sum_chain(const T* x, u32_t n, u32_t W, u32_t lane, u32_t k) {
    const u32_t groups = n / W / TORCH_SUM_ILP;
    const u32_t level_power = max(4u, ceil_log2(groups) / TORCH_SUM_LEVELS);
    const u32_t level_step = 1u << level_power;
    const u32_t level_mask = level_step - 1u;
    float acc[TORCH_SUM_LEVELS] = {0.0f, 0.0f, 0.0f, 0.0f};
    u32_t group = 0;
    while (group + level_step <= groups) {
#pragma unroll 16
        for (u32_t s = 0; s < level_step; ++s, ++group)
            acc[0] = __fadd_rn(acc[0], torch_sum_element<T, SQUARE>(x, (group * TORCH_SUM_ILP + k) * W + lane));
#pragma unroll
        for (u32_t level = 1; level < TORCH_SUM_LEVELS; ++level) {
            acc[level] = __fadd_rn(acc[level], acc[level - 1]);
            acc[level - 1] = 0.0f;
            if ((group & (level_mask << (level * level_power))) != 0u) break;
        }
    }
    for (; group < groups; ++group)
        acc[0] = __fadd_rn(acc[0], torch_sum_element<T, SQUARE>(x, (group * TORCH_SUM_ILP + k) * W + lane));
#pragma unroll
    for (u32_t level = 1; level < TORCH_SUM_LEVELS; ++level) acc[0] = __fadd_rn(acc[0], acc[level]);
    return acc[0];
}

// Lane `lane` of torch_row_sum<W> from its ILP folded accumulators acc[k]: accumulator 0, then
// the whole vectors after the last group, then accumulators 1.. in order.
template <class T, bool SQUARE>
__device__ float torch_sum_lane(const T* x, u32_t n, u32_t W, u32_t lane, const float* acc) {
    const u32_t vectors = n / W;
    float total = acc[0];
    for (u32_t v = vectors / TORCH_SUM_ILP * TORCH_SUM_ILP; v < vectors; ++v)
        total = __fadd_rn(total, torch_sum_element<T, SQUARE>(x, v * W + lane));
    for (u32_t k = 1; k < TORCH_SUM_ILP; ++k) total = __fadd_rn(total, acc[k]);
    return total;
}

// torch_sum_block's total from its chain sums, in one warp: lane q holds chain q = k *
// TORCH_SUM_LANES + lane's sum (torch_sum_chain(x, n, TORCH_SUM_LANES, lane, k)). Every lane
// gathers the chains of lane (its lane % TORCH_SUM_LANES) by shuffles and adds them as
// torch_sum_lane, then adds the leftover elements from 0 and the lanes' sums in order; every
// lane of the warp must call it and gets the total (the same operations on the same values).
template <class T, bool SQUARE>
__device__ __forceinline__ float torch_sum_warp_total(const T* x, u32_t n, float chain) {
    static_assert(TORCH_SUM_CHAINS == 32, "a lane per chain");
    const u32_t lane = threadIdx.x % TORCH_SUM_LANES;
    float acc[TORCH_SUM_ILP];
#pragma unroll
    for (u32_t k = 0; k < TORCH_SUM_ILP; ++k) acc[k] = __shfl_sync(0xffffffffu, chain, k * TORCH_SUM_LANES + lane);
    const float lane_sum = torch_sum_lane<T, SQUARE>(x, n, TORCH_SUM_LANES, lane, acc);
    float total = 0.0f;
    for (u32_t i = n / TORCH_SUM_LANES * TORCH_SUM_LANES; i < n; ++i)
        total = __fadd_rn(total, torch_sum_element<T, SQUARE>(x, i));
#pragma unroll
    for (u32_t l = 0; l < TORCH_SUM_LANES; ++l) total = __fadd_rn(total, __shfl_sync(0xffffffffu, lane_sum, l));
    return total;
}

// The end of torch_sum_block once its TORCH_SUM_CHAINS chain sums are in `chains` (shared
// memory, visible to the block): warp 0 adds them up (torch_sum_warp_total, lane q chain q) and
// the total goes through `result` to every thread (every thread must call it).
template <class T, bool SQUARE>
__device__ float torch_sum_lanes_total(const T* x, u32_t n, const float* chains, float* result) {
    const u32_t t = threadIdx.x;
    if (t < TORCH_SUM_CHAINS) {
        const float total = torch_sum_warp_total<T, SQUARE>(x, n, chains[t]);
        if (t == 0) *result = total;
    }
    __syncthreads();
    return *result;
}

// sum_f32_torch of x[0..n) (of the squares when SQUARE), computed by the whole block (at least 32
// threads, every thread must call it) and returned to every thread. `scratch` is shared memory of
// TORCH_SUM_BLOCK_SCRATCH floats.
template <class T, bool SQUARE>
__device__ float torch_sum_block(const T* x, u32_t n, float* scratch) {
    float* chains = scratch;  // [ILP][LANES]
    float* result = scratch + TORCH_SUM_CHAINS;
    const u32_t t = threadIdx.x;
    if (n < TORCH_SUM_LANES) {
        if (t == 0) {
            float acc[TORCH_SUM_ILP];
            for (u32_t k = 0; k < TORCH_SUM_ILP; ++k) acc[k] = torch_sum_chain<T, SQUARE>(x, n, 1, 0, k);
            *result = torch_sum_lane<T, SQUARE>(x, n, 1, 0, acc);
        }
        __syncthreads();
        return *result;
    }
    if (t < TORCH_SUM_CHAINS)
        chains[t] = torch_sum_chain<T, SQUARE>(x, n, TORCH_SUM_LANES, t % TORCH_SUM_LANES, t / TORCH_SUM_LANES);
    __syncthreads();
    return torch_sum_lanes_total<T, SQUARE>(x, n, chains, result);
}

// sum_f32_torch of x[0..n) (of the squares when SQUARE) in one thread: torch_sum_block's order.
template <class T, bool SQUARE>
__device__ float torch_sum_thread(const T* x, u32_t n) {
    float acc[TORCH_SUM_ILP];
    if (n < TORCH_SUM_LANES) {
        for (u32_t k = 0; k < TORCH_SUM_ILP; ++k) acc[k] = torch_sum_chain<T, SQUARE>(x, n, 1, 0, k);
        return torch_sum_lane<T, SQUARE>(x, n, 1, 0, acc);
    }
    // The leftover elements are summed from 0 first, then the lanes are added in order.
    float total = 0.0f;
    for (u32_t i = n / TORCH_SUM_LANES * TORCH_SUM_LANES; i < n; ++i)
        total = __fadd_rn(total, torch_sum_element<T, SQUARE>(x, i));
    for (u32_t lane = 0; lane < TORCH_SUM_LANES; ++lane) {
        for (u32_t k = 0; k < TORCH_SUM_ILP; ++k)
            acc[k] = torch_sum_chain<T, SQUARE>(x, n, TORCH_SUM_LANES, lane, k);
        total = __fadd_rn(total, torch_sum_lane<T, SQUARE>(x, n, TORCH_SUM_LANES, lane, acc));
    }
    return total;
}

// --- torch_sum_block's order with the work spread over a whole block ---------------------------
// torch_sum_chain is a fixed tree: acc[0] restarts from 0 after every level_step groups (each
// flush sets it to 0), so the chain is a sequence of independent level-0 segments (level_step
// groups each, summed from 0 in group order), then a tail of the leftover groups (also from 0).
// The cascade above level 0 only ever sees the segment sums, in segment order. So the segment
// sums can be computed by any threads in any order and fed to TorchSumCascade in segment order:
// every fp32 operation, and its operands, stays exactly that of torch_sum_chain.

// Groups [first, first + count) of accumulator (lane, k) of torch_row_sum<W>, summed from 0 in
// group order (torch_sum_chain's level-0 loop).
template <class T, bool SQUARE>
__device__ __forceinline__ float torch_sum_run(const T* x, u32_t W, u32_t lane, u32_t k, u32_t first, u32_t count) {
    float acc = 0.0f;
#pragma unroll 16
    for (u32_t g = first; g < first + count; ++g)
        acc = __fadd_rn(acc, torch_sum_element<T, SQUARE>(x, (g * TORCH_SUM_ILP + k) * W + lane));
    return acc;
}

// torch_sum_chain's levels 1.. fed whole level-0 segment sums in segment order: push(s) is the
// flush after a segment (acc[0] = s, the segment's sum from 0), finish(tail) the fold at the end
// (acc[0] = the tail's sum from 0).
struct TorchSumCascade {
    float acc[TORCH_SUM_LEVELS];
    u32_t group;
    u32_t level_power;
    u32_t level_step;
    u32_t level_mask;
    __device__ __forceinline__ explicit TorchSumCascade(u32_t groups) {
        level_power = max(4u, ceil_log2(groups) / TORCH_SUM_LEVELS);
        level_step = 1u << level_power;
        level_mask = level_step - 1u;
        group = 0;
#pragma unroll
        for (u32_t level = 0; level < TORCH_SUM_LEVELS; ++level) acc[level] = 0.0f;
    }
    __device__ __forceinline__ void push(float segment) {
        group += level_step;
        acc[0] = segment;
#pragma unroll
        for (u32_t level = 1; level < TORCH_SUM_LEVELS; ++level) {
            acc[level] = __fadd_rn(acc[level], acc[level - 1]);
            acc[level - 1] = 0.0f;
            if ((group & (level_mask << (level * level_power))) != 0u) break;
        }
    }
    __device__ __forceinline__ float finish(float tail) {
        acc[0] = tail;
#pragma unroll
        for (u32_t level = 1; level < TORCH_SUM_LEVELS; ++level) acc[0] = __fadd_rn(acc[0], acc[level]);
        return acc[0];
    }
};

// Level-0 segments each thread sums per round of torch_sum_block_split.
constexpr u32_t TORCH_SUM_SPLIT_SEGMENTS = 4;

// Shared floats torch_sum_block_split needs for THREADS threads.
constexpr u32_t torch_sum_split_scratch(u32_t threads) {
    return threads * TORCH_SUM_SPLIT_SEGMENTS + TORCH_SUM_BLOCK_SCRATCH;
}

// torch_sum_block's result, bit for bit, from a block of exactly THREADS threads (a multiple of 32;
// every thread must call it): in rounds, every thread sums TORCH_SUM_SPLIT_SEGMENTS level-0
// segments (chain q = t % 32 of 32 consecutive values per group, so a warp's loads are
// coalesced), then warp 0 (lane q = chain q) pushes the round's segments into its chain's
// cascade in segment order; then lane q adds its tail and folds (torch_sum_chain's result), and
// the lanes and the total follow exactly as in torch_sum_block. `scratch`: shared memory of
// torch_sum_split_scratch(THREADS) floats.
template <class T, bool SQUARE, u32_t THREADS>
__device__ float torch_sum_block_split(const T* x, u32_t n, float* scratch) {
    static_assert(THREADS % 32 == 0 && THREADS >= 32, "whole warps");
    constexpr u32_t WARPS = THREADS / 32;
    constexpr u32_t PER_ROUND = WARPS * TORCH_SUM_SPLIT_SEGMENTS;  // segments of each chain per round
    float* segments = scratch;                                      // [PER_ROUND][32 chains]
    float* chains = scratch + THREADS * TORCH_SUM_SPLIT_SEGMENTS;   // [ILP][LANES]
    float* result = chains + TORCH_SUM_CHAINS;
    const u32_t t = threadIdx.x;
    if (n < TORCH_SUM_LANES) {
        if (t == 0) *result = torch_sum_thread<T, SQUARE>(x, n);
        __syncthreads();
        return *result;
    }
    const u32_t groups = n / TORCH_SUM_LANES / TORCH_SUM_ILP;
    TorchSumCascade cascade(groups);
    const u32_t step = cascade.level_step;
    const u32_t full = groups / step;  // whole level-0 segments of every chain
    const u32_t q = t % TORCH_SUM_CHAINS;
    const u32_t lane = q % TORCH_SUM_LANES;
    const u32_t k = q / TORCH_SUM_LANES;
    for (u32_t round = 0; round < full; round += PER_ROUND) {
#pragma unroll
        for (u32_t s = 0; s < TORCH_SUM_SPLIT_SEGMENTS; ++s) {
            const u32_t local = t / TORCH_SUM_CHAINS + WARPS * s;
            const u32_t m = round + local;
            if (m < full)
                segments[local * TORCH_SUM_CHAINS + q] =
                    torch_sum_run<T, SQUARE>(x, TORCH_SUM_LANES, lane, k, m * step, step);
        }
        __syncthreads();
        if (t < TORCH_SUM_CHAINS) {
            const u32_t count = min(PER_ROUND, full - round);
            for (u32_t local = 0; local < count; ++local) cascade.push(segments[local * TORCH_SUM_CHAINS + t]);
        }
        __syncthreads();
    }
    if (t < TORCH_SUM_CHAINS)
        chains[t] = cascade.finish(
            torch_sum_run<T, SQUARE>(x, TORCH_SUM_LANES, lane, k, full * step, groups - full * step));
    __syncthreads();
    // From here exactly torch_sum_block.
    return torch_sum_lanes_total<T, SQUARE>(x, n, chains, result);
}

}  // namespace refmath
