// The `fast` linears y[r, o] = sum_k x[r, k] * w[o, k] on tensor cores (mma.sync m16n8k16, bf16
// operands, fp32 accumulation), w bf16, x f32 taken onto the tensor cores as PIECES bf16 pieces:
//   PIECES = 1 (linear_bf16_fast_*): x rounded to bf16 — the V4.1 linears the reference runs in
//     bf16 (the grouped wo_a, the compressor and indexer projections) and V4's dense projections;
//   PIECES = 3 (linear_bf16x3_fast_*, the split-x bf16x3 product): x split exactly into
//     x = x1 + x2 + x3, x1 = bf16(x), x2 = bf16(x - x1), x3 = bf16(x - x1 - x2) (round to nearest
//     even; each remainder exact in fp32; x's 24 significant bits fit the three 8-bit pieces, so
//     nothing is left unless a piece falls below bf16's normal range) — the fp32 linears
//     (Backend::linear_f32: V4.1's router gate, the compressor's wkv and wgate, heads) with
//     fp32-level accuracy on a bf16 weight. The pieces' products enter the sums in a fixed order:
//     at every mma step (16 k of a chunk) x3·w, then x2·w, then x1·w, each one mma on the same
//     accumulator (the small pieces first: in a part's first step they are not truncated against
//     x1's products).
// The bound of each is derived in kernels/src/ops/linear_fast.rs.
//
// The arithmetic of an output, the same in every tile. K is read in chunks of CHUNK = 32: lane
// (g, q) (g = lane / 4, q = lane % 4) takes the 8 consecutive k values [8q, 8q + 8) of the
// chunk in its weight row and x rows, and the chunk is two mma steps (PIECES mma each), step s
// taking k [8q + 4s, 8q + 4s + 4) into the fragment slots (2q, 2q + 1, 2q + 8, 2q + 9). A and B
// use the same slot map, so each mma is the dot product of 16 distinct k of the chunk. K is cut
// into PARTS parts, part p the chunks [p C / PARTS, (p + 1) C / PARTS) (C = chunks of inp), each
// summed from zero in K order; then total = part 0, total += part 1, ... in part order (fp32),
// rounded to bf16 when asked. An output sits at the same place of its 16 x 8 mma tile in every
// tile (tiles start at multiples of 16 rows and 8 columns). So an output's bits depend on inp
// alone — never on the rows of the launch or on the tile: deterministic and batch invariant.
//
// The tiles. linear_bf16<PIECES, MT, NT> (decode): a block is PARTS warps, all on the same MT x NT
// mma tiles (16 rows x 8 columns each), warp w summing part w; the block adds the PARTS partial
// sums through shared memory in warp order. At decode a block's work is a latency chain, so a warp
// first asks L2 for its part's weights, then loads each UNROLL chunks' weights and their x rows
// before it uses any of them. linear_bf16_wide<PIECES> (prefill): a block of
// WIDE_ROWS x WIDE_COLS outputs, each warp WIDE_MT x WIDE_NT mma tiles (32 rows x 128 columns) of
// them over all of K: part by part, the chunks staged in shared memory a stage (a barrier) at a
// time, two buffers deep (w by cp.async; x through registers, split into its bf16 pieces once
// for the block as it is stored, in the order of the fragment registers), the part's sum in
// registers added to the running total, which waits in shared memory (one slot per thread and
// output: no synchronisation). linear_bf16_wide<PIECES, true> (prefill
// with too few wide blocks to fill the device, e.g. a 384-output router): the same block over
// one K part (grid.z = group x PARTS), its part's sums to partials[part] ([PARTS][rows][groups
// out]), which linear_fast_reduce adds in part order with the same additions as the totals.
//
// w is bf16 [out, stride] with stride = inp rounded up to CHUNK (zero padding), x f32 [rows, inp]
// (zero past inp and for rows past `rows`), y f32 storage, rounded to bf16 when p.round_bf16.
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

// The PIECES bf16 pieces of the pair (lo, hi), each a bf16 pair word (lo in the low half):
// piece 1 = bf16(v), piece j + 1 = bf16(v - pieces 1..j), each difference exact in fp32. Every
// tile takes x onto the tensor cores through it.
template <int PIECES>
__device__ __forceinline__ void split_pair(float lo, float hi, u32_t (&pieces)[PIECES]) {
#pragma unroll
    for (int j = 0; j < PIECES; ++j) {
        const u32_t bits = pack_bf16(lo, hi);
        pieces[j] = bits;
        if (j + 1 < PIECES) {
            lo = __fsub_rn(lo, __uint_as_float(bits << 16));
            hi = __fsub_rn(hi, __uint_as_float(bits & 0xffff0000u));
        }
    }
}

// The A fragment registers of mma tile mt from one row's 8 values v = x[row, 8q .. 8q + 8) (the
// tile's row g for half = 0, row g + 8 for half = 1), for each of the PIECES bf16 pieces:
// a[j][mt][s][r] holds piece j + 1 of the pair of k that step s puts in register r.
template <int PIECES, int MT>
__device__ __forceinline__ void split_row(const float (&v)[8], int mt, int half, u32_t (&a)[PIECES][MT][2][4]) {
#pragma unroll
    for (int pair = 0; pair < 4; ++pair) {
        // pairs (v0, v1), (v2, v3) of step 0 and (v4, v5), (v6, v7) of step 1; the second pair of
        // a step sits in register 2 + half (k + 8 of the mma).
        const int s = pair / 2, r = (pair % 2) * 2 + half;
        u32_t pieces[PIECES];
        split_pair<PIECES>(v[2 * pair], v[2 * pair + 1], pieces);
#pragma unroll
        for (int j = 0; j < PIECES; ++j) a[j][mt][s][r] = pieces[j];
    }
}

// acc += the PIECES pieces' products of step s, x3 · w first, x1 · w last (the order of the
// header).
template <int PIECES, int MT>
__device__ __forceinline__ void mma_pieces(float (&acc)[4], const u32_t (&a)[PIECES][MT][2][4], int mt, int s,
                                           u32_t b0, u32_t b1) {
#pragma unroll
    for (int j = PIECES - 1; j >= 0; --j) mma_bf16(acc, a[j][mt][s], b0, b1);
}

// f(mt, nt, i) for every C fragment register i of MT x NT mma tiles, unrolled.
template <int MT, int NT, class F>
__device__ __forceinline__ void for_tiles(F f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) f(mt, nt, i);
}

// Every accumulator of MT x NT mma tiles set to 0.
template <int MT, int NT>
__device__ __forceinline__ void zero_tiles(float (&acc)[MT][NT][4]) {
    for_tiles<MT, NT>([&](int mt, int nt, int i) { acc[mt][nt][i] = 0.0f; });
}

// Asks L2 for the lines of the warp's K part [first, last) chunks in its weight rows (lane q takes
// every fourth line of lane g's row), so that the loop's weight loads wait on L2 rather than DRAM,
// when the launch has at most one block per multiprocessor (its blocks are latency chains); a
// launch of more blocks streams the weights through the blocks it keeps resident, and asking
// ahead only adds requests. x is not asked for: every block of the launch reads the same rows,
// which stay in L2. Prefetches change no value.
template <int NT>
__device__ __forceinline__ void prefetch_weights(const uint4* (&w_rows)[NT], const bool (&col_ok)[NT], u32_t first,
                                                 u32_t last) {
    u32_t multiprocessors;
    asm("mov.u32 %0, %%nsmid;" : "=r"(multiprocessors));
    if (first >= last || gridDim.x * gridDim.y * gridDim.z > multiprocessors) return;
    const u32_t q = threadIdx.x % 4;
    const u32_t w_bytes = (last - first) * CHUNK * 2;  // a weight row's part
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        if (!col_ok[nt]) continue;
        const char* part = reinterpret_cast<const char*>(w_rows[nt] - q + static_cast<size_t>(first) * 4);
        for (u32_t at = 128 * q; at < w_bytes + 128; at += 4 * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(part + min(at, w_bytes - 1)));
    }
}

// The decode tile: one warp's MT x NT tiles over its K part, then the block's part sums in warp
// order.
template <int PIECES, int MT, int NT>
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
    prefetch_weights<NT>(w_rows, col_ok, first, last);
    float acc[MT][NT][4];
    zero_tiles(acc);

    for (u32_t c0 = first; c0 < last; c0 += UNROLL) {
        uint4 b[UNROLL][NT];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                b[u][nt] = (c0 + u < last && col_ok[nt]) ? w_rows[nt][(c0 + u) * 4] : make_uint4(0, 0, 0, 0);
        // The x rows of X_CHUNKS chunks are loaded together, before any of them is used, so their
        // round trips overlap (at most two chunks of one mma tile's rows in registers: more cost
        // the bandwidth-bound launches their blocks per SM).
        constexpr int X_CHUNKS = 2 / MT > 0 ? 2 / MT : 1;
        static_assert(UNROLL % X_CHUNKS == 0, "whole batches of chunks");
#pragma unroll
        for (int u0 = 0; u0 < UNROLL; u0 += X_CHUNKS) {
            float v[X_CHUNKS][MT][2][8];
#pragma unroll
            for (int du = 0; du < X_CHUNKS; ++du)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half)
                        load_x8(x, x_stride, c0 + u0 + du < last ? row0 + mt * 16 + g + 8 * half : p.rows,
                                (c0 + u0 + du) * CHUNK + 8 * q, p, v[du][mt][half]);
#pragma unroll
            for (int du = 0; du < X_CHUNKS; ++du) {
                const int u = u0 + du;
                if (c0 + u >= last) break;
                u32_t a[PIECES][MT][2][4];  // [piece][tile][step][fragment register]
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) split_row<PIECES, MT>(v[du][mt][half], mt, half, a);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        mma_pieces<PIECES, MT>(acc[mt][nt], a, mt, 0, b[u][nt].x, b[u][nt].y);
                        mma_pieces<PIECES, MT>(acc[mt][nt], a, mt, 1, b[u][nt].z, b[u][nt].w);
                    }
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

// The prefill tile: a block of WIDE_ROWS x WIDE_COLS outputs, warp (wr, wc) = (warp % 4, warp / 4)
// WIDE_MT x WIDE_NT mma tiles of them (32 rows x 128 columns). Its dynamic shared memory: the
// running totals (not in the one-part form), then WIDE_BUFFERS stage buffers of
// wide_stage_chunks<PIECES> chunks each. A chunk holds x's PIECES bf16 pieces (WIDE_X_BYTES
// each, in fragment order: wide_x_frag), then w [WIDE_COLS][CHUNK] bf16 in rows of 64 bytes,
// lane (g, q) reading the 16 bytes of k [8q, 8q + 8) at byte 16q of its row (a quarter warp,
// rows g and g + 1, reads 128 consecutive bytes: distinct banks).
constexpr int WIDE_MT = 2, WIDE_NT = 16;  // mma tiles per warp: 32 rows x 128 columns
constexpr u32_t WIDE_ROWS = 4 * WIDE_MT * 16, WIDE_COLS = 2 * WIDE_NT * 8;  // warps 4 x 2
constexpr u32_t WIDE_OUTPUTS = WIDE_MT * WIDE_NT * 4;  // per thread
constexpr u32_t WIDE_TOTAL_BYTES = WIDE_OUTPUTS * THREADS * 4;
constexpr u32_t WIDE_X_BYTES = WIDE_ROWS * CHUNK * 2, WIDE_W_BYTES = WIDE_COLS * CHUNK * 2;  // of a chunk
constexpr u32_t WIDE_BUFFERS = 2;
// Chunks a stage (a barrier each): two of the bf16 product (128 mma a warp); one of the split-x
// product (its three pieces take the second chunk's shared memory; 192 mma a warp).
template <int PIECES>
constexpr u32_t wide_stage_chunks() {
    return PIECES == 1 ? 2 : 1;
}
template <int PIECES>
constexpr u32_t wide_chunk_bytes() {
    return PIECES * WIDE_X_BYTES + WIDE_W_BYTES;
}
template <int PIECES, bool ONE_PART>
constexpr u32_t wide_shared_bytes() {
    return (ONE_PART ? 0 : WIDE_TOTAL_BYTES) + WIDE_BUFFERS * wide_stage_chunks<PIECES>() * wide_chunk_bytes<PIECES>();
}
static_assert(wide_shared_bytes<1, false>() == 224 * 1024 && wide_shared_bytes<3, false>() == 208 * 1024 &&
                  wide_shared_bytes<1, true>() == 96 * 1024 && wide_shared_bytes<3, true>() == 80 * 1024,
              "the launch's shared memory: ops/linear_fast.rs wide_shared_bytes");

// The byte offset, in a piece of a chunk's x, of the A fragment registers a[0..4) of step s of
// lane (g, q) on the mma tile of rows 16m + g, 16m + g + 8 (tr = 8m + g): the pair words of
// k (8q + 4s, + 1) of both rows, then of k (8q + 4s + 2, + 3) of both rows (split_row's
// registers), 16 bytes, so that one 16-byte load gives them. A quarter warp reading (g = 2i,
// 2i + 1; q = 0 .. 3) and one storing (its g; q = 0 .. 3; s = 0, 1) each cover the 8 bank
// groups of 16 bytes: s is swapped on odd g.
__device__ __forceinline__ u32_t wide_x_frag(u32_t tr, u32_t s, u32_t q) {
    return ((tr * 2 + (s ^ (tr & 1))) * 4 + q) * 16;
}

// What a thread stages of every chunk c (t = threadIdx.x): the WIDE_X_FRAGS fragment quads
// (tr, s, q) = (t / 8 + 32 j, t % 2, t % 8 / 2), their k 32c + 4 (t % 8) .. + 4 of their two rows
// loaded through registers (a warp loads 4 rows of 128 bytes at a time) and split into their
// bf16 pieces once for the block; and the WIDE_W_COPIES 16-byte weight segments
// w[col0 + t / 4 + 64 j, 32c + 8 (t % 4) .. + 8), by cp.async.
constexpr u32_t WIDE_X_FRAGS = WIDE_ROWS * CHUNK / 8 / THREADS, WIDE_FRAG_STEP = THREADS / 8;
constexpr u32_t WIDE_W_COPIES = WIDE_COLS * (CHUNK / 8) / THREADS, WIDE_COPY_ROWS = THREADS / (CHUNK / 8);
static_assert(WIDE_X_FRAGS * WIDE_FRAG_STEP * 2 == WIDE_ROWS && WIDE_W_COPIES * WIDE_COPY_ROWS == WIDE_COLS);

struct WideStager {
    const float* x;        // x[first row, 4 (t % 8)]: the thread's first row, 16 (t / 64) + t / 8 % 8 of the block
    const uint4* w;        // w[first column, 8 (t % 4)]: the thread's first column, t / 4 of the block
    u32_t x_rows, w_cols;  // rows of x and columns of w from the thread's first on
    size_t x_stride;       // x's rows (the launch's groups x p.inp)
    u32_t w_step;          // WIDE_COPY_ROWS rows of w, in uint4

    // The thread's rows and columns of the block (row0, col0) of the group's x (rows x_stride
    // apart) and w (rows of `chunks` chunks).
    __device__ __forceinline__ WideStager(const float* x, size_t x_stride, const uint4* w, u32_t chunks, u32_t row0,
                                          u32_t col0, const LinearParams& p)
        : x_stride(x_stride), w_step(WIDE_COPY_ROWS * chunks * 4) {
        const u32_t row = row0 + threadIdx.x / 64 * 16 + threadIdx.x / 8 % 8, col = col0 + threadIdx.x / 4;
        x_rows = row < p.rows ? p.rows - row : 0;
        w_cols = col < p.out ? p.out - col : 0;
        this->x = x + static_cast<size_t>(x_rows > 0 ? row : 0) * x_stride + 4 * (threadIdx.x % 8);
        this->w = w + static_cast<size_t>(w_cols > 0 ? col : 0) * chunks * 4 + threadIdx.x % 4;
    }

    // Chunk c's values of the thread's fragment quads: v[j][h] = x[16 (tr / 8) + tr % 8 + 8h, k ..
    // k + 4) of the block (tr = t / 8 + 32 j: the thread's first row + 8h + 64j), zero past
    // p.rows and p.inp (16-byte loads; 4-byte ones when inp is not a multiple of 4: the rows are
    // then not 16-byte aligned).
    __device__ __forceinline__ void load_x(u32_t c, const LinearParams& p, float4 (&v)[WIDE_X_FRAGS][2]) const {
        const u32_t k = c * CHUNK + 4 * (threadIdx.x % 8);
        const auto at = [&](u32_t j, u32_t h) { return x + (8 * h + 64 * j) * x_stride + c * CHUNK; };
        const auto ok = [&](u32_t j, u32_t h) { return 8 * h + 64 * j < x_rows; };
        if ((p.inp & 3u) == 0) {
#pragma unroll
            for (u32_t j = 0; j < WIDE_X_FRAGS; ++j)
#pragma unroll
                for (u32_t h = 0; h < 2; ++h)
                    v[j][h] = ok(j, h) && k < p.inp ? *reinterpret_cast<const float4*>(at(j, h))
                                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        } else {
#pragma unroll
            for (u32_t j = 0; j < WIDE_X_FRAGS; ++j)
#pragma unroll
                for (u32_t h = 0; h < 2; ++h) {
                    const float* row = at(j, h);
                    v[j][h].x = ok(j, h) && k < p.inp ? row[0] : 0.0f;
                    v[j][h].y = ok(j, h) && k + 1 < p.inp ? row[1] : 0.0f;
                    v[j][h].z = ok(j, h) && k + 2 < p.inp ? row[2] : 0.0f;
                    v[j][h].w = ok(j, h) && k + 3 < p.inp ? row[3] : 0.0f;
                }
        }
    }

    // The thread's fragment quads of a chunk, from its values v, into the chunk's x pieces at xs
    // (piece j at xs + j WIDE_X_BYTES): each pair of values as its PIECES pair words (split_pair).
    template <int PIECES>
    __device__ __forceinline__ void store_x(u8_t* xs, const float4 (&v)[WIDE_X_FRAGS][2]) const {
#pragma unroll
        for (u32_t j = 0; j < WIDE_X_FRAGS; ++j) {
            u32_t lo0[PIECES], hi0[PIECES], lo1[PIECES], hi1[PIECES];  // [row g or g + 8][pair]
            split_pair<PIECES>(v[j][0].x, v[j][0].y, lo0);
            split_pair<PIECES>(v[j][1].x, v[j][1].y, hi0);
            split_pair<PIECES>(v[j][0].z, v[j][0].w, lo1);
            split_pair<PIECES>(v[j][1].z, v[j][1].w, hi1);
            const u32_t e = threadIdx.x % 8, at = wide_x_frag(threadIdx.x / 8 + j * WIDE_FRAG_STEP, e % 2, e / 2);
#pragma unroll
            for (int piece = 0; piece < PIECES; ++piece)
                *reinterpret_cast<uint4*>(xs + piece * WIDE_X_BYTES + at) =
                    make_uint4(lo0[piece], hi0[piece], lo1[piece], hi1[piece]);
        }
    }

    // Chunk c's weight rows into ws (zero past p.out; the padding of a row is zero).
    __device__ __forceinline__ void copy_w(u8_t* ws, u32_t c) const {
#pragma unroll
        for (u32_t j = 0; j < WIDE_W_COPIES; ++j) {
            const bool ok = j * WIDE_COPY_ROWS < w_cols;
            cp_async16(ws + (threadIdx.x / 4 + j * WIDE_COPY_ROWS) * (CHUNK * 2) + threadIdx.x % 4 * 16,
                       ok ? w + j * w_step + c * 4 : w, ok);
        }
    }
};

// The prefill tile: warp (wr, wc) computes rows [32 wr, 32 wr + 32) x columns [128 wc, 128 wc + 128)
// of the block's outputs, over every part (ONE_PART false: the outputs to y) or over part
// blockIdx.z % PARTS of group blockIdx.z / PARTS (ONE_PART: the part's sums to partials
// [PARTS][rows][groups out], y unused). The chunks go through the two buffers a stage at a time:
// after the stage's barrier a thread issues the next stage's weight copies and x loads, computes
// the stage, then stores the next stage's x (split) into the other buffer.
template <int PIECES, bool ONE_PART>
__device__ __forceinline__ void linear_bf16_wide(const float* x, const uint4* w, float* y, float* partials,
                                                 LinearParams p) {
    constexpr u32_t STAGE_CHUNKS = wide_stage_chunks<PIECES>(), CHUNK_BYTES = wide_chunk_bytes<PIECES>();
    extern __shared__ __align__(16) u8_t wide_smem[];
    float* totals = reinterpret_cast<float*>(wide_smem) + threadIdx.x;  // [WIDE_OUTPUTS][THREADS]
    u8_t* buffers = wide_smem + (ONE_PART ? 0 : WIDE_TOTAL_BYTES);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32_t g = lane / 4, q = lane % 4;
    const u32_t wr = warp % 4, wc = warp / 4;
    const u32_t row0 = blockIdx.y * WIDE_ROWS, col0 = blockIdx.x * WIDE_COLS;
    const u32_t chunks = (p.inp + CHUNK - 1) / CHUNK;
    const u32_t group = ONE_PART ? blockIdx.z / PARTS : blockIdx.z;
    const u32_t groups = ONE_PART ? gridDim.z / PARTS : gridDim.z;
    const u32_t first_part = ONE_PART ? blockIdx.z % PARTS : 0, end_part = ONE_PART ? first_part + 1 : PARTS;
    // This block's group: its columns of x and y, its rows of w.
    const size_t x_stride = static_cast<size_t>(groups) * p.inp, y_stride = static_cast<size_t>(groups) * p.out;
    if constexpr (!ONE_PART) y += static_cast<size_t>(group) * p.out;
    const WideStager stager(x + static_cast<size_t>(group) * p.inp, x_stride,
                            w + static_cast<size_t>(group) * p.out * chunks * 4, chunks, row0, col0, p);

    // The parts follow each other through K: chunks [begin, end) are the block's, chunk c the
    // (c - begin) % STAGE_CHUNKS-th of stage (c - begin) / STAGE_CHUNKS, whose buffer is the
    // stage's number modulo WIDE_BUFFERS.
    const u32_t begin = first_part * chunks / PARTS, end = end_part * chunks / PARTS;
    const auto chunk_at = [&](u32_t c) { return buffers + (c - begin) % (WIDE_BUFFERS * STAGE_CHUNKS) * CHUNK_BYTES; };
    float4 next[STAGE_CHUNKS][WIDE_X_FRAGS][2];  // the x values of the stage from `first` on, in flight
    const auto load_stage = [&](u32_t first) {
#pragma unroll
        for (u32_t u = 0; u < STAGE_CHUNKS; ++u)
            if (first + u < end) {
                stager.copy_w(chunk_at(first + u) + PIECES * WIDE_X_BYTES, first + u);
                stager.load_x(first + u, p, next[u]);
            }
        cp_async_commit();
    };
    const auto store_stage = [&](u32_t first) {
#pragma unroll
        for (u32_t u = 0; u < STAGE_CHUNKS; ++u)
            if (first + u < end) stager.store_x<PIECES>(chunk_at(first + u), next[u]);
    };
    load_stage(begin);
    store_stage(begin);

    u32_t c = begin;  // the next chunk
    float acc[WIDE_MT][WIDE_NT][4];
    // acc = the sums of part `part` (its chunks from c on), from zero.
    const auto sum_part = [&](u32_t part) {
        const u32_t last = (part + 1) * chunks / PARTS;
        zero_tiles(acc);
        for (; c < last; ++c) {
            const u32_t slot = (c - begin) % STAGE_CHUNKS;
            if (slot == 0) {
                // This stage is in its buffer (this thread's copies and stores; the barrier:
                // everyone's), and every warp is done with the last stage, whose buffer takes the
                // next one.
                cp_async_wait<0>();
                __syncthreads();
                load_stage(c + STAGE_CHUNKS);
            }
            const u8_t* xs = chunk_at(c);
            const u8_t* ws = xs + PIECES * WIDE_X_BYTES;
            u32_t a[PIECES][WIDE_MT][2][4];  // [piece][tile][step][fragment register], as in linear_bf16
#pragma unroll
            for (int mt = 0; mt < WIDE_MT; ++mt)
#pragma unroll
                for (int s = 0; s < 2; ++s)
#pragma unroll
                    for (int piece = 0; piece < PIECES; ++piece) {
                        const uint4 v = *reinterpret_cast<const uint4*>(
                            xs + piece * WIDE_X_BYTES + wide_x_frag((wr * WIDE_MT + mt) * 8 + g, s, q));
                        a[piece][mt][s][0] = v.x;
                        a[piece][mt][s][1] = v.y;
                        a[piece][mt][s][2] = v.z;
                        a[piece][mt][s][3] = v.w;
                    }
#pragma unroll
            for (int nt = 0; nt < WIDE_NT; ++nt) {
                // w[col, 8q .. 8q + 8) of column col = 128 wc + 8 nt + g.
                const u32_t n = wc * (WIDE_NT * 8) + nt * 8 + g;
                const uint4 b = *reinterpret_cast<const uint4*>(ws + n * (CHUNK * 2) + q * 16);
#pragma unroll
                for (int mt = 0; mt < WIDE_MT; ++mt) {
                    mma_pieces<PIECES, WIDE_MT>(acc[mt][nt], a, mt, 0, b.x, b.y);
                    mma_pieces<PIECES, WIDE_MT>(acc[mt][nt], a, mt, 1, b.z, b.w);
                }
            }
            if (slot == STAGE_CHUNKS - 1) store_stage(c + 1);
        }
    };
    // Output i of tile (mt, nt): C fragment (row g, columns 2q, 2q + 1), (row g + 8, the same).
    const auto row_of = [&](int mt, int i) { return row0 + wr * (WIDE_MT * 16) + mt * 16 + g + 8 * (i / 2); };
    const auto col_of = [&](int nt, int i) { return col0 + wc * (WIDE_NT * 8) + nt * 8 + 2 * q + i % 2; };
    if constexpr (ONE_PART) {
        sum_part(first_part);
        for_tiles<WIDE_MT, WIDE_NT>([&](int mt, int nt, int i) {
            const u32_t row = row_of(mt, i), col = col_of(nt, i);
            if (row >= p.rows || col >= p.out) return;
            partials[((size_t)first_part * p.rows + row) * y_stride + (size_t)group * p.out + col] = acc[mt][nt][i];
        });
    } else {
        for (u32_t part = 0; part < PARTS; ++part) {
            sum_part(part);
            // total = part 0, then total + part p, in part order (this thread's own slots).
            for_tiles<WIDE_MT, WIDE_NT>([&](int mt, int nt, int i) {
                float& total = totals[((mt * WIDE_NT + nt) * 4 + i) * THREADS];
                total = part == 0 ? acc[mt][nt][i] : __fadd_rn(total, acc[mt][nt][i]);
            });
        }
        for_tiles<WIDE_MT, WIDE_NT>([&](int mt, int nt, int i) {
            const u32_t row = row_of(mt, i), col = col_of(nt, i);
            if (row >= p.rows || col >= p.out) return;
            const float sum = totals[((mt * WIDE_NT + nt) * 4 + i) * THREADS];
            y[static_cast<size_t>(row) * y_stride + col] = p.round_bf16 ? round_bf16_f32(sum) : sum;
        });
    }
}

// y[i] = ((partials[0][i] + partials[1][i]) + ...) + partials[PARTS - 1][i] in part order (the
// wide tile's totals), rounded to bf16 when p.round_bf16; i < p.count.
__device__ __forceinline__ void linear_fast_reduce(const float* partials, float* y, LinearReduceParams p) {
    for (u32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.count; i += gridDim.x * blockDim.x) {
        float total = partials[i];
#pragma unroll
        for (int part = 1; part < PARTS; ++part) total = __fadd_rn(total, partials[(size_t)part * p.count + i]);
        y[i] = p.round_bf16 ? round_bf16_f32(total) : total;
    }
}

}  // namespace linear_fast
