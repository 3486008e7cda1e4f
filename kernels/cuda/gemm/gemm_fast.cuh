// The `fast` block-scaled GEMMs (ARCHITECTURE.md §3): tensor cores on E4M3 with fp32 sums and
// DeepGEMM-style promotion once per scale group along K:
//
//   P_p = 0;  for every k-group g of K part p, in K order:  P_p = fma( T_g(m, n), s_w(n, g) * s_a(m, g), P_p )
//   y[m, n] = out( (((P_0 + P_1) + P_2) + ...) )
//
// where out() is the launch's output (params' `store`, STORE_*): bf16 rounded to nearest even
// (V4.1's rounding point), that bf16 value widened into f32 storage (V4.1's rounding point for an
// f32 tensor, with no conversion launch after the GEMM), or the fp32 sum as it is (V4's float32
// linears); the sum is the same, so a bf16 output is always its f32 output rounded once.
//
// The K parts are consecutive spans of `span` codes (a multiple of 512; the last part may be
// shorter), a function of the weight's shape alone (ops/gemm_fast.rs, `k_parts`), and every tile,
// decode or prefill, computes the same parts and adds them in the same order, in one of two ways:
// - split: one block per part and column block, its P_p stored to partials in fp32 and
//   gemm_fast_reduce adding them in part order (decode sizes: every SM then streams weights);
// - folded (the 128-row tiles, FOLDS, where the launch's blocks fill the SMs without cutting K:
//   the launcher's rule, ops/gemm_fast.rs `folds`): one block computes P_0, P_1, ... one after
//   the other, each from zero as a split block does, keeps total = P_0, total = total + P_p
//   (__fadd_rn, part order) in shared memory and stores out(total) once: the reduction's
//   operations in its order, without the partials or its launch.
// A dense launch may take two weights of one shape (the shared expert's w1 and w3:
// gemm_fast_dense), each computed into its own plane of y as it is alone.
// The routed experts' production launches use one part (enough blocks per expert); their
// kernels take parts as the dense ones do (for the benchmark's sweep).
// T_g is the tensor core's fp32 sum of the group's exact products of E4M3 activations and E4M3
// weights, started from zero: one k32 MMA for a 32-group, a chain of four in K order for a
// 128-group. On sm_90a that MMA is the warpgroup MMA (gemm/wgmma.cuh: Hopper's native FP8 path;
// its mma.sync e4m3 form is an f16 emulation), elsewhere mma.sync m16n8k32; every tile of one
// device uses the same one. Two weight formats share this one body:
// - Fp8Chunks<G>: FP8 E4M3 weights with UE8M0 scales per G x G tile (expanded at upload to f32 per
//   16-row band and k-group);
// - Fp4Chunks: FP4 E2M1 weights with one UE8M0 scale per row and 32 columns (the routed experts).
//   Every E2M1 value times 2^-6 is exactly an E4M3 value, so each code is converted to that
//   E4M3 byte in registers (a few bit operations, exact), the same MMA runs, and the weight scale
//   is applied times 2^6; T_g is then 2^-6 times the sum for FP8 weights of the codes' values,
//   and the promotion's product the same.
// The weights are the MMA's A operand (16 output features per warp, from registers), the
// activation rows its B operand (8 tokens per n8 tile, from shared memory), so decode shapes
// (M = 1 ... 64) waste no weight bytes. A code's k slot in the MMA is its place in the group
// (thread t of a quad holds the codes 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3 of its rows).
//
// Token rows: DenseRows (rows [m0, m0 + BT) of y = a · wᵀ) or the routed experts' GatheredRows
// (a tile of up to BT rows of one expert from group_routed_rows, moe/routed.cu: output row j
// reads activation row j / x_row_div; the expert's weights come from the device table).
//
// Batch invariance: an output's value depends only on its activation row, its weight row and the
// fixed K loop (groups in order); the tile shape (tokens per block BT, warps per block) and which
// rows share a tile change which thread computes it, never how. Every launch shape gives the
// same bits: a row alone, inside any batch, in a prefill tile or in any expert tile (the GPU
// tests check it).
//
// Weights are re-laid at upload (ops/gemm_fast.rs, fragment_chunks): per 16-row band and 128
// codes of K one contiguous chunk in A fragment order ([group j][lane][row g: PIECE / 2 bytes,
// row g + 8: PIECE / 2 bytes], PIECE = 16 bytes for FP8, 8 for FP4), so a warp reads a group's
// A fragment with one conflict-free shared load; rows past N and K are zero.
//
// Pipeline: STAGES slots of shared memory, each holding the block's weight chunks and activation
// rows for STEP codes of K (the rows as the MMA's K-major B: [STEP / 16][BT rows][16 codes], 8
// rows of 16 codes a contiguous core matrix), the activations' scales of those groups
// ([groups][BT + 4] f32) and the weights' scales per band, filled by cp.async STAGES - 1 steps
// ahead. On sm_90a each warpgroup keeps two sets of group sums, the next group's wgmma running
// while a group is promoted. FP8 tiles of 32 tokens or more form each group's scale products
// once per warp, after the stages (gemm_fast_tile, PRODUCTS); a folding tile's running totals
// come after them (FOLDS). Out-of-range rows, features and
// groups are zero-filled and never stored. In a routed expert's tile (often part full) only the
// n8 token tiles that hold a row, rounded up to a quarter of the tile, load, multiply and store:
// a tile costs about the rows it has, its weights are still read once.
#pragma once
#include "common/compile_time.cuh"
#include "common/grid_dependency.cuh"
#include "common/numerics.cuh"
#include "gemm/wgmma.cuh"

namespace fastgemm {

constexpr u32_t STEP_K = 128;  // K codes of one weight chunk

// d = A (16 x 32, row) * B (32 x 8, col) + c, E4M3 inputs, fp32 accumulation.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const u32_t (&a)[4], u32_t b0, u32_t b1,
                                         const float (&c)[4]) {
    asm(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// The launches' output stores (params' `store`; FastOutput in ops/gemm_fast.rs).
constexpr u32_t STORE_BF16 = 0;         // bf16, rounded to nearest even
constexpr u32_t STORE_F32 = 1;          // f32, the sum as it is
constexpr u32_t STORE_BF16_IN_F32 = 2;  // f32 holding the bf16-rounded value

// y[i] = v as the launch's output `store`.
__device__ __forceinline__ void store_out(void* y, size_t i, float v, u32_t store) {
    if (store == STORE_BF16) {
        static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(v);
    } else if (store == STORE_F32) {
        static_cast<float*>(y)[i] = v;
    } else {
        static_cast<float*>(y)[i] = __bfloat162float(__float2bfloat16_rn(v));
    }
}

// FP8 weights: a lane's piece of a group is 16 bytes (row g's codes 4t .. 4t + 3 and 16 + 4t ..
// 16 + 4t + 3, then row g + 8's: the A fragment's registers 0, 2, 1, 3); the scale of a
// band and k-group is one f32 (a G x G tile covers the band's 16 rows).
template <int G>
struct Fp8Chunks {
    static constexpr u32_t PIECE = 16;
    static constexpr u32_t SCALE_BYTES = 4;
    static constexpr bool BAND_SCALE = true;  // one scale for the band's 16 rows (gemm_fast_tile's products)
    // The A fragment of a piece: row g's codes 4t .. and 16 + 4t .., then row g + 8's.
    static __device__ __forceinline__ void fragment(const u8_t* piece, u32_t (&frag)[4]) {
        const uint4 v = *reinterpret_cast<const uint4*>(piece);
        frag[0] = v.x;
        frag[1] = v.z;
        frag[2] = v.y;
        frag[3] = v.w;
    }
    // The weight scales of rows g and g + 8 of the band for the stage's group gq.
    static __device__ __forceinline__ float2 scales(const u8_t* band_scales, u32_t gq, u32_t /*g*/) {
        const float s = reinterpret_cast<const float*>(band_scales)[gq];
        return make_float2(s, s);
    }
};

// The 8 E2M1 codes of `w` as E4M3 bytes worth 2^-6 times their value: the low nibbles' codes in
// `lo`, the high nibbles' in `hi` (byte i of each from byte i of w). The upload puts a row's codes
// 4t + i in the low nibble of byte i and 16 + 4t + i in its high nibble (ops/gemm_fast.rs,
// fp4_piece_order): `lo` and `hi` are then the A fragment's two registers of that row. An E2M1
// code s|ee|m placed as the E4M3 byte s|00ee|m00 is that value exactly: ee = 0 gives the E4M3
// subnormal m 2^-1 2^-6 (E2M1's
// subnormal m 2^-1), ee > 0 the normal (1 + m/2) 2^(ee - 7) = 2^-6 (1 + m/2) 2^(ee - 1). The
// factor 2^6 goes back with the weight scale (Fp4Chunks::scales): the products, and so the tensor
// core's sum from zero, are exactly 2^-6 times those of the codes' values.
__device__ __forceinline__ void e2m1x8_to_e4m3(u32_t w, u32_t& lo, u32_t& hi) {
    lo = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1c1c1c1cu);
    hi = (w & 0x80808080u) | ((w >> 2) & 0x1c1c1c1cu);
}

// 2^6 times the UE8M0 scale e, 2^(e - 121), in f32: its exponent field is e + 6 (2^-127's as well:
// the subnormal times 2^6 is normal), past 254 the product's overflow, +inf (255, NaN, never
// occurs in checkpoints).
__device__ __forceinline__ float e8m0_times_64(u8_t e) { return __uint_as_float(min((u32_t)e + 6u, 255u) << 23); }

// FP4 weights: a lane's piece of a group is 8 bytes (the 4 packed bytes of row g's codes 4t ..
// 4t + 3 and 16 + 4t .. 16 + 4t + 3 in e2m1x8_to_e4m3's order, then row g + 8's); the scales of
// a band and k-group are the 16 rows' UE8M0 bytes, applied times 2^6 (the conversion's factor,
// e8m0_times_64).
struct Fp4Chunks {
    static constexpr u32_t PIECE = 8;
    static constexpr u32_t SCALE_BYTES = 16;
    static constexpr bool BAND_SCALE = false;  // a scale per row
    static __device__ __forceinline__ void fragment(const u8_t* piece, u32_t (&frag)[4]) {
        const uint2 v = *reinterpret_cast<const uint2*>(piece);
        e2m1x8_to_e4m3(v.x, frag[0], frag[2]);
        e2m1x8_to_e4m3(v.y, frag[1], frag[3]);
    }
    static __device__ __forceinline__ float2 scales(const u8_t* band_scales, u32_t gq, u32_t g) {
        return make_float2(e8m0_times_64(band_scales[16 * gq + g]), e8m0_times_64(band_scales[16 * gq + g + 8]));
    }
};

// acc[r] += c[r] * s(r), the promotion of one group's tensor-core sum with the scale products
// s(r) = s_w(row of r) * s_a(token of r): r = 0, 1 are row g (`s_g`), r = 2, 3 row g + 8 (`s_g8`);
// r = 0, 2 token 2t (.x), r = 1, 3 token 2t + 1 (.y) of the n8 tile.
__device__ __forceinline__ void promote(float (&acc)[4], const float (&c)[4], float2 s_g, float2 s_g8) {
    acc[0] = __fmaf_rn(c[0], s_g.x, acc[0]);
    acc[1] = __fmaf_rn(c[1], s_g.y, acc[1]);
    acc[2] = __fmaf_rn(c[2], s_g8.x, acc[2]);
    acc[3] = __fmaf_rn(c[3], s_g8.y, acc[3]);
}

// N consecutive f32 of shared memory, one vector load or store.
template <u32_t N>
struct alignas(4 * N) Floats {
    float v[N];
};

// Stores the n8 tile's sums acc of output features n0 + 16 w + g (+ 8) and token rows 2t, 2t + 1
// (+ 8 i): to `partial` (f32 [*, n]) when it is not null, else to y as the launch's output.
template <class Rows>
__device__ __forceinline__ void store_tile(const float (&acc)[4], u32_t feature, u32_t row0, const Rows& rows,
                                           u32_t n, void* y, u32_t store, float* partial) {
#pragma unroll
    for (u32_t r = 0; r < 4; ++r) {
        const u32_t col = feature + (r / 2) * 8;
        const u32_t row = row0 + r % 2;
        if (col < n && rows.valid(row)) {
            if (partial != nullptr) {
                partial[rows.y_row(row) * n + col] = acc[r];
            } else {
                store_out(y, rows.y_row(row) * n + col, acc[r], store);
            }
        }
    }
}

// Shared-memory layout of one stage of STEP codes of K: the block's weight chunks, the token rows
// as the MMA's K-major B ([STEP / 16][BT][16 codes]: 8 rows of 16 codes a contiguous core
// matrix, the next 16 codes BT * 16 bytes on), their scales ([STEP / G][SA_ROW] f32: a token
// pair's two scales one 8-byte load; rows of BT + 4 so that a warp's copies of 4 rows' 8 groups
// hit 32 banks) and the bands' weight scales ([WARPS][STEP / G]).
template <class W, int G, int WARPS, int BT, int STEP>
struct Stage {
    static constexpr u32_t CHUNK = 128 * W::PIECE;  // one band's weights of STEP_K codes
    static constexpr u32_t SUB = STEP / STEP_K;     // weight chunks per band and stage
    static constexpr u32_t GPS = STEP / G;          // groups per stage
    static constexpr u32_t HALF = BT * 16;          // one 16-code column of B
    static constexpr u32_t SA_ROW = BT + 4;         // f32 per group of the scales
    static constexpr u32_t W_OFF = 0;
    static constexpr u32_t B_OFF = W_OFF + WARPS * SUB * CHUNK;
    static constexpr u32_t SA_OFF = B_OFF + BT * STEP;
    static constexpr u32_t SW_OFF = SA_OFF + 4 * SA_ROW * GPS;  // a multiple of 16 (BT % 8 == 0)
    static constexpr u32_t BYTES = (SW_OFF + W::SCALE_BYTES * WARPS * GPS + 15) / 16 * 16;
};

// A share of COUNT items over WORKERS workers in a strided loop's order: worker x's item i < PER
// is x + i WORKERS, which exists unless past COUNT (only in a last, partial round: a test of the
// worker alone).
template <u32_t COUNT, u32_t WORKERS>
struct Share {
    static constexpr u32_t PER = (COUNT + WORKERS - 1) / WORKERS;
    static __device__ __forceinline__ u32_t item(u32_t x, u32_t i) { return x + i * WORKERS; }
    static __device__ __forceinline__ bool has(u32_t x, u32_t i) {
        return (i + 1) * WORKERS <= COUNT || item(x, i) < COUNT;
    }
};

// The least power of two not below n.
constexpr u32_t pow2_ceil(u32_t n) { return n <= 1 ? 1 : 2 * pow2_ceil((n + 1) / 2); }

// The token rows of a dense launch: rows [m0, m0 + BT) of y = a · wᵀ, clipped to m.
struct DenseRows {
    static constexpr bool PART_FULL = false;  // tiles are full but the last
    u32_t m0;
    u32_t m;
    u32_t y0;  // y's row of m0: plane p's rows start at p m ([planes][m][n])
    __device__ __forceinline__ bool valid(u32_t r) const { return m0 + r < m; }
    __device__ __forceinline__ size_t a_row(u32_t r) const { return m0 + r; }
    __device__ __forceinline__ size_t y_row(u32_t r) const { return y0 + r; }
};

// The token rows of one routed tile: tile row r < count writes output row rows[r] and reads
// activation row a_rows[r] (rows[r] / x_row_div; both in shared memory, written before the body
// runs).
struct GatheredRows {
    static constexpr bool PART_FULL = true;  // an expert's tile holds 1 .. BT rows
    const u32_t* rows;
    const u32_t* a_rows;
    u32_t count;
    __device__ __forceinline__ bool valid(u32_t r) const { return r < count; }
    __device__ __forceinline__ size_t a_row(u32_t r) const { return a_rows[r]; }
    __device__ __forceinline__ size_t y_row(u32_t r) const { return rows[r]; }
};

// The sums of one group for RUN n8 token tiles, from zero: T (d) = the LINKS k32 MMAs of the
// group's A fragments `frag` (in K order) against B at `b` (the group's first 16-code column of
// the stage; the next is Stage::HALF bytes on, the next k32 two columns on). On sm_90a one
// warpgroup MMA per k32 over all RUN tiles (the warpgroup's four warps issue it together),
// committed as one group and left in flight: d is complete after wgmma::wait (the caller's).
// Elsewhere mma.sync per k32 and n8 tile (B's fragment: token g's codes 4t .. and 16 + 4t ..),
// complete on return.
template <u32_t RUN, u32_t LINKS, u32_t HALF>
__device__ __forceinline__ void group_sums(float (&d)[RUN][4], const u32_t (&frag)[LINKS][4], const u8_t* b, u32_t g,
                                           u32_t t) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wgmma::fence();  // the fragments, and d's last reads, before the wgmmas
#pragma unroll
    for (u32_t j = 0; j < LINKS; ++j) {
        const unsigned long long desc = wgmma::desc(b + 2 * j * HALF, HALF, 128);
        if (j == 0) {
            wgmma::E4m3<8 * RUN>::template run<0>(d, frag[j], desc);  // from zero
        } else {
            wgmma::E4m3<8 * RUN>::template run<1>(d, frag[j], desc);
        }
    }
    wgmma::commit();
#else
#pragma unroll
    for (u32_t i = 0; i < RUN; ++i) d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.0f;
#pragma unroll
    for (u32_t j = 0; j < LINKS; ++j) {
#pragma unroll
        for (u32_t i = 0; i < RUN; ++i) {
            const u8_t* row = b + 2 * j * HALF + (8 * i + g) * 16 + 4 * t;
            const u32_t b0 = *reinterpret_cast<const u32_t*>(row);
            const u32_t b1 = *reinterpret_cast<const u32_t*>(row + HALF);
            mma_e4m3(d[i], frag[j], b0, b1, d[i]);
        }
    }
#endif
}

// One block's tile: output features [n0, n0 + 16 WARPS) of the BT token rows `rows` over the K
// codes [k_begin, k_end): one part (k_begin a multiple of `span`, k_end = min(k, k_begin +
// span)) or, with FOLDS, consecutive parts of `span` codes from k_begin (the last ending at
// k_end), each summed from zero and added in part order (total = P_0; total = total + P_p). STEP
// codes of K per pipeline stage (a multiple of 128 dividing `span`: only how much each barrier
// covers, never the order of any addition). a: E4M3 activation codes [*, k]; sa: f32 [*, k / G];
// w: weight chunks [ceil(n / 16)][ceil(k / 128)][CHUNK]; ws: weight scales per band
// [ceil(n / 16)][k / G][SCALE_BYTES]; the sums (a part's, or the total of the parts) go to
// `partial` (f32 [*, n]) when it is not null, else to y ([*, n], as `store` says). k % G == 0,
// k % 32 == 0. WARPS is a multiple of 4 (whole warpgroups); every warp runs every group, bands
// past n on zero weights.
template <class W, int G, int WARPS, int BT, int STAGES, int STEP, bool FOLDS, class Rows>
__device__ void gemm_fast_tile(const u8_t* __restrict__ a, const float* __restrict__ sa,
                               const u8_t* __restrict__ w, const u8_t* __restrict__ ws, void* __restrict__ y,
                               u32_t store, float* __restrict__ partial, u32_t n, u32_t k, u32_t k_begin,
                               u32_t k_end, u32_t span, u32_t n0, const Rows& rows) {
    static_assert(G == 32 || G == 128, "32- or 128-groups");
    static_assert(BT % 8 == 0 && STAGES >= 2 && STEP % STEP_K == 0, "tile");
    static_assert(WARPS % 4 == 0, "whole warpgroups");
    typedef Stage<W, G, WARPS, BT, STEP> L;
    constexpr u32_t THREADS = WARPS * 32;
    constexpr u32_t TILES = BT / 8;  // n8 token tiles per warp
    constexpr u32_t LINKS = G / 32;  // k32 MMAs per group
    constexpr u32_t CHUNK = L::CHUNK;
    // With one weight scale per band and group (W::BAND_SCALE), the 8 lanes of one t would each
    // form the same scale products s_w * s_a of their tokens. In tiles of 32 tokens or more the
    // warp forms its band's products of a group once instead, PER a lane, into shared memory
    // after the stages ([WARPS][2][BT] f32: two groups, as the two sets of sums; ops/gemm_fast.rs,
    // products_bytes, sizes the launch so) in the promotion's order: place 16 j + 4 t + 2 h + e
    // holds token 8 (2 j + h) + 2 t + e, so thread t reads its products of n8 tiles 2j and
    // 2j + 1 in one 16-byte load. The same multiply of the same operands: the same bits. The
    // 8-token tile forms its own (fewer instructions there).
    constexpr bool PRODUCTS = W::BAND_SCALE && BT >= 32;
    constexpr u32_t PER = BT / 32;
    constexpr u32_t PAIR = PER < 2 ? PER : 2;  // consecutive tokens of a lane's places
    // Shared memory after the stages: the products ([WARPS][2][BT] f32, PRODUCTS), then a
    // folding tile's running totals of its finished parts: [TILES][THREADS] float4, thread x's
    // sums acc[i] at i THREADS + x (its own slots: no barrier; ops/gemm_fast.rs, totals_bytes).
    constexpr u32_t PRODUCTS_BYTES = PRODUCTS ? WARPS * 2 * BT * 4 : 0;
    extern __shared__ __align__(16) u8_t smem[];

    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    const u32_t g = lane / 4;
    const u32_t t = lane % 4;
    // The token of lane l's first place, l PER (PRODUCTS); place l PER + 2 h + e has token + 8 h + e.
    const u32_t q = lane * PER;
    const u32_t p_token = 16 * (q / 16) + 8 * (q / 2 % 2) + 2 * (q / 4 % 4) + q % 2;
    const u32_t groups = k / G;
    const u32_t bands = (n + 15) / 16;
    const u32_t chunks = (k + STEP_K - 1) / STEP_K;  // per band
    const u32_t step0 = k_begin / STEP;
    const u32_t steps = (k_end + STEP - 1) / STEP - step0;  // of this part
    // The n8 token tiles the block runs: where tiles are often part full (Rows::PART_FULL: an
    // expert's rows), those holding a row rounded up to a quarter of TILES, each count its own
    // compiled loop with no test inside (the rows present are uniform over the block, so no
    // thread diverges): a partial tile's loads, multiplies and stores cost its quarters. Dense
    // tiles run one loop over all TILES (one copy of the code; only their last rows are short).
    constexpr u32_t QUARTER = TILES >= 4 ? TILES / 4 : 1;
    u32_t run_tiles = TILES;
    if constexpr (Rows::PART_FULL) run_tiles = (rows.count + 8 * QUARTER - 1) / (8 * QUARTER) * QUARTER;

    // The K loop over RUN (a compile-time count, Const<RUN>) n8 token tiles.
    auto run = [&](auto count) {
        constexpr u32_t RUN = decltype(count)::value;
        constexpr u32_t RUN_ROWS = 8 * RUN;
        // The stage's copies, each kind a compile-time count a thread. Which thread copies which
        // bytes is fixed here, before the K loop, with each copy's source at the part's first
        // stage, its place in a slot and its row or band test: a stage adds its offsets (along K
        // and its slot's), and only a stage that reaches past K tests where its copies lie. A
        // copy that fails a test zero-fills and reads nothing; its source stays on row or band 0
        // of the operand, so that a stage's offset keeps it inside.
        //
        // Weights: warp w copies band n0 / 16 + w's chunks of the stage, 16 bytes a lane a copy
        // (512 contiguous bytes a warp), copy i 512 i bytes on.
        constexpr u32_t W_COPIES = L::SUB * CHUNK / 512;
        const bool w_ok = n0 / 16 + warp < bands;
        const u8_t* const w_src =
            w + ((size_t)(w_ok ? n0 / 16 + warp : 0) * chunks + step0 * L::SUB) * CHUNK + lane * 16;
        const u32_t w_dst = L::W_OFF + warp * L::SUB * CHUNK + lane * 16;
        // Activation rows: 16 codes a copy, two consecutive threads on the 32 bytes of a row
        // (one global sector), the pairs on consecutive rows. Pair x = threadIdx.x / 2 takes the
        // tasks q = x + j PAIRS (Share) of the stage's ROWS_P rows of STEP / 32 pieces: task q
        // is row q % ROWS_P, codes 32 (q / ROWS_P) .., with ROWS_P the power of two from
        // RUN_ROWS (rows past RUN_ROWS are not copied). One of ROWS_P and PAIRS divides the
        // other, so task j lies R PAIRS rows and COL codes past the pair's first (both known at
        // compile time): a pair has one row, or A_ROWS where ROWS_P > PAIRS, each with its
        // source set once.
        constexpr u32_t PAIRS = THREADS / 2;
        constexpr u32_t ROWS_P = pow2_ceil(RUN_ROWS);
        static_assert(ROWS_P % PAIRS == 0 || PAIRS % ROWS_P == 0, "a pair's rows");
        typedef Share<ROWS_P * STEP / 32, PAIRS> ATasks;
        constexpr u32_t A_ROWS = ROWS_P > PAIRS ? ROWS_P / PAIRS : 1;
        const u32_t pair = threadIdx.x / 2;
        const u32_t a_col = (2 * (pair / ROWS_P) + threadIdx.x % 2) * 16;
        const u8_t* a_src[A_ROWS];
        bool a_ok[A_ROWS];
        auto set_a = [&](auto index) {
            constexpr u32_t r = decltype(index)::value;
            const u32_t row = pair % ROWS_P + r * PAIRS;
            a_ok[r] = row < RUN_ROWS && rows.valid(row);
            a_src[r] = a + (a_ok[r] ? rows.a_row(row) : 0) * k + step0 * STEP + a_col;
        };
        unrolled<0, A_ROWS>(set_a);
        const u32_t a_dst = L::B_OFF + a_col / 16 * L::HALF + pair % ROWS_P * 16;
        // Activation scales: a row's scales of the stage's groups from consecutive threads (one
        // sector): copy c = threadIdx.x + i THREADS (Share) is row c / GPS's of group c % GPS,
        // its source kept as f32 from sa (rows m: m k / G < 2^32).
        typedef Share<RUN_ROWS * L::GPS, THREADS> SaCopies;
        u32_t sa_at[SaCopies::PER];
        bool sa_ok[SaCopies::PER];
        auto set_sa = [&](auto index) {
            constexpr u32_t i = decltype(index)::value;
            const u32_t row = SaCopies::item(threadIdx.x, i) / L::GPS;
            sa_ok[i] = rows.valid(row);
            sa_at[i] = (sa_ok[i] ? (u32_t)rows.a_row(row) : 0) * groups + step0 * L::GPS + threadIdx.x % L::GPS;
        };
        unrolled<0, SaCopies::PER>(set_sa);
        const u32_t sa_dst = L::SA_OFF + 4 * (threadIdx.x % L::GPS * L::SA_ROW + threadIdx.x / L::GPS);
        // Weight scales: thread c < WARPS GPS copies band n0 / 16 + c / GPS's of group c % GPS.
        static_assert(WARPS * L::GPS <= THREADS, "a weight scale copy a thread");
        const bool sw_has = threadIdx.x < WARPS * L::GPS;
        const bool sw_ok = n0 / 16 + threadIdx.x / L::GPS < bands;
        const u8_t* const sw_src =
            ws + ((size_t)(sw_ok ? n0 / 16 + threadIdx.x / L::GPS : 0) * groups + step0 * L::GPS + threadIdx.x % L::GPS) *
                     W::SCALE_BYTES;
        const u32_t sw_dst = L::SW_OFF + W::SCALE_BYTES * threadIdx.x;
        const u32_t smem_at = (u32_t)__cvta_generic_to_shared(smem);

        // Stage `local` of the part into slot `slot`: the rows past RUN_ROWS are never read.
        auto load_stage = [&](u32_t local, u32_t slot) {
            const u32_t base = smem_at + slot * L::BYTES;
            const u32_t step = step0 + local;
            // IN_K: the stage lies inside K (all but a part's last do).
            auto copies = [&](auto in_k) {
                constexpr bool IN_K = decltype(in_k)::value != 0;
                const u8_t* const w_at = w_src + (size_t)local * L::SUB * CHUNK;
                auto copy_w = [&](auto index) {
                    constexpr u32_t i = decltype(index)::value;
                    const u8_t* src = w_at + 512 * i;
                    bool ok = w_ok;
                    if constexpr (!IN_K) {
                        ok = ok && step * L::SUB + 512 * i / CHUNK < chunks;
                        src = ok ? src : w;
                    }
                    cp_async16(base + w_dst + 512 * i, src, ok);
                };
                unrolled<0, W_COPIES>(copy_w);
                const u8_t* a_at[A_ROWS];
#pragma unroll
                for (u32_t r = 0; r < A_ROWS; ++r) a_at[r] = a_src[r] + local * STEP;
                auto copy_a = [&](auto index) {
                    constexpr u32_t j = decltype(index)::value;
                    constexpr u32_t R = j * PAIRS % ROWS_P / PAIRS;
                    constexpr u32_t COL = 32 * (j * PAIRS / ROWS_P);
                    if (!ATasks::has(pair, j)) return;
                    if (ROWS_P > RUN_ROWS && pair % ROWS_P + R * PAIRS >= RUN_ROWS) return;
                    const u8_t* src = a_at[R] + COL;
                    bool ok = a_ok[R];
                    if constexpr (!IN_K) {
                        ok = ok && step * STEP + a_col + COL < k;
                        src = ok ? src : a;
                    }
                    cp_async16(base + a_dst + COL / 16 * L::HALF + R * PAIRS * 16, src, ok);
                };
                unrolled<0, ATasks::PER>(copy_a);
                auto copy_sa = [&](auto index) {
                    constexpr u32_t i = decltype(index)::value;
                    if (!SaCopies::has(threadIdx.x, i)) return;
                    const float* src = sa + (sa_at[i] + local * L::GPS);
                    bool ok = sa_ok[i];
                    if constexpr (!IN_K) {
                        ok = ok && step * L::GPS + threadIdx.x % L::GPS < groups;
                        src = ok ? src : sa;
                    }
                    cp_async4(base + sa_dst + 4 * (i * THREADS / L::GPS), src, ok);
                };
                unrolled<0, SaCopies::PER>(copy_sa);
                if (sw_has) {
                    const u8_t* src = sw_src + local * L::GPS * W::SCALE_BYTES;
                    bool ok = sw_ok;
                    if constexpr (!IN_K) {
                        ok = ok && step * L::GPS + threadIdx.x % L::GPS < groups;
                        src = ok ? src : ws;
                    }
                    if constexpr (W::SCALE_BYTES == 16) {
                        cp_async16(base + sw_dst, src, ok);
                    } else {
                        cp_async4(base + sw_dst, src, ok);
                    }
                }
            };
            if ((step + 1) * STEP <= k) {
                copies(Const<1>{});
            } else {
                copies(Const<0>{});
            }
        };

        float acc[RUN][4];
#pragma unroll
        for (u32_t i = 0; i < RUN; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        // Set gq % 2 of the warp's scale products (PRODUCTS), after the stages.
        auto products = [&](u32_t gq) {
            return reinterpret_cast<float*>(smem + STAGES * L::BYTES) + (warp * 2 + gq % 2) * BT;
        };
        // The thread's running total of n8 tile i (FOLDS).
        auto total = [&](u32_t i) {
            return reinterpret_cast<float4*>(smem + STAGES * L::BYTES + PRODUCTS_BYTES) + i * THREADS + threadIdx.x;
        };
        // acc plus the total before it, in gemm_fast_reduce's order: total + P_p.
        auto add_total = [&](u32_t i) {
            const float4 t = *total(i);
            return make_float4(__fadd_rn(t.x, acc[i][0]), __fadd_rn(t.y, acc[i][1]), __fadd_rn(t.z, acc[i][2]),
                               __fadd_rn(t.w, acc[i][3]));
        };
        // FOLDS: stages of a part; the block's parts start at k_begin, a part's end (but the
        // block's last) is a stage's end, and after it its sums join the total (total = P_0, then
        // total + P_p) and acc starts the next part from zero.
        const u32_t part_steps = span / STEP;
        [[maybe_unused]] u32_t part_left = part_steps;
        auto fold = [&](bool first) {
#pragma unroll
            for (u32_t i = 0; i < RUN; ++i) {
                *total(i) = first ? make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]) : add_total(i);
                acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
            }
        };

#pragma unroll
        for (u32_t s = 0; s + 1 < (u32_t)STAGES; ++s) {
            if (s < steps) load_stage(s, s);
            cp_async_commit();
        }
        for (u32_t step = 0; step < steps; ++step) {
            cp_async_wait<STAGES - 2>();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
            wgmma::fence_proxy_async();  // this thread's copies, visible to the wgmmas' reads
#endif
            __syncthreads();  // this stage is in; every thread is done with the slot refilled below
            const u32_t next = step + STAGES - 1;
            if (next < steps) load_stage(next, next % STAGES);
            cp_async_commit();

            const u8_t* base = smem + (step % STAGES) * L::BYTES;
            const u8_t* w_piece = base + L::W_OFF + warp * L::SUB * CHUNK + lane * W::PIECE;
            const float* s_a = reinterpret_cast<const float*>(base + L::SA_OFF);
            const u8_t* s_w = base + L::SW_OFF + warp * L::GPS * W::SCALE_BYTES;
            // Group gq's sums into d: its k32s' A fragments (32-group q of the stage is group
            // q % 4 of chunk q / 4), then the MMAs.
            auto sums = [&](u32_t gq, float (&d)[RUN][4]) {
                u32_t frag[LINKS][4];
#pragma unroll
                for (u32_t j = 0; j < LINKS; ++j) {
                    const u32_t q = gq * LINKS + j;
                    W::fragment(w_piece + (q / 4) * CHUNK + (q % 4) * 32 * W::PIECE, frag[j]);
                }
                group_sums<RUN, LINKS, L::HALF>(d, frag, base + L::B_OFF + 2 * gq * LINKS * L::HALF, g, t);
            };
            // The warp's products s_w * s_a of group gq's tokens (PRODUCTS), into its set gq % 2.
            auto band_products = [&](u32_t gq) {
                if constexpr (PRODUCTS) {
                    const float sw = W::scales(s_w, gq, g).x;
                    Floats<PER> p;
#pragma unroll
                    for (u32_t h = 0; h < PER / PAIR; ++h) {
                        const Floats<PAIR> s =
                            *reinterpret_cast<const Floats<PAIR>*>(s_a + gq * L::SA_ROW + p_token + 8 * h);
#pragma unroll
                        for (u32_t e = 0; e < PAIR; ++e) p.v[PAIR * h + e] = __fmul_rn(sw, s.v[e]);
                    }
                    *reinterpret_cast<Floats<PER>*>(products(gq) + q) = p;
                }
            };
            // acc += group gq's sums d, promoted.
            auto promote_group = [&](u32_t gq, const float (&d)[RUN][4]) {
                if constexpr (PRODUCTS) {
                    static_assert(RUN % 2 == 0, "pairs of n8 tiles");
                    const float* p = products(gq) + 4 * t;
#pragma unroll
                    for (u32_t i = 0; i < RUN; i += 2) {
                        // Tiles i and i + 1; rows g and g + 8 have the band's one scale.
                        const float4 s = *reinterpret_cast<const float4*>(p + 8 * i);
                        promote(acc[i], d[i], make_float2(s.x, s.y), make_float2(s.x, s.y));
                        promote(acc[i + 1], d[i + 1], make_float2(s.z, s.w), make_float2(s.z, s.w));
                    }
                } else {
                    const float2 sw = W::scales(s_w, gq, g);
#pragma unroll
                    for (u32_t i = 0; i < RUN; ++i) {
                        const float2 s = *reinterpret_cast<const float2*>(s_a + gq * L::SA_ROW + i * 8 + 2 * t);
                        promote(acc[i], d[i], make_float2(__fmul_rn(sw.x, s.x), __fmul_rn(sw.x, s.y)),
                                make_float2(__fmul_rn(sw.y, s.x), __fmul_rn(sw.y, s.y)));
                    }
                }
            };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
            // Two sets of sums: group gq + 1's wgmmas run while group gq is promoted; the stage's
            // last group is waited for in full, so the slot is free at the next barrier. Straight
            // code over every group of the stage (`unrolled`: no branch between a wgmma and its
            // wait, which ptxas would answer by waiting at once; compile.rs tests it): a group
            // past K has zero codes and scales, so its promotion adds fma(0, 0, acc) = acc (acc
            // is never -0: it starts at +0 and a sum that rounds to zero is +0), the bits of
            // skipping it.
            // Products likewise: group gq + 1's are formed before group gq is promoted, and one
            // __syncwarp after each promotion orders both the stores before their reads and the
            // reads of a set before its next stores.
            float d[2][RUN][4];
            sums(0, d[0]);
            band_products(0);
            if constexpr (PRODUCTS) __syncwarp();
            auto group = [&](auto index) {
                constexpr u32_t gq = decltype(index)::value;
                if constexpr (gq + 1 < L::GPS) {
                    sums(gq + 1, d[(gq + 1) % 2]);
                    band_products(gq + 1);
                    wgmma::wait<1>();
                } else {
                    wgmma::wait<0>();
                }
                wgmma::pin(d[gq % 2]);
                promote_group(gq, d[gq % 2]);
                if constexpr (PRODUCTS && gq + 1 < L::GPS) __syncwarp();
            };
            unrolled<0, L::GPS>(group);
#else
            const u32_t k0 = (step0 + step) * STEP;
#pragma unroll
            for (u32_t gq = 0; gq < L::GPS; ++gq) {
                if (k0 + G * gq >= k) break;  // uniform: the group is past K
                float d[RUN][4];
                sums(gq, d);
                band_products(gq);
                if constexpr (PRODUCTS) __syncwarp();  // the set's stores before its reads, its last reads before them
                promote_group(gq, d);
            }
#endif
            if constexpr (FOLDS) {
                if (--part_left == 0 && step + 1 < steps) {
                    fold(step + 1 == part_steps);
                    part_left = part_steps;
                }
            }
        }
        cp_async_wait<0>();
        if constexpr (FOLDS) {
            // The block's last part, added to the total of the others (a block of one part has none).
            if (steps > part_steps) {
#pragma unroll
                for (u32_t i = 0; i < RUN; ++i) {
                    const float4 s = add_total(i);
                    acc[i][0] = s.x;
                    acc[i][1] = s.y;
                    acc[i][2] = s.z;
                    acc[i][3] = s.w;
                }
            }
        }

        const u32_t feature = n0 + warp * 16 + g;
#pragma unroll
        for (u32_t i = 0; i < RUN; ++i) store_tile(acc[i], feature, i * 8 + 2 * t, rows, n, y, store, partial);
    };
    if constexpr (Rows::PART_FULL) {
        switch (run_tiles / QUARTER) {
            case 1: run(Const<QUARTER>{}); break;
            case 2: if constexpr (TILES >= 2 * QUARTER) run(Const<2 * QUARTER>{}); break;
            case 3: if constexpr (TILES >= 3 * QUARTER) run(Const<3 * QUARTER>{}); break;
            case 4: if constexpr (TILES >= 4 * QUARTER) run(Const<4 * QUARTER>{}); break;
            default: break;  // no row (never launched)
        }
    } else {
        run(Const<TILES>{});  // a dense tile is full but for the last rows: one loop
    }
}

// One block per (16 WARPS output features, blockIdx.x; BT token rows, blockIdx.y; plane and K
// part, blockIdx.z = plane * parts + part, or, p.folded, plane): gemm_fast_tile on weight `plane`
// (w0, ws0 or w1, ws1; p.projections weights of one shape, 1 or 2: the shared expert's w1 and w3
// in one launch) over the K codes [part span, min(k, (part + 1) span)), or all of K in its parts.
// With one part or folded the block stores its plane of y ([projections][m][n], as p.store
// says), else its part's sums to that plane of partials[part] ([parts][projections][m][n]), which
// gemm_fast_reduce adds in part order for every plane at once. The plane changes only which
// weight a block reads and where it stores, never how: each plane of a two-weight launch is
// bitwise its weight's own launch. The 128-row tiles fold (p.folded, set by the launcher only
// for them: FOLDS, their totals in shared memory) at prefill; the smaller tiles serve M <= 64,
// where the parts' blocks are what fills the SMs.
template <class W, int G, int WARPS, int BT, int STAGES, int STEP>
__device__ void gemm_fast_dense(const u8_t* __restrict__ a, const float* __restrict__ sa, const u8_t* w0,
                                const u8_t* ws0, const u8_t* w1, const u8_t* ws1, void* __restrict__ y,
                                float* __restrict__ partials, const FastGemmParams& p) {
    constexpr bool FOLDS = BT >= 128;
    const bool folded = FOLDS && p.folded;
    const u32_t blocks = folded ? 1 : p.parts;  // blocks along K a plane
    const u32_t plane = blockIdx.z < blocks ? 0 : 1;
    const u32_t part = blockIdx.z - plane * blocks;
    // partials[part], [projections][m][n]: the block's rows in it are y's (DenseRows::y0).
    float* partial = blocks > 1 ? partials + (size_t)part * p.projections * p.m * p.n : nullptr;
    const u32_t k_begin = part * p.span;
    const u32_t k_end = folded ? p.k : min(p.k, k_begin + p.span);
    gemm_fast_tile<W, G, WARPS, BT, STAGES, STEP, FOLDS>(
        a, sa, plane == 0 ? w0 : w1, plane == 0 ? ws0 : ws1, y, p.store, partial, p.n, p.k, k_begin, k_end, p.span,
        blockIdx.x * 16 * WARPS, DenseRows{blockIdx.y * BT, p.m, plane * p.m + blockIdx.y * BT});
}

// One block per (tile of group_routed_rows with up to BT rows of one expert, blockIdx.y; blocks
// past *tile_count return), 16 WARPS output features (blockIdx.x) and either the K part
// (blockIdx.z: codes [z span, min(k, (z + 1) span)), as the dense kernels) or, with
// p.projections > 1 (in one part), the table slot which + blockIdx.z, whose outputs are plane z
// of y ([projections][m][n]: the tile's output rows are offset by z m in shared memory):
// `body(w, ws, rows, n0, k_begin, k_end, partial)` on the tile's expert weights from the table
// ([3][n_experts][2] device addresses: weight chunks, band scales), or zeros for the bucket of
// unknown ids (the combine skips those rows). With one part (production) the body stores y; with
// more it writes its part's sums to partials[z] ([m, n], zeros for unknown ids), which
// gemm_fast_reduce adds in part order. Which slot a block computes changes where it reads and
// stores, never how: each plane of a two-slot launch is bitwise that slot's own launch.
template <int WARPS, int BT, class Body>
__device__ void routed_tile(const u32_t* __restrict__ order, const u32_t* __restrict__ tiles,
                            const u32_t* __restrict__ tile_count, const unsigned long long* __restrict__ table,
                            void* __restrict__ y, float* __restrict__ partials, const FastRoutedParams& p,
                            Body body) {
    __shared__ u32_t tile_rows[BT];
    __shared__ u32_t tile_a_rows[BT];
    const u32_t tile = blockIdx.y;
    if (tile >= *tile_count) return;
    const u32_t bucket = tiles[3 * tile];
    const u32_t start = tiles[3 * tile + 1];
    const u32_t count = min(tiles[3 * tile + 2], (u32_t)BT);
    // blockIdx.z: the projection (with several, in one K part) or the K part.
    const u32_t slot = p.projections > 1 ? blockIdx.z : 0;
    const u32_t part = p.projections > 1 ? 0 : blockIdx.z;
    for (u32_t r = threadIdx.x; r < count; r += blockDim.x) {
        const u32_t row = order[start + r];
        tile_rows[r] = row + slot * p.m;  // the output row in the slot's plane of y
        tile_a_rows[r] = row / p.x_row_div;
    }
    __syncthreads();
    const GatheredRows rows{tile_rows, tile_a_rows, count};
    const u32_t n0 = blockIdx.x * 16 * WARPS;
    const u32_t k_begin = part * p.span;
    const u32_t k_end = min(p.k, k_begin + p.span);
    float* partial = p.parts > 1 ? partials + (size_t)part * p.m * p.n : nullptr;
    if (bucket >= p.n_experts) {
        for (u32_t i = threadIdx.x; i < count * 16 * WARPS; i += blockDim.x) {
            const u32_t col = n0 + i % (16 * WARPS);
            if (col >= p.n) continue;
            const size_t at = rows.y_row(i / (16 * WARPS)) * p.n + col;
            if (partial != nullptr) {
                partial[at] = 0.0f;
            } else {
                store_out(y, at, 0.0f, p.store);
            }
        }
        return;
    }
    const unsigned long long* entry = table + ((size_t)(p.which + slot) * p.n_experts + bucket) * 2;
    body(reinterpret_cast<const u8_t*>(entry[0]), reinterpret_cast<const u8_t*>(entry[1]), rows, n0, k_begin, k_end,
         partial);
}

template <class W, int WARPS, int BT, int STAGES, int STEP>
__device__ void gemm_fast_routed(const u8_t* __restrict__ a, const float* __restrict__ sa,
                                 const u32_t* __restrict__ order, const u32_t* __restrict__ tiles,
                                 const u32_t* __restrict__ tile_count, const unsigned long long* __restrict__ table,
                                 void* __restrict__ y, float* __restrict__ partials, FastRoutedParams p) {
    routed_tile<WARPS, BT>(order, tiles, tile_count, table, y, partials, p,
                           [&](const u8_t* w, const u8_t* ws, const GatheredRows& rows, u32_t n0, u32_t k_begin,
                               u32_t k_end, float* partial) {
                               gemm_fast_tile<W, 32, WARPS, BT, STAGES, STEP, false>(
                                   a, sa, w, ws, y, p.store, partial, p.n, p.k, k_begin, k_end, p.span, n0, rows);
                           });
}

// y[i] = out( ((P_0[i] + P_1[i]) + P_2[i]) + ... ) over the parts' sums partials[p][i], in part
// order (the numerics definition above), i < p.count.
__device__ void gemm_fast_reduce(const float* __restrict__ partials, void* __restrict__ y, FastReduceParams p) {
    for (u32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.count; i += gridDim.x * blockDim.x) {
        float total = partials[i];
        for (u32_t part = 1; part < p.parts; ++part) total = __fadd_rn(total, partials[(size_t)part * p.count + i]);
        store_out(y, i, total, p.store);
    }
}

}  // namespace fastgemm

// The kernels of one tile configuration (gemm_fast.cu instantiates the production ones; the
// benchmark compiles others to time them): gemm_fast_dense.
#define GEMM_FAST(NAME, WEIGHTS, G, WARPS, BT, STAGES, STEP)                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                         \
        NAME(const u8_t* a, const float* sa, const u8_t* w0, const u8_t* ws0, const u8_t* w1,       \
             const u8_t* ws1, void* y, float* partials, FastGemmParams p) {                         \
        grid_dependency_sync();                                                                     \
        fastgemm::gemm_fast_dense<WEIGHTS, G, WARPS, BT, STAGES, STEP>(a, sa, w0, ws0, w1, ws1, y,  \
                                                                       partials, p);                \
    }

// The routed kernels (grid: column blocks, expert tiles, K parts; routed_tile): with one part the
// block stores y, else it writes its part's sums to partials[z] ([m, n]).
#define GEMM_FAST_ROUTED(NAME, WEIGHTS, WARPS, BT, STAGES, STEP)                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                         \
        NAME(const u8_t* a, const float* sa, const u32_t* order, const u32_t* tiles,                 \
             const u32_t* tile_count, const unsigned long long* table, void* y, float* partials,     \
             FastRoutedParams p) {                                                                  \
        grid_dependency_sync();                                                                     \
        fastgemm::gemm_fast_routed<WEIGHTS, WARPS, BT, STAGES, STEP>(a, sa, order, tiles, tile_count, \
                                                                     table, y, partials, p);        \
    }
