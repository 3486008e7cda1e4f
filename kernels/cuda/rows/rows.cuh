// The model's small host-side row math between backend ops, on the device, bit for bit as
// deepinfer-model computes it on the CPU (so that no activation has to visit the host):
// - `bf16(mean over hc streams)` with the CPU's fold order (Backend::stream_means_at);
// - `bf16(x · scale)` elementwise (Backend::scale_at, the indexer's head weights);
// - gated pooling of compressor groups (Backend::gated_pool_rows), with `exp` as Rust's std
//   computes it on x86-64 Linux (glibc's `expf`, see `exp_std` below);
// - the Engram gate and injection (`engram/gate.rs` EngramGate::inject) of the live tokens.
// Every result depends only on its own row / token (batch invariant). Explicit round-to-nearest
// intrinsics throughout, so nothing is contracted into an FMA the CPU does not do.
#pragma once
#include "common/reference_math.cuh"

namespace rows {

typedef unsigned long long u64_t;

constexpr u32_t THREADS = 256;
// Threads of one Engram-injection block (one block per live token).
constexpr u32_t INJECT_THREADS = 256;
// Streams one Engram injection handles (mirrored by ops::rows::MAX_HC).
constexpr u32_t MAX_HC = 16;

// out[t, d] = round(Σ_k streams[t, k, d] / hc), the sum folded from 0 in k order.
struct StreamMeansParams {
    u32_t tokens;
    u32_t hc;
    u32_t dim;
    u32_t round_bf16;
};

// x[i] = round(x[i] · scale) over n values.
struct ScaleParams {
    u64_t n;
    float scale;
    u32_t round_bf16;
};

// out[g, c] = bf16(Σ_j kv_j[c] · (e_j / Σ e)), e_j = exp(gate_j[c] - max_j gate_j[c]) over the
// `ratio` member rows of group g (each `kv ‖ gate`, 2 · head_dim values, at members[g * ratio + j]).
struct PoolParams {
    u32_t groups;
    u32_t ratio;
    u32_t head_dim;
};

// Streams x [tokens, hc, dim]; kv [live, kv_stride] (hc keys then the value, each dim wide);
// weight [hc, dim] = q_weight ⊙ k_weight; live [live] token indices (ids >= tokens are skipped).
struct InjectParams {
    u32_t tokens;
    u32_t live;
    u32_t hc;
    u32_t dim;
    u32_t kv_stride;
    float eps;
    float inv_sqrt_dim;  // fp32((f64)dim^-0.5), computed on the host as the CPU does
};

// ---- exp as Rust's std f32::exp computes it on x86-64 Linux: glibc's expf ---------------------
// x · 32/ln2 = k + r (k rounded to nearest through the 1.5 · 2^52 shift), 2^(k/32) from a 32-entry
// table of 2^(i/32) (its exponent bits offset by i << 47 so that adding k << 47 scales it), and a
// cubic in r, all in double with the FMAs of glibc's FMA build (x86-64 CPUs with FMA select it),
// rounded once to float. Not always the correctly rounded float: the rounding of k·ln2/32 and of
// the FMAs decides some last bits, so the operation order matters. Checked against the host's
// f32::exp over all 2^32 inputs on the build machine (glibc 2.36, AMD EPYC) and on the GPU test
// machine over every float of [-104, 0] and a sample of the rest. (The same steps without the
// FMAs, glibc's generic build on CPUs without FMA, differ on 2 of the 2^32 inputs.)
__constant__ u64_t EXP2_TABLE[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

__device__ __forceinline__ float exp_std(float x) {
    const u32_t bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) >= 0x42b00000u) {  // |x| >= 88, inf or NaN
        if (bits == 0xff800000u) return 0.0f;
        if ((bits & 0x7fffffffu) >= 0x7f800000u) return __fadd_rn(x, x);
        if (x > __uint_as_float(0x42b17217u)) return __uint_as_float(0x7f800000u);  // > ln 2^128
        if (x < -__uint_as_float(0x42cff1b4u)) return 0.0f;                        // < ln 2^-150
    }
    const double INV_LN2_N = 0x1.71547652b82fep+5;  // 32 / ln 2
    const double SHIFT = 0x1.8p+52;
    const double C0 = 0x1.c6af84b912394p-5 / 32.0 / 32.0 / 32.0;
    const double C1 = 0x1.ebfce50fac4f3p-3 / 32.0 / 32.0;
    const double C2 = 0x1.62e42ff0c52d6p-1 / 32.0;
    // glibc's FMA build contracts z = x · 32/ln2 into both of its uses.
    const double xd = (double)x;
    const double shifted = __fma_rn(INV_LN2_N, xd, SHIFT);
    const u64_t ki = (u64_t)__double_as_longlong(shifted);
    const double kd = __dsub_rn(shifted, SHIFT);
    const double r = __fma_rn(INV_LN2_N, xd, -kd);
    const double s = __longlong_as_double((long long)(EXP2_TABLE[ki % 32u] + (ki << 47)));
    const double r2 = __dmul_rn(r, r);
    const double cubic = __fma_rn(C0, r, C1);
    const double linear = __fma_rn(C2, r, 1.0);
    return __double2float_rn(__dmul_rn(__fma_rn(cubic, r2, linear), s));
}

__device__ __forceinline__ float rounded(float v, u32_t round_bf16) { return round_bf16 ? round_bf16_f32(v) : v; }

__device__ __forceinline__ u64_t global_thread() { return (u64_t)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64_t thread_count() { return (u64_t)gridDim.x * blockDim.x; }

__device__ void stream_means(const float* __restrict__ streams, float* __restrict__ out, StreamMeansParams p) {
    const u64_t total = (u64_t)p.tokens * p.dim;
    const float divisor = (float)p.hc;
    for (u64_t i = global_thread(); i < total; i += thread_count()) {
        const u64_t token = i / p.dim;
        const u64_t d = i - token * p.dim;
        const float* x = streams + token * p.hc * p.dim + d;
        float sum = 0.0f;
        for (u32_t k = 0; k < p.hc; ++k) sum = __fadd_rn(sum, x[(u64_t)k * p.dim]);
        out[i] = rounded(__fdiv_rn(sum, divisor), p.round_bf16);
    }
}

__device__ void scale_round(float* __restrict__ x, ScaleParams p) {
    for (u64_t i = global_thread(); i < p.n; i += thread_count())
        x[i] = rounded(__fmul_rn(x[i], p.scale), p.round_bf16);
}

__device__ void exp_std_in_place(float* __restrict__ x, u64_t n) {
    for (u64_t i = global_thread(); i < n; i += thread_count()) x[i] = exp_std(x[i]);
}

// One thread per (group, channel): the max, the exps (recomputed in the second pass, the same
// values), their sum and the weighted values, each folded from its start in member order.
__device__ void gated_pool(const u64_t* __restrict__ members, float* __restrict__ out, PoolParams p) {
    const u64_t total = (u64_t)p.groups * p.head_dim;
    for (u64_t i = global_thread(); i < total; i += thread_count()) {
        const u64_t group = i / p.head_dim;
        const u32_t c = (u32_t)(i - group * p.head_dim);
        const u64_t* rows_of = members + group * p.ratio;
        float max = __uint_as_float(0xff800000u);
        for (u32_t j = 0; j < p.ratio; ++j) {
            const float* row = reinterpret_cast<const float*>(rows_of[j]);
            max = fmaxf(max, row[p.head_dim + c]);
        }
        float sum = 0.0f;
        for (u32_t j = 0; j < p.ratio; ++j) {
            const float* row = reinterpret_cast<const float*>(rows_of[j]);
            sum = __fadd_rn(sum, exp_std(__fsub_rn(row[p.head_dim + c], max)));
        }
        float value = 0.0f;
        for (u32_t j = 0; j < p.ratio; ++j) {
            const float* row = reinterpret_cast<const float*>(rows_of[j]);
            const float e = exp_std(__fsub_rn(row[p.head_dim + c], max));
            value = __fadd_rn(value, __fmul_rn(row[c], __fdiv_rn(e, sum)));
        }
        out[i] = round_bf16_f32(value);
    }
}

// mean(x²) of dim values in torch's CPU sum order, as EngramGate's mean_square.
// Every thread of the block must call it; it returns once all have read the sum, so the next
// call may reuse `scratch`.
__device__ __forceinline__ float mean_square(const float* x, u32_t dim, float* scratch) {
    const float sum = refmath::torch_sum_block<float, true>(x, dim, scratch);
    __syncthreads();
    return __fdiv_rn(sum, (float)dim);
}

// One block per live token. Dynamic shared memory: dim floats (the products h·w·key).
__device__ void engram_inject(float* __restrict__ streams, const float* __restrict__ kv,
                              const float* __restrict__ weight, const u32_t* __restrict__ live, InjectParams p) {
    extern __shared__ float products[];
    __shared__ float scratch[refmath::TORCH_SUM_BLOCK_SCRATCH];
    __shared__ float gates[MAX_HC];
    const u32_t token = live[blockIdx.x];
    if (token >= p.tokens) return;  // uniform over the block
    float* x = streams + (u64_t)token * p.hc * p.dim;
    const float* row = kv + (u64_t)blockIdx.x * p.kv_stride;
    for (u32_t k = 0; k < p.hc; ++k) {
        const float* h = x + (u64_t)k * p.dim;
        const float* key = row + (u64_t)k * p.dim;
        const float* w = weight + (u64_t)k * p.dim;
        const float ms_h = mean_square(h, p.dim, scratch);
        const float ms_key = mean_square(key, p.dim, scratch);
        const float rstd = __fmul_rn(__fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms_h, p.eps))),
                                     __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms_key, p.eps))));
        for (u32_t i = threadIdx.x; i < p.dim; i += blockDim.x)
            products[i] = __fmul_rn(__fmul_rn(h[i], w[i]), key[i]);
        __syncthreads();
        const float sum = refmath::torch_sum_block<float, false>(products, p.dim, scratch);
        if (threadIdx.x == 0) {
            const float dot = __fmul_rn(__fmul_rn(sum, rstd), p.inv_sqrt_dim);
            const float signed_root = copysignf(__fsqrt_rn(fmaxf(fabsf(dot), 1e-6f)), dot);
            gates[k] = refmath::sigmoid(signed_root);
        }
        __syncthreads();  // products and scratch are reused by the next stream
    }
    const float* value = row + (u64_t)p.hc * p.dim;
    for (u32_t i = threadIdx.x; i < p.hc * p.dim; i += blockDim.x) {
        const u32_t k = i / p.dim;
        x[i] = round_bf16_f32(__fadd_rn(x[i], __fmul_rn(gates[k], value[i - k * p.dim])));
    }
}

}  // namespace rows
