// Interleaved-pair partial RoPE instantiations on f32 storage (the model's host layout).
#include "common/grid_dependency.cuh"
#include "rope/rope.cuh"

// Outputs rounded to bf16.
extern "C" __global__ void __launch_bounds__(rope::THREADS)
    rope_interleaved_f32(float* x, const int* positions, const float* cos_table, const float* sin_table,
                         RopeParams p) {
    grid_dependency_sync();
    rope::rope_interleaved<true>(x, positions, cos_table, sin_table, p);
}

// f32 storage, fp32 outputs (no rounding).
extern "C" __global__ void __launch_bounds__(rope::THREADS)
    rope_interleaved_f32_exact(float* x, const int* positions, const float* cos_table,
                               const float* sin_table, RopeParams p) {
    grid_dependency_sync();
    rope::rope_interleaved<false>(x, positions, cos_table, sin_table, p);
}
