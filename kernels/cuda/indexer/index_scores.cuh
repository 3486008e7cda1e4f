// Lightning-indexer scores of one or many queries against compressed keys (v41-architecture.md
// §3.5), with the reference's bf16 rounding points, operation for operation as
// CpuBackend::index_scores: score[j] = bf16(sum_h bf16(max(bf16(q_h . k_j), 0) * w_h)), each dot
// product a sequential f64 sum and the head sum a sequential f64 sum (with p.round_bf16 = 0, no
// bf16 rounding anywhere). One block per (key, query): one thread per head computes its term,
// thread 0 adds them in head order. A key's score depends only on (q, w, k_j): batch invariant.
// A KeyFetch accessor maps a key's row number to its address (FlatKeys: row r of one buffer
// [rows, head_dim]; KeyPointers: the r-th address of a device pointer table); the arithmetic is
// the same for both.
#pragma once
#include "common/reference_math.cuh"

namespace indexer {

constexpr int THREADS = 64;

// Row r is at keys + r * head_dim of one buffer [rows, head_dim].
struct FlatKeys {
    const float* keys;
    u32_t head_dim;
    __device__ const float* operator()(u32_t row) const { return keys + (size_t)row * head_dim; }
};

// Row r is at the device address ptrs[r] (head_dim floats there; checked by the launcher's table).
struct KeyPointers {
    const unsigned long long* ptrs;
    __device__ const float* operator()(u32_t row) const {
        return reinterpret_cast<const float*>(ptrs[row]);
    }
};

// Key blockIdx.x of one query (q [heads, head_dim], w [heads]) among its first `visible` key
// rows (row r at key_at(r)); its score goes to scores[key].
template <typename KeyFetch>
__device__ void index_scores(const float* __restrict__ q, const float* __restrict__ w, KeyFetch key_at,
                             u32_t visible, float* __restrict__ scores, IndexParams p) {
    extern __shared__ float terms[];  // [heads]
    const u32_t key = blockIdx.x;
    if (key >= visible) return;
    const float* k = key_at(key);
    for (u32_t h = threadIdx.x; h < p.heads; h += THREADS) {
        float logit = refmath::dot_f64_sequential(q + (size_t)h * p.head_dim, k, p.head_dim);
        if (p.round_bf16) logit = round_bf16_f32(logit);
        const float term = __fmul_rn(fmaxf(logit, 0.0f), w[h]);
        terms[h] = p.round_bf16 ? round_bf16_f32(term) : term;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (u32_t h = 0; h < p.heads; ++h) sum = __dadd_rn(sum, (double)terms[h]);
        const float score = __double2float_rn(sum);
        scores[key] = p.round_bf16 ? round_bf16_f32(score) : score;
    }
}

}  // namespace indexer
