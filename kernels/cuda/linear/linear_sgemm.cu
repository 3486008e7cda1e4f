// Instantiations of the sgemm-order fp32 linear (block partials, then their pairwise tree) (f32 in, f32 weights, f32 or bf16-rounded out),
// and of the `fast` linears on tensor cores (linear_fast.cuh): the bf16 linear (x rounded to bf16) and the split-x
// bf16x3 linear (x in three bf16 pieces), each in three decode tiles by row count and the prefill tile (every tile
// gives the same bits).
#include "common/grid_dependency.cuh"
#include "linear/linear_sgemm.cuh"
#include "linear/linear_fast.cuh"

extern "C" __global__ void __launch_bounds__(linear::THREADS)
    linear_sgemm_f32(const float* x, const float* w, float* partials, LinearParams p) {
    grid_dependency_sync();
    linear::linear_sgemm_partials(x, w, partials, p);
}

extern "C" __global__ void __launch_bounds__(linear::THREADS)
    linear_sgemm_reduce_f32(const float* partials, float* y, LinearParams p) {
    grid_dependency_sync();
    linear::linear_sgemm_reduce(partials, y, p);
}

extern "C" __global__ void __launch_bounds__(linear::THREADS)
    dequant_fp8_rows_f32(const u8_t* codes, const u8_t* scales, float* out, DequantParams p) {
    grid_dependency_sync();
    linear::dequant_fp8_rows(codes, scales, out, p);
}

extern "C" __global__ void __launch_bounds__(linear::THREADS)
    dequant_fp4_rows_f32(const u8_t* packed, const u8_t* scales, float* out, DequantParams p) {
    grid_dependency_sync();
    linear::dequant_fp4_rows(packed, scales, out, p);
}

// The fast linears of a bf16 weight, per product (x as PIECES bf16 pieces: linear_bf16_fast_* one,
// linear_bf16x3_fast_* three) and tile (ops/linear_fast.rs, FastLinearTile).
#define LINEAR_FAST_DECODE(NAME, PIECES, MT, NT)                                                      \
    extern "C" __global__ void __launch_bounds__(linear_fast::THREADS)                               \
        NAME(const float* x, const uint4* w, float* y, LinearParams p) {                             \
        grid_dependency_sync();                                                                      \
        linear_fast::linear_bf16<PIECES, MT, NT>(x, w, y, p);                                        \
    }
#define LINEAR_FAST_WIDE(NAME, PIECES)                                                                \
    extern "C" __global__ void __launch_bounds__(linear_fast::THREADS, 1)                            \
        NAME(const float* x, const uint4* w, float* y, LinearParams p) {                             \
        grid_dependency_sync();                                                                      \
        linear_fast::linear_bf16_wide<PIECES, false>(x, w, y, nullptr, p);                           \
    }
#define LINEAR_FAST_WIDE_PART(NAME, PIECES)                                                           \
    extern "C" __global__ void __launch_bounds__(linear_fast::THREADS)                               \
        NAME(const float* x, const uint4* w, float* partials, LinearParams p) {                      \
        grid_dependency_sync();                                                                      \
        linear_fast::linear_bf16_wide<PIECES, true>(x, w, nullptr, partials, p);                     \
    }

LINEAR_FAST_DECODE(linear_bf16_fast_t1x1, 1, 1, 1)
LINEAR_FAST_DECODE(linear_bf16_fast_t2x2, 1, 2, 2)
LINEAR_FAST_DECODE(linear_bf16_fast_t4x2, 1, 4, 2)
LINEAR_FAST_WIDE(linear_bf16_fast_wide, 1)
LINEAR_FAST_DECODE(linear_bf16x3_fast_t1x1, 3, 1, 1)
LINEAR_FAST_DECODE(linear_bf16x3_fast_t2x2, 3, 2, 2)
LINEAR_FAST_DECODE(linear_bf16x3_fast_t4x2, 3, 4, 2)
LINEAR_FAST_WIDE(linear_bf16x3_fast_wide, 3)
LINEAR_FAST_WIDE_PART(linear_bf16_fast_wide_part, 1)
LINEAR_FAST_WIDE_PART(linear_bf16x3_fast_wide_part, 3)

extern "C" __global__ void linear_fast_reduce(const float* partials, float* y, LinearReduceParams p) {
    grid_dependency_sync();
    linear_fast::linear_fast_reduce(partials, y, p);
}
