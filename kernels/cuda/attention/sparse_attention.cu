// Instantiation of the sink attention on f32 storage (bf16 values).
#include "attention/sparse_attention.cuh"

extern "C" __global__ void __launch_bounds__(attention::THREADS)
    sparse_attention_sink_f32(const float* q, const float* keys, const float* sink, float* out,
                              AttentionParams p) {
    attention::sparse_attention_sink(q, keys, sink, out, p);
}
