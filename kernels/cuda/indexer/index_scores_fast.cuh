// The `fast` lightning-indexer scores (ARCHITECTURE.md §3): the row-batched scores of
// index_scores.cuh at the bf16 rounding points, score[j] = bf16(sum_h bf16(max(bf16(q_h . k_j), 0)
// * w_h)), with the head_dim-128 dot products on tensor cores (mma.sync m16n8k16, bf16 operands,
// fp32 accumulation from zero, k-steps in dim order) and everything after them as the exact kernel
// does it: the same fp32 product with w_h, the same bf16 roundings, the head sum a sequential f64
// sum in head order rounded to f32, then to bf16.
//
// Why this gives the exact kernel's bits on the indexer's inputs: q and the keys are Q4e-QDQ'd
// (v41-architecture.md §3.0: E2M1 values times a power-of-two scale per 32 dims, stored as bf16),
// so their conversion to bf16 is exact and every product q_d k_d is exact in fp32. The products
// of one 32-dim group are multiples of 2^(s - 2) below 1152 · 2^s (2^s the group's q scale times
// its key scale); while the four groups' s lie within 9 of each other, the whole dot product and
// every partial sum of the mma chain fit fp32's 24 bits, so the tensor cores add them exactly and
// the fp32 logit is the exact kernel's (its f64 sum rounded once to f32): the same value enters
// the same operations from there on. Wider scale spreads within one head and key may round a
// logit differently (the fast numerics' error).
//
// One block per tile of TILE_KEYS keys and group of GROUP consecutive queries (grid (tiles,
// groups)); warp w owns keys [16 w, 16 w + 16) of the tile. A query scores the tile only if it
// sees past the tile's first key (query t sees visible[t] keys from table row first_keys[t]). The
// tile's keys are staged once in shared memory as bf16 for every query of the group with the same
// first row (a prefill's queries share their sequence's keys; a new first row restages them), and
// each warp keeps its 16 keys as mma B fragments in registers. Then per query, one barrier each:
//   1. the warp's [heads x 16 keys] dot products, 16 heads at a time (A: the query's bf16 rows by
//      ldmatrix), and their terms bf16(max(bf16(dot), 0) * w_h) into shared memory [key][head];
//   2. meanwhile the previous query's head sums, one thread of warps 4..7 per key, into its scores;
//   3. the next query's q and w (loaded before step 1) stored as bf16 in the other buffer.
// A key's score depends on its query's q and w and the key alone, through a fixed chain of
// operations: deterministic and batch invariant (no launch shape or neighbour changes a bit).
#pragma once
#include "common/numerics.cuh"

namespace fast_index {

constexpr u32_t HEAD_DIM = 128;
constexpr u32_t MAX_HEADS = 64;
constexpr u32_t TILE_KEYS = 128;  // keys per block: 16 per warp
constexpr u32_t THREADS = 2 * TILE_KEYS;
constexpr u32_t GROUP = 8;  // queries per block
// bf16 per staged q or key row (272 bytes: ldmatrix's 8 rows in distinct banks) and per key's
// terms (144 bytes: the head sums' 16-byte reads of 8 keys in distinct banks).
constexpr u32_t ROW_STRIDE = HEAD_DIM + 8;
constexpr u32_t TERM_STRIDE = MAX_HEADS + 8;
constexpr u32_t ROW_QUADS = HEAD_DIM / 4;                   // float4 per f32 row
constexpr u32_t Q_QUADS = MAX_HEADS * ROW_QUADS / THREADS;  // a thread's float4 of a query's q
constexpr u32_t STAGE_QUADS = TILE_KEYS * ROW_QUADS / THREADS;  // a thread's float4 of the tile
constexpr u32_t STAGE_BATCH = 8;                                // staged float4 in flight
constexpr u32_t NO_QUERY = GROUP;

// The block's shared memory (dynamic; `FAST_SHARED_BYTES` in ops/index.rs).
struct Shared {
    __nv_bfloat16 keys[TILE_KEYS][ROW_STRIDE];          // the tile's keys
    __nv_bfloat16 q[2][MAX_HEADS][ROW_STRIDE];          // a query's rows, double-buffered
    __nv_bfloat16 terms[2][TILE_KEYS][TERM_STRIDE];     // a query's terms, double-buffered
    float w[2][MAX_HEADS];                              // a query's head weights
    u32_t visible[GROUP], first[GROUP], start[GROUP];  // the group's windows and offsets
};
static_assert(sizeof(Shared) == 107104, "FAST_SHARED_BYTES in ops/index.rs");

__device__ __forceinline__ Shared& shared_regions() {
    extern __shared__ __align__(16) unsigned char index_fast_smem[];
    return *reinterpret_cast<Shared*>(index_fast_smem);
}

// The keys query slot i scores in the tile from key tile0 on (0: none).
__device__ __forceinline__ u32_t tile_count(const Shared& sh, u32_t i, u32_t tile0) {
    return sh.visible[i] > tile0 ? min(TILE_KEYS, sh.visible[i] - tile0) : 0u;
}

// The first slot from i on that scores keys of the tile (NO_QUERY: none).
__device__ __forceinline__ u32_t next_query(const Shared& sh, u32_t i, u32_t tile0) {
    while (i < GROUP && tile_count(sh, i, tile0) == 0) ++i;
    return i;
}

// The keys the queries from slot i on that share its first row (up to the next that does not)
// score in the tile: the most of them.
__device__ __forceinline__ u32_t run_count(const Shared& sh, u32_t i, u32_t tile0) {
    u32_t count = 0;
    for (u32_t j = i; j < GROUP; j = next_query(sh, j + 1, tile0)) {
        if (sh.first[j] != sh.first[i]) break;
        count = max(count, tile_count(sh, j, tile0));
    }
    return count;
}

__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* dst, float4 v) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
}

// Keys [0, count) of the tile (key j at the address key_ptrs[row0 + j]) into sh.keys as bf16,
// zero from count on: a thread's float4 in batches of STAGE_BATCH, all loads of a batch in flight
// before its stores (read-only global loads, which no shared store can alias).
__device__ __forceinline__ void stage_keys(Shared& sh, const unsigned long long* __restrict__ key_ptrs,
                                           u32_t row0, u32_t count) {
#pragma unroll 1
    for (u32_t r0 = 0; r0 < STAGE_QUADS; r0 += STAGE_BATCH) {
        float4 v[STAGE_BATCH];
#pragma unroll
        for (u32_t r = 0; r < STAGE_BATCH; ++r) {
            const u32_t i = threadIdx.x + (r0 + r) * THREADS, key = i / ROW_QUADS;
            v[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (key < count) {
                const float4* row = reinterpret_cast<const float4*>(__ldg(&key_ptrs[row0 + key]));
                v[r] = __ldg(&row[i % ROW_QUADS]);
            }
        }
#pragma unroll
        for (u32_t r = 0; r < STAGE_BATCH; ++r) {
            const u32_t i = threadIdx.x + (r0 + r) * THREADS;
            store_bf16x4(&sh.keys[i / ROW_QUADS][i % ROW_QUADS * 4], v[r]);
        }
    }
}

// This thread's share of a query's q rows [heads, HEAD_DIM] and of its weights [heads].
struct QueryShare {
    float4 q[Q_QUADS];
    float w;
};

__device__ __forceinline__ void fetch_query(QueryShare& share, const float* __restrict__ q,
                                            const float* __restrict__ w, u32_t query, u32_t heads) {
    const float4* q4 = reinterpret_cast<const float4*>(q + (size_t)query * heads * HEAD_DIM);
#pragma unroll
    for (u32_t r = 0; r < Q_QUADS; ++r) {
        const u32_t i = threadIdx.x + r * THREADS;
        share.q[r] = i < heads * ROW_QUADS ? q4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    share.w = threadIdx.x < heads ? w[(size_t)query * heads + threadIdx.x] : 0.0f;
}

// The share into buffer buf: q as bf16, zero rows from `heads` up to `rows` (the last 16-head
// tile's), and the weights.
__device__ __forceinline__ void store_query(Shared& sh, u32_t buf, const QueryShare& share, u32_t rows) {
#pragma unroll
    for (u32_t r = 0; r < Q_QUADS; ++r) {
        const u32_t i = threadIdx.x + r * THREADS;
        if (i < rows * ROW_QUADS)
            store_bf16x4(&sh.q[buf][i / ROW_QUADS][i % ROW_QUADS * 4], share.q[r]);
    }
    if (threadIdx.x < MAX_HEADS) sh.w[buf][threadIdx.x] = share.w;
}

// The warp's keys key0 .. key0 + 15 as mma B fragments: b[nt][kp] holds k-steps 2 kp and 2 kp + 1
// of keys key0 + 8 nt + (lane / 4) (registers 0, 1: step 2 kp; 2, 3: step 2 kp + 1).
__device__ __forceinline__ void load_key_fragments(u32_t (&b)[2][4][4], const Shared& sh, u32_t key0,
                                                   u32_t lane) {
#pragma unroll
    for (u32_t nt = 0; nt < 2; ++nt)
#pragma unroll
        for (u32_t kp = 0; kp < 4; ++kp)
            ldmatrix_x4(b[nt][kp], &sh.keys[key0 + nt * 8 + lane % 8][kp * 32 + lane / 8 * 8]);
}

// The terms bf16(max(bf16(q_h . k), 0) * w_h) of the query in buffer buf, of every head and the
// warp's 16 keys, into sh.terms[buf][key][h].
__device__ __forceinline__ void score_terms(Shared& sh, u32_t buf, const u32_t (&b)[2][4][4], u32_t key0,
                                            u32_t heads, u32_t lane) {
    const u32_t g = lane / 4, t = lane % 4;
    for (u32_t h0 = 0; h0 < heads; h0 += 16) {
        float c[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (u32_t kk = 0; kk < HEAD_DIM / 16; ++kk) {
            // a: heads h0 + g, + 8 x dims 16 kk + 2t.., + 8..
            u32_t a[4];
            ldmatrix_x4(a, &sh.q[buf][h0 + lane / 8 % 2 * 8 + lane % 8][kk * 16 + lane / 16 * 8]);
#pragma unroll
            for (u32_t nt = 0; nt < 2; ++nt)
                mma_bf16(c[nt], a, b[nt][kk / 2][kk % 2 * 2], b[nt][kk / 2][kk % 2 * 2 + 1]);
        }
        // c[nt][i]: head h0 + g + 8 (i / 2), key key0 + 8 nt + 2t + i % 2.
#pragma unroll
        for (u32_t nt = 0; nt < 2; ++nt)
#pragma unroll
            for (u32_t i = 0; i < 4; ++i) {
                const u32_t h = h0 + g + i / 2 * 8, key = key0 + nt * 8 + 2 * t + i % 2;
                if (h < heads) {
                    const float logit = round_bf16_f32(c[nt][i]);
                    const float term = __fmul_rn(fmaxf(logit, 0.0f), sh.w[buf][h]);
                    sh.terms[buf][key][h] = __float2bfloat16_rn(term);
                }
            }
    }
}

// A query's scores of keys [0, count) from its terms in buffer buf, one thread of the upper warps
// per key (the warps a partial tile leaves without keys to multiply): the terms added in head
// order in f64 from 0, rounded to f32, then to bf16 (as the exact kernel).
__device__ __forceinline__ void head_sums(const Shared& sh, u32_t buf, u32_t count, u32_t heads,
                                          float* __restrict__ scores) {
    static_assert(THREADS == 2 * TILE_KEYS, "one upper-half thread per key");
    const u32_t key = threadIdx.x - TILE_KEYS;
    if (threadIdx.x < TILE_KEYS || key >= count) return;
    double sum = 0.0;
    for (u32_t h0 = 0; h0 < heads; h0 += 8) {
        const uint4 v = *reinterpret_cast<const uint4*>(&sh.terms[buf][key][h0]);
        const u32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (u32_t e = 0; e < 8; ++e) {
            const u32_t word = words[e / 2];
            const float term = __uint_as_float(e % 2 ? word & 0xffff0000u : word << 16);
            if (h0 + e < heads) sum = __dadd_rn(sum, (double)term);
        }
    }
    scores[key] = round_bf16_f32(__double2float_rn(sum));
}

// The row-batched entry (index_scores.cu: the arguments and the grid): queries
// group blockIdx.y .. + group (of `queries`; 1 <= group <= GROUP, the launcher's choice: no
// score depends on it), keys [TILE_KEYS blockIdx.x, + TILE_KEYS) of each
// query's window; q [queries, heads, HEAD_DIM], w [queries, heads] (f32 storage, bf16 values);
// query t's key j at the address key_ptrs[first_keys[t] + j], its score at
// scores[score_starts[t] + j].
__device__ void index_scores(const float* __restrict__ q, const float* __restrict__ w,
                             const unsigned long long* __restrict__ key_ptrs,
                             const u32_t* __restrict__ visible, const u32_t* __restrict__ first_keys,
                             const u32_t* __restrict__ score_starts, float* __restrict__ scores,
                             u32_t queries, u32_t group, IndexParams p) {
    Shared& sh = shared_regions();
    const u32_t tile0 = blockIdx.x * TILE_KEYS, query0 = blockIdx.y * group;
    if (threadIdx.x < GROUP) {
        const u32_t query = query0 + threadIdx.x;
        const bool real = threadIdx.x < group && query < queries;
        sh.visible[threadIdx.x] = real ? visible[query] : 0u;
        sh.first[threadIdx.x] = real ? first_keys[query] : 0u;
        sh.start[threadIdx.x] = real ? score_starts[query] : 0u;
    }
    __syncthreads();
    u32_t slot = next_query(sh, 0, tile0);
    if (slot == NO_QUERY) return;
    const u32_t heads = p.heads, rows = (heads + 15) / 16 * 16;
    const u32_t lane = threadIdx.x % 32, key0 = threadIdx.x / 32 * 16;
    QueryShare share;
    fetch_query(share, q, w, query0 + slot, heads);
    store_query(sh, 0, share, rows);
    u32_t b[2][4][4];
    bool staged = false;
    u32_t staged_first = 0, buf = 0;
    u32_t prev = NO_QUERY;  // the query whose terms are in buffer buf ^ 1
    while (slot != NO_QUERY) {
        const u32_t next = next_query(sh, slot + 1, tile0);
        const bool restage = !staged || sh.first[slot] != staged_first;
        if (restage) {
            __syncthreads();  // no warp still reads the keys staged before
            stage_keys(sh, key_ptrs, sh.first[slot] + tile0, run_count(sh, slot, tile0));
            staged = true;
            staged_first = sh.first[slot];
        }
        __syncthreads();  // slot's q and w (and keys) are in place; prev's terms are complete
        if (restage) load_key_fragments(b, sh, key0, lane);
        if (next != NO_QUERY) fetch_query(share, q, w, query0 + next, heads);
        if (key0 < tile_count(sh, slot, tile0)) score_terms(sh, buf, b, key0, heads, lane);
        if (prev != NO_QUERY)
            head_sums(sh, buf ^ 1, tile_count(sh, prev, tile0), heads, scores + sh.start[prev] + tile0);
        if (next != NO_QUERY) store_query(sh, buf ^ 1, share, rows);
        prev = slot;
        slot = next;
        buf ^= 1;
    }
    __syncthreads();  // the last query's terms are complete
    head_sums(sh, buf ^ 1, tile_count(sh, prev, tile0), heads, scores + sh.start[prev] + tile0);
}

}  // namespace fast_index
