// Instantiation of the indexer scores on f32 storage.
#include "indexer/index_scores.cuh"

extern "C" __global__ void __launch_bounds__(indexer::THREADS)
    index_scores_f32(const float* q, const float* w, const float* keys, float* scores, IndexParams p) {
    indexer::index_scores(q, w, keys, scores, p);
}
