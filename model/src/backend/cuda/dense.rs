//! The whole-tensor ops of [`CudaBackend`]: the block-scaled FP8/FP4 GEMMs, the plain and
//! dequantised fp32 linears, RMSNorm, RoPE and the QDQ points.

use super::*;

impl CudaBackend {
    /// [`Backend::gemm_fp8`], with errors: the exact CUDA-core kernel, or the tensor-core kernel
    /// of the `fast` numerics.
    pub fn try_gemm_fp8(&self, x: &Tensor, w: &Fp8Weight) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "gemm_fp8";
        let group = match w.block {
            32 => ActGroup::G32,
            128 => ActGroup::G128,
            block => {
                return Err(shape_err(
                    OP,
                    format!("weight block {block} (only 32 and 128)"),
                ));
            }
        };
        self.block_scaled_gemm(OP, x, (w.out, w.inp), group, |a, y| {
            match self.numerics {
                Numerics::Exact => gemm_fp8(&self.rt, a, &*self.cached_fp8(w)?, y),
                Numerics::Fast => gemm_fp8_fast(&self.rt, a, &*self.cached_fp8_fast(w)?, y),
            }
            .map_err(op_err(OP))
        })
    }

    /// [`Backend::gemm_fp4`], with errors: the exact CUDA-core kernel, or the tensor-core kernel
    /// of the `fast` numerics.
    pub fn try_gemm_fp4(&self, x: &Tensor, w: &Fp4Weight) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "gemm_fp4";
        self.block_scaled_gemm(OP, x, (w.out, w.inp), ActGroup::G32, |a, y| {
            match self.numerics {
                Numerics::Exact => gemm_fp4(&self.rt, a, &*self.cached_fp4(w)?, y),
                Numerics::Fast => gemm_fp4_fast(&self.rt, a, &*self.cached_fp4_fast(w)?, y),
            }
            .map_err(op_err(OP))
        })
    }

    /// `x · wᵀ` of a block-scaled weight `[out, inp]` in f32: `x` quantised to FP8 in `group`s,
    /// then `gemm` into a bf16 output `[rows, out]`, widened.
    fn block_scaled_gemm(
        &self,
        op: &'static str,
        x: &Tensor,
        (out, inp): (usize, usize),
        group: ActGroup,
        gemm: impl FnOnce(&DeviceActFp8, &mut CudaSlice<bf16>) -> Result<(), CudaBackendError>,
    ) -> Result<Tensor, CudaBackendError> {
        if x.is_empty() {
            return Ok(Tensor::empty());
        }
        let a = self.quantised_activations(op, x, inp, group)?;
        let mut y = self
            .rt
            .stream()
            .alloc_zeros::<bf16>(a.rows * out)
            .map_err(driver_err(op, "allocating an output"))?;
        gemm(&a, &mut y)?;
        self.widen(op, &y)
    }

    /// [`Backend::linear_f32`] / [`Backend::linear_bf16`], with errors. Like the CPU reference, a
    /// weight shorter than `out` rows yields only the rows it has. In `fast` numerics the bf16
    /// linear runs on tensor cores (`ops::linear_fast`); the fp32 linears stay exact.
    pub fn try_linear(
        &self,
        x: &Tensor,
        w: &[f32],
        out: usize,
        inp: usize,
        output: Rounding,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "linear";
        let rows = whole_rows(OP, x, inp)?;
        let out = out.min(w.len() / inp);
        if rows == 0 || out == 0 {
            return Ok(Tensor::empty());
        }
        let dx = self.input(OP, x)?;
        let mut dy = self.alloc(OP, rows * out)?;
        if self.numerics == Numerics::Fast && output == Rounding::Bf16 {
            let dw = self.cached_bf16_fast(&w[..out * inp], 1, out, inp)?;
            linear_bf16_fast(&self.rt, &dx, &dw, &mut dy, rows, output).map_err(op_err(OP))?;
        } else {
            let dw = self.cached_f32(OP, &w[..out * inp])?;
            linear_sgemm_f32(&self.rt, &dx, &dw, &mut dy, (rows, out, inp), output)
                .map_err(op_err(OP))?;
        }
        Ok(self.tensor(dy))
    }

    /// [`Backend::linear_grouped_bf16`], with errors: in `fast` numerics every group in one
    /// launch of the fast bf16 linear (grid z, each group bitwise its linear alone); in `exact`
    /// numerics the groups one by one ([`linear_by_groups`]), bitwise the CPU reference.
    pub fn try_linear_grouped_bf16(
        &self,
        x: &Tensor,
        w: &[f32],
        groups: usize,
        out: usize,
        inp: usize,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "linear_grouped_bf16";
        if groups == 0 || w.len() != groups * out * inp {
            return Err(shape_err(
                OP,
                format!(
                    "{} weight values for {groups} groups of [{out}, {inp}]",
                    w.len()
                ),
            ));
        }
        let rows = whole_rows(OP, x, groups * inp)?;
        if self.numerics != Numerics::Fast {
            return Ok(linear_by_groups(
                self,
                x,
                (groups, inp, out),
                |inputs, g| {
                    self.linear_bf16(inputs, &w[g * out * inp..(g + 1) * out * inp], out, inp)
                },
            ));
        }
        if rows == 0 || out == 0 {
            return Ok(Tensor::empty());
        }
        let dx = self.input(OP, x)?;
        let mut dy = self.alloc(OP, rows * groups * out)?;
        let dw = self.cached_bf16_fast(w, groups, groups * out, inp)?;
        linear_bf16_fast(&self.rt, &dx, &dw, &mut dy, rows, Rounding::Bf16).map_err(op_err(OP))?;
        Ok(self.tensor(dy))
    }

    /// [`Backend::linear_fp8_f32`], with errors: the FP8 weight (cached on the device) is
    /// dequantised exactly to f32 on the device in blocks of rows ([`dequant_block_rows`]) and
    /// multiplied in the CPU sgemm order, as the default method does on the host; `x` and the
    /// result stay on the device.
    pub fn try_linear_fp8_f32(
        &self,
        x: &Tensor,
        w: &Fp8Weight,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "linear_fp8_f32";
        let dw = self.cached_fp8(w)?;
        self.dequantised_linear(OP, x, (w.out, w.inp), |start, rows, block| {
            dequant_fp8_rows_f32(&self.rt, &dw, start, rows, block)
        })
    }

    /// [`Backend::linear_fp4_f32`], with errors (see [`CudaBackend::try_linear_fp8_f32`]).
    pub fn try_linear_fp4_f32(
        &self,
        x: &Tensor,
        w: &Fp4Weight,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "linear_fp4_f32";
        let dw = self.cached_fp4(w)?;
        self.dequantised_linear(OP, x, (w.out, w.inp), |start, rows, block| {
            dequant_fp4_rows_f32(&self.rt, &dw, start, rows, block)
        })
    }

    /// `x · Wᵀ` (fp32 out) with `W [out, inp]` dequantised block by block by `dequant` (first row,
    /// rows, output buffer). Each output is one sgemm-order chain, so the blocking never shows;
    /// the blocks' columns are interleaved into `[rows, out]` by one gather.
    fn dequantised_linear(
        &self,
        op: &'static str,
        x: &Tensor,
        (out, inp): (usize, usize),
        dequant: impl Fn(usize, usize, &mut CudaSlice<f32>) -> Result<(), KernelError>,
    ) -> Result<Tensor, CudaBackendError> {
        let rows = whole_rows(op, x, inp)?;
        if rows == 0 || out == 0 {
            return Ok(Tensor::empty());
        }
        let dx = self.input(op, x)?;
        let count = dequant_block_rows(out, inp);
        let mut parts = Vec::with_capacity(out / count);
        for start in (0..out).step_by(count) {
            let mut block = self.alloc(op, count * inp)?;
            dequant(start, count, &mut block).map_err(op_err(op))?;
            let mut part = self.alloc(op, rows * count)?;
            linear_sgemm_f32(
                &self.rt,
                &dx,
                &block,
                &mut part,
                (rows, count, inp),
                Rounding::F32,
            )
            .map_err(op_err(op))?;
            parts.push(self.tensor(part));
        }
        if let [whole] = &parts[..] {
            return Ok(whole.clone());
        }
        let pieces: Vec<(&Tensor, usize)> = (0..rows)
            .flat_map(|r| parts.iter().map(move |part| (part, r * count)))
            .collect();
        self.try_gather(&pieces, count)
    }

    /// [`Backend::rms_norm`], with errors.
    pub fn try_rms_norm(
        &self,
        x: &Tensor,
        weight: &[f32],
        eps: f32,
        precision: Precision,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "rms_norm";
        let cols = weight.len();
        whole_rows(OP, x, cols)?;
        if x.is_empty() {
            return Ok(Tensor::empty());
        }
        let dw = self.cached_f32(OP, weight)?;
        let dx = self.input(OP, x)?;
        let mut dy = self.alloc(OP, x.len())?;
        rms_norm_f32(
            &self.rt,
            &dx,
            &dw,
            &mut dy,
            x.len() / cols,
            cols,
            eps,
            rounding(precision),
        )
        .map_err(op_err(OP))?;
        Ok(self.tensor(dy))
    }

    /// [`Backend::rope`], with errors. The cos/sin rows of the rows' positions are built on the host
    /// with the CPU reference's angle rule (f64 sine and cosine of `f32(position · freq)`).
    #[allow(clippy::too_many_arguments)]
    pub fn try_rope(
        &self,
        x: Tensor,
        stride: usize,
        vectors_per_row: usize,
        positions: &[usize],
        table: &RopeTable,
        inverse: bool,
        precision: Precision,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "rope";
        let pairs = table.freqs.len();
        let row_width = stride * vectors_per_row;
        if row_width == 0 || 2 * pairs > stride || !x.len().is_multiple_of(row_width) {
            return Err(shape_err(
                OP,
                format!(
                    "x ({} values) must be whole rows of {vectors_per_row} vectors of {stride}, each \
                     holding the {} rotated channels",
                    x.len(),
                    2 * pairs
                ),
            ));
        }
        let rows = x.len() / row_width;
        if positions.len() < rows {
            return Err(shape_err(
                OP,
                format!("{rows} rows but {} positions", positions.len()),
            ));
        }
        if rows == 0 || pairs == 0 {
            return Ok(x);
        }
        let mut cos = Vec::with_capacity(rows * pairs);
        let mut sin = Vec::with_capacity(rows * pairs);
        for &position in &positions[..rows] {
            for pair in 0..pairs {
                let (c, s) = table.cos_sin(position, pair);
                cos.push(c);
                sin.push(s);
            }
        }
        let row_index: Vec<i32> = (0..rows)
            .map(|r| i32::try_from(r).map_err(|_| shape_err(OP, format!("{rows} rows"))))
            .collect::<Result<_, _>>()?;
        let dpos = self
            .rt
            .htod(&row_index)
            .map_err(driver_err(OP, "uploading positions"))?;
        let dcos = self.upload(OP, &cos)?;
        let dsin = self.upload(OP, &sin)?;
        let shape = RopeShape {
            tokens: rows,
            heads: vectors_per_row,
            head_dim: stride,
            rope_dim: 2 * pairs,
            table_rows: rows,
        };
        self.in_place(OP, x, |dx| {
            rope_interleaved_f32(
                &self.rt,
                dx,
                &dpos,
                &dcos,
                &dsin,
                shape,
                inverse,
                rounding(precision),
            )
            .map_err(op_err(OP))
        })
    }

    /// The QDQ points, with errors.
    pub fn try_qdq(&self, x: Tensor, point: QdqPoint) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "qdq";
        if x.is_empty() {
            return Ok(x);
        }
        self.in_place(OP, x, |dx| qdq_f32(&self.rt, dx, point).map_err(op_err(OP)))
    }
}

/// Weight rows dequantised at a time by the fp32 linears over FP8 / FP4 weights: the whole weight
/// when it has at most [`DEQUANT_ELEMENTS`] values, else the largest divisor of `out` whose rows
/// fit (equal blocks, so their columns interleave with one gather).
pub(crate) fn dequant_block_rows(out: usize, inp: usize) -> usize {
    let fit = (DEQUANT_ELEMENTS / inp.max(1)).max(1);
    if out <= fit {
        return out.max(1);
    }
    (1..=fit)
        .rev()
        .find(|d| out.is_multiple_of(*d))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dequant_blocks_are_equal_divisors_of_the_rows_within_the_budget() {
        assert_eq!(dequant_block_rows(1100, 96), 1100);
        let inp = 8192;
        let fit = DEQUANT_ELEMENTS / inp;
        assert_eq!(dequant_block_rows(fit, inp), fit);
        assert_eq!(dequant_block_rows(2 * fit + 4, inp), fit / 2 + 1);
        assert_eq!(dequant_block_rows(129_280, 4096), 16_160);
        // A prime row count beyond the budget falls back to single rows.
        assert_eq!(dequant_block_rows(1_000_003, 4096), 1);
        assert_eq!(dequant_block_rows(0, 16), 1);
    }
}
