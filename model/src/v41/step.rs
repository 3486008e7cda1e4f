//! One forward over every sequence of a step. Each sequence's chunk of tokens becomes rows of one
//! matrix and every block runs once over all rows (the GEMMs' M is the step's token count); only
//! what belongs to a sequence runs per sequence: window pushes, compressors, the indexer's
//! selection, the key lists, the Engram history and the DSpark rings. No op mixes rows, so a
//! sequence's logits are bitwise those of running it alone (batch invariance).

use super::context_parallel::CpRank;
use super::csa::{self, StepShared};
use super::state::SequenceState;
use super::trace::ForwardTrace;
use super::vision::ImageChunk;
use super::{Model, attention, block, dspark};
use crate::backend::{
    Backend, DenseWeight, LogprobPick, MaskedRows, Precision, RowSampling, StreamShape, Tensor,
};
use crate::engram::EngramPart;
use crate::error::ModelError;
use crate::layers::ctx::{Ctx, at_layer};
use crate::layers::mhc;
use crate::layers::moe::ImageRouting;
use crate::layers::step::{
    COMPACT_AFTER, EmbeddedRow, EntryOutput, EntryWant, HeadLogits, StepRows, embedded_streams,
    entry_outputs, entry_wants, gather_rows, row_sampling, rows_of, wanted_rows,
};
use crate::sampling::{AllowedTokens, SamplingParams, TokenLogprobs};

/// One sequence's part of a V4.1 step ([`Model::forward_step`]).
pub type StepEntry<'a> = crate::layers::step::StepEntry<'a, SequenceState>;

/// How a V4.1 step runs beyond its entries: the shared options and [`StepExtras`].
pub type StepOptions<'a> = crate::layers::step::StepOptions<'a, StepExtras<'a>>;

/// What only a V4.1 step runs. Each applies to a one-entry step; the default is none of them.
#[derive(Default)]
pub struct StepExtras<'a> {
    /// Records the entry's intermediates (and forces its injected decisions).
    pub trace: Option<&'a mut ForwardTrace>,
    /// The image spans of the entry's chunk ([`Model::place_images`]).
    pub images: Option<&'a ImageChunk<'a>>,
    /// This rank's part of a context-parallel chunk: the entry's tokens are the whole chunk, every
    /// rank of the group runs the step at once with its own copy of the sequence state; only the
    /// rank's own rows are computed (`LogitsWanted::Last`: only the rank owning the chunk's last
    /// token gets a row) and the sequence ends as the single-rank prefill leaves it
    /// (`context_parallel`). Not with bounded replay, sampling, a trace or images.
    pub cp: Option<&'a CpRank<'a>>,
}

impl<'a> StepOptions<'a> {
    /// A one-entry step that records its intermediates into `trace`.
    pub fn traced(trace: &'a mut ForwardTrace) -> Self {
        StepOptions {
            family: StepExtras {
                trace: Some(trace),
                ..StepExtras::default()
            },
            ..StepOptions::default()
        }
    }

    /// A one-entry step whose chunk holds the image spans `images`.
    pub fn with_images(images: &'a ImageChunk<'a>) -> Self {
        StepOptions {
            family: StepExtras {
                images: Some(images),
                ..StepExtras::default()
            },
            ..StepOptions::default()
        }
    }
}

/// One logits row to sample after its step ([`Model::sample_rows`]), typically the last row of
/// an [`EntryOutput::DeviceLogits`] once a grammar's mask for it is known.
#[derive(Debug, Clone, Copy)]
pub struct LogitsRow<'a> {
    /// One `vocab`-wide row.
    pub logits: &'a Tensor,
    pub params: SamplingParams,
    /// Absolute position of the token being sampled (the noise's counter): the position of the
    /// row's own token plus one.
    pub position: u64,
    /// The tokens the row may take; `None`: every token.
    pub allowed: Option<&'a AllowedTokens>,
}

/// Keeps the `width`-wide rows whose flag is set.
fn retain_rows(backend: &dyn Backend, values: &mut Tensor, kept: &[bool], width: usize) {
    let rows = kept.iter().enumerate().filter(|(_, keep)| **keep);
    *values = gather_rows(backend, values, rows.map(|(r, _)| r), width);
}

impl Model {
    /// One forward over several sequences at once: each entry's tokens are appended at its
    /// sequence's next positions (from `decoder_from` on with bounded replay); returns, per entry
    /// and in order, its logits rows (`[n, vocab]` for [`LogitsWanted::All`], `[vocab]` for
    /// [`LogitsWanted::Last`]; bit for bit those of the entry run alone) or, for an entry that
    /// asks to `sample`, the tokens sampled from them on the backend (the logits then never leave
    /// the device). `options.experts` runs the routed experts elsewhere (expert parallelism: the
    /// router, the combine order and the shared expert stay here, so the logits are bitwise the
    /// same when it honours the [`crate::expert_dispatch::RoutedExperts`] contract); with
    /// `options.logits_on_device` the unsampled entries' rows stay on the backend
    /// ([`EntryOutput::DeviceLogits`]), so that a grammar-constrained row can be sampled by
    /// [`Model::sample_rows`] once its mask is known, with nothing but the ids ever copied to the
    /// host; `options.family` traces, places images or runs a context-parallel rank's part
    /// ([`StepExtras`], one entry). Every entry is checked before any state changes: a bad entry
    /// fails the step naming its index.
    ///
    /// [`LogitsWanted::All`]: crate::layers::step::LogitsWanted::All
    /// [`LogitsWanted::Last`]: crate::layers::step::LogitsWanted::Last
    pub fn forward_step(
        &self,
        entries: &mut [StepEntry<'_>],
        options: StepOptions<'_>,
    ) -> Result<Vec<EntryOutput>, ModelError> {
        let StepOptions {
            experts,
            logits_on_device,
            family:
                StepExtras {
                    mut trace,
                    images,
                    cp,
                },
        } = options;
        self.check_extras(entries, trace.is_some(), images, cp)?;
        self.check_step(entries, experts.is_some(), |_, entry| {
            self.check_chunk(entry.seq, entry.tokens)
        })?;
        if entries.iter().any(|entry| entry.decoder_from.is_some()) {
            self.check_replay_boundary()?;
        }
        let cfg = &self.cfg;
        let ctx = self.ctx();
        let (hc, dim) = (cfg.hc.mult, cfg.dim);
        let width = hc * dim;
        let chunks: Vec<&[u32]> = entries.iter().map(|entry| entry.tokens).collect();
        let wants = entry_wants(entries);
        // Leading rows of each chunk before its decoder suffix (bounded replay).
        let dropped: Vec<usize> = entries
            .iter()
            .map(|entry| {
                entry.decoder_from.map_or(0, |from| {
                    from.saturating_sub(entry.seq.len).min(entry.tokens.len())
                })
            })
            .collect();
        let mut rows = match cp {
            Some(cp) => StepRows::single(&cp.own_positions()),
            None => StepRows::new(
                entries
                    .iter()
                    .map(|entry| (entry.seq.len, entry.tokens.len())),
            ),
        };
        // The tokens of the rows computed here (a CP rank's own, else every chunk's).
        let row_tokens: Vec<u32> = match cp {
            Some(cp) => cp.own_rows().iter().map(|&o| chunks[0][o]).collect(),
            None => chunks.concat(),
        };
        let mut seqs: Vec<&mut SequenceState> =
            entries.iter_mut().map(|entry| &mut *entry.seq).collect();
        let truncate_at = if dropped.iter().any(|&d| d > 0) {
            self.replay_boundary()
        } else {
            None
        };
        if let Some(trace) = trace.as_deref_mut() {
            trace.reset(cfg.n_layers);
        }

        // Image-span rows: dead to Engram, routed with bias_vl (spec §3.1, §3.6).
        let n_rows = rows.positions.len();
        let dead = images.map_or_else(|| vec![false; n_rows], |chunk| chunk.image_rows().to_vec());
        let mut image_rows = dead.clone();
        let engram_rows: Option<Vec<_>> = self.weights.engram.as_ref().map(|engram| {
            seqs.iter_mut()
                .zip(&chunks)
                .zip(&rows.spans)
                .map(|((seq, tokens), span)| match cp {
                    // Every rank hashes the whole chunk (the history needs it), keeps its rows.
                    Some(cp) => engram
                        .hasher()
                        .hash_chunk(&mut seq.engram, tokens, &[])
                        .select(cp.own_rows()),
                    None => {
                        let dead = &dead[span.clone()];
                        engram.hasher().hash_chunk(&mut seq.engram, tokens, dead)
                    }
                })
                .collect()
        });
        let embedded = row_tokens.iter().enumerate().map(|(i, &token)| {
            images
                .and_then(|chunk| chunk.embeddings().get(i).copied().flatten())
                .map_or(EmbeddedRow::Token(token), EmbeddedRow::Given)
        });
        let mut streams = embedded_streams(ctx.backend, &self.weights.embed, embedded, dim, hc);
        let mut pre = ctx.backend.resident(
            (0..n_rows * hc)
                .map(|i| if i % hc == 0 { 1.0 } else { 0.0 })
                .collect::<Vec<f32>>()
                .into(),
        );
        let targets = cfg
            .dspark
            .as_ref()
            .map_or(&[][..], |d| &d.target_layers[..]);
        let mut taps: Vec<Tensor> = Vec::new();
        let mut shared = StepShared::default();

        for (l, block_weights) in self.weights.backbone.layers.iter().enumerate() {
            if truncate_at == Some(l) {
                // Decoder boundary: its compressor sees every token, everything else only the tail.
                if let Some(weights) = &block_weights.attn.compressor {
                    let leading = || {
                        rows.spans
                            .iter()
                            .zip(&dropped)
                            .flat_map(|(span, &d)| span.start..span.start + d)
                    };
                    let xn = block::attention_inputs(
                        &ctx,
                        block_weights,
                        &gather_rows(ctx.backend, &streams, leading(), width),
                        &gather_rows(ctx.backend, &pre, leading(), hc),
                    );
                    let inputs = csa::compressor_inputs(&ctx, weights, &xn);
                    let leading_rows: usize = dropped.iter().sum();
                    let input_width = inputs.len() / leading_rows.max(1);
                    let mut at = 0;
                    let mut jobs = Vec::new();
                    for ((seq, span), &d) in seqs.iter_mut().zip(&rows.spans).zip(&dropped) {
                        if let (Some(state), true) = (seq.layers[l].compressor.as_mut(), d > 0) {
                            jobs.push(csa::CompressJob {
                                state,
                                inputs: inputs.rows(at..at + d, input_width),
                                positions: &rows.positions[span.start..span.start + d],
                            });
                        }
                        at += d;
                    }
                    csa::compress_chunk(&ctx, weights, jobs, l);
                }
                let kept = rows.drop_leading(&dropped);
                retain_rows(ctx.backend, &mut streams, &kept, width);
                retain_rows(ctx.backend, &mut pre, &kept, hc);
                image_rows = image_rows
                    .iter()
                    .zip(&kept)
                    .filter(|(_, keep)| **keep)
                    .map(|(&image, _)| image)
                    .collect::<Vec<bool>>();
                if rows.positions.is_empty() {
                    self.idle_expert_layers(l);
                    break;
                }
            }
            inject_streams(trace.as_deref(), l, &mut streams, &mut pre);
            let engram_index = cfg
                .engram
                .as_ref()
                .and_then(|e| e.layer_ids.iter().position(|&id| id == l));
            if let (Some(engram), Some(hashed), Some(index)) =
                (&self.weights.engram, &engram_rows, engram_index)
            {
                let parts: Vec<EngramPart<'_>> = rows
                    .spans
                    .iter()
                    .zip(hashed)
                    .map(|(span, hashed)| EngramPart {
                        rows: hashed,
                        span: span.clone(),
                        dead: &dead[span.clone()],
                    })
                    .collect();
                streams = engram.apply_step(ctx.backend, index, &parts, streams);
                if let Some(trace) = trace.as_deref_mut() {
                    trace.engram_out[l] = streams.to_vec();
                }
            }
            if targets.contains(&l) {
                taps.push(ctx.backend.stream_means_at(
                    &streams,
                    StreamShape { hc, dim },
                    Precision::Bf16,
                ));
            }
            let forced_routes = trace
                .as_deref()
                .and_then(|t| t.inject.routes.get(l).cloned().flatten());
            let attn_trace = trace.as_deref_mut();
            let block_ctx = Ctx {
                image_routing: images.and_then(|chunk| {
                    let bias_vl = chunk.router_bias().get(l)?;
                    Some(ImageRouting::new(&image_rows, bias_vl))
                }),
                ..at_layer(ctx, experts, l)
            };
            let (seqs, shared, rows) = (&mut seqs, &mut shared, &rows);
            let routes = block::forward(
                &block_ctx,
                block_weights,
                &mut streams,
                &mut pre,
                forced_routes.as_deref(),
                attn_trace.is_some(),
                |xn| {
                    attention::forward(
                        &ctx,
                        &block_weights.attn,
                        l,
                        xn,
                        rows,
                        seqs,
                        shared,
                        attn_trace,
                        cp,
                    )
                },
            );
            if let Some(err) = cp.and_then(CpRank::failure) {
                return Err(err);
            }
            if let Some(trace) = trace.as_deref_mut() {
                trace.layer_out[l] = streams.to_vec();
                trace.layer_pre[l] = pre.to_vec();
                trace.route_idx[l] = routes.iter().map(|r| r.experts.clone()).collect();
                trace.route_w[l] = routes.iter().map(|r| r.weights.clone()).collect();
            }
        }
        inject_streams(trace.as_deref(), cfg.n_layers, &mut streams, &mut pre);
        // A CP rank has the chunk's last row only if it computes the last token.
        let holds_last = cp.is_none_or(CpRank::owns_last);
        let wanted = wanted_rows(&rows, &wants, holds_last);
        let outputs = self.head_rows(
            &ctx,
            &rows,
            (&wanted, &wants),
            (&streams, &pre),
            trace.as_deref_mut(),
            logits_on_device,
        )?;

        if let Some(weights) = self
            .weights
            .dspark
            .as_ref()
            .filter(|_| !rows.positions.is_empty())
        {
            // Per row, its taps side by side: `[rows, taps · dim]`.
            let main_hidden: Tensor =
                match trace.as_deref().and_then(|t| t.inject.main_hidden.clone()) {
                    Some(injected) => injected.into(),
                    None => {
                        let pieces: Vec<(&Tensor, usize)> = (0..rows.positions.len())
                            .flat_map(|t| taps.iter().map(move |tap| (tap, t * dim)))
                            .collect();
                        ctx.backend.gather(&pieces, dim)
                    }
                };
            let stage_entries =
                dspark::context_entries(&ctx, weights, &main_hidden, &rows.positions);
            let head_dim = cfg.head_dim;
            // A CP rank's rings take every rank's entries (the DSpark stage gathers last).
            let gathered = cp.map(|cp| {
                let entries = stage_entries.iter();
                let full = entries.map(|e| cp.all_gather(ctx.backend, e, head_dim, cfg.n_layers));
                (full.collect::<Vec<_>>(), cp.chunk_positions())
            });
            if let Some(err) = cp.and_then(CpRank::failure) {
                return Err(err);
            }
            for (e, seq) in seqs.iter_mut().enumerate() {
                let (stage_entries, positions) = match &gathered {
                    Some((full, positions)) => (full, &positions[..]),
                    None => (&stage_entries, &rows.positions[rows.spans[e].clone()]),
                };
                for (ring, entries) in seq.dspark.iter_mut().zip(stage_entries) {
                    let kv = match gathered {
                        Some(_) => entries.clone(),
                        None => rows.of(e, entries, head_dim),
                    };
                    for (row, &position) in kv.split_rows(head_dim).into_iter().zip(positions) {
                        ring.push_at(position, row);
                    }
                }
            }
            if let Some(trace) = trace {
                trace.main_hidden = main_hidden.into_vec();
            }
        }
        for (seq, tokens) in seqs.iter_mut().zip(&chunks) {
            seq.len += tokens.len();
            seq.trim(cfg.window_size);
            if tokens.len() > COMPACT_AFTER {
                seq.compact(ctx.backend);
            }
            seq.pack_caches(ctx.backend);
        }
        Ok(outputs)
    }

    /// One token per row, each row sampled with its parameters at its position after its mask
    /// (if any) set its disallowed logits to −∞ ([`crate::sampling::sample_allowed`] is the
    /// definition): one sampling op over all rows, reading them where they are; only the ids
    /// reach the host. A row that is not one vocabulary wide, or whose mask allows nothing, fails
    /// the call naming the row.
    pub fn sample_rows(&self, rows: &[LogitsRow<'_>]) -> Result<Vec<u32>, ModelError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let vocab = self.cfg.vocab_size;
        let logits = self.gather_logits_rows("sample_rows", rows)?;
        let backend = self.ctx().backend;
        let sampling: Vec<RowSampling> = rows
            .iter()
            .map(|r| RowSampling {
                params: r.params,
                position: r.position,
            })
            .collect();
        let allowed: Vec<Option<&AllowedTokens>> = rows.iter().map(|r| r.allowed).collect();
        backend
            .sample_masked(MaskedRows {
                logits: &logits,
                vocab,
                rows: &sampling,
                allowed: &allowed,
            })
            .map_err(|e| ModelError::Sequence {
                message: e.to_string(),
            })
    }

    /// The log-probabilities of `picks[i].token` sampled from row `i` (after its mask, with
    /// `picks[i].top` alternatives; [`crate::sampling::token_logprobs`] is the definition): one
    /// op over all rows, reading them where they are; only the log-probabilities reach the host.
    /// A row that is not one vocabulary wide, or whose mask allows nothing, fails the call naming
    /// the row.
    pub fn token_logprobs_rows(
        &self,
        rows: &[LogitsRow<'_>],
        picks: &[LogprobPick],
    ) -> Result<Vec<TokenLogprobs>, ModelError> {
        if rows.is_empty() && picks.is_empty() {
            return Ok(Vec::new());
        }
        let logits = self.gather_logits_rows("token_logprobs_rows", rows)?;
        let allowed: Vec<Option<&AllowedTokens>> = rows.iter().map(|r| r.allowed).collect();
        self.ctx()
            .backend
            .token_logprobs_masked(MaskedRows {
                logits: &logits,
                vocab: self.cfg.vocab_size,
                rows: picks,
                allowed: &allowed,
            })
            .map_err(|e| ModelError::Sequence {
                message: e.to_string(),
            })
    }

    /// The rows gathered into one `[rows, vocab]` tensor on the backend; a row that is not one
    /// vocabulary wide fails `op` naming it.
    fn gather_logits_rows(&self, op: &str, rows: &[LogitsRow<'_>]) -> Result<Tensor, ModelError> {
        let vocab = self.cfg.vocab_size;
        if let Some(r) = rows.iter().position(|r| r.logits.len() != vocab) {
            return Err(ModelError::Sequence {
                message: format!(
                    "{op}: row {r} holds {} logits, not one row of {vocab}",
                    rows[r].logits.len()
                ),
            });
        }
        let pieces: Vec<(&Tensor, usize)> = rows.iter().map(|r| (r.logits, 0)).collect();
        Ok(self.ctx().backend.gather(&pieces, vocab))
    }

    /// Refuses what [`StepExtras`] cannot run: a trace, images or a CP rank with several entries,
    /// a CP rank with a trace, images, bounded replay, sampling or a split of another chunk, and
    /// image spans that do not match their entry's chunk.
    fn check_extras(
        &self,
        entries: &[StepEntry<'_>],
        traced: bool,
        images: Option<&ImageChunk<'_>>,
        cp: Option<&CpRank<'_>>,
    ) -> Result<(), ModelError> {
        let unsupported = |what: String| Err(ModelError::Unsupported { what });
        if entries.len() != 1 && (traced || images.is_some() || cp.is_some()) {
            return unsupported(format!(
                "a traced, image-bearing or context-parallel step over {} sequences (one at a time)",
                entries.len()
            ));
        }
        let Some(entry) = entries.first() else {
            return Ok(());
        };
        if let Some(chunk) = images {
            chunk.check_tokens(entry.tokens)?;
        }
        if let Some(cp) = cp {
            if traced || images.is_some() || entry.decoder_from.is_some() || entry.sample.is_some()
            {
                return unsupported(
                    "a context-parallel chunk traced, with images, decoder replay or in-step sampling"
                        .to_string(),
                );
            }
            cp.check_chunk(entry.seq.len, entry.tokens.len())?;
        }
        Ok(())
    }

    /// The final collapse, norm and head over the rows each entry wants: one head GEMM for the
    /// entries that want logits (read on the host, or left on the backend with
    /// `logits_on_device`), one sampled head for those that sample; a trace records the final
    /// hidden state of every row.
    fn head_rows(
        &self,
        ctx: &Ctx,
        rows: &StepRows,
        (wanted, wants): (&[Vec<usize>], &[EntryWant]),
        (streams, pre): (&Tensor, &Tensor),
        trace: Option<&mut ForwardTrace>,
        logits_on_device: bool,
    ) -> Result<Vec<EntryOutput>, ModelError> {
        let cfg = &self.cfg;
        let (hc, dim, vocab) = (cfg.hc.mult, cfg.dim, cfg.vocab_size);
        let needed: Vec<usize> = if trace.is_some() {
            (0..rows.positions.len()).collect()
        } else {
            wanted.iter().flatten().copied().collect()
        };
        let mut hidden = Tensor::empty();
        if !needed.is_empty() {
            let x = mhc::collapse(
                ctx,
                &gather_rows(ctx.backend, streams, needed.iter().copied(), hc * dim),
                &gather_rows(ctx.backend, pre, needed.iter().copied(), hc),
            );
            hidden = ctx
                .backend
                .rms_norm(&x, ctx.norm(&self.weights.norm, Precision::Bf16));
        }
        let head = DenseWeight {
            values: &self.weights.head,
            out: vocab,
            inp: dim,
        };
        // `needed` is ascending: a row's place in it by binary search.
        let slot = |row: usize| needed.binary_search(&row).ok();
        let logits = match rows_of(wanted, wants, false).next() {
            Some(_) => ctx.backend.linear_f32(
                &gather_rows(
                    ctx.backend,
                    &hidden,
                    rows_of(wanted, wants, false).filter_map(slot),
                    dim,
                ),
                head,
            ),
            None => Tensor::empty(),
        };
        // Read once on the host unless the rows stay on the backend.
        let logits = if logits_on_device {
            HeadLogits::Device(logits)
        } else {
            HeadLogits::Host(logits.into_vec())
        };
        let sampling = row_sampling(rows, wanted, wants);
        let tokens = if sampling.is_empty() {
            Vec::new()
        } else {
            ctx.backend
                .sample_linear(
                    &gather_rows(
                        ctx.backend,
                        &hidden,
                        rows_of(wanted, wants, true).filter_map(slot),
                        dim,
                    ),
                    head,
                    &sampling,
                )
                .map_err(|e| ModelError::Sequence {
                    message: e.to_string(),
                })?
        };
        if let Some(trace) = trace {
            trace.final_hidden = hidden.into_vec();
        }
        Ok(entry_outputs(wanted, wants, &tokens, &logits, vocab))
    }
}

/// Replaces the streams / collapse weights entering block `layer` when the trace injects them.
fn inject_streams(
    trace: Option<&ForwardTrace>,
    layer: usize,
    streams: &mut Tensor,
    pre: &mut Tensor,
) {
    let Some(inject) = trace.map(|t| &t.inject) else {
        return;
    };
    if let Some(Some(forced)) = inject.streams.get(layer)
        && forced.len() == streams.len()
    {
        *streams = forced.clone().into();
    }
    if let Some(Some(forced)) = inject.pre.get(layer)
        && forced.len() == pre.len()
    {
        *pre = forced.clone().into();
    }
}
