// The V4 family's float32 ops that have no V4.1 counterpart, so a V4 decode step stays on the
// device: the compressor's softmax pooling over slots given by device address (position bias
// added to the gates) and the hyper-head's collapse weights (the MoE's fp32 experts run in
// moe/routed.cu). Every value is bitwise the CPU reference's: its exponential
// (refmath::exp_f32), its sums in its order, no contraction; but for the fast numerics' hyper
// head, whose sum of squares is a fixed tree (v4_hyper_head_tree_f32).
#include "common/grid_dependency.cuh"
#include "common/params.h"
#include "common/reference_math.cuh"

// out[e * width + c] = Σ_s softmax_s(gate_s[c] + bias_s[c]) · kv_s[c] over the slots
// s in [slot_start[e], slot_start[e + 1]) of entry e; `kv`, `gate` and `bias` hold one device
// address per slot (width floats each). One thread per (entry, channel).
extern "C" __global__ void __launch_bounds__(256)
v4_pool_f32(const unsigned long long* kv, const unsigned long long* gate, const unsigned long long* bias,
            const unsigned int* slot_start, unsigned int entries, unsigned int width, float* out) {
    grid_dependency_sync();
    const unsigned long long total = static_cast<unsigned long long>(entries) * width;
    for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
         i < total; i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
        const unsigned int e = static_cast<unsigned int>(i / width);
        const unsigned int c = static_cast<unsigned int>(i % width);
        const unsigned int first = slot_start[e];
        const unsigned int last = slot_start[e + 1];
        float max = __int_as_float(0xff800000);
        for (unsigned int s = first; s < last; ++s) {
            const float* g = reinterpret_cast<const float*>(gate[s]);
            max = fmaxf(max, __fadd_rn(g[c], reinterpret_cast<const float*>(bias[s])[c]));
        }
        float sum = 0.0f;
        float value = 0.0f;
        for (unsigned int s = first; s < last; ++s) {
            const float* g = reinterpret_cast<const float*>(gate[s]);
            const float* v = reinterpret_cast<const float*>(kv[s]);
            const float logit = __fadd_rn(g[c], reinterpret_cast<const float*>(bias[s])[c]);
            const float w = refmath::exp_f32(__fsub_rn(logit, max));
            sum = __fadd_rn(sum, w);
            value = __fadd_rn(value, __fmul_rn(w, v[c]));
        }
        out[i] = last > first ? __fdiv_rn(value, sum) : 0.0f;
    }
}

// The hyper-head's collapse weights of every row of x [rows, width]:
// pre[r * hc + k] = sigmoid(dot_sgemm(x_r, proj_k) · inv_r · scale + base_k) + hc_eps with
// inv_r = 1 / sqrt(S_r / width + norm_eps), S_r = Σ_i f64(x_i · x_i) rounded once to f32. One
// block of HYPER_HEAD_THREADS per row. The exact kernel sums S_r in sequence (the reference's
// order: squares_in_order, one thread) while the other warps run the hc · sgemm_chains(width)
// FMA chains of the dot products, one chain per thread (each chain is the reference's sequence of
// FMAs from 0, whichever thread runs it), into shared memory; then thread k < hc adds its chains'
// partials by the reference's pairwise tree in K order (refmath::PairwiseSum) and computes
// weight k: the same operations as refmath::dot_sgemm_order in one thread, so the same bits.
// The fast kernel (ARCHITECTURE.md §3) sums S_r by a fixed tree instead (squares_tree: every
// thread's strided f64 partial, then halving): the same value but for the f64 sum's rounding,
// so S_r, rounded to f32, is the reference's or one ulp away; the dot products are the same.
// Both orders are fixed per row: a row's weights are the same bits alone and in any batch.

// Σ_i f64(x_i · x_i) over row[0 .. width), added in sequence from 0 (one dependent f64 chain).
// The next SQUARES_AHEAD values are loaded into registers before the chain adds the current ones,
// so the chain's adds, not the loads' latency, set its pace; the operations and their order are
// those of the plain loop.
constexpr unsigned int SQUARES_AHEAD = 64;
__device__ __forceinline__ double squares_in_order(const float* __restrict__ row, unsigned int width) {
    float next[SQUARES_AHEAD];
#pragma unroll
    for (unsigned int j = 0; j < SQUARES_AHEAD; ++j) next[j] = j < width ? row[j] : 0.0f;
    double acc = 0.0;
    for (unsigned int base = 0; base < width; base += SQUARES_AHEAD) {
        float current[SQUARES_AHEAD];
#pragma unroll
        for (unsigned int j = 0; j < SQUARES_AHEAD; ++j) current[j] = next[j];
        const unsigned int ahead = base + SQUARES_AHEAD;
#pragma unroll
        for (unsigned int j = 0; j < SQUARES_AHEAD; ++j) next[j] = ahead + j < width ? row[ahead + j] : 0.0f;
        const unsigned int count = min(SQUARES_AHEAD, width - base);
#pragma unroll
        for (unsigned int j = 0; j < SQUARES_AHEAD; ++j) {
            if (j < count) acc = __dadd_rn(acc, static_cast<double>(__fmul_rn(current[j], current[j])));
        }
    }
    return acc;
}

constexpr unsigned int HYPER_HEAD_THREADS = 256;
constexpr unsigned int HYPER_HEAD_MAX_CHAINS = 1024;  // hc · sgemm_chains(width), checked by the launcher

// Σ_i f64(x_i · x_i) over row[0 .. width) by a fixed tree, called by every thread of the block:
// thread t adds the squares of row[t], row[t + T], ... in sequence from 0 (T = HYPER_HEAD_THREADS),
// then the T partials are added pairwise by halving (partial t + T/2 into t, ...). Returned to
// every thread.
__device__ __forceinline__ double squares_tree(const float* __restrict__ row, unsigned int width,
                                               double* partials) {
    double acc = 0.0;
    for (unsigned int i = threadIdx.x; i < width; i += HYPER_HEAD_THREADS) {
        acc = __dadd_rn(acc, static_cast<double>(__fmul_rn(row[i], row[i])));
    }
    partials[threadIdx.x] = acc;
    __syncthreads();
#pragma unroll
    for (unsigned int half = HYPER_HEAD_THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partials[threadIdx.x] = __dadd_rn(partials[threadIdx.x], partials[threadIdx.x + half]);
        __syncthreads();
    }
    return partials[0];
}

// 1 / sqrt(S / width + norm_eps) of the sum of squares S (rounded once to f32).
__device__ __forceinline__ float inverse_rms(double squares, unsigned int width, float norm_eps) {
    const float mean = __fdiv_rn(__double2float_rn(squares), static_cast<float>(width));
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, norm_eps)));
}

// The kernels' body (after their grid_dependency_sync), TREE picking the squares' order.
template <bool TREE>
__device__ __forceinline__ void hyper_head(const float* x, const float* proj, const float* base,
                                           unsigned int rows, unsigned int width, unsigned int hc,
                                           float scale, float hc_eps, float norm_eps, float* pre) {
    __shared__ float inv;
    __shared__ float chain_sums[HYPER_HEAD_MAX_CHAINS];
    __shared__ double partials[TREE ? HYPER_HEAD_THREADS : 1];
    const unsigned int r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + static_cast<size_t>(r) * width;
    const unsigned int chains = refmath::sgemm_chains(width);
    if (TREE) {
        const double squares = squares_tree(row, width, partials);
        if (threadIdx.x == 0) inv = inverse_rms(squares, width, norm_eps);
    } else if (threadIdx.x == 0) {
        inv = inverse_rms(squares_in_order(row, width), width, norm_eps);
    }
    if (threadIdx.x >= 32) {
        for (unsigned int c = threadIdx.x - 32; c < hc * chains; c += blockDim.x - 32) {
            const unsigned int k = c / chains;
            const unsigned int i = c % chains;
            const unsigned int start = refmath::sgemm_chain_start(i, width, chains);
            const unsigned int end = refmath::sgemm_chain_start(i + 1, width, chains);
            chain_sums[c] = refmath::fma_chain(row + start, proj + static_cast<size_t>(k) * width + start, end - start);
        }
    }
    __syncthreads();
    for (unsigned int k = threadIdx.x; k < hc; k += blockDim.x) {
        refmath::PairwiseSum sum;
        for (unsigned int i = 0; i < chains; ++i) sum.push(chain_sums[k * chains + i]);
        const float logit = __fadd_rn(__fmul_rn(__fmul_rn(sum.finish(), inv), scale), base[k]);
        pre[static_cast<size_t>(r) * hc + k] = __fadd_rn(refmath::sigmoid(logit), hc_eps);
    }
}

// The hyper heads, TREE picking the squares' order: the exact numerics' (the reference's order,
// bitwise the CPU) and the fast numerics' (the fixed tree).
#define V4_HYPER_HEAD(NAME, TREE)                                                                     \
    extern "C" __global__ void __launch_bounds__(HYPER_HEAD_THREADS)                                \
        NAME(const float* x, const float* proj, const float* base, unsigned int rows,                \
             unsigned int width, unsigned int hc, float scale, float hc_eps, float norm_eps,         \
             float* pre) {                                                                           \
        grid_dependency_sync();                                                                      \
        hyper_head<TREE>(x, proj, base, rows, width, hc, scale, hc_eps, norm_eps, pre);              \
    }

V4_HYPER_HEAD(v4_hyper_head_f32, false)
V4_HYPER_HEAD(v4_hyper_head_tree_f32, true)
