// Instantiations of the indexer scores on f32 storage: one query, and a batch of queries that
// each see a prefix of one shared key buffer.
#include "indexer/index_scores.cuh"

// One query: grid (p.keys); scores [p.keys].
extern "C" __global__ void __launch_bounds__(indexer::THREADS)
    index_scores_f32(const float* q, const float* w, const float* keys, float* scores, IndexParams p) {
    indexer::index_scores(q, w, keys, p.keys, scores, p);
}

// Queries q [queries, heads, head_dim], w [queries, heads]: grid (max visible, queries); query t
// scores the first visible[t] (<= p.keys) keys into scores[score_starts[t] ..].
extern "C" __global__ void __launch_bounds__(indexer::THREADS)
    index_scores_rows_f32(const float* q, const float* w, const float* keys, const u32_t* visible,
                          const u32_t* score_starts, float* scores, IndexParams p) {
    const size_t query = blockIdx.y;
    indexer::index_scores(q + query * p.heads * p.head_dim, w + query * p.heads, keys, visible[query],
                          scores + score_starts[query], p);
}
