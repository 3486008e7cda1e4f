// Launch parameters shared with Rust. Each struct is mirrored field for field by a #[repr(C)]
// struct in kernels/src/params.rs; change both together (the GPU test checks their sizes).
#pragma once

typedef unsigned char u8_t;
typedef unsigned short u16_t;
typedef unsigned int u32_t;

// FP8 activation quantisation: x [rows, cols] bf16 -> codes [rows, cols] e4m3, scales [rows, cols/G] f32.
struct ActQuantParams {
    u32_t rows;
    u32_t cols;
};

// Block-scaled GEMM: y[m, n] = sum_k a[m, k] * w[n, k]; a [m, k] e4m3 codes + f32 scales [m, k/G];
// w [n, k] (FP8: e4m3 bytes, FP4: packed e2m1 nibbles [n, k/2]) + e8m0 scales; y [m, n] bf16.
struct GemmParams {
    u32_t m;
    u32_t n;
    u32_t k;
    u32_t w_scale_cols;   // columns of the weight-scale matrix (row stride, in bytes)
    u32_t warps_per_col;  // 1, 2, 4 or 8 warps share a column's K range (no effect on the result)
};

// The fast FP8 / FP4 GEMM (gemm/gemm_fast.cuh): y[m, n] = sum_k a[m, k] * w[n, k] on tensor cores,
// K cut into `parts` spans of `span` codes (the last one shorter); y stored as `store` says;
// `projections` weights of one shape (1, or 2: w0 and w1 into planes [2][m][n] of y); `folded`:
// 1 when each block adds all the parts of its outputs (the 128-row tiles only), 0 for a block per
// part.
struct FastGemmParams {
    u32_t m;
    u32_t n;
    u32_t k;
    u32_t span;
    u32_t parts;
    u32_t store;        // y: 0 bf16, 1 f32 as summed, 2 f32 of the bf16-rounded value (gemm_fast.cuh)
    u32_t projections;  // weights, one plane of y each
    u32_t folded;       // 1: a block per plane over all parts (gemm_fast_dense)
};

// The fast GEMM's part sums added in part order: y[i] = sum_p partials[p][i], i < count, stored
// as FastGemmParams::store says.
struct FastReduceParams {
    u32_t count;
    u32_t parts;
    u32_t store;
};

// The fast routed-expert GEMM (gemm/gemm_fast.cuh): output row j < m = x row j / x_row_div times
// the `which` weight (0 w1, 1 w3, 2 w2) of its expert in a table of n_experts, [n, k]; K cut into
// `parts` spans of `span` codes as FastGemmParams (production: one part, span = k).
struct FastRoutedParams {
    u32_t m;
    u32_t n;
    u32_t k;
    u32_t span;
    u32_t parts;
    u32_t x_row_div;
    u32_t n_experts;
    u32_t which;
    u32_t store;        // y as FastGemmParams::store says
    u32_t projections;  // table slots from `which` (1; 2: w1 and w3, planes [2][m][n] of y)
};

// RMSNorm over the last axis: x [rows, cols] bf16, w [cols] bf16 -> y [rows, cols] bf16.
struct RmsNormParams {
    u32_t rows;
    u32_t cols;
    float eps;
};

// Interleaved-pair partial RoPE, in place on x [tokens, heads, head_dim] bf16 (row stride
// heads*head_dim): the pairs (2i, 2i+1) of the last rope_dim channels of every head are rotated by
// the angle table cos/sin [table_rows, rope_dim/2] f32 at row positions[token].
struct RopeParams {
    u32_t tokens;
    u32_t heads;
    u32_t head_dim;
    u32_t rope_dim;
    u32_t table_rows;
    u32_t inverse;  // 1: rotate by -angle (the de-rotation of attention outputs)
};

// RMSNorm (optional), RoPE and a QDQ point over rows of cols values (rope/rope_qdq.cuh): the last
// rope_dim channels of every stride-wide vector rotated by the row's position.
struct RopeQdqParams {
    u32_t rows;
    u32_t cols;
    u32_t stride;
    u32_t rope_dim;
    u32_t table_rows;
    u32_t inverse;  // 1: rotate by -angle
    float eps;      // the norm's (unused without one)
};

// In-place QDQ over a flat f32 buffer of n values, in consecutive groups (the last may be short).
struct QdqParams {
    u32_t n;
};

// y[rows, out] = x[rows, inp] . w[out, inp]^T in the CPU sgemm order; round_bf16 = 1 rounds y.
struct LinearParams {
    u32_t rows;
    u32_t out;
    u32_t inp;
    u32_t round_bf16;
};

// The fast linear's part sums added in part order: y[i] = sum_p partials[p][i], i < count,
// rounded to bf16 (kept in f32 storage) when round_bf16.
struct LinearReduceParams {
    u32_t count;
    u32_t round_bf16;
};

// Sink attention: q [heads, head_dim], keys [keys, head_dim], out [heads, head_dim] per query
// (the row-batched kernel: keys = rows of the shared key buffer, each query lists its own rows).
struct AttentionParams {
    u32_t heads;
    u32_t head_dim;
    u32_t keys;
    float scale;
    u32_t round_bf16;  // 1: probabilities and outputs rounded to bf16 (V4.1); 0: fp32
};

// mHC mixes of one token: x [hc * dim] = n values, proj [(2 + hc) * hc, n].
struct HcMixesParams {
    u32_t hc;
    u32_t n;
    u32_t sinkhorn_iters;
    float hc_eps;
    float norm_eps;
};

// mHC collapse / expand over hc streams of dim values.
struct HcElementwiseParams {
    u32_t hc;
    u32_t dim;
    u32_t round_bf16;  // 1: outputs rounded to bf16; 0: fp32
};

// Indexer scores: q [heads, head_dim], w [heads], keys [keys, head_dim] -> scores [keys] per query
// (the row-batched kernel: each query scores its own prefix of the keys).
struct IndexParams {
    u32_t heads;
    u32_t head_dim;
    u32_t keys;
    u32_t round_bf16;  // 1: the reference's bf16 rounding points; 0: fp32 throughout
    u32_t tile_keys;   // keys per block
    u32_t head_chunk;  // heads staged in shared memory at a time
};

// Rows [row_start, row_start + rows) of a block-scaled weight [n, k] dequantised to f32
// out [rows, k]: FP8 (tile x tile UE8M0 scales, scale_cols per scale row) or FP4 (1 x 32 scales).
struct DequantParams {
    u32_t row_start;
    u32_t rows;
    u32_t k;
    u32_t tile;
    u32_t scale_cols;
};
