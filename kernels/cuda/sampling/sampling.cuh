// Token sampling of a batch of logit rows, bit for bit as deepinfer-model's sampling.rs (the one
// definition): greedy = argmax (NaN never wins, ties to the lowest id); otherwise Gumbel-max over
// the kept candidates of f64(logit) / T + g(seed, position, token), with g = -ln(-ln u) from a
// counter-based hash and this file's ln_f64 / exp_f64 (basic IEEE operations only, the very same
// as sampling.rs). One block per row: rows never interact (batch invariant).
//
// Top-k / top-p keep a prefix of the row sorted by logit (descending, f32 total order, ties to the
// lower id). The kernel sorts the row's 32-bit order keys (an LSD radix sort, 4 stable passes of
// 8 bits, in the row's global scratch) and never sorts ids: the kept set is "every token whose key
// is below the cut-off key, plus the lowest-id tokens equal to it", so ids come from a pass over
// the row. Top-p's weights exp(logit/T - max) are summed, and their shares accumulated, in sorted
// order exactly as the CPU's sequential f64 loops round them; see `ordered_sum` for the parallel
// method and why it is exact. Every reduction's combine is commutative (max, lowest id on ties),
// so the block's reduction order cannot change a result.
#pragma once
#include "common/params.h"

namespace sampling {

constexpr u32_t THREADS = 512;
constexpr u32_t WARPS = THREADS / 32;
constexpr u32_t FULL_MASK = 0xffffffffu;
constexpr u32_t RADIX = 256;
static_assert(THREADS >= RADIX, "one thread per radix digit scans the warp counts");

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
    u32_t padded;  // the scratch row length (u64 sort scratch, f64 weights): >= vocab
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

// Horner's rule from `lead`: acc = fma(acc, x, c[i]) for i = 0 .. N - 1, in order.
template <int N>
__device__ __forceinline__ double horner(double lead, double x, const double (&c)[N]) {
    double acc = lead;
#pragma unroll
    for (int i = 0; i < N; ++i) acc = __fma_rn(acc, x, c[i]);
    return acc;
}

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
    const double series = horner(0x1.47ae147ae147bp-5, s2, series_terms);
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
    const double poly = horner(0x1.6124613a86d09p-33, r, terms);
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

// A thread's best candidate so far: `none()` (NaN, an id past every token) until one is offered.
struct BestToken {
    double value;
    u32_t token;
    __device__ __forceinline__ static BestToken none() {
        return {__longlong_as_double(0x7ff8000000000000ll), 0xffffffffu};
    }
    // Takes candidate (v, t) when it beats the best so far.
    __device__ __forceinline__ void offer(double v, u32_t t) {
        if (beats(v, t, value, token)) {
            value = v;
            token = t;
        }
    }
};

// The block's best token t < vocab by score(t); every thread gets it.
template <class Score>
__device__ __forceinline__ u32_t best_token_of(Score score, u32_t vocab, double* values, u32_t* tokens) {
    BestToken best = BestToken::none();
    for (u32_t t = threadIdx.x; t < vocab; t += THREADS) best.offer(score(t), t);
    return block_best(best.value, best.token, values, tokens);
}

// ---------------------------------------------------------------------------------------------
// Sorting the row's order keys.

// Ascending key of the order "logit descending (f32 total order)": equal keys, equal bits.
__device__ __forceinline__ u32_t descending_key(float logit) {
    const u32_t bits = __float_as_uint(logit);
    const u32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ~ascending;
}

// The logit whose `descending_key` is `key`.
__device__ __forceinline__ float key_logit(u32_t key) {
    const u32_t ascending = ~key;
    return __uint_as_float((ascending & 0x80000000u) ? (ascending & 0x7fffffffu) : ~ascending);
}

// The lanes of the warp whose `digit` (0..255, or RADIX for "no key") equals this lane's: one
// ballot per bit, in place of match.any (as CUB's radix ranking matches digits).
__device__ __forceinline__ u32_t lanes_with_digit(u32_t digit) {
    u32_t peers = FULL_MASK;
#pragma unroll
    for (u32_t bit = 0; bit < 9; ++bit) {
        const bool set = ((digit >> bit) & 1u) != 0u;
        const u32_t lanes_set = __ballot_sync(FULL_MASK, set);
        peers &= set ? lanes_set : ~lanes_set;
    }
    return peers;
}

constexpr u32_t KEYS_PER_LANE = 8;
constexpr u32_t WARP_TILE = 32 * KEYS_PER_LANE;
constexpr u32_t BLOCK_TILE = WARPS * WARP_TILE;
static_assert(BLOCK_TILE == THREADS * KEYS_PER_LANE, "a tile is KEYS_PER_LANE keys per thread");

struct SortShared {
    u32_t digit_counts[4][RADIX];     // the row's histogram of each 8-bit digit
    u32_t warp_offsets[WARPS][RADIX];  // per tile: a warp's digit counts, then its output offsets
    u32_t bucket_next[RADIX];         // the next output position of each digit
    u32_t skip;                       // the pass's digit is the same in every key
};

// keys[0..n) = the order keys of logits[0..n), and the histogram of each of their 4 digits
// (warp-aggregated atomics: one per distinct digit of a warp).
__device__ void build_keys(const float* logits, u32_t n, u32_t* keys, SortShared& s) {
    const u32_t lane = threadIdx.x & 31u;
    for (u32_t i = threadIdx.x; i < 4 * RADIX; i += THREADS) (&s.digit_counts[0][0])[i] = 0u;
    __syncthreads();
    for (u32_t base = 0; base < n; base += BLOCK_TILE) {
        u32_t tile_keys[KEYS_PER_LANE];
#pragma unroll
        for (u32_t r = 0; r < KEYS_PER_LANE; ++r) {
            const u32_t i = base + r * THREADS + threadIdx.x;
            tile_keys[r] = i < n ? descending_key(logits[i]) : 0u;
        }
#pragma unroll
        for (u32_t r = 0; r < KEYS_PER_LANE; ++r) {
            const u32_t i = base + r * THREADS + threadIdx.x;
            const bool valid = i < n;
            if (valid) keys[i] = tile_keys[r];
#pragma unroll
            for (u32_t pass = 0; pass < 4; ++pass) {
                const u32_t digit = valid ? (tile_keys[r] >> (8u * pass)) & (RADIX - 1u) : RADIX;
                const u32_t peers = lanes_with_digit(digit);
                if (valid && lane == (u32_t)(__ffs(peers) - 1)) atomicAdd(&s.digit_counts[pass][digit], (u32_t)__popc(peers));
            }
        }
    }
    __syncthreads();
}

// dst[0..n) = src[0..n) stably ordered by the digit (key >> shift) & 255, whose first output
// positions are s.bucket_next. Tile by tile (BLOCK_TILE keys): each warp ranks its 256 keys per
// digit (lanes of one digit found by `lanes_with_digit`), one thread per digit turns the warps' counts
// into output offsets in warp order, then every key is written to its place.
__device__ void radix_pass(const u32_t* src, u32_t* dst, u32_t n, u32_t shift, SortShared& s) {
    const u32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32_t lanes_below = (1u << lane) - 1u;
    for (u32_t i = threadIdx.x; i < WARPS * RADIX; i += THREADS) (&s.warp_offsets[0][0])[i] = 0u;
    __syncthreads();
    for (u32_t base = 0; base < n; base += BLOCK_TILE) {
        u32_t keys[KEYS_PER_LANE];
        u32_t ranks[KEYS_PER_LANE];
#pragma unroll
        for (u32_t r = 0; r < KEYS_PER_LANE; ++r) {
            const u32_t i = base + warp * WARP_TILE + r * 32u + lane;
            keys[r] = i < n ? src[i] : 0u;
        }
#pragma unroll
        for (u32_t r = 0; r < KEYS_PER_LANE; ++r) {
            const u32_t i = base + warp * WARP_TILE + r * 32u + lane;
            const bool valid = i < n;
            const u32_t digit = valid ? (keys[r] >> shift) & (RADIX - 1u) : RADIX;
            const u32_t peers = lanes_with_digit(digit);
            const u32_t before = valid ? s.warp_offsets[warp][digit] : 0u;
            ranks[r] = before + (u32_t)__popc(peers & lanes_below);
            __syncwarp();
            if (valid && lane == (u32_t)(__ffs(peers) - 1)) s.warp_offsets[warp][digit] = before + (u32_t)__popc(peers);
            __syncwarp();
        }
        __syncthreads();
        if (threadIdx.x < RADIX) {
            u32_t next = s.bucket_next[threadIdx.x];
            for (u32_t w = 0; w < WARPS; ++w) {
                const u32_t count = s.warp_offsets[w][threadIdx.x];
                s.warp_offsets[w][threadIdx.x] = next;
                next += count;
            }
            s.bucket_next[threadIdx.x] = next;
        }
        __syncthreads();
#pragma unroll
        for (u32_t r = 0; r < KEYS_PER_LANE; ++r) {
            const u32_t i = base + warp * WARP_TILE + r * 32u + lane;
            if (i < n) dst[s.warp_offsets[warp][(keys[r] >> shift) & (RADIX - 1u)] + ranks[r]] = keys[r];
        }
        __syncthreads();
        for (u32_t i = threadIdx.x; i < WARPS * RADIX; i += THREADS) (&s.warp_offsets[0][0])[i] = 0u;
        __syncthreads();
    }
}

// Sorts the order keys of logits[0..n) ascending (logits descending) with `a` and `b` (n keys
// each) as buffers; returns the one holding the result. A pass whose digit is the same in every
// key would not move anything and is skipped.
__device__ const u32_t* sort_keys(const float* logits, u32_t n, u32_t* a, u32_t* b, SortShared& s) {
    build_keys(logits, n, a, s);
    u32_t* src = a;
    u32_t* dst = b;
    for (u32_t pass = 0; pass < 4; ++pass) {
        if (threadIdx.x == 0) {
            u32_t position = 0;
            u32_t single = 0;
            for (u32_t d = 0; d < RADIX; ++d) {
                const u32_t count = s.digit_counts[pass][d];
                s.bucket_next[d] = position;
                position += count;
                if (count == n) single = 1u;
            }
            s.skip = single;
        }
        __syncthreads();
        if (s.skip == 0u) {
            radix_pass(src, dst, n, 8u * pass, s);
            u32_t* t = src;
            src = dst;
            dst = t;
        }
        __syncthreads();
    }
    return src;
}

// ---------------------------------------------------------------------------------------------
// The CPU's sequential f64 sum, in parallel and exact.
//
// `ordered_sum` returns S_n of S_0 = 0, S_{i+1} = fl(S_i + a_i) (a_i >= 0, round to nearest
// even), the CPU's loop, optionally stopping at the first i with S_{i+1} >= target. The order of
// the additions is kept; what runs in parallel is working out, for a chunk of consecutive a_i,
// what adding them does to any S of one binade:
//
// While S stays in the binade [2^e, 2^(e+1)), S = k·u with u = 2^(e-52) and k an integer in
// [2^52, 2^53), and fl(S + a) = u · round_half_even(k + a/u). With x = a/u (exact: a times a power
// of two >= 1), q = floor(x) and f = x - q (both exact), round_half_even(k + x) = k + q + [f > 1/2],
// or, when f = 1/2 exactly, k + q + [(k + q) odd]. So one addition maps k to k + d[k mod 2] with a
// two-entry table d that depends on a and e only, and a run of additions is the composition of
// such tables, (d then d')[p] = d[p] + d'[(p + d[p]) mod 2]: associative, so a warp composes a
// chunk's tables as a tree, in order. This is the exact rounding of every step as long as every
// intermediate k stays below 2^53 (S below 2^(e+1)); the sums only grow, so it suffices that the
// chunk's final k is below 2^53. Each chunk's binade is predicted from an approximate (unordered)
// prefix sum; one thread then walks the chunks in order with the true S: a chunk whose predicted
// binade holds S and whose final k stays below 2^53 is applied from its table, any other (the
// first, those where S crosses a power of two, mispredictions) is added element by element as the
// CPU does. A stop target inside a chunk is found the same way (the sums are monotone). The result
// is therefore S_n exactly, whatever the prediction; the prediction only decides the speed.
//
// Limits that keep every scaling exact: e in [MIN_BINADE, 52] (so u is normal and a/u is a
// scaling by at least 1); x >= 2^53 or NaN marks the chunk for the element-by-element walk.

constexpr u32_t MAX_CHUNKS = 512;
constexpr int MIN_BINADE = -900;
constexpr int MAX_BINADE = 52;
constexpr u64_t TABLE_CAP = 1ull << 54;  // a table entry at or above 2^53 only means "leaves the binade"

struct SumShared {
    u64_t delta[MAX_CHUNKS][2];  // the chunk's k increment for an even / odd incoming k
    double approx[MAX_CHUNKS];   // the chunk's unordered sum
    int binade[MAX_CHUNKS];      // the predicted binade of S over the chunk
    u32_t usable[MAX_CHUNKS];    // the chunk has a table for `binade`
    double result;
    u32_t stop;
};

// The addends of the top-p sums: the weights, or (after the total) their shares in place.
struct Addends {
    const double* values;
    __device__ __forceinline__ double operator()(u32_t i) const { return values[i]; }
};

__device__ __forceinline__ int binade_of(double x) {
    return (int)(((u64_t)__double_as_longlong(x) >> 52) & 0x7ffull) - 1023;
}

// (d0, d1) then (e0, e1), capped (values only grow, so a capped entry stays >= 2^53).
__device__ __forceinline__ void compose(u64_t& d0, u64_t& d1, u64_t e0, u64_t e1) {
    const u64_t n0 = d0 + ((d0 & 1ull) ? e1 : e0);
    const u64_t n1 = d1 + ((d1 & 1ull) ? e0 : e1);
    d0 = n0 < TABLE_CAP ? n0 : TABLE_CAP;
    d1 = n1 < TABLE_CAP ? n1 : TABLE_CAP;
}

// The table (d0, d1) of the addends a[first..end) in the binade whose u is 1 / scale; false when
// an addend is too large for it (or NaN).
__device__ __forceinline__ bool addends_table(const Addends& a, u32_t first, u32_t end, double scale, u64_t& d0, u64_t& d1) {
    d0 = 0;
    d1 = 0;
    for (u32_t i = first; i < end; ++i) {
        const double x = __dmul_rn(a(i), scale);
        if (!(x < 0x1p53)) return false;
        const double q = floor(x);
        const double f = __dsub_rn(x, q);
        const u64_t qi = (u64_t)q;
        u64_t e0 = qi, e1 = qi;
        if (f > 0.5) {
            e0 = qi + 1ull;
            e1 = qi + 1ull;
        } else if (f == 0.5) {
            e0 = qi + (qi & 1ull);
            e1 = qi + ((qi + 1ull) & 1ull);
        }
        compose(d0, d1, e0, e1);
    }
    return true;
}

// Whether S, on its binade e's grid, stays in that binade after the table (d0, d1); `after` is
// then the new S.
__device__ __forceinline__ bool apply_table(double sum, int e, u64_t d0, u64_t d1, double& after) {
    const u64_t k = (u64_t)__dmul_rn(sum, power_of_two(52 - e));
    const u64_t next = k + ((k & 1ull) ? d1 : d0);
    if (next >= (1ull << 53)) return false;
    after = __dmul_rn((double)next, power_of_two(e - 52));
    return true;
}

// S_n (or the first S_{i+1} >= target, when `stops`) of the addends a[0..n); also the number of
// addends taken (n, or i + 1 at the stop). Called by the whole block; s.result / s.stop hold the
// answer after it returns. A chunk is 32 lanes × per_lane consecutive addends.
__device__ void ordered_sum(Addends a, u32_t n, bool stops, double target, SumShared& s) {
    const u32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32_t per_lane_min = (n + MAX_CHUNKS * 32u - 1u) / (MAX_CHUNKS * 32u);
    const u32_t per_lane = per_lane_min > 0u ? per_lane_min : 1u;
    const u32_t chunk = 32u * per_lane;
    const u32_t chunks = (n + chunk - 1u) / chunk;

    // Unordered chunk sums, for the prediction only.
    for (u32_t c = warp; c < chunks; c += WARPS) {
        double part = 0.0;
        for (u32_t j = 0; j < per_lane; ++j) {
            const u32_t i = c * chunk + lane * per_lane + j;
            if (i < n) part += a(i);
        }
        for (u32_t offset = 16; offset > 0; offset >>= 1) part += __shfl_down_sync(FULL_MASK, part, offset);
        if (lane == 0) s.approx[c] = part;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double start = 0.0;
        for (u32_t c = 0; c < chunks; ++c) {
            const double end = start + s.approx[c];
            const int e = binade_of(start);
            s.binade[c] = e;
            s.usable[c] = start >= 0x1p-1022 && end == end && binade_of(end) == e && e >= MIN_BINADE && e <= MAX_BINADE;
            start = end;
        }
    }
    __syncthreads();

    // Each usable chunk's table for its predicted binade: a lane composes its per_lane addends in
    // order, the warp composes the lanes' tables as a tree (lane l + offset follows lane l).
    for (u32_t c = warp; c < chunks; c += WARPS) {
        if (s.usable[c] == 0u) continue;
        const u32_t first = c * chunk + lane * per_lane;
        const u32_t end = first + per_lane < n ? first + per_lane : n;
        u64_t d0, d1;
        const bool fits = addends_table(a, first, end, power_of_two(52 - s.binade[c]), d0, d1);
        for (u32_t offset = 1; offset < 32u; offset <<= 1) {
            const u64_t o0 = __shfl_down_sync(FULL_MASK, d0, offset);
            const u64_t o1 = __shfl_down_sync(FULL_MASK, d1, offset);
            if (lane + offset < 32u) compose(d0, d1, o0, o1);
        }
        const bool all_fit = __all_sync(FULL_MASK, fits);
        if (lane == 0) {
            s.delta[c][0] = d0;
            s.delta[c][1] = d1;
            if (!all_fit) s.usable[c] = 0u;
        }
    }
    __syncthreads();

    // The walk, in order, with the true S, by warp 0 (every lane holds the same S). A chunk
    // without a usable table is walked lane range by lane range: tables of the remaining lanes
    // for the binade S is in, composed in lane order (an inclusive scan), applied up to the first
    // lane where S would leave the binade (or reach the target); that lane's addends are added
    // one by one, and the rest of the chunk starts again from the new S.
    if (warp == 0) {
        double sum = 0.0;
        u32_t taken = n;
        bool stopped = false;
        for (u32_t c = 0; c < chunks && !stopped; ++c) {
            const u32_t lo = c * chunk;
            const u32_t hi = lo + chunk < n ? lo + chunk : n;
            if (s.usable[c] != 0u) {
                const int e = s.binade[c];
                double after;
                if (sum >= power_of_two(e) && sum < power_of_two(e + 1) &&
                    apply_table(sum, e, s.delta[c][0], s.delta[c][1], after) && !(stops && after >= target)) {
                    sum = after;
                    continue;
                }
            }
            const u32_t first = lo + lane * per_lane < hi ? lo + lane * per_lane : hi;
            const u32_t end = first + per_lane < hi ? first + per_lane : hi;
            u32_t next_lane = 0;
            while (next_lane < 32u && !stopped) {
                const int e = binade_of(sum);
                const bool on_grid = sum >= 0x1p-1022 && e >= MIN_BINADE && e <= MAX_BINADE;
                u64_t d0 = 0, d1 = 0;
                bool fits = true;
                if (on_grid && lane >= next_lane) fits = addends_table(a, first, end, power_of_two(52 - e), d0, d1);
                for (u32_t offset = 1; offset < 32u; offset <<= 1) {
                    u64_t o0 = __shfl_up_sync(FULL_MASK, d0, offset);
                    u64_t o1 = __shfl_up_sync(FULL_MASK, d1, offset);
                    if (lane >= offset) {
                        compose(o0, o1, d0, d1);
                        d0 = o0;
                        d1 = o1;
                    }
                }
                double after = sum;
                const bool stays = on_grid && apply_table(sum, e, d0, d1, after) && !(stops && after >= target);
                const u32_t misfit = __ballot_sync(FULL_MASK, lane >= next_lane && !fits);
                const u32_t leaves = __ballot_sync(FULL_MASK, lane >= next_lane && !stays) | misfit;
                const u32_t stuck = leaves != 0u ? (u32_t)(__ffs(leaves) - 1) : 32u;
                if (stuck > next_lane) sum = __shfl_sync(FULL_MASK, after, stuck - 1u);
                if (stuck == 32u) break;
                const u32_t one_first = lo + stuck * per_lane;
                const u32_t one_end = one_first + per_lane < hi ? one_first + per_lane : hi;
                for (u32_t i = one_first; i < one_end; ++i) {
                    sum = __dadd_rn(sum, a(i));
                    if (stops && sum >= target) {
                        taken = i + 1u;
                        stopped = true;
                        break;
                    }
                }
                next_lane = stuck + 1u;
            }
        }
        if (lane == 0) {
            s.result = sum;
            s.stop = taken;
        }
    }
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------

struct RowShared {
    u32_t any_nan;
    u32_t keep;
    u32_t first_token;
    u32_t cut_first;    // first sorted position holding the cut-off key
    u32_t cut_last;     // one past the last sorted position holding it
    u32_t warp_counts[WARPS];
    u32_t equal_before;  // tokens equal to the cut-off key in earlier tiles
};

__device__ void sample_rows(const float* __restrict__ logits, const SampleRow* __restrict__ rows,
                            u64_t* __restrict__ sort_scratch, double* __restrict__ weight_scratch,
                            u32_t* __restrict__ tokens, SampleParams p) {
    __shared__ double values[THREADS];
    __shared__ u32_t ids[THREADS];
    __shared__ SortShared sort_shared;
    __shared__ SumShared sum_shared;
    __shared__ RowShared row_shared;
    const u32_t row = blockIdx.x;
    if (row >= p.rows) return;
    const SampleRow r = rows[row];
    const float* l = logits + (size_t)row * p.vocab;
    const u32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;

    if (r.temperature == 0.0f) {
        const u32_t winner = best_token_of([&](u32_t t) { return (double)l[t]; }, p.vocab, values, ids);
        if (threadIdx.x == 0) tokens[row] = winner;
        return;
    }

    const double inv_t = __ddiv_rn(1.0, (double)r.temperature);
    // Token t's sampling score: its logit over the temperature plus its Gumbel noise.
    const auto noisy_score = [&](u32_t t) {
        return __dadd_rn(__dmul_rn((double)l[t], inv_t), gumbel(r.seed, r.position, t));
    };
    const bool restrict_k = r.top_k > 0u && r.top_k < p.vocab;
    const bool restrict_p = r.top_p < 1.0f;
    if (!restrict_k && !restrict_p) {
        // Every token is a candidate, considered by the CPU from id 0 up: a NaN score of token 0
        // stays best (nothing compares above it); later NaN scores never win.
        if (isnan(noisy_score(0u))) {
            if (threadIdx.x == 0) tokens[row] = 0u;
            return;
        }
        const u32_t winner = best_token_of(noisy_score, p.vocab, values, ids);
        if (threadIdx.x == 0) tokens[row] = winner;
        return;
    }

    // The row's keys, sorted: a and b are the two halves of the row's u64 scratch.
    u32_t* key_a = (u32_t*)(sort_scratch + (size_t)row * p.padded);
    u32_t* key_b = key_a + p.padded;
    const u32_t* sorted = sort_keys(l, p.vocab, key_a, key_b, sort_shared);
    const u32_t count = restrict_k ? r.top_k : p.vocab;

    u32_t keep = count;
    if (restrict_p) {
        // The CPU's weights exp(logit/T - max) of the first `count` sorted tokens. A NaN among
        // them makes its total NaN, every share NaN and never >= top_p: everything is kept. Else
        // every weight is in [0, 1] and the first is exactly 1.
        double* weights = weight_scratch + (size_t)row * p.padded;
        const double max = __dmul_rn((double)key_logit(sorted[0]), inv_t);
        if (threadIdx.x == 0) row_shared.any_nan = 0u;
        __syncthreads();
        bool saw_nan = false;
        for (u32_t i = threadIdx.x; i < count; i += THREADS) {
            const double w = exp_f64(__dsub_rn(__dmul_rn((double)key_logit(sorted[i]), inv_t), max));
            weights[i] = w;
            saw_nan |= isnan(w);
        }
        if (saw_nan) row_shared.any_nan = 1u;
        __syncthreads();
        if (row_shared.any_nan == 0u) {
            ordered_sum(Addends{weights}, count, false, 0.0, sum_shared);
            const double total = sum_shared.result;
            for (u32_t i = threadIdx.x; i < count; i += THREADS) weights[i] = __ddiv_rn(weights[i], total);
            __syncthreads();
            ordered_sum(Addends{weights}, count, true, (double)r.top_p, sum_shared);
            keep = sum_shared.stop;
        }
    }

    // The kept candidates: the first `keep` sorted tokens = the tokens whose key is below the
    // cut-off key, and the lowest-id `keep - cut_first` of those equal to it.
    const u32_t cut = sorted[keep - 1u];
    if (threadIdx.x == 0) {
        u32_t lo = 0, hi = keep - 1u;  // first position of `cut` in sorted[0..keep)
        while (lo < hi) {
            const u32_t mid = lo + (hi - lo) / 2u;
            if (sorted[mid] < cut) lo = mid + 1u;
            else hi = mid;
        }
        row_shared.cut_first = lo;
        u32_t a = keep, b = p.vocab;  // first position after `cut` in sorted[keep..vocab)
        while (a < b) {
            const u32_t mid = a + (b - a) / 2u;
            if (sorted[mid] <= cut) a = mid + 1u;
            else b = mid;
        }
        row_shared.cut_last = a;
        row_shared.first_token = 0xffffffffu;
        row_shared.equal_before = 0u;
    }
    __syncthreads();
    const u32_t equal_kept = keep - row_shared.cut_first;
    const bool all_equal_kept = row_shared.cut_last - row_shared.cut_first == equal_kept;

    // The CPU considers its candidates from the best: a NaN score of the first (the lowest id
    // holding the largest key) stays best. A score is NaN exactly when the logit is (the noise is
    // finite), so the check needs that token only for a NaN first key.
    const u32_t first_key = sorted[0];
    if (isnan(key_logit(first_key))) {
        for (u32_t t = threadIdx.x; t < p.vocab; t += THREADS)
            if (descending_key(l[t]) == first_key) atomicMin(&row_shared.first_token, t);
        __syncthreads();
        if (threadIdx.x == 0) tokens[row] = row_shared.first_token;
        return;
    }

    BestToken best = BestToken::none();
    if (all_equal_kept) {
        for (u32_t t = threadIdx.x; t < p.vocab; t += THREADS) {
            if (descending_key(l[t]) > cut) continue;
            best.offer(noisy_score(t), t);
        }
    } else {
        // Ties at the cut-off: a token equal to it is kept when fewer than `equal_kept` equal
        // tokens have lower ids (an ordered count, tile by tile).
        const u32_t lanes_below = (1u << lane) - 1u;
        for (u32_t base = 0; base < p.vocab; base += THREADS) {
            const u32_t t = base + threadIdx.x;
            const bool valid = t < p.vocab;
            const u32_t key = valid ? descending_key(l[t]) : 0xffffffffu;
            const bool equal = valid && key == cut;
            const u32_t ballot = __ballot_sync(FULL_MASK, equal);
            if (lane == 0) row_shared.warp_counts[warp] = (u32_t)__popc(ballot);
            __syncthreads();
            u32_t before = row_shared.equal_before + (u32_t)__popc(ballot & lanes_below);
            for (u32_t w = 0; w < warp; ++w) before += row_shared.warp_counts[w];
            if (valid && (key < cut || (equal && before < equal_kept))) best.offer(noisy_score(t), t);
            __syncthreads();
            if (threadIdx.x == 0) {
                u32_t tile_equal = 0;
                for (u32_t w = 0; w < WARPS; ++w) tile_equal += row_shared.warp_counts[w];
                row_shared.equal_before += tile_equal;
            }
            __syncthreads();
        }
    }
    const u32_t winner = block_best(best.value, best.token, values, ids);
    if (threadIdx.x == 0) tokens[row] = winner;
}

// ---------------------------------------------------------------------------------------------
// Grammar masks: sampling.rs's AllowedTokens::apply, before the sampler runs on the masked rows.

// Launch parameters of mask_logits (mirrored by `MaskParams`).
struct MaskParams {
    u32_t rows;
    u32_t vocab;
    u32_t words;  // bitset words per row: ceil(vocab / 32)
};

constexpr u32_t MASK_THREADS = 256;

// logits[r, t] = -inf wherever bit t % 32 of words[r, t / 32] is clear (the host clears every bit
// of a row's padding). One thread per logit, MASK_THREADS per block; rows never interact.
__device__ void mask_logits(float* __restrict__ logits, const u32_t* __restrict__ words, MaskParams p) {
    const unsigned long long i = (unsigned long long)blockIdx.x * MASK_THREADS + threadIdx.x;
    if (i >= (unsigned long long)p.rows * p.vocab) return;
    const u32_t row = (u32_t)(i / p.vocab);
    const u32_t t = (u32_t)(i % p.vocab);
    const u32_t word = words[(size_t)row * p.words + t / 32u];
    if (((word >> (t % 32u)) & 1u) == 0u) logits[i] = __uint_as_float(0xff800000u);
}

// ---------------------------------------------------------------------------------------------
// Log-probabilities of sampled tokens: sampling.rs's token_logprobs, bit for bit. One block of
// LOGPROB_LANES threads per row (rows never interact). ln p(t) = (x_t - m) - ln S with m the row's
// largest logit and S = sum of exp_f64(x - m) over the tokens of non-zero probability: thread l
// adds the tokens l, l + LANES, ... in increasing id (the CPU's lane l), then the lanes are added
// pairwise, halving (lane[i] += lane[i + half]), the CPU's order. The max is order-free. NaN
// logits count as -inf (a grammar's masked logits are -inf already: mask_logits runs first). The
// alternatives are `top` block-wide argmax rounds (larger logit first, ties to the lower id),
// each over the tokens after the previous pick in that order.

constexpr u32_t LOGPROB_LANES = 256;
constexpr u32_t MAX_TOP_LOGPROBS = 20;

// Launch parameters of token_logprobs (mirrored by `LogprobParams`).
struct LogprobParams {
    u32_t rows;
    u32_t vocab;
    u32_t top;  // alternatives per row, <= MAX_TOP_LOGPROBS
};

// Whether (a, ia) comes before (b, ib): a larger logit, or an equal one with a lower id.
__device__ __forceinline__ bool logprob_before(float a, u32_t ia, float b, u32_t ib) {
    return a > b || (a == b && ia < ib);
}

__device__ __forceinline__ float logprob_of(float x, double max, double ln_total) {
    if (!(x > __uint_as_float(0xff800000u))) return __uint_as_float(0xff800000u);
    return __double2float_rn(__dsub_rn(__dsub_rn((double)x, max), ln_total));
}

// chosen_logprob[r] = ln p(chosen[r]); top_ids / top_logprobs [rows, MAX_TOP_LOGPROBS]: the first
// `top` alternatives of row r, 0xffffffff past the tokens of non-zero probability.
__device__ void token_logprobs(const float* __restrict__ logits, const u32_t* __restrict__ chosen,
                               float* __restrict__ chosen_logprob, u32_t* __restrict__ top_ids,
                               float* __restrict__ top_logprobs, LogprobParams p) {
    __shared__ double lanes[LOGPROB_LANES];
    __shared__ float best_logit[LOGPROB_LANES];
    __shared__ u32_t best_id[LOGPROB_LANES];
    const u32_t row = blockIdx.x;
    if (row >= p.rows) return;
    const float* l = logits + (size_t)row * p.vocab;
    const u32_t lane = threadIdx.x;
    const float neg_inf = __uint_as_float(0xff800000u);

    float m = neg_inf;
    for (u32_t t = lane; t < p.vocab; t += LOGPROB_LANES)
        if (l[t] > m) m = l[t];
    best_logit[lane] = m;
    __syncthreads();
    for (u32_t half = LOGPROB_LANES / 2; half > 0; half >>= 1) {
        if (lane < half && best_logit[lane + half] > best_logit[lane]) best_logit[lane] = best_logit[lane + half];
        __syncthreads();
    }
    const double max = (double)best_logit[0];
    double sum = 0.0;
    for (u32_t t = lane; t < p.vocab; t += LOGPROB_LANES)
        if (l[t] > neg_inf) sum = __dadd_rn(sum, exp_f64(__dsub_rn((double)l[t], max)));
    lanes[lane] = sum;
    __syncthreads();
    for (u32_t half = LOGPROB_LANES / 2; half > 0; half >>= 1) {
        if (lane < half) lanes[lane] = __dadd_rn(lanes[lane], lanes[lane + half]);
        __syncthreads();
    }
    const double ln_total = ln_f64(lanes[0]);
    if (lane == 0) {
        const u32_t c = chosen[row];
        chosen_logprob[row] = c < p.vocab ? logprob_of(l[c], max, ln_total) : neg_inf;
    }

    float prev_logit = 0.0f;
    u32_t prev_id = 0xffffffffu;
    for (u32_t k = 0; k < p.top; ++k) {
        float bl = neg_inf;
        u32_t bi = 0xffffffffu;
        for (u32_t t = lane; t < p.vocab; t += LOGPROB_LANES) {
            const float x = l[t];
            if (!(x > neg_inf)) continue;
            if (prev_id != 0xffffffffu && !logprob_before(prev_logit, prev_id, x, t)) continue;
            if (bi == 0xffffffffu || logprob_before(x, t, bl, bi)) {
                bl = x;
                bi = t;
            }
        }
        best_logit[lane] = bl;
        best_id[lane] = bi;
        __syncthreads();
        for (u32_t half = LOGPROB_LANES / 2; half > 0; half >>= 1) {
            if (lane < half) {
                const u32_t oi = best_id[lane + half];
                if (oi != 0xffffffffu &&
                    (best_id[lane] == 0xffffffffu || logprob_before(best_logit[lane + half], oi, best_logit[lane], best_id[lane]))) {
                    best_logit[lane] = best_logit[lane + half];
                    best_id[lane] = oi;
                }
            }
            __syncthreads();
        }
        prev_logit = best_logit[0];
        prev_id = best_id[0];
        const size_t at = (size_t)row * MAX_TOP_LOGPROBS + k;
        if (lane == 0) {
            top_ids[at] = prev_id;
            top_logprobs[at] = prev_id != 0xffffffffu ? logprob_of(prev_logit, max, ln_total) : neg_inf;
        }
        __syncthreads();
        if (prev_id == 0xffffffffu) break;
    }
}

}  // namespace sampling
