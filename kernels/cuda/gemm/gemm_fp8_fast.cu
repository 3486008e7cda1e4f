// The fast FP8 GEMM's tile configurations (gemm_fp8_fast.cuh): every one computes the same bits,
// the launcher (ops/gemm_fast.rs) picks one by M. Names: t<weight tile>_b<tokens per block>;
// arguments: group, warps, token rows, pipeline stages, K bytes per stage.
#include "gemm/gemm_fp8_fast.cuh"

#define GEMM_FP8_FAST(NAME, G, WARPS, BT, STAGES, STEP)                                                   \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                         \
        NAME(const u8_t* a, const float* sa, const u8_t* w, const float* wsb, __nv_bfloat16* y,     \
             FastGemmParams p) {                                                                    \
        fastgemm::gemm_fp8_fast<G, WARPS, BT, STAGES, STEP>(a, sa, w, wsb, y, p);                       \
    }

GEMM_FP8_FAST(gemm_fp8_fast_t32_b8, 32, 2, 8, 4, 512)
GEMM_FP8_FAST(gemm_fp8_fast_t32_b32, 32, 2, 32, 3, 512)
GEMM_FP8_FAST(gemm_fp8_fast_t32_b64, 32, 2, 64, 4, 256)
GEMM_FP8_FAST(gemm_fp8_fast_t32_b128, 32, 8, 128, 3, 128)
GEMM_FP8_FAST(gemm_fp8_fast_t128_b8, 128, 2, 8, 4, 512)
GEMM_FP8_FAST(gemm_fp8_fast_t128_b32, 128, 2, 32, 3, 512)
GEMM_FP8_FAST(gemm_fp8_fast_t128_b64, 128, 2, 64, 4, 256)
GEMM_FP8_FAST(gemm_fp8_fast_t128_b128, 128, 8, 128, 3, 128)
