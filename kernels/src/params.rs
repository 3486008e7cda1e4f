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
/// `parts` spans of `span` codes; `y` stored as `store` says (`ops::gemm_fast::FastStore`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastGemmParams {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub span: u32,
    pub parts: u32,
    pub store: u32,
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
    use std::mem::{offset_of, size_of};

    /// The C layouts in params.h: u32/float fields, 4 bytes each, no padding.
    #[test]
    fn layouts_match_params_h() {
        assert_eq!(size_of::<ActQuantParams>(), 8);
        assert_eq!(size_of::<GemmParams>(), 20);
        assert_eq!(offset_of!(GemmParams, warps_per_col), 16);
        assert_eq!(offset_of!(GemmParams, w_scale_cols), 12);
        assert_eq!(size_of::<FastGemmParams>(), 24);
        assert_eq!(offset_of!(FastGemmParams, store), 20);
        assert_eq!(size_of::<FastReduceParams>(), 12);
        assert_eq!(offset_of!(FastReduceParams, store), 8);
        assert_eq!(size_of::<FastRoutedParams>(), 40);
        assert_eq!(offset_of!(FastRoutedParams, store), 32);
        assert_eq!(offset_of!(FastRoutedParams, projections), 36);
        assert_eq!(size_of::<RmsNormParams>(), 12);
        assert_eq!(offset_of!(RmsNormParams, eps), 8);
        assert_eq!(size_of::<RopeParams>(), 24);
        assert_eq!(offset_of!(RopeParams, inverse), 20);
        assert_eq!(size_of::<QdqParams>(), 4);
        assert_eq!(size_of::<LinearParams>(), 16);
        assert_eq!(offset_of!(LinearParams, round_bf16), 12);
        assert_eq!(size_of::<LinearReduceParams>(), 8);
        assert_eq!(offset_of!(LinearReduceParams, round_bf16), 4);
        assert_eq!(size_of::<AttentionParams>(), 20);
        assert_eq!(offset_of!(AttentionParams, scale), 12);
        assert_eq!(size_of::<HcMixesParams>(), 20);
        assert_eq!(offset_of!(HcMixesParams, norm_eps), 16);
        assert_eq!(size_of::<HcElementwiseParams>(), 12);
        assert_eq!(size_of::<IndexParams>(), 24);
        assert_eq!(offset_of!(IndexParams, head_chunk), 20);
        assert_eq!(size_of::<DequantParams>(), 20);
    }

    #[test]
    fn params_h_declares_the_same_fields_in_order() {
        let header = include_str!("../cuda/common/params.h");
        let fields = |name: &str| -> Vec<String> {
            let start = header
                .find(&format!("struct {name} {{"))
                .expect("struct in params.h");
            let body = &header[start
                ..header[start..]
                    .find("};")
                    .map(|e| start + e)
                    .expect("struct end")];
            // Each field line is `type name;  // comment`: the name is the last word before ';'.
            body.lines()
                .skip(1)
                .filter_map(|line| line.split_once(';').map(|(decl, _)| decl))
                .filter_map(|decl| decl.split_whitespace().last().map(str::to_string))
                .collect()
        };
        assert_eq!(fields("ActQuantParams"), ["rows", "cols"]);
        assert_eq!(
            fields("GemmParams"),
            ["m", "n", "k", "w_scale_cols", "warps_per_col"]
        );
        assert_eq!(
            fields("FastGemmParams"),
            ["m", "n", "k", "span", "parts", "store"]
        );
        assert_eq!(fields("FastReduceParams"), ["count", "parts", "store"]);
        assert_eq!(fields("LinearReduceParams"), ["count", "round_bf16"]);
        assert_eq!(
            fields("FastRoutedParams"),
            [
                "m",
                "n",
                "k",
                "span",
                "parts",
                "x_row_div",
                "n_experts",
                "which",
                "store",
                "projections"
            ]
        );
        assert_eq!(fields("RmsNormParams"), ["rows", "cols", "eps"]);
        assert_eq!(
            fields("RopeParams"),
            [
                "tokens",
                "heads",
                "head_dim",
                "rope_dim",
                "table_rows",
                "inverse"
            ]
        );
        assert_eq!(fields("QdqParams"), ["n"]);
        assert_eq!(fields("LinearParams"), ["rows", "out", "inp", "round_bf16"]);
        assert_eq!(
            fields("AttentionParams"),
            ["heads", "head_dim", "keys", "scale", "round_bf16"]
        );
        assert_eq!(
            fields("HcMixesParams"),
            ["hc", "n", "sinkhorn_iters", "hc_eps", "norm_eps"]
        );
        assert_eq!(fields("HcElementwiseParams"), ["hc", "dim", "round_bf16"]);
        assert_eq!(
            fields("IndexParams"),
            [
                "heads",
                "head_dim",
                "keys",
                "round_bf16",
                "tile_keys",
                "head_chunk"
            ]
        );
        assert_eq!(
            fields("DequantParams"),
            ["row_start", "rows", "k", "tile", "scale_cols"]
        );
    }
}
