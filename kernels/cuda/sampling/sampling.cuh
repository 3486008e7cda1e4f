// Token sampling of a batch of logit rows, operation for operation as deepinfer-model's
// sampling.rs (the one definition): greedy = argmax (NaN never wins, ties to the lowest id);
// otherwise Gumbel-max over the kept candidates of f64(logit) / T + g(seed, position, token), with
// g = -ln(-ln u) from a counter-based hash and this file's ln_f64 / exp_f64 (basic IEEE
// operations only, the very same as sampling.rs). Top-k / top-p keep a prefix of the row sorted by
// logit (descending, total order, ties to the lower id): a bitonic sort of 64-bit keys in the
// row's global scratch, its steps within 4096-key tiles run in shared memory; top-p's weights
// exp(logit/T - max) are summed and scanned sequentially in that order by one thread, as the CPU
// does. One block per row: rows never interact (batch invariant). Every reduction's combine is
// commutative (max, lowest id on ties), so the block's reduction order cannot change the result.
#pragma once
#include "common/numerics.cuh"

namespace sampling {

constexpr u32_t THREADS = 512;

typedef unsigned long long u64_t;

// One row's parameters (mirrored by kernels/src/ops/sampling.rs `SampleRow`).
struct SampleRow {
    u64_t seed;
    u64_t position;
    float temperature;  // 0: greedy
    float top_p;        // < 1 restricts
    u32_t top_k;        // 0 or >= vocab: no restriction
    u32_t reserved;
};

// Launch parameters (mirrored by `SampleParams`).
struct SampleParams {
    u32_t rows;
    u32_t vocab;
    u32_t padded;  // the scratch row length: the power of two >= vocab
};

__device__ __forceinline__ u64_t mix64(u64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// sampling::uniform: a number in (0, 1) from (seed, position, token).
__device__ __forceinline__ double uniform(u64_t seed, u64_t position, u32_t token) {
    const u64_t key = mix64(seed ^ 0x6A09E667F3BCC909ull);
    const u64_t x = mix64(key ^ mix64((position * 0x1000000001B3ull) ^ (u64_t)token));
    return __ddiv_rn(__dadd_rn((double)(x >> 11), 0.5), 0x1p53);
}

__device__ __forceinline__ double power_of_two(long long e) {
    return __longlong_as_double((long long)((unsigned long long)(e + 1023) << 52));
}

constexpr double LN2_HEAD = 0x1.62e42feep-1;
constexpr double LN2_TAIL = 0x1.a39ef35793c76p-33;

// sampling::ln_f64.
__device__ double ln_f64(double x) {
    if (isnan(x) || x < 0.0) return __longlong_as_double(0x7ff8000000000000ll);
    if (x == 0.0) return __longlong_as_double((long long)0xfff0000000000000ull);
    if (isinf(x)) return x;
    long long bias = 0;
    if (x < 0x1p-1022) {
        x = __dmul_rn(x, power_of_two(54));
        bias = -54;
    }
    const u64_t bits = (u64_t)__double_as_longlong(x);
    long long e = (long long)((bits >> 52) & 0x7ffull) - 1023;
    double m = __longlong_as_double((long long)((bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull));
    if (m >= 0x1.6a09e667f3bcdp+0) {
        m = __dmul_rn(m, 0.5);
        e += 1;
    }
    const double ed = (double)(e + bias);
    const double s = __ddiv_rn(__dsub_rn(m, 1.0), __dadd_rn(m, 1.0));
    const double s2 = __dmul_rn(s, s);
    // 1/(2i + 3) for i = 11 down to 0.
    const double series_terms[11] = {
        0x1.642c8590b2164p-5, 0x1.8618618618618p-5, 0x1.af286bca1af28p-5, 0x1.e1e1e1e1e1e1ep-5,
        0x1.1111111111111p-4, 0x1.3b13b13b13b14p-4, 0x1.745d1745d1746p-4, 0x1.c71c71c71c71cp-4,
        0x1.2492492492492p-3, 0x1.999999999999ap-3, 0x1.5555555555555p-2};
    double series = 0x1.47ae147ae147bp-5;
#pragma unroll
    for (int i = 0; i < 11; ++i) series = __fma_rn(series, s2, series_terms[i]);
    const double two_s = __dmul_rn(2.0, s);
    const double ln_m = __fma_rn(two_s, __dmul_rn(s2, series), two_s);
    return __fma_rn(ed, LN2_HEAD, __fma_rn(ed, LN2_TAIL, ln_m));
}

// sampling::exp_f64.
__device__ double exp_f64(double x) {
    if (isnan(x)) return x;
    if (x < -746.0) return 0.0;
    if (x > 0x1.62e3d70a3d70ap+9) return __longlong_as_double(0x7ff0000000000000ll);
    const double k = rint(__dmul_rn(x, 0x1.71547652b82fep+0));
    const double r = __fma_rn(k, -LN2_TAIL, __fma_rn(k, -LN2_HEAD, x));
    // 1/i! for i = 12 down to 2.
    const double terms[11] = {
        0x1.1eed8eff8d898p-29, 0x1.ae64567f544e4p-26, 0x1.27e4fb7789f5cp-22, 0x1.71de3a556c734p-19,
        0x1.a01a01a01a01ap-16, 0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10, 0x1.1111111111111p-7,
        0x1.5555555555555p-5, 0x1.5555555555555p-3, 0x1.0000000000000p-1};
    double poly = 0x1.6124613a86d09p-33;
#pragma unroll
    for (int i = 0; i < 11; ++i) poly = __fma_rn(poly, r, terms[i]);
    const double mantissa = __dadd_rn(__fma_rn(__dmul_rn(r, r), poly, r), 1.0);
    const long long ki = (long long)k;
    const long long half = ki >> 1;
    return __dmul_rn(__dmul_rn(mantissa, power_of_two(half)), power_of_two(ki - half));
}

__device__ __forceinline__ double gumbel(u64_t seed, u64_t position, u32_t token) {
    return -ln_f64(-ln_f64(uniform(seed, position, token)));
}

// Whether candidate (va, ta) beats (vb, tb): NaN loses to any number (two NaNs: lower id), else
// the larger value, ties to the lower id. Commutative and associative.
__device__ __forceinline__ bool beats(double va, u32_t ta, double vb, u32_t tb) {
    const bool na = isnan(va), nb = isnan(vb);
    if (na || nb) return (na && nb) ? ta < tb : nb;
    if (va != vb) return va > vb;
    return ta < tb;
}

// Block-wide best candidate; every thread passes its own and gets the winner's id.
__device__ u32_t block_best(double value, u32_t token, double* values, u32_t* tokens) {
    values[threadIdx.x] = value;
    tokens[threadIdx.x] = token;
    __syncthreads();
    for (u32_t stride = THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const u32_t other = threadIdx.x + stride;
            if (beats(values[other], tokens[other], values[threadIdx.x], tokens[threadIdx.x])) {
                values[threadIdx.x] = values[other];
                tokens[threadIdx.x] = tokens[other];
            }
        }
        __syncthreads();
    }
    const u32_t winner = tokens[0];
    __syncthreads();
    return winner;
}

// Ascending key of the order "logit descending (f32 total order), token ascending".
__device__ __forceinline__ u64_t descending_key(float logit, u32_t token) {
    const u32_t bits = __float_as_uint(logit);
    const u32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((u64_t)(~ascending) << 32) | (u64_t)token;
}

// Keys sorted at a time in shared memory by the bitonic network's local steps.
constexpr u32_t SORT_TILE = 4096;

// The steps (k, j) with k in [k_first, k_last] and j < tile of the ascending bitonic network over
// keys[0..n), run tile by tile in shared memory (a step with j < tile pairs keys of one tile).
__device__ void bitonic_tile_steps(u64_t* keys, u32_t n, u32_t tile, u32_t k_first, u32_t k_last, u64_t* cache) {
    for (u32_t base = 0; base < n; base += tile) {
        for (u32_t i = threadIdx.x; i < tile; i += THREADS) cache[i] = keys[base + i];
        __syncthreads();
        for (u32_t k = k_first; k <= k_last; k <<= 1) {
            for (u32_t j = min(k >> 1, tile >> 1); j > 0; j >>= 1) {
                for (u32_t i = threadIdx.x; i < tile; i += THREADS) {
                    const u32_t partner = i ^ j;
                    if (partner > i) {
                        const u64_t a = cache[i], b = cache[partner];
                        const bool ascending = ((base + i) & k) == 0u;
                        if ((a > b) == ascending) {
                            cache[i] = b;
                            cache[partner] = a;
                        }
                    }
                }
                __syncthreads();
            }
        }
        for (u32_t i = threadIdx.x; i < tile; i += THREADS) keys[base + i] = cache[i];
        __syncthreads();
    }
}

// Ascending bitonic sort of keys[0..n), n a power of two, by the whole block: the steps whose
// pairs lie within a tile run in shared memory (`cache`, SORT_TILE keys), the others in place.
__device__ void bitonic_sort(u64_t* keys, u32_t n, u64_t* cache) {
    const u32_t tile = min(n, SORT_TILE);
    bitonic_tile_steps(keys, n, tile, 2, tile, cache);
    for (u32_t k = tile << 1; k <= n; k <<= 1) {
        for (u32_t j = k >> 1; j >= tile; j >>= 1) {
            for (u32_t i = threadIdx.x; i < n; i += THREADS) {
                const u32_t partner = i ^ j;
                if (partner > i) {
                    const u64_t a = keys[i], b = keys[partner];
                    const bool ascending = (i & k) == 0u;
                    if ((a > b) == ascending) {
                        keys[i] = b;
                        keys[partner] = a;
                    }
                }
            }
            __syncthreads();
        }
        bitonic_tile_steps(keys, n, tile, k, k, cache);
    }
}

__device__ void sample_rows(const float* __restrict__ logits, const SampleRow* __restrict__ rows,
                            u64_t* __restrict__ sort_scratch, double* __restrict__ weight_scratch,
                            u32_t* __restrict__ tokens, SampleParams p) {
    __shared__ double values[THREADS];
    __shared__ u32_t ids[THREADS];
    __shared__ u32_t kept;
    __shared__ u64_t sort_cache[SORT_TILE];
    const u32_t row = blockIdx.x;
    if (row >= p.rows) return;
    const SampleRow r = rows[row];
    const float* l = logits + (size_t)row * p.vocab;
    const double nan = __longlong_as_double(0x7ff8000000000000ll);

    if (r.temperature == 0.0f) {
        double best = nan;
        u32_t best_token = 0xffffffffu;
        for (u32_t t = threadIdx.x; t < p.vocab; t += THREADS) {
            const double v = (double)l[t];
            if (beats(v, t, best, best_token)) {
                best = v;
                best_token = t;
            }
        }
        const u32_t winner = block_best(best, best_token, values, ids);
        if (threadIdx.x == 0) tokens[row] = winner;
        return;
    }

    const double inv_t = __ddiv_rn(1.0, (double)r.temperature);
    const bool restrict_k = r.top_k > 0u && r.top_k < p.vocab;
    const bool restrict_p = r.top_p < 1.0f;
    // The candidates: the first `count` entries of the sorted scratch row, or every token.
    u64_t* sorted = sort_scratch + (size_t)row * p.padded;
    u32_t count = p.vocab;
    if (restrict_k || restrict_p) {
        for (u32_t i = threadIdx.x; i < p.padded; i += THREADS)
            sorted[i] = i < p.vocab ? descending_key(l[i], i) : ~0ull;
        __syncthreads();
        bitonic_sort(sorted, p.padded, sort_cache);
        if (restrict_k) count = r.top_k;
        if (restrict_p) {
            double* weights = weight_scratch + (size_t)row * p.padded;
            const double max = __dmul_rn((double)l[(u32_t)sorted[0]], inv_t);
            for (u32_t i = threadIdx.x; i < count; i += THREADS)
                weights[i] = exp_f64(__dsub_rn(__dmul_rn((double)l[(u32_t)sorted[i]], inv_t), max));
            __syncthreads();
            if (threadIdx.x == 0) {
                double total = 0.0;
                for (u32_t i = 0; i < count; ++i) total = __dadd_rn(total, weights[i]);
                double cumulative = 0.0;
                u32_t keep = count;
                for (u32_t i = 0; i < count; ++i) {
                    cumulative = __dadd_rn(cumulative, __ddiv_rn(weights[i], total));
                    if (cumulative >= (double)r.top_p) {
                        keep = i + 1;
                        break;
                    }
                }
                kept = keep;
            }
            __syncthreads();
            count = kept;
        }
    }
    const bool listed = restrict_k || restrict_p;
    // The CPU keeps its first candidate when that one's score is NaN (nothing compares above it).
    const u32_t first = listed ? (u32_t)sorted[0] : 0u;
    const double first_score = __dadd_rn(__dmul_rn((double)l[first], inv_t), gumbel(r.seed, r.position, first));
    if (isnan(first_score)) {
        if (threadIdx.x == 0) tokens[row] = first;
        return;
    }
    double best = nan;
    u32_t best_token = 0xffffffffu;
    for (u32_t i = threadIdx.x; i < count; i += THREADS) {
        const u32_t t = listed ? (u32_t)sorted[i] : i;
        const double score = __dadd_rn(__dmul_rn((double)l[t], inv_t), gumbel(r.seed, r.position, t));
        if (beats(score, t, best, best_token)) {
            best = score;
            best_token = t;
        }
    }
    const u32_t winner = block_best(best, best_token, values, ids);
    if (threadIdx.x == 0) tokens[row] = winner;
}

}  // namespace sampling
