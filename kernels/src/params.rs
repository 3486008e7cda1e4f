//! `#[repr(C)]` launch parameters, field for field the structs of `cuda/common/params.h`.

use crate::runtime::KernelValue;

/// `ActQuantParams`: x `[rows, cols]` -> codes `[rows, cols]`, scales `[rows, cols / group]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActQuantParams {
    pub rows: u32,
    pub cols: u32,
}

/// `GemmParams`: `y[m, n] = a[m, k] · w[n, k]ᵀ`; `w_scale_cols` is the weight-scale row stride.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmParams {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub w_scale_cols: u32,
    /// 1, 2, 4 or 8: warps that share one output column's K range (no effect on the result).
    pub warps_per_col: u32,
}

/// `FastGemmParams`: the fast FP8 / FP4 GEMM's `y[m, n] = a[m, k] · w[n, k]ᵀ`, K cut into
/// `parts` spans of `span` codes; `y` stored as `store` says (`ops::gemm_fast::FastOutput`);
/// `projections` weights of one shape (1, or 2: grid z = plane · parts + part, weight `p` into
/// plane `p` of `y`, `[p][m][n]`); `folded` 1 when each block adds all the parts of its outputs
/// (grid z = plane; the 128-row tiles only), 0 for a block per part.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastGemmParams {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub span: u32,
    pub parts: u32,
    pub store: u32,
    pub projections: u32,
    pub folded: u32,
}

/// `FastReduceParams`: the fast GEMM's part sums added in part order, stored as `store` says.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastReduceParams {
    pub count: u32,
    pub parts: u32,
    pub store: u32,
}

/// `FastRoutedParams`: the fast routed-expert GEMM, output row `j < m` = x row `j / x_row_div`
/// times the `which` weight (0 w1, 1 w3, 2 w2) of its expert in a table of `n_experts`; K cut
/// into `parts` spans of `span` codes as in [`FastGemmParams`] (production: one part);
/// `projections` consecutive table slots from `which` (1, or 2 for w1 and w3 in one launch, in
/// one K part: grid z picks the slot, slot `s` stored at plane `s` of `y`, `[s][m][n]`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastRoutedParams {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub span: u32,
    pub parts: u32,
    pub x_row_div: u32,
    pub n_experts: u32,
    pub which: u32,
    pub store: u32,
    pub projections: u32,
}

/// `RmsNormParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormParams {
    pub rows: u32,
    pub cols: u32,
    pub eps: f32,
}

/// `RopeParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeParams {
    pub tokens: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub rope_dim: u32,
    pub table_rows: u32,
    pub inverse: u32,
}

/// `RopeQdqParams`: RMSNorm (optional), RoPE and a QDQ point over rows.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeQdqParams {
    pub rows: u32,
    pub cols: u32,
    pub stride: u32,
    pub rope_dim: u32,
    pub table_rows: u32,
    pub inverse: u32,
    pub eps: f32,
}

/// `QdqParams`: in-place QDQ over `n` values.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QdqParams {
    pub n: u32,
}

/// `LinearParams`: `y[rows, out] = x[rows, inp] · w[out, inp]ᵀ`; `round_bf16` is 0 or 1.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearParams {
    pub rows: u32,
    pub out: u32,
    pub inp: u32,
    pub round_bf16: u32,
}

/// `LinearReduceParams`: the fast linear's part sums added in part order, rounded to bf16 (kept
/// in f32) when `round_bf16` is 1.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearReduceParams {
    pub count: u32,
    pub round_bf16: u32,
}

/// `AttentionParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    pub heads: u32,
    pub head_dim: u32,
    pub keys: u32,
    pub scale: f32,
    pub round_bf16: u32,
}

/// `HcMixesParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcMixesParams {
    pub hc: u32,
    pub n: u32,
    pub sinkhorn_iters: u32,
    pub hc_eps: f32,
    pub norm_eps: f32,
}

/// `HcElementwiseParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HcElementwiseParams {
    pub hc: u32,
    pub dim: u32,
    pub round_bf16: u32,
}

/// `IndexParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexParams {
    pub heads: u32,
    pub head_dim: u32,
    pub keys: u32,
    pub round_bf16: u32,
    /// Keys per block (`ops::index::IndexTile`).
    pub tile_keys: u32,
    /// Heads staged in shared memory at a time.
    pub head_chunk: u32,
}

/// `DequantParams`: rows `[row_start, row_start + rows)` of a `[n, k]` weight.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DequantParams {
    pub row_start: u32,
    pub rows: u32,
    pub k: u32,
    pub tile: u32,
    pub scale_cols: u32,
}

// SAFETY: each struct is #[repr(C)], holds only u32/f32 fields (no padding, no pointers) and matches
// its C counterpart in params.h field for field, so passing it by value to a kernel is sound.
unsafe impl KernelValue for ActQuantParams {}
// SAFETY: as above.
unsafe impl KernelValue for GemmParams {}
// SAFETY: as above.
unsafe impl KernelValue for FastGemmParams {}
// SAFETY: as above.
unsafe impl KernelValue for FastReduceParams {}
// SAFETY: as above.
unsafe impl KernelValue for LinearReduceParams {}
// SAFETY: as above.
unsafe impl KernelValue for FastRoutedParams {}
// SAFETY: as above.
unsafe impl KernelValue for RmsNormParams {}
// SAFETY: as above.
unsafe impl KernelValue for RopeParams {}
// SAFETY: as above.
unsafe impl KernelValue for RopeQdqParams {}
// SAFETY: as above.
unsafe impl KernelValue for QdqParams {}
// SAFETY: as above.
unsafe impl KernelValue for LinearParams {}
// SAFETY: as above.
unsafe impl KernelValue for AttentionParams {}
// SAFETY: as above.
unsafe impl KernelValue for HcMixesParams {}
// SAFETY: as above.
unsafe impl KernelValue for HcElementwiseParams {}
// SAFETY: as above.
unsafe impl KernelValue for IndexParams {}
// SAFETY: as above.
unsafe impl KernelValue for DequantParams {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::assert_mirrors;
    use std::mem::offset_of;

    /// Each struct has the size and the fields, in order, of its namesake in params.h (u32/float
    /// fields, 4 bytes each, no padding).
    #[test]
    fn params_mirror_params_h() {
        let header = include_str!("../cuda/common/params.h");
        assert_mirrors::<ActQuantParams>(header, 8, &["rows", "cols"]);
        assert_mirrors::<GemmParams>(
            header,
            20,
            &["m", "n", "k", "w_scale_cols", "warps_per_col"],
        );
        assert_mirrors::<FastGemmParams>(
            header,
            32,
            &[
                "m",
                "n",
                "k",
                "span",
                "parts",
                "store",
                "projections",
                "folded",
            ],
        );
        assert_mirrors::<FastReduceParams>(header, 12, &["count", "parts", "store"]);
        assert_mirrors::<LinearReduceParams>(header, 8, &["count", "round_bf16"]);
        assert_mirrors::<FastRoutedParams>(
            header,
            40,
            &[
                "m",
                "n",
                "k",
                "span",
                "parts",
                "x_row_div",
                "n_experts",
                "which",
                "store",
                "projections",
            ],
        );
        assert_mirrors::<RmsNormParams>(header, 12, &["rows", "cols", "eps"]);
        assert_mirrors::<RopeParams>(
            header,
            24,
            &[
                "tokens",
                "heads",
                "head_dim",
                "rope_dim",
                "table_rows",
                "inverse",
            ],
        );
        assert_mirrors::<RopeQdqParams>(
            header,
            28,
            &[
                "rows",
                "cols",
                "stride",
                "rope_dim",
                "table_rows",
                "inverse",
                "eps",
            ],
        );
        assert_mirrors::<QdqParams>(header, 4, &["n"]);
        assert_mirrors::<LinearParams>(header, 16, &["rows", "out", "inp", "round_bf16"]);
        assert_mirrors::<AttentionParams>(
            header,
            20,
            &["heads", "head_dim", "keys", "scale", "round_bf16"],
        );
        assert_mirrors::<HcMixesParams>(
            header,
            20,
            &["hc", "n", "sinkhorn_iters", "hc_eps", "norm_eps"],
        );
        assert_mirrors::<HcElementwiseParams>(header, 12, &["hc", "dim", "round_bf16"]);
        assert_mirrors::<IndexParams>(
            header,
            24,
            &[
                "heads",
                "head_dim",
                "keys",
                "round_bf16",
                "tile_keys",
                "head_chunk",
            ],
        );
        assert_mirrors::<DequantParams>(
            header,
            20,
            &["row_start", "rows", "k", "tile", "scale_cols"],
        );
    }

    /// The Rust fields stand in the C order where a swap would keep the size.
    #[test]
    fn rust_fields_sit_at_their_c_offsets() {
        assert_eq!(offset_of!(GemmParams, warps_per_col), 16);
        assert_eq!(offset_of!(GemmParams, w_scale_cols), 12);
        assert_eq!(offset_of!(FastGemmParams, store), 20);
        assert_eq!(offset_of!(FastGemmParams, projections), 24);
        assert_eq!(offset_of!(FastGemmParams, folded), 28);
        assert_eq!(offset_of!(FastReduceParams, store), 8);
        assert_eq!(offset_of!(FastRoutedParams, store), 32);
        assert_eq!(offset_of!(FastRoutedParams, projections), 36);
        assert_eq!(offset_of!(RmsNormParams, eps), 8);
        assert_eq!(offset_of!(RopeParams, inverse), 20);
        assert_eq!(offset_of!(RopeQdqParams, eps), 24);
        assert_eq!(offset_of!(LinearParams, round_bf16), 12);
        assert_eq!(offset_of!(LinearReduceParams, round_bf16), 4);
        assert_eq!(offset_of!(AttentionParams, scale), 12);
        assert_eq!(offset_of!(HcMixesParams, norm_eps), 16);
        assert_eq!(offset_of!(IndexParams, head_chunk), 20);
    }
}
