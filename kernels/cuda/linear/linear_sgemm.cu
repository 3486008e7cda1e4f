// Instantiation of the sgemm-order fp32 linear (f32 in, f32 weights, f32 or bf16-rounded out).
#include "linear/linear_sgemm.cuh"

extern "C" __global__ void __launch_bounds__(linear::THREADS)
    linear_sgemm_f32(const float* x, const float* w, float* y, LinearParams p) {
    linear::linear_sgemm(x, w, y, p);
}

extern "C" __global__ void __launch_bounds__(linear::THREADS)
    dequant_fp8_rows_f32(const u8_t* codes, const u8_t* scales, float* out, DequantParams p) {
    linear::dequant_fp8_rows(codes, scales, out, p);
}

extern "C" __global__ void __launch_bounds__(linear::THREADS)
    dequant_fp4_rows_f32(const u8_t* packed, const u8_t* scales, float* out, DequantParams p) {
    linear::dequant_fp4_rows(packed, scales, out, p);
}
