// FP4-expert GEMM instantiation: E2M1 weights (1x32 UE8M0 scales) x FP8 activations (32-groups),
// dequantised on the fly (Hopper has no FP4 tensor cores).
#include "gemm/gemm_block_scaled.cuh"

extern "C" __global__ void __launch_bounds__(gemm::WARPS * 32, 3)
    gemm_fp4_g32_bf16(const u8_t* a, const float* sa, const u8_t* w, const u8_t* ws, __nv_bfloat16* y,
                      GemmParams p) {
    gemm::gemm_block_scaled<gemm::Fp4Weights, 32, 8>(a, sa, w, ws, y, p);
}

// The column-per-warp path (few rows): one warp per output column over the whole K range.
extern "C" __global__ void __launch_bounds__(gemm::WARPS * 32, 4)
    gemm_fp4_g32_warp_bf16(const u8_t* a, const float* sa, const u8_t* w, const u8_t* ws, __nv_bfloat16* y,
                           GemmParams p) {
    gemm::gemm_warp_scaled<gemm::Fp4Weights, 32, 8>(a, sa, w, ws, y, p);
}
