// The `fast` sink attention (ARCHITECTURE.md §3): the same operation as sparse_attention.cuh —
// per query, every head attends to its own list of key rows (K = V, one row shared by all heads)
// plus a per-head sink — on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation), its f32
// operands taken as PIECES bf16 pieces (one kernel body, the pieces a template parameter):
//   PIECES = 1 (`sparse_attention_sink_rows_ptr_fast*`): the bf16 rounding points of V4.1 (q,
//     keys and the probabilities' weights are bf16 values there, so converting them to bf16 is
//     exact; only the order of the fp32 additions differs from the exact kernel's f64 sums); the
//     output rounded to bf16 as the reference rounds it.
//   PIECES = 2 (`sparse_attention_sink_rows_ptr_fast_f32*`): V4's plain f32 precision (no
//     rounding point: transformers' float32 attention). Every f32 operand x — q, the keys (as K
//     and as V) and the fp32 weights p — is split exactly into x = x₀ + x₁ + r, x₀ = bf16(x),
//     x₁ = bf16(x − x₀) (the difference exact in fp32), |r| ≤ 2^-16 |x|, and each product a·b
//     is taken as a₁·b₀ + a₀·b₁ + a₀·b₀, three mma on one accumulator, the small ones first
//     (a₁·b₁ ≤ 2^-16 |a b| dropped): within 3.01 · 2^-16 of a·b instead of bf16's 2^-8, on
//     the tensor cores where the exact kernel sums in f64 on CUDA cores. Two pieces, not three
//     as the bf16x3 linear takes: a third would cut the heads a block holds again (q and the
//     key tile sit in shared memory once per piece) for precision below what the fp32
//     accumulation keeps anyway (17 · 2^-23 an mma); TF32 pieces would take 32 bits each in
//     shared memory (twice a bf16 piece) at half the mma rate. The output is the f32 value,
//     unrounded, as the exact kernel writes it at Rounding::F32. The two pieces of q and of the
//     key tiles fit 32 heads a block (Shared<_, 2>, 219 008 bytes with the staging at head_dim 512).
// Both are within bounds derived from this arithmetic (kernels/src/ops/attention.rs), tested in
// tests/tests/fast_attention/mod.rs.
//
// One block per (`groups` groups of 16 heads, query, split of its keys); groups · head_dim / 64
// warps, warp w serving head group w / (head_dim / 64) over the head dims [64 d, 64 d + 64),
// d = w % (head_dim / 64) (head_dim 64, 128, 256 or 512, so that the softmax's half-warps tile the
// pairs evenly; key rows 16-byte aligned — the launcher checks both). A key tile is read from
// global memory and converted once for all the block's heads (1 to MAX_GROUPS / PIECES groups:
// 16 to 64 heads with one piece, 16 or 32 with two).
// The loop runs rounds of R tiles (ROUND: 2 in the whole-query kernel of one piece, 1 in the
// others, whose shared memory holds no second tile), three barriers a round: 3 / (16 R) a key.
// A thread converts the same float4 of every tile: float4 t % (head_dim / 4) of the tile's rows
// t / (head_dim / 4), + 2 groups, ... (t = threadIdx.x; slots t, t + threads, ... of the tile's
// 4 head_dim float4), as its bf16 pieces into shared memory (double-buffered by round: a slow warp
// may still read the last round's keys). The f32 keys reach it by one of two ways
// (KEYS_IN_REGISTERS):
//   - the staging ring (split blocks, two pieces): cp.async copies them (f32, as stored) two
//     tiles ahead into two staging slots of shared memory, one copy group per round (a thread
//     only ever reads back the float4 it copied itself, so a slot needs no barrier of its own);
//   - registers (the whole-query kernel of one piece, the prefill's): the thread loads them
//     itself, the next round's first tile over this round's softmax, its second over this
//     round's outputs (not over the scores, whose registers are the kernel's most), and stores
//     each tile's pieces into the next round's buffer as its phase ends: the f32 keys never pass
//     through shared memory (4 head_dim float4 a tile the ring writes and reads back).
//   0. The block's first tiles are requested (the ring's first two rounds, the registers' first
//      round); then the block's q rows are converted to their bf16 pieces into shared memory
//      (zero past the last head; rows head_dim + 8 apart); with registers, the first round's
//      keys follow. A key's address takes two dependent loads (its row number, then the table's
//      address); lanes 0 .. 16 R - 1 of warp 0 resolve them a few rounds ahead into shared
//      memory (KeyAddressPipe), so a fetch never waits on them.
// Then per round, in list order:
//   1. The ring: the thread's share of the round's tiles, waited for, is converted; after the
//      barrier the slots are refilled with the next tiles (two ahead of the round's first).
//   2. Scores: each warp multiplies its 64 dims of its group's 16 heads (A, by ldmatrix from the
//      bf16 q, shared by the round's tiles) by the same dims of each tile's 16 keys (B, by
//      ldmatrix), the pieces' products per k-step (mma_pieces): a partial [16 heads x 16 keys]
//      per warp and tile, stored to shared memory; a head's partials are added in the order of
//      its group's warps (dim order, fixed), times the scale.
//   3. Online softmax per head, one half-warp per head (lane j = key j), tile after tile of the
//      round: the new running max, the rescale exp(m_old - m_new), the weights p = exp(s - m_new)
//      (0 past the list), the weights' sum by a fixed shuffle tree, l = l * rescale + sum; p's
//      pieces to shared memory. m is carried in every lane's register (each lane's tile max is
//      the same value up to the sign of a zero, which no weight or rescale sees), l in lane 0's
//      (whose tree sum it adds); lane 0 writes both back at the round's end.
//   4. Outputs, tile after tile of the round: each warp rescales its accumulators [16 heads x 64
//      dims] and adds p · V for its dims (V = the tile's keys, by ldmatrix.trans), the pieces'
//      products per n-tile.
// Finally out = acc / (l + exp(sink - m)), rounded to bf16 with one piece.
//
// Why the bits do not depend on the group count (nor differ from the one-group kernel this
// replaced): every head's arithmetic is the same operations on the same values. q and the keys
// are split into their pieces by the same conversion wherever it runs (the same f32 values from
// the ring or from registers, zeros past the list either way); ldmatrix puts in each
// register exactly the pair of bf16 values the 32-bit fragment loads did (numerics.cuh,
// ldmatrix_x4); a warp's scores are the same mma chain over its 64 dims (k-steps in dim order,
// the pieces in a fixed order, from zero), a head's head_dim / 64 partials are added in dim
// order, then scaled; the softmax runs the same lanes, shuffle trees and expf on the same
// operands; the tiles, splits and the combine's order are fixed by the key count, and a round
// runs each of its tiles' scores, softmax update and output update in tile order as rounds of
// one tile do (only the barriers between them are fewer). A block's groups share only the key
// tiles and the barriers: no value flows from one head to another. So the launcher picks the
// group count from the launch's shape, and `fast_attention::every_head_block_gives_the_same_bits`
// (tests) checks it for both pieces and both forms.
//
// Split keys (flash-decoding): a query's list is cut into splits of SPLIT_TILES tiles, each
// computed from a fresh softmax state, then merged in split order from (M, L, O) = (-1e30, 0, 0):
// M' = max(M, m_s), O' = O exp(M - M') + acc_s exp(m_s - M'), L' likewise (merge_split);
// out = O / (L + exp(sink - M)). Two launch forms give the same bits: one block per split (grid
// z), so that a decode step of few queries still fills the GPU, each split's (m, l, acc) to
// scratch and `combine` merging them; or (WHOLE, the `_whole` kernels, for launches of many
// queries: a prefill) one block per query running its splits one after the other and merging
// each as it ends, with no scratch. A query of one split writes its output as above in both. The
// split count depends only on the query's key count, so every output depends only on its query's
// q, its key list and the fixed tile, split and merge order: deterministic and batch invariant.
// n_keys = 0 gives 0, as the exact kernel does.
#pragma once
#include "common/numerics.cuh"

namespace fast_attention {

constexpr u32_t HEADS = 16;         // heads per group (one mma M tile)
constexpr u32_t MAX_GROUPS = 4;     // groups per block of one piece (MAX_GROUPS / PIECES of PIECES)
constexpr u32_t TILE = 16;          // keys per tile (one mma K step of the output product)
constexpr u32_t WARP_DIMS = 64;     // head dims per warp
constexpr u32_t MAX_DIM_WARPS = 8;  // head_dim <= 512
constexpr u32_t MAX_THREADS = MAX_GROUPS * MAX_DIM_WARPS * 32;
constexpr u32_t MAX_WHOLE_THREADS = MAX_THREADS / 2;  // the one-block-per-query kernels'
constexpr u32_t MAX_F32_THREADS = MAX_THREADS / 2;    // both kernels of two pieces (32 heads)
// bf16 per shared q or key row: 16-byte rows whose 8 consecutive rows fall in distinct banks
// (ldmatrix without conflicts).
constexpr u32_t ROW_STRIDE = WARP_DIMS * MAX_DIM_WARPS + 8;
constexpr u32_t STAGES = 2;         // tiles in flight in the staging ring (cp.async)
constexpr u32_t HELD = 4;           // float4 of a tile a thread holds in registers (TileShare)
constexpr u32_t ADDRESS_SLOTS = 4;  // rounds whose key addresses wait in shared memory
constexpr u32_t SPLIT_TILES = 4;      // tiles per split of a query's keys
constexpr u32_t SPLIT_KEYS = SPLIT_TILES * TILE;

// The splits of a list of n_keys keys (one for an empty list).
__device__ __forceinline__ u32_t splits_of(u32_t n_keys) {
    return n_keys <= SPLIT_KEYS ? 1u : (n_keys + SPLIT_KEYS - 1) / SPLIT_KEYS;
}

// Tiles a round of barriers (the loop's unit): 2 in the whole-query kernel of one piece, 1 in
// the split blocks (64 heads of 1024 threads: two tiles' partials do not fit beside q) and with
// two pieces (two tiles' key pieces do not fit). A split's SPLIT_TILES are whole rounds.
template <bool WHOLE, u32_t PIECES>
constexpr u32_t ROUND = WHOLE && PIECES == 1 ? 2 : 1;

// How the f32 keys reach their bf16 pieces (the header): through registers in the whole-query
// kernel of one piece (the prefill's: 128 registers, no spills, its rounds' two tiles one at a
// time), through the staging ring in the others (the split blocks' 1024 threads have 64
// registers; the f32 kernels, V4's, are as they were).
template <bool WHOLE, u32_t PIECES>
constexpr bool KEYS_IN_REGISTERS = WHOLE && PIECES == 1;

// The block's shared memory (dynamic): regions at fixed offsets, sized for the widest block of
// the kernel (64 heads of 1024 threads with one piece in split blocks, of 512 threads at head_dim
// <= 256 in whole queries; 32 heads of 512 threads with two pieces), then, unless
// KEYS_IN_REGISTERS, the staging ring of head_dim-wide f32 keys. q rows are head_dim + 8 bf16
// apart (16-byte rows, 8 consecutive ones in distinct banks), so a block of T threads needs
// 32 T + 128 groups of them a piece. `fast_shared_bytes` in ops/attention.rs mirrors it:
// sizeof(Shared) + STAGES · TILE · head_dim · 4 bytes of the ring (136 960 + 128 head_dim:
// 202 496 at head_dim 512 for the split blocks of one piece; 153 472 + 128 head_dim: 219 008
// with two pieces), sizeof(Shared) alone whole with one piece (140 288).
template <bool WHOLE, u32_t PIECES>
struct Shared {
    static constexpr u32_t R = ROUND<WHOLE, PIECES>;
    static constexpr u32_t GROUPS = MAX_GROUPS / PIECES;
    static constexpr u32_t BLOCK_HEADS = GROUPS * HEADS;
    static constexpr u32_t THREADS = WHOLE || PIECES == 2 ? MAX_THREADS / 2 : MAX_THREADS;
    static constexpr u32_t Q_PIECE = 32 * THREADS + 128 * GROUPS;  // bf16 of a piece of q
    float row_max[BLOCK_HEADS];                                    // per head of the block: the running max,
    float row_sum[BLOCK_HEADS];                                    // the weights' sum
    float rescale[R][BLOCK_HEADS];                                 // and the round's tiles' rescales
    __nv_bfloat16 weights[PIECES][BLOCK_HEADS][R * TILE + 8];      // the pieces of p of the round
    float partial[R][THREADS / 32][HEADS][TILE];                   // each warp's partial scores (partial_col)
    __nv_bfloat16 keys[2][R][PIECES][TILE][ROW_STRIDE];            // the round's keys, double-buffered
    __nv_bfloat16 q[PIECES][Q_PIECE];                              // the block's q rows
    unsigned long long key_addresses[ADDRESS_SLOTS][R * TILE];     // round r's key rows in slot r % 4
};
static_assert(sizeof(Shared<false, 1>) == 136960, "FAST_SHARED_REGIONS in ops/attention.rs");
static_assert(sizeof(Shared<true, 1>) == 140288, "FAST_WHOLE_SHARED_REGIONS in ops/attention.rs");
static_assert(sizeof(Shared<false, 2>) == 153472 && sizeof(Shared<true, 2>) == 153472,
              "FAST_F32_SHARED_REGIONS in ops/attention.rs");
// ldmatrix rows 16-byte aligned (the regions before keys and q fill whole 16 bytes: no padding
// either), and the staging after the regions float4-aligned.
template <bool WHOLE, u32_t PIECES>
constexpr bool aligned_regions() {
    using S = Shared<WHOLE, PIECES>;
    return (sizeof(S::row_max) + sizeof(S::row_sum) + sizeof(S::rescale) + sizeof(S::weights) + sizeof(S::partial)) %
                   16 ==
               0 &&
           sizeof(S::keys) % 16 == 0 && sizeof(S) % 16 == 0;
}
static_assert(aligned_regions<false, 1>() && aligned_regions<true, 1>() && aligned_regions<false, 2>() &&
                  aligned_regions<true, 2>(),
              "16-byte aligned regions");

template <bool WHOLE, u32_t PIECES>
__device__ __forceinline__ Shared<WHOLE, PIECES>& shared_regions() {
    extern __shared__ __align__(16) unsigned char smem[];
    return *reinterpret_cast<Shared<WHOLE, PIECES>*>(smem);
}

// [STAGES][TILE · head_dim / 4]: tile k's keys in f32, as copied, in slot k % STAGES.
template <bool WHOLE, u32_t PIECES>
__device__ __forceinline__ float4* staging() {
    extern __shared__ __align__(16) unsigned char smem[];
    return reinterpret_cast<float4*>(smem + sizeof(Shared<WHOLE, PIECES>));
}

// Four f32 values v as their PIECES bf16 pieces, piece j at at + j · piece_stride (8-byte
// aligned): piece 0 = bf16(v), piece 1 = bf16(v − piece 0), the difference exact in fp32.
template <u32_t PIECES>
__device__ __forceinline__ void store_pieces(__nv_bfloat16* at, u32_t piece_stride, float4 v) {
#pragma unroll
    for (u32_t j = 0; j < PIECES; ++j) {
        const u32_t xy = pack_bf16(v.x, v.y), zw = pack_bf16(v.z, v.w);
        *reinterpret_cast<uint2*>(at + j * piece_stride) = make_uint2(xy, zw);
        if (j + 1 < PIECES) {
            v.x = __fsub_rn(v.x, __uint_as_float(xy << 16));
            v.y = __fsub_rn(v.y, __uint_as_float(xy & 0xffff0000u));
            v.z = __fsub_rn(v.z, __uint_as_float(zw << 16));
            v.w = __fsub_rn(v.w, __uint_as_float(zw & 0xffff0000u));
        }
    }
}

// d += a · b of the operands' pieces (a[j], b[j]: piece j's fragments, b's two registers at
// b[j][r], b[j][r + 1]) in the fixed order of the header: a₁·b₀, a₀·b₁, then a₀·b₀ (one mma with
// one piece).
template <u32_t PIECES, u32_t B_REGS>
__device__ __forceinline__ void mma_pieces(float (&d)[4], const u32_t (&a)[PIECES][4], const u32_t (&b)[PIECES][B_REGS],
                                           u32_t r) {
    if constexpr (PIECES == 2) {
        mma_bf16(d, a[1], b[0][r], b[0][r + 1]);
        mma_bf16(d, a[0], b[1][r], b[1][r + 1]);
    }
    mma_bf16(d, a[0], b[0][r], b[0][r + 1]);
}

// The column of key j in head row h of a warp's partial scores: columns 8..15 and 0..7 swap in
// rows 2, 3, 6, 7, ... so that a warp's float2 stores of its fragments and the softmax's reads
// of two heads' rows are both free of bank conflicts. Only placement: no value changes.
__device__ __forceinline__ u32_t partial_col(u32_t h, u32_t j) { return j ^ ((h & 2u) << 2); }

// Copies this thread's float4 of the tiles of round r (R tiles of the block's `tiles`) into
// staging slots k % STAGES, k = r R .. r R + R - 1, as one copy group (empty past the last tile;
// zero past the list): float4 slot, slot + blockDim.x, ... of each tile's TILE << quad_bits, key
// j of the round at addresses[j].
template <u32_t R>
__device__ __forceinline__ void fetch(float4* stage, u32_t r, u32_t tiles, u32_t keys_left,
                                      const unsigned long long* addresses, const void* any_row, u32_t quad_bits) {
    const u32_t tile_quads = TILE << quad_bits;
#pragma unroll
    for (u32_t i = 0; i < R; ++i) {
        const u32_t k = r * R + i;
        if (k >= tiles) break;
        float4* slot_area = stage + (k % STAGES) * tile_quads;
        for (u32_t slot = threadIdx.x; slot < tile_quads; slot += blockDim.x) {
            const u32_t j = slot >> quad_bits;
            const bool valid = k * TILE + j < keys_left;
            const float4* src = valid ? reinterpret_cast<const float4*>(addresses[i * TILE + j]) +
                                            (slot & ((1u << quad_bits) - 1))
                                      : reinterpret_cast<const float4*>(any_row);  // not read
            cp_async16(&slot_area[slot], src, valid);
        }
    }
    cp_async_commit();
}

// KEYS_IN_REGISTERS: this thread's share of a key tile on its way to its bf16 pieces: float4
// `quad` of the tile's rows row0, row0 + step, ... (its slots threadIdx.x + u · blockDim.x of the
// tile's TILE << quad_bits, as fetch copies them: a block is a whole number of rows, step = 2 ·
// groups), the first HELD of them loaded ahead into registers (all of them in blocks of 32 or 64
// heads: TILE / step = 8 / groups), the rest (blocks of 16 heads) as the tile is stored. Tile k's
// key j at addresses[j].
struct TileShare {
    u32_t quad, row0, step;
    u32_t keys_left;  // from the split's first key on

    __device__ __forceinline__ TileShare(u32_t quad_bits, u32_t keys_left)
        : quad(threadIdx.x & ((1u << quad_bits) - 1)), row0(threadIdx.x >> quad_bits),
          step(blockDim.x >> quad_bits), keys_left(keys_left) {}

    // Row `row` of tile k: zero past the list, as cp.async fills it.
    __device__ __forceinline__ float4 load_row(const unsigned long long* addresses, u32_t k, u32_t row) const {
        return k * TILE + row < keys_left ? __ldg(reinterpret_cast<const float4*>(addresses[row]) + quad)
                                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __device__ __forceinline__ void load(float4 (&held)[HELD], const unsigned long long* addresses, u32_t k) const {
#pragma unroll
        for (u32_t u = 0; u < HELD; ++u) {
            if (u * step >= TILE) break;
            held[u] = load_row(addresses, k, row0 + u * step);
        }
    }
    // The tile's share as its bf16 pieces into `keys` (piece j at keys[j]).
    template <u32_t PIECES>
    __device__ __forceinline__ void store(__nv_bfloat16 (&keys)[PIECES][TILE][ROW_STRIDE], const float4 (&held)[HELD],
                                          const unsigned long long* addresses, u32_t k) const {
#pragma unroll
        for (u32_t u = 0; u < HELD; ++u) {
            if (u * step >= TILE) break;
            store_pieces<PIECES>(&keys[0][row0 + u * step][quad * 4], TILE * ROW_STRIDE, held[u]);
        }
        for (u32_t row = row0 + HELD * step; row < TILE; row += step)
            store_pieces<PIECES>(&keys[0][row][quad * 4], TILE * ROW_STRIDE, load_row(addresses, k, row));
    }
};

// The key addresses of the block's rounds (R tiles), resolved ahead through the two dependent
// loads of a key (its row number, then the row's address) by lanes 0 .. R TILE - 1 of warp 0,
// one key each, so that no fetch waits on them: when round r is fetched (ADDRESS_SLOTS > STAGES /
// R + 1 rounds ahead of its use), its addresses sit in Shared::key_addresses; the address of
// round r + 1 is in flight in `address`, the row of round r + 2 in `row`. advance(r) publishes
// round r's addresses (read after the next barrier) and requests the next two.
template <u32_t R>
struct KeyAddressPipe {
    static constexpr u32_t KEYS = R * TILE;
    const unsigned long long* key_ptrs;
    const u32_t* key_rows;  // from the block's first key on
    u32_t keys_left;
    u32_t row = 0;
    unsigned long long address = 0;

    __device__ __forceinline__ bool valid(u32_t round) const { return round * KEYS + threadIdx.x < keys_left; }
    __device__ __forceinline__ u32_t row_of(u32_t round) const {
        return valid(round) ? key_rows[round * KEYS + threadIdx.x] : 0u;
    }
    // Rounds [0, first) resolved at once, round `first`'s address and round first + 1's row in flight.
    template <class S>
    __device__ __forceinline__ void start(S& sh, u32_t first) {
        if (threadIdx.x >= KEYS) return;
        for (u32_t r = 0; r < first; ++r)
            sh.key_addresses[r % ADDRESS_SLOTS][threadIdx.x] = valid(r) ? key_ptrs[row_of(r)] : 0ull;
        address = valid(first) ? key_ptrs[row_of(first)] : 0ull;
        row = row_of(first + 1);
    }
    // Round r's address (in flight since the last call) to its slot; round r + 1's and r + 2's requested.
    template <class S>
    __device__ __forceinline__ void advance(S& sh, u32_t r) {
        if (threadIdx.x >= KEYS) return;
        sh.key_addresses[r % ADDRESS_SLOTS][threadIdx.x] = address;
        address = valid(r + 1) ? key_ptrs[row] : 0ull;
        row = row_of(r + 2);
    }
};

// Merges a split's statistics (m_s, l_s) into the running (m, l), splits in order: the weights of
// the running values and of the split's, w_old = exp(m - m'), w_new = exp(m_s - m').
__device__ __forceinline__ float2 merge_split(float& m, float& l, float m_s, float l_s) {
    const float merged = fmaxf(m, m_s);
    const float w_old = expf(m - merged), w_new = expf(m_s - merged);
    l = __fadd_rn(__fmul_rn(l, w_old), __fmul_rn(l_s, w_new));
    m = merged;
    return make_float2(w_old, w_new);
}

// A running output o merged with a split's acc by merge_split's weights w.
__device__ __forceinline__ float merge_value(float o, float acc, float2 w) {
    return __fadd_rn(__fmul_rn(o, w.x), __fmul_rn(acc, w.y));
}

// The row-batched entry (sparse_attention.cu: the arguments and the grid): query query0 +
// blockIdx.y of q [queries, heads, head_dim] (f32 storage; bf16 values with one piece), its key j at the address
// key_ptrs[key_rows[row_starts[query] + j]], its split blockIdx.z; this block's heads are
// blockIdx.x · groups · HEADS + [0, groups · HEADS), groups = blockDim.x / (head_dim / 2). A
// query of one split writes out; of several, its split's (m, l, acc) to the split scratch, or
// with WHOLE (grid z = 1) the block runs all its splits and writes out.
template <bool WHOLE, u32_t PIECES>
__device__ void attention(const float* __restrict__ q, const unsigned long long* __restrict__ key_ptrs,
                          const u32_t* __restrict__ key_rows, const u32_t* __restrict__ row_starts,
                          const float* __restrict__ sink, float* __restrict__ out,
                          float* __restrict__ split_acc, float* __restrict__ split_stats, u32_t query0,
                          u32_t max_splits, AttentionParams p) {
    const u32_t query = query0 + blockIdx.y;
    const u32_t first = row_starts[query];
    const u32_t n_keys = row_starts[query + 1] - first;
    const u32_t splits = splits_of(n_keys);
    const u32_t split = WHOLE ? 0u : blockIdx.z;
    if (split >= splits) return;
    using S = Shared<WHOLE, PIECES>;
    constexpr u32_t R = S::R;
    constexpr bool REGISTERS = KEYS_IN_REGISTERS<WHOLE, PIECES>;
    S& sh = shared_regions<WHOLE, PIECES>();
    float4* const stage = staging<WHOLE, PIECES>();  // not with REGISTERS
    const u32_t threads = blockDim.x;
    // head_dim / 64 warps per group and head_dim / 4 float4 per row: powers of two.
    const u32_t dim_bits = __ffs(p.head_dim) - 7, quad_bits = dim_bits + 4;
    const u32_t dim_warps = 1u << dim_bits;
    const u32_t block_heads = (threads >> (5 + dim_bits)) * HEADS;
    const u32_t block_head0 = blockIdx.x * block_heads;
    const u32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32_t g = lane / 4, t = lane % 4;
    const u32_t local0 = (warp >> dim_bits) * HEADS;  // this warp's first head in the block
    const u32_t dim0 = (warp & (dim_warps - 1)) * WARP_DIMS;

    // 0. The first tiles in flight (the ring's two rounds, the registers' one), then q's bf16 pieces
    // (and with registers the first round's keys) and the row statistics.
    const u32_t all_tiles = (n_keys + TILE - 1) / TILE;
    const u32_t first_tile = split * SPLIT_TILES;
    const u32_t tiles = (WHOLE || splits == 1 ? all_tiles : min(all_tiles, first_tile + SPLIT_TILES)) - first_tile;
    const u32_t keys_left = n_keys - first_tile * TILE;  // from the split's first key on
    const u32_t* split_rows = key_rows + first + first_tile * TILE;
    // Rounds of R tiles; the registers or the staging ring hold AHEAD of them in flight.
    constexpr u32_t AHEAD = REGISTERS ? 1 : STAGES / R;
    const u32_t rounds = (tiles + R - 1) / R;
    // Rounds 0 .. AHEAD resolved now (the first fetches' and the loop's first), the next in flight.
    KeyAddressPipe<R> pipe{key_ptrs, split_rows, keys_left};
    pipe.start(sh, AHEAD + 1);
    __syncthreads();  // the first rounds' addresses are in place
    // REGISTERS: tile k's share (TileShare), its addresses in its round's slot, its bf16 pieces in
    // its round's buffer.
    static_assert(!REGISTERS || R == 2, "a round's two tiles go through registers one at a time");
    const TileShare share(quad_bits, keys_left);
    const auto tile_addresses = [&](u32_t k) { return sh.key_addresses[k / R % ADDRESS_SLOTS] + k % R * TILE; };
    const auto load_tile = [&](float4(&held)[HELD], u32_t k) {
        if (k < tiles) share.load(held, tile_addresses(k), k);
    };
    const auto store_tile = [&](const float4(&held)[HELD], u32_t k) {
        if (k < tiles) share.store<PIECES>(sh.keys[k / R & 1][k % R], held, tile_addresses(k), k);
    };
    float4 held[HELD], second[HELD];  // REGISTERS: a tile on its way; the first round's second
    if constexpr (REGISTERS) {
        load_tile(held, 0);
        load_tile(second, 1);
    } else {
#pragma unroll
        for (u32_t r = 0; r < AHEAD; ++r)
            fetch<R>(stage, r, tiles, keys_left, sh.key_addresses[r % ADDRESS_SLOTS], key_ptrs, quad_bits);
    }
    const u32_t q_stride = p.head_dim + 8;  // bf16 between q rows
    {
        const float4* q4 = reinterpret_cast<const float4*>(q + ((size_t)query * p.heads + block_head0) * p.head_dim);
        const u32_t quads = 1u << quad_bits;
#pragma unroll 4
        for (u32_t i = threadIdx.x; i < block_heads << quad_bits; i += threads) {
            const u32_t h = i >> quad_bits, quad = i & (quads - 1);
            const float4 v = block_head0 + h < p.heads ? q4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            store_pieces<PIECES>(&sh.q[0][h * q_stride + quad * 4], S::Q_PIECE, v);
        }
    }
    if constexpr (REGISTERS) {
        store_tile(held, 0);
        store_tile(second, 1);
    }
    if (threadIdx.x < block_heads) {
        sh.row_max[threadIdx.x] = -1e30f;
        sh.row_sum[threadIdx.x] = 0.0f;
    }
    float acc[8][4];
#pragma unroll
    for (u32_t nt = 0; nt < 8; ++nt)
#pragma unroll
        for (u32_t c = 0; c < 4; ++c) acc[nt][c] = 0.0f;
    // WHOLE: the merged splits so far, (m, l) of the thread's heads g and g + 8, and o, from
    // (-1e30, 0, 0) as `combine`'s.
    float merged_m[2] = {-1e30f, -1e30f}, merged_l[2] = {0.0f, 0.0f};
    float merged[8][4];
#pragma unroll
    for (u32_t nt = 0; nt < 8; ++nt)
#pragma unroll
        for (u32_t c = 0; c < 4; ++c) merged[nt][c] = 0.0f;
    const u32_t lo = local0 + g, hi = lo + 8;
    // Merges the split that just ended (its statistics final) into `merged`; the next split
    // starts from zero.
    const auto merge_ended_split = [&]() {
#pragma unroll
        for (u32_t half = 0; half < 2; ++half) {
            const u32_t local = half == 0 ? lo : hi;
            const float2 w = merge_split(merged_m[half], merged_l[half], sh.row_max[local], sh.row_sum[local]);
#pragma unroll
            for (u32_t nt = 0; nt < 8; ++nt)
#pragma unroll
                for (u32_t c = 0; c < 2; ++c) {
                    merged[nt][2 * half + c] = merge_value(merged[nt][2 * half + c], acc[nt][2 * half + c], w);
                    acc[nt][2 * half + c] = 0.0f;
                }
        }
    };

    for (u32_t r = 0; r < rounds; ++r) {
        if (WHOLE && r > 0 && r * R % SPLIT_TILES == 0) {
            // A split ended with the last round (its statistics final since barrier C): merge it,
            // then, once every thread has read them, restart the statistics.
            merge_ended_split();
            __syncthreads();
            if (threadIdx.x < block_heads) {
                sh.row_max[threadIdx.x] = -1e30f;
                sh.row_sum[threadIdx.x] = 0.0f;
            }
        }
        const u32_t k0 = r * R, round_tiles = min(R, tiles - k0);  // the round's first tile, its tiles
        __nv_bfloat16(&keys)[R][PIECES][TILE][ROW_STRIDE] = sh.keys[r & 1];
        // 1. The ring: this thread's float4 of the round's tiles, as their bf16 pieces (zero past the
        // list).
        if constexpr (!REGISTERS) {
            cp_async_wait<AHEAD - 1>();     // round r's group has landed (AHEAD - 1 newer may be pending)
            asm volatile("" ::: "memory");  // and no read of its slots moves above the wait
#pragma unroll
            for (u32_t i = 0; i < R; ++i) {
                if (i >= round_tiles) break;
                const float4* slot_area = stage + ((k0 + i) % STAGES) * (TILE << quad_bits);
                for (u32_t slot = threadIdx.x; slot < TILE << quad_bits; slot += threads) {
                    store_pieces<PIECES>(&keys[i][0][slot >> quad_bits][(slot & ((1u << quad_bits) - 1)) * 4],
                                         TILE * ROW_STRIDE, slot_area[slot]);
                }
            }
        }
        __syncthreads();  // (A) the round's keys (and q) are in place; the last weights were used
        if constexpr (!REGISTERS)
            fetch<R>(stage, r + AHEAD, tiles, keys_left, sh.key_addresses[(r + AHEAD) % ADDRESS_SLOTS], key_ptrs,
                     quad_bits);
        // Round r + AHEAD + 1's addresses, fetched next time round (after barrier A; with registers,
        // loaded from barrier B on); its slot last held round r + AHEAD + 1 - ADDRESS_SLOTS's,
        // fetched or loaded before this round's barrier A.
        if (warp == 0) pipe.advance(sh, r + AHEAD + 1);

        // 2. Partial scores over this warp's dims: per tile [16 heads x 16 keys] as two n-tiles of
        // 8 keys, the round's tiles sharing q's fragments.
        float s[R][2][4];
#pragma unroll
        for (u32_t i = 0; i < R; ++i)
#pragma unroll
            for (u32_t nt = 0; nt < 2; ++nt)
#pragma unroll
                for (u32_t c = 0; c < 4; ++c) s[i][nt][c] = 0.0f;
#pragma unroll
        for (u32_t kp = 0; kp < 2; ++kp) {
            // a[c]: heads g, g + 8 x dims 2t.., 2t + 8.. of k-step kk = 2 kp + c; b: of k-steps 2 kp
            // and 2 kp + 1, key nt 8 + g of tile i. Piece j of each in a[c][j], b[nt][j].
            u32_t a[2][PIECES][4];
#pragma unroll
            for (u32_t c = 0; c < 2; ++c)
#pragma unroll
                for (u32_t j = 0; j < PIECES; ++j)
                    ldmatrix_x4(a[c][j], &sh.q[j][(local0 + lane / 8 % 2 * 8 + lane % 8) * q_stride + dim0 +
                                                  (2 * kp + c) * 16 + lane / 16 * 8]);
#pragma unroll
            for (u32_t i = 0; i < R; ++i) {
                if (i >= round_tiles) break;
                u32_t b[2][PIECES][4];
#pragma unroll
                for (u32_t nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (u32_t j = 0; j < PIECES; ++j)
                        ldmatrix_x4(b[nt][j], &keys[i][j][nt * 8 + lane % 8][dim0 + kp * 32 + lane / 8 * 8]);
#pragma unroll
                for (u32_t c = 0; c < 2; ++c)
#pragma unroll
                    for (u32_t nt = 0; nt < 2; ++nt) mma_pieces<PIECES>(s[i][nt], a[c], b[nt], 2 * c);
            }
        }
        const u32_t swizzle = (g & 2u) << 2;  // partial_col of rows g and g + 8
#pragma unroll
        for (u32_t i = 0; i < R; ++i) {
            if (i >= round_tiles) break;
            float(&partial)[HEADS][TILE] = sh.partial[i][warp];
#pragma unroll
            for (u32_t nt = 0; nt < 2; ++nt) {
                const u32_t col = (nt * 8 + 2 * t) ^ swizzle;
                *reinterpret_cast<float2*>(&partial[g][col]) = make_float2(s[i][nt][0], s[i][nt][1]);
                *reinterpret_cast<float2*>(&partial[g + 8][col]) = make_float2(s[i][nt][2], s[i][nt][3]);
            }
        }
        // REGISTERS: the next round's first tile, loaded over this round's softmax (not over its
        // scores, whose registers are the kernel's most); its addresses in place since the last
        // round's barrier B.
        if constexpr (REGISTERS) load_tile(held, k0 + R);
        __syncthreads();  // (B) every warp's partial scores are in place

        // 3. Online softmax: half-warp per head, lane j = key j of each tile, the round's tiles
        // one after the other; m in every lane's register, l in lane 0's (the header says why).
        for (u32_t pair_index = threadIdx.x; pair_index < block_heads * TILE; pair_index += threads) {
            const u32_t h = pair_index / TILE, j = pair_index % TILE;
            const u32_t local = h % HEADS, col = partial_col(local, j);
            // Head h's partials: warps h / HEADS · dim_warps + w, w in dim order.
            const u32_t warp0 = h / HEADS * dim_warps;
            float row_max = sh.row_max[h], row_sum = sh.row_sum[h];
#pragma unroll
            for (u32_t i = 0; i < R; ++i) {
                if (i >= round_tiles) break;
                // Unrolled (no loop control per score): the same additions in the same order.
                float score = 0.0f;
#pragma unroll
                for (u32_t w = 0; w < MAX_DIM_WARPS; ++w) {
                    if (w >= dim_warps) break;
                    score += sh.partial[i][warp0 + w][local][col];
                }
                score *= p.scale;
                const bool valid = (k0 + i) * TILE + j < keys_left;
                float tile_max = valid ? score : -1e30f;
#pragma unroll
                for (u32_t step = 8; step > 0; step /= 2)
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, step));
                const float new_max = fmaxf(row_max, tile_max);
                const float weight = valid ? expf(score - new_max) : 0.0f;
                float sum = weight;
#pragma unroll
                for (u32_t step = 8; step > 0; step /= 2)
                    sum += __shfl_xor_sync(0xffffffffu, sum, step);
                // p's pieces (bf16(p) alone with one piece), as store_pieces splits.
                const __nv_bfloat16 weight0 = __float2bfloat16_rn(weight);
                sh.weights[0][h][i * TILE + j] = weight0;
                if constexpr (PIECES == 2)
                    sh.weights[1][h][i * TILE + j] = __float2bfloat16_rn(__fsub_rn(weight, __bfloat162float(weight0)));
                if (j == 0) {
                    const float rescale = expf(row_max - new_max);
                    sh.rescale[i][h] = rescale;
                    row_sum = row_sum * rescale + sum;
                }
                row_max = new_max;
            }
            __syncwarp();  // every lane has read the statistics
            if (j == 0) {
                sh.row_max[h] = row_max;
                sh.row_sum[h] = row_sum;
            }
        }
        // REGISTERS: the next round's first tile into the other buffer (its readers, the last
        // round's, all passed barrier A); its second loaded over this round's outputs.
        if constexpr (REGISTERS) {
            store_tile(held, k0 + R);
            load_tile(held, k0 + R + 1);
        }
        __syncthreads();  // (C) the round's weights and rescales are in place

        // 4. Outputs, tile by tile: acc = acc * rescale + p · V over this warp's 64 dims (8
        // n-tiles), p's and V's pieces (bf16(p) · V with one piece).
#pragma unroll
        for (u32_t i = 0; i < R; ++i) {
            if (i >= round_tiles) break;
            const float rescale_lo = sh.rescale[i][lo], rescale_hi = sh.rescale[i][hi];
            u32_t pa[PIECES][4];
#pragma unroll
            for (u32_t j = 0; j < PIECES; ++j) {
                pa[j][0] = *reinterpret_cast<const u32_t*>(&sh.weights[j][lo][i * TILE + 2 * t]);
                pa[j][1] = *reinterpret_cast<const u32_t*>(&sh.weights[j][hi][i * TILE + 2 * t]);
                pa[j][2] = *reinterpret_cast<const u32_t*>(&sh.weights[j][lo][i * TILE + 2 * t + 8]);
                pa[j][3] = *reinterpret_cast<const u32_t*>(&sh.weights[j][hi][i * TILE + 2 * t + 8]);
            }
#pragma unroll
            for (u32_t np = 0; np < 4; ++np) {
                // b0, b1 of n-tiles 2 np and 2 np + 1: keys 2t.. and 2t + 8.., dim 8 nt + g.
                u32_t bv[PIECES][4];
#pragma unroll
                for (u32_t j = 0; j < PIECES; ++j)
                    ldmatrix_x4_trans(bv[j], &keys[i][j][lane / 8 % 2 * 8 + lane % 8][dim0 + (2 * np + lane / 16) * 8]);
#pragma unroll
                for (u32_t c = 0; c < 2; ++c) {
                    const u32_t nt = 2 * np + c;
                    acc[nt][0] *= rescale_lo;
                    acc[nt][1] *= rescale_lo;
                    acc[nt][2] *= rescale_hi;
                    acc[nt][3] *= rescale_hi;
                    mma_pieces<PIECES>(acc[nt], pa, bv, 2 * c);
                }
            }
        }
        if constexpr (REGISTERS) store_tile(held, k0 + R + 1);
    }
    __syncthreads();  // the row statistics of the last round are final

    const size_t width = (size_t)p.heads * p.head_dim;
    const u32_t head0 = block_head0 + local0;
    if (!WHOLE && splits > 1) {
        // This split's (m, l, acc) for `combine`.
        const size_t slot = (size_t)blockIdx.y * max_splits + split;
#pragma unroll
        for (u32_t half = 0; half < 2; ++half) {
            const u32_t h = head0 + g + 8 * half;
            if (h >= p.heads) continue;
            const u32_t local = local0 + g + 8 * half;
            float* acc_h = split_acc + slot * width + (size_t)h * p.head_dim;
#pragma unroll
            for (u32_t nt = 0; nt < 8; ++nt) {
                const u32_t d = dim0 + nt * 8 + 2 * t;
                *reinterpret_cast<float2*>(&acc_h[d]) =
                    make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]);
            }
            if (dim0 == 0 && t == 0) {
                float* stats = split_stats + (slot * p.heads + h) * 2;
                stats[0] = sh.row_max[local];
                stats[1] = sh.row_sum[local];
            }
        }
        return;
    }

    // out = acc / (l + exp(sink - m)), rounded to bf16 with one piece (the V4.1 rounding point),
    // the f32 value with two; with WHOLE and several splits, the last one merged,
    // out = o / (L + exp(sink - M)) as `combine` writes it.
    const bool merging = WHOLE && splits > 1;
    if (merging) merge_ended_split();
#pragma unroll
    for (u32_t half = 0; half < 2; ++half) {
        const u32_t h = head0 + g + 8 * half;
        if (h >= p.heads) continue;
        const u32_t local = local0 + g + 8 * half;
        const float l = merging ? merged_l[half] : sh.row_sum[local];
        const float m = merging ? merged_m[half] : sh.row_max[local];
        const float denominator = l + expf(sink[h] - m);
        float* out_h = out + query * width + (size_t)h * p.head_dim;
#pragma unroll
        for (u32_t nt = 0; nt < 8; ++nt) {
            const u32_t d = dim0 + nt * 8 + 2 * t;
            const float o0 = merging ? merged[nt][2 * half] : acc[nt][2 * half];
            const float o1 = merging ? merged[nt][2 * half + 1] : acc[nt][2 * half + 1];
            *reinterpret_cast<float2*>(&out_h[d]) =
                make_float2(store_f32<float, PIECES == 1>(o0 / denominator), store_f32<float, PIECES == 1>(o1 / denominator));
        }
    }
}

// Merges dims [4 quad, 4 quad + 4) of head `h` of a query of `splits` > 1 splits (stride `heads`
// split results apart in `acc` / `stats`, as `attention` wrote them) into out [heads, head_dim]:
// merge_split in split order from (-1e30, 0, 0), the first split's o from zero as the WHOLE
// block's; out = o / (L + exp(sink - M)), rounded to bf16 when p.round_bf16 (the launches of one
// piece: `attention`'s own rounding). A thread computes the weights once for its four outputs.
__device__ void combine(const float* __restrict__ acc, const float* __restrict__ stats, u32_t splits,
                        u32_t h, u32_t quad, float sink, float* __restrict__ out, AttentionParams p) {
    const size_t split_quads = (size_t)p.heads * p.head_dim / 4;
    const size_t split_stats = (size_t)p.heads * 2;
    const float* st = stats + 2 * h;
    const float4* a = reinterpret_cast<const float4*>(acc) + (size_t)h * (p.head_dim / 4) + quad;
    float m = -1e30f, l = 0.0f;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (u32_t s = 0; s < splits; ++s) {
        const float2 w = merge_split(m, l, st[s * split_stats], st[s * split_stats + 1]);
        const float4 v = a[s * split_quads];
        o.x = merge_value(o.x, v.x, w);
        o.y = merge_value(o.y, v.y, w);
        o.z = merge_value(o.z, v.z, w);
        o.w = merge_value(o.w, v.w, w);
    }
    const float denominator = l + expf(sink - m);
    o = make_float4(o.x / denominator, o.y / denominator, o.z / denominator, o.w / denominator);
    if (p.round_bf16) o = make_float4(round_bf16_f32(o.x), round_bf16_f32(o.y), round_bf16_f32(o.z), round_bf16_f32(o.w));
    *reinterpret_cast<float4*>(out + (size_t)h * p.head_dim + 4 * quad) = o;
}

}  // namespace fast_attention
