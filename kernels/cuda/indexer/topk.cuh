// The indexer's selection on the device, exactly `csa::top_k_lowest_index`: the k largest of n
// values in `f32::total_cmp` order, ties broken toward the lower index, the result ascending.
//
// One block of THREADS threads per row. Each value becomes its 32-bit total-order key (unsigned
// compare of keys == total_cmp of the floats, NaNs and signed zeros included). A radix select
// (digits of 11, 11 and 10 bits, from the top, one shared histogram per pass) finds the k-th
// largest key T and how many keys equal to T belong to the k largest (`take_equal`, the lowest
// indices among those equal to T). A stable compaction then walks the row in index order, tile by
// tile, with one block-wide scan of (greater, equal) counts per tile: element i is selected when
// key > T, or key == T and fewer than `take_equal` keys equal to T precede it; its rank in the
// ascending output is (keys > T before i) + min(keys == T before i, take_equal). No atomics decide
// anything but histogram counts, so the result is a function of the row alone.
#pragma once
#include "common/params.h"

namespace topk {

constexpr u32_t THREADS = 1024;
constexpr u32_t WARPS = THREADS / 32;
constexpr u32_t MAX_BINS = 2048;
constexpr u32_t PASSES = 3;
// No index (padding of the output rows); also the largest key.
constexpr u32_t NONE = 0xffffffffu;
// order_key(+inf) and order_key(-inf).
constexpr u32_t KEY_POS_INF = 0xff800000u;
constexpr u32_t KEY_NEG_INF = 0x007fffffu;

// The key whose unsigned order is `f32::total_cmp`'s order of the floats: negative values (sign
// bit set) have every bit flipped, the others get the sign bit set.
__device__ __forceinline__ u32_t order_key(float value) {
    const u32_t bits = __float_as_uint(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct Shared {
    u32_t histogram[MAX_BINS];
    u32_t warp_sums[WARPS + 1];
    u32_t digit;
    u32_t above;  // keys of the current prefix in bins above `digit`
};

// Exclusive prefix sum of one value per thread in thread order; `total` gets the sum of all.
// Every thread of the block must call it.
__device__ __forceinline__ u32_t block_exclusive_scan(u32_t value, Shared& s, u32_t& total) {
    const u32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    u32_t inclusive = value;
#pragma unroll
    for (u32_t offset = 1; offset < 32; offset <<= 1) {
        const u32_t before = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += before;
    }
    if (lane == 31) s.warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const u32_t own = lane < WARPS ? s.warp_sums[lane] : 0u;
        u32_t running = own;
#pragma unroll
        for (u32_t offset = 1; offset < 32; offset <<= 1) {
            const u32_t before = __shfl_up_sync(0xffffffffu, running, offset);
            if (lane >= offset) running += before;
        }
        if (lane < WARPS) s.warp_sums[lane] = running - own;
        if (lane == 31) s.warp_sums[WARPS] = running;
    }
    __syncthreads();
    const u32_t result = s.warp_sums[warp] + inclusive - value;
    total = s.warp_sums[WARPS];
    __syncthreads();  // warp_sums is reused by the next scan
    return result;
}

// The k-th largest key `threshold` of keys.key(0 .. n) and how many keys equal to it are among the
// k largest (`take_equal`). k = 0 selects nothing (no key exceeds NONE and take_equal = 0); k >= n
// selects everything (threshold 0, take_equal = n).
template <class Keys>
__device__ void find_threshold(const Keys& keys, u32_t n, u32_t k, Shared& s, u32_t& threshold,
                               u32_t& take_equal) {
    if (k == 0) {
        threshold = NONE;
        take_equal = 0;
        return;
    }
    if (k >= n) {
        threshold = 0;
        take_equal = n;
        return;
    }
    const u32_t widths[PASSES] = {11, 11, 10};
    u32_t prefix = 0, prefix_mask = 0, remaining = k, shift = 32;
    for (u32_t pass = 0; pass < PASSES; ++pass) {
        const u32_t width = widths[pass];
        shift -= width;
        const u32_t bins = 1u << width;
        for (u32_t b = threadIdx.x; b < bins; b += THREADS) s.histogram[b] = 0;
        __syncthreads();
#pragma unroll 4
        for (u32_t i = threadIdx.x; i < n; i += THREADS) {
            const u32_t key = keys.key(i);
            if ((key & prefix_mask) == prefix) atomicAdd(&s.histogram[(key >> shift) & (bins - 1)], 1u);
        }
        __syncthreads();
        // Thread t owns bins bins-1-t*per .. bins-per-t*per (counted from the top).
        const u32_t per = bins / THREADS;
        u32_t local = 0;
        for (u32_t j = 0; j < per; ++j) local += s.histogram[bins - 1 - (threadIdx.x * per + j)];
        u32_t total;
        const u32_t before = block_exclusive_scan(local, s, total);
        if (before < remaining && remaining <= before + local) {
            u32_t above = before;
            for (u32_t j = 0; j < per; ++j) {
                const u32_t bin = bins - 1 - (threadIdx.x * per + j);
                const u32_t count = s.histogram[bin];
                if (above + count >= remaining) {
                    s.digit = bin;
                    s.above = above;
                    break;
                }
                above += count;
            }
        }
        __syncthreads();
        prefix |= s.digit << shift;
        prefix_mask |= (bins - 1) << shift;
        remaining -= s.above;
        __syncthreads();  // s.digit / s.above and the histogram are rewritten by the next pass
    }
    threshold = prefix;
    take_equal = remaining;
}

// Walks keys.key(0 .. n) in index order and calls visit(i, selected, rank, key) for each element
// (rank: its position among the selected, ascending by index; meaningful when selected). With
// `stop_when_full`, stops after the tile in which the k-th element was selected.
template <class Keys, class Visit>
__device__ void compact(const Keys& keys, u32_t n, u32_t k, u32_t threshold, u32_t take_equal,
                        bool stop_when_full, Shared& s, Visit& visit) {
    u32_t greater_before = 0, equal_before = 0;
    for (u32_t base = 0; base < n; base += THREADS) {
        const u32_t i = base + threadIdx.x;
        const u32_t key = i < n ? keys.key(i) : 0u;
        const u32_t greater = (i < n && key > threshold) ? 1u : 0u;
        const u32_t equal = (i < n && key == threshold) ? 1u : 0u;
        u32_t tile_total;
        // Counts of one tile are at most THREADS < 2^16: two counters in one word.
        const u32_t before = block_exclusive_scan(greater | (equal << 16), s, tile_total);
        const u32_t greater_here = greater_before + (before & 0xffffu);
        const u32_t equal_here = equal_before + (before >> 16);
        if (i < n) {
            const bool selected = greater || (equal && equal_here < take_equal);
            visit(i, selected, greater_here + min(equal_here, take_equal), key);
        }
        greater_before += tile_total & 0xffffu;
        equal_before += tile_total >> 16;
        if (stop_when_full && greater_before + min(equal_before, take_equal) >= k) break;
    }
}

// Keys of a row of scores.
struct ScoreKeys {
    const float* scores;
    __device__ __forceinline__ u32_t key(u32_t i) const { return order_key(scores[i]); }
};

// Keys of the candidate blocks of a row of n scores: block b scores its positions
// [b * block_size, min((b + 1) * block_size, n)) by their running maximum from -inf, replaced only
// by a strictly greater score (Rust's `fold(-inf, f32::max)` on x86-64: NaN never wins, the first
// of equal values such as -0.0 / 0.0 stays); the newest block is pinned to +inf.
struct BlockMaxKeys {
    const float* scores;
    u32_t n;
    u32_t block_size;
    u32_t newest;
    // min(start + block_size, n) without overflow.
    __device__ __forceinline__ u32_t block_end(u32_t start) const {
        return n - start > block_size ? start + block_size : n;
    }
    __device__ __forceinline__ float block_max(u32_t b) const {
        const u32_t start = b * block_size;
        const u32_t end = block_end(start);
        float best = __uint_as_float(0xff800000u);  // -inf
        for (u32_t p = start; p < end; ++p) {
            const float score = scores[p];
            if (score > best) best = score;
        }
        return best;
    }
    __device__ __forceinline__ u32_t key(u32_t b) const {
        return b == newest ? KEY_POS_INF : order_key(block_max(b));
    }
};

// Writes the selected indices of a row at their ranks.
struct WriteIndex {
    u32_t* out;
    __device__ __forceinline__ void operator()(u32_t i, bool selected, u32_t rank, u32_t) const {
        if (selected) out[rank] = i;
    }
};

// Marks every position of a block: kept when the block is selected and its score > -inf.
struct WriteBlockMask {
    u8_t* mask;
    u32_t n;
    u32_t block_size;
    __device__ __forceinline__ void operator()(u32_t b, bool selected, u32_t, u32_t key) const {
        const u8_t keep = (selected && key > KEY_NEG_INF) ? 1 : 0;
        const u32_t start = b * block_size;
        const u32_t end = n - start > block_size ? start + block_size : n;
        for (u32_t p = start; p < end; ++p) mask[p] = keep;
    }
};

}  // namespace topk
