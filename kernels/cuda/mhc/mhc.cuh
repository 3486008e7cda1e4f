// mHC (manifold-constrained hyper-connections, v41-architecture.md §3.2) for a batch of tokens,
// operation for operation as the CPU reference (CpuBackend::hc_mixes / hc_collapse / hc_expand).
// Every token's math is the one-token math on its own rows (one token = the n = 1 case), so a
// token's results do not depend on the batch.
//
// hc_mixes, two launches.
// hc_mixes_partials (grid: TOKEN_TILE + K chains blocks x token tiles of TOKEN_TILE tokens).
// Every (token, projection, K chain) partial of the CPU sgemm order (refmath::sgemm_chains) is
// its own fp32 FMA chain from 0 over the chain's K in order; the schedule only decides which
// thread runs which chain, never the operations of one. Block x >= TOKEN_TILE is K chain
// c = x - TOKEN_TILE for the tile's tokens and every projection, as a small GEMM: the tile's x
// rows and all projection rows are staged TILE_K values of K at a time in shared memory
// (coalesced loads, the next tile's loads issued before the current one is used), lane = token
// and warp w owns projections w, w + 8, ...; every thread FMAs its chains over the staged K in
// K order (float4 reads of four consecutive K, used x, y, z, w). A projection row is so read
// once per token tile instead of once per token, and a token's row once per K chain.
// Block x < TOKEN_TILE computes token (tile * TOKEN_TILE + x)'s sum of squares in the order of
// torch's CPU sum (as the CPU reference's sum_squares_f32_torch) with the whole block
// (refmath::torch_sum_block_split: the level-0 segments of torch's cascade are independent sums
// from 0, computed in parallel and fed to each chain's cascade in segment order: the operations
// of refmath::torch_sum_block exactly).
// Scratch per token: [projections * K chains partials (projection-major), sum of squares].
// hc_mixes (grid: tokens): warp w adds the partials of projections w, w + 8, ... in the CPU's
// perfect pairwise tree (K chains is a power of two: each lane first adds its K / 32 adjacent
// partials as a perfect subtree, then a shuffle-down tree over the 32 lanes -- offsets 1, 2, 4,
// ... add left subtree + right subtree, the tree of refmath::PairwiseSum); then one warp does the
// sigmoids and the Sinkhorn passes with a lane per comb cell (two for hc > 5 cells): every lane
// recomputes its row's (or column's) sum in the reference's order (the same operations on the
// same values, so the same bits for every lane of the row) and divides its own cell.
// Output per token: pre [hc], post [hc], comb [hc, hc].
// hc_collapse / hc_expand: elementwise, token = blockIdx.y, each token with its own weights /
// mixes; the k/j sums in stream order in fp32, one rounding (bf16 when p.round_bf16, else none).
#pragma once
#include "common/reference_math.cuh"

namespace mhc {

constexpr int THREADS = 256;
constexpr int MAX_HC = 8;

constexpr u32_t PARTIAL_THREADS = 256;
constexpr u32_t PARTIAL_WARPS = PARTIAL_THREADS / 32;
constexpr u32_t TOKEN_TILE = 32;         // tokens of a K-chain block: one per lane
constexpr u32_t TILE_K = 32;             // K values staged per pass
constexpr u32_t TILE_STRIDE = TILE_K + 4;  // float4 rows; 8 lanes' rows start in distinct banks
constexpr u32_t MAX_PROJECTIONS = (2 + MAX_HC) * MAX_HC;
constexpr u32_t PROJECTIONS_PER_WARP = (MAX_PROJECTIONS + PARTIAL_WARPS - 1) / PARTIAL_WARPS;
constexpr u32_t TOKENS_PER_WARP = TOKEN_TILE / PARTIAL_WARPS;
constexpr u32_t MAX_CELLS_PER_LANE = (MAX_HC * MAX_HC + 31) / 32;

__device__ __forceinline__ u32_t hc_mixes_tasks(HcMixesParams p) {
    return (2 + p.hc) * p.hc * refmath::sgemm_chains(p.n);
}

__device__ void hc_mixes_partials(const float* __restrict__ x, const float* __restrict__ proj,
                                  float* __restrict__ scratch, HcMixesParams p, u32_t tokens) {
    __shared__ __align__(16) float x_tile[TOKEN_TILE][TILE_STRIDE];
    __shared__ __align__(16) float w_tile[MAX_PROJECTIONS][TILE_STRIDE];
    __shared__ float sum_scratch[refmath::torch_sum_split_scratch(PARTIAL_THREADS)];
    const u32_t tasks = hc_mixes_tasks(p);
    const u32_t token0 = blockIdx.y * TOKEN_TILE;
    if (blockIdx.x < TOKEN_TILE) {
        const u32_t token = token0 + blockIdx.x;
        if (token >= tokens) return;  // the whole block
        const float sum_squares = refmath::torch_sum_block_split<float, true, PARTIAL_THREADS>(
            x + (size_t)token * p.n, p.n, sum_scratch);
        if (threadIdx.x == 0) scratch[(size_t)token * (tasks + 1) + tasks] = sum_squares;
        return;
    }
    const u32_t k_chains = refmath::sgemm_chains(p.n);
    const u32_t chain = blockIdx.x - TOKEN_TILE;
    const u32_t projections = (2 + p.hc) * p.hc;
    const u32_t start = refmath::sgemm_chain_start(chain, p.n, k_chains);
    const u32_t length = refmath::sgemm_chain_start(chain + 1, p.n, k_chains) - start;
    const u32_t valid = min(TOKEN_TILE, tokens - token0);
    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    x += (size_t)token0 * p.n + start;
    proj += start;
    if (gridDim.y == 1) {
        // Few tokens (decode): the K passes below would each wait on DRAM; ask for every line of
        // the chain's rows at once, so that the passes find them in L2.
        const u32_t lines = length / 32 + 2;  // 128-byte lines a row's chain may touch
        for (u32_t i = threadIdx.x; i < (valid + projections) * lines; i += PARTIAL_THREADS) {
            const u32_t row = i / lines;
            const u32_t k = min((i % lines) * 32, length - 1);
            const float* at = row < valid ? x + (size_t)row * p.n + k : proj + (size_t)(row - valid) * p.n + k;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
        }
    }
    float x_next[TOKENS_PER_WARP];
    float w_next[PROJECTIONS_PER_WARP];
    // Thread (warp, lane) loads K offset + lane of token rows warp + 8i and projection rows
    // warp + 8i (0 outside: those are stored but never used in an FMA).
    const auto load = [&](u32_t offset) {
        const bool inside = offset + lane < length;
#pragma unroll
        for (u32_t i = 0; i < TOKENS_PER_WARP; ++i) {
            const u32_t t = warp + PARTIAL_WARPS * i;
            x_next[i] = inside && t < valid ? x[(size_t)t * p.n + offset + lane] : 0.0f;
        }
#pragma unroll
        for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i) {
            const u32_t row = warp + PARTIAL_WARPS * i;
            w_next[i] = inside && row < projections ? proj[(size_t)row * p.n + offset + lane] : 0.0f;
        }
    };
    float acc[PROJECTIONS_PER_WARP];
#pragma unroll
    for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i) acc[i] = 0.0f;
    load(0);
    const float* xs = x_tile[lane];
    for (u32_t offset = 0; offset < length; offset += TILE_K) {
        __syncthreads();  // every thread is done with the previous pass's tiles
#pragma unroll
        for (u32_t i = 0; i < TOKENS_PER_WARP; ++i) x_tile[warp + PARTIAL_WARPS * i][lane] = x_next[i];
#pragma unroll
        for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i)
            if (warp + PARTIAL_WARPS * i < projections) w_tile[warp + PARTIAL_WARPS * i][lane] = w_next[i];
        __syncthreads();
        if (offset + TILE_K < length) load(offset + TILE_K);
        const u32_t count = min(TILE_K, length - offset);
        if (count == TILE_K) {
#pragma unroll
            for (u32_t kk = 0; kk < TILE_K; kk += 4) {
                const float4 xq = *reinterpret_cast<const float4*>(xs + kk);
#pragma unroll
                for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i) {
                    const u32_t row = warp + PARTIAL_WARPS * i;
                    if (row < projections) {
                        const float4 wq = *reinterpret_cast<const float4*>(&w_tile[row][kk]);
                        acc[i] = __fmaf_rn(xq.x, wq.x, acc[i]);
                        acc[i] = __fmaf_rn(xq.y, wq.y, acc[i]);
                        acc[i] = __fmaf_rn(xq.z, wq.z, acc[i]);
                        acc[i] = __fmaf_rn(xq.w, wq.w, acc[i]);
                    }
                }
            }
        } else {
            for (u32_t kk = 0; kk < count; ++kk) {
                const float xv = xs[kk];
#pragma unroll
                for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i) {
                    const u32_t row = warp + PARTIAL_WARPS * i;
                    if (row < projections) acc[i] = __fmaf_rn(xv, w_tile[row][kk], acc[i]);
                }
            }
        }
    }
    if (lane < valid) {
        float* out = scratch + (size_t)(token0 + lane) * (tasks + 1) + chain;
#pragma unroll
        for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i) {
            const u32_t row = warp + PARTIAL_WARPS * i;
            if (row < projections) out[(size_t)row * k_chains] = acc[i];
        }
    }
}

// Sum of row j (COLUMN: column j) of the hc x hc matrix c, from 0 in index order.
template <bool COLUMN>
__device__ __forceinline__ float comb_line_sum(const float* c, u32_t j, u32_t hc) {
    float s = 0.0f;
    for (u32_t k = 0; k < hc; ++k) s = __fadd_rn(s, COLUMN ? c[k * hc + j] : c[j * hc + k]);
    return s;
}

__device__ void hc_mixes(const float* __restrict__ scratch, const float* __restrict__ base,
                         const float* __restrict__ scale, float* __restrict__ out, HcMixesParams p) {
    extern __shared__ float token_partials[];  // [tasks + 1], staged with coalesced loads
    __shared__ float mixes[(2 + MAX_HC) * MAX_HC];
    __shared__ float c[MAX_HC * MAX_HC];  // comb through the softmax and Sinkhorn passes
    const u32_t hc = p.hc;
    const u32_t projections = (2 + hc) * hc;
    const u32_t k_chains = refmath::sgemm_chains(p.n);
    const u32_t tasks = hc_mixes_tasks(p);
    scratch += (size_t)blockIdx.x * (tasks + 1);
    out += (size_t)blockIdx.x * (2 * hc + hc * hc);
    for (u32_t i = threadIdx.x; i <= tasks; i += THREADS) token_partials[i] = scratch[i];
    __syncthreads();
    const float* partials = token_partials;
    const float sum_squares = partials[tasks];

    const float mean_square = __fdiv_rn(sum_squares, (float)p.n);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_square, p.norm_eps)));
    const u32_t lane = threadIdx.x % 32;
    for (u32_t row = threadIdx.x / 32; row < projections; row += THREADS / 32) {
        // The perfect pairwise tree over the row's k_chains partials (a power of two).
        const float* leaves = partials + row * k_chains;
        float v;
        if (k_chains > 32) {
            const u32_t per_lane = k_chains / 32;  // a perfect subtree per lane
            refmath::PairwiseSum subtree;
            for (u32_t b = 0; b < per_lane; ++b) subtree.push(leaves[lane * per_lane + b]);
            v = subtree.finish();
        } else {
            v = lane < k_chains ? leaves[lane] : 0.0f;
        }
        const u32_t width = min(k_chains, 32u);
        for (u32_t offset = 1; offset < width; offset *= 2) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, offset));
        if (lane == 0) mixes[row] = __fmul_rn(v, inv);
    }
    __syncthreads();
    // One warp from here: lane l owns comb cells l and l + 32; __syncwarp orders the passes.
    if (threadIdx.x >= 32) return;
    const u32_t cells = hc * hc;
    float* pre = out;
    float* post = out + hc;
    float* comb = out + 2 * hc;
    if (lane < hc) {
        const u32_t k = lane;
        pre[k] = __fadd_rn(refmath::sigmoid(__fadd_rn(__fmul_rn(mixes[k], scale[0]), base[k])), p.hc_eps);
        post[k] = __fmul_rn(2.0f, refmath::sigmoid(__fadd_rn(__fmul_rn(mixes[hc + k], scale[1]), base[hc + k])));
    }
    for (u32_t i = lane; i < cells; i += 32)
        c[i] = __fadd_rn(__fmul_rn(mixes[2 * hc + i], scale[2]), base[2 * hc + i]);
    __syncwarp();
    float v[MAX_CELLS_PER_LANE];
    // Row softmax (+eps): the row's max and exps, then the row's sum of the exps.
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) {
        const u32_t e = lane + 32 * r;
        if (e < cells) {
            const float* row = c + e / hc * hc;
            float max = -__uint_as_float(0x7f800000u);
            for (u32_t k = 0; k < hc; ++k) max = fmaxf(max, row[k]);
            // The reference's standalone torch.exp here is correctly rounded (CPU: quant::exp_f32_accurate).
            v[r] = refmath::exp_accurate(__fsub_rn(c[e], max));
        }
    }
    __syncwarp();
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r)
        if (lane + 32 * r < cells) c[lane + 32 * r] = v[r];
    __syncwarp();
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) {
        const u32_t e = lane + 32 * r;
        if (e < cells) v[r] = __fadd_rn(__fdiv_rn(c[e], comb_line_sum<false>(c, e / hc, hc)), p.hc_eps);
    }
    __syncwarp();
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r)
        if (lane + 32 * r < cells) c[lane + 32 * r] = v[r];
    __syncwarp();
    // Column normalisation, then (iters - 1) row/column passes: cell /= (line sum + eps).
    const u32_t column_passes = p.sinkhorn_iters > 0 ? p.sinkhorn_iters : 1;  // the first is unconditional
    for (u32_t pass = 1; pass < 2 * column_passes; ++pass) {
        const bool column = pass % 2 == 1;
#pragma unroll
        for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) {
            const u32_t e = lane + 32 * r;
            if (e < cells) {
                const float s = column ? comb_line_sum<true>(c, e % hc, hc) : comb_line_sum<false>(c, e / hc, hc);
                v[r] = __fdiv_rn(c[e], __fadd_rn(s, p.hc_eps));
            }
        }
        __syncwarp();
#pragma unroll
        for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r)
            if (lane + 32 * r < cells) c[lane + 32 * r] = v[r];
        __syncwarp();
    }
    for (u32_t i = lane; i < cells; i += 32) comb[i] = c[i];
}

// y[t, d] = bf16(sum_k w[t, k] * x[t, k, d]), k in stream order from 0; t = blockIdx.y.
__device__ void hc_collapse(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                            HcElementwiseParams p) {
    const u32_t d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= p.dim) return;
    const size_t token = blockIdx.y;
    x += token * p.hc * p.dim;
    w += token * p.hc;
    y += token * p.dim;
    float acc = 0.0f;
    for (u32_t k = 0; k < p.hc; ++k) acc = __fadd_rn(acc, __fmul_rn(w[k], x[(size_t)k * p.dim + d]));
    y[d] = p.round_bf16 ? round_bf16_f32(acc) : acc;
}

// out[t, k, d] = bf16(post[k] * y[t, d] + sum_j comb[j, k] * residual[t, j, d]) with token t's
// mix = post [hc] ++ comb [hc, hc] (mix [tokens, hc + hc * hc]); t = blockIdx.y. A thread takes
// one d for every k: it reads the token's hc residual values of d once (hc <= MAX_HC).
__device__ void hc_expand(const float* __restrict__ y, const float* __restrict__ residual,
                          const float* __restrict__ mix, float* __restrict__ out, HcElementwiseParams p) {
    const u32_t d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= p.dim) return;
    const size_t token = blockIdx.y;
    y += token * p.dim;
    residual += token * p.hc * p.dim;
    mix += token * (p.hc + p.hc * p.hc);
    out += token * p.hc * p.dim;
    const float* comb = mix + p.hc;
    float r[MAX_HC];
#pragma unroll
    for (u32_t j = 0; j < MAX_HC; ++j) r[j] = j < p.hc ? residual[(size_t)j * p.dim + d] : 0.0f;
    const float yd = y[d];
    for (u32_t k = 0; k < p.hc; ++k) {
        float mixed = 0.0f;
#pragma unroll
        for (u32_t j = 0; j < MAX_HC; ++j) {
            if (j < p.hc) mixed = __fadd_rn(mixed, __fmul_rn(comb[j * p.hc + k], r[j]));
        }
        const float v = __fadd_rn(__fmul_rn(mix[k], yd), mixed);
        out[(size_t)k * p.dim + d] = p.round_bf16 ? round_bf16_f32(v) : v;
    }
}

}  // namespace mhc
