// Instantiations of the FP8 activation quantiser: group 32 (V4.1) and group 128 (V4), from bf16
// storage and from f32 storage (the model's host layout; any fp32 values).
#include "common/grid_dependency.cuh"
#include "quant/act_quant.cuh"

extern "C" __global__ void act_quant_fp8_g32_bf16(const __nv_bfloat16* x, u8_t* codes, float* scales,
                                                  ActQuantParams p) {
    grid_dependency_sync();
    act_quant_fp8<32>(x, codes, scales, p);
}

extern "C" __global__ void act_quant_fp8_g128_bf16(const __nv_bfloat16* x, u8_t* codes, float* scales,
                                                   ActQuantParams p) {
    grid_dependency_sync();
    act_quant_fp8<128>(x, codes, scales, p);
}

extern "C" __global__ void act_quant_fp8_g32_f32(const float* x, u8_t* codes, float* scales, ActQuantParams p) {
    grid_dependency_sync();
    act_quant_fp8<32>(x, codes, scales, p);
}

extern "C" __global__ void act_quant_fp8_g128_f32(const float* x, u8_t* codes, float* scales, ActQuantParams p) {
    grid_dependency_sync();
    act_quant_fp8<128>(x, codes, scales, p);
}
