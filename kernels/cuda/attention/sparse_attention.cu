// Instantiations of the sink attention on f32 storage (bf16 values): one query, and a batch of
// queries each over its own list of key rows, the rows either rows of one key buffer or entries
// of a device pointer table (one address per row). One kernel body (sparse_attention.cuh); the
// entries differ only in how a row's address is found.
#include "attention/sparse_attention.cuh"
#include "attention/sparse_attention_fast.cuh"

// One query: grid (heads); keys [p.keys, head_dim], key j is row j.
extern "C" __global__ void __launch_bounds__(attention::THREADS)
    sparse_attention_sink_f32(const float* q, const float* keys, const float* sink, float* out,
                              AttentionParams p) {
    attention::sparse_attention_sink(q, attention::FlatKeys{keys, p.head_dim}, attention::ConsecutiveRows{},
                                     p.keys, sink, out, p);
}

// Queries [queries, heads, head_dim]: grid (heads, queries); query t's keys are the rows
// key_rows[row_starts[t] .. row_starts[t + 1]) of keys [p.keys, head_dim].
extern "C" __global__ void __launch_bounds__(attention::THREADS)
    sparse_attention_sink_rows_f32(const float* q, const float* keys, const u32_t* key_rows,
                                   const u32_t* row_starts, const float* sink, float* out,
                                   AttentionParams p) {
    const size_t query = blockIdx.y;
    const u32_t first = row_starts[query];
    const size_t width = (size_t)p.heads * p.head_dim;
    attention::sparse_attention_sink(q + query * width, attention::FlatKeys{keys, p.head_dim},
                                     attention::ListedRows{key_rows + first}, row_starts[query + 1] - first,
                                     sink, out + query * width, p);
}

// As sparse_attention_sink_rows_f32, with the rows looked up in a pointer table: row r of the
// lists is the head_dim floats at the device address key_ptrs[r] (r < p.keys).
extern "C" __global__ void __launch_bounds__(attention::THREADS)
    sparse_attention_sink_rows_ptr_f32(const float* q, const unsigned long long* key_ptrs,
                                       const u32_t* key_rows, const u32_t* row_starts,
                                       const float* sink, float* out, AttentionParams p) {
    const size_t query = blockIdx.y;
    const u32_t first = row_starts[query];
    const size_t width = (size_t)p.heads * p.head_dim;
    attention::sparse_attention_sink(q + query * width, attention::KeyPointers{key_ptrs},
                                     attention::ListedRows{key_rows + first}, row_starts[query + 1] - first,
                                     sink, out + query * width, p);
}

// The `fast` numerics' row-batched entry (sparse_attention_fast.cuh): grid (ceil(heads / 16),
// queries), head_dim / 2 threads; the arguments of sparse_attention_sink_rows_ptr_f32.
extern "C" __global__ void __launch_bounds__(fast_attention::MAX_WARPS * 32)
    sparse_attention_sink_rows_ptr_fast(const float* q, const unsigned long long* key_ptrs,
                                        const u32_t* key_rows, const u32_t* row_starts,
                                        const float* sink, float* out, AttentionParams p) {
    const size_t query = blockIdx.y;
    const u32_t first = row_starts[query];
    const size_t width = (size_t)p.heads * p.head_dim;
    fast_attention::attention(q + query * width, key_ptrs, key_rows + first,
                              row_starts[query + 1] - first, sink, out + query * width, p);
}
