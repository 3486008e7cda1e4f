// Multi-head attention with a per-head sink (v41-architecture.md §3.4, the CPU reference's
// CpuBackend::sparse_attention, operation for operation) of one or many queries: keys are rows of
// a shared buffer [rows, head_dim] (K = V, shared by every head), q [heads, head_dim] per query,
// out [heads, head_dim] per query (f32 storage; probabilities and outputs rounded to bf16 when
// p.round_bf16, the V4.1 rounding points).
// One block per (head, query). A query's keys are given by a KeyRows accessor: key j of the query
// is row key_row(j) of the buffer (the one-query entry: row j; the row-batched entry: its own list
// of row indices). Keys are taken in blocks of 64 (the reference kernel's block): the scores
// are sequential f64 dot products times the scale; the running max, the block's exp weights
// (the reference's vectorised exp) and their sequential f64 sum are done by one thread; each
// thread then rescales its output channels and adds the block's f64 sum of bf16(p) * v. The
// denominator finally gains exp(sink - max). Every reduction has one fixed order that depends only
// on this (head, query)'s data: bit-identical to the CPU and batch invariant by construction.
#pragma once
#include "common/reference_math.cuh"

namespace attention {

constexpr int THREADS = 256;
constexpr int KEY_BLOCK = 64;
constexpr int MAX_DIMS_PER_THREAD = 4;  // head_dim <= THREADS * 4 (checked by the launcher)

// Key j of the one-query entry is row j.
struct ConsecutiveRows {
    __device__ u32_t operator()(u32_t j) const { return j; }
};

// Key j of a row-batched query is rows[j] (the query's slice of the flattened row lists).
struct ListedRows {
    const u32_t* rows;
    __device__ u32_t operator()(u32_t j) const { return rows[j]; }
};

// Head blockIdx.x of one query: q and out point at the query's [heads, head_dim]; n_keys keys,
// key j at row key_row(j) of keys.
template <typename KeyRows>
__device__ void sparse_attention_sink(const float* __restrict__ q, const float* __restrict__ keys,
                                      KeyRows key_row, u32_t n_keys, const float* __restrict__ sink,
                                      float* __restrict__ out, AttentionParams p) {
    __shared__ float scores[KEY_BLOCK];
    __shared__ float weights[KEY_BLOCK];
    __shared__ const float* block_keys[KEY_BLOCK];
    __shared__ float block_rescale;
    __shared__ float final_denominator;
    const u32_t head = blockIdx.x;
    if (head >= p.heads) return;
    const float* qh = q + (size_t)head * p.head_dim;

    float acc[MAX_DIMS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) acc[i] = 0.0f;
    float running_max = -1e30f;  // thread 0's copies are the authoritative ones
    float denominator = 0.0f;

    for (u32_t start = 0; start < n_keys; start += KEY_BLOCK) {
        const u32_t count = min((u32_t)KEY_BLOCK, n_keys - start);
        if (threadIdx.x < count) {
            const float* key = keys + (size_t)key_row(start + threadIdx.x) * p.head_dim;
            block_keys[threadIdx.x] = key;
            scores[threadIdx.x] = __fmul_rn(refmath::dot_f64_sequential(qh, key, p.head_dim), p.scale);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float block_max = -__uint_as_float(0x7f800000u);
            for (u32_t j = 0; j < count; ++j) block_max = fmaxf(block_max, scores[j]);
            const float new_max = fmaxf(running_max, block_max);
            const float rescale = refmath::exp_f32(__fsub_rn(running_max, new_max));
            double prob_sum = 0.0;
            for (u32_t j = 0; j < count; ++j) {
                const float prob = refmath::exp_f32(__fsub_rn(scores[j], new_max));
                prob_sum = __dadd_rn(prob_sum, (double)prob);
                weights[j] = p.round_bf16 ? round_bf16_f32(prob) : prob;
            }
            denominator = __fadd_rn(__fmul_rn(denominator, rescale), __double2float_rn(prob_sum));
            running_max = new_max;
            block_rescale = rescale;
        }
        __syncthreads();
        const float rescale = block_rescale;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
            const u32_t d = threadIdx.x + i * THREADS;
            if (d < p.head_dim) {
                double sum = 0.0;
#pragma unroll 16
                for (u32_t j = 0; j < count; ++j)
                    sum = __dadd_rn(sum, (double)__fmul_rn(weights[j], block_keys[j][d]));
                acc[i] = __fadd_rn(__fmul_rn(acc[i], rescale), __double2float_rn(sum));
            }
        }
        __syncthreads();  // scores, weights and block_keys are rewritten by the next block
    }
    if (threadIdx.x == 0)
        final_denominator = __fadd_rn(denominator, refmath::exp_f32(__fsub_rn(sink[head], running_max)));
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
        const u32_t d = threadIdx.x + i * THREADS;
        if (d < p.head_dim) {
            const float v = __fdiv_rn(acc[i], final_denominator);
            out[(size_t)head * p.head_dim + d] = p.round_bf16 ? round_bf16_f32(v) : v;
        }
    }
}

}  // namespace attention
