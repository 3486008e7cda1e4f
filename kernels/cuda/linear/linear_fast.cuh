// The `fast` bf16 linear y[r, o] = sum_k x[r, k] * w[o, k] on tensor cores (mma.sync m16n8k16,
// bf16 operands, fp32 accumulation): the V4.1 linears the reference runs in bf16 (the grouped
// wo_a, the compressor and indexer projections) and V4's dense projections (f32 out).
//
// K is read in chunks of CHUNK = 32: lane (g, q) (g = lane / 4, q = lane % 4) loads the 8
// consecutive k values [8q, 8q + 8) of its weight row and of its x rows (one 16-byte load of
// bf16 weights), and the chunk is two mma steps, step s taking k [8q + 4s, 8q + 4s + 4) into the
// fragment slots (2q, 2q + 1, 2q + 8, 2q + 9). A and B use the same slot map, so each step is the
// dot product of 16 distinct k of the chunk: the order of K is fixed by the kernel alone.
// A block is PARTS warps; warp w sums the chunks [w C / PARTS, (w + 1) C / PARTS) (C = chunks of
// inp) from zero in K order, and the PARTS partial sums are added in warp order. Each output's
// arithmetic therefore depends on inp alone — never on the rows of the launch or on the tile
// (MT x NT mma tiles of 16 rows x 8 columns per warp), which only changes how many outputs a
// warp carries: deterministic and batch invariant.
//
// w is bf16 [out, stride] with stride = inp rounded up to CHUNK (zero padding), x f32 [rows, inp]
// converted to bf16 (round to nearest even: exact for V4.1's bf16 values; V4's f32 rounded),
// y f32 storage, rounded to bf16 when p.round_bf16.
//
// Groups (grid.z, the grouped wo_a): group g is an independent linear of p.out rows of w (rows
// [g p.out, (g + 1) p.out)) over the columns [g p.inp, (g + 1) p.inp) of x [rows, groups p.inp]
// into the columns [g p.out, (g + 1) p.out) of y [rows, groups p.out]. One group (grid.z = 1) is
// the plain linear; a group's outputs are bitwise those of its linear launched alone.
#pragma once
#include "common/numerics.cuh"
#include "common/params.h"

namespace linear_fast {

constexpr int PARTS = 8;  // warps per block, one K part each
constexpr int THREADS = 32 * PARTS;
constexpr u32_t CHUNK = 32;  // k per lane step (two mma k16 steps)
constexpr int UNROLL = 4;    // chunks whose weights are loaded before their mma steps

// x[row, k .. k + 8) as f32 (rows x_stride apart), zero past inp or for a row past `rows`.
__device__ __forceinline__ void load_x8(const float* x, size_t x_stride, u32_t row, u32_t k, const LinearParams& p,
                                        float (&v)[8]) {
    if (row >= p.rows) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
        return;
    }
    const float* at = x + static_cast<size_t>(row) * x_stride + k;
    if ((p.inp & 3u) == 0 && k + 8 <= p.inp) {
        const float4 lo = *reinterpret_cast<const float4*>(at);
        const float4 hi = *reinterpret_cast<const float4*>(at + 4);
        v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
        v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = k + i < p.inp ? at[i] : 0.0f;
    }
}

// One warp's MT x NT tiles over its K part, then the block's part sums in warp order.
template <int MT, int NT>
__device__ __forceinline__ void linear_bf16(const float* x, const uint4* w, float* y, LinearParams p) {
    __shared__ float partials[PARTS][MT * 16][NT * 8];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32_t g = lane / 4, q = lane % 4;
    const u32_t row0 = blockIdx.y * (MT * 16), col0 = blockIdx.x * (NT * 8);
    const u32_t chunks = (p.inp + CHUNK - 1) / CHUNK;
    const u32_t first = warp * chunks / PARTS, last = (warp + 1) * chunks / PARTS;
    // This block's group: its columns of x and y, its rows of w.
    const size_t x_stride = static_cast<size_t>(gridDim.z) * p.inp, y_stride = static_cast<size_t>(gridDim.z) * p.out;
    x += static_cast<size_t>(blockIdx.z) * p.inp;
    y += static_cast<size_t>(blockIdx.z) * p.out;
    w += static_cast<size_t>(blockIdx.z) * p.out * chunks * 4;
    // uint4 units: a weight row holds `chunks` chunks of 4 uint4 (32 bf16), lane q reads the q-th.
    const uint4* w_rows[NT];
    bool col_ok[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const u32_t col = col0 + nt * 8 + g;
        col_ok[nt] = col < p.out;
        w_rows[nt] = w + static_cast<size_t>(col_ok[nt] ? col : 0) * chunks * 4 + q;
    }
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

    for (u32_t c0 = first; c0 < last; c0 += UNROLL) {
        uint4 b[UNROLL][NT];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                b[u][nt] = (c0 + u < last && col_ok[nt]) ? w_rows[nt][(c0 + u) * 4] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (c0 + u >= last) break;
            const u32_t k = (c0 + u) * CHUNK + 8 * q;
            unsigned a[MT][2][4];  // [tile][step][fragment register]
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float v[8];
                    load_x8(x, x_stride, row0 + mt * 16 + g + 8 * half, k, p, v);
                    a[mt][0][half] = pack_bf16(v[0], v[1]);
                    a[mt][0][2 + half] = pack_bf16(v[2], v[3]);
                    a[mt][1][half] = pack_bf16(v[4], v[5]);
                    a[mt][1][2 + half] = pack_bf16(v[6], v[7]);
                }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    mma_bf16(acc[mt][nt], a[mt][0], b[u][nt].x, b[u][nt].y);
                    mma_bf16(acc[mt][nt], a[mt][1], b[u][nt].z, b[u][nt].w);
                }
        }
    }
    // C fragment: (row g, columns 2q, 2q + 1) and (row g + 8, the same columns).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u32_t r = mt * 16 + g, c = nt * 8 + 2 * q;
            partials[warp][r][c] = acc[mt][nt][0];
            partials[warp][r][c + 1] = acc[mt][nt][1];
            partials[warp][r + 8][c] = acc[mt][nt][2];
            partials[warp][r + 8][c + 1] = acc[mt][nt][3];
        }
    __syncthreads();
    for (u32_t i = threadIdx.x; i < MT * 16 * NT * 8; i += THREADS) {
        const u32_t r = i / (NT * 8), c = i % (NT * 8);
        const u32_t row = row0 + r, col = col0 + c;
        if (row >= p.rows || col >= p.out) continue;
        float sum = partials[0][r][c];
#pragma unroll
        for (int part = 1; part < PARTS; ++part) sum += partials[part][r][c];
        y[static_cast<size_t>(row) * y_stride + col] = p.round_bf16 ? round_bf16_f32(sum) : sum;
    }
}

}  // namespace linear_fast
