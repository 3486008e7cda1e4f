// Multi-head attention with a per-head sink (v41-architecture.md §3.4, the CPU reference's
// CpuBackend::sparse_attention, operation for operation) of one or many queries: keys are rows of
// a shared buffer [rows, head_dim] (K = V, shared by every head), q [heads, head_dim] per query,
// out [heads, head_dim] per query (f32 storage; probabilities and outputs rounded to bf16 when
// p.round_bf16, the V4.1 rounding points).
// One block per (head, query). A query's keys are its own list of row numbers (ListedRows), and
// KeyFetch maps a row number to the row's address (FlatKeys: row r of one buffer [rows, head_dim];
// KeyPointers: the r-th address of a device pointer table, so a query's keys may lie in many
// separately allocated buffers). The arithmetic is the same for every accessor, so
// the entries agree bit for bit on the same key values. Keys are taken in blocks of 64 (the reference kernel's block), up to 16 blocks
// per pass: every key's score (a sequential f64 dot product times the scale) is computed in
// parallel, one thread per key; each block's max is taken by one thread, the running max chain
// over the blocks (and each block's rescale) by thread 0, every exp weight (the reference's
// standalone torch.exp, correctly rounded) in parallel, each block's sum in torch's CPU sum order
// (refmath::torch_sum_thread) by one thread, the denominator
// chain by thread 0; each thread then, for its output channels and block by block, rescales and
// adds the block's f64 sum of bf16(p) * v in key order. The denominator finally gains exp(sink -
// max). Every reduction keeps the one fixed order of the reference that depends only on this
// (head, query)'s data: bit-identical to the CPU and batch invariant by construction.
#pragma once
#include "common/key_rows.cuh"
#include "common/reference_math.cuh"

namespace attention {

constexpr int THREADS = 512;
constexpr int KEY_BLOCK = 64;
constexpr int MAX_DIMS_PER_THREAD = 4;  // head_dim <= THREADS * 4 (checked by the launcher)
constexpr u32_t KEY_BLOCKS_PER_PASS = 16;
constexpr u32_t KEYS_PER_PASS = KEY_BLOCK * KEY_BLOCKS_PER_PASS;

// Key j of a row-batched query is rows[j] (the query's slice of the flattened row lists).
struct ListedRows {
    const u32_t* rows;
    __device__ u32_t operator()(u32_t j) const { return rows[j]; }
};

using keyrows::FlatKeys;
using keyrows::KeyPointers;

// Head blockIdx.x of one query: q and out point at the query's [heads, head_dim]; n_keys keys,
// key j at the address key_at(key_row(j)).
template <typename KeyFetch>
__device__ void sparse_attention_sink(const float* __restrict__ q, KeyFetch key_at, ListedRows key_row,
                                      u32_t n_keys, const float* __restrict__ sink,
                                      float* __restrict__ out, AttentionParams p) {
    __shared__ float probs[KEYS_PER_PASS];    // the scores, then their exp weights
    __shared__ float weights[KEYS_PER_PASS];  // the weights as multiplied into v (bf16 or not)
    __shared__ const float* key_rows[KEYS_PER_PASS];  // the pass's key addresses
    __shared__ float block_max[KEY_BLOCKS_PER_PASS];
    __shared__ float block_new_max[KEY_BLOCKS_PER_PASS];
    __shared__ float block_rescale[KEY_BLOCKS_PER_PASS];
    __shared__ float block_sum[KEY_BLOCKS_PER_PASS];
    __shared__ float final_denominator;
    // The head's query widened to f64 once (the score loop multiplies it by every key).
    __shared__ double q_wide[THREADS * MAX_DIMS_PER_THREAD];
    const u32_t head = blockIdx.x;
    if (head >= p.heads) return;
    const float* qh = q + (size_t)head * p.head_dim;
    for (u32_t d = threadIdx.x; d < p.head_dim; d += THREADS) q_wide[d] = (double)qh[d];
    __syncthreads();

    float acc[MAX_DIMS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) acc[i] = 0.0f;
    float running_max = -1e30f;  // thread 0's copies are the authoritative ones
    float denominator = 0.0f;

    for (u32_t pass_start = 0; pass_start < n_keys; pass_start += KEYS_PER_PASS) {
        const u32_t count = min(KEYS_PER_PASS, n_keys - pass_start);
        const u32_t blocks = (count + KEY_BLOCK - 1) / KEY_BLOCK;
        for (u32_t j = threadIdx.x; j < count; j += THREADS) {
            const float* key = key_at(key_row(pass_start + j));
            key_rows[j] = key;
            probs[j] = __fmul_rn(refmath::dot_f64_sequential_wide(q_wide, key, p.head_dim), p.scale);
        }
        __syncthreads();
        if (threadIdx.x < blocks) {
            const u32_t first = threadIdx.x * KEY_BLOCK;
            const u32_t last = min(first + KEY_BLOCK, count);
            float max = -__uint_as_float(0x7f800000u);
            for (u32_t j = first; j < last; ++j) max = fmaxf(max, probs[j]);
            block_max[threadIdx.x] = max;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (u32_t b = 0; b < blocks; ++b) {
                const float new_max = fmaxf(running_max, block_max[b]);
                block_rescale[b] = refmath::exp_accurate(__fsub_rn(running_max, new_max));
                block_new_max[b] = new_max;
                running_max = new_max;
            }
        }
        __syncthreads();
        for (u32_t j = threadIdx.x; j < count; j += THREADS) {
            const float prob = refmath::exp_accurate(__fsub_rn(probs[j], block_new_max[j / KEY_BLOCK]));
            probs[j] = prob;
            weights[j] = p.round_bf16 ? round_bf16_f32(prob) : prob;
        }
        __syncthreads();
        if (threadIdx.x < blocks) {
            const u32_t first = threadIdx.x * KEY_BLOCK;
            const u32_t last = min(first + KEY_BLOCK, count);
            block_sum[threadIdx.x] = refmath::torch_sum_thread<float, false>(probs + first, last - first);
        }
        __syncthreads();
        if (threadIdx.x == 0)
            for (u32_t b = 0; b < blocks; ++b)
                denominator = __fadd_rn(__fmul_rn(denominator, block_rescale[b]), block_sum[b]);
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
            const u32_t d = threadIdx.x + i * THREADS;
            if (d < p.head_dim) {
                for (u32_t b = 0; b < blocks; ++b) {
                    const u32_t first = b * KEY_BLOCK;
                    const u32_t last = min(first + KEY_BLOCK, count);
                    double sum = 0.0;
#pragma unroll 16
                    for (u32_t j = first; j < last; ++j)
                        sum = __dadd_rn(sum, (double)__fmul_rn(weights[j], key_rows[j][d]));
                    acc[i] = __fadd_rn(__fmul_rn(acc[i], block_rescale[b]), __double2float_rn(sum));
                }
            }
        }
        __syncthreads();  // the per-pass arrays are rewritten by the next pass
    }
    if (threadIdx.x == 0)
        final_denominator = __fadd_rn(denominator, refmath::exp_accurate(__fsub_rn(sink[head], running_max)));
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
