// Interleaved-pair partial RoPE instantiation for bf16 activations.
#include "rope/rope.cuh"

extern "C" __global__ void __launch_bounds__(rope::THREADS)
    rope_interleaved_bf16(__nv_bfloat16* x, const int* positions, const float* cos_table,
                          const float* sin_table, RopeParams p) {
    rope::rope_interleaved<__nv_bfloat16>(x, positions, cos_table, sin_table, p);
}
