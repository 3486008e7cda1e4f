// Instantiations of the indexer scores on f32 storage: one query, and a batch of queries that
// each see a window of one table of key rows (a prefix of their own sequence's keys), the rows
// either rows of one key buffer or entries of a device pointer table (one address per row). One
// kernel body (index_scores.cuh); the `fast` numerics' table entry on tensor cores
// (index_scores_fast.cuh).
#include "common/grid_dependency.cuh"
#include "indexer/index_scores.cuh"
#include "indexer/index_scores_fast.cuh"

// One query: grid (p.keys); scores [p.keys].
extern "C" __global__ void __launch_bounds__(indexer::THREADS)
    index_scores_f32(const float* q, const float* w, const float* keys, float* scores, IndexParams p) {
    grid_dependency_sync();
    indexer::index_scores(q, w, indexer::FlatKeys{keys, p.head_dim}, p.keys, scores, p);
}

// Queries q [queries, heads, head_dim], w [queries, heads]: grid (max visible, queries); query t
// scores the visible[t] keys from row first_keys[t] (first + visible <= p.keys) into
// scores[score_starts[t] ..].
extern "C" __global__ void __launch_bounds__(indexer::THREADS)
    index_scores_rows_f32(const float* q, const float* w, const float* keys, const u32_t* visible,
                          const u32_t* first_keys, const u32_t* score_starts, float* scores,
                          IndexParams p) {
    grid_dependency_sync();
    const size_t query = blockIdx.y;
    indexer::index_scores(q + query * p.heads * p.head_dim, w + query * p.heads,
                          indexer::FlatKeys{keys + size_t(first_keys[query]) * p.head_dim, p.head_dim},
                          visible[query], scores + score_starts[query], p);
}

// As index_scores_rows_f32, with key row r the head_dim floats at the device address
// key_ptrs[r] (r < p.keys).
extern "C" __global__ void __launch_bounds__(indexer::THREADS)
    index_scores_rows_ptr_f32(const float* q, const float* w, const unsigned long long* key_ptrs,
                              const u32_t* visible, const u32_t* first_keys,
                              const u32_t* score_starts, float* scores, IndexParams p) {
    grid_dependency_sync();
    const size_t query = blockIdx.y;
    indexer::index_scores(q + query * p.heads * p.head_dim, w + query * p.heads,
                          indexer::KeyPointers{key_ptrs + first_keys[query]}, visible[query],
                          scores + score_starts[query], p);
}

// The `fast` numerics' scores at the bf16 rounding points (index_scores_fast.cuh: tensor-core dot
// products, head_dim 128, at most 64 heads), the arguments of index_scores_rows_ptr_f32 and the
// query count and the queries per block: grid (ceil(max visible / TILE_KEYS), ceil(queries / group)), THREADS threads,
// sizeof(fast_index::Shared) bytes of dynamic shared memory; key rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(fast_index::THREADS, 2)
    index_scores_rows_ptr_fast(const float* q, const float* w, const unsigned long long* key_ptrs,
                               const u32_t* visible, const u32_t* first_keys,
                               const u32_t* score_starts, float* scores, u32_t queries, u32_t group,
                               IndexParams p) {
    grid_dependency_sync();
    fast_index::index_scores(q, w, key_ptrs, visible, first_keys, score_starts, scores, queries, group, p);
}
