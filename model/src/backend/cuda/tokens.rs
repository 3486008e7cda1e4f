//! The ops of [`CudaBackend`] that turn rows into ids: token sampling (only the ids come back;
//! a grammar's masks go up as bitsets and are applied on the device) and the sampled tokens'
//! log-probabilities (only those and the alternatives come back), the MoE router after its
//! gate linear, and the Engram table lookup.

use deepinfer_kernels::ops::sampling::{
    LOGPROB_LANES, LogprobOutputs, MAX_TOP_LOGPROBS, mask_logits_f32, mask_words_per_row,
    token_logprobs_f32,
};

use super::*;
use crate::backend::LogprobPick;
use crate::sampling::{AllowedTokens, TokenLogprobs};

// The kernel's sum order and output stride are the reference's.
const _: () = assert!(LOGPROB_LANES as usize == crate::sampling::LOGPROB_LANES);
const _: () = assert!(MAX_TOP_LOGPROBS == crate::sampling::MAX_TOP_LOGPROBS);

impl CudaBackend {
    /// [`Backend::sample_rows`], with errors: the logits are uploaded, every row sampled by the
    /// device's sampling kernel, and only the ids come back. Rows that restrict (top-k / top-p)
    /// take a sort scratch of the vocabulary's next power of two per row.
    pub fn try_sample_rows(
        &self,
        logits: &[f32],
        vocab: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, CudaBackendError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let dlogits = self.upload("sample_rows", logits)?;
        self.sample_device_rows(&dlogits, vocab, rows)
    }

    /// [`Backend::sample_linear`], with errors: the fp32 logits `x · Wᵀ` are computed into a
    /// device buffer as [`Backend::linear_f32`] computes them (`linear_f32_into`, in either
    /// numerics) and sampled there; only the ids come back to the host.
    pub fn try_sample_linear(
        &self,
        x: &Tensor,
        head: DenseWeight<'_>,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, CudaBackendError> {
        const OP: &str = "sample_linear";
        let (w, out, inp) = (head.values, head.out, head.inp);
        if inp == 0 || out == 0 || x.len() != rows.len() * inp || w.len() < out * inp {
            return Err(shape_err(
                OP,
                format!(
                    "x holds {} values and w {}: not {} rows of {inp} against {out} outputs",
                    x.len(),
                    w.len(),
                    rows.len()
                ),
            ));
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let dx = self.input(OP, x)?;
        // SAFETY: linear_f32_into writes each of the rows * out logits (linear_sgemm_f32's
        // reduction, or linear_bf16_fast storing every row < rows and column < out).
        let mut dlogits = unsafe { self.alloc_written(OP, rows.len() * out) }?;
        self.linear_f32_into(
            OP,
            &dx,
            &w[..out * inp],
            &mut dlogits,
            (rows.len(), out, inp),
        )?;
        self.sample_device_rows(&dlogits, out, rows)
    }

    /// [`Backend::sample_masked`], with errors (the shapes and masks checked by the caller): the
    /// logits are read where they are (copied device to device, since the masks change them),
    /// the masks uploaded as one bitset per row (all ones for an unmasked row) and applied by
    /// the mask kernel, the rows sampled by the sampling kernel; only the ids come back.
    pub fn try_sample_masked(
        &self,
        masked: MaskedRows<'_, RowSampling>,
    ) -> Result<Vec<u32>, CudaBackendError> {
        const OP: &str = "sample_masked";
        let (logits, vocab, rows) = (masked.logits, masked.vocab, masked.rows);
        let allowed = masked.allowed;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let masked = allowed.iter().any(Option::is_some);
        if !masked {
            let dlogits = self.input(OP, logits)?;
            return self.sample_device_rows(&dlogits, vocab, rows);
        }
        let dlogits = self.masked_copy(OP, logits, vocab, allowed)?;
        self.sample_device_rows(&dlogits, vocab, rows)
    }

    /// A device copy of the logits rows with each row's mask applied (all ones for an unmasked
    /// row): the bitsets go up, the mask kernel sets the disallowed logits to −∞.
    fn masked_copy(
        &self,
        op: &'static str,
        logits: &Tensor,
        vocab: usize,
        allowed: &[Option<&AllowedTokens>],
    ) -> Result<CudaSlice<f32>, CudaBackendError> {
        let per_row = mask_words_per_row(vocab);
        let mut words = Vec::with_capacity(allowed.len() * per_row);
        for (row, mask) in allowed.iter().enumerate() {
            match mask {
                Some(mask) => words.extend(
                    mask.row_words(vocab)
                        .map_err(|e| shape_err(op, format!("row {row}: {e}")))?,
                ),
                None => words.extend(std::iter::repeat_n(u32::MAX, per_row)),
            }
        }
        let mut dlogits = self.input(op, logits)?.into_owned(self, op)?;
        if allowed.iter().any(Option::is_some) {
            let dwords = self
                .rt
                .stream()
                .clone_htod(&words)
                .map_err(driver_err(op, "uploading the masks"))?;
            mask_logits_f32(&self.rt, &mut dlogits, &dwords, allowed.len(), vocab)
                .map_err(op_err(op))?;
        }
        Ok(dlogits)
    }

    /// [`Backend::token_logprobs_masked`], with errors (the shapes and masks checked by the
    /// caller): the rows are copied and masked on the device, the log-probability kernel runs
    /// one block per row, and only each row's log-probability and alternatives come back.
    pub fn try_token_logprobs_masked(
        &self,
        masked: MaskedRows<'_, LogprobPick>,
    ) -> Result<Vec<TokenLogprobs>, CudaBackendError> {
        const OP: &str = "token_logprobs_masked";
        let (logits, vocab, picks) = (masked.logits, masked.vocab, masked.rows);
        let allowed = masked.allowed;
        if picks.is_empty() {
            return Ok(Vec::new());
        }
        let dlogits = self.masked_copy(OP, logits, vocab, allowed)?;
        let top = picks.iter().map(|p| p.top).max().unwrap_or(0);
        let top = top.min(MAX_TOP_LOGPROBS);
        let tokens: Vec<u32> = picks.iter().map(|p| p.token).collect();
        let stream = self.rt.stream();
        let dtokens = stream
            .clone_htod(&tokens)
            .map_err(driver_err(OP, "uploading the tokens"))?;
        // Stay zeroed: token_logprobs_f32 writes only `top` of each row's MAX_TOP_LOGPROBS.
        let mut dchosen = self.alloc_zeroed(OP, picks.len())?;
        let mut dtop_ids = self.alloc_zeroed::<u32>(OP, picks.len() * MAX_TOP_LOGPROBS)?;
        let mut dtop = self.alloc_zeroed(OP, picks.len() * MAX_TOP_LOGPROBS)?;
        let out = LogprobOutputs {
            chosen: &mut dchosen,
            top_ids: &mut dtop_ids,
            top_logprobs: &mut dtop,
        };
        token_logprobs_f32(&self.rt, &dlogits, &dtokens, out, vocab, top).map_err(op_err(OP))?;
        let chosen = self.download(OP, &dchosen)?;
        let top_ids = self.to_host(OP, &dtop_ids, "downloading the alternatives")?;
        let top_logprobs = self.download(OP, &dtop)?;
        Ok(picks
            .iter()
            .enumerate()
            .map(|(r, pick)| {
                let row = r * MAX_TOP_LOGPROBS..r * MAX_TOP_LOGPROBS + pick.top.min(top);
                TokenLogprobs {
                    token: pick.token,
                    logprob: chosen[r],
                    top: top_ids[row.clone()]
                        .iter()
                        .zip(&top_logprobs[row])
                        .take_while(|(id, _)| **id != u32::MAX)
                        .map(|(&id, &lp)| (id, lp))
                        .collect(),
                }
            })
            .collect())
    }

    /// Samples `rows.len()` rows of `vocab` logits already on the device (`sample_rows`'s math);
    /// only the ids are downloaded.
    pub(super) fn sample_device_rows(
        &self,
        dlogits: &CudaSlice<f32>,
        vocab: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, CudaBackendError> {
        const OP: &str = "sample_rows";
        let vocab_u32 =
            u32::try_from(vocab).map_err(|_| shape_err(OP, format!("vocabulary of {vocab}")))?;
        let host_rows: Vec<SampleRow> = rows
            .iter()
            .map(|r| SampleRow {
                seed: r.params.seed,
                position: r.position,
                temperature: r.params.temperature,
                top_p: r.params.top_p,
                // At or beyond the vocabulary top-k keeps everything, as it does on the CPU.
                top_k: u32::try_from(r.params.top_k).map_or(vocab_u32, |k| k.min(vocab_u32)),
                reserved: 0,
            })
            .collect();
        let restricted = host_rows.iter().any(|r| r.restricts(vocab));
        let stream = self.rt.stream();
        let drows = stream
            .clone_htod(&host_rows)
            .map_err(driver_err(OP, "uploading the row parameters"))?;
        let mut scratch =
            SampleScratch::new(&self.rt, rows.len(), vocab, restricted).map_err(op_err(OP))?;
        // Stays zeroed: sample_rows_f32's many paths not audited (one memset per step).
        let mut dtokens = self.alloc_zeroed::<u32>(OP, rows.len())?;
        sample_rows_f32(
            &self.rt,
            dlogits,
            &drows,
            &host_rows,
            &mut scratch,
            &mut dtokens,
            vocab,
        )
        .map_err(op_err(OP))?;
        self.transfers
            .sampled_id_copies
            .fetch_add(1, Ordering::Relaxed);
        stream
            .clone_dtoh(&dtokens)
            .map_err(driver_err(OP, "downloading the tokens"))
    }

    /// [`Backend::route_experts`], with errors.
    pub fn try_route_experts(
        &self,
        logits: &Tensor,
        routing: Routing<'_>,
    ) -> Result<Vec<ExpertRoute>, CudaBackendError> {
        const OP: &str = "route_experts";
        let Routing {
            bias,
            selection,
            route_scale,
        } = routing;
        let n_experts = bias.len();
        if n_experts == 0 || logits.len() < n_experts {
            return Ok(Vec::new());
        }
        let rows = logits.len() / n_experts;
        let logits = logits.range(0..rows * n_experts);
        let stream = self.rt.stream();
        let dbias = self.cached_f32(OP, bias)?;
        let dlogits = self.input(OP, &logits)?;
        let forced_ids: Vec<u32>;
        let dforced;
        let device_selection = match selection {
            ExpertSelection::TopK(k) => RouteSelection::TopK(k),
            ExpertSelection::Forced(forced) => {
                // Ids at or beyond the expert count are dropped, as on the CPU.
                forced_ids = forced
                    .iter()
                    .filter(|&&e| e < n_experts)
                    .map(|&e| e as u32)
                    .collect();
                if forced_ids.is_empty() {
                    let empty = ExpertRoute {
                        experts: Vec::new(),
                        weights: Vec::new(),
                    };
                    return Ok(vec![empty; rows]);
                }
                dforced = stream
                    .clone_htod(&forced_ids)
                    .map_err(driver_err(OP, "uploading the forced experts"))?;
                RouteSelection::Forced(&dforced)
            }
        };
        let selected = selected_count(device_selection, n_experts);
        if selected == 0 {
            let empty = ExpertRoute {
                experts: Vec::new(),
                weights: Vec::new(),
            };
            return Ok(vec![empty; rows]);
        }
        // SAFETY (both): route_experts_f32's block per row writes all its ids and weights.
        let mut dexperts = unsafe { self.alloc_written::<u32>(OP, rows * selected) }?;
        let mut dweights = unsafe { self.alloc_written(OP, rows * selected) }?;
        route_experts_f32(
            &self.rt,
            &dlogits,
            &dbias,
            device_selection,
            route_scale,
            &mut dexperts,
            &mut dweights,
        )
        .map_err(op_err(OP))?;
        let experts = self.to_host(OP, &dexperts, "downloading the experts")?;
        let weights = self.download(OP, &dweights)?;
        Ok(experts
            .chunks_exact(selected)
            .zip(weights.chunks_exact(selected))
            .map(|(experts, weights)| ExpertRoute {
                experts: experts.iter().map(|&e| e as usize).collect(),
                weights: weights.to_vec(),
            })
            .collect())
    }

    /// [`Backend::engram_gather`], with errors. The table is uploaded to device memory on first
    /// use and cached like a weight (see the module header); only the ids travel per call.
    pub fn try_engram_gather(
        &self,
        table: &EngramTable,
        row_ids: &[u32],
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "engram_gather";
        if row_ids.is_empty() {
            return Ok(Tensor::empty());
        }
        let dtable = self.cached(
            (
                HostKey::bytes(table.codes()),
                HostKey::bytes(table.scales()),
            ),
            |cache| &mut cache.engram_tables,
            || {
                DeviceEngramTable::upload(
                    &self.rt,
                    table.rows(),
                    table.head_dim(),
                    table.codes(),
                    table.scales(),
                )
                .map_err(op_err(OP))
            },
        )?;
        let dids = self
            .rt
            .stream()
            .clone_htod(row_ids)
            .map_err(driver_err(OP, "uploading the row ids"))?;
        // SAFETY: engram_gather_f32 writes every (id, channel), zeros for ids past the table.
        let mut dout = unsafe { self.alloc_written(OP, row_ids.len() * table.head_dim()) }?;
        engram_gather_f32(&self.rt, &dtable, &dids, &mut dout).map_err(op_err(OP))?;
        Ok(self.tensor(dout))
    }
}
