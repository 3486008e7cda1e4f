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
// (coalesced cp.async copies, PARTIAL_STAGES passes in flight), lane = token
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
// sigmoids and the Sinkhorn passes with a lane per comb cell (two for hc > 5 cells), the cells in
// registers (CombCells): every lane gathers its row's (or column's) cells by shuffles and sums
// them in the reference's order (the same operations on the same values, so the same bits for
// every lane of the row) and divides its own cell.
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
constexpr u32_t PARTIAL_STAGES = 4;      // K passes in flight (cp.async)
constexpr u32_t MAX_PROJECTIONS = (2 + MAX_HC) * MAX_HC;
constexpr u32_t PROJECTIONS_PER_WARP = (MAX_PROJECTIONS + PARTIAL_WARPS - 1) / PARTIAL_WARPS;
constexpr u32_t MAX_CELLS_PER_LANE = (MAX_HC * MAX_HC + 31) / 32;

__device__ __forceinline__ u32_t hc_mixes_tasks(HcMixesParams p) {
    return (2 + p.hc) * p.hc * refmath::sgemm_chains(p.n);
}

// Shared floats of a K-chain block's staged passes (hc_mixes_partials' dynamic shared memory):
// PARTIAL_STAGES slots of [TOKEN_TILE token rows ++ projections rows][TILE_STRIDE].
__host__ __device__ constexpr u32_t partial_stage_floats(u32_t projections) {
    return PARTIAL_STAGES * (TOKEN_TILE + projections) * TILE_STRIDE;
}

__device__ void hc_mixes_partials(const float* __restrict__ x, const float* __restrict__ proj,
                                  float* __restrict__ scratch, HcMixesParams p, u32_t tokens) {
    extern __shared__ __align__(16) float stages[];  // partial_stage_floats(projections)
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
        // Few tokens (decode): ask for every line of the chain's rows at once, so that the passes
        // after the first PARTIAL_STAGES find them in L2.
        const u32_t lines = length / 32 + 2;  // 128-byte lines a row's chain may touch
        for (u32_t i = threadIdx.x; i < (valid + projections) * lines; i += PARTIAL_THREADS) {
            const u32_t row = i / lines;
            const u32_t k = min((i % lines) * 32, length - 1);
            const float* at = row < valid ? x + (size_t)row * p.n + k : proj + (size_t)(row - valid) * p.n + k;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
        }
    }
    // Pass q stages K [q TILE_K, (q + 1) TILE_K) of the chain in slot q % PARTIAL_STAGES: row r <
    // TOKEN_TILE is the tile's token r, row TOKEN_TILE + j projection j. Warp w copies the rows w,
    // w + 8, ... of the valid tokens and the projections, lane = K offset (cp.async, 4 bytes,
    // zero past the chain). Token rows past `valid` stay unwritten: their lanes compute sums that
    // are never stored. Every pass commits one group (empty past the last pass), so waiting for
    // all but PARTIAL_STAGES - 2 groups always completes pass q at iteration q.
    const u32_t passes = (length + TILE_K - 1) / TILE_K;
    const u32_t rows_per_slot = TOKEN_TILE + projections;
    const auto slot = [&](u32_t q) { return stages + (size_t)(q % PARTIAL_STAGES) * rows_per_slot * TILE_STRIDE; };
    const auto issue = [&](u32_t q) {
        if (q < passes) {
            float* tile = slot(q);
            const u32_t k = q * TILE_K + lane;
            const bool inside = k < length;
            for (u32_t r = warp; r < valid + projections; r += PARTIAL_WARPS) {
                const bool token = r < valid;
                const u32_t row = token ? r : TOKEN_TILE + (r - valid);
                const float* src = token ? x + (size_t)r * p.n + k : proj + (size_t)(r - valid) * p.n + k;
                cp_async4(tile + row * TILE_STRIDE + lane, inside ? src : proj, inside);
            }
        }
        cp_async_commit();
    };
    for (u32_t q = 0; q + 1 < PARTIAL_STAGES; ++q) issue(q);
    float acc[PROJECTIONS_PER_WARP];
#pragma unroll
    for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i) acc[i] = 0.0f;
    for (u32_t q = 0; q < passes; ++q) {
        cp_async_wait<PARTIAL_STAGES - 2>();
        __syncthreads();  // pass q visible to every thread; every thread is done with pass q - 1's slot
        issue(q + PARTIAL_STAGES - 1);
        const float* tile = slot(q);
        const float* xs = tile + lane * TILE_STRIDE;
        const float* ws = tile + TOKEN_TILE * TILE_STRIDE;
        const u32_t count = min(TILE_K, length - q * TILE_K);
        if (count == TILE_K) {
#pragma unroll
            for (u32_t kk = 0; kk < TILE_K; kk += 4) {
                const float4 xq = *reinterpret_cast<const float4*>(xs + kk);
#pragma unroll
                for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i) {
                    const u32_t row = warp + PARTIAL_WARPS * i;
                    if (row < projections) {
                        const float4 wq = *reinterpret_cast<const float4*>(ws + row * TILE_STRIDE + kk);
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
                    if (row < projections) acc[i] = __fmaf_rn(xv, ws[row * TILE_STRIDE + kk], acc[i]);
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

// The comb matrix through the softmax and the Sinkhorn passes, held by one warp: lane l holds
// cells l + 32 r in v[r]. A cell's value reaches every lane by shuffles.
struct CombCells {
    float v[MAX_CELLS_PER_LANE];
    u32_t hc;

    // Cell `cell`'s value, in every lane (all 32 lanes call it with their own `cell`).
    __device__ __forceinline__ float at(u32_t cell) const {
        float out = 0.0f;
#pragma unroll
        for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) {
            const float got = __shfl_sync(0xffffffffu, v[r], cell % 32);
            if (cell / 32 == r) out = got;
        }
        return out;
    }

    // Cell k of line j (COLUMN: column j, else row j).
    template <bool COLUMN>
    __device__ __forceinline__ u32_t cell_of(u32_t j, u32_t k) const {
        return COLUMN ? k * hc + j : j * hc + k;
    }

    // The sum of line j, from 0 in index order (the reference's order).
    template <bool COLUMN>
    __device__ __forceinline__ float line_sum(u32_t j) const {
        float s = 0.0f;
#pragma unroll
        for (u32_t k = 0; k < MAX_HC; ++k)
            if (k < hc) s = __fadd_rn(s, at(cell_of<COLUMN>(j, k)));
        return s;
    }

    // The largest value of row j.
    __device__ __forceinline__ float row_max(u32_t j) const {
        float m = -__uint_as_float(0x7f800000u);
#pragma unroll
        for (u32_t k = 0; k < MAX_HC; ++k)
            if (k < hc) m = fmaxf(m, at(cell_of<false>(j, k)));
        return m;
    }
};

__device__ void hc_mixes(const float* __restrict__ scratch, const float* __restrict__ base,
                         const float* __restrict__ scale, float* __restrict__ out, HcMixesParams p) {
    extern __shared__ float token_partials[];  // [tasks + 1], staged with coalesced loads
    __shared__ float mixes[(2 + MAX_HC) * MAX_HC];
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
    // One warp from here: lane l holds comb cells l and l + 32 (CombCells); every lane takes part
    // in every shuffle, lanes past the cells on a cell of their own that they never store.
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
    CombCells c;
    c.hc = hc;
    u32_t row[MAX_CELLS_PER_LANE], column[MAX_CELLS_PER_LANE];
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) {
        const u32_t e = min(lane + 32 * r, cells - 1);
        row[r] = e / hc;
        column[r] = e % hc;
        c.v[r] = __fadd_rn(__fmul_rn(mixes[2 * hc + e], scale[2]), base[2 * hc + e]);
    }
    // Row softmax (+eps): the row's max and exps, then the row's sum of the exps.
    float v[MAX_CELLS_PER_LANE];
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r)
        // The reference's standalone torch.exp here is correctly rounded (CPU: quant::exp_f32_accurate).
        v[r] = refmath::exp_accurate(__fsub_rn(c.v[r], c.row_max(row[r])));
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) c.v[r] = v[r];
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) v[r] = __fadd_rn(__fdiv_rn(c.v[r], c.line_sum<false>(row[r])), p.hc_eps);
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) c.v[r] = v[r];
    // Column normalisation, then (iters - 1) row/column passes: cell /= (line sum + eps).
    const u32_t column_passes = p.sinkhorn_iters > 0 ? p.sinkhorn_iters : 1;  // the first is unconditional
    for (u32_t pass = 1; pass < 2 * column_passes; ++pass) {
        const bool by_column = pass % 2 == 1;
#pragma unroll
        for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) {
            const float sum = by_column ? c.line_sum<true>(column[r]) : c.line_sum<false>(row[r]);
            v[r] = __fdiv_rn(c.v[r], __fadd_rn(sum, p.hc_eps));
        }
#pragma unroll
        for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r) c.v[r] = v[r];
    }
#pragma unroll
    for (u32_t r = 0; r < MAX_CELLS_PER_LANE; ++r)
        if (lane + 32 * r < cells) comb[lane + 32 * r] = c.v[r];
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
// mixes = pre [hc] ++ post [hc] ++ comb [hc, hc] (hc_mixes' rows: mixes [tokens, 2 hc + hc * hc],
// read in place); t = blockIdx.y. A thread takes one d for every k: it reads the token's hc
// residual values of d once (hc <= MAX_HC).
__device__ void hc_expand(const float* __restrict__ y, const float* __restrict__ residual,
                          const float* __restrict__ mixes, float* __restrict__ out, HcElementwiseParams p) {
    const u32_t d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= p.dim) return;
    const size_t token = blockIdx.y;
    y += token * p.dim;
    residual += token * p.hc * p.dim;
    const float* post = mixes + token * (2 * p.hc + p.hc * p.hc) + p.hc;
    const float* comb = post + p.hc;
    out += token * p.hc * p.dim;
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
        const float v = __fadd_rn(__fmul_rn(post[k], yd), mixed);
        out[(size_t)k * p.dim + d] = p.round_bf16 ? round_bf16_f32(v) : v;
    }
}

}  // namespace mhc
