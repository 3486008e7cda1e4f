// Instantiations of the indexer's selection (indexer/topk.cuh) over the flat scores of a batch of
// queries: query t owns scores[starts[t] .. starts[t] + visible[t]) (DeviceVisiblePrefixes).
#include "common/grid_dependency.cuh"
#include "indexer/topk.cuh"

// Grid (queries), THREADS threads. out [queries, k]: query t's selected indices ascending, then
// u32 max up to k; counts[t] = min(k, visible[t]).
extern "C" __global__ void __launch_bounds__(topk::THREADS)
    top_k_rows_f32(const float* scores, const u32_t* visible, const u32_t* starts, u32_t k, u32_t* out,
                   u32_t* counts) {
    grid_dependency_sync();
    __shared__ topk::Shared shared;
    const u32_t query = blockIdx.x;
    const u32_t n = visible[query];
    const u32_t count = min(k, n);
    const topk::ScoreKeys keys{scores + starts[query]};
    u32_t* row = out + (size_t)query * k;
    u32_t threshold, take_equal;
    topk::find_threshold(keys, n, count, shared, threshold, take_equal);
    topk::WriteIndex write{row};
    topk::compact(keys, n, count, threshold, take_equal, true, shared, write);
    for (u32_t r = count + threadIdx.x; r < k; r += topk::THREADS) row[r] = topk::NONE;
    if (threadIdx.x == 0) counts[query] = count;
}

// Grid (queries), THREADS threads. mask (the scores' layout): level one of the two-level top-k,
// 1 where a position's block is among the best min(topk_blocks, blocks) blocks and its block score
// is above -inf, else 0.
extern "C" __global__ void __launch_bounds__(topk::THREADS)
    candidate_mask_rows_f32(const float* scores, const u32_t* visible, const u32_t* starts,
                            u32_t block_size, u32_t topk_blocks, u8_t* mask) {
    grid_dependency_sync();
    __shared__ topk::Shared shared;
    const u32_t query = blockIdx.x;
    const u32_t n = visible[query];
    if (n == 0) return;
    const u32_t blocks = (n - 1) / block_size + 1;
    const u32_t count = min(topk_blocks, blocks);
    const topk::BlockMaxKeys keys{scores + starts[query], n, block_size, blocks - 1};
    u32_t threshold, take_equal;
    topk::find_threshold(keys, blocks, count, shared, threshold, take_equal);
    topk::WriteBlockMask write{mask + starts[query], n, block_size};
    topk::compact(keys, blocks, count, threshold, take_equal, false, shared, write);
}

// Grid (ceil(max scores' visible / 256), queries), 256 threads: score i of query t (i below both
// visible counts) becomes -inf where mask says 0; scores beyond the mask's row stay as they are.
extern "C" __global__ void __launch_bounds__(256)
    apply_mask_rows_f32(float* scores, const u32_t* score_visible, const u32_t* score_starts,
                        const u8_t* mask, const u32_t* mask_visible, const u32_t* mask_starts) {
    grid_dependency_sync();
    const u32_t query = blockIdx.y;
    const u32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= min(score_visible[query], mask_visible[query])) return;
    if (mask[mask_starts[query] + i] == 0) scores[score_starts[query] + i] = __uint_as_float(0xff800000u);  // -inf
}
