//! The whole-tensor ops of [`CudaBackend`]: the block-scaled FP8/FP4 GEMMs, the plain linears,
//! the V4 family's projections ([`Backend::linear`]), RMSNorm, RoPE and the QDQ points.
//!
//! V4's projections in the `fast` numerics (exact: fp32 with the weight dequantised exactly, the
//! CPU's bits): FP8 weights with 128×128 (or 32×32) tiles on the fast FP8 GEMM, the activations
//! quantised to E4M3 with one power-of-two scale per 1×128 (1×32) group along K, as DeepSeek's V4
//! inference and DeepGEMM do; FP4 weights on the fast FP4 GEMM with 1×32 activation groups; dense
//! weights on the fast bf16 linear (activations and weights rounded to bf16, exact for a
//! checkpoint's BF16 weights). Every output is the fp32 sum as it is (f32 storage, no bf16
//! rounding: V4's float32 activations); the fast kernels' K order is fixed by the weight's shape,
//! so a row's result never depends on the batch. Weights whose K is not a multiple of the tile
//! (which the FP8 GEMM and its activation groups cannot take) keep the exact kernel.
//!
//! The plain linears in the `fast` numerics: [`Backend::linear_bf16`] on the fast bf16 linear
//! (x rounded to bf16); [`Backend::linear_f32`] (V4.1's router gate, the compressor's `wkv` and
//! `wgate`, heads, and `sample_linear`'s logits, the same computation) on the split-x bf16x3
//! linear (x split exactly into three bf16 pieces: fp32-level accuracy, bound in
//! `ops::linear_fast`) when every value of the weight is bf16 — checked once, when the weight is
//! first cached on the device; a weight with any value off bf16 keeps the exact sgemm kernel.

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
        let shape = (w.out, w.inp);
        match self.numerics {
            Numerics::Exact => self.block_scaled_gemm(OP, x, shape, group, |a, y| {
                gemm_fp8(&self.rt, a, &*self.device_form(w)?, y, GemmSplit::Auto)
                    .map_err(op_err(OP))
            }),
            Numerics::Fast => self.fast_linear_f32(OP, x, shape, group, |a, y| {
                let w = self.device_form(w)?;
                gemm_fp8_fast(&self.rt, a, &*w, &mut RoundedToBf16(y), FastTile::Auto)
                    .map_err(op_err(OP))
            }),
        }
    }

    /// [`Backend::gemm_fp4`], with errors: the exact CUDA-core kernel, or the tensor-core kernel
    /// of the `fast` numerics.
    pub fn try_gemm_fp4(&self, x: &Tensor, w: &Fp4Weight) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "gemm_fp4";
        let shape = (w.out, w.inp);
        match self.numerics {
            Numerics::Exact => self.block_scaled_gemm(OP, x, shape, ActGroup::G32, |a, y| {
                gemm_fp4(&self.rt, a, &*self.device_form(w)?, y, GemmSplit::Auto)
                    .map_err(op_err(OP))
            }),
            Numerics::Fast => self.fast_linear_f32(OP, x, shape, ActGroup::G32, |a, y| {
                let w = self.device_form(w)?;
                gemm_fp4_fast(&self.rt, a, &*w, &mut RoundedToBf16(y), FastTile::Auto)
                    .map_err(op_err(OP))
            }),
        }
    }

    /// `x · wᵀ` of a block-scaled weight `[out, inp]` on the exact kernels: `x` quantised to FP8
    /// in `group`s, then `gemm` into a bf16 output `[rows, out]`, widened (the fast kernels
    /// store the rounded values as f32 themselves: [`RoundedToBf16`]).
    fn block_scaled_gemm(
        &self,
        op: &'static str,
        x: &Tensor,
        shape: (usize, usize),
        group: ActGroup,
        gemm: impl FnOnce(&DeviceActFp8, &mut CudaSlice<bf16>) -> Result<(), CudaBackendError>,
    ) -> Result<Tensor, CudaBackendError> {
        if x.is_empty() {
            return Ok(Tensor::empty());
        }
        self.widen(op, &self.quantised_gemm(op, x, shape, group, gemm)?)
    }

    /// `x` (not empty) quantised to FP8 in `group`s, then `gemm` into a new output `[rows, out]`
    /// of `T` (bf16 or f32).
    fn quantised_gemm<T: DeviceRepr>(
        &self,
        op: &'static str,
        x: &Tensor,
        (out, inp): (usize, usize),
        group: ActGroup,
        gemm: impl FnOnce(&DeviceActFp8, &mut CudaSlice<T>) -> Result<(), CudaBackendError>,
    ) -> Result<CudaSlice<T>, CudaBackendError> {
        let a = self.quantised_activations(op, x, inp, group)?;
        // SAFETY: every `gemm` here (gemm_fp8/fp4: one summing thread or lane per (row, column)
        // of its tile; gemm_fp8/fp4_fast: every tile row < m and feature < n stored, or the part
        // sums reduced into every output) writes all a.rows * out values.
        let mut y = unsafe { self.alloc_written::<T>(op, a.rows * out) }?;
        gemm(&a, &mut y)?;
        Ok(y)
    }

    /// [`Backend::linear`], with errors: exact (the CPU's bits) or, in the `fast` numerics, on
    /// tensor cores with f32 outputs (module doc).
    pub fn try_linear_v4(&self, x: &Tensor, w: &Linear) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "linear";
        let fast = self.numerics == Numerics::Fast;
        match w {
            Linear::Dense { out, inp, values } => {
                let w = DenseWeight {
                    values,
                    out: *out,
                    inp: *inp,
                };
                let kernel = if fast {
                    DenseKernel::Bf16(Rounding::F32)
                } else {
                    DenseKernel::Exact(Rounding::F32)
                };
                self.dense_linear(OP, x, w, kernel)
            }
            Linear::Fp8(w) => match fast_fp8_group(w).filter(|_| fast) {
                Some(group) => self.fast_linear_f32(OP, x, (w.out, w.inp), group, |a, y| {
                    gemm_fp8_fast(&self.rt, a, &*self.device_form(w)?, y, FastTile::Auto)
                        .map_err(op_err(OP))
                }),
                None => self.exact_linear_fp8(x, w),
            },
            Linear::Fp4(w) if fast => {
                self.fast_linear_f32(OP, x, (w.out, w.inp), ActGroup::G32, |a, y| {
                    gemm_fp4_fast(&self.rt, a, &*self.device_form(w)?, y, FastTile::Auto)
                        .map_err(op_err(OP))
                })
            }
            Linear::Fp4(w) => self.exact_linear_fp4(x, w),
        }
    }

    /// A fast block-scaled GEMM with f32 output `[rows, out]` on `x` quantised in `group`s (the
    /// fp32 sums, or rounded to bf16 where `gemm` stores through [`RoundedToBf16`]).
    fn fast_linear_f32(
        &self,
        op: &'static str,
        x: &Tensor,
        shape: (usize, usize),
        group: ActGroup,
        gemm: impl FnOnce(&DeviceActFp8, &mut CudaSlice<f32>) -> Result<(), CudaBackendError>,
    ) -> Result<Tensor, CudaBackendError> {
        whole_rows(op, x, shape.1)?;
        if x.is_empty() || shape.0 == 0 {
            return Ok(Tensor::empty());
        }
        Ok(self.tensor(self.quantised_gemm(op, x, shape, group, gemm)?))
    }

    /// [`Backend::linear_f32`] / [`Backend::linear_bf16`], with errors. Like the CPU reference, a
    /// weight shorter than `out` rows yields only the rows it has. In `fast` numerics both run on
    /// tensor cores (module doc: `linear_f32` only on a weight of bf16 values).
    pub fn try_linear(
        &self,
        x: &Tensor,
        w: DenseWeight<'_>,
        output: Rounding,
    ) -> Result<Tensor, CudaBackendError> {
        let kernel = match (self.numerics, output) {
            (Numerics::Exact, _) => DenseKernel::Exact(output),
            (Numerics::Fast, Rounding::Bf16) => DenseKernel::Bf16(Rounding::Bf16),
            (Numerics::Fast, Rounding::F32) => DenseKernel::F32,
        };
        self.dense_linear("linear", x, w, kernel)
    }

    /// `x · Wᵀ` of a dense weight (at most `out` rows of it, as the CPU reference) on `kernel`.
    fn dense_linear(
        &self,
        op: &'static str,
        x: &Tensor,
        w: DenseWeight<'_>,
        kernel: DenseKernel,
    ) -> Result<Tensor, CudaBackendError> {
        let DenseWeight {
            values: w,
            out,
            inp,
        } = w;
        let rows = whole_rows(op, x, inp)?;
        let out = out.min(w.len() / inp);
        if rows == 0 || out == 0 {
            return Ok(Tensor::empty());
        }
        let dx = self.input(op, x)?;
        let w = &w[..out * inp];
        // SAFETY: linear_bf16_fast stores every (row < rows, column < out) of its tiles;
        // linear_sgemm_f32's reduction writes each of the rows * out outputs.
        let mut dy = unsafe { self.alloc_written(op, rows * out) }?;
        match kernel {
            DenseKernel::Exact(output) => {
                let dw = self.cached_f32(op, w)?;
                linear_sgemm_f32(&self.rt, &dx, &dw, &mut dy, (rows, out, inp), output)
                    .map_err(op_err(op))?;
            }
            DenseKernel::Bf16(output) => {
                let dw = self.cached_bf16_fast(w, 1, out, inp)?;
                let product = FastProduct::Bf16(output);
                linear_bf16_fast(&self.rt, &dx, &dw, &mut dy, rows, None, product)
                    .map_err(op_err(op))?;
            }
            DenseKernel::F32 => self.linear_f32_into(op, &dx, w, &mut dy, (rows, out, inp))?,
        }
        Ok(self.tensor(dy))
    }

    /// `y [rows, out] = x [rows, inp] · Wᵀ` (`w` holding exactly `out · inp` values) as
    /// [`Backend::linear_f32`] computes it in this backend's numerics (module doc): the exact
    /// sgemm order, or in `fast` numerics the split-x bf16x3 linear on a weight of bf16 values.
    pub(super) fn linear_f32_into(
        &self,
        op: &'static str,
        x: &CudaSlice<f32>,
        w: &[f32],
        y: &mut CudaSlice<f32>,
        (rows, out, inp): (usize, usize, usize),
    ) -> Result<(), CudaBackendError> {
        if self.numerics == Numerics::Exact {
            let dw = self.cached_f32(op, w)?;
            return linear_sgemm_f32(&self.rt, x, &dw, y, (rows, out, inp), Rounding::F32)
                .map_err(op_err(op));
        }
        match &*self.cached_f32_linear_fast(op, w, out, inp)? {
            FastF32Weight::Bf16x3(dw) => {
                linear_bf16_fast(&self.rt, x, dw, y, rows, None, FastProduct::SplitBf16x3)
            }
            FastF32Weight::Sgemm(dw) => {
                linear_sgemm_f32(&self.rt, x, dw, y, (rows, out, inp), Rounding::F32)
            }
        }
        .map_err(op_err(op))
    }

    /// [`Backend::linear_grouped_bf16`], with errors: in `fast` numerics every group in one
    /// launch of the fast bf16 linear (grid z, each group bitwise its linear alone); in `exact`
    /// numerics the groups one by one ([`linear_by_groups`]), bitwise the CPU reference.
    pub fn try_linear_grouped_bf16(
        &self,
        x: &Tensor,
        w: &[f32],
        shape: Groups,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "linear_grouped_bf16";
        let Groups { groups, out, inp } = shape;
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
            return Ok(linear_by_groups(self, x, shape, |inputs, g| {
                self.linear_bf16(inputs, shape.weight(w, g))
            }));
        }
        if rows == 0 || out == 0 {
            return Ok(Tensor::empty());
        }
        let dx = self.input(OP, x)?;
        // SAFETY: linear_bf16_fast stores every (row, column) of every group (grid z).
        let mut dy = unsafe { self.alloc_written(OP, rows * groups * out) }?;
        let dw = self.cached_bf16_fast(w, groups, groups * out, inp)?;
        linear_bf16_fast(
            &self.rt,
            &dx,
            &dw,
            &mut dy,
            rows,
            None,
            FastProduct::Bf16(Rounding::Bf16),
        )
        .map_err(op_err(OP))?;
        Ok(self.tensor(dy))
    }

    /// The exact `linear` of an FP8 weight: the weight (cached on the device) is dequantised
    /// exactly to f32 on the device in blocks of rows ([`dequant_block_rows`]) and multiplied in
    /// the CPU sgemm order, as the CPU reference does on the host; `x` and the result stay on
    /// the device.
    fn exact_linear_fp8(&self, x: &Tensor, w: &Fp8Weight) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "linear";
        let dw = self.device_form(w)?;
        self.dequantised_linear(OP, x, (w.out, w.inp), |start, rows, block| {
            dequant_fp8_rows_f32(&self.rt, &dw, start, rows, block)
        })
    }

    /// The exact `linear` of an FP4 weight (see [`CudaBackend::exact_linear_fp8`]).
    fn exact_linear_fp4(&self, x: &Tensor, w: &Fp4Weight) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "linear";
        let dw = self.device_form(w)?;
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
            // SAFETY: dequant_fp8/fp4_rows_f32 write each of the count * inp values (one
            // thread each).
            let mut block = unsafe { self.alloc_written(op, count * inp) }?;
            dequant(start, count, &mut block).map_err(op_err(op))?;
            // SAFETY: linear_sgemm_f32's reduction writes each of the rows * count outputs.
            let mut part = unsafe { self.alloc_written(op, rows * count) }?;
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
    pub fn try_rms_norm(&self, x: &Tensor, norm: RmsNorm<'_>) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "rms_norm";
        let RmsNorm {
            weight,
            eps,
            precision,
        } = norm;
        let cols = weight.len();
        whole_rows(OP, x, cols)?;
        if x.is_empty() {
            return Ok(Tensor::empty());
        }
        let dw = self.cached_f32(OP, weight)?;
        let dx = self.input(OP, x)?;
        let rows = x.len() / cols;
        // SAFETY: both kernels run one block per row, its threads covering every column (and,
        // quantising, every code and every group's scale).
        let mut dy = unsafe { self.alloc_written(OP, x.len()) }?;
        // bf16 outputs in whole 32-groups are what V4.1's FP8 GEMMs read: quantised in the same
        // launch and kept on the result for them (CudaBuffer's `fp8`).
        if precision == Precision::Bf16 && cols.is_multiple_of(32) {
            // SAFETY: as above.
            let mut act =
                unsafe { DeviceActFp8::alloc_written(&self.rt, rows, cols, ActGroup::G32) }
                    .map_err(op_err(OP))?;
            rms_norm_act_quant_f32(&self.rt, &dx, &dw, &mut dy, &mut act, eps)
                .map_err(op_err(OP))?;
            return Ok(self.tensor_with_fp8(dy, act));
        }
        rms_norm_f32(
            &self.rt,
            &dx,
            &dw,
            &mut dy,
            rows,
            cols,
            eps,
            rounding(precision),
        )
        .map_err(op_err(OP))?;
        Ok(self.tensor(dy))
    }

    /// [`Backend::rope`], with errors. The rows index a device table of the table's cos/sin rows
    /// from position 0 ([`DeviceRopeTable`], built on the host with the CPU reference's angle
    /// rule and cached): a call uploads only its rows' positions.
    pub fn try_rope(
        &self,
        x: Tensor,
        (stride, vectors_per_row): (usize, usize),
        rotation: &Rotation<'_>,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "rope";
        let Rotation {
            table,
            positions,
            inverse,
            precision,
        } = *rotation;
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
        let device = self.device_rotation(OP, rotation, rows, (stride, vectors_per_row))?;
        self.in_place(OP, x, |dx| {
            rope_interleaved_f32(&self.rt, dx, device.by(inverse), rounding(precision))
                .map_err(op_err(OP))
        })
    }

    /// What a rotation of `rows` rows (at most `rotation.positions.len()`) of `layout` reads on
    /// the device: its shape, the cos/sin table covering its positions and the positions.
    fn device_rotation(
        &self,
        op: &'static str,
        rotation: &Rotation<'_>,
        rows: usize,
        (stride, vectors_per_row): (usize, usize),
    ) -> Result<DeviceRotation, CudaBackendError> {
        let positions = &rotation.positions[..rows];
        let row_index: Vec<i32> = positions
            .iter()
            .map(|&p| i32::try_from(p).map_err(|_| shape_err(op, format!("position {p}"))))
            .collect::<Result<_, _>>()?;
        let longest = positions.iter().copied().max().unwrap_or(0) + 1;
        let rope = self.rope_table(rotation.table, longest)?;
        let shape = RopeShape {
            tokens: rows,
            heads: vectors_per_row,
            head_dim: stride,
            rope_dim: 2 * rotation.table.freqs.len(),
            table_rows: rope.positions,
        };
        Ok(DeviceRotation {
            shape,
            positions: self.device_positions(op, row_index)?,
            table: rope,
        })
    }

    /// `rows` (RoPE positions) on the device: the copy uploaded for the same rows before, if
    /// it is among the latest [`KEPT_POSITIONS`], else uploaded now and kept. A step's queries,
    /// keys, inverse rotation and indexer rotate the same rows in every layer: one upload a step.
    /// The copies are never written after their upload, so a kept one holds its rows.
    fn device_positions(
        &self,
        op: &'static str,
        rows: Vec<i32>,
    ) -> Result<Arc<CudaSlice<i32>>, CudaBackendError> {
        let mut kept = self
            .positions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = kept
            .iter()
            .position(|(host, _)| *host == rows)
            .and_then(|i| kept.remove(i))
        {
            let device = found.1.clone();
            kept.push_front(found);
            return Ok(device);
        }
        let device = Arc::new(
            self.rt
                .htod(&rows)
                .map_err(driver_err(op, "uploading positions"))?,
        );
        kept.push_front((rows, device.clone()));
        kept.truncate(KEPT_POSITIONS);
        Ok(device)
    }

    /// The device cos/sin rows of `table` covering positions `0..positions`: the cached ones, or
    /// (the first time, or when longer positions come) rows for the next power of two of
    /// positions (at least [`MIN_ROPE_POSITIONS`]), built on the host once.
    fn rope_table(
        &self,
        table: &crate::backend::RopeTable,
        positions: usize,
    ) -> Result<Arc<DeviceRopeTable>, CudaBackendError> {
        let key = HostKey::f32s(&table.freqs);
        let mut cache = self.lock_weights();
        if let Some(found) = cache.rope_tables.get(&key)
            && found.positions >= positions
        {
            return Ok(found.clone());
        }
        let covered = positions.next_power_of_two().max(MIN_ROPE_POSITIONS);
        let pairs = table.freqs.len();
        let mut cos = Vec::with_capacity(covered * pairs);
        let mut sin = Vec::with_capacity(covered * pairs);
        for position in 0..covered {
            for pair in 0..pairs {
                let (c, s) = table.cos_sin(position, pair);
                cos.push(c);
                sin.push(s);
            }
        }
        let built = Arc::new(DeviceRopeTable {
            positions: covered,
            cos: self.upload("rope", &cos)?,
            sin: self.upload("rope", &sin)?,
        });
        cache.rope_tables.insert(key, built.clone());
        Ok(built)
    }

    /// [`Backend::rope_qdq`], with errors: one pass ([`rope_qdq_f32`]) where every rounding is
    /// bf16, something is rotated and a row is whole QDQ groups (within the launch's grid); else
    /// the norm, the rotation and the QDQ one after another (the same bits).
    pub fn try_rope_qdq(
        &self,
        x: Tensor,
        norm: Option<RmsNorm<'_>>,
        (stride, vectors_per_row): (usize, usize),
        rotation: &Rotation<'_>,
        point: ModelQdq,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "rope_qdq";
        let point = match point {
            ModelQdq::Q8 => QdqPoint::Q8,
            ModelQdq::Q4e => QdqPoint::Q4e,
            ModelQdq::Q4m => QdqPoint::Q4m,
        };
        let cols = stride * vectors_per_row;
        let pairs = rotation.table.freqs.len();
        let one_pass = rotation.precision == Precision::Bf16
            && norm.is_none_or(|n| n.precision == Precision::Bf16 && n.weight.len() == cols)
            && cols != 0
            && cols <= ROPE_QDQ_MAX_COLS
            && cols.is_multiple_of(32)
            && stride.is_multiple_of(2)
            && pairs != 0
            && 2 * pairs <= stride;
        if !one_pass {
            let x = match norm {
                Some(norm) => self.try_rms_norm(&x, norm)?,
                None => x,
            };
            let x = self.try_rope(x, (stride, vectors_per_row), rotation)?;
            if x.is_empty() {
                return Ok(x);
            }
            return self.in_place(OP, x, |dx| qdq_f32(&self.rt, dx, point).map_err(op_err(OP)));
        }
        let rows = whole_rows(OP, &x, cols)?;
        if rotation.positions.len() < rows {
            return Err(shape_err(
                OP,
                format!("{rows} rows but {} positions", rotation.positions.len()),
            ));
        }
        if rows == 0 {
            return Ok(x);
        }
        let device = self.device_rotation(OP, rotation, rows, (stride, vectors_per_row))?;
        let launch = |input: RopeQdqInput<'_>, y: &mut CudaSlice<f32>| {
            rope_qdq_f32(&self.rt, input, y, device.by(rotation.inverse), point).map_err(op_err(OP))
        };
        match norm {
            None => self.in_place(OP, x, |dy| {
                launch(
                    RopeQdqInput {
                        x: None,
                        norm: None,
                    },
                    dy,
                )
            }),
            Some(norm) => {
                let dw = self.cached_f32(OP, norm.weight)?;
                let dx = self.input(OP, &x)?;
                // SAFETY: rope_qdq_f32's blocks together cover every column of every row.
                let mut dy = unsafe { self.alloc_written(OP, x.len()) }?;
                launch(
                    RopeQdqInput {
                        x: Some(&dx),
                        norm: Some((&dw, norm.eps)),
                    },
                    &mut dy,
                )?;
                Ok(self.tensor(dy))
            }
        }
    }
}

/// A rotation's device inputs ([`CudaBackend::device_rotation`]).
struct DeviceRotation {
    shape: RopeShape,
    table: Arc<DeviceRopeTable>,
    positions: Arc<CudaSlice<i32>>,
}

impl DeviceRotation {
    /// The kernels' rotation by these inputs, `inverse` or not.
    fn by(&self, inverse: bool) -> RopeRotation<'_> {
        RopeRotation {
            positions: &self.positions,
            cos: &self.table.cos,
            sin: &self.table.sin,
            shape: self.shape,
            inverse,
        }
    }
}

/// The activation group of the fast FP8 GEMM for `w`: its tile side (32 or 128), when `inp` is
/// whole tiles; `None` (the exact kernel) otherwise.
pub(crate) fn fast_fp8_group(w: &Fp8Weight) -> Option<ActGroup> {
    let group = match w.block {
        32 => ActGroup::G32,
        128 => ActGroup::G128,
        _ => return None,
    };
    (w.inp > 0 && w.inp.is_multiple_of(w.block)).then_some(group)
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

/// The kernel of a dense linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DenseKernel {
    /// The exact sgemm order (the CPU's bits), the output rounded as given.
    Exact(Rounding),
    /// The fast bf16 linear (x rounded to bf16), the output rounded as given.
    Bf16(Rounding),
    /// [`Backend::linear_f32`] in this backend's numerics ([`CudaBackend::linear_f32_into`]).
    F32,
}

/// A weight of [`Backend::linear_f32`] in the `fast` numerics, sorted when first cached.
pub(super) enum FastF32Weight {
    /// Every value bf16: the split-x bf16x3 linear on tensor cores.
    Bf16x3(FastBf16Weight),
    /// A value off bf16 (which the bf16 weight would round): the exact sgemm kernel.
    Sgemm(CudaSlice<f32>),
}

/// The fewest positions a device RoPE table covers (the table of a short context is built once).
const MIN_ROPE_POSITIONS: usize = 4096;

/// One RoPE table's `(cos, sin)` rows for positions `0..positions` on the device, `[positions,
/// pairs]` each, the values of [`crate::backend::RopeTable::cos_sin`].
pub(super) struct DeviceRopeTable {
    positions: usize,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp8(out: usize, inp: usize, block: usize) -> Fp8Weight {
        Fp8Weight {
            out,
            inp,
            block,
            data: vec![0; out * inp],
            scales: vec![127; out.div_ceil(block) * inp.div_ceil(block)],
        }
    }

    /// V4's FP8 projections take the fast GEMM with activation groups of their tile side when K
    /// is whole tiles; any other K or tile keeps the exact kernel.
    #[test]
    fn fp8_weights_take_the_fast_gemm_with_groups_of_their_tile_side() {
        assert_eq!(fast_fp8_group(&fp8(256, 7168, 128)), Some(ActGroup::G128));
        assert_eq!(fast_fp8_group(&fp8(96, 160, 32)), Some(ActGroup::G32));
        assert_eq!(
            fast_fp8_group(&fp8(256, 200, 128)),
            None,
            "K of 1.5625 tiles"
        );
        assert_eq!(fast_fp8_group(&fp8(64, 128, 64)), None, "64x64 tiles");
        assert_eq!(fast_fp8_group(&fp8(64, 0, 128)), None, "no K");
    }

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
