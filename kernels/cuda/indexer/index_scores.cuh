// Lightning-indexer scores of one or many queries against compressed keys (v41-architecture.md
// §3.5), with the reference's bf16 rounding points, operation for operation as
// CpuBackend::index_scores: score[j] = bf16(sum_h bf16(max(bf16(q_h . k_j), 0) * w_h)), each dot
// product a sequential f64 sum and the head sum a sequential f64 sum (with p.round_bf16 = 0, no
// bf16 rounding anywhere). A key's score depends only on (q, w, k_j): batch invariant.
//
// One block per query and tile of p.tile_keys keys: the tile's key rows and the query's heads, in
// chunks of p.head_chunk, are staged in shared memory (the heads' rows padded to an odd stride, so
// the lanes of a warp, one head each, read distinct banks while the key value is a broadcast);
// one thread per (key, head) of the chunk runs the head's dot product, then one thread per key
// adds the chunk's terms to the key's running f64 sum in head order. The same products and sums
// in the same order as one thread per head and key: the same bits, with the rows read once per
// block instead of once per head.
//
// A KeyFetch accessor maps a key's row number to its address (FlatKeys: row r of one buffer
// [rows, head_dim]; KeyPointers: the r-th address of a device pointer table); the arithmetic is
// the same for both.
#pragma once
#include "common/key_rows.cuh"
#include "common/reference_math.cuh"

namespace indexer {

constexpr int THREADS = 128;

using keyrows::FlatKeys;
using keyrows::KeyPointers;

// The padded stride of a staged head row: the smallest odd count >= head_dim.
__device__ __forceinline__ u32_t head_stride(u32_t head_dim) { return head_dim | 1u; }

// The key tile blockIdx.x of one query (q [heads, head_dim], w [heads]) among its first `visible`
// key rows (row r at key_at(r)); each score goes to scores[key]. Dynamic shared memory (the
// launcher's IndexTile::shared_bytes): sums [tile_keys] f64, keys [tile_keys][head_dim],
// q [head_chunk][head_stride], terms [tile_keys][head_chunk].
template <typename KeyFetch>
__device__ void index_scores(const float* __restrict__ q, const float* __restrict__ w, KeyFetch key_at,
                             u32_t visible, float* __restrict__ scores, IndexParams p) {
    extern __shared__ double index_smem[];
    const u32_t first = blockIdx.x * p.tile_keys;
    if (first >= visible) return;
    const u32_t count = min(p.tile_keys, visible - first);
    const u32_t hd = p.head_dim, stride = head_stride(hd);
    double* sums = index_smem;
    float* keys = reinterpret_cast<float*>(sums + p.tile_keys);
    float* q_rows = keys + (size_t)p.tile_keys * hd;
    float* terms = q_rows + (size_t)p.head_chunk * stride;

    for (u32_t i = threadIdx.x; i < count * hd; i += THREADS) {
        const u32_t key = i / hd, d = i % hd;
        keys[i] = key_at(first + key)[d];
    }
    for (u32_t key = threadIdx.x; key < count; key += THREADS) sums[key] = 0.0;
    for (u32_t h0 = 0; h0 < p.heads; h0 += p.head_chunk) {
        const u32_t chunk = min(p.head_chunk, p.heads - h0);
        __syncthreads();  // the keys are in; the chunk before is summed
        for (u32_t i = threadIdx.x; i < chunk * hd; i += THREADS) {
            const u32_t h = i / hd, d = i % hd;
            q_rows[h * stride + d] = q[(size_t)(h0 + h) * hd + d];
        }
        __syncthreads();
        for (u32_t i = threadIdx.x; i < count * chunk; i += THREADS) {
            const u32_t key = i / chunk, h = i % chunk;
            float logit = refmath::dot_f64_sequential(q_rows + h * stride, keys + (size_t)key * hd, hd);
            if (p.round_bf16) logit = round_bf16_f32(logit);
            const float term = __fmul_rn(fmaxf(logit, 0.0f), w[h0 + h]);
            terms[key * chunk + h] = p.round_bf16 ? round_bf16_f32(term) : term;
        }
        __syncthreads();
        for (u32_t key = threadIdx.x; key < count; key += THREADS) {
            double sum = sums[key];
            for (u32_t h = 0; h < chunk; ++h) sum = __dadd_rn(sum, (double)terms[key * chunk + h]);
            sums[key] = sum;
        }
    }
    __syncthreads();
    for (u32_t key = threadIdx.x; key < count; key += THREADS) {
        const float score = __double2float_rn(sums[key]);
        scores[first + key] = p.round_bf16 ? round_bf16_f32(score) : score;
    }
}

}  // namespace indexer
