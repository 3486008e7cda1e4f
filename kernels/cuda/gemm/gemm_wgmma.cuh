// The fast GEMM's prefill tile on sm_90a warpgroup MMAs (wgmma.mma_async m64n128k32 e4m3): the
// same sums as gemm_fast_tile (gemm_fast.cuh, whose header is the numerics contract), so the same
// bits, with the weights as the A operand of a warpgroup (64 output features: its four warps'
// 16-row bands) and the block's 128 token rows as B (out^T = W · X^T, as the mma.sync tiles).
//
// Why the sums are the same ones:
// - A comes from registers, where wgmma's 8-bit A fragment is, warp by warp, mma.sync m16n8k32's
//   (warp w of the warpgroup: rows 16 w + g and 16 w + g + 8, k 4t.. and 16 + 4t..); the
//   fragments are read from the same weight chunks with W::fragment (FP8 codes, or FP4 codes
//   converted to E4M3 in registers, as there), so a weight code sits in the same k slot as in
//   gemm_fast_tile.
// - B comes from shared memory, K-major without swizzle (core matrices of 8 token rows x 16
//   bytes). The mma.sync B fragment puts a group's activation codes 8t.. at k 4t.. and 8t + 4..
//   at k 16 + 4t..: k slots 0..31 hold the 4-byte words [0, 2, 4, 6, 1, 3, 5, 7] of the group.
//   The stage copies each word to that slot (4-byte cp.async: word v of a group to the K half v
//   % 2, word v / 2 of it), so an activation code, too, sits in the same k slot.
// - T_g is one wgmma from zero (scale-d = 0) for a 32-group; for a 128-group the chain of its four
//   k32 wgmmas in K order (scale-d 0, 1, 1, 1), as the mma.sync chain. The promotion is
//   fastgemm::promote, the groups of a part in K order, the parts those of k_parts (the launcher
//   passes the production's span).
// - A block runs all of K and adds its parts' sums itself, in gemm_fast_reduce's order: at the end
//   of part p > 0 of K, total = total + P_p (total = P_0 after part 0) in f32, kept in the
//   launch's scratch ([m][n] f32, each output's own slot: the block's tile, read back by the
//   thread that wrote it); y = out(total + P_last). No part-sum buffers, no reduction launch.
//
// Pipeline: STAGES slots of shared memory (WgmmaStage), filled by cp.async STAGES - 1 steps
// ahead by all threads (each stage's copies issued behind its first wgmma); after a slot lands,
// fence.proxy.async makes the copies visible to the tensor core's (async proxy) reads. Each
// warpgroup keeps two sets of group sums: it issues the wgmma(s) of group q + 1 into one while it
// promotes group q from the other (wgmma.wait_group 1), and drains at the end of a stage
// (wait_group 0) before the slot can be refilled.
//
// sm_90a only (wgmma): gemm_fast.cu instantiates it only where __CUDA_ARCH_FEAT_SM90_ALL is
// defined; the runtime loads these kernels on sm_90a alone (KernelId::built_for).
#pragma once
#include "gemm/gemm_fast.cuh"

namespace fastgemm {

// Shared-memory layout of one stage of STEP codes of K: the weight chunks of the block's bands (as
// the mma.sync stage), the activations as wgmma's K-major B ([STEP / 16][BT][16 bytes]: 16 codes
// of K for each token row, in the mma.sync k-slot order above), their scales ([GPS][BT] f32) and
// the weight scales ([WARPS][GPS]).
template <class W, int G, int WARPS, int BT, int STEP>
struct WgmmaStage {
    static constexpr u32_t CHUNK = 128 * W::PIECE;
    static constexpr u32_t SUB = STEP / STEP_K;
    static constexpr u32_t GPS = STEP / G;
    static constexpr u32_t W_OFF = 0;
    static constexpr u32_t B_OFF = W_OFF + WARPS * SUB * CHUNK;
    static constexpr u32_t SA_OFF = B_OFF + BT * STEP;
    static constexpr u32_t SW_OFF = SA_OFF + 4 * BT * GPS;
    static constexpr u32_t BYTES = (SW_OFF + W::SCALE_BYTES * WARPS * GPS + 15) / 16 * 16;
};

// The matrix descriptor of a K-major B without swizzle at `smem`: core matrices of 8 rows x 16
// bytes (128 contiguous bytes), the next 16 codes of K `lbo` bytes on (leading byte offset), the
// next 8 rows `sbo` bytes on (stride byte offset); base offset 0, layout type 0 (no swizzle).
__device__ __forceinline__ unsigned long long wgmma_desc(const void* smem, u32_t lbo, u32_t sbo) {
    const u32_t address = (u32_t)__cvta_generic_to_shared(smem);
    return (unsigned long long)((address >> 4) & 0x3fffu) | ((unsigned long long)((lbo >> 4) & 0x3fffu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3fffu) << 32);
}

// Orders this thread's earlier shared-memory writes (cp.async: the generic proxy) before later reads
// by the async proxy (the wgmma's B operand).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// Pins the sums' registers at this point of the program: their reads stay after the wait that
// precedes it, their writes before the wgmma that follows it.
template <int TILES>
__device__ __forceinline__ void fence_sums(float (&d)[TILES][4]) {
#pragma unroll
    for (u32_t i = 0; i < TILES; ++i) {
        asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
    }
}

// d = A (64 x 32, this thread's fragment `a`) · B (32 x 128, K-major at descriptor `b`) (+ d
// when ACCUMULATE), E4M3 inputs, fp32 sums; d[i] is the n8 tile i's mma.sync C fragment.
template <int ACCUMULATE>
__device__ __forceinline__ void wgmma_e4m3_n128(float (&d)[16][4], const u32_t (&a)[4], unsigned long long b) {
    asm volatile(
        "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, "
        "%41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, "
        "%61, %62, %63}, {%64, %65, %66, %67}, %68, accumulate, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
          "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),
          "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),
          "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]),
          "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]),
          "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(ACCUMULATE));
}

// One block's tile on warpgroup MMAs: output features [n0, n0 + 64 WGS) (warp w: band n0 / 16 + w)
// of the BT = 128 token rows `rows` over all K, in parts of `span` codes (a multiple of STEP):
// y ([*, n], bf16 or f32 by out_f32) = gemm_fast_tile's parts added in part order (the same
// bits); `total` (f32 [*, n]) holds the running sum of the parts when there are several. a, sa,
// w, ws as gemm_fast_tile's.
template <class W, int G, int WGS, int BT, int STAGES, int STEP, class Rows>
__device__ void gemm_fast_wgmma(const u8_t* __restrict__ a, const float* __restrict__ sa,
                                const u8_t* __restrict__ w, const u8_t* __restrict__ ws, void* __restrict__ y,
                                u32_t out_f32, float* __restrict__ total, u32_t n, u32_t k, u32_t span, u32_t n0,
                                const Rows& rows) {
    static_assert(G == 32 || G == 128, "32- or 128-groups");
    static_assert(BT == 128, "the m64n128k32 instruction: 128 token rows");
    static_assert(STAGES >= 2 && STEP % STEP_K == 0, "tile");
    constexpr u32_t WARPS = 4 * WGS;
    typedef WgmmaStage<W, G, WARPS, BT, STEP> L;
    constexpr u32_t THREADS = WARPS * 32;
    constexpr u32_t TILES = BT / 8;   // n8 token tiles of a warp's sums
    constexpr u32_t LINKS = G / 32;   // k32 wgmmas per group
    constexpr u32_t Q32 = STEP / 32;  // 32-code groups per stage
    extern __shared__ __align__(16) u8_t smem[];

    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    const u32_t g = lane / 4;
    const u32_t t = lane % 4;
    const u32_t groups = k / G;
    const u32_t bands = (n + 15) / 16;
    const u32_t chunks = (k + STEP_K - 1) / STEP_K;  // per band
    const u32_t steps = (k + STEP - 1) / STEP;
    const u32_t steps_per_part = span / STEP;

    auto load_stage = [&](u32_t step, u32_t slot) {
        u8_t* base = smem + slot * L::BYTES;
        const u32_t k0 = step * STEP;
        stage_weights<W, WARPS, L::SUB, THREADS>(base + L::W_OFF, w, n0, step, bands, chunks);
        // Word v (4 codes) of 32-group q of a row to K half v % 2 of the group, word v / 2 in it.
        // A warp's 32 copies: 8 rows x words v = 2j + half (j = 0..3), to 32 distinct banks.
        for (u32_t c = threadIdx.x; c < BT * STEP / 4; c += THREADS) {
            const u32_t row = (c / 64 / Q32) * 8 + c % 8;
            const u32_t j = (c / 8) % 4, half = (c / 32) % 2, q = (c / 64) % Q32;
            const u32_t col = 32 * q + 4 * (2 * j + half);
            const bool ok = rows.valid(row) && k0 + col < k;
            u8_t* dst = base + L::B_OFF + ((2 * q + half) * BT + row) * 16 + 4 * j;
            cp_async4(dst, ok ? a + rows.a_row(row) * k + k0 + col : a, ok);
        }
        for (u32_t c = threadIdx.x; c < BT * L::GPS; c += THREADS) {
            const u32_t row = c % BT, gi = k0 / G + c / BT;
            const bool ok = rows.valid(row) && gi < groups;
            cp_async4(base + L::SA_OFF + 4 * c, ok ? sa + rows.a_row(row) * groups + gi : sa, ok);
        }
        stage_weight_scales<W, WARPS, L::GPS, THREADS>(base + L::SW_OFF, ws, n0, k0 / G, bands, groups);
    };

    float acc[TILES][4];
    float sums[2][TILES][4];
#pragma unroll
    for (u32_t i = 0; i < TILES; ++i) {
        acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
        for (u32_t r = 0; r < 4; ++r) sums[0][i][r] = sums[1][i][r] = 0.0f;
    }

#pragma unroll
    for (u32_t s = 0; s + 1 < (u32_t)STAGES; ++s) {
        if (s < steps) load_stage(s, s);
        cp_async_commit();
    }
    const u32_t feature = n0 + warp * 16 + g;
    // Each of this thread's outputs that exists: f(acc[i][r], its index in [*, n]).
    auto for_outputs = [&](auto f) {
#pragma unroll
        for (u32_t i = 0; i < TILES; ++i) {
#pragma unroll
            for (u32_t r = 0; r < 4; ++r) {
                const u32_t col = feature + (r / 2) * 8;
                const u32_t row = i * 8 + 2 * t + r % 2;
                if (col < n && rows.valid(row)) f(acc[i][r], rows.y_row(row) * n + col);
            }
        }
    };

    for (u32_t step = 0; step < steps; ++step) {
        cp_async_wait<STAGES - 2>();
        fence_proxy_async();  // this thread's copies, visible to the tensor core's reads
        __syncthreads();      // this stage is in; every wgmma is done with the slot refilled below

        const u8_t* base = smem + (step % STAGES) * L::BYTES;
        const u8_t* w_piece = base + L::W_OFF + warp * L::SUB * L::CHUNK + lane * W::PIECE;
        const u8_t* b_base = base + L::B_OFF;
        const float* s_a = reinterpret_cast<const float*>(base + L::SA_OFF);
        const u8_t* s_w = base + L::SW_OFF + warp * L::GPS * W::SCALE_BYTES;

        // Group gq's sums into d: its LINKS k32 wgmmas in K order, the first from zero.
        auto issue = [&](u32_t gq, float (&d)[TILES][4]) {
            u32_t frag[LINKS][4];
#pragma unroll
            for (u32_t j = 0; j < LINKS; ++j) {
                const u32_t q = gq * LINKS + j;  // the stage's 32-group: chunk q / 4, group q % 4
                W::fragment(w_piece + (q / 4) * L::CHUNK + (q % 4) * 32 * W::PIECE, frag[j]);
            }
            fence_sums(d);
            wgmma_fence();  // the fragments and d are written before the wgmmas read them
#pragma unroll
            for (u32_t j = 0; j < LINKS; ++j) {
                const u32_t q = gq * LINKS + j;
                const unsigned long long b = wgmma_desc(b_base + 2 * q * BT * 16, BT * 16, 128);
                if (j == 0) {
                    wgmma_e4m3_n128<0>(d, frag[j], b);
                } else {
                    wgmma_e4m3_n128<1>(d, frag[j], b);
                }
            }
            wgmma_commit();
        };
        // acc += group gq's sums d, promoted (the sums are complete: waited for).
        auto promote_group = [&](u32_t gq, float (&d)[TILES][4]) {
            fence_sums(d);
            const float2 sw = W::scales(s_w, gq, g);
#pragma unroll
            for (u32_t i = 0; i < TILES; ++i) {
                const float2 s = *reinterpret_cast<const float2*>(s_a + gq * BT + i * 8 + 2 * t);
                promote(acc[i], d[i], sw, s.x, s.y);
            }
        };

        // Every group of the stage, a fixed schedule: a group past K (the last stage of a K that
        // is no multiple of STEP) has zero codes and zero scales, so its promotion adds
        // fma(0, 0, acc) = acc (acc is never -0: it starts at +0, and a sum that rounds to zero
        // is +0), what the mma.sync tile's skipping it gives.
        issue(0, sums[0]);
        // The copies of a stage STAGES - 1 on, into the slot the previous stage read, issued
        // while the first group's wgmma runs.
        const u32_t next = step + STAGES - 1;
        if (next < steps) load_stage(next, next % STAGES);
        cp_async_commit();
#pragma unroll
        for (u32_t gq = 0; gq < L::GPS; ++gq) {
            if (gq + 1 < L::GPS) {
                issue(gq + 1, sums[(gq + 1) % 2]);
                wgmma_wait<1>();  // group gq is done, gq + 1 runs during its promotion
            } else {
                wgmma_wait<0>();  // the stage's last group: the slot is free after it
            }
            promote_group(gq, sums[gq % 2]);
        }
        // The end of a part before the last: total = P_0, then total + P_p; the next part's
        // sum starts from zero.
        if ((step + 1) % steps_per_part == 0 && step + 1 < steps) {
            const bool first = step + 1 == steps_per_part;
            for_outputs([&](float v, size_t at) { total[at] = first ? v : __fadd_rn(total[at], v); });
#pragma unroll
            for (u32_t i = 0; i < TILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        }
    }
    cp_async_wait<0>();

    const bool parted = steps > steps_per_part;
    for_outputs([&](float v, size_t at) { store_out(y, at, parted ? __fadd_rn(total[at], v) : v, out_f32); });
}

}  // namespace fastgemm

// The warpgroup-MMA prefill tile (gemm_fast_wgmma): WGS warpgroups (64 output features each), BT
// token rows, STAGES pipeline stages of STEP codes. Grid (column blocks, row blocks): every block
// runs all of K, its parts of p.span codes (p.parts of them) added in part order in `total`
// ([m, n] f32, read and written only with p.parts > 1); GEMM_FAST's arguments.
#define GEMM_FAST_WGMMA(NAME, WEIGHTS, G, WGS, BT, STAGES, STEP)                                       \
    extern "C" __global__ void __launch_bounds__(WGS * 128, 1)                                       \
        NAME(const u8_t* a, const float* sa, const u8_t* w, const u8_t* ws, void* y, float* total,    \
             FastGemmParams p) {                                                                    \
        const fastgemm::DenseRows rows{blockIdx.y * BT, p.m};                                        \
        fastgemm::gemm_fast_wgmma<WEIGHTS, G, WGS, BT, STAGES, STEP>(                                \
            a, sa, w, ws, y, p.out_f32, total, p.n, p.k, p.span, blockIdx.x * 64 * WGS, rows);       \
    }
