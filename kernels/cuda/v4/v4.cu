// The V4 family's float32 ops that have no V4.1 counterpart, so a V4 decode step stays on the
// device: the compressor's softmax pooling over slots given by device address (position bias
// added to the gates) and the hyper-head's collapse weights (the MoE's fp32 experts run in
// moe/routed.cu). Every value is bitwise the CPU reference's: its exponential
// (refmath::exp_f32), its sums in its order, no contraction.
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
// inv_r = 1 / sqrt(Σ_i f64(x_i · x_i) / width + norm_eps) (sum in sequence, in f64, rounded
// once). One block of HYPER_HEAD_THREADS per row. Thread 0 sums the squares (one dependent f64
// chain: its order is the reference's; squares_in_order); meanwhile the other warps run the hc · sgemm_chains(width)
// FMA chains of the dot products, one chain per thread (each chain is the reference's sequence of
// FMAs from 0, whichever thread runs it), into shared memory; then thread k < hc adds its chains'
// partials by the reference's pairwise tree in K order (refmath::PairwiseSum) and computes
// weight k. The same operations as refmath::dot_sgemm_order in one thread, so the same bits.
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
extern "C" __global__ void __launch_bounds__(HYPER_HEAD_THREADS)
v4_hyper_head_f32(const float* x, const float* proj, const float* base, unsigned int rows,
                  unsigned int width, unsigned int hc, float scale, float hc_eps, float norm_eps,
                  float* pre) {
    grid_dependency_sync();
    __shared__ float inv;
    __shared__ float chain_sums[HYPER_HEAD_MAX_CHAINS];
    const unsigned int r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + static_cast<size_t>(r) * width;
    const unsigned int chains = refmath::sgemm_chains(width);
    if (threadIdx.x == 0) {
        const double acc = squares_in_order(row, width);
        const float mean = __fdiv_rn(__double2float_rn(acc), static_cast<float>(width));
        inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, norm_eps)));
    } else if (threadIdx.x >= 32) {
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
