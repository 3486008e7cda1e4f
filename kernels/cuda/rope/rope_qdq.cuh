// The rotated, quantised rows of a cache or an index (v41-architecture.md §3.0, §3.8): optionally
// an RMSNorm (norm/rms_norm.cuh, bf16 outputs), then the interleaved-pair RoPE of the last rope_dim
// channels of every stride-wide vector (rope/rope.cuh's arithmetic, bf16 outputs), then a QDQ
// point (quant/qdq.cuh's rules): each value the bits those launches give one after another, in
// one pass. Grid (rows, ceil(cols / CHUNK)): a block takes CHUNK columns of a row, thread t the
// elements first + t + 256 i, so a RoPE pair is two neighbouring lanes (stride and rope_dim even)
// and a QDQ group (16 or 32) is part of one warp (cols a multiple of 32). With a norm, every block
// of a row computes the row's RMS from x (never written in place then). Elementwise but for the
// row's norm and a group's amax, both fixed in order: batch invariant. y may be x without a norm.
#pragma once
#include "norm/rms_norm.cuh"
#include "quant/qdq.cuh"

namespace rope_qdq {

constexpr int THREADS = 256;
constexpr int PER_THREAD = 2;
constexpr u32_t CHUNK = THREADS * PER_THREAD;  // columns a block takes

// w: the norm's weight, or null for no norm.
template <class Rule>
__device__ void rope_qdq(const float* x, const float* __restrict__ w, float* y, const int* __restrict__ positions,
                         const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                         RopeQdqParams p) {
    const u32_t row = blockIdx.x;
    const u32_t first = blockIdx.y * CHUNK;
    if (row >= p.rows || first >= p.cols) return;
    const float* xr = x + (size_t)row * p.cols;
    float* yr = y + (size_t)row * p.cols;
    float v[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const u32_t c = first + threadIdx.x + i * THREADS;
        v[i] = c < p.cols ? xr[c] : 0.0f;
    }
    if (w != nullptr) {
        const float inv = rmsnorm::inv_rms(xr, p.cols, p.eps);
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const u32_t c = first + threadIdx.x + i * THREADS;
            if (c < p.cols) v[i] = rmsnorm::normed<true>(w[c], v[i], inv);
        }
    }
    const u32_t half = p.rope_dim / 2;
    const u32_t tail = p.stride - p.rope_dim;  // the first rotated channel of a vector
    const int pos = positions[row];
    const bool rotate = pos >= 0 && (u32_t)pos < p.table_rows;  // else unrotated (callers validate)
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const u32_t c = first + threadIdx.x + i * THREADS;
        if (c >= p.cols) continue;  // the whole warp (cols % 32 == 0)
        const float partner = __shfl_xor_sync(0xffffffffu, v[i], 1);
        const u32_t d = c % p.stride;
        if (rotate && d >= tail) {
            const size_t at = (size_t)pos * half + (d - tail) / 2;
            const float cs = cos_table[at];
            const float sn = p.inverse ? -sin_table[at] : sin_table[at];
            // y0 = x0 c - x1 s (the even channel), y1 = x0 s + x1 c (the odd one)
            v[i] = (d - tail) % 2 == 0 ? round_bf16_f32(__fsub_rn(__fmul_rn(v[i], cs), __fmul_rn(partner, sn)))
                                       : round_bf16_f32(__fadd_rn(__fmul_rn(partner, sn), __fmul_rn(v[i], cs)));
        }
        float amax = fabsf(v[i]);
#pragma unroll
        for (int offset = Rule::G / 2; offset > 0; offset >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        yr[c] = Rule::apply(v[i], amax);
    }
}

}  // namespace rope_qdq
