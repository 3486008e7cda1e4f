// FP8 block-scaled GEMM instantiations: 32x32 weight tiles with 32-groups of activations (V4.1),
// 128x128 tiles with 128-groups (V4). The activation group is the weight tile's side, as in
// deepinfer-model's quant::gemm_fp8.
#include "gemm/gemm_block_scaled.cuh"

GEMM_DENSE(gemm_fp8_t32_g32_bf16, gemm::Fp8Weights<32>, 32, false, 3)
GEMM_DENSE(gemm_fp8_t128_g128_bf16, gemm::Fp8Weights<128>, 128, false, 3)

// The column-per-warp path (few rows): one warp per output column over the whole K range.
GEMM_DENSE(gemm_fp8_t32_g32_warp_bf16, gemm::Fp8Weights<32>, 32, true, 4)
GEMM_DENSE(gemm_fp8_t128_g128_warp_bf16, gemm::Fp8Weights<128>, 128, true, 4)
