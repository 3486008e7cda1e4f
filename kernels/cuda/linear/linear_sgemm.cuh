// Plain fp32 linear y[r, o] = sum_k x[r, k] * w[o, k] (w [out, inp] row-major) in the summation
// order of the reference's CPU sgemm (deepinfer-model quant::dot_f32_sgemm): K split into
// refmath::sgemm_chains(inp) equal chains, each a sequence of FMAs from 0, the chain partials
// added as the CPU's pairwise tree; with round_bf16, the order of its bf16 GEMM instead
// (quant::dot_bf16_gemm: chains of 32 products, added in K order) and the outputs rounded. Two kernels: linear_sgemm_partials computes every chain, one
// thread per (row, column, chain), from tiles of 256 K staged in shared memory (a block of
// threads covers TILE_ROWS rows x TILE_COLS columns of one chain: the weight tile is read once,
// coalesced, for all its rows); linear_sgemm_reduce adds each output's partials in the CPU's tree.
// Which thread runs a chain never changes its order, so the result is bit-identical to the CPU
// reference and a row's values never depend on the number of rows (batch invariant). Outputs stay
// in f32 storage.
#pragma once
#include "common/reference_math.cuh"

namespace linear {

constexpr int THREADS = 256;
constexpr u32_t TILE_ROWS = THREADS / 32;  // one warp per row of the tile
constexpr u32_t TILE_COLS = 32;            // one lane per column
constexpr u32_t TILE_K = refmath::SGEMM_MIN_CHAIN;  // K values of a chain staged per pass

// The chains of a dot product of `inp` products: the sgemm order's, or with bf16_order the bf16
// GEMM's (refmath::BF16_GEMM_K_BLOCK products each).
__device__ __forceinline__ u32_t chain_count(u32_t inp, bool bf16_order) {
    return bf16_order ? (inp + refmath::BF16_GEMM_K_BLOCK - 1) / refmath::BF16_GEMM_K_BLOCK : refmath::sgemm_chains(inp);
}

__device__ __forceinline__ u32_t chain_start(u32_t chain, u32_t inp, bool bf16_order) {
    return bf16_order ? min(chain * refmath::BF16_GEMM_K_BLOCK, inp)
                      : refmath::sgemm_chain_start(chain, inp, refmath::sgemm_chains(inp));
}

// One tile's FMA chains of one chain of K: TILE_ROWS rows x TILE_COLS columns (threads past
// `rows` or `out` idle), the weight tile (w_at(c, k): column col0 + c, input k) and the input tile
// (x_at(r, k): tile row r) staged in shared memory TILE_K at a time (a chain is shorter than
// 2 * TILE_K); partials[(chain * partial_rows + out_row(r)) * out + col0 + c] is the chain of tile
// row r and column col0 + c.
template <class XAt, class WAt, class OutRow>
__device__ __forceinline__ void sgemm_tile_partials(XAt x_at, WAt w_at, OutRow out_row, u32_t rows, u32_t col0,
                                                    u32_t chain, u32_t out, u32_t inp, u32_t partial_rows,
                                                    bool bf16_order, float* __restrict__ partials) {
    __shared__ float w_tile[TILE_COLS][TILE_K + 1];
    __shared__ float x_tile[TILE_ROWS][TILE_K];
    const u32_t end = chain_start(chain + 1, inp, bf16_order);
    const u32_t r = threadIdx.x / 32;
    const u32_t c = threadIdx.x % 32;
    const bool active = r < rows && col0 + c < out;
    // quant::dot_f32_sgemm's chain: acc = fma(x[k], w[k], acc) for k in order, from 0.
    float acc = 0.0f;
    for (u32_t start = chain_start(chain, inp, bf16_order); start < end; start += TILE_K) {
        const u32_t len = min(TILE_K, end - start);
        // Coalesced loads: consecutive threads read consecutive k of one weight (or input) row.
#pragma unroll 8
        for (u32_t i = threadIdx.x; i < TILE_COLS * TILE_K; i += THREADS) {
            const u32_t tc = i / TILE_K;
            const u32_t k = i % TILE_K;
            w_tile[tc][k] = (col0 + tc < out && k < len) ? w_at(tc, start + k) : 0.0f;
        }
#pragma unroll 8
        for (u32_t i = threadIdx.x; i < TILE_ROWS * TILE_K; i += THREADS) {
            const u32_t tr = i / TILE_K;
            const u32_t k = i % TILE_K;
            x_tile[tr][k] = (tr < rows && k < len) ? x_at(tr, start + k) : 0.0f;
        }
        __syncthreads();
        if (active) {
#pragma unroll 16
            for (u32_t k = 0; k < len; ++k) acc = __fmaf_rn(x_tile[r][k], w_tile[c][k], acc);
        }
        __syncthreads();
    }
    if (active) partials[((size_t)chain * partial_rows + out_row(r)) * out + col0 + c] = acc;
}

// Grid (ceil(out / TILE_COLS), chains, ceil(rows / TILE_ROWS)). partials[b][r][o] (b-major, so the
// reducer reads them coalesced) is chain b's FMA chain of output (r, o).
__device__ void linear_sgemm_partials(const float* __restrict__ x, const float* __restrict__ w,
                                      float* __restrict__ partials, LinearParams p) {
    const u32_t col0 = blockIdx.x * TILE_COLS;
    const u32_t row0 = blockIdx.z * TILE_ROWS;
    const auto x_at = [&](u32_t r, u32_t k) { return __ldg(x + (size_t)(row0 + r) * p.inp + k); };
    const auto w_at = [&](u32_t c, u32_t k) { return __ldg(w + (size_t)(col0 + c) * p.inp + k); };
    const auto out_row = [&](u32_t r) { return row0 + r; };
    sgemm_tile_partials(x_at, w_at, out_row, min(TILE_ROWS, p.rows - row0), col0, blockIdx.y, p.out, p.inp,
                        p.rows, p.round_bf16 != 0, partials);
}

// One thread per output: its chain partials pushed in K order into the CPU's pairwise tree (the
// bf16 order: added in K order, then rounded to bf16).
__device__ void linear_sgemm_reduce(const float* __restrict__ partials, float* __restrict__ y, LinearParams p) {
    const size_t outputs = (size_t)p.rows * p.out;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= outputs) return;
    if (p.round_bf16) {
        const u32_t chains = chain_count(p.inp, true);
        float v = 0.0f;
        for (u32_t b = 0; b < chains; ++b) v = __fadd_rn(v, partials[(size_t)b * outputs + i]);
        y[i] = round_bf16_f32(v);
        return;
    }
    const u32_t chains = refmath::sgemm_chains(p.inp);
    refmath::PairwiseSum sum;
    for (u32_t b = 0; b < chains; ++b) sum.push(partials[(size_t)b * outputs + i]);
    y[i] = sum.finish();
}

// Weight values dequantised to f32 (exact: code value times a power of two), as the CPU reference's
// fp32 linears over FP8 / FP4 weights expand them (Backend::linear_fp8_f32 / linear_fp4_f32):
// value (row, col) of a [rows, k] weight; FP8 with square `tile` x `tile` scales (`scale_cols` per
// scale row), FP4 packed two per byte (low nibble first) with 1 x 32 scales.
__device__ __forceinline__ float fp8_weight(const u8_t* __restrict__ codes, const u8_t* __restrict__ scales, u32_t row,
                                            u32_t col, u32_t k, u32_t tile, u32_t scale_cols) {
    const float scale = e8m0_decode(scales[(size_t)(row / tile) * scale_cols + col / tile]);
    return __fmul_rn(e4m3_decode(codes[(size_t)row * k + col]), scale);
}

__device__ __forceinline__ float fp4_weight(const u8_t* __restrict__ packed, const u8_t* __restrict__ scales, u32_t row,
                                            u32_t col, u32_t k, u32_t scale_cols) {
    const u8_t byte = packed[(size_t)row * (k / 2) + col / 2];
    const u32_t nibble = (col % 2 == 0) ? (byte & 0x0fu) : (byte >> 4);
    const float scale = e8m0_decode(scales[(size_t)row * scale_cols + col / 32]);
    return __fmul_rn(e2m1_decode(nibble), scale);
}

// Rows row_start .. row_start + rows of a weight, dequantised.
__device__ void dequant_fp8_rows(const u8_t* __restrict__ codes, const u8_t* __restrict__ scales,
                                 float* __restrict__ out, DequantParams p) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)p.rows * p.k) return;
    out[i] = fp8_weight(codes, scales, p.row_start + (u32_t)(i / p.k), (u32_t)(i % p.k), p.k, p.tile, p.scale_cols);
}

__device__ void dequant_fp4_rows(const u8_t* __restrict__ packed, const u8_t* __restrict__ scales,
                                 float* __restrict__ out, DequantParams p) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)p.rows * p.k) return;
    out[i] = fp4_weight(packed, scales, p.row_start + (u32_t)(i / p.k), (u32_t)(i % p.k), p.k, p.scale_cols);
}

}  // namespace linear
