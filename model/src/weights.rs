//! Block-quantised weight matrices exactly as stored in a V4.1 checkpoint (spec §6.3): FP8 E4M3
//! weights with one UE8M0 scale per `block × block` tile, and packed FP4 E2M1 expert weights with one
//! UE8M0 scale per 1×32 group. The GEMMs that consume them live in `quant.rs`; the dequantisers here
//! are the plain definition, for tests and for weights the reference expands at load time.

/// Elements per FP4 scale group along the input dimension.
pub const FP4_GROUP: usize = 32;

/// The 8 non-negative E2M1 magnitudes, indexed by the low 3 bits of a nibble (bit 3 is the sign).
const E2M1_MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Decodes one FP8 E4M3 (OCP "fn" variant: no infinities, 0x7f/0xff are NaN) byte.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exponent = i32::from((byte >> 3) & 0x0f);
    let mantissa = f32::from(byte & 0x07);
    if exponent == 0x0f && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exponent == 0 {
        mantissa / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(exponent - 7)
    };
    sign * magnitude
}

/// Decodes one UE8M0 scale byte: `2^(e - 127)`; 255 is NaN.
pub fn e8m0_to_f32(byte: u8) -> f32 {
    if byte == 0xff {
        f32::NAN
    } else {
        2f32.powi(i32::from(byte) - 127)
    }
}

/// Decodes one FP4 E2M1 nibble (bit 3 = sign).
pub fn e2m1_to_f32(nibble: u8) -> f32 {
    let magnitude = E2M1_MAGNITUDES[usize::from(nibble & 0x07)];
    if nibble & 0x08 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// A dense FP8 weight `[out, inp]` (row-major E4M3 bytes) with UE8M0 scales
/// `[ceil(out/block), ceil(inp/block)]` (row-major), one per `block × block` tile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Weight {
    pub out: usize,
    pub inp: usize,
    pub block: usize,
    /// E4M3 bytes, `out * inp`.
    pub data: Vec<u8>,
    /// UE8M0 bytes, `scale_rows() * scale_cols()`.
    pub scales: Vec<u8>,
}

impl Fp8Weight {
    /// Scale rows: `ceil(out / block)`.
    pub fn scale_rows(&self) -> usize {
        self.out.div_ceil(self.block)
    }

    /// Scale columns: `ceil(inp / block)`.
    pub fn scale_cols(&self) -> usize {
        self.inp.div_ceil(self.block)
    }

    /// The UE8M0 scale byte of the tile holding element (`row`, `col`).
    pub fn scale_byte(&self, row: usize, col: usize) -> u8 {
        self.scales[(row / self.block) * self.scale_cols() + col / self.block]
    }

    /// Row `row` dequantised to f32: `e4m3(W[row, j]) · 2^(S[row/b, j/b] − 127)`.
    pub fn dequant_row(&self, row: usize) -> Vec<f32> {
        let codes = &self.data[row * self.inp..(row + 1) * self.inp];
        codes
            .iter()
            .enumerate()
            .map(|(col, &code)| e4m3_to_f32(code) * e8m0_to_f32(self.scale_byte(row, col)))
            .collect()
    }

    /// The whole matrix dequantised to f32, row-major `[out, inp]` (exact in bf16).
    pub fn to_f32(&self) -> Vec<f32> {
        (0..self.out)
            .flat_map(|row| self.dequant_row(row))
            .collect()
    }
}

/// A routed-expert FP4 weight `[out, inp]`: `packed` holds `out * inp / 2` bytes, element `2k` of a row
/// in the low nibble of byte `k`, element `2k + 1` in the high nibble; `scales` are UE8M0
/// `[out, inp / 32]`, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp4Weight {
    pub out: usize,
    pub inp: usize,
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
}

impl Fp4Weight {
    /// Scale columns per row: `inp / 32`.
    pub fn scale_cols(&self) -> usize {
        self.inp / FP4_GROUP
    }

    /// The E2M1 nibble of element (`row`, `col`).
    pub fn code(&self, row: usize, col: usize) -> u8 {
        let byte = self.packed[row * (self.inp / 2) + col / 2];
        if col.is_multiple_of(2) {
            byte & 0x0f
        } else {
            byte >> 4
        }
    }

    /// Row `row` dequantised to f32: `e2m1(code) · 2^(S[row, j/32] − 127)`.
    pub fn dequant_row(&self, row: usize) -> Vec<f32> {
        let scales = &self.scales[row * self.scale_cols()..(row + 1) * self.scale_cols()];
        (0..self.inp)
            .map(|col| e2m1_to_f32(self.code(row, col)) * e8m0_to_f32(scales[col / FP4_GROUP]))
            .collect()
    }

    /// The whole matrix dequantised to f32, row-major `[out, inp]`.
    pub fn to_f32(&self) -> Vec<f32> {
        (0..self.out)
            .flat_map(|row| self.dequant_row(row))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_decodes_normals_subnormals_and_nan() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exponent 7, mantissa 0
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // largest finite
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x3c), 1.5);
        assert!(e4m3_to_f32(0x7f).is_nan());
    }

    #[test]
    fn e8m0_and_e2m1_decode() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(0x78), 2f32.powi(-7));
        assert!(e8m0_to_f32(255).is_nan());
        assert_eq!(e2m1_to_f32(0x7), 6.0);
        assert_eq!(e2m1_to_f32(0xf), -6.0);
        assert_eq!(e2m1_to_f32(0x3), 1.5);
        assert_eq!(e2m1_to_f32(0x8), 0.0);
    }

    #[test]
    fn fp8_dequant_applies_the_tile_scale() {
        // 2 x 3 matrix, block 2: tiles (0,0) (0,1) -> scale columns 2, one scale row.
        let weight = Fp8Weight {
            out: 2,
            inp: 3,
            block: 2,
            data: vec![0x38, 0x38, 0x38, 0xb8, 0x3c, 0x40],
            scales: vec![128, 126],
        };
        assert_eq!(weight.to_f32(), vec![2.0, 2.0, 0.5, -2.0, 3.0, 1.0]);
    }

    #[test]
    fn fp4_low_nibble_is_the_even_column() {
        let weight = Fp4Weight {
            out: 1,
            inp: 32,
            packed: [vec![0x2f], vec![0x00; 15]].concat(),
            scales: vec![128],
        };
        let row = weight.dequant_row(0);
        assert_eq!(row[0], -12.0); // nibble 0xf = -6, scale 2
        assert_eq!(row[1], 2.0); // nibble 0x2 = 1.0, scale 2
        assert!(row[2..].iter().all(|&v| v == 0.0));
    }
}
