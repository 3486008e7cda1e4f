// Interleaved-pair partial RoPE instantiation for bf16 activations.
#include "common/grid_dependency.cuh"
#include "rope/rope.cuh"

extern "C" __global__ void __launch_bounds__(rope::THREADS)
    rope_interleaved_bf16(__nv_bfloat16* x, const int* positions, const float* cos_table,
                          const float* sin_table, RopeParams p) {
    grid_dependency_sync();
    rope::rope_interleaved<__nv_bfloat16>(x, positions, cos_table, sin_table, p);
}

// f32 storage (the model's host layout), outputs rounded to bf16.
extern "C" __global__ void __launch_bounds__(rope::THREADS)
    rope_interleaved_f32(float* x, const int* positions, const float* cos_table, const float* sin_table,
                         RopeParams p) {
    grid_dependency_sync();
    rope::rope_interleaved<float>(x, positions, cos_table, sin_table, p);
}

// f32 storage, fp32 outputs (no rounding).
extern "C" __global__ void __launch_bounds__(rope::THREADS)
    rope_interleaved_f32_exact(float* x, const int* positions, const float* cos_table,
                               const float* sin_table, RopeParams p) {
    grid_dependency_sync();
    rope::rope_interleaved<float, false>(x, positions, cos_table, sin_table, p);
}
