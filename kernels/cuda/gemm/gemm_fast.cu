// The fast GEMMs' tile configurations (gemm_fast.cuh; DENSE_TILES and ROUTED_TILES in
// ops/gemm_fast.rs, whose test ties each to its line here): every one computes the same bits, the
// launchers (ops/gemm_fast.rs, ops/routed_fast.rs) pick one by M (dense) or by the mean rows per
// expert (routed). Names: <weights>_fast[_routed]_[t<weight tile>_]b<tokens per block>; arguments:
// group, warps, token rows, pipeline stages, K codes per stage (the macros: gemm_fast.cuh).
#include "common/grid_dependency.cuh"
#include "gemm/gemm_fast.cuh"

GEMM_FAST(gemm_fp8_fast_t32_b8, fastgemm::Fp8Chunks<32>, 32, 4, 8, 3, 256)
GEMM_FAST(gemm_fp8_fast_t32_b32, fastgemm::Fp8Chunks<32>, 32, 4, 32, 3, 256)
GEMM_FAST(gemm_fp8_fast_t32_b64, fastgemm::Fp8Chunks<32>, 32, 4, 64, 3, 256)
GEMM_FAST(gemm_fp8_fast_t32_b128, fastgemm::Fp8Chunks<32>, 32, 8, 128, 2, 256)
GEMM_FAST(gemm_fp8_fast_t128_b8, fastgemm::Fp8Chunks<128>, 128, 4, 8, 3, 256)
GEMM_FAST(gemm_fp8_fast_t128_b32, fastgemm::Fp8Chunks<128>, 128, 4, 32, 3, 256)
GEMM_FAST(gemm_fp8_fast_t128_b64, fastgemm::Fp8Chunks<128>, 128, 4, 64, 3, 256)
GEMM_FAST(gemm_fp8_fast_t128_b128, fastgemm::Fp8Chunks<128>, 128, 8, 128, 2, 256)

GEMM_FAST(gemm_fp4_fast_b8, fastgemm::Fp4Chunks, 32, 4, 8, 3, 256)
GEMM_FAST(gemm_fp4_fast_b32, fastgemm::Fp4Chunks, 32, 4, 32, 3, 256)
GEMM_FAST(gemm_fp4_fast_b64, fastgemm::Fp4Chunks, 32, 4, 64, 3, 256)
GEMM_FAST(gemm_fp4_fast_b128, fastgemm::Fp4Chunks, 32, 8, 128, 2, 256)

GEMM_FAST_ROUTED(gemm_fp4_fast_routed_b8, fastgemm::Fp4Chunks, 4, 8, 2, 512)
GEMM_FAST_ROUTED(gemm_fp4_fast_routed_b32, fastgemm::Fp4Chunks, 8, 32, 3, 256)
GEMM_FAST_ROUTED(gemm_fp4_fast_routed_b64, fastgemm::Fp4Chunks, 8, 64, 3, 128)
GEMM_FAST_ROUTED(gemm_fp4_fast_routed_b128, fastgemm::Fp4Chunks, 8, 128, 3, 128)

extern "C" __global__ void gemm_fast_reduce(const float* partials, void* y, FastReduceParams p) {
    grid_dependency_sync();
    fastgemm::gemm_fast_reduce(partials, y, p);
}

