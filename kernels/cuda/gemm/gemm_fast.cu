// The fast GEMMs' tile configurations (gemm_fast.cuh): every one computes the same bits, the
// launchers (ops/gemm_fast.rs, ops/routed_fast.rs) pick one by M (dense) or by rows per expert
// (routed). Names: <weights>_fast[_routed]_[t<weight tile>_]b<tokens per block>; arguments:
// group, warps, token rows, pipeline stages, K codes per stage.
#include "gemm/gemm_fast.cuh"

// Grid (column blocks, row blocks, K parts): part blockIdx.z = codes [z span, (z + 1) span) of K;
// with one part the block stores y (bf16 or f32, p.out_f32), else it writes its part's sums to
// partials[z] ([m, n]).
#define GEMM_FAST(NAME, WEIGHTS, G, WARPS, BT, STAGES, STEP)                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                         \
        NAME(const u8_t* a, const float* sa, const u8_t* w, const u8_t* ws, void* y, float* partials, \
             FastGemmParams p) {                                                                    \
        const fastgemm::DenseRows rows{blockIdx.y * BT, p.m};                                        \
        const u32_t k_begin = blockIdx.z * p.span;                                                   \
        const u32_t k_end = min(p.k, k_begin + p.span);                                              \
        float* partial = p.parts > 1 ? partials + (size_t)blockIdx.z * p.m * p.n : nullptr;          \
        fastgemm::gemm_fast_tile<WEIGHTS, G, WARPS, BT, STAGES, STEP>(                               \
            a, sa, w, ws, y, p.out_f32, partial, p.n, p.k, k_begin, k_end, blockIdx.x * 16 * WARPS, rows); \
    }

#define GEMM_FAST_ROUTED(NAME, WEIGHTS, WARPS, BT, STAGES, STEP)                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                         \
        NAME(const u8_t* a, const float* sa, const u32_t* order, const u32_t* tiles,                 \
             const u32_t* tile_count, const unsigned long long* table, void* y,                      \
             FastRoutedParams p) {                                                                  \
        fastgemm::gemm_fast_routed<WEIGHTS, WARPS, BT, STAGES, STEP>(a, sa, order, tiles, tile_count, \
                                                                     table, y, p);                  \
    }

GEMM_FAST(gemm_fp8_fast_t32_b8, fastgemm::Fp8Chunks<32>, 32, 2, 8, 4, 512)
GEMM_FAST(gemm_fp8_fast_t32_b32, fastgemm::Fp8Chunks<32>, 32, 2, 32, 3, 512)
GEMM_FAST(gemm_fp8_fast_t32_b64, fastgemm::Fp8Chunks<32>, 32, 2, 64, 4, 256)
GEMM_FAST(gemm_fp8_fast_t32_b128, fastgemm::Fp8Chunks<32>, 32, 8, 128, 3, 128)
GEMM_FAST(gemm_fp8_fast_t128_b8, fastgemm::Fp8Chunks<128>, 128, 2, 8, 4, 512)
GEMM_FAST(gemm_fp8_fast_t128_b32, fastgemm::Fp8Chunks<128>, 128, 2, 32, 3, 512)
GEMM_FAST(gemm_fp8_fast_t128_b64, fastgemm::Fp8Chunks<128>, 128, 2, 64, 4, 256)
GEMM_FAST(gemm_fp8_fast_t128_b128, fastgemm::Fp8Chunks<128>, 128, 8, 128, 3, 128)

GEMM_FAST(gemm_fp4_fast_b8, fastgemm::Fp4Chunks, 32, 2, 8, 4, 512)
GEMM_FAST(gemm_fp4_fast_b32, fastgemm::Fp4Chunks, 32, 2, 32, 3, 512)
GEMM_FAST(gemm_fp4_fast_b64, fastgemm::Fp4Chunks, 32, 2, 64, 4, 256)
GEMM_FAST(gemm_fp4_fast_b128, fastgemm::Fp4Chunks, 32, 8, 128, 3, 128)

GEMM_FAST_ROUTED(gemm_fp4_fast_routed_b8, fastgemm::Fp4Chunks, 2, 8, 4, 512)
GEMM_FAST_ROUTED(gemm_fp4_fast_routed_b32, fastgemm::Fp4Chunks, 2, 32, 3, 512)
GEMM_FAST_ROUTED(gemm_fp4_fast_routed_b64, fastgemm::Fp4Chunks, 2, 64, 4, 256)
GEMM_FAST_ROUTED(gemm_fp4_fast_routed_b128, fastgemm::Fp4Chunks, 8, 128, 3, 128)

extern "C" __global__ void gemm_fast_reduce(const float* partials, void* y, FastReduceParams p) {
    fastgemm::gemm_fast_reduce(partials, y, p);
}
