//! The Engram table: FP8 E4M3 rows with one UE8M0 scale per 32 channels, gathered by row id and
//! dequantised to bf16 (`fp32(code) · 2^(e−127)`, rounded to bf16).

use crate::error::ModelError;
use crate::quant::{e4m3_table, round_bf16};
use crate::weights::e8m0_to_f32;

/// Channels per table scale (the checkpoint's FP8 block size).
pub const TABLE_SCALE_GROUP: usize = 32;

/// One engram layer's table, `[rows, head_dim]` E4M3 codes and `[rows, head_dim / 32]` UE8M0
/// scales, both row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngramTable {
    rows: usize,
    head_dim: usize,
    codes: Vec<u8>,
    scales: Vec<u8>,
}

impl EngramTable {
    /// Checks the buffer sizes against `rows × head_dim`; `tensor` names the table in errors.
    pub fn new(
        tensor: &str,
        rows: usize,
        head_dim: usize,
        codes: Vec<u8>,
        scales: Vec<u8>,
    ) -> Result<EngramTable, ModelError> {
        let bad = |message: String| ModelError::Checkpoint {
            file: std::path::PathBuf::new(),
            tensor: tensor.to_string(),
            message,
        };
        if head_dim == 0 || !head_dim.is_multiple_of(TABLE_SCALE_GROUP) {
            return Err(bad(format!(
                "head_dim {head_dim} is not a positive multiple of {TABLE_SCALE_GROUP}"
            )));
        }
        if codes.len() != rows * head_dim {
            return Err(bad(format!(
                "expected {rows}×{head_dim} E4M3 codes, found {}",
                codes.len()
            )));
        }
        let groups = head_dim / TABLE_SCALE_GROUP;
        if scales.len() != rows * groups {
            return Err(bad(format!(
                "expected {rows}×{groups} E8M0 scales, found {}",
                scales.len()
            )));
        }
        Ok(EngramTable {
            rows,
            head_dim,
            codes,
            scales,
        })
    }

    /// Table rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Channels per row.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The E4M3 codes, `[rows, head_dim]` row-major (what a device backend uploads).
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// The UE8M0 scales, `[rows, head_dim / 32]` row-major.
    pub fn scales(&self) -> &[u8] {
        &self.scales
    }

    /// Writes the bf16 rows `row_ids` one after another into `out` (`row_ids.len() · head_dim`
    /// values). A row id outside the table gives zeros, as a table shard does for rows it does not
    /// hold.
    pub fn gather(&self, row_ids: &[u32], out: &mut [f32]) {
        let decode = e4m3_table();
        let groups = self.head_dim / TABLE_SCALE_GROUP;
        for (&row, dst) in row_ids.iter().zip(out.chunks_exact_mut(self.head_dim)) {
            let row = row as usize;
            if row >= self.rows {
                dst.fill(0.0);
                continue;
            }
            let codes = &self.codes[row * self.head_dim..(row + 1) * self.head_dim];
            let scales = &self.scales[row * groups..(row + 1) * groups];
            for ((dst, codes), &scale) in dst
                .chunks_exact_mut(TABLE_SCALE_GROUP)
                .zip(codes.chunks_exact(TABLE_SCALE_GROUP))
                .zip(scales)
            {
                let scale = e8m0_to_f32(scale);
                for (value, &code) in dst.iter_mut().zip(codes) {
                    *value = round_bf16(decode[usize::from(code)] * scale);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_dequantises_per_group_and_zeroes_foreign_rows() -> Result<(), ModelError> {
        // 2 rows × 64 channels; row 1 has code 0x38 (1.0) in group 0 and 0xb4 (−0.75) in group 1.
        let mut codes = vec![0_u8; 128];
        codes[64..96].fill(0x38);
        codes[96..128].fill(0xb4);
        let scales = vec![127, 127, 130, 120];
        let table = EngramTable::new("t", 2, 64, codes, scales)?;
        let mut out = vec![f32::NAN; 3 * 64];
        table.gather(&[1, 7, 0], &mut out);
        assert!(out[..32].iter().all(|&v| v == 8.0));
        assert!(out[32..64].iter().all(|&v| v == -0.75 / 128.0));
        assert!(out[64..].iter().all(|&v| v == 0.0));
        assert!(EngramTable::new("t", 2, 64, vec![0; 127], vec![0; 4]).is_err());
        assert!(EngramTable::new("t", 2, 48, vec![0; 96], vec![0; 2]).is_err());
        Ok(())
    }
}
