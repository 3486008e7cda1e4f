//! Format-agnostic reading of one projection `<prefix>.weight` `[out, inp]`: the stored dtype
//! decides the representation, so one loader reads the official quantised files (FP8 E4M3 with
//! `block × block` UE8M0 tiles, packed FP4 with 1×32 scales) and the float32/bfloat16 files
//! transformers writes.

use safetensors::Dtype;

use super::Checkpoint;
use crate::error::ModelError;
use crate::weights::{Fp4Weight, Fp8Weight};

/// A projection as stored in the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum StoredLinear {
    /// FP8 E4M3 weight with its block scales.
    Fp8(Fp8Weight),
    /// Packed FP4 E2M1 weight with per-32 scales.
    Fp4(Fp4Weight),
    /// Plain BF16/F32 weight widened to f32, row-major `[out, inp]`.
    Dense {
        out: usize,
        inp: usize,
        values: Vec<f32>,
    },
}

impl StoredLinear {
    /// `[out, inp]`.
    pub fn shape(&self) -> [usize; 2] {
        match self {
            StoredLinear::Fp8(weight) => [weight.out, weight.inp],
            StoredLinear::Fp4(weight) => [weight.out, weight.inp],
            StoredLinear::Dense { out, inp, .. } => [*out, *inp],
        }
    }

    /// The weight dequantised to f32, row-major `[out, inp]`.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            StoredLinear::Fp8(weight) => weight.to_f32(),
            StoredLinear::Fp4(weight) => weight.to_f32(),
            StoredLinear::Dense { values, .. } => values.clone(),
        }
    }
}

impl Checkpoint {
    /// Reads `<prefix>.weight` `[out, inp]` in its stored format: F8_E4M3 (+ `<prefix>.scale`
    /// F8_E8M0 `[⌈out/block⌉, ⌈inp/block⌉]`), I8 packed FP4 (+ `.scale` `[out, inp/32]`), or
    /// BF16/F32. Any other dtype, or a wrong shape, is an error naming the tensor.
    pub fn linear(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
        block: usize,
    ) -> Result<StoredLinear, ModelError> {
        let name = format!("{prefix}.weight");
        let tensor = self.tensor(&name)?;
        match tensor.dtype {
            Dtype::F8_E4M3 => Ok(StoredLinear::Fp8(
                self.fp8_weight_blocked(prefix, out, inp, block)?,
            )),
            Dtype::I8 => Ok(StoredLinear::Fp4(self.fp4_weight(prefix, out, inp)?)),
            Dtype::BF16 | Dtype::F32 => Ok(StoredLinear::Dense {
                out,
                inp,
                values: self.bf16_or_f32(&name, &[out, inp])?,
            }),
            other => Err(ModelError::Checkpoint {
                file: tensor.file.to_path_buf(),
                tensor: name,
                message: format!(
                    "expected an F8_E4M3, packed FP4 (I8), BF16 or F32 projection, found {other:?} {:?}",
                    tensor.shape
                ),
            }),
        }
    }
}
