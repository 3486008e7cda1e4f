// mHC (manifold-constrained hyper-connections, v41-architecture.md §3.2) for a batch of tokens,
// operation for operation as the CPU reference (CpuBackend::hc_mixes / hc_collapse / hc_expand).
// Every token's math is the one-token math on its own rows (one token = the n = 1 case), so a
// token's results do not depend on the batch. Every value below comes from the reference's fp32
// operations on the same operands in the same order; the schedules only decide which thread runs
// which operation and how values move (shared memory, shuffles), so the bits never depend on them.
//
// hc_mixes, two launches.
// hc_mixes_partials (grid: tile + K chains blocks x token tiles of `tile` tokens, tile =
// token_tile(tokens, hc): WIDE_TILE for more than TOKEN_TILE tokens and hc <= WIDE_HC, else
// TOKEN_TILE). Every (token, projection, K chain) partial of the CPU sgemm order
// (refmath::sgemm_chains) is its own fp32 FMA chain from 0 over the chain's K in order; the
// schedule only decides which thread runs which chain, never the operations of one. Block
// x >= tile is K chain c = x - tile for the tile's tokens and every projection, as a small GEMM:
// the tile's x rows and all projection rows are staged TILE_K values of K at a time in shared
// memory (stream_chain: coalesced cp.async copies, PARTIAL_STAGES passes in flight), and every
// thread FMAs its chains over the staged K in K order (float4 reads of four consecutive K, used
// x, y, z, w; a value read once for all its thread's chains). A projection row is so read once
// per token tile instead of once per token, and a token's row once per K chain. Two mappings of
// (token, projection) pairs to threads:
// - More than TOKEN_TILE valid tokens (so tile = WIDE_TILE, hc <= WIDE_HC), the register tile
//   (tiled_chain): lane l of warp w takes tokens 4w + l / 8 + 32 r (r < 2) and projections
//   l % 8 + 8 i (i < 3), six chains in registers. A float4 step is 5 LDS.128 for 24 FFMA, each
//   LDS.128 one shared-memory wavefront: the warp reads 4 token rows (each broadcast to 8
//   lanes) or 8 consecutive projection rows (each to 4 lanes), in distinct banks (TILE_STRIDE).
//   A pass is 40 LDS.128 and 192 FFMA a thread: 0.21 wavefronts a FFMA, under the 0.25 at which
//   an SM (one wavefront, four FFMA instructions a clock) waits on shared memory; the spread
//   mapping at a full tile of 32 (4 wavefronts a token float4, 3 broadcast projections) needs 0.58.
// - At most TOKEN_TILE valid tokens (decode, a prefill's last part tile, and every tile for
//   hc > WIDE_HC), the spread mapping (spread_chain), so that no lane works for a dead token:
//   with T the tile's valid tokens rounded up to a power of two, thread t takes token t % T and
//   the SLOTS consecutive projections (t / T) SLOTS + i, SLOTS = ceil(T projections /
//   PARTIAL_THREADS) (slot i; slots past the projections skipped, warps without a pair skip the
//   FMAs). A full tile is so lane = token and warp w's projections 3w.. (hc 4); one decode token
//   is one chain per projection in warp 0's lanes. The FMA loop is instantiated per slot count
//   (fma_pass<SLOTS>), so no dead slot is issued. The reads are conflict-free: a quarter warp
//   reads one row (broadcast) or up to 8 rows spaced 1 or 2 apart (distinct banks).
// Block x < tile computes token (tile index * tile + x)'s sum of squares in the order of
// torch's CPU sum (as the CPU reference's sum_squares_f32_torch) with the whole block
// (refmath::torch_sum_block_split: the level-0 segments of torch's cascade are independent sums
// from 0, computed in parallel and fed to each chain's cascade in segment order: the operations
// of refmath::torch_sum_block exactly).
// Scratch per token: [projections * K chains partials (projection-major), sum of squares].
// hc_mixes (grid: tokens), one body per hc (hc_mixes_hc<HC>: every loop over a line unrolled):
// the token's partials are staged in shared memory (STAGE_BATCH loads per thread in flight), then
// warp w adds the partials of projections w, w + 8, ... in the CPU's perfect pairwise tree
// (K chains is a power of two: each lane first adds its K / 32 adjacent partials as a perfect
// subtree -- the levels below its top in place in its own partials, the top into a register --
// then a shuffle-down tree over the 32 lanes, offsets 1, 2, 4, ... adding left subtree + right
// subtree: the tree of refmath::PairwiseSum; the warp's rows side by side). Then warp 1 computes
// the pre / post sigmoids while warp 0 does the comb's softmax and Sinkhorn passes with a lane
// per comb cell (two for hc > 5), the cells in registers (CombCells): every lane gathers its
// row's (or column's) HC cells by HC independent shuffles and sums them from 0 in index order
// (the reference's order: the same operations on the same values, so the same bits in every lane
// of the line) and divides its own cell. A pass is so one shuffle latency, HC dependent adds, the
// eps add and one division (no branch around a shuffle).
// Output per token: pre [hc], post [hc], comb [hc, hc].
// hc_collapse / hc_expand: elementwise, token = blockIdx.y, each token with its own weights /
// mixes; the k/j sums in stream order in fp32, one rounding (bf16 when p.round_bf16, else none).
#pragma once
#include "common/compile_time.cuh"
#include "common/reference_math.cuh"

namespace mhc {

constexpr int THREADS = 256;
constexpr u32_t WARPS = THREADS / 32;
constexpr int MAX_HC = 8;
constexpr u32_t FULL_WARP = 0xffffffffu;
constexpr u32_t STAGE_BATCH = 6;  // hc_mixes: partials a thread loads per round (V4.1: 1536, one round)

constexpr u32_t PARTIAL_THREADS = 256;
constexpr u32_t PARTIAL_WARPS = PARTIAL_THREADS / 32;
constexpr u32_t TOKEN_TILE = 32;         // tokens of a spread K-chain block: at most one per lane
constexpr u32_t WIDE_TILE = 64;          // tokens of a register-tile K-chain block (prefill)
constexpr u32_t WIDE_HC = 4;             // the most streams of the register tile: 24 projections
constexpr u32_t TILE_K = 32;             // K values staged per pass
constexpr u32_t TILE_STRIDE = TILE_K + 4;  // float4 rows; 8 consecutive rows start in distinct banks
constexpr u32_t PARTIAL_STAGES = 4;      // K passes in flight (cp.async)
constexpr u32_t MAX_PROJECTIONS = (2 + MAX_HC) * MAX_HC;
constexpr u32_t PROJECTIONS_PER_WARP = (MAX_PROJECTIONS + PARTIAL_WARPS - 1) / PARTIAL_WARPS;  // most slots
// The register tile: a warp's lanes in PROJECTION_GROUPS groups of projections; a thread's
// TILE_TOKENS tokens (TOKEN_TILE apart) and TILE_SLOTS projections (PROJECTION_GROUPS apart).
constexpr u32_t PROJECTION_GROUPS = 8;
constexpr u32_t TILE_TOKENS = WIDE_TILE / TOKEN_TILE;
constexpr u32_t TILE_SLOTS = (2 + WIDE_HC) * WIDE_HC / PROJECTION_GROUPS;
static_assert(PARTIAL_THREADS / PROJECTION_GROUPS == TOKEN_TILE, "a thread's tokens are TOKEN_TILE apart");
static_assert(TILE_SLOTS * PROJECTION_GROUPS == (2 + WIDE_HC) * WIDE_HC, "the tile covers WIDE_HC's projections");

__device__ __forceinline__ u32_t hc_mixes_tasks(HcMixesParams p) {
    return (2 + p.hc) * p.hc * refmath::sgemm_chains(p.n);
}

// The tokens of a K-chain block (and the sum-of-squares blocks before a tile's K chains) when a
// launch holds `tokens` tokens of hc streams.
__host__ __device__ constexpr u32_t token_tile(u32_t tokens, u32_t hc) {
    return tokens > TOKEN_TILE && hc <= WIDE_HC ? WIDE_TILE : TOKEN_TILE;
}

// Shared floats of a K-chain block's staged passes (hc_mixes_partials' dynamic shared memory):
// PARTIAL_STAGES slots of [tile token rows ++ projections rows][TILE_STRIDE].
__host__ __device__ constexpr u32_t partial_stage_floats(u32_t tile, u32_t projections) {
    return PARTIAL_STAGES * (tile + projections) * TILE_STRIDE;
}

// acc + a . b over four consecutive K, in K order.
__device__ __forceinline__ float fma4(float acc, float4 a, float4 b) {
    acc = __fmaf_rn(a.x, b.x, acc);
    acc = __fmaf_rn(a.y, b.y, acc);
    acc = __fmaf_rn(a.z, b.z, acc);
    return __fmaf_rn(a.w, b.w, acc);
}

// K chain `chain` of the tile's tokens (token0 on, `valid` of them) and of every projection
// through shared memory, TILE_K values of K a pass: pass(staged, count) runs on every pass in K
// order, with row r < tile of `staged` the tile's token r and row tile + j projection j
// (TILE_STRIDE floats a row), `count` values of K (TILE_K but in the chain's last pass).
template <class Pass>
__device__ __forceinline__ void stream_chain(const float* __restrict__ x, const float* __restrict__ proj,
                                             HcMixesParams p, u32_t chain, u32_t token0, u32_t valid, u32_t tile,
                                             float* stages, Pass&& pass) {
    const u32_t k_chains = refmath::sgemm_chains(p.n);
    const u32_t projections = (2 + p.hc) * p.hc;
    const u32_t start = refmath::sgemm_chain_start(chain, p.n, k_chains);
    const u32_t length = refmath::sgemm_chain_start(chain + 1, p.n, k_chains) - start;
    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    // K k of the chain in staged row r (r < valid: the tile's token r, else projection r - valid).
    const auto source = [&](u32_t r, u32_t k) {
        return r < valid ? x + ((size_t)(token0 + r) * p.n + start + k)
                         : proj + ((size_t)(r - valid) * p.n + start + k);
    };
    if (gridDim.y == 1) {
        // Few tokens (decode): ask for every line of the chain's rows at once, so that the passes
        // after the first PARTIAL_STAGES find them in L2.
        const u32_t lines = length / 32 + 2;  // 128-byte lines a row's chain may touch
        for (u32_t i = threadIdx.x; i < (valid + projections) * lines; i += PARTIAL_THREADS) {
            const u32_t row = i / lines;
            const u32_t k = min((i % lines) * 32, length - 1);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(source(row, k)));
        }
    }
    // Pass q stages its K in slot q % PARTIAL_STAGES. Warp w copies the rows w, w + 8, ... of the
    // valid tokens and the projections, lane = K offset (cp.async, 4 bytes, zero past the chain).
    // Token rows past `valid` stay unwritten: the sums of their lanes are never stored. Every
    // pass commits one group (empty past the last pass), so waiting for all but
    // PARTIAL_STAGES - 2 groups always completes pass q at iteration q.
    const u32_t passes = (length + TILE_K - 1) / TILE_K;
    const u32_t rows_per_slot = tile + projections;
    const auto slot = [&](u32_t q) { return stages + (size_t)(q % PARTIAL_STAGES) * rows_per_slot * TILE_STRIDE; };
    const auto issue = [&](u32_t q) {
        if (q < passes) {
            float* staged = slot(q);
            const u32_t k = q * TILE_K + lane;
            const bool inside = k < length;
            for (u32_t r = warp; r < valid + projections; r += PARTIAL_WARPS) {
                const u32_t row = r < valid ? r : tile + (r - valid);
                cp_async4(staged + row * TILE_STRIDE + lane, inside ? source(r, k) : proj, inside);
            }
        }
        cp_async_commit();
    };
    for (u32_t q = 0; q + 1 < PARTIAL_STAGES; ++q) issue(q);
    for (u32_t q = 0; q < passes; ++q) {
        cp_async_wait<PARTIAL_STAGES - 2>();
        __syncthreads();  // pass q visible to every thread; every thread is done with pass q - 1's slot
        issue(q + PARTIAL_STAGES - 1);
        pass(slot(q), min(TILE_K, length - q * TILE_K));
    }
}

// One staged pass of a thread's SLOTS chains: acc[i] += x[token] . w[first + i] over the pass's
// `count` K in K order (float4 reads of four consecutive K, used x, y, z, w, when the pass is
// whole); slots past the projections are skipped. xs: the token's staged row, ws: projection
// `first`'s (slot i: ws + i TILE_STRIDE).
template <u32_t SLOTS>
__device__ __forceinline__ void fma_pass(float (&acc)[PROJECTIONS_PER_WARP], const float* xs, const float* ws,
                                         u32_t count, u32_t first, u32_t projections) {
    if (count == TILE_K) {
#pragma unroll
        for (u32_t kk = 0; kk < TILE_K; kk += 4) {
            const float4 xq = *reinterpret_cast<const float4*>(xs + kk);
#pragma unroll
            for (u32_t i = 0; i < SLOTS; ++i)
                if (first + i < projections)
                    acc[i] = fma4(acc[i], xq, *reinterpret_cast<const float4*>(ws + i * TILE_STRIDE + kk));
        }
    } else {
        for (u32_t kk = 0; kk < count; ++kk) {
            const float xv = xs[kk];
#pragma unroll
            for (u32_t i = 0; i < SLOTS; ++i)
                if (first + i < projections) acc[i] = __fmaf_rn(xv, ws[i * TILE_STRIDE + kk], acc[i]);
        }
    }
}

// K chain `chain` of a tile of at most TOKEN_TILE valid tokens (token0 on; `tile` token rows
// staged) for every projection, in the spread mapping (see the header comment).
__device__ void spread_chain(const float* __restrict__ x, const float* __restrict__ proj,
                             float* __restrict__ scratch, HcMixesParams p, u32_t chain, u32_t token0,
                             u32_t valid, u32_t tile, float* stages) {
    const u32_t projections = (2 + p.hc) * p.hc;
    u32_t token_bits = 0;  // T = 1 << token_bits: valid rounded up to a power of two
    while ((1u << token_bits) < valid) ++token_bits;
    const u32_t slots = ((projections << token_bits) + PARTIAL_THREADS - 1) / PARTIAL_THREADS;
    // Thread t runs token t % T's chains of projections first + i (slot i), first = slots t / T;
    // slots past the projections are skipped.
    const u32_t token = threadIdx.x & ((1u << token_bits) - 1u);
    const u32_t first = (threadIdx.x >> token_bits) * slots;
    const bool busy = ((32 * (threadIdx.x / 32)) >> token_bits) * slots < projections;  // the warp holds a pair
    float acc[PROJECTIONS_PER_WARP];
#pragma unroll
    for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i) acc[i] = 0.0f;
    stream_chain(x, proj, p, chain, token0, valid, tile, stages, [&](const float* staged, u32_t count) {
        if (!busy) return;
        const float* xs = staged + token * TILE_STRIDE;
        const float* ws = staged + (tile + first) * TILE_STRIDE;
        with_const<1, PROJECTIONS_PER_WARP>(slots, [&](auto s) {
            fma_pass<decltype(s)::value>(acc, xs, ws, count, first, projections);
        });
    });
    if (token < valid) {
        const u32_t k_chains = refmath::sgemm_chains(p.n);
        float* out = scratch + (size_t)(token0 + token) * (hc_mixes_tasks(p) + 1) + chain;
#pragma unroll
        for (u32_t i = 0; i < PROJECTIONS_PER_WARP; ++i)
            if (i < slots && first + i < projections) out[(size_t)(first + i) * k_chains] = acc[i];
    }
}

// K chain `chain` of a WIDE_TILE tile of more than TOKEN_TILE valid tokens (token0 on) for every
// projection (hc <= WIDE_HC), in the register tile (see the header comment). Slots past the
// projections (hc < WIDE_HC) compute on the last projection's row and are never stored, so that
// every lane issues the same FMAs.
__device__ void tiled_chain(const float* __restrict__ x, const float* __restrict__ proj,
                            float* __restrict__ scratch, HcMixesParams p, u32_t chain, u32_t token0, u32_t valid,
                            float* stages) {
    const u32_t projections = (2 + p.hc) * p.hc;
    const u32_t lane = threadIdx.x % 32;
    const u32_t group = lane % PROJECTION_GROUPS;  // projections group + PROJECTION_GROUPS i
    const u32_t token = threadIdx.x / PROJECTION_GROUPS;  // tokens token + TOKEN_TILE r
    u32_t w_rows[TILE_SLOTS];
#pragma unroll
    for (u32_t i = 0; i < TILE_SLOTS; ++i) w_rows[i] = WIDE_TILE + min(group + PROJECTION_GROUPS * i, projections - 1);
    float acc[TILE_TOKENS][TILE_SLOTS];
#pragma unroll
    for (u32_t r = 0; r < TILE_TOKENS; ++r)
#pragma unroll
        for (u32_t i = 0; i < TILE_SLOTS; ++i) acc[r][i] = 0.0f;
    stream_chain(x, proj, p, chain, token0, valid, WIDE_TILE, stages, [&](const float* staged, u32_t count) {
        const auto xs = [&](u32_t r) { return staged + (token + TOKEN_TILE * r) * TILE_STRIDE; };
        const auto ws = [&](u32_t i) { return staged + w_rows[i] * TILE_STRIDE; };
        if (count == TILE_K) {
#pragma unroll
            for (u32_t kk = 0; kk < TILE_K; kk += 4) {
                float4 xq[TILE_TOKENS], wq[TILE_SLOTS];
#pragma unroll
                for (u32_t r = 0; r < TILE_TOKENS; ++r) xq[r] = *reinterpret_cast<const float4*>(xs(r) + kk);
#pragma unroll
                for (u32_t i = 0; i < TILE_SLOTS; ++i) wq[i] = *reinterpret_cast<const float4*>(ws(i) + kk);
#pragma unroll
                for (u32_t r = 0; r < TILE_TOKENS; ++r)
#pragma unroll
                    for (u32_t i = 0; i < TILE_SLOTS; ++i) acc[r][i] = fma4(acc[r][i], xq[r], wq[i]);
            }
        } else {
            for (u32_t kk = 0; kk < count; ++kk) {
#pragma unroll
                for (u32_t r = 0; r < TILE_TOKENS; ++r)
#pragma unroll
                    for (u32_t i = 0; i < TILE_SLOTS; ++i) acc[r][i] = __fmaf_rn(xs(r)[kk], ws(i)[kk], acc[r][i]);
            }
        }
    });
    const u32_t k_chains = refmath::sgemm_chains(p.n);
#pragma unroll
    for (u32_t r = 0; r < TILE_TOKENS; ++r) {
        if (token + TOKEN_TILE * r >= valid) continue;
        float* out = scratch + (size_t)(token0 + token + TOKEN_TILE * r) * (hc_mixes_tasks(p) + 1) + chain;
#pragma unroll
        for (u32_t i = 0; i < TILE_SLOTS; ++i)
            if (group + PROJECTION_GROUPS * i < projections)
                out[(size_t)(group + PROJECTION_GROUPS * i) * k_chains] = acc[r][i];
    }
}

__device__ void hc_mixes_partials(const float* __restrict__ x, const float* __restrict__ proj,
                                  float* __restrict__ scratch, HcMixesParams p, u32_t tokens) {
    extern __shared__ __align__(16) float stages[];  // partial_stage_floats(tile, projections)
    __shared__ float sum_scratch[refmath::torch_sum_split_scratch(PARTIAL_THREADS)];
    const u32_t tile = token_tile(tokens, p.hc);
    const u32_t token0 = blockIdx.y * tile;
    if (blockIdx.x < tile) {
        const u32_t token = token0 + blockIdx.x;
        if (token >= tokens) return;  // the whole block
        const u32_t tasks = hc_mixes_tasks(p);
        const float sum_squares = refmath::torch_sum_block_split<float, true, PARTIAL_THREADS>(
            x + (size_t)token * p.n, p.n, sum_scratch);
        if (threadIdx.x == 0) scratch[(size_t)token * (tasks + 1) + tasks] = sum_squares;
        return;
    }
    const u32_t valid = min(tile, tokens - token0);
    if (valid > TOKEN_TILE)
        tiled_chain(x, proj, scratch, p, blockIdx.x - tile, token0, valid, stages);
    else
        spread_chain(x, proj, scratch, p, blockIdx.x - tile, token0, valid, tile, stages);
}

// The HC x HC comb matrix through the softmax and the Sinkhorn passes, held by one warp: lane l
// holds cells l + 32 r in v[r]. A cell's value reaches every lane by a shuffle.
template <u32_t HC>
struct CombCells {
    static constexpr u32_t CELLS = HC * HC;
    static constexpr u32_t PER_LANE = (CELLS + 31) / 32;
    float v[PER_LANE];

    // Cell `cell`'s value, in every lane (all 32 lanes call it with their own `cell`).
    __device__ __forceinline__ float at(u32_t cell) const {
        float out = 0.0f;
#pragma unroll
        for (u32_t r = 0; r < PER_LANE; ++r) {
            const float got = __shfl_sync(FULL_WARP, v[r], cell % 32);
            if (PER_LANE == 1 || cell / 32 == r) out = got;
        }
        return out;
    }

    // Cell k of line j (COLUMN: column j, else row j).
    template <bool COLUMN>
    __device__ __forceinline__ static u32_t cell_of(u32_t j, u32_t k) {
        return COLUMN ? k * HC + j : j * HC + k;
    }

    // The sum of line j, from 0 in index order (the reference's order): HC independent shuffles,
    // then HC dependent adds.
    template <bool COLUMN>
    __device__ __forceinline__ float line_sum(u32_t j) const {
        float s = 0.0f;
#pragma unroll
        for (u32_t k = 0; k < HC; ++k) s = __fadd_rn(s, at(cell_of<COLUMN>(j, k)));
        return s;
    }

    // The largest value of row j.
    __device__ __forceinline__ float row_max(u32_t j) const {
        float m = -__uint_as_float(0x7f800000u);
#pragma unroll
        for (u32_t k = 0; k < HC; ++k) m = fmaxf(m, at(cell_of<false>(j, k)));
        return m;
    }

    // One Sinkhorn pass: every cell /= (its line's sum + eps), the sums taken before any cell changes.
    template <bool COLUMN>
    __device__ __forceinline__ void normalise(const u32_t (&line)[PER_LANE], float eps) {
        float next[PER_LANE];
#pragma unroll
        for (u32_t r = 0; r < PER_LANE; ++r) next[r] = __fdiv_rn(v[r], __fadd_rn(line_sum<COLUMN>(line[r]), eps));
#pragma unroll
        for (u32_t r = 0; r < PER_LANE; ++r) v[r] = next[r];
    }
};

// hc_mixes of token blockIdx.x for hc = HC. `token_partials`: dynamic shared memory of the
// token's tasks partials; `mixes`: shared memory of (2 + HC) HC floats.
template <u32_t HC>
__device__ void hc_mixes_hc(const float* __restrict__ scratch, const float* __restrict__ base,
                            const float* __restrict__ scale, float* __restrict__ out, HcMixesParams p,
                            float* token_partials, float* mixes) {
    constexpr u32_t PROJECTIONS = (2 + HC) * HC;
    constexpr u32_t ROWS = (PROJECTIONS + WARPS - 1) / WARPS;  // projection rows per warp
    using Comb = CombCells<HC>;
    const u32_t k_chains = refmath::sgemm_chains(p.n);
    const u32_t tasks = PROJECTIONS * k_chains;
    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    scratch += (size_t)blockIdx.x * (tasks + 1);
    out += (size_t)blockIdx.x * (2 * HC + Comb::CELLS);
    // The weights of the last part, read now so that they arrive with the partials: warp 1's
    // lanes k < HC take pre / post k, warp 0's lanes their comb cells (lanes past the cells a
    // copy of the last cell, never stored).
    u32_t row[Comb::PER_LANE], column[Comb::PER_LANE];
    float cell_base[Comb::PER_LANE];
#pragma unroll
    for (u32_t r = 0; r < Comb::PER_LANE; ++r) {
        const u32_t e = min(lane + 32 * r, Comb::CELLS - 1);
        row[r] = e / HC;
        column[r] = e % HC;
        cell_base[r] = warp == 0 ? base[2 * HC + e] : 0.0f;
    }
    const u32_t k = min(lane, HC - 1);
    const float pre_base = warp == 1 ? base[k] : 0.0f;
    const float post_base = warp == 1 ? base[HC + k] : 0.0f;
    const float scale_pre = scale[0], scale_post = scale[1], scale_comb = scale[2];

    const float sum_squares = scratch[tasks];
    // The token's partials into shared memory, STAGE_BATCH loads of a thread in flight at once.
    for (u32_t first = threadIdx.x; first < tasks; first += THREADS * STAGE_BATCH) {
        float staged[STAGE_BATCH];
#pragma unroll
        for (u32_t b = 0; b < STAGE_BATCH; ++b) staged[b] = scratch[min(first + THREADS * b, tasks)];
#pragma unroll
        for (u32_t b = 0; b < STAGE_BATCH; ++b)
            if (first + THREADS * b < tasks) token_partials[first + THREADS * b] = staged[b];
    }
    __syncthreads();
    const float mean_square = __fdiv_rn(sum_squares, (float)p.n);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_square, p.norm_eps)));
    // The perfect pairwise tree over each of the warp's rows of k_chains partials (a power of
    // two): lane l's per_lane adjacent partials first, as a perfect subtree (the levels below its
    // top added level by level in place in the lane's own partials, the top one into v), then
    // the shuffle-down tree over the lanes, the warp's rows side by side.
    if (PROJECTIONS >= WARPS || warp < PROJECTIONS) {  // hc = 1: warps past the 3 rows hold none
        const u32_t per_lane = max(k_chains / 32, 1u);
        const u32_t width = min(k_chains, 32u);
        // The lane's first partial of row j; a row past the projections reads the warp's first
        // (no other warp writes it), lanes past width read the last lane's.
        const auto leaves = [&](u32_t j) {
            const u32_t row = warp + WARPS * j < PROJECTIONS ? warp + WARPS * j : warp;
            return token_partials + row * k_chains + min(lane, width - 1) * per_lane;
        };
#pragma unroll
        for (u32_t j = 0; j < ROWS; ++j) {
            float* own = leaves(j);
            if (warp + WARPS * j < PROJECTIONS)  // no level below per_lane = 4
                for (u32_t half = 1; 2 * half < per_lane; half *= 2)
                    for (u32_t b = 0; b < per_lane; b += 2 * half) own[b] = __fadd_rn(own[b], own[b + half]);
        }
        float v[ROWS];
#pragma unroll
        for (u32_t j = 0; j < ROWS; ++j) {
            const float* own = leaves(j);
            const float top = per_lane > 1 ? __fadd_rn(own[0], own[per_lane / 2]) : own[0];
            v[j] = warp + WARPS * j < PROJECTIONS && lane < width ? top : 0.0f;
        }
        for (u32_t offset = 1; offset < width; offset *= 2) {
#pragma unroll
            for (u32_t j = 0; j < ROWS; ++j) v[j] = __fadd_rn(v[j], __shfl_down_sync(FULL_WARP, v[j], offset));
        }
#pragma unroll
        for (u32_t j = 0; j < ROWS; ++j)
            if (lane == 0 && warp + WARPS * j < PROJECTIONS) mixes[warp + WARPS * j] = __fmul_rn(v[j], inv);
    }
    __syncthreads();
    float* pre = out;
    float* post = out + HC;
    float* comb = out + 2 * HC;
    if (warp == 1 && lane < HC) {  // beside warp 0's comb
        pre[k] = __fadd_rn(refmath::sigmoid(__fadd_rn(__fmul_rn(mixes[k], scale_pre), pre_base)), p.hc_eps);
        post[k] = __fmul_rn(2.0f, refmath::sigmoid(__fadd_rn(__fmul_rn(mixes[HC + k], scale_post), post_base)));
    }
    if (warp != 0) return;
    // One warp from here (CombCells): every lane takes part in every shuffle.
    Comb c;
#pragma unroll
    for (u32_t r = 0; r < Comb::PER_LANE; ++r)
        c.v[r] = __fadd_rn(__fmul_rn(mixes[2 * HC + min(lane + 32 * r, Comb::CELLS - 1)], scale_comb), cell_base[r]);
    // Row softmax (+eps): the row's max and exps, then the row's sum of the exps.
    float next[Comb::PER_LANE];
#pragma unroll
    for (u32_t r = 0; r < Comb::PER_LANE; ++r)
        // The reference's standalone torch.exp here is correctly rounded (CPU: quant::exp_f32_accurate).
        next[r] = refmath::exp_accurate(__fsub_rn(c.v[r], c.row_max(row[r])));
#pragma unroll
    for (u32_t r = 0; r < Comb::PER_LANE; ++r) c.v[r] = next[r];
#pragma unroll
    for (u32_t r = 0; r < Comb::PER_LANE; ++r)
        next[r] = __fadd_rn(__fdiv_rn(c.v[r], c.line_sum<false>(row[r])), p.hc_eps);
#pragma unroll
    for (u32_t r = 0; r < Comb::PER_LANE; ++r) c.v[r] = next[r];
    // Column normalisation, then (iters - 1) row and column passes: cell /= (line sum + eps).
    const u32_t column_passes = p.sinkhorn_iters > 0 ? p.sinkhorn_iters : 1;  // the first is unconditional
    c.template normalise<true>(column, p.hc_eps);
    for (u32_t pass = 1; pass < column_passes; ++pass) {
        c.template normalise<false>(row, p.hc_eps);
        c.template normalise<true>(column, p.hc_eps);
    }
#pragma unroll
    for (u32_t r = 0; r < Comb::PER_LANE; ++r)
        if (lane + 32 * r < Comb::CELLS) comb[lane + 32 * r] = c.v[r];
}

__device__ void hc_mixes(const float* __restrict__ scratch, const float* __restrict__ base,
                         const float* __restrict__ scale, float* __restrict__ out, HcMixesParams p) {
    extern __shared__ float token_partials[];  // [tasks], staged with coalesced loads
    __shared__ float mixes[MAX_PROJECTIONS];
    with_const<1, MAX_HC>(p.hc, [&](auto hc) {
        hc_mixes_hc<decltype(hc)::value>(scratch, base, scale, out, p, token_partials, mixes);
    });
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
