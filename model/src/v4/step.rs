//! One V4 forward over every sequence of a step. Each sequence's chunk of tokens becomes rows of
//! one matrix and every layer runs once over all rows (the GEMMs' M is the step's token count), on
//! [`Tensor`]s that stay where the backend computed them; only what belongs to a sequence runs per
//! sequence: window pushes, the compressors' pending rows and entries, the indexer's selection, the
//! key lists and the speculative heads' state. No op mixes rows, so a sequence's logits are bitwise
//! those of running it alone.

use super::state::{LayerState, SequenceState};
use super::{Model, attention, block};
use crate::backend::{StreamShape, Tensor};
use crate::error::ModelError;
use crate::layers::ctx::{Ctx, at_layer};
use crate::layers::step::{
    COMPACT_AFTER, EmbeddedRow, EntryOutput, EntryWant, HeadLogits, StepOptions, StepRows,
    embedded_streams, entry_outputs, entry_wants, gather_rows, row_sampling, rows_of, wanted_rows,
};

/// One sequence's part of a V4 step ([`Model::forward_step`]); the V4 family has no decoder
/// bounded replay (`decoder_from` must be `None`).
pub type StepEntry<'a> = crate::layers::step::StepEntry<'a, SequenceState>;

impl Model {
    /// One forward over several sequences at once: each entry's tokens are appended at its
    /// sequence's next positions; returns, per entry and in order, its logits rows (as
    /// a one-entry step returns them for that entry alone, bit for bit) or, for an entry that
    /// asks to `sample`, the tokens sampled from them on the backend (the logits then never leave
    /// the device). `options.experts` runs the backbone's routed experts elsewhere (expert
    /// parallelism: the router — a hash layer's `tid2eid` picks included —, the combine order and
    /// the shared expert stay here, so the logits are bitwise the same when it honours the
    /// [`crate::expert_dispatch::RoutedExperts`] contract); a V4 model reads every logits row on
    /// the host (`options.logits_on_device` has no effect). Every entry is checked before any
    /// state changes: a bad entry fails the step naming its index.
    pub fn forward_step(
        &self,
        entries: &mut [StepEntry<'_>],
        options: StepOptions<'_>,
    ) -> Result<Vec<EntryOutput>, ModelError> {
        let experts = options.experts;
        self.check_step(entries, experts.is_some(), |e, entry| {
            if entry.decoder_from.is_some() {
                return Err(ModelError::Unsupported {
                    what: format!("step entry {e}: decoder bounded replay on a V4-family model"),
                });
            }
            self.check_chunk(entry.seq, entry.tokens)
        })?;
        let cfg = &self.cfg;
        let ctx = self.ctx();
        let precision = cfg.precision();
        let (hc, dim) = (cfg.hc.mult, cfg.dim);
        let width = hc * dim;
        let rows = StepRows::new(
            entries
                .iter()
                .map(|entry| (entry.seq.len, entry.tokens.len())),
        );
        let tokens: Vec<u32> = entries
            .iter()
            .flat_map(|entry| entry.tokens.iter().copied())
            .collect();
        let wants = entry_wants(entries);
        let mut seqs: Vec<&mut SequenceState> =
            entries.iter_mut().map(|entry| &mut *entry.seq).collect();

        let embedded = tokens.iter().map(|&token| EmbeddedRow::Token(token));
        let mut streams = embedded_streams(ctx.backend, &self.weights.embed, embedded, dim, hc);
        let targets = cfg
            .dspark
            .as_ref()
            .filter(|_| self.weights.dspark.is_some())
            .map_or(&[][..], |d| &d.target_layers[..]);
        // The mean streams entering each target layer `[n, dim]`, in the config's target order.
        let mut taps: Vec<Tensor> = vec![Tensor::empty(); targets.len()];
        for (l, layer) in self.weights.backbone.layers.iter().enumerate() {
            for (tap, _) in taps.iter_mut().zip(targets).filter(|(_, t)| **t == l) {
                *tap = ctx
                    .backend
                    .stream_means_at(&streams, StreamShape { hc, dim }, precision);
            }
            let table = ctx.rope.for_layer(cfg, l);
            let mut states: Vec<&mut LayerState> =
                seqs.iter_mut().map(|seq| &mut seq.layers[l]).collect();
            block::forward(
                &at_layer(ctx, experts, l),
                layer,
                &mut streams,
                &tokens,
                |xn| {
                    attention::forward_rows(
                        &ctx,
                        &layer.attn,
                        table,
                        xn,
                        &rows,
                        &mut states,
                        &self.weights.unit,
                    )
                },
            );
        }
        if self.weights.mtp.is_some() || self.weights.dspark.is_some() {
            for ((seq, span), entry_tokens) in seqs
                .iter_mut()
                .zip(&rows.spans)
                .zip(rows.spans.iter().map(|span| &tokens[span.clone()]))
            {
                let entry_streams = streams.rows(span.clone(), width);
                let entry_taps: Vec<Tensor> =
                    taps.iter().map(|tap| tap.rows(span.clone(), dim)).collect();
                self.advance_speculative(
                    &ctx,
                    seq,
                    entry_tokens,
                    &entry_streams,
                    &entry_taps,
                    &rows.positions[span.clone()],
                );
            }
        }
        let outputs = self.head_rows(&ctx, &rows, &wants, &streams)?;
        for (seq, span) in seqs.iter_mut().zip(&rows.spans) {
            seq.len += span.len();
            seq.trim(cfg.window_size);
            if span.len() > COMPACT_AFTER {
                seq.compact(ctx.backend);
            }
            seq.pack_caches(ctx.backend);
        }
        Ok(outputs)
    }

    /// The hyper-head collapse, norm and head over the rows each entry wants: one head GEMM for
    /// the entries that want logits, one sampled head for those that sample.
    fn head_rows(
        &self,
        ctx: &Ctx,
        rows: &StepRows,
        wants: &[EntryWant],
        streams: &Tensor,
    ) -> Result<Vec<EntryOutput>, ModelError> {
        let cfg = &self.cfg;
        let (width, vocab) = (cfg.hc.mult * cfg.dim, cfg.vocab_size);
        let (backend, head) = (ctx.backend, &*self.weights.head);
        let wanted = wanted_rows(rows, wants, true);
        let hidden_of = |selected: &[usize]| {
            let x = gather_rows(backend, streams, selected.iter().copied(), width);
            let h = block::hyper_head(ctx, &self.weights.hyper_head, &x);
            backend.rms_norm(&h, ctx.norm(&self.weights.norm, cfg.precision()))
        };
        let logit_rows: Vec<usize> = rows_of(&wanted, wants, false).collect();
        // A dense head is fp32 in both numerics (as V4.1's): the sampled rows below take it
        // through `sample_linear`, so the logits returned are those the tokens are sampled from.
        let logits = if logit_rows.is_empty() {
            Vec::new()
        } else {
            let hidden = hidden_of(&logit_rows);
            match head.dense() {
                Some(dense) => backend.linear_f32(&hidden, dense),
                None => head.apply(backend, &hidden),
            }
            .into_vec()
        };
        let sampled_rows: Vec<usize> = rows_of(&wanted, wants, true).collect();
        let sampling = row_sampling(rows, &wanted, wants);
        let tokens = if sampled_rows.is_empty() {
            Vec::new()
        } else {
            let hidden = hidden_of(&sampled_rows);
            match head.dense() {
                Some(dense) => backend.sample_linear(&hidden, dense, &sampling),
                None => {
                    let logits = head.apply(backend, &hidden);
                    backend.sample_rows(&logits, vocab, &sampling)
                }
            }
            .map_err(|e| ModelError::Sequence {
                message: e.to_string(),
            })?
        };
        let logits = HeadLogits::Host(logits);
        Ok(entry_outputs(&wanted, wants, &tokens, &logits, vocab))
    }
}
