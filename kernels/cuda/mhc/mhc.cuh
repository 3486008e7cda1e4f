// mHC (manifold-constrained hyper-connections, v41-architecture.md §3.2) for a batch of tokens,
// operation for operation as the CPU reference (CpuBackend::hc_mixes / hc_collapse / hc_expand).
// Every token's math is the one-token math on its own rows (one token = the n = 1 case), so a
// token's results do not depend on the batch.
//
// hc_mixes, two launches. hc_mixes_partials (grid: partial blocks x tokens): every (projection,
// K chain) partial of the CPU sgemm order (refmath::sgemm_chains) is its own fp32 FMA chain in K
// order; a warp
// owns 32 consecutive partials (one lane each), loads them 32 K at a time with coalesced reads
// (the warp reads 32 consecutive K of one row) into a padded shared tile and each lane runs its
// chain from the tile. The last block of a token computes the mean-of-squares sum in the order of
// torch's CPU sum (refmath::torch_sum_block, as the CPU reference's sum_squares_f32_torch).
// Scratch per token: [projections * K chains partials, sum of squares].
// hc_mixes (grid: tokens): one thread per projection adds its partials in the CPU's pairwise
// tree; then one warp does the sigmoids and the Sinkhorn iterations in the reference's order (a
// lane per row in the row passes, a lane per column in the column passes).
// Output per token: pre [hc], post [hc], comb [hc, hc].
// hc_collapse / hc_expand: elementwise, token = blockIdx.y, each token with its own weights /
// mixes; the k/j sums in stream order in fp32, one rounding (bf16 when p.round_bf16, else none).
#pragma once
#include "common/reference_math.cuh"

namespace mhc {

constexpr int THREADS = 256;
constexpr int MAX_HC = 8;

constexpr u32_t PARTIAL_WARPS = 4;
constexpr u32_t PARTIAL_THREADS = PARTIAL_WARPS * 32;
constexpr u32_t TILE_K = 32;  // K values of each chain loaded per pass

__device__ __forceinline__ u32_t hc_mixes_tasks(HcMixesParams p) {
    return (2 + p.hc) * p.hc * refmath::sgemm_chains(p.n);
}

__device__ void hc_mixes_partials(const float* __restrict__ x, const float* __restrict__ proj,
                                  float* __restrict__ scratch, HcMixesParams p) {
    __shared__ float x_tile[PARTIAL_WARPS][32][TILE_K + 1];
    __shared__ float w_tile[PARTIAL_WARPS][32][TILE_K + 1];
    __shared__ float sum_scratch[refmath::TORCH_SUM_ILP * refmath::TORCH_SUM_LANES + refmath::TORCH_SUM_LANES + 1];
    const u32_t k_chains = refmath::sgemm_chains(p.n);
    const u32_t tasks = hc_mixes_tasks(p);
    x += (size_t)blockIdx.y * p.n;
    scratch += (size_t)blockIdx.y * (tasks + 1);
    if (blockIdx.x == gridDim.x - 1) {
        // Bring the token's row into L1 first, so the sum's strided chains do not wait on memory.
        for (u32_t i = threadIdx.x * 32; i < p.n; i += PARTIAL_THREADS * 32)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(x + i));
        const float sum_squares = refmath::torch_sum_block<float, true>(x, p.n, sum_scratch);
        if (threadIdx.x == 0) scratch[tasks] = sum_squares;
        return;
    }
    const u32_t warp = threadIdx.x / 32;
    const u32_t lane = threadIdx.x % 32;
    const u32_t first = (blockIdx.x * PARTIAL_WARPS + warp) * 32;
    if (first >= tasks) return;  // only warp-level synchronisation below
    const u32_t chains = min(32u, tasks - first);
    // Lane j's chain: task first + j = (row, K chain); its K start and its length.
    const u32_t task = first + min(lane, chains - 1);
    const u32_t start = refmath::sgemm_chain_start(task % k_chains, p.n, k_chains);
    const unsigned long long row_start = (unsigned long long)(task / k_chains) * p.n + start;
    const u32_t length =
        lane < chains ? refmath::sgemm_chain_start(task % k_chains + 1, p.n, k_chains) - start : 0u;
    const u32_t longest = (p.n + k_chains - 1) / k_chains;
    float(*xs)[TILE_K + 1] = x_tile[warp];
    float(*ws)[TILE_K + 1] = w_tile[warp];
    float acc = 0.0f;
    for (u32_t offset = 0; offset < longest; offset += TILE_K) {
        // All 64 loads of a pass are issued before the first is used (memory-level parallelism).
        float x_values[32];
        float w_values[32];
#pragma unroll
        for (u32_t j = 0; j < 32; ++j) {
            const u32_t chain_start = __shfl_sync(0xffffffffu, start, j);
            const unsigned long long chain_row = __shfl_sync(0xffffffffu, row_start, j);
            const u32_t k = chain_start + offset + lane;
            const bool inside = j < chains && k < p.n;
            x_values[j] = inside ? x[k] : 0.0f;
            w_values[j] = inside ? proj[chain_row + offset + lane] : 0.0f;
        }
#pragma unroll
        for (u32_t j = 0; j < 32; ++j) {
            xs[j][lane] = x_values[j];
            ws[j][lane] = w_values[j];
        }
        __syncwarp();
        const u32_t count = length > offset ? min(TILE_K, length - offset) : 0u;
        for (u32_t i = 0; i < count; ++i) acc = __fmaf_rn(xs[lane][i], ws[lane][i], acc);
        __syncwarp();
    }
    if (lane < chains) scratch[first + lane] = acc;
}

__device__ void hc_mixes(const float* __restrict__ scratch, const float* __restrict__ base,
                         const float* __restrict__ scale, float* __restrict__ out, HcMixesParams p) {
    extern __shared__ float token_partials[];  // [tasks + 1], staged with coalesced loads
    __shared__ float mixes[(2 + MAX_HC) * MAX_HC];
    __shared__ float c[MAX_HC * MAX_HC];  // comb through the softmax and Sinkhorn passes
    const u32_t hc = p.hc;
    const u32_t projections = (2 + hc) * hc;
    const u32_t k_chains = refmath::sgemm_chains(p.n);
    const u32_t tasks = hc_mixes_tasks(p);
    scratch += (size_t)blockIdx.x * (tasks + 1);
    out += (size_t)blockIdx.x * (2 * hc + hc * hc);
    for (u32_t i = threadIdx.x; i <= tasks; i += THREADS) token_partials[i] = scratch[i];
    __syncthreads();
    const float* partials = token_partials;
    const float sum_squares = partials[tasks];

    const float mean_square = __fdiv_rn(sum_squares, (float)p.n);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_square, p.norm_eps)));
    if (threadIdx.x < projections) {
        refmath::PairwiseSum total;
        for (u32_t b = 0; b < k_chains; ++b) total.push(partials[threadIdx.x * k_chains + b]);
        mixes[threadIdx.x] = __fmul_rn(total.finish(), inv);
    }
    __syncthreads();
    // One warp from here: lane j owns row j of comb in the row passes, lane k column k in the
    // column passes (each sum in the reference's order); __syncwarp orders the passes.
    if (threadIdx.x >= 32) return;
    const u32_t lane = threadIdx.x;
    const bool owner = lane < hc;
    float* pre = out;
    float* post = out + hc;
    float* comb = out + 2 * hc;
    if (owner) {
        const u32_t k = lane;
        pre[k] = __fadd_rn(refmath::sigmoid(__fadd_rn(__fmul_rn(mixes[k], scale[0]), base[k])), p.hc_eps);
        post[k] = __fmul_rn(2.0f, refmath::sigmoid(__fadd_rn(__fmul_rn(mixes[hc + k], scale[1]), base[hc + k])));
    }
    for (u32_t i = lane; i < hc * hc; i += 32)
        c[i] = __fadd_rn(__fmul_rn(mixes[2 * hc + i], scale[2]), base[2 * hc + i]);
    __syncwarp();
    // Row softmax (+eps), column normalisation, then (iters - 1) row/column passes.
    if (owner) {
        float* row = c + lane * hc;
        float max = -__uint_as_float(0x7f800000u);
        for (u32_t k = 0; k < hc; ++k) max = fmaxf(max, row[k]);
        // The reference's standalone torch.exp here is correctly rounded (CPU: quant::exp_f32_accurate).
        for (u32_t k = 0; k < hc; ++k) row[k] = refmath::exp_accurate(__fsub_rn(row[k], max));
        float s = 0.0f;
        for (u32_t k = 0; k < hc; ++k) s = __fadd_rn(s, row[k]);
        for (u32_t k = 0; k < hc; ++k) row[k] = __fadd_rn(__fdiv_rn(row[k], s), p.hc_eps);
    }
    __syncwarp();
    const u32_t column_passes = p.sinkhorn_iters > 0 ? p.sinkhorn_iters : 1;  // the first is unconditional
    for (u32_t iter = 0; iter < column_passes; ++iter) {
        if (iter > 0) {
            if (owner) {
                const u32_t j = lane;
                float s = 0.0f;
                for (u32_t k = 0; k < hc; ++k) s = __fadd_rn(s, c[j * hc + k]);
                s = __fadd_rn(s, p.hc_eps);
                for (u32_t k = 0; k < hc; ++k) c[j * hc + k] = __fdiv_rn(c[j * hc + k], s);
            }
            __syncwarp();
        }
        if (owner) {
            const u32_t k = lane;
            float s = 0.0f;
            for (u32_t j = 0; j < hc; ++j) s = __fadd_rn(s, c[j * hc + k]);
            s = __fadd_rn(s, p.hc_eps);
            for (u32_t j = 0; j < hc; ++j) c[j * hc + k] = __fdiv_rn(c[j * hc + k], s);
        }
        __syncwarp();
    }
    for (u32_t i = lane; i < hc * hc; i += 32) comb[i] = c[i];
}

// y[t, d] = bf16(sum_k w[t, k] * x[t, k, d]), k in stream order from 0; t = blockIdx.y.
__device__ void hc_collapse(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                            HcElementwiseParams p) {
    const u32_t d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= p.dim) return;
    const size_t token = blockIdx.y;
    x += token * p.hc * p.dim;
    w += token * p.hc;
    y += token * p.dim;
    float acc = 0.0f;
    for (u32_t k = 0; k < p.hc; ++k) acc = __fadd_rn(acc, __fmul_rn(w[k], x[(size_t)k * p.dim + d]));
    y[d] = p.round_bf16 ? round_bf16_f32(acc) : acc;
}

// out[t, k, d] = bf16(post[k] * y[t, d] + sum_j comb[j, k] * residual[t, j, d]) with token t's
// mix = post [hc] ++ comb [hc, hc] (mix [tokens, hc + hc * hc]); t = blockIdx.y.
__device__ void hc_expand(const float* __restrict__ y, const float* __restrict__ residual,
                          const float* __restrict__ mix, float* __restrict__ out, HcElementwiseParams p) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)p.hc * p.dim) return;
    const size_t token = blockIdx.y;
    y += token * p.dim;
    residual += token * p.hc * p.dim;
    mix += token * (p.hc + p.hc * p.hc);
    out += token * p.hc * p.dim;
    const u32_t k = (u32_t)(i / p.dim);
    const u32_t d = (u32_t)(i % p.dim);
    const float* comb = mix + p.hc;
    float mixed = 0.0f;
    for (u32_t j = 0; j < p.hc; ++j)
        mixed = __fadd_rn(mixed, __fmul_rn(comb[j * p.hc + k], residual[(size_t)j * p.dim + d]));
    const float v = __fadd_rn(__fmul_rn(mix[k], y[d]), mixed);
    out[i] = p.round_bf16 ? round_bf16_f32(v) : v;
}

}  // namespace mhc
