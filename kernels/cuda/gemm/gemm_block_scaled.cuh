// Block-scaled GEMM with FP8 activations (v41-architecture.md §3.0):
//   y[m, n] = bf16( sum over k-groups g, in K order, of
//                   RN_f32(exact sum_{k in g} a[m, k] * w[n, k]) * s_a[m, g] * s_w(n, g) ).
// Every product of two FP8 codes (or FP8 x E2M1) is exact in fp32 and every scale is a power of
// two. A group's partial is the exact sum of its products rounded once to fp32 (see exact_dot32:
// the value deepinfer-model's quant::dot_f32 computes in f64), so it does not depend on any order;
// the scaled partials are then added g = 0, 1, ... in fp32 by one thread, as the reference does.
// Nothing depends on M or on the launch shape: a row's result is bitwise the same alone or inside
// any batch (batch invariance by construction; no split-K), and equal to the CPU reference.
//
// Work split (a plain tiled kernel on the CUDA cores; Hopper has no FP4 tensor cores and this slice
// puts exactness first): a block is 8 warps and covers BM rows (from blockIdx.x * BM) and
// 8 / wpc output columns (wpc = p.warps_per_col in {1, 2, 4, 8}). The wpc warps of a column take
// interleaved chunks of 32 k-groups (lane j of warp w computes k-group step + 32 w + j for all BM
// rows) and write the scaled partials to shared memory; after a barrier one thread per
// (column, row) adds them in K order. wpc only changes who computes a partial, never the order of
// any addition, so the result is bitwise the same for every wpc (the GPU test checks it); the
// launcher picks a larger wpc for small M to put more warps on the K range of a column. Each lane
// fetches its next k-group's weights one step ahead, and the scales before the math.
// blockIdx.x (rows) varies fastest, so the blocks that read one weight panel run together (L2 hits).
//
// The column-per-warp body (gemm_warp_tile, for a few rows: decode) computes the same partials and
// adds them in the same order with one warp per column and no block barrier; the launcher takes
// it for M <= 4 (the H200 measurement behind that choice is in ops/gemm.rs).
//
// How a k-group's exact sum is formed depends on the weights (Weights::dot16 / dot32 and
// Weights::unscale): FP8 weights use exact_dot32 (split products, 6 operations each); FP4 weights
// use fp4_dot (two plain FMA accumulators split by activation magnitude, 2 FFMA each, on weights
// decoded scaled by 2^-126). Both give RN_f32 of the exact sum; the proof for FP4 is at fp4_dot.
#pragma once
#include "common/grid_dependency.cuh"
#include "common/numerics.cuh"

namespace gemm {

constexpr int WARPS = 8;

// 16 E4M3 codes (one 16-byte load) decoded to floats, in memory order.
__device__ __forceinline__ void decode_e4m3x16(uint4 v, float* out) {
    const u32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 lo = e4m3x2_decode((u16_t)(words[i] & 0xffffu));
        const float2 hi = e4m3x2_decode((u16_t)(words[i] >> 16));
        out[4 * i + 0] = lo.x;
        out[4 * i + 1] = lo.y;
        out[4 * i + 2] = hi.x;
        out[4 * i + 3] = hi.y;
    }
}

// The exact sum of 32 exact products, as two exact fp32 halves (sum = hi + lo exactly). Each
// product p is a multiple of 2^-18 (2^-10 for E2M1 weights) with |p| <= 448^2 < 2^18. Split at 2:
// p_hi = p rounded to a multiple of 2 (adding and removing 1.5 * 2^24), p_lo = p - p_hi, |p_lo| <= 1.
// Then |hi| < 2^23 in steps of 2 and |lo| <= 32 in steps of 2^-18: both sums are exact in fp32
// whatever their order.
__device__ __forceinline__ void exact_dot32(const float* av, const float* wv, float& hi, float& lo) {
    constexpr float SPLIT = 25165824.0f;  // 1.5 * 2^24: its fp32 neighbours are 2 apart
    float h = 0.0f, l = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const float prod = __fmul_rn(av[i], wv[i]);  // exact
        const float prod_hi = __fsub_rn(__fadd_rn(prod, SPLIT), SPLIT);
        h = __fadd_rn(h, prod_hi);
        l = __fadd_rn(l, __fsub_rn(prod, prod_hi));
    }
    hi = h;
    lo = l;
}

// exact_dot32 over 16 products: hi and lo of a part of a group. The parts of one group add up
// exactly in any order (the bounds above hold for any subset of a group's products), so the
// group's exact sum does not depend on how its products are split between lanes.
__device__ __forceinline__ void exact_dot16(const float* av, const float* wv, float& hi, float& lo) {
    constexpr float SPLIT = 25165824.0f;
    float h = 0.0f, l = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const float prod = __fmul_rn(av[i], wv[i]);
        const float prod_hi = __fsub_rn(__fadd_rn(prod, SPLIT), SPLIT);
        h = __fadd_rn(h, prod_hi);
        l = __fadd_rn(l, __fsub_rn(prod, prod_hi));
    }
    hi = h;
    lo = l;
}

// The exact sum of N products of E4M3 activations and E2M1 weights, as two fp32 halves whose
// exact sum (times 2^126) is the products' exact sum. `wv` holds the weights times 2^-126
// (Fp4Weights::decode*, which places an E2M1 code's magnitude bits as an fp32 denormal);
// Fp4Weights::unscale multiplies RN(big + small) back by 2^126.
//
// Why every operation here is exact (so RN_f32(big + small) * 2^126 is RN_f32 of the exact sum,
// the CPU's quant::dot_f32 rounded once):
// - E2M1 values w: 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6: multiples of 2^-1, |w| <= 6.
// - E4M3 values a: normals (1 + f/8) 2^(e-7), e = 1..15 (448 = 1.75 * 2^8 the largest), and
//   subnormals f * 2^-9, f = 1..7: every value is a multiple of 2^-9, and a value with |a| >= 2^t
//   (t >= -6) is a multiple of 2^(t-3). (NaN codes: see the last point.)
// - The activation is split at c = 2^-2: a_small = clamp(a, -c, c), a_big = a - a_small.
//   a_small is a itself or ±c (both E4M3 values: multiples of 2^-9, |a_small| <= 2^-2); a_big is
//   0 or a ∓ c with |a| > c, so a and c are multiples of 2^-5 and so is a_big, |a_big| < 448.
//   a - a_small is exact (both multiples of 2^-9 below 2^9: at most 18 significant bits).
// - Products with the unscaled weights: a_big * w is a multiple of 2^-6 with |.| < 448 * 6 < 2^12;
//   a_small * w a multiple of 2^-10 with |.| <= 1.5. With N <= 32 products every partial sum of
//   the big chain is a multiple of 2^-6 below 32 * 2^12 = 2^17 (at most 23 significant bits), of
//   the small chain a multiple of 2^-10 below 48 < 2^6 (at most 16 bits): fp32 holds each exactly,
//   so every FFMA (exact product, one rounding of an exactly representable sum) is exact, in any
//   order and for any subset of a group's products (the 16-element halves of gemm_warp_tile).
// - The scaling by 2^-126 keeps this: the values become multiples of 2^-132 and 2^-136, still
//   multiples of fp32's smallest step 2^-149 (denormals are kept: NVRTC runs without ftz), so
//   "a multiple of Q below 2^24 Q is exact" holds unchanged. For the final RN(big + small) with
//   exact sum S * 2^-126: if |S| >= 1 the result is a normal number and rounding commutes with the
//   power-of-two scaling; if |S| < 1, S is a multiple of 2^-10 (at most 10 significant bits) and
//   S * 2^-126 a multiple of 2^-136, both exact. Multiplying back by 2^126 is exact (the result
//   RN(S) is representable). The group scale s_a * s_w is applied after, on the rounded partial,
//   exactly as in the reference.
// - A NaN activation (never produced by act_quant) stays NaN: clamp gives ±c, a - (±c) is NaN.
constexpr float FP4_SPLIT_AT = 0.25f;  // c = 2^-2
template <int N>
__device__ __forceinline__ void fp4_dot(const float* av, const float* wv_scaled, float& big, float& small) {
    constexpr float C = FP4_SPLIT_AT;
    float b = 0.0f, s = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const float a_small = fminf(fmaxf(av[i], -C), C);
        const float a_big = __fsub_rn(av[i], a_small);
        b = __fmaf_rn(a_big, wv_scaled[i], b);
        s = __fmaf_rn(a_small, wv_scaled[i], s);
    }
    big = b;
    small = s;
}

// The fp32 partial of a k-group of G elements whose 16-element parts lie in G / 16 consecutive
// lanes (each holding its part's hi and lo): every lane of the group gets RN_f32(exact sum). A
// 32-group adds its two lanes' halves exactly in fp32 (the exact_dot32 bounds); a 128-group adds
// its eight lanes' hi + lo exactly in f64 (at most 43 significant bits) and rounds once. All 32
// lanes must call it together.
template <int G>
struct LaneGroup;
template <>
struct LaneGroup<32> {
    static __device__ __forceinline__ float partial(float hi, float lo) {
        hi = __fadd_rn(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
        lo = __fadd_rn(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
        return __fadd_rn(hi, lo);
    }
};
template <>
struct LaneGroup<128> {
    static __device__ __forceinline__ float partial(float hi, float lo) {
        double sum = __dadd_rn((double)hi, (double)lo);
#pragma unroll
        for (int offset = 1; offset < 8; offset <<= 1) sum = __dadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
        return __double2float_rn(sum);
    }
};

// The accumulator of one k-group's partial: the fp32 RN(hi + lo) itself for 32-groups, an exact
// f64 sum of the 32-element halves for wider groups (rounded to fp32 once).
template <int G>
struct GroupPartial {
    typedef double type;
    static __device__ __forceinline__ float round(double v) { return __double2float_rn(v); }
};
template <>
struct GroupPartial<32> {
    typedef float type;
    static __device__ __forceinline__ float round(float v) { return v; }
};

// FP8 E4M3 weights [n, k] with one UE8M0 scale per TILE x TILE tile ([ceil(n/T), ceil(k/T)]).
template <int TILE>
struct Fp8Weights {
    // The raw bytes of the 32 weights w[n, col .. col + 32) (col is a multiple of 32), fetched
    // ahead of their use so that the next k-group's load is in flight during this one's math.
    struct Raw {
        uint4 lo, hi;
    };
    static __device__ __forceinline__ Raw fetch32(const u8_t* __restrict__ w, u32_t n, u32_t k, u32_t col) {
        const uint4* src = reinterpret_cast<const uint4*>(w + (size_t)n * k + col);
        return Raw{__ldg(src), __ldg(src + 1)};
    }
    static __device__ __forceinline__ void decode32(const Raw& raw, float* out) {
        decode_e4m3x16(raw.lo, out);
        decode_e4m3x16(raw.hi, out + 16);
    }
    static __device__ __forceinline__ float scale(const u8_t* __restrict__ ws, u32_t n, u32_t col,
                                                  u32_t scale_cols) {
        return e8m0_decode(__ldg(ws + (size_t)(n / TILE) * scale_cols + col / TILE));
    }
    // The 16 weights w[n, col .. col + 16) (col a multiple of 16) of the column-per-warp path.
    typedef uint4 Raw16;
    static __device__ __forceinline__ Raw16 fetch16(const u8_t* __restrict__ w, u32_t n, u32_t k, u32_t col) {
        return __ldg(reinterpret_cast<const uint4*>(w + (size_t)n * k + col));
    }
    static __device__ __forceinline__ void decode16(const Raw16& raw, float* out) { decode_e4m3x16(raw, out); }
    // A group's exact sum as two exact halves (exact_dot32), and the identity on their rounded sum.
    static __device__ __forceinline__ void dot32(const float* av, const float* wv, float& hi, float& lo) {
        exact_dot32(av, wv, hi, lo);
    }
    static __device__ __forceinline__ void dot16(const float* av, const float* wv, float& hi, float& lo) {
        exact_dot16(av, wv, hi, lo);
    }
    static __device__ __forceinline__ float unscale(float partial) { return partial; }
};

// FP4 E2M1 weights packed two per byte ([n, k/2], even column in the low nibble) with one UE8M0
// scale per row and 32 columns ([n, k/32]). decode* gives every weight times 2^-126 (see fp4_dot):
// the code's 3 magnitude bits (e e m) placed at fp32 bits 24..22 and its sign at bit 31 are
// exactly that value (e > 0: exponent field e, mantissa m/2, so (1 + m/2) 2^(e-127); e = 0: the
// denormal m * 2^-127 = (m/2) 2^-126), in 2-3 integer operations instead of a decode by cases.
struct Fp4Weights {
    struct Raw {
        uint4 v;
    };
    // Nibble J (bits 4J .. 4J+3) of `word`, decoded times 2^-126.
    template <int J>
    static __device__ __forceinline__ float nibble_scaled(u32_t word) {
        u32_t magnitude;
        if constexpr (4 * J <= 22) {
            magnitude = word << (22 - 4 * J);
        } else {
            magnitude = word >> (4 * J - 22);
        }
        const u32_t sign = word << (28 - 4 * J);
        return __uint_as_float((magnitude & 0x01c00000u) | (sign & 0x80000000u));
    }
    // The 8 weights of a 32-bit word, in memory order (even column in the low nibble).
    static __device__ __forceinline__ void decode_word(u32_t word, float* out) {
        out[0] = nibble_scaled<0>(word);
        out[1] = nibble_scaled<1>(word);
        out[2] = nibble_scaled<2>(word);
        out[3] = nibble_scaled<3>(word);
        out[4] = nibble_scaled<4>(word);
        out[5] = nibble_scaled<5>(word);
        out[6] = nibble_scaled<6>(word);
        out[7] = nibble_scaled<7>(word);
    }
    static __device__ __forceinline__ Raw fetch32(const u8_t* __restrict__ w, u32_t n, u32_t k, u32_t col) {
        return Raw{__ldg(reinterpret_cast<const uint4*>(w + (size_t)n * (k / 2) + col / 2))};
    }
    static __device__ __forceinline__ void decode32(const Raw& raw, float* out) {
        decode_word(raw.v.x, out);
        decode_word(raw.v.y, out + 8);
        decode_word(raw.v.z, out + 16);
        decode_word(raw.v.w, out + 24);
    }
    static __device__ __forceinline__ float scale(const u8_t* __restrict__ ws, u32_t n, u32_t col,
                                                  u32_t scale_cols) {
        return e8m0_decode(__ldg(ws + (size_t)n * scale_cols + col / 32));
    }
    // The 16 weights w[n, col .. col + 16) (col a multiple of 16: 8 bytes) of the column-per-warp path.
    typedef uint2 Raw16;
    static __device__ __forceinline__ Raw16 fetch16(const u8_t* __restrict__ w, u32_t n, u32_t k, u32_t col) {
        return __ldg(reinterpret_cast<const uint2*>(w + (size_t)n * (k / 2) + col / 2));
    }
    static __device__ __forceinline__ void decode16(const Raw16& raw, float* out) {
        decode_word(raw.x, out);
        decode_word(raw.y, out + 8);
    }
    // A group's (or half group's) exact sum as two exact scaled halves, and RN(big + small) back
    // to the true scale (exact: see fp4_dot).
    static __device__ __forceinline__ void dot32(const float* av, const float* wv, float& big, float& small) {
        fp4_dot<32>(av, wv, big, small);
    }
    static __device__ __forceinline__ void dot16(const float* av, const float* wv, float& big, float& small) {
        fp4_dot<16>(av, wv, big, small);
    }
    static __device__ __forceinline__ float unscale(float partial) {
        return __fmul_rn(partial, __uint_as_float(0x7e800000u));  // 2^126
    }
};

// The rows of one block's tile: tile row r < count reads activation row a_row(r) and writes output
// row y_row(r). DenseRows is [m0, m0 + BM) clipped to m; the routed-expert GEMM (moe/routed.cu)
// gathers up to BM output rows that chose one expert. Rows never interact, so which rows share a
// tile does not change any result.
struct DenseRows {
    u32_t m0;
    u32_t count;
    __device__ __forceinline__ size_t a_row(u32_t r) const { return (size_t)m0 + r; }
    __device__ __forceinline__ size_t y_row(u32_t r) const { return (size_t)m0 + r; }
};

// One block's tile: the rows of `tile` (at most BM) and the output columns of column block
// `col_block`. a: E4M3 codes with rows of p.k; sa: f32 power-of-two scales with rows of p.k / G;
// w, ws: per Weights; y: bf16 with rows of p.n. Requires k % G == 0, G % 32 == 0, 16-byte
// aligned rows (k % 32 == 0). gemm_dense below takes dense rows from the block's grid
// position.
template <class Weights, int G, int BM, class Rows>
__device__ void gemm_block_tile(const u8_t* __restrict__ a, const float* __restrict__ sa,
                                const u8_t* __restrict__ w, const u8_t* __restrict__ ws,
                                __nv_bfloat16* __restrict__ y, GemmParams p, const Rows& tile, u32_t col_block) {
    static_assert(G % 32 == 0, "a k-group is a whole number of 32-element loads");
    static_assert(WARPS * BM <= WARPS * 32, "one summing thread per (column, row)");
    __shared__ float partials[WARPS][BM][33];
    const u32_t wpc = p.warps_per_col;  // validated by the launcher: 1, 2, 4 or 8
    const u32_t cols_per_block = WARPS / wpc;
    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    const u32_t n = col_block * cols_per_block + warp / wpc;
    const u32_t part = warp % wpc;
    const u32_t rows = min((u32_t)BM, tile.count);
    const u32_t kgroups = p.k / G;

    // The thread that accumulates output (sum_col, sum_row) of this block.
    const u32_t sum_col = threadIdx.x / BM;
    const u32_t sum_row = threadIdx.x % BM;
    const u32_t sum_n = col_block * cols_per_block + sum_col;
    const bool summer = sum_col < cols_per_block && sum_row < rows && sum_n < p.n;

    float acc = 0.0f;
    const bool has_col = n < p.n;
    // The first 32 weights of this lane's k-group in the current step, fetched one step ahead.
    typename Weights::Raw next_raw{};
    if (has_col && 32 * part + lane < kgroups) next_raw = Weights::fetch32(w, n, p.k, (32 * part + lane) * G);
    for (u32_t step = 0; step < kgroups; step += 32 * wpc) {
        const u32_t kg = step + 32 * part + lane;
        const typename Weights::Raw first_raw = next_raw;
        const u32_t kg_next = kg + 32 * wpc;
        if (has_col && kg_next < kgroups) next_raw = Weights::fetch32(w, n, p.k, kg_next * G);
        if (has_col && kg < kgroups) {
            // Scales first: their loads overlap the k-group's math instead of following it.
            const float sw = Weights::scale(ws, n, kg * G, p.w_scale_cols);
            float act_scale[BM];
#pragma unroll
            for (int r = 0; r < BM; ++r)
                act_scale[r] = (u32_t)r < rows ? __ldg(sa + tile.a_row(r) * kgroups + kg) : 0.0f;
            // A 32-group's partial is RN(hi + lo); a wider group (G = 128) adds its 32-element
            // halves exactly in f64 (at most 43 significant bits) and rounds once at the end.
            typename GroupPartial<G>::type part_sum[BM];
#pragma unroll
            for (int r = 0; r < BM; ++r) part_sum[r] = 0;
#pragma unroll 1
            for (u32_t sub = 0; sub < (u32_t)G; sub += 32) {
                const u32_t col = kg * G + sub;
                float wv[32];
                Weights::decode32(sub == 0 ? first_raw : Weights::fetch32(w, n, p.k, col), wv);
#pragma unroll
                for (int r = 0; r < BM; ++r) {
                    if ((u32_t)r < rows) {
                        const uint4* src = reinterpret_cast<const uint4*>(a + tile.a_row(r) * p.k + col);
                        float av[32];
                        decode_e4m3x16(__ldg(src), av);
                        decode_e4m3x16(__ldg(src + 1), av + 16);
                        float hi, lo;
                        Weights::dot32(av, wv, hi, lo);
                        if constexpr (G == 32) {
                            part_sum[r] = __fadd_rn(hi, lo);  // the one rounding
                        } else {
                            part_sum[r] = __dadd_rn(part_sum[r], __dadd_rn((double)hi, (double)lo));
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < BM; ++r) {
                if ((u32_t)r < rows)
                    partials[warp][r][lane] = __fmul_rn(
                        __fmul_rn(Weights::unscale(GroupPartial<G>::round(part_sum[r])), act_scale[r]), sw);
            }
        }
        __syncthreads();
        if (summer) {
            for (u32_t chunk = 0; chunk < wpc; ++chunk) {
                const u32_t base = step + 32 * chunk;
                if (base >= kgroups) break;
                const u32_t valid = min(32u, kgroups - base);
                const float* src = partials[sum_col * wpc + chunk][sum_row];
                // Unrolled with a predicate, so the 32 shared loads issue back to back and only the
                // additions form the (K-ordered) dependency chain.
#pragma unroll
                for (u32_t j = 0; j < 32; ++j) {
                    if (j < valid) acc = __fadd_rn(acc, src[j]);
                }
            }
        }
        __syncthreads();
    }
    if (summer) y[tile.y_row(sum_row) * p.n + sum_n] = __float2bfloat16_rn(acc);
}

// The column-per-warp path, for few rows (decode): warp w of the block computes output column
// col_block * WARPS + w for every row of `tile` (at most BM) over the whole K range. Lane l reads
// the 16 elements k0 + 16 l .. + 16 of each 512-element step k0 (one coalesced 512-byte FP8 or
// 256-byte FP4 load per warp, fetched one step ahead), computes its part of the step's k-groups
// for every row, the group's lanes combine their parts exactly (LaneGroup), one lane per group
// writes the scaled partial RN(partial * s_a) * s_w, and lane r adds row r's partials to its
// accumulator in K order, from 0, exactly as gemm_block_tile and the reference do: bitwise the
// same result, with no block-wide barrier and every lane busy when K is a multiple of 512.
template <class Weights, int G, int BM, class Rows>
__device__ void gemm_warp_tile(const u8_t* __restrict__ a, const float* __restrict__ sa,
                               const u8_t* __restrict__ w, const u8_t* __restrict__ ws,
                               __nv_bfloat16* __restrict__ y, GemmParams p, const Rows& tile, u32_t col_block) {
    constexpr u32_t LANE_ELEMS = 16;
    constexpr u32_t STEP = 32 * LANE_ELEMS;
    constexpr u32_t GROUPS = STEP / G;  // k-groups per step
    constexpr u32_t LANES_PER_GROUP = G / LANE_ELEMS;
    static_assert(BM <= 32, "lane r sums row r");
    __shared__ float partials[WARPS][BM][GROUPS + 1];
    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    const u32_t n = col_block * WARPS + warp;
    if (n >= p.n) return;  // whole warps; no block-wide barrier follows
    const u32_t rows = min((u32_t)BM, tile.count);
    const u32_t kgroups = p.k / G;
    float acc = 0.0f;  // lane r < rows: row r's sum
    typename Weights::Raw16 next{};
    if (LANE_ELEMS * lane < p.k) next = Weights::fetch16(w, n, p.k, LANE_ELEMS * lane);
    for (u32_t k0 = 0; k0 < p.k; k0 += STEP) {
        const u32_t col = k0 + LANE_ELEMS * lane;
        // k % G == 0 and col % 16 == 0: a group's lanes are all active or all idle.
        const bool active = col < p.k;
        const typename Weights::Raw16 raw = next;
        if (col + STEP < p.k) next = Weights::fetch16(w, n, p.k, col + STEP);
        const u32_t kg = col / G;
        float wv[LANE_ELEMS];
        float sw = 0.0f;
        if (active) {
            Weights::decode16(raw, wv);
            sw = Weights::scale(ws, n, col, p.w_scale_cols);
        }
#pragma unroll
        for (int r = 0; r < BM; ++r) {
            if ((u32_t)r < rows) {  // uniform over the warp: every lane reaches the shuffles
                float hi = 0.0f, lo = 0.0f, act_scale = 0.0f;
                if (active) {
                    float av[LANE_ELEMS];
                    decode_e4m3x16(__ldg(reinterpret_cast<const uint4*>(a + tile.a_row(r) * p.k + col)), av);
                    Weights::dot16(av, wv, hi, lo);
                    act_scale = __ldg(sa + tile.a_row(r) * kgroups + kg);
                }
                const float partial = Weights::unscale(LaneGroup<G>::partial(hi, lo));
                if (active && lane % LANES_PER_GROUP == 0)
                    partials[warp][r][lane / LANES_PER_GROUP] = __fmul_rn(__fmul_rn(partial, act_scale), sw);
            }
        }
        __syncwarp();
        if (lane < rows) {
            const u32_t valid = min(GROUPS, (p.k - k0) / G);
            const float* src = partials[warp][lane];
#pragma unroll
            for (u32_t j = 0; j < GROUPS; ++j) {
                if (j < valid) acc = __fadd_rn(acc, src[j]);
            }
        }
        __syncwarp();  // the partials are rewritten by the next step
    }
    if (lane < rows) y[tile.y_row(lane) * p.n + n] = __float2bfloat16_rn(acc);
}

// The tile of this block's grid position: rows from blockIdx.x * BM (< p.m by the grid), column
// block blockIdx.y. COLUMN_PER_WARP: gemm_warp_tile (columns blockIdx.y * WARPS ..), else
// gemm_block_tile; the same sums in the same order.
template <class Weights, int G, int BM, bool COLUMN_PER_WARP>
__device__ void gemm_dense(const u8_t* __restrict__ a, const float* __restrict__ sa,
                           const u8_t* __restrict__ w, const u8_t* __restrict__ ws,
                           __nv_bfloat16* __restrict__ y, GemmParams p) {
    const u32_t m0 = blockIdx.x * BM;
    if constexpr (COLUMN_PER_WARP) {
        gemm_warp_tile<Weights, G, BM>(a, sa, w, ws, y, p, DenseRows{m0, p.m - m0}, blockIdx.y);
    } else {
        gemm_block_tile<Weights, G, BM>(a, sa, w, ws, y, p, DenseRows{m0, p.m - m0}, blockIdx.y);
    }
}

}  // namespace gemm

// A dense GEMM kernel of gemm_fp8.cu / gemm_fp4.cu: NAME(a, sa, w, ws, y, p) runs gemm_dense
// with 8 rows per block, at least MIN_BLOCKS blocks per SM.
#define GEMM_DENSE(NAME, WEIGHTS, G, COLUMN_PER_WARP, MIN_BLOCKS)                                    \
    extern "C" __global__ void __launch_bounds__(gemm::WARPS * 32, MIN_BLOCKS)                       \
        NAME(const u8_t* a, const float* sa, const u8_t* w, const u8_t* ws, __nv_bfloat16* y,      \
             GemmParams p) {                                                                          \
        grid_dependency_sync();                                                                       \
        gemm::gemm_dense<WEIGHTS, G, 8, COLUMN_PER_WARP>(a, sa, w, ws, y, p);                       \
    }
