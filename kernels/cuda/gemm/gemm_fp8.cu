// FP8 block-scaled GEMM instantiations: 32x32 weight tiles with 32-groups of activations (V4.1),
// 128x128 tiles with 128-groups (V4). The activation group is the weight tile's side, as in
// deepinfer-model's quant::gemm_fp8.
#include "gemm/gemm_block_scaled.cuh"

#define GEMM_FP8(NAME, TILE, GROUP)                                                                   \
    extern "C" __global__ void __launch_bounds__(gemm::WARPS * 32, 3)                                  \
        NAME(const u8_t* a, const float* sa, const u8_t* w, const u8_t* ws, __nv_bfloat16* y,      \
             GemmParams p) {                                                                          \
        gemm::gemm_block_scaled<gemm::Fp8Weights<TILE>, GROUP, 8>(a, sa, w, ws, y, p);              \
    }

GEMM_FP8(gemm_fp8_t32_g32_bf16, 32, 32)
GEMM_FP8(gemm_fp8_t128_g128_bf16, 128, 128)

// The column-per-warp path (few rows): one warp per output column over the whole K range.
#define GEMM_FP8_WARP(NAME, TILE, GROUP)                                                              \
    extern "C" __global__ void __launch_bounds__(gemm::WARPS * 32, 4)                                  \
        NAME(const u8_t* a, const float* sa, const u8_t* w, const u8_t* ws, __nv_bfloat16* y,      \
             GemmParams p) {                                                                          \
        gemm::gemm_warp_scaled<gemm::Fp8Weights<TILE>, GROUP, 8>(a, sa, w, ws, y, p);               \
    }

GEMM_FP8_WARP(gemm_fp8_t32_g32_warp_bf16, 32, 32)
GEMM_FP8_WARP(gemm_fp8_t128_g128_warp_bf16, 128, 128)
