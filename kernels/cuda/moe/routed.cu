// The routed experts of an MoE layer on the device, driven by device routes (no copy to the host),
// operation for operation as deepinfer-model's v41::moe::forward_rows / expert:
// - group_routed_rows: output rows bucketed by expert on the device (ids >= the expert count in a
//   last bucket) and cut into tiles of at most tile_rows rows of one expert.
// - gemm_*_routed_{rows,tiles}: one block per (output row or tile, column block): output row j =
//   x row (j / x_row_div) times the weight of expert experts[j], the block-scaled GEMM body of
//   gemm/gemm_block_scaled.cuh on the block's gathered rows (rows never interact, so every row is
//   bitwise what gemm_fp4 / gemm_fp8 gives for it, whichever rows share its block); rows of
//   unknown ids are zero. `rows` takes one row per block from the routes (decode: rows rarely
//   share an expert), `tiles` the tiles of group_routed_rows (up to 8 rows of one expert).
// - gemm_*_routed_experts: one block per (tile of up to 32 rows of one expert, 8 output columns),
//   one warp per column, one k-group of 32 per lane: the warp loads EXPERT_STEPS * 32 k-groups of
//   its weight row at once (coalesced 16-byte FP4 / 32-byte FP8 loads, all in flight together),
//   decodes each group once and uses it for every row of the tile, so an expert's weights are
//   read once per launch for up to 32 rows. Same partials, same K-ordered sums as the dense GEMM.
// - gemm_exact_routed_partials_f32: the fp32 experts of V4 (v4::Linear: dense f32, FP8 or FP4
//   weights dequantised exactly, activations unquantised), one block per (tile of up to 8 rows
//   of one expert, 32 columns, sgemm chain of K): linear_sgemm's FMA chains with the tile's expert
//   weights; linear_sgemm_reduce adds the chain partials in the CPU's pairwise tree, so every
//   row is bitwise what the fp32 linear gives for it.
// - swiglu_exact_rows_f32 (f32 in): clamps, g / (1 + exp_f32(-g)) * u, times the row's route
//   weight, rounded, stored as f32 (V4's exact experts, unquantised).
// - swiglu_act_quant_fp8_g32_{bf16,f32}: the same SwiGLU values, quantised in the same kernel as
//   act_quant_fp8<32> quantises them once stored (quant/act_quant.cuh): the FP8 activations of
//   w2 with no f32 hidden rows in memory.
// - moe_combine_f32 (bf16 in) / moe_combine_exact_f32 (f32 in): a token's slot outputs added in
//   increasing expert id (equal ids in slot order, ids >= the expert count skipped), then the
//   shared expert, then one rounding.
#include "common/grid_dependency.cuh"
#include "gemm/gemm_block_scaled.cuh"
#include "linear/linear_sgemm.cuh"
#include "common/reference_math.cuh"
#include "quant/act_quant.cuh"

typedef unsigned long long u64_t;

namespace routed {

// Launch parameters of the routed GEMM (mirrored by kernels/src/ops/routed.rs).
struct RoutedGemmParams {
    u32_t m;              // output rows (experts[m])
    u32_t n;              // output columns (the projection's out features)
    u32_t k;              // input columns
    u32_t w_scale_cols;   // weight-scale row stride
    u32_t warps_per_col;  // 1, 2, 4 or 8 (no effect on the result)
    u32_t x_row_div;      // output row j reads x row j / x_row_div
    u32_t n_experts;      // experts in the table
    u32_t which;          // table slot: 0 w1, 1 w3, 2 w2
};

// SwiGLU of gate/up rows (mirrored by kernels/src/ops/routed.rs).
struct SwigluParams {
    u32_t n;            // values
    u32_t inter;        // values per row (the route weight's row); n when there are no weights
    u32_t has_weights;  // 1: multiply by weights[i / inter]
    float limit;        // > 0: clamp g from above and u to [-limit, limit]
    u32_t round_bf16;   // 1: outputs rounded to bf16
};

// Combine of k slot outputs and the shared expert per token (mirrored by kernels/src/ops/routed.rs).
struct CombineParams {
    u32_t rows;
    u32_t k;
    u32_t dim;
    u32_t n_experts;
    u32_t round_bf16;
};

// The exact fp32 routed GEMM (mirrored by kernels/src/ops/routed_exact.rs).
struct ExactRoutedParams {
    u32_t m;           // output rows (experts[m])
    u32_t n;           // output columns
    u32_t k;           // input columns
    u32_t format;      // EXACT_F32, EXACT_FP8 or EXACT_FP4
    u32_t tile;        // FP8: square scale tile
    u32_t scale_cols;  // FP8 / FP4: scales per scale row
    u32_t x_row_div;   // output row j reads x row j / x_row_div
    u32_t n_experts;   // experts in the table
    u32_t which;       // table slot: 0 w1, 1 w3, 2 w2
};

constexpr u32_t EXACT_F32 = 0;
constexpr u32_t EXACT_FP8 = 1;
constexpr u32_t EXACT_FP4 = 2;

// Grouping of output rows by expert (mirrored by kernels/src/ops/routed.rs).
struct GroupParams {
    u32_t m;          // output rows
    u32_t n_experts;  // buckets 0 .. n_experts - 1, and n_experts for unknown ids
    u32_t tile_rows;  // rows per tile at most: TILE_ROWS or EXPERT_TILE_ROWS
};

constexpr u32_t TILE_ROWS = 8;
constexpr u32_t EXPERT_TILE_ROWS = 32;
constexpr u32_t EXPERT_STEPS = 5;
constexpr u32_t EXPERT_PARTIAL_STRIDE = 33;  // floats per (warp, tile row): 32 partials + padding
constexpr u32_t GROUP_THREADS = 1024;
constexpr u32_t MAX_SLOTS = 64;
constexpr u32_t COMBINE_THREADS = 256;

// A tile's gathered rows: tile row r reads x row rows[r] / x_row_div and writes output row rows[r].
template <u32_t ROWS>
struct GatheredRows {
    u32_t rows[ROWS];
    u32_t count;
    u32_t x_row_div;
    __device__ __forceinline__ size_t a_row(u32_t r) const { return rows[r] / x_row_div; }
    __device__ __forceinline__ size_t y_row(u32_t r) const { return rows[r]; }
};

// One block: counts per bucket, then (warp 0, 32 buckets at a time with a warp scan) bucket
// offsets and the tiles {bucket, start, count} of at most p.tile_rows rows in bucket order, then
// every row scattered into `order` at its bucket's cursor. The order inside a bucket is arbitrary
// (atomics): no result depends on it.
__device__ void group_rows(const u32_t* __restrict__ experts, u32_t* __restrict__ order,
                           u32_t* __restrict__ tiles, u32_t* __restrict__ tile_count, GroupParams p) {
    extern __shared__ u32_t group_shared[];
    const u32_t buckets = p.n_experts + 1;
    u32_t* counts = group_shared;           // [buckets]
    u32_t* cursor = group_shared + buckets;  // [buckets]
    for (u32_t b = threadIdx.x; b < buckets; b += blockDim.x) counts[b] = 0;
    __syncthreads();
    for (u32_t j = threadIdx.x; j < p.m; j += blockDim.x) atomicAdd(&counts[min(experts[j], p.n_experts)], 1u);
    __syncthreads();
    if (threadIdx.x < 32) {
        const u32_t lane = threadIdx.x;
        u32_t offset = 0;  // rows of the buckets before this chunk
        u32_t tile = 0;    // tiles of the buckets before this chunk
        for (u32_t b0 = 0; b0 < buckets; b0 += 32) {
            const u32_t b = b0 + lane;
            const u32_t c = b < buckets ? counts[b] : 0u;
            const u32_t own_tiles = (c + p.tile_rows - 1) / p.tile_rows;
            u32_t rows_incl = c, tiles_incl = own_tiles;
#pragma unroll
            for (u32_t d = 1; d < 32; d <<= 1) {
                const u32_t rows_up = __shfl_up_sync(0xffffffffu, rows_incl, d);
                const u32_t tiles_up = __shfl_up_sync(0xffffffffu, tiles_incl, d);
                if (lane >= d) {
                    rows_incl += rows_up;
                    tiles_incl += tiles_up;
                }
            }
            const u32_t start = offset + rows_incl - c;
            u32_t t = tile + tiles_incl - own_tiles;
            if (b < buckets) cursor[b] = start;
            for (u32_t s = 0; s < c; s += p.tile_rows, ++t) {
                tiles[3 * t] = b;
                tiles[3 * t + 1] = start + s;
                tiles[3 * t + 2] = min(p.tile_rows, c - s);
            }
            offset += __shfl_sync(0xffffffffu, rows_incl, 31);
            tile += __shfl_sync(0xffffffffu, tiles_incl, 31);
        }
        if (lane == 0) *tile_count = tile;
    }
    __syncthreads();
    for (u32_t j = threadIdx.x; j < p.m; j += blockDim.x) {
        const u32_t at = atomicAdd(&cursor[min(experts[j], p.n_experts)], 1u);
        order[at] = j;
    }
}

// One block's tile of `bucket`'s rows: the GEMM body with that expert's weights, or zeros for the
// bucket of unknown ids (the CPU drops them). table: [3][n_experts][2] device addresses (weight
// codes, weight scales) of w1, w3, w2.
// COLUMN_PER_WARP: gemm_warp_tile (one warp per column; the launcher sets warps_per_col = 1, so
// a block covers gemm::WARPS columns), else gemm_block_tile; the same sums in the same order.
template <class Weights, u32_t ROWS, bool COLUMN_PER_WARP>
__device__ __forceinline__ void gemm_routed_tile(const u8_t* __restrict__ a, const float* __restrict__ sa,
                                                 const u64_t* __restrict__ table, __nv_bfloat16* __restrict__ y,
                                                 RoutedGemmParams p, u32_t bucket, const GatheredRows<ROWS>& tile) {
    const u32_t cols_per_block = gemm::WARPS / p.warps_per_col;
    if (bucket >= p.n_experts) {
        for (u32_t i = threadIdx.x; i < tile.count * cols_per_block; i += blockDim.x) {
            const u32_t col = blockIdx.y * cols_per_block + i % cols_per_block;
            if (col < p.n) y[tile.y_row(i / cols_per_block) * p.n + col] = __float2bfloat16_rn(0.0f);
        }
        return;
    }
    const u64_t* entry = table + ((size_t)p.which * p.n_experts + bucket) * 2;
    const u8_t* w = reinterpret_cast<const u8_t*>(entry[0]);
    const u8_t* ws = reinterpret_cast<const u8_t*>(entry[1]);
    const GemmParams shape{p.m, p.n, p.k, p.w_scale_cols, p.warps_per_col};
    if constexpr (COLUMN_PER_WARP) {
        gemm::gemm_warp_tile<Weights, 32, (int)ROWS>(a, sa, w, ws, y, shape, tile, blockIdx.y);
    } else {
        gemm::gemm_block_tile<Weights, 32, (int)ROWS>(a, sa, w, ws, y, shape, tile, blockIdx.y);
    }
}

// One output row per block (blockIdx.x), straight from the routes: best when rows rarely share
// an expert (decode). One warp per output column (gemm_warp_tile: at one row the faster body).
template <class Weights>
__device__ void gemm_routed_rows(const u8_t* __restrict__ a, const float* __restrict__ sa,
                                 const u32_t* __restrict__ experts, const u64_t* __restrict__ table,
                                 __nv_bfloat16* __restrict__ y, RoutedGemmParams p) {
    const u32_t row = blockIdx.x;
    GatheredRows<1> tile;
    tile.rows[0] = row;
    tile.count = 1;
    tile.x_row_div = p.x_row_div;
    gemm_routed_tile<Weights, 1, true>(a, sa, table, y, p, experts[row], tile);
}

// One tile of group_rows per block (blockIdx.x; blocks past *tile_count return): up to TILE_ROWS
// rows of one expert share each weight load and decode.
template <class Weights>
__device__ void gemm_routed_tiles(const u8_t* __restrict__ a, const float* __restrict__ sa,
                                  const u32_t* __restrict__ order, const u32_t* __restrict__ tiles,
                                  const u32_t* __restrict__ tile_count, const u64_t* __restrict__ table,
                                  __nv_bfloat16* __restrict__ y, RoutedGemmParams p) {
    const u32_t t = blockIdx.x;
    if (t >= *tile_count) return;
    const u32_t start = tiles[3 * t + 1];
    GatheredRows<TILE_ROWS> tile;
    tile.count = tiles[3 * t + 2];  // 1 .. TILE_ROWS
    tile.x_row_div = p.x_row_div;
#pragma unroll
    for (u32_t r = 0; r < TILE_ROWS; ++r) tile.rows[r] = order[start + min(r, tile.count - 1)];
    gemm_routed_tile<Weights, TILE_ROWS, false>(a, sa, table, y, p, tiles[3 * t], tile);
}

// One block per (tile of group_rows with up to EXPERT_TILE_ROWS rows of one expert, blockIdx.x;
// blocks past *tile_count return) and WARPS output columns (blockIdx.y): warp w computes column
// blockIdx.y * WARPS + w for every row of the tile. Lane l takes k-group g0 + 32 s + l of each of
// the EXPERT_STEPS steps of a chunk: the chunk's weight loads (and scales) are issued together,
// then per step the lane decodes its group's 32 weights once, and for each tile row computes the
// group's exact partial RN_f32(sum of 32 exact products), scales it (partial * s_a) * s_w into
// shared memory, and lane r adds row r's 32 partials in K order to its accumulator, from 0.0f:
// the additions of gemm_block_tile / gemm_warp_tile and the reference, in their order.
template <class Weights>
__device__ void gemm_routed_experts(const u8_t* __restrict__ a, const float* __restrict__ sa,
                                    const u32_t* __restrict__ order, const u32_t* __restrict__ tiles,
                                    const u32_t* __restrict__ tile_count, const u64_t* __restrict__ table,
                                    __nv_bfloat16* __restrict__ y, RoutedGemmParams p) {
    extern __shared__ float expert_partials[];  // [WARPS][tile rows][EXPERT_PARTIAL_STRIDE]
    const u32_t t = blockIdx.x;
    if (t >= *tile_count) return;
    const u32_t bucket = tiles[3 * t];
    const u32_t start = tiles[3 * t + 1];
    const u32_t count = min(tiles[3 * t + 2], EXPERT_TILE_ROWS);
    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    const u32_t n = blockIdx.y * gemm::WARPS + warp;
    if (n >= p.n) return;  // whole warps; no block-wide barrier follows
    // Lane r < count holds tile row r's output row.
    const u32_t own_row = lane < count ? order[start + lane] : 0u;
    if (bucket >= p.n_experts) {
        if (lane < count) y[(size_t)own_row * p.n + n] = __float2bfloat16_rn(0.0f);
        return;
    }
    const u64_t* entry = table + ((size_t)p.which * p.n_experts + bucket) * 2;
    const u8_t* w = reinterpret_cast<const u8_t*>(entry[0]);
    const u8_t* ws = reinterpret_cast<const u8_t*>(entry[1]);
    float* partials = expert_partials + (size_t)warp * count * EXPERT_PARTIAL_STRIDE;
    const u32_t kgroups = p.k / 32;
    float acc = 0.0f;  // lane r < count: row r's sum
    for (u32_t g0 = 0; g0 < kgroups; g0 += 32 * EXPERT_STEPS) {
        typename Weights::Raw raw[EXPERT_STEPS];
        float sw[EXPERT_STEPS];
#pragma unroll
        for (u32_t s = 0; s < EXPERT_STEPS; ++s) {
            const u32_t g = g0 + 32 * s + lane;
            if (g < kgroups) raw[s] = Weights::fetch32(w, n, p.k, g * 32);
        }
#pragma unroll
        for (u32_t s = 0; s < EXPERT_STEPS; ++s) {
            const u32_t g = g0 + 32 * s + lane;
            sw[s] = g < kgroups ? Weights::scale(ws, n, g * 32, p.w_scale_cols) : 0.0f;
        }
#pragma unroll
        for (u32_t s = 0; s < EXPERT_STEPS; ++s) {
            const u32_t base = g0 + 32 * s;
            if (base >= kgroups) break;  // uniform over the warp
            const u32_t g = base + lane;
            const bool active = g < kgroups;
            float wv[32];
            if (active) Weights::decode32(raw[s], wv);
#pragma unroll 1
            for (u32_t r = 0; r < count; ++r) {
                const size_t a_row = __shfl_sync(0xffffffffu, own_row, r) / p.x_row_div;
                if (active) {
                    const uint4* src = reinterpret_cast<const uint4*>(a + a_row * p.k + (size_t)g * 32);
                    float av[32];
                    gemm::decode_e4m3x16(__ldg(src), av);
                    gemm::decode_e4m3x16(__ldg(src + 1), av + 16);
                    float hi, lo;
                    Weights::dot32(av, wv, hi, lo);
                    const float act_scale = __ldg(sa + a_row * kgroups + g);
                    const float partial = Weights::unscale(__fadd_rn(hi, lo));
                    partials[r * EXPERT_PARTIAL_STRIDE + lane] = __fmul_rn(__fmul_rn(partial, act_scale), sw[s]);
                }
            }
            __syncwarp();
            if (lane < count) {
                const u32_t valid = min(32u, kgroups - base);
                const float* src = partials + lane * EXPERT_PARTIAL_STRIDE;
#pragma unroll
                for (u32_t j = 0; j < 32; ++j) {
                    if (j < valid) acc = __fadd_rn(acc, src[j]);
                }
            }
            __syncwarp();  // the partials are rewritten by the next step
        }
    }
    if (lane < count) y[(size_t)own_row * p.n + n] = __float2bfloat16_rn(acc);
}

}  // namespace routed

extern "C" __global__ void __launch_bounds__(routed::GROUP_THREADS)
    group_routed_rows(const u32_t* experts, u32_t* order, u32_t* tiles, u32_t* tile_count,
                      routed::GroupParams p) {
    grid_dependency_sync();
    routed::group_rows(experts, order, tiles, tile_count, p);
}

#define ROUTED_GEMM(ROWS_NAME, TILES_NAME, WEIGHTS)                                                    \
    extern "C" __global__ void __launch_bounds__(gemm::WARPS * 32, 3)                                  \
        ROWS_NAME(const u8_t* a, const float* sa, const u32_t* experts, const u64_t* table,            \
                  __nv_bfloat16* y, routed::RoutedGemmParams p) {                                     \
        grid_dependency_sync();                                                                       \
        routed::gemm_routed_rows<WEIGHTS>(a, sa, experts, table, y, p);                               \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(gemm::WARPS * 32, 3)                                  \
        TILES_NAME(const u8_t* a, const float* sa, const u32_t* order, const u32_t* tiles,             \
                   const u32_t* tile_count, const u64_t* table, __nv_bfloat16* y,                     \
                   routed::RoutedGemmParams p) {                                                      \
        grid_dependency_sync();                                                                       \
        routed::gemm_routed_tiles<WEIGHTS>(a, sa, order, tiles, tile_count, table, y, p);             \
    }

#define ROUTED_EXPERTS_GEMM(NAME, WEIGHTS)                                                              \
    extern "C" __global__ void __launch_bounds__(gemm::WARPS * 32)                                     \
        NAME(const u8_t* a, const float* sa, const u32_t* order, const u32_t* tiles,                   \
             const u32_t* tile_count, const u64_t* table, __nv_bfloat16* y, routed::RoutedGemmParams p) { \
        grid_dependency_sync();                                                                           \
        routed::gemm_routed_experts<WEIGHTS>(a, sa, order, tiles, tile_count, table, y, p);            \
    }

ROUTED_EXPERTS_GEMM(gemm_fp4_routed_experts_g32_bf16, gemm::Fp4Weights)
ROUTED_EXPERTS_GEMM(gemm_fp8_t32_routed_experts_g32_bf16, gemm::Fp8Weights<32>)

ROUTED_GEMM(gemm_fp4_routed_rows_g32_bf16, gemm_fp4_routed_tiles_g32_bf16, gemm::Fp4Weights)
ROUTED_GEMM(gemm_fp8_t32_routed_rows_g32_bf16, gemm_fp8_t32_routed_tiles_g32_bf16, gemm::Fp8Weights<32>)

namespace routed {

// Grid (tiles of group_rows with up to linear::TILE_ROWS rows, blocks past *tile_count return;
// ceil(n / 32) column blocks; refmath::sgemm_chains(k) chains of K). The tile's expert weights (table: [3][n_experts][2]
// addresses, codes then scales; dense f32 weights in the codes slot) dequantised exactly into the
// shared tile; the bucket of unknown ids computes with zero weights (the combine skips those rows).
__device__ void gemm_exact_routed_partials(const float* __restrict__ x, const u32_t* __restrict__ order,
                                           const u32_t* __restrict__ tiles, const u32_t* __restrict__ tile_count,
                                           const u64_t* __restrict__ table, float* __restrict__ partials,
                                           ExactRoutedParams p) {
    const u32_t t = blockIdx.x;
    if (t >= *tile_count) return;
    const u32_t bucket = tiles[3 * t];
    const u32_t start = tiles[3 * t + 1];
    const u32_t count = min(tiles[3 * t + 2], linear::TILE_ROWS);
    u32_t rows[linear::TILE_ROWS];
#pragma unroll
    for (u32_t r = 0; r < linear::TILE_ROWS; ++r) rows[r] = order[start + min(r, count - 1)];
    const bool known = bucket < p.n_experts;
    const u64_t* entry = table + ((size_t)p.which * p.n_experts + (known ? bucket : 0)) * 2;
    const u8_t* codes = reinterpret_cast<const u8_t*>(entry[0]);
    const u8_t* scales = reinterpret_cast<const u8_t*>(entry[1]);
    const u32_t col0 = blockIdx.y * linear::TILE_COLS;
    const auto x_at = [&](u32_t r, u32_t k) { return __ldg(x + (size_t)(rows[r] / p.x_row_div) * p.k + k); };
    const auto w_at = [&](u32_t c, u32_t k) -> float {
        if (!known) return 0.0f;
        const u32_t row = col0 + c;
        if (p.format == EXACT_FP8) return linear::fp8_weight(codes, scales, row, k, p.k, p.tile, p.scale_cols);
        if (p.format == EXACT_FP4) return linear::fp4_weight(codes, scales, row, k, p.k, p.scale_cols);
        return __ldg(reinterpret_cast<const float*>(codes) + (size_t)row * p.k + k);
    };
    const auto out_row = [&](u32_t r) { return rows[r]; };
    linear::sgemm_tile_partials(x_at, w_at, out_row, count, col0, blockIdx.z, p.n, p.k, p.m, false, partials);
}

__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(float v) { return v; }

// v41::moe::expert's hidden value of element i from its gate g and up u: (g, u) clamped when
// limit > 0 (g.min(limit): a NaN g becomes limit; u.clamp(-limit, limit): NaN stays NaN),
// g / (1 + exp_f32(-g)) * u, times the route weight weights[i / inter], rounded.
__device__ __forceinline__ float swiglu_value(float g, float u, const float* __restrict__ weights, u32_t i,
                                              const SwigluParams& p) {
    if (p.limit > 0.0f) {
        g = fminf(g, p.limit);
        if (u < -p.limit) u = -p.limit;
        if (u > p.limit) u = p.limit;
    }
    float v = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, refmath::exp_f32(-g))), u);
    if (p.has_weights) v = __fmul_rn(weights[i / p.inter], v);
    return p.round_bf16 ? round_bf16_f32(v) : v;
}

template <class T>
__device__ void swiglu_rows(const T* __restrict__ gate, const T* __restrict__ up, const float* __restrict__ weights,
                            float* __restrict__ out, SwigluParams p) {
    for (u32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += gridDim.x * blockDim.x)
        out[i] = swiglu_value(widen(gate[i]), widen(up[i]), weights, i, p);
}

// swiglu_rows of the [q.rows, q.cols] hidden rows (p.n = rows * cols, p.inter = cols) quantised
// in 32-groups without storing them: warp w takes elements [128 w, 128 w + 128) as
// act_quant_fp8 does, each lane computes its 4 values by swiglu_value (the f32 values
// swiglu_rows would store) and quantises them by act_quant_lane (as act_quant_fp8<32> would
// after loading them), so codes and scales are bitwise those of the two kernels.
template <class T>
__device__ void swiglu_act_quant(const T* __restrict__ gate, const T* __restrict__ up,
                                 const float* __restrict__ weights, u8_t* __restrict__ codes,
                                 float* __restrict__ scales, SwigluParams p, ActQuantParams q) {
    unsigned long long base;
    bool valid;
    if (!act_quant_span((unsigned long long)q.rows * q.cols, base, valid)) return;
    float v[ACT_QUANT_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (valid) {
        const float4 g = load4_f32(gate, base);
        const float4 u = load4_f32(up, base);
        const u32_t i = (u32_t)base;  // < p.n, a u32
        v[0] = swiglu_value(g.x, u.x, weights, i, p);
        v[1] = swiglu_value(g.y, u.y, weights, i + 1, p);
        v[2] = swiglu_value(g.z, u.z, weights, i + 2, p);
        v[3] = swiglu_value(g.w, u.w, weights, i + 3, p);
    }
    act_quant_lane<32>(v, valid, base, codes, scales);
}

// One block per token (blockIdx.x) and COMBINE_THREADS columns (blockIdx.y): the token's valid
// slots sorted by (expert id, slot) once, then every column adds them in that order from 0.0f,
// adds the shared expert and rounds once.
template <class T>
__device__ void combine(const T* __restrict__ slot_out, const u32_t* __restrict__ experts,
                        const T* __restrict__ shared_out, float* __restrict__ out, CombineParams p) {
    __shared__ u32_t order[MAX_SLOTS];
    __shared__ u32_t count;
    const u32_t row = blockIdx.x;
    if (threadIdx.x == 0) {
        u32_t c = 0;
        for (u32_t s = 0; s < p.k; ++s) {
            const u32_t id = experts[(size_t)row * p.k + s];
            if (id >= p.n_experts) continue;
            // Stable insertion: after every slot whose id is <= this one.
            u32_t at = c;
            while (at > 0 && experts[(size_t)row * p.k + order[at - 1]] > id) {
                order[at] = order[at - 1];
                --at;
            }
            order[at] = s;
            ++c;
        }
        count = c;
    }
    __syncthreads();
    const u32_t col = blockIdx.y * COMBINE_THREADS + threadIdx.x;
    if (col >= p.dim) return;
    float acc = 0.0f;
    for (u32_t i = 0; i < count; ++i)
        acc = __fadd_rn(acc, widen(slot_out[((size_t)row * p.k + order[i]) * p.dim + col]));
    acc = __fadd_rn(acc, widen(shared_out[(size_t)row * p.dim + col]));
    out[(size_t)row * p.dim + col] = p.round_bf16 ? round_bf16_f32(acc) : acc;
}

}  // namespace routed

extern "C" __global__ void __launch_bounds__(linear::THREADS)
    gemm_exact_routed_partials_f32(const float* x, const u32_t* order, const u32_t* tiles, const u32_t* tile_count,
                                   const u64_t* table, float* partials, routed::ExactRoutedParams p) {
    grid_dependency_sync();
    routed::gemm_exact_routed_partials(x, order, tiles, tile_count, table, partials, p);
}

extern "C" __global__ void swiglu_exact_rows_f32(const float* gate, const float* up, const float* weights, float* out,
                                                 routed::SwigluParams p) {
    grid_dependency_sync();
    routed::swiglu_rows(gate, up, weights, out, p);
}

extern "C" __global__ void swiglu_act_quant_fp8_g32_bf16(const __nv_bfloat16* gate, const __nv_bfloat16* up,
                                                        const float* weights, u8_t* codes, float* scales,
                                                        routed::SwigluParams p, ActQuantParams q) {
    grid_dependency_sync();
    routed::swiglu_act_quant(gate, up, weights, codes, scales, p, q);
}

extern "C" __global__ void swiglu_act_quant_fp8_g32_f32(const float* gate, const float* up, const float* weights,
                                                       u8_t* codes, float* scales, routed::SwigluParams p,
                                                       ActQuantParams q) {
    grid_dependency_sync();
    routed::swiglu_act_quant(gate, up, weights, codes, scales, p, q);
}

extern "C" __global__ void __launch_bounds__(routed::COMBINE_THREADS)
    moe_combine_f32(const __nv_bfloat16* slot_out, const u32_t* experts, const __nv_bfloat16* shared_out, float* out,
                    routed::CombineParams p) {
    grid_dependency_sync();
    routed::combine(slot_out, experts, shared_out, out, p);
}

extern "C" __global__ void __launch_bounds__(routed::COMBINE_THREADS)
    moe_combine_exact_f32(const float* slot_out, const u32_t* experts, const float* shared_out, float* out,
                          routed::CombineParams p) {
    grid_dependency_sync();
    routed::combine(slot_out, experts, shared_out, out, p);
}
