// Engram on the device, as deepinfer-model's engram module computes it on the host:
// - hashing (NgramHasher::rows_of_contexts): per token, layer and column (n-gram size n = column /
//   heads + 2), rolling = XOR over lags 0..n-1 of context[lag] * multiplier[layer][lag] (wrapping
//   u64), row = rolling % prime[layer][column] + offset[layer][column]; one thread per row id.
// - lookup (EngramTable::gather): row `id` of an E4M3 table [rows, head_dim] with one UE8M0 scale
//   per 32 channels, bf16(decode(code) * 2^(scale - 127)) (scale byte 255: NaN); ids outside the
//   table give zeros. One thread per output value.
// Both are pure per element: nothing depends on other tokens (batch invariant).
#pragma once
#include "common/numerics.cuh"

namespace engram {

constexpr u32_t THREADS = 256;
constexpr u32_t SCALE_GROUP = 32;

typedef unsigned long long u64_t;

// Launch parameters (mirrored by kernels/src/ops/engram.rs `EngramHashParams`).
struct HashParams {
    u32_t tokens;
    u32_t layers;
    u32_t max_ngram;
    u32_t columns;  // (max_ngram - 1) * heads
    u32_t heads;
};

// Launch parameters (mirrored by `EngramGatherParams`).
struct GatherParams {
    u32_t ids;
    u32_t table_rows;
    u32_t head_dim;  // a multiple of SCALE_GROUP
};

__device__ void hash_rows(const u64_t* __restrict__ contexts, const u64_t* __restrict__ multipliers,
                          const u64_t* __restrict__ primes, const u64_t* __restrict__ offsets,
                          u32_t* __restrict__ rows, HashParams p) {
    const size_t index = (size_t)blockIdx.x * THREADS + threadIdx.x;
    const size_t per_token = (size_t)p.layers * p.columns;
    if (index >= (size_t)p.tokens * per_token) return;
    const u32_t token = (u32_t)(index / per_token);
    const u32_t layer = (u32_t)((index % per_token) / p.columns);
    const u32_t column = (u32_t)(index % p.columns);
    const u32_t last_lag = column / p.heads + 1;
    const u64_t* context = contexts + (size_t)token * p.max_ngram;
    const u64_t* multiplier = multipliers + (size_t)layer * p.max_ngram;
    u64_t rolling = context[0] * multiplier[0];
    for (u32_t lag = 1; lag <= last_lag; ++lag) rolling ^= context[lag] * multiplier[lag];
    const size_t at = (size_t)layer * p.columns + column;
    rows[index] = (u32_t)(rolling % primes[at] + offsets[at]);
}

__device__ void gather(const u8_t* __restrict__ codes, const u8_t* __restrict__ scales,
                       const u32_t* __restrict__ ids, float* __restrict__ out, GatherParams p) {
    const size_t index = (size_t)blockIdx.x * THREADS + threadIdx.x;
    if (index >= (size_t)p.ids * p.head_dim) return;
    const u32_t id = ids[index / p.head_dim];
    const u32_t channel = (u32_t)(index % p.head_dim);
    if (id >= p.table_rows) {
        out[index] = 0.0f;
        return;
    }
    const u8_t scale_byte = scales[(size_t)id * (p.head_dim / SCALE_GROUP) + channel / SCALE_GROUP];
    const float scale = scale_byte == 0xffu ? __int_as_float(0x7fc00000) : e8m0_decode(scale_byte);
    out[index] = round_bf16_f32(__fmul_rn(e4m3_decode(codes[(size_t)id * p.head_dim + channel]), scale));
}

}  // namespace engram
