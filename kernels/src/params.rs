//! `#[repr(C)]` launch parameters, field for field the structs of `cuda/common/params.h`.

use cudarc::driver::DeviceRepr;

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

// SAFETY: each struct is #[repr(C)], holds only u32/f32 fields (no padding, no pointers) and matches
// its C counterpart in params.h field for field, so passing it by value to a kernel is sound.
unsafe impl DeviceRepr for ActQuantParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for GemmParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for RmsNormParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for RopeParams {}

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
        assert_eq!(size_of::<RmsNormParams>(), 12);
        assert_eq!(offset_of!(RmsNormParams, eps), 8);
        assert_eq!(size_of::<RopeParams>(), 24);
        assert_eq!(offset_of!(RopeParams, inverse), 20);
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
    }
}
