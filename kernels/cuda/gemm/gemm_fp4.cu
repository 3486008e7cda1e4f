// FP4-expert GEMM instantiation: E2M1 weights (1x32 UE8M0 scales) x FP8 activations (32-groups),
// dequantised on the fly (Hopper has no FP4 tensor cores).
#include "gemm/gemm_block_scaled.cuh"

GEMM_DENSE(gemm_fp4_g32_bf16, gemm::Fp4Weights, 32, false, 3)

// The column-per-warp path (few rows): one warp per output column over the whole K range.
GEMM_DENSE(gemm_fp4_g32_warp_bf16, gemm::Fp4Weights, 32, true, 4)
