// Interleaved-pair partial RoPE (v41-architecture.md §3.8): on the last rope_dim channels of each
// head, the pair (x[2i], x[2i+1]) is multiplied as a complex number by (cos, sin) of its position's
// angle i: y0 = x0*c - x1*s, y1 = x0*s + x1*c, in fp32 with no fused multiply-add (each product
// rounded, like the CPU reference), rounded to bf16. One thread per pair; elementwise, so batch
// invariant.
#pragma once
#include "common/numerics.cuh"

namespace rope {

constexpr int THREADS = 256;

// f32 storage (the model's host layout); outputs rounded to bf16 when ROUND_BF16, else kept in fp32.
template <bool ROUND_BF16>
__device__ void rope_interleaved(float* __restrict__ x, const int* __restrict__ positions,
                                 const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                                 RopeParams p) {
    const u32_t half = p.rope_dim / 2;
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)p.tokens * p.heads * half) return;
    const u32_t pair = (u32_t)(i % half);
    const unsigned long long token_head = i / half;
    const u32_t token = (u32_t)(token_head / p.heads);
    const int pos = positions[token];
    if (pos < 0 || (u32_t)pos >= p.table_rows) return;  // the launcher's contract: positions are in range
    float* px = x + token_head * p.head_dim + (p.head_dim - p.rope_dim) + 2 * pair;
    const float c = cos_table[(size_t)pos * half + pair];
    const float s = p.inverse ? -sin_table[(size_t)pos * half + pair] : sin_table[(size_t)pos * half + pair];
    const float x0 = px[0];
    const float x1 = px[1];
    px[0] = store_f32<float, ROUND_BF16>(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
    px[1] = store_f32<float, ROUND_BF16>(__fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}

}  // namespace rope
