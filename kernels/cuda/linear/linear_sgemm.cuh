// Plain fp32 linear y[r, o] = sum_k x[r, k] * w[o, k] (w [out, inp] row-major) in the summation
// order of the reference's CPU sgemm (deepinfer-model quant::dot_f32_sgemm): sequential FMAs inside
// each block of 256 products, the block partials added as the CPU's pairwise tree. One warp per
// output element: lane j runs the FMA chains of 256-blocks j, j + 32, ... (independent chains),
// then lane 0 adds the partials in the CPU's tree. Bit-identical to the CPU reference, and a row's
// values never depend on the number of rows (batch invariant). With round_bf16 the outputs are
// rounded to bf16 (kept in f32 storage). Correctness first: each 256-chain is serial.
#pragma once
#include "common/reference_math.cuh"

namespace linear {

constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
constexpr u32_t MAX_BLOCKS = 256;  // inp <= 65536 (checked by the launcher)

__device__ void linear_sgemm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                             LinearParams p) {
    __shared__ float partials[WARPS][MAX_BLOCKS];
    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    const unsigned long long i = (unsigned long long)blockIdx.x * WARPS + warp;  // output index
    if (i >= (unsigned long long)p.rows * p.out) return;  // whole warps leave together
    const u32_t row = (u32_t)(i / p.out);
    const u32_t col = (u32_t)(i % p.out);
    const float* xr = x + (size_t)row * p.inp;
    const float* wr = w + (size_t)col * p.inp;
    const u32_t blocks = (p.inp + refmath::SGEMM_K_BLOCK - 1) / refmath::SGEMM_K_BLOCK;
    for (u32_t b = lane; b < blocks; b += 32) {
        const u32_t start = b * refmath::SGEMM_K_BLOCK;
        partials[warp][b] = refmath::fma_chain(xr + start, wr + start, min(refmath::SGEMM_K_BLOCK, p.inp - start));
    }
    __syncwarp();
    if (lane == 0) {
        refmath::PairwiseSum sum;
        for (u32_t b = 0; b < blocks; ++b) sum.push(partials[warp][b]);
        const float v = sum.finish();
        y[i] = p.round_bf16 ? round_bf16_f32(v) : v;
    }
}

// Weight rows dequantised to f32 (exact: code value times a power of two), as the CPU reference's
// fp32 linears over FP8 / FP4 weights expand them (Backend::linear_fp8_f32 / linear_fp4_f32).
__device__ void dequant_fp8_rows(const u8_t* __restrict__ codes, const u8_t* __restrict__ scales,
                                 float* __restrict__ out, DequantParams p) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)p.rows * p.k) return;
    const u32_t row = p.row_start + (u32_t)(i / p.k);
    const u32_t col = (u32_t)(i % p.k);
    const float scale = e8m0_decode(scales[(size_t)(row / p.tile) * p.scale_cols + col / p.tile]);
    out[i] = __fmul_rn(e4m3_decode(codes[(size_t)row * p.k + col]), scale);
}

__device__ void dequant_fp4_rows(const u8_t* __restrict__ packed, const u8_t* __restrict__ scales,
                                 float* __restrict__ out, DequantParams p) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)p.rows * p.k) return;
    const u32_t row = p.row_start + (u32_t)(i / p.k);
    const u32_t col = (u32_t)(i % p.k);
    const u8_t byte = packed[(size_t)row * (p.k / 2) + col / 2];
    const u32_t nibble = (col % 2 == 0) ? (byte & 0x0fu) : (byte >> 4);
    const float scale = e8m0_decode(scales[(size_t)row * p.scale_cols + col / 32]);
    out[i] = __fmul_rn(e2m1_decode(nibble), scale);
}

}  // namespace linear
