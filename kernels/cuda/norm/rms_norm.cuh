// RMSNorm over the last axis (v41-architecture.md §3.0): y = bf16(w * (x * rsqrt(mean(x^2) + eps)))
// with fp32 math, the mean of squares in the order of torch's CPU sum (as the CPU reference). One
// block per row with a fixed thread count, so a row's reduction order never depends on the number
// of rows (batch invariance). With QUANT, the stored outputs are also quantised to FP8 in groups
// of 32 (act_quant.cuh's Q8, the same codes and scales act_quant_fp8_g32 gives y).
//
// Layout: a row is cut into segments of SEGMENT = 512 columns, 16 groups of 32; warp w holds
// segments w and w + 8 in registers, lane q column q of each group (slot 16 r + j of the thread
// is column 512 (w + 8 r) + 32 j + q): the first 8192 columns, each read once, 32 consecutive
// floats a warp load. Columns from 8192 on are read again in the output pass, a column a thread.
//
// Sum of squares in torch's order (refmath's torch_sum_* over x[c] squared): element 32 g + q is
// group g of accumulator chain q, and torch_sum_chain restarts its level-0 sum every 16 groups
// (its level step for rows of up to 2^19 groups), so a segment's 16 groups of chain q are one
// level-0 segment, summed from 0 in group order (refmath::torch_sum_block_split's split): lane q
// adds its segments' squares in registers, a dependent chain of 16 adds; the segment sums meet in
// shared memory (one barrier); in every warp, lane q feeds chain q's segment sums into a
// refmath::TorchSumCascade in segment order, the last, partial segment as the tail, and
// refmath::torch_sum_warp_total adds the chains up. Every fp32 operation and its operands are
// those of refmath::torch_sum_block, so the bits are. Rows of fewer than 8 columns (torch's
// one-lane order) or more than 8192 take refmath::torch_sum_block over global memory (inv_rms,
// as rope_qdq).
//
// Output pass: a warp's 16 groups of a segment are normed, stored and quantised as one
// straight-line batch (predicated stores, no branch between the groups, so their group maxima and
// scale math overlap); a warp's group is its 32 lanes (cols % 32 == 0 with QUANT: a group is
// wholly inside the row or wholly past it). Each value is the same operations as ever, the codes
// and scales those of act_quant_g32_lanes (the same group maxima and reciprocal scales, exactly).
#pragma once
#include "common/reference_math.cuh"
#include "quant/act_quant.cuh"

namespace rmsnorm {

constexpr int THREADS = 256;
constexpr u32_t WARPS = THREADS / 32;
constexpr u32_t SEGMENT_GROUPS = 16;                      // torch_sum_chain's level step
constexpr u32_t SEGMENT = 32 * SEGMENT_GROUPS;            // columns of a segment
constexpr u32_t ROUNDS = 2;                               // segments a warp holds
constexpr u32_t CACHED = ROUNDS * SEGMENT_GROUPS;         // columns a thread holds
constexpr u32_t CACHED_COLS = THREADS * CACHED;           // 8192
constexpr u32_t CACHED_SEGMENTS = WARPS * ROUNDS;         // 16

// Column of a thread's slot i = 16 r + j (segment w + 8 r, group j) relative to that of its slot 0,
// SEGMENT w + lane.
__device__ __forceinline__ constexpr u32_t slot_offset(u32_t i) {
    return SEGMENT * WARPS * (i / SEGMENT_GROUPS) + 32 * (i % SEGMENT_GROUPS);
}

// 1 / sqrt(mean(x^2) + eps) from the row's sum of squares.
__device__ __forceinline__ float inv_rms_of(float sum_squares, u32_t cols, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_squares, (float)cols), eps)));
}

// inv_rms_of the row xr of `cols` read from global memory, the sum by refmath::torch_sum_block
// (every thread of the block calls it).
__device__ __forceinline__ float inv_rms(const float* __restrict__ xr, u32_t cols, float eps) {
    __shared__ float scratch[refmath::TORCH_SUM_BLOCK_SCRATCH];
    return inv_rms_of(refmath::torch_sum_block<float, true>(xr, cols, scratch), cols, eps);
}

// Shared floats per lane of sum_squares_cached: its whole segments' sums, the tail's, padding to
// 16 bytes (float4 reads; lanes 20 floats apart read distinct banks a quarter-warp at a time).
constexpr u32_t SEGMENT_SUMS_STRIDE = CACHED_SEGMENTS + 4;
constexpr u32_t TAIL_SLOT = CACHED_SEGMENTS;

// refmath::torch_sum_block's sum of the squares of the row's 8 <= cols <= CACHED_COLS columns
// held in `cached` (every thread calls it; every thread gets the sum): lane q of warp w sums
// chain q's groups of its segments w + 8 r from 0 (a whole segment, or the tail: the groups past
// the last whole segment) into sums[q][m] (the tail into sums[q][TAIL_SLOT]); then every warp
// reads lane q's sums at once, pushes the whole segments into chain q's cascade in order,
// finishes it with the tail and adds the chains up (torch_sum_warp_total reads the columns past
// the last group, cols % 32 of them, from xr).
__device__ __forceinline__ float sum_squares_cached(const float (&cached)[CACHED], const float* xr, u32_t cols) {
    __shared__ __align__(16) float shared_sums[32 * SEGMENT_SUMS_STRIDE];
    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    const u32_t groups = cols / 32;
    const u32_t whole = groups / SEGMENT_GROUPS;  // whole segments; segment `whole` is the tail
    float* lane_sums = shared_sums + lane * SEGMENT_SUMS_STRIDE;
#pragma unroll
    for (u32_t r = 0; r < ROUNDS; ++r) {
        const u32_t m = warp + WARPS * r;
        if (m > whole) break;  // warp-uniform; so are the later rounds
        const u32_t count = m < whole ? SEGMENT_GROUPS : groups % SEGMENT_GROUPS;
        float sum = 0.0f;
#pragma unroll
        for (u32_t j = 0; j < SEGMENT_GROUPS; ++j) {
            const float v = cached[SEGMENT_GROUPS * r + j];
            if (j < count) sum = __fadd_rn(sum, __fmul_rn(v, v));
        }
        lane_sums[m < whole ? m : TAIL_SLOT] = sum;
    }
    __syncthreads();
    float sums[SEGMENT_SUMS_STRIDE];  // past `whole`: unused
#pragma unroll
    for (u32_t m = 0; m < SEGMENT_SUMS_STRIDE; m += 4)
        *reinterpret_cast<float4*>(sums + m) = *reinterpret_cast<const float4*>(lane_sums + m);
    refmath::TorchSumCascade cascade(groups);
    __builtin_assume(cascade.level_step == SEGMENT_GROUPS);  // groups <= 256: the breaks fold away
#pragma unroll
    for (u32_t m = 0; m < CACHED_SEGMENTS; ++m) {
        if (m == whole) break;
        cascade.push(sums[m]);
    }
    // The tail, none (0) when the whole segments fill the cache.
    const float tail = whole < CACHED_SEGMENTS ? sums[TAIL_SLOT] : 0.0f;
    return refmath::torch_sum_warp_total<float, true>(xr, cols, cascade.finish(tail));
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
    const u32_t warp = threadIdx.x / 32;
    const size_t row0 = (size_t)row * p.cols;
    const float* xr = x + row0;
    float* yr = y + row0;
    const u32_t first = SEGMENT * warp + threadIdx.x % 32;  // the column of slot 0

    // Every load unrolled, so that they are in flight together.
    float cached[CACHED];
    float weights[CACHED];
#pragma unroll
    for (u32_t i = 0; i < CACHED; ++i) {
        const u32_t c = first + slot_offset(i);
        cached[i] = c < p.cols ? xr[c] : 0.0f;
        weights[i] = c < p.cols ? w[c] : 0.0f;
    }
    // Rows of fewer than 8 columns (torch's one-lane order) or more than the cache: from memory.
    const float inv = p.cols < refmath::TORCH_SUM_LANES || p.cols > CACHED_COLS
                          ? inv_rms(xr, p.cols, p.eps)
                          : inv_rms_of(sum_squares_cached(cached, xr, p.cols), p.cols, p.eps);

#pragma unroll
    for (u32_t r = 0; r < ROUNDS; ++r) {
        const u32_t start = SEGMENT * (warp + WARPS * r);  // the segment's first column
        if (start >= p.cols) break;                       // warp-uniform; so are the later rounds
        float v[SEGMENT_GROUPS];
#pragma unroll
        for (u32_t j = 0; j < SEGMENT_GROUPS; ++j) {
            const u32_t i = SEGMENT_GROUPS * r + j;
            const u32_t c = first + slot_offset(i);
            v[j] = normed<ROUND_BF16>(weights[i], cached[i], inv);
            if (c < p.cols) yr[c] = v[j];
        }
        if constexpr (QUANT) {
            const u32_t groups = min(SEGMENT_GROUPS, (p.cols - start) / 32);  // those inside the row
            act_quant_g32_lanes(v, groups, row0 + first + slot_offset(SEGMENT_GROUPS * r), codes, scales);
        }
    }
    for (u32_t c = CACHED_COLS + threadIdx.x; c < p.cols; c += THREADS) {
        const float v[1] = {normed<ROUND_BF16>(w[c], xr[c], inv)};
        yr[c] = v[0];
        if constexpr (QUANT) act_quant_g32_lanes(v, 1, row0 + c, codes, scales);
    }
}

}  // namespace rmsnorm
