//! The small row math of [`CudaBackend`] between its big ops, so that a step's activations stay on
//! the device: the indexer's head-weight scaling, the stream means of the DSpark taps, the
//! compressor's gated pooling (member rows read in place, wherever earlier steps left them) and
//! the Engram gate and injection. Each is bit for bit the trait's CPU default (the kernels of
//! `deepinfer_kernels::ops::rows`, with `exp` as Rust's std computes it).

use deepinfer_kernels::ops::rows::{
    EngramInjectShape, engram_inject_f32, gated_pool_f32, scale_round_f32, stream_means_f32,
};

use deepinfer_kernels::ops::movement::add_f32;

use super::*;

impl CudaBackend {
    /// [`Backend::scale_at`], with errors: in place when `x` is the only holder of its buffer.
    pub fn try_scale(
        &self,
        x: Tensor,
        scale: f32,
        precision: Precision,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "scale";
        if x.is_empty() {
            return Ok(x);
        }
        self.in_place(OP, x, |data| {
            scale_round_f32(&self.rt, data, scale, rounding(precision)).map_err(op_err(OP))
        })
    }

    /// [`Backend::stream_means_at`], with errors: `streams [n, hc, dim]` → `[n, dim]` in one
    /// launch.
    pub fn try_stream_means(
        &self,
        streams: &Tensor,
        shape: StreamShape,
        precision: Precision,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "stream_means";
        let StreamShape { hc, dim } = shape;
        if hc == 0 || dim == 0 || streams.is_empty() {
            return Ok(Tensor::empty());
        }
        if !streams.len().is_multiple_of(hc * dim) {
            return Err(shape_err(
                OP,
                format!(
                    "streams ({} values) are not whole tokens of hc = {hc} × dim = {dim}",
                    streams.len()
                ),
            ));
        }
        let dstreams = self.input(OP, streams)?;
        // SAFETY: stream_means_f32's grid-stride loop writes every (token, dim).
        let mut out = unsafe { self.alloc_written(OP, streams.len() / hc) }?;
        stream_means_f32(&self.rt, &dstreams, hc, dim, rounding(precision), &mut out)
            .map_err(op_err(OP))?;
        Ok(self.tensor(out))
    }

    /// [`Backend::gated_pool_rows`], with errors: every group in one launch over a table of its
    /// members' device addresses when the groups have one size (the model's case: `ratio`
    /// members each); otherwise each run of groups of one size apart, the results put in order.
    pub fn try_gated_pool_rows(
        &self,
        groups: &[Vec<&Tensor>],
        head_dim: usize,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "gated_pool_rows";
        if groups.is_empty() || head_dim == 0 {
            return Ok(Tensor::empty());
        }
        let ratio = groups[0].len();
        if ratio == 0 || groups.iter().any(|members| members.len() != ratio) {
            return self.gated_pool_runs(groups, head_dim);
        }
        let mut keep = HostUploads::default();
        let addresses = groups
            .iter()
            .flatten()
            .map(|row| self.address_of(OP, row, 0, 2 * head_dim, &mut keep))
            .collect::<Result<Vec<u64>, _>>()?;
        let members = self
            .rt
            .htod(&addresses)
            .map_err(driver_err(OP, "uploading the member addresses"))?;
        // SAFETY: gated_pool_f32's grid-stride loop writes every (group, channel).
        let mut out = unsafe { self.alloc_written(OP, groups.len() * head_dim) }?;
        // SAFETY: every address is `2 · head_dim` values of a buffer of this context (checked by
        // `address_of`): a member tensor's, borrowed for this call, or an upload in `keep`, held
        // until the launch is enqueued; buffers are freed in order on the runtime's stream.
        unsafe { gated_pool_f32(&self.rt, &members, groups.len(), ratio, head_dim, &mut out) }
            .map_err(op_err(OP))?;
        drop(keep);
        Ok(self.tensor(out))
    }

    /// [`CudaBackend::try_gated_pool_rows`] of groups of different sizes: each run of
    /// consecutive groups of one size pooled in one launch (a group without members pools to
    /// zeros, as on the CPU), then the runs gathered in order.
    fn gated_pool_runs(
        &self,
        groups: &[Vec<&Tensor>],
        head_dim: usize,
    ) -> Result<Tensor, CudaBackendError> {
        let mut runs: Vec<Tensor> = Vec::new();
        let mut start = 0;
        while start < groups.len() {
            let size = groups[start].len();
            let end = start
                + groups[start..]
                    .iter()
                    .take_while(|members| members.len() == size)
                    .count();
            runs.push(if size == 0 {
                vec![0.0f32; (end - start) * head_dim].into()
            } else {
                self.try_gated_pool_rows(&groups[start..end], head_dim)?
            });
            start = end;
        }
        let pieces: Vec<(&Tensor, usize)> = runs
            .iter()
            .flat_map(|run| (0..run.len() / head_dim).map(move |g| (run, g * head_dim)))
            .collect();
        self.try_gather(&pieces, head_dim)
    }

    /// [`Backend::engram_inject`], with errors: one block per live token, the streams changed in
    /// place when they are the only holder of their buffer; the gate's `q ⊙ k` weight is cached
    /// like a model weight.
    pub fn try_engram_inject(
        &self,
        streams: Tensor,
        injection: EngramInjection<'_>,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "engram_inject";
        let EngramInjection { kv, live, gate } = injection;
        if live.is_empty() {
            return Ok(streams);
        }
        if !kv.len().is_multiple_of(live.len()) {
            return Err(shape_err(
                OP,
                format!(
                    "kv ({} values) is not one row per live token ({})",
                    kv.len(),
                    live.len()
                ),
            ));
        }
        let token_width = gate.hc_mult() * gate.dim();
        let tokens = streams.len() / token_width.max(1);
        let ids = live
            .iter()
            .map(|&token| u32::try_from(token).ok().filter(|_| token < tokens))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| {
                shape_err(
                    OP,
                    format!("live tokens {live:?} are not all below the {tokens} of the streams"),
                )
            })?;
        let dlive = self
            .rt
            .htod(&ids)
            .map_err(driver_err(OP, "uploading the live tokens"))?;
        let dkv = self.input(OP, kv)?;
        let dweight = self.cached_f32(OP, gate.weight())?;
        let shape = EngramInjectShape {
            hc: gate.hc_mult(),
            dim: gate.dim(),
            kv_stride: kv.len() / live.len(),
            eps: gate.eps(),
        };
        self.in_place(OP, streams, |data| {
            engram_inject_f32(&self.rt, data, &dkv, &dlive, &dweight, shape).map_err(op_err(OP))
        })
    }
}

impl CudaBackend {
    /// [`Backend::add`], with errors: in place when `x` is the only holder of its buffer.
    pub fn try_add(&self, x: Tensor, y: &Tensor) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "add";
        if x.len() != y.len() {
            return Err(shape_err(
                OP,
                format!("x has {} values, y {}", x.len(), y.len()),
            ));
        }
        if x.is_empty() {
            return Ok(x);
        }
        let dy = self.input(OP, y)?;
        self.in_place(OP, x, |dx| add_f32(&self.rt, dx, &dy).map_err(op_err(OP)))
    }

    /// [`Backend::argmax_rows`], with errors: the device sampler's greedy rows (the first maximum,
    /// as the trait's definition on rows without NaN); only the ids come back.
    pub fn try_argmax_rows(&self, x: &Tensor, width: usize) -> Result<Vec<u32>, CudaBackendError> {
        const OP: &str = "argmax_rows";
        whole_rows(OP, x, width)?;
        if x.is_empty() {
            return Ok(Vec::new());
        }
        let greedy = RowSampling {
            params: crate::sampling::SamplingParams::greedy(),
            position: 0,
        };
        let rows = vec![greedy; x.len() / width];
        let dx = self.input(OP, x)?;
        self.sample_device_rows(&dx, width, &rows)
    }
}
