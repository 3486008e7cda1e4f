// Interleaved-pair partial RoPE instantiations on f32 storage (the model's host layout).
#include "common/grid_dependency.cuh"
#include "rope/rope.cuh"
#include "rope/rope_qdq.cuh"

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

// RMSNorm (when w is not null), RoPE and a QDQ point in one pass (rope/rope_qdq.cuh), bf16
// rounding throughout: the window entries (Q8), the indexer's queries and keys (Q4e) and the
// compressed entries (Q4m).
#define ROPE_QDQ(name, rule)                                                                            \
    extern "C" __global__ void __launch_bounds__(rope_qdq::THREADS)                                     \
        name(const float* x, const float* w, float* y, const int* positions, const float* cos_table,   \
             const float* sin_table, RopeQdqParams p) {                                                 \
        grid_dependency_sync();                                                                         \
        rope_qdq::rope_qdq<rule>(x, w, y, positions, cos_table, sin_table, p);                          \
    }
ROPE_QDQ(rope_qdq_q8_f32, qdq::Q8)
ROPE_QDQ(rope_qdq_q4e_f32, qdq::Q4e)
ROPE_QDQ(rope_qdq_q4m_f32, qdq::Q4m)
