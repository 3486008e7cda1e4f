// Instantiations of the batched token sampler on f32 logits, of the grammar mask it samples after,
// and of the log-probabilities of the sampled tokens.
#include "common/grid_dependency.cuh"
#include "sampling/sampling.cuh"

extern "C" __global__ void __launch_bounds__(sampling::THREADS)
    sample_rows_f32(const float* logits, const sampling::SampleRow* rows, unsigned long long* sort_scratch,
                    double* weight_scratch, u32_t* tokens, sampling::SampleParams p) {
    grid_dependency_sync();
    sampling::sample_rows(logits, rows, sort_scratch, weight_scratch, tokens, p);
}

extern "C" __global__ void __launch_bounds__(sampling::MASK_THREADS)
    mask_logits_f32(float* logits, const u32_t* words, sampling::MaskParams p) {
    grid_dependency_sync();
    sampling::mask_logits(logits, words, p);
}

extern "C" __global__ void __launch_bounds__(sampling::LOGPROB_LANES)
    token_logprobs_f32(const float* logits, const u32_t* chosen, float* chosen_logprob, u32_t* top_ids,
                       float* top_logprobs, sampling::LogprobParams p) {
    grid_dependency_sync();
    sampling::token_logprobs(logits, chosen, chosen_logprob, top_ids, top_logprobs, p);
}
