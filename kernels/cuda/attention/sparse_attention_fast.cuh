// The `fast` sink attention (ARCHITECTURE.md §3): the same operation as sparse_attention.cuh —
// per query, every head attends to its own list of key rows (K = V, one row shared by all heads)
// plus a per-head sink — on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation), for the
// bf16 rounding points of V4.1 (q, keys and the probabilities' weights are bf16 values there, so
// converting them to bf16 is exact; only the order of the fp32 additions differs from the exact
// kernel's f64 sums).
//
// One block per (16 heads, query); warp w owns the head dims [64 w, 64 w + 64) (head_dim / 64
// warps: head_dim 64, 128, 256 or 512, so that the softmax's half-warps tile 256 pairs evenly;
// key rows 16-byte aligned — the launcher checks both). Keys go in tiles of 16, in list order:
//   1. The tile's keys (f32 in global memory, through the pointer table) are converted to bf16
//      into shared memory (double-buffered; the next tile's loads are issued before this tile's
//      products, so their latency overlaps the math).
//   2. Scores: each warp multiplies its 64 dims of the 16 queries' heads (A, held in registers
//      for the whole kernel) by the same dims of the 16 keys (B): a partial [16 heads x 16 keys]
//      per warp, stored to shared memory; the partials are added in warp order (fixed), times
//      the scale.
//   3. Online softmax per head, one half-warp per head (lane j = key j): the new running max,
//      the rescale exp(m_old - m_new), the weights p = exp(s - m_new) (0 past the list), the
//      weights' sum by a fixed shuffle tree, l = l * rescale + sum; bf16(p) to shared memory.
//   4. Outputs: each warp rescales its accumulators [16 heads x 64 dims] and adds bf16(p) · V
//      for its dims (V = the tile's keys).
// Finally out = acc / (l + exp(sink - m)), rounded to bf16.
//
// Split keys (flash-decoding): a query's list is cut into splits of SPLIT_TILES tiles, one block
// each (grid z), so that a decode step of few queries still fills the GPU. A query of one split
// writes its output as above; a query of several writes each split's (m, l, acc) to scratch and
// `combine` merges them in split order: M = max m_s, L = sum l_s exp(m_s - M), out = sum acc_s
// exp(m_s - M) / (L + exp(sink - M)). The split count depends only on the query's key count, so
// every output depends only on its query's q, its key list and the fixed tile, split and
// reduction order: deterministic and batch invariant. n_keys = 0 gives 0, as the exact kernel
// does.
#pragma once
#include "common/numerics.cuh"

namespace fast_attention {

constexpr u32_t HEADS = 16;      // heads per block (one mma M tile)
constexpr u32_t TILE = 16;       // keys per tile (one mma K step of the output product)
constexpr u32_t WARP_DIMS = 64;  // head dims per warp
constexpr u32_t MAX_WARPS = 8;   // head_dim <= 512
constexpr u32_t MAX_HEAD_DIM = WARP_DIMS * MAX_WARPS;
constexpr u32_t KEY_STRIDE = MAX_HEAD_DIM + 8;  // bf16 per shared key row (conflict-free reads)
constexpr u32_t P_STRIDE = TILE + 8;            // bf16 per shared weight row
// float4 loads per thread and tile: TILE keys x head_dim / 4 float4 over head_dim / 2 threads.
constexpr u32_t LOADS = TILE / 2;
constexpr u32_t SPLIT_TILES = 4;                 // tiles per split of a query's keys
constexpr u32_t SPLIT_KEYS = SPLIT_TILES * TILE;

// The splits of a list of n_keys keys (one for an empty list).
__device__ __forceinline__ u32_t splits_of(u32_t n_keys) {
    return n_keys <= SPLIT_KEYS ? 1u : (n_keys + SPLIT_KEYS - 1) / SPLIT_KEYS;
}

// One split's results of a query of several splits: acc [heads, head_dim] (unnormalised) and
// stats [heads, 2] = (running max m, weight sum l).
struct SplitOut {
    float* acc;
    float* stats;
};

// Two bf16 values from shared memory as one pair.
__device__ __forceinline__ u32_t pair(const __nv_bfloat16& lo, const __nv_bfloat16& hi) {
    const __nv_bfloat162 v = __halves2bfloat162(lo, hi);
    return *reinterpret_cast<const u32_t*>(&v);
}

struct Shared {
    __nv_bfloat16 keys[2][TILE][KEY_STRIDE];        // the tile's keys, double-buffered
    float partial[MAX_WARPS][HEADS][TILE];          // each warp's partial scores
    __nv_bfloat16 weights[HEADS][P_STRIDE];         // bf16(p) of the tile
    float row_max[HEADS];
    float row_sum[HEADS];
    float rescale[HEADS];
};

// The float4 `i` of this thread's share of a tile: (key row, float4 column) for `threads`
// threads and `quads` = head_dim / 4 float4 per key.
__device__ __forceinline__ void load_slot(u32_t i, u32_t threads, u32_t quads, u32_t& row,
                                          u32_t& quad) {
    const u32_t slot = i * threads + threadIdx.x;
    row = slot / quads;
    quad = slot % quads;
}

// Loads this thread's share of tile `tile` of the query's keys into registers (zero past the
// list).
__device__ __forceinline__ void fetch(float4 (&staged)[LOADS], u32_t tile, u32_t n_keys,
                                      const unsigned long long* __restrict__ key_ptrs,
                                      const u32_t* __restrict__ key_rows, u32_t threads, u32_t quads) {
#pragma unroll
    for (u32_t i = 0; i < LOADS; ++i) {
        u32_t row, quad;
        load_slot(i, threads, quads, row, quad);
        const u32_t j = tile * TILE + row;
        if (j < n_keys) {
            const float4* key = reinterpret_cast<const float4*>(key_ptrs[key_rows[j]]);
            staged[i] = key[quad];
        } else {
            staged[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
}

// Split `split` of `splits` of query `query` of the row-batched entry: q [queries, heads,
// head_dim] (f32 storage, bf16 values), key j of the query at the address
// key_ptrs[key_rows[first + j]] for j < n_keys. One split writes out; several write `part`.
__device__ void attention(const float* __restrict__ q, const unsigned long long* __restrict__ key_ptrs,
                          const u32_t* __restrict__ key_rows, u32_t n_keys, u32_t split, u32_t splits,
                          const float* __restrict__ sink, float* __restrict__ out, SplitOut part,
                          AttentionParams p) {
    __shared__ Shared sh;
    const u32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32_t g = lane / 4, t = lane % 4;
    const u32_t threads = blockDim.x;  // head_dim / 64 warps
    const u32_t quads = p.head_dim / 4;
    const u32_t head0 = blockIdx.x * HEADS;
    const u32_t dim0 = warp * WARP_DIMS;

    // This warp's A fragments of q (4 k-steps of 16 dims), zero past the last head.
    u32_t qa[4][4];
#pragma unroll
    for (u32_t kk = 0; kk < 4; ++kk) {
        const u32_t d = dim0 + kk * 16 + 2 * t;
        const u32_t h_lo = head0 + g, h_hi = head0 + g + 8;
        const float* lo = q + (size_t)h_lo * p.head_dim;
        const float* hi = q + (size_t)h_hi * p.head_dim;
        const bool has_lo = h_lo < p.heads, has_hi = h_hi < p.heads;
        qa[kk][0] = has_lo ? pack_bf16(lo[d], lo[d + 1]) : 0u;
        qa[kk][1] = has_hi ? pack_bf16(hi[d], hi[d + 1]) : 0u;
        qa[kk][2] = has_lo ? pack_bf16(lo[d + 8], lo[d + 9]) : 0u;
        qa[kk][3] = has_hi ? pack_bf16(hi[d + 8], hi[d + 9]) : 0u;
    }
    float acc[8][4];
#pragma unroll
    for (u32_t nt = 0; nt < 8; ++nt)
#pragma unroll
        for (u32_t c = 0; c < 4; ++c) acc[nt][c] = 0.0f;
    if (threadIdx.x < HEADS) {
        sh.row_max[threadIdx.x] = -1e30f;
        sh.row_sum[threadIdx.x] = 0.0f;
    }

    const u32_t all_tiles = (n_keys + TILE - 1) / TILE;
    const u32_t first_tile = split * SPLIT_TILES;
    const u32_t tiles = splits == 1 ? all_tiles : min(all_tiles, first_tile + SPLIT_TILES);
    float4 staged[LOADS];
    if (first_tile < tiles) fetch(staged, first_tile, n_keys, key_ptrs, key_rows, threads, quads);

    for (u32_t tile = first_tile; tile < tiles; ++tile) {
        const u32_t buf = tile & 1;
#pragma unroll
        for (u32_t i = 0; i < LOADS; ++i) {
            u32_t row, quad;
            load_slot(i, threads, quads, row, quad);
            u32_t* dst = reinterpret_cast<u32_t*>(&sh.keys[buf][row][quad * 4]);
            dst[0] = pack_bf16(staged[i].x, staged[i].y);
            dst[1] = pack_bf16(staged[i].z, staged[i].w);
        }
        __syncthreads();  // (A) the tile's keys are in place; the last tile's weights were used
        if (tile + 1 < tiles) fetch(staged, tile + 1, n_keys, key_ptrs, key_rows, threads, quads);

        // Partial scores over this warp's dims: [16 heads x 16 keys] as two n-tiles of 8 keys.
        float s[2][4];
#pragma unroll
        for (u32_t nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (u32_t c = 0; c < 4; ++c) s[nt][c] = 0.0f;
            const __nv_bfloat16* key = sh.keys[buf][nt * 8 + g];
#pragma unroll
            for (u32_t kk = 0; kk < 4; ++kk) {
                const u32_t d = dim0 + kk * 16 + 2 * t;
                const u32_t b0 = *reinterpret_cast<const u32_t*>(key + d);
                const u32_t b1 = *reinterpret_cast<const u32_t*>(key + d + 8);
                mma_bf16(s[nt], qa[kk], b0, b1);
            }
            sh.partial[warp][g][nt * 8 + 2 * t] = s[nt][0];
            sh.partial[warp][g][nt * 8 + 2 * t + 1] = s[nt][1];
            sh.partial[warp][g + 8][nt * 8 + 2 * t] = s[nt][2];
            sh.partial[warp][g + 8][nt * 8 + 2 * t + 1] = s[nt][3];
        }
        __syncthreads();  // (B) every warp's partial scores are in place

        // Online softmax: half-warp per head, lane j = key j of the tile.
        const u32_t warps = threads / 32;
        for (u32_t pair_index = threadIdx.x; pair_index < HEADS * TILE; pair_index += threads) {
            const u32_t h = pair_index / TILE, j = pair_index % TILE;
            float score = 0.0f;
            for (u32_t w = 0; w < warps; ++w) score += sh.partial[w][h][j];
            score *= p.scale;
            const bool valid = tile * TILE + j < n_keys;
            float tile_max = valid ? score : -1e30f;
#pragma unroll
            for (u32_t step = 8; step > 0; step /= 2)
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, step));
            const float old_max = sh.row_max[h];
            const float new_max = fmaxf(old_max, tile_max);
            const float weight = valid ? expf(score - new_max) : 0.0f;
            float sum = weight;
#pragma unroll
            for (u32_t step = 8; step > 0; step /= 2)
                sum += __shfl_xor_sync(0xffffffffu, sum, step);
            sh.weights[h][j] = __float2bfloat16_rn(weight);
            __syncwarp();
            if (j == 0) {
                const float rescale = expf(old_max - new_max);
                sh.rescale[h] = rescale;
                sh.row_max[h] = new_max;
                sh.row_sum[h] = sh.row_sum[h] * rescale + sum;
            }
        }
        __syncthreads();  // (C) the tile's weights and rescales are in place

        // Outputs: acc = acc * rescale + bf16(p) · V over this warp's 64 dims (8 n-tiles).
        const float rescale_lo = sh.rescale[g], rescale_hi = sh.rescale[g + 8];
        u32_t pa[4];
        pa[0] = *reinterpret_cast<const u32_t*>(&sh.weights[g][2 * t]);
        pa[1] = *reinterpret_cast<const u32_t*>(&sh.weights[g + 8][2 * t]);
        pa[2] = *reinterpret_cast<const u32_t*>(&sh.weights[g][2 * t + 8]);
        pa[3] = *reinterpret_cast<const u32_t*>(&sh.weights[g + 8][2 * t + 8]);
#pragma unroll
        for (u32_t nt = 0; nt < 8; ++nt) {
            acc[nt][0] *= rescale_lo;
            acc[nt][1] *= rescale_lo;
            acc[nt][2] *= rescale_hi;
            acc[nt][3] *= rescale_hi;
            const u32_t d = dim0 + nt * 8 + g;
            const u32_t b0 = pair(sh.keys[buf][2 * t][d], sh.keys[buf][2 * t + 1][d]);
            const u32_t b1 = pair(sh.keys[buf][2 * t + 8][d], sh.keys[buf][2 * t + 9][d]);
            mma_bf16(acc[nt], pa, b0, b1);
        }
    }
    __syncthreads();  // the row statistics of the last tile are final

    if (splits > 1) {
        // This split's (m, l, acc) for `combine`.
#pragma unroll
        for (u32_t half = 0; half < 2; ++half) {
            const u32_t h = head0 + g + 8 * half;
            if (h >= p.heads) continue;
            const u32_t local = g + 8 * half;
            float* acc_h = part.acc + (size_t)h * p.head_dim;
#pragma unroll
            for (u32_t nt = 0; nt < 8; ++nt) {
                const u32_t d = dim0 + nt * 8 + 2 * t;
                acc_h[d] = acc[nt][2 * half];
                acc_h[d + 1] = acc[nt][2 * half + 1];
            }
            if (warp == 0 && t == 0) {
                part.stats[2 * h] = sh.row_max[local];
                part.stats[2 * h + 1] = sh.row_sum[local];
            }
        }
        return;
    }

    // out = acc / (l + exp(sink - m)), rounded to bf16 (the V4.1 rounding point).
#pragma unroll
    for (u32_t half = 0; half < 2; ++half) {
        const u32_t h = head0 + g + 8 * half;
        if (h >= p.heads) continue;
        const u32_t local = g + 8 * half;
        const float denominator =
            sh.row_sum[local] + expf(sink[h] - sh.row_max[local]);
        float* out_h = out + (size_t)h * p.head_dim;
#pragma unroll
        for (u32_t nt = 0; nt < 8; ++nt) {
            const u32_t d = dim0 + nt * 8 + 2 * t;
            out_h[d] = round_bf16_f32(acc[nt][2 * half] / denominator);
            out_h[d + 1] = round_bf16_f32(acc[nt][2 * half + 1] / denominator);
        }
    }
}

// Merges the splits of head `h` of a query of `splits` > 1 splits (stride `heads` split
// results apart in `acc` / `stats`, as `attention` wrote them) into out [heads, head_dim], in
// split order; each thread writes the dims threadIdx.x, + blockDim.x, ...
__device__ void combine(const float* __restrict__ acc, const float* __restrict__ stats, u32_t splits,
                        u32_t h, float sink, float* __restrict__ out, AttentionParams p) {
    const size_t split_acc = (size_t)p.heads * p.head_dim;
    const size_t split_stats = (size_t)p.heads * 2;
    float m = -1e30f;
    for (u32_t s = 0; s < splits; ++s) m = fmaxf(m, stats[s * split_stats + 2 * h]);
    float l = 0.0f;
    for (u32_t s = 0; s < splits; ++s) {
        const float* st = stats + s * split_stats + 2 * h;
        l += st[1] * expf(st[0] - m);
    }
    const float denominator = l + expf(sink - m);
    float* out_h = out + (size_t)h * p.head_dim;
    for (u32_t d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (u32_t s = 0; s < splits; ++s) {
            const float weight = expf(stats[s * split_stats + 2 * h] - m);
            o += acc[s * split_acc + (size_t)h * p.head_dim + d] * weight;
        }
        out_h[d] = round_bf16_f32(o / denominator);
    }
}

}  // namespace fast_attention
