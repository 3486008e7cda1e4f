// mHC (manifold-constrained hyper-connections, v41-architecture.md §3.2) for a batch of tokens,
// operation for operation as the CPU reference (CpuBackend::hc_mixes / hc_collapse / hc_expand).
// Every token's math is the one-token math on its own rows (one token = the n = 1 case), so a
// token's results do not depend on the batch.
//
// hc_mixes, one block per token (blockIdx.x): x [tokens, hc, dim], each token flattened to n
// values; mean(x^2) in the order of torch's CPU sum (refmath::torch_sum_block, as the CPU
// reference's sum_squares_f32_torch); the (2 + hc) * hc
// projections in the CPU sgemm order (one thread per 256-block partial, then one thread per
// projection adds them in the CPU's pairwise tree); then one thread does the sigmoids and the Sinkhorn iterations
// in the reference's order. Output per token: pre [hc], post [hc], comb [hc, hc].
// hc_collapse / hc_expand: elementwise, token = blockIdx.y, each token with its own weights /
// mixes; the k/j sums in stream order in fp32, one rounding (bf16 when p.round_bf16, else none).
#pragma once
#include "common/reference_math.cuh"

namespace mhc {

constexpr int THREADS = 256;
constexpr int MAX_HC = 8;

__device__ void hc_mixes(const float* __restrict__ x, const float* __restrict__ proj,
                         const float* __restrict__ base, const float* __restrict__ scale,
                         float* __restrict__ out, HcMixesParams p) {
    extern __shared__ float partials[];  // [(2 + hc) * hc, blocks]
    __shared__ float scratch[refmath::TORCH_SUM_ILP * refmath::TORCH_SUM_LANES + refmath::TORCH_SUM_LANES + 1];
    __shared__ float mixes[(2 + MAX_HC) * MAX_HC];
    const u32_t hc = p.hc;
    const u32_t projections = (2 + hc) * hc;
    const u32_t blocks = (p.n + refmath::SGEMM_K_BLOCK - 1) / refmath::SGEMM_K_BLOCK;
    x += (size_t)blockIdx.x * p.n;
    out += (size_t)blockIdx.x * (2 * hc + hc * hc);

    const float sum_squares = refmath::torch_sum_block<float, true>(x, p.n, scratch);

    for (u32_t task = threadIdx.x; task < projections * blocks; task += THREADS) {
        const u32_t row = task / blocks;
        const u32_t block = task % blocks;
        const u32_t start = block * refmath::SGEMM_K_BLOCK;
        partials[task] = refmath::fma_chain(x + start, proj + (size_t)row * p.n + start,
                                            min(refmath::SGEMM_K_BLOCK, p.n - start));
    }
    __syncthreads();
    const float mean_square = __fdiv_rn(sum_squares, (float)p.n);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_square, p.norm_eps)));
    if (threadIdx.x < projections) {
        refmath::PairwiseSum total;
        for (u32_t b = 0; b < blocks; ++b) total.push(partials[threadIdx.x * blocks + b]);
        mixes[threadIdx.x] = __fmul_rn(total.finish(), inv);
    }
    __syncthreads();
    if (threadIdx.x != 0) return;

    float* pre = out;
    float* post = out + hc;
    float* comb = out + 2 * hc;
    for (u32_t k = 0; k < hc; ++k) {
        pre[k] = __fadd_rn(refmath::sigmoid(__fadd_rn(__fmul_rn(mixes[k], scale[0]), base[k])), p.hc_eps);
        post[k] = __fmul_rn(2.0f, refmath::sigmoid(__fadd_rn(__fmul_rn(mixes[hc + k], scale[1]), base[hc + k])));
    }
    float c[MAX_HC * MAX_HC];
    for (u32_t i = 0; i < hc * hc; ++i)
        c[i] = __fadd_rn(__fmul_rn(mixes[2 * hc + i], scale[2]), base[2 * hc + i]);
    // Row softmax (+eps), column normalisation, then (iters - 1) row/column passes.
    for (u32_t j = 0; j < hc; ++j) {
        float* row = c + j * hc;
        float max = -__uint_as_float(0x7f800000u);
        for (u32_t k = 0; k < hc; ++k) max = fmaxf(max, row[k]);
        // The reference's standalone torch.exp here is correctly rounded (CPU: quant::exp_f32_accurate).
        for (u32_t k = 0; k < hc; ++k) row[k] = (float)exp((double)__fsub_rn(row[k], max));
        float s = 0.0f;
        for (u32_t k = 0; k < hc; ++k) s = __fadd_rn(s, row[k]);
        for (u32_t k = 0; k < hc; ++k) row[k] = __fadd_rn(__fdiv_rn(row[k], s), p.hc_eps);
    }
    const u32_t column_passes = p.sinkhorn_iters > 0 ? p.sinkhorn_iters : 1;  // the first is unconditional
    for (u32_t iter = 0; iter < column_passes; ++iter) {
        if (iter > 0) {
            for (u32_t j = 0; j < hc; ++j) {
                float s = 0.0f;
                for (u32_t k = 0; k < hc; ++k) s = __fadd_rn(s, c[j * hc + k]);
                s = __fadd_rn(s, p.hc_eps);
                for (u32_t k = 0; k < hc; ++k) c[j * hc + k] = __fdiv_rn(c[j * hc + k], s);
            }
        }
        for (u32_t k = 0; k < hc; ++k) {
            float s = 0.0f;
            for (u32_t j = 0; j < hc; ++j) s = __fadd_rn(s, c[j * hc + k]);
            s = __fadd_rn(s, p.hc_eps);
            for (u32_t j = 0; j < hc; ++j) c[j * hc + k] = __fdiv_rn(c[j * hc + k], s);
        }
    }
    for (u32_t i = 0; i < hc * hc; ++i) comb[i] = c[i];
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
