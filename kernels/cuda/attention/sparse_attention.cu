// Instantiations of the sink attention on f32 storage: a batch of queries each over its own list
// of key rows, the rows either rows of one key buffer or entries of a device pointer table (one
// address per row). One kernel body (sparse_attention.cuh); the entries differ only in how a
// row's address is found.
#include "common/grid_dependency.cuh"
#include "attention/sparse_attention.cuh"
#include "attention/sparse_attention_fast.cuh"

// Queries [queries, heads, head_dim]: grid (heads, queries); query t's keys are the rows
// key_rows[row_starts[t] .. row_starts[t + 1]) of keys [p.keys, head_dim].
extern "C" __global__ void __launch_bounds__(attention::THREADS)
    sparse_attention_sink_rows_f32(const float* q, const float* keys, const u32_t* key_rows,
                                   const u32_t* row_starts, const float* sink, float* out,
                                   AttentionParams p) {
    grid_dependency_sync();
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
    grid_dependency_sync();
    const size_t query = blockIdx.y;
    const u32_t first = row_starts[query];
    const size_t width = (size_t)p.heads * p.head_dim;
    attention::sparse_attention_sink(q + query * width, attention::KeyPointers{key_ptrs},
                                     attention::ListedRows{key_rows + first}, row_starts[query + 1] - first,
                                     sink, out + query * width, p);
}

// The `fast` numerics' row-batched entry (sparse_attention_fast.cuh): grid (ceil(heads / (16 ·
// groups)), queries of this launch, the most splits of any of them), groups · head_dim / 2
// threads (groups 1, 2 or 4: 16 to 64 heads a block), sizeof(fast_attention::Shared<false, 1>) + 128 ·
// head_dim bytes of dynamic shared memory; the arguments of sparse_attention_sink_rows_ptr_f32
// (q and the keys bf16 values; p.round_bf16 set, for the combine), then the split
// scratch and the launch's queries: query query0 + blockIdx.y; its split s of several writes acc
// [heads, head_dim] at split_acc + (blockIdx.y * max_splits + s) * heads * head_dim and stats
// [heads, 2] at split_stats + (blockIdx.y * max_splits + s) * heads * 2.
extern "C" __global__ void __launch_bounds__(fast_attention::MAX_THREADS)
    sparse_attention_sink_rows_ptr_fast(const float* q, const unsigned long long* key_ptrs,
                                        const u32_t* key_rows, const u32_t* row_starts,
                                        const float* sink, float* out, float* split_acc,
                                        float* split_stats, u32_t query0, u32_t max_splits,
                                        AttentionParams p) {
    grid_dependency_sync();
    fast_attention::attention<false, 1>(q, key_ptrs, key_rows, row_starts, sink, out, split_acc, split_stats,
                                        query0, max_splits, p);
}

// The same attention of f32 q and keys, each split into two bf16 pieces (fp32 accuracy, the f32
// output unrounded: sparse_attention_fast.cuh): groups 1 or 2 (16 or 32 heads a block),
// sizeof(fast_attention::Shared<false, 2>) + 128 · head_dim bytes of dynamic shared memory; p.round_bf16
// clear, for the combine.
extern "C" __global__ void __launch_bounds__(fast_attention::MAX_F32_THREADS)
    sparse_attention_sink_rows_ptr_fast_f32(const float* q, const unsigned long long* key_ptrs,
                                            const u32_t* key_rows, const u32_t* row_starts,
                                            const float* sink, float* out, float* split_acc,
                                            float* split_stats, u32_t query0, u32_t max_splits,
                                            AttentionParams p) {
    grid_dependency_sync();
    fast_attention::attention<false, 2>(q, key_ptrs, key_rows, row_starts, sink, out, split_acc, split_stats,
                                        query0, max_splits, p);
}

// The same attention with one block per query running all of its splits (grid (head blocks,
// queries of this launch, 1); at most 512 threads: 32 heads of head_dim 512, so that the merged
// outputs stay in registers; sizeof(fast_attention::Shared<true, 1>) bytes of dynamic shared
// memory, for its rounds of two tiles, and no staging ring: its keys go through registers); the
// same bits as the split blocks and their combine, no scratch.
extern "C" __global__ void __launch_bounds__(fast_attention::MAX_WHOLE_THREADS)
    sparse_attention_sink_rows_ptr_fast_whole(const float* q, const unsigned long long* key_ptrs,
                                              const u32_t* key_rows, const u32_t* row_starts,
                                              const float* sink, float* out, u32_t query0,
                                              AttentionParams p) {
    grid_dependency_sync();
    fast_attention::attention<true, 1>(q, key_ptrs, key_rows, row_starts, sink, out, nullptr, nullptr, query0, 1, p);
}

// The one-block-per-query form of sparse_attention_sink_rows_ptr_fast_f32 (at most 512 threads:
// 32 heads of head_dim 512, as many as its shared memory holds; sizeof(fast_attention::Shared<true,
// 2>) + 128 · head_dim bytes).
extern "C" __global__ void __launch_bounds__(fast_attention::MAX_F32_THREADS)
    sparse_attention_sink_rows_ptr_fast_f32_whole(const float* q, const unsigned long long* key_ptrs,
                                                  const u32_t* key_rows, const u32_t* row_starts,
                                                  const float* sink, float* out, u32_t query0,
                                                  AttentionParams p) {
    grid_dependency_sync();
    fast_attention::attention<true, 2>(q, key_ptrs, key_rows, row_starts, sink, out, nullptr, nullptr, query0, 1, p);
}

// Merges the splits of the queries of several splits of one sparse_attention_sink_rows_ptr_fast
// or _fast_f32 launch (same arguments): grid (ceil(heads · head_dim / 4 / threads), queries of the launch), any
// number of threads; thread i of the query's heads · head_dim / 4 writes head i / (head_dim / 4),
// dims 4 (i % (head_dim / 4)) .. + 4.
extern "C" __global__ void sparse_attention_split_combine(const u32_t* row_starts, const float* sink,
                                                          float* out, const float* split_acc,
                                                          const float* split_stats, u32_t query0,
                                                          u32_t max_splits, AttentionParams p) {
    grid_dependency_sync();
    const size_t query = query0 + blockIdx.y;
    const u32_t splits = fast_attention::splits_of(row_starts[query + 1] - row_starts[query]);
    if (splits == 1) return;
    const u32_t quads = p.head_dim / 4;
    const u32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    const u32_t h = i / quads;
    if (h >= p.heads) return;
    const size_t width = (size_t)p.heads * p.head_dim;
    const size_t slot = (size_t)blockIdx.y * max_splits;
    fast_attention::combine(split_acc + slot * width, split_stats + slot * p.heads * 2, splits, h,
                            i % quads, sink[h], out + query * width, p);
}
