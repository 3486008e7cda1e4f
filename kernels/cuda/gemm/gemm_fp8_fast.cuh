// The `fast` FP8 block-scaled GEMM (ARCHITECTURE.md §3): tensor cores (mma.sync m16n8k32 e4m3,
// fp32 accumulation, sm_89+) with DeepGEMM-style promotion once per scale group along K:
//
//   y[m, n] = bf16( acc ),  acc = 0;  for every k-group g in K order:
//       acc = fma( T_g(m, n), s_w(n, g) * s_a(m, g), acc )
//
// where T_g is the tensor core's fp32 sum of the group's exact FP8 x FP8 products, started from
// zero (one mma for a 32-group; a chain of four for a 128-group, in K order). The weights are the
// mma's A operand (16 output features per warp), the activation rows its B operand (8 tokens per
// mma), so decode shapes (M = 1 ... 64) waste no weight bytes. Inside an mma's 32 products the
// K order is permuted the same way in every tile (thread t of a quad holds the 8 contiguous bytes
// 8t .. 8t + 8 of the group: 4t.. as k 4t.., 8t + 4.. as k 16 + 4t..), so a product's place in
// the tensor core's sum is a function of its k alone.
//
// Batch invariance: an output's value depends only on its activation row, its weight row and the
// fixed K loop (groups in order); the tile shape (tokens per block
// BT, warps per block) changes which thread computes it, never how. Every launch shape gives the
// same bits: a row alone, inside any batch, or in a prefill tile (the GPU tests check it).
//
// Weights are re-laid at upload (ops/gemm_fast.rs, FastFp8Weight): per 16-row band and 128-byte
// step of K one contiguous 2 KiB chunk in mma fragment order ([group j][lane][row g: 8 bytes,
// row g + 8: 8 bytes]), so a warp streams its band's weights as one contiguous range and reads a
// group's A fragment with one conflict-free 16-byte load; rows past N and K are zero.
//
// Pipeline: STAGES slots of shared memory, each holding the block's weight chunks and activation
// rows for STEP bytes of K (rows padded by 32 bytes: the 8-byte fragment loads of 8 rows x 4
// threads hit distinct banks), the activations' scales of those groups and the weights' scales per
// 16-row band (f32, expanded at upload), filled by cp.async STAGES - 1 steps ahead. Out-of-range
// rows, features and groups are zero-filled and never stored.
#pragma once
#include "common/numerics.cuh"

namespace fastgemm {

constexpr u32_t STEP_K = 128;               // K bytes of one weight chunk
constexpr u32_t CHUNK = 16 * STEP_K;        // one band's weights of 128 bytes of K

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const u32_t dst = (u32_t)__cvta_generic_to_shared(smem);
    const u32_t bytes = valid ? 16u : 0u;  // 0: zero-fill, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
    const u32_t dst = (u32_t)__cvta_generic_to_shared(smem);
    const u32_t bytes = valid ? 4u : 0u;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

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

// Shared-memory layout of one stage of STEP bytes of K.
template <int G, int WARPS, int BT, int STEP>
struct Stage {
    static constexpr u32_t FEATS = 16 * WARPS;
    static constexpr u32_t SUB = STEP / STEP_K;    // weight chunks per band and stage
    static constexpr u32_t ROW = STEP + 32;        // padded activation row
    static constexpr u32_t GPS = STEP / G;         // groups per stage
    static constexpr u32_t W_OFF = 0;
    static constexpr u32_t A_OFF = W_OFF + WARPS * SUB * CHUNK;
    static constexpr u32_t SA_OFF = A_OFF + BT * ROW;
    static constexpr u32_t SW_OFF = SA_OFF + 4 * BT * GPS;
    static constexpr u32_t BYTES = (SW_OFF + 4 * WARPS * GPS + 15) / 16 * 16;
};

// One block: output features [blockIdx.x * 16 WARPS, + 16 WARPS) of token rows
// [blockIdx.y * BT, + BT), STEP bytes of K per pipeline stage (a multiple of 128: only how much
// each barrier covers, never the order of any addition). a: E4M3 [m, k]; sa: f32 [m, k / G];
// w: E4M3 chunks [ceil(n / 16)][ceil(k / 128)][CHUNK]; wsb: f32 weight scales per 16-row band
// [ceil(n / 16), k / G]; y: bf16 [m, n]. k % G == 0, k % 32 == 0.
template <int G, int WARPS, int BT, int STAGES, int STEP>
__device__ void gemm_fp8_fast(const u8_t* __restrict__ a, const float* __restrict__ sa,
                              const u8_t* __restrict__ w, const float* __restrict__ wsb,
                              __nv_bfloat16* __restrict__ y, FastGemmParams p) {
    static_assert(G == 32 || G == 128, "32- or 128-groups");
    static_assert(BT % 8 == 0 && STAGES >= 2 && STEP % STEP_K == 0, "tile");
    typedef Stage<G, WARPS, BT, STEP> L;
    constexpr u32_t THREADS = WARPS * 32;
    constexpr u32_t TILES = BT / 8;  // n8 token tiles per warp
    extern __shared__ __align__(16) u8_t smem[];

    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    const u32_t g = lane / 4;
    const u32_t t = lane % 4;
    const u32_t n0 = blockIdx.x * L::FEATS;
    const u32_t m0 = blockIdx.y * BT;
    const u32_t groups = p.k / G;
    const u32_t bands = (p.n + 15) / 16;
    const u32_t chunks = (p.k + STEP_K - 1) / STEP_K;  // per band
    const u32_t steps = (p.k + STEP - 1) / STEP;

    auto load_stage = [&](u32_t step, u32_t slot) {
        u8_t* base = smem + slot * L::BYTES;
        const u32_t k0 = step * STEP;
        for (u32_t c = threadIdx.x; c < WARPS * L::SUB * (CHUNK / 16); c += THREADS) {
            const u32_t band = n0 / 16 + c / (L::SUB * (CHUNK / 16));
            const u32_t chunk = step * L::SUB + (c / (CHUNK / 16)) % L::SUB;
            const bool ok = band < bands && chunk < chunks;
            const size_t src = ((size_t)band * chunks + chunk) * CHUNK + (c % (CHUNK / 16)) * 16;
            cp_async16(base + L::W_OFF + c * 16, ok ? w + src : w, ok);
        }
        for (u32_t c = threadIdx.x; c < BT * (STEP / 16); c += THREADS) {
            const u32_t row = c / (STEP / 16), col = (c % (STEP / 16)) * 16, m = m0 + row;
            const bool ok = m < p.m && k0 + col < p.k;
            cp_async16(base + L::A_OFF + row * L::ROW + col, ok ? a + (size_t)m * p.k + k0 + col : a, ok);
        }
        for (u32_t c = threadIdx.x; c < BT * L::GPS; c += THREADS) {
            const u32_t m = m0 + c / L::GPS, gi = k0 / G + c % L::GPS;
            const bool ok = m < p.m && gi < groups;
            cp_async4(base + L::SA_OFF + 4 * c, ok ? sa + (size_t)m * groups + gi : sa, ok);
        }
        for (u32_t c = threadIdx.x; c < WARPS * L::GPS; c += THREADS) {
            const u32_t band = n0 / 16 + c / L::GPS, gi = k0 / G + c % L::GPS;
            const bool ok = band < bands && gi < groups;
            cp_async4(base + L::SW_OFF + 4 * c, ok ? wsb + (size_t)band * groups + gi : wsb, ok);
        }
    };

    float acc[TILES][4];
#pragma unroll
    for (u32_t i = 0; i < TILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};

#pragma unroll
    for (u32_t s = 0; s + 1 < (u32_t)STAGES; ++s) {
        if (s < steps) load_stage(s, s);
        cp_async_commit();
    }
    for (u32_t step = 0; step < steps; ++step) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // this stage is in; every thread is done with the slot refilled below
        const u32_t next = step + STAGES - 1;
        if (next < steps) load_stage(next, next % STAGES);
        cp_async_commit();

        const u8_t* base = smem + (step % STAGES) * L::BYTES;
        const u8_t* w_chunk = base + L::W_OFF + warp * L::SUB * CHUNK + lane * 16;
        const u8_t* a_row = base + L::A_OFF + g * L::ROW + 8 * t;
        const float* s_a = reinterpret_cast<const float*>(base + L::SA_OFF);
        const float* s_w = reinterpret_cast<const float*>(base + L::SW_OFF) + warp * L::GPS;
        const u32_t k0 = step * STEP;
        // The A fragment of the stage's 32-byte group q: chunk q / 4, group q % 4 in it.
        auto fragment = [&](u32_t q, u32_t (&frag)[4]) {
            const uint4 v = *reinterpret_cast<const uint4*>(w_chunk + (q / 4) * CHUNK + (q % 4) * 512);
            frag[0] = v.x;
            frag[1] = v.z;
            frag[2] = v.y;
            frag[3] = v.w;
        };
        if constexpr (G == 32) {
#pragma unroll
            for (u32_t q = 0; q < STEP / 32; ++q) {
                if (k0 + 32 * q >= p.k) break;  // uniform: the group is past K
                u32_t frag[4];
                fragment(q, frag);
                const float sw = s_w[q];
#pragma unroll
                for (u32_t i = 0; i < TILES; ++i) {
                    const uint2 b = *reinterpret_cast<const uint2*>(a_row + i * 8 * L::ROW + 32 * q);
                    float c[4];
                    mma_e4m3(c, frag, b.x, b.y, zero);
                    const float s0 = __fmul_rn(sw, s_a[(i * 8 + 2 * t) * L::GPS + q]);
                    const float s1 = __fmul_rn(sw, s_a[(i * 8 + 2 * t + 1) * L::GPS + q]);
                    acc[i][0] = __fmaf_rn(c[0], s0, acc[i][0]);
                    acc[i][1] = __fmaf_rn(c[1], s1, acc[i][1]);
                    acc[i][2] = __fmaf_rn(c[2], s0, acc[i][2]);
                    acc[i][3] = __fmaf_rn(c[3], s1, acc[i][3]);
                }
            }
        } else {
#pragma unroll
            for (u32_t gq = 0; gq < L::GPS; ++gq) {
                if (k0 + 128 * gq >= p.k) break;  // uniform: the group is past K
                float c[TILES][4];
#pragma unroll
                for (u32_t i = 0; i < TILES; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
#pragma unroll
                for (u32_t j = 0; j < 4; ++j) {
                    u32_t frag[4];
                    fragment(4 * gq + j, frag);
#pragma unroll
                    for (u32_t i = 0; i < TILES; ++i) {
                        const uint2 b =
                            *reinterpret_cast<const uint2*>(a_row + i * 8 * L::ROW + 128 * gq + 32 * j);
                        mma_e4m3(c[i], frag, b.x, b.y, c[i]);
                    }
                }
                const float sw = s_w[gq];
#pragma unroll
                for (u32_t i = 0; i < TILES; ++i) {
                    const float s0 = __fmul_rn(sw, s_a[(i * 8 + 2 * t) * L::GPS + gq]);
                    const float s1 = __fmul_rn(sw, s_a[(i * 8 + 2 * t + 1) * L::GPS + gq]);
                    acc[i][0] = __fmaf_rn(c[i][0], s0, acc[i][0]);
                    acc[i][1] = __fmaf_rn(c[i][1], s1, acc[i][1]);
                    acc[i][2] = __fmaf_rn(c[i][2], s0, acc[i][2]);
                    acc[i][3] = __fmaf_rn(c[i][3], s1, acc[i][3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    const u32_t feature = n0 + warp * 16 + g;
#pragma unroll
    for (u32_t i = 0; i < TILES; ++i) {
        const u32_t token = m0 + i * 8 + 2 * t;
#pragma unroll
        for (u32_t r = 0; r < 4; ++r) {
            const u32_t n = feature + (r / 2) * 8;
            const u32_t m = token + r % 2;
            if (n < p.n && m < p.m) y[(size_t)m * p.n + n] = __float2bfloat16_rn(acc[i][r]);
        }
    }
}

}  // namespace fastgemm
