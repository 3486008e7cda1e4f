//! Per-sequence state (spec §5.1): the window rings of every layer, the compressor tails and the
//! append-only compressed-KV / index-key caches of the KV sources, the Engram history and the DSpark
//! context rings. Rings keep `window + MAX_BACKTRACK` entries so that a rollback of up to
//! `MAX_BACKTRACK` tokens (a partially accepted verify) restores exactly the never-drafted state.

use crate::backend::{Backend, KeyList, Pinned, PositionRing, Tensor};
use crate::engram::EngramHistory;
use crate::error::ModelError;
use crate::layers::prefix::{attached_end, processed_block_end};
pub use crate::layers::ring::MAX_BACKTRACK;
use crate::layers::ring::{PACK_ENTRIES, pack_rows, past_end, tensor_bytes, too_far};

/// Compressor state of one KV-source layer (equal: the same values; where they are stored does
/// not matter).
#[derive(Debug, Clone, Default)]
pub struct CompressorState {
    /// Per-token `kv ‖ gate` rows (fp32) of the recent positions, for the pending group.
    pub pending: PositionRing,
    /// Compressed KV entries (after RoPE and `Q4m`), one per complete group.
    pub compressed: KeyList,
    /// Index keys (after RoPE and `Q4e`), one per complete group.
    pub index_keys: KeyList,
    /// Groups whose entry and key [`CompressorState::pack`] has seen (the rest came after).
    packed: usize,
}

impl PartialEq for CompressorState {
    fn eq(&self, other: &CompressorState) -> bool {
        (&self.pending, &self.compressed, &self.index_keys)
            == (&other.pending, &other.compressed, &other.index_keys)
    }
}

impl CompressorState {
    /// Once [`PACK_ENTRIES`] groups came since the last look, copies their entries and keys into
    /// buffers of their own if they pin more than they hold ([`pack_rows`]: after batched
    /// steps, whose buffers hold every sequence's entries).
    fn pack(&mut self, backend: &dyn Backend) {
        let groups = self.compressed.len();
        if groups < self.packed + PACK_ENTRIES {
            return;
        }
        pack_rows(&mut self.compressed, self.packed, backend);
        pack_rows(&mut self.index_keys, self.packed, backend);
        self.packed = groups;
    }
}

/// State of one backbone layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerState {
    /// Window K=V entries (after RoPE and `Q8`).
    pub window: PositionRing,
    /// KV sources only.
    pub compressor: Option<CompressorState>,
}

/// Everything a sequence carries between forward calls (equal: the same values, position by
/// position).
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceState {
    pub(crate) len: usize,
    pub(crate) layers: Vec<LayerState>,
    pub(crate) engram: EngramHistory,
    /// One context ring per DSpark stage (the stage's FP8 context KV of every target position).
    pub(crate) dspark: Vec<PositionRing>,
}

impl SequenceState {
    pub(crate) fn new(layers: Vec<LayerState>, dspark_stages: usize) -> SequenceState {
        SequenceState {
            len: 0,
            layers,
            engram: EngramHistory::new(),
            dspark: vec![PositionRing::default(); dspark_stages],
        }
    }

    /// Tokens seen so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token has been seen.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The compressed-KV cache of KV-source `layer` (after RoPE and `Q4m`), if it is one.
    pub fn compressed_kv(&self, layer: usize) -> Option<&[Tensor]> {
        self.layers
            .get(layer)?
            .compressor
            .as_ref()
            .map(|c| c.compressed.rows())
    }

    /// The index-key cache of KV-source `layer` (after RoPE and `Q4e`), if it is one.
    pub fn index_keys(&self, layer: usize) -> Option<&[Tensor]> {
        self.layers
            .get(layer)?
            .compressor
            .as_ref()
            .map(|c| c.index_keys.rows())
    }

    /// Bytes of every row and entry the state holds (`crate::state_bytes::StateBytes::bytes`
    /// models it).
    pub fn held_bytes(&self) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|layer| {
                layer.window.held_bytes()
                    + layer.compressor.as_ref().map_or(0, |c| {
                        c.pending.held_bytes()
                            + tensor_bytes(c.compressed.iter())
                            + tensor_bytes(c.index_keys.iter())
                    })
            })
            .sum();
        let dspark: u64 = self.dspark.iter().map(PositionRing::held_bytes).sum();
        layers + dspark + self.engram.held_bytes()
    }

    /// Bytes of the distinct allocations the state keeps alive: every buffer a row or entry
    /// views, whole (on a device, a view of a step's buffer pins all of it), and the Engram
    /// history's capacity. At least [`SequenceState::held_bytes`].
    pub fn pinned_bytes(&self) -> u64 {
        let mut pinned = Pinned::default();
        for layer in &self.layers {
            layer.window.pin(&mut pinned);
            if let Some(c) = &layer.compressor {
                c.pending.pin(&mut pinned);
                pinned.add_tensors(c.compressed.iter());
                pinned.add_tensors(c.index_keys.iter());
            }
        }
        for ring in &self.dspark {
            ring.pin(&mut pinned);
        }
        pinned.add(self.engram.allocation());
        pinned.bytes()
    }

    /// Every ring of the state: each layer's window and compressor pending rows, then the
    /// DSpark rings.
    fn rings_mut(&mut self) -> impl Iterator<Item = &mut PositionRing> {
        let layers = self.layers.iter_mut().flat_map(|layer| {
            let LayerState { window, compressor } = layer;
            std::iter::once(window).chain(compressor.as_mut().map(|c| &mut c.pending))
        });
        layers.chain(&mut self.dspark)
    }

    /// Keeps `window + MAX_BACKTRACK` entries of every ring.
    pub(crate) fn trim(&mut self, window: usize) {
        let capacity = window + MAX_BACKTRACK;
        for ring in self.rings_mut() {
            ring.trim(capacity);
        }
    }

    /// [`CompressorState::pack`] of every KV source (after every step).
    pub(crate) fn pack_caches(&mut self, backend: &dyn Backend) {
        for compressor in self.layers.iter_mut().filter_map(|l| l.compressor.as_mut()) {
            compressor.pack(backend);
        }
    }

    /// [`PositionRing::compact`] of every ring (after a long chunk: its window, pending and
    /// DSpark rows are the chunk's last few, views into buffers of the whole chunk).
    pub(crate) fn compact(&mut self, backend: &dyn Backend) {
        for ring in self.rings_mut() {
            ring.compact(backend);
        }
    }

    /// Drops every token after the first `len` (see `Model::rollback`).
    pub(crate) fn rollback(
        &mut self,
        len: usize,
        window: usize,
        ratios: &[usize],
    ) -> Result<(), ModelError> {
        if len > self.len {
            return Err(past_end(len, self.len));
        }
        let needed_window = len.saturating_sub(window);
        for (l, layer) in self.layers.iter().enumerate() {
            if let Some(compressor) = &layer.compressor {
                let ratio = ratios[l].max(1);
                if compressor.pending.start() > len - len % ratio && !len.is_multiple_of(ratio) {
                    return Err(too_far(len, self.len));
                }
            }
            if layer.window.start() > needed_window {
                return Err(too_far(len, self.len));
            }
        }
        for ring in &self.dspark {
            if ring.start() > needed_window {
                return Err(too_far(len, self.len));
            }
        }
        for (l, layer) in self.layers.iter_mut().enumerate() {
            layer.window.truncate(len);
            if let Some(compressor) = &mut layer.compressor {
                let groups = len / ratios[l].max(1);
                compressor.pending.truncate(len);
                compressor.compressed.truncate(groups);
                compressor.index_keys.truncate(groups);
                compressor.packed = compressor.packed.min(groups);
            }
        }
        for ring in &mut self.dspark {
            ring.truncate(len);
        }
        self.engram.truncate(len);
        self.len = len;
        Ok(())
    }
}

/// What a prefix cache keeps of one block of a sequence's positions `[start, start + len)`
/// (`start` and `len` multiples of every compression ratio): every KV source's compressed-KV
/// entries and index keys of the block's groups (exact: a hit attaches them as first computed)
/// and the Engram history entries of its positions (token-derived). The window, compressor-tail
/// and DSpark rings are not kept: a hit rebuilds them by replaying a bounded suffix
/// ([`SequenceState::attach_prefix`]).
pub type PrefixBlock = crate::layers::prefix::PrefixBlock<BlockCaches>;

/// What a V4.1 [`PrefixBlock`] keeps.
#[derive(Debug, Clone)]
pub struct BlockCaches {
    /// Per layer, for KV sources: the block's compressed entries and index keys.
    caches: Vec<Option<(Vec<Tensor>, Vec<Tensor>)>>,
    /// Empty for a model without Engram.
    engram: Vec<Option<u32>>,
}

impl PrefixBlock {
    /// Bytes of the entries kept (f32 values and Engram entries).
    pub fn held_bytes(&self) -> u64 {
        let caches: u64 = self
            .kept
            .caches
            .iter()
            .flatten()
            .map(|(compressed, keys)| tensor_bytes(compressed) + tensor_bytes(keys))
            .sum();
        caches + (self.kept.engram.len() * std::mem::size_of::<Option<u32>>()) as u64
    }
}

impl SequenceState {
    /// The [`PrefixBlock`] of positions `[start, start + len)`; an error when the sequence has not
    /// processed them all or a bound is not a multiple of a KV source's ratio `ratios[layer]`.
    pub fn prefix_block(
        &self,
        start: usize,
        len: usize,
        ratios: &[usize],
    ) -> Result<PrefixBlock, ModelError> {
        let end = processed_block_end(start, len, self.len)?;
        let mut caches = Vec::with_capacity(self.layers.len());
        for (l, layer) in self.layers.iter().enumerate() {
            caches.push(match &layer.compressor {
                Some(c) => {
                    let ratio = ratios.get(l).copied().unwrap_or(0).max(1);
                    if !start.is_multiple_of(ratio) || !len.is_multiple_of(ratio) {
                        return Err(misaligned("prefix block", start, len, l, ratio));
                    }
                    let groups = start / ratio..end / ratio;
                    Some((
                        c.compressed[groups.clone()].to_vec(),
                        c.index_keys[groups].to_vec(),
                    ))
                }
                None => None,
            });
        }
        let engram = match self.engram.entries(start..end) {
            Some(entries) => entries.to_vec(),
            None if self.engram.is_empty() => Vec::new(),
            None => {
                return Err(ModelError::Sequence {
                    message: format!(
                        "the Engram history holds {} positions, the prefix block ends at {end}",
                        self.engram.len()
                    ),
                });
            }
        };
        Ok(PrefixBlock::new(start, len, BlockCaches { caches, engram }))
    }

    /// Attaches consecutive prefix `blocks` (from position 0) to an empty sequence and places it
    /// at `replay_from` (a multiple of every ratio, at most the blocks' end): the caller then
    /// feeds the tokens from `replay_from` on, whose forward rebuilds the rings (their windows
    /// read nothing below `replay_from`) while every attached compressed entry and index key
    /// stays as cached (never rewritten, see `csa::compress_chunk`).
    pub fn attach_prefix(
        &mut self,
        blocks: &[&PrefixBlock],
        replay_from: usize,
        ratios: &[usize],
    ) -> Result<(), ModelError> {
        let fail = |message: String| Err(ModelError::Sequence { message });
        let end = attached_end(
            self.len,
            blocks,
            |kept| kept.caches.len() == self.layers.len(),
            |block, end| ModelError::Sequence {
                message: format!(
                    "prefix block at {} of {} layers does not continue a prefix of {end} tokens \
                     over {} layers",
                    block.start(),
                    block.kept.caches.len(),
                    self.layers.len()
                ),
            },
        )?;
        if replay_from > end {
            return fail(format!(
                "replay from {replay_from} lies past the attached prefix of {end} tokens"
            ));
        }
        let engram_entries: usize = blocks.iter().map(|b| b.kept.engram.len()).sum();
        if engram_entries != 0 && engram_entries != end {
            return fail(format!(
                "the prefix blocks hold {engram_entries} Engram entries for {end} positions"
            ));
        }
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let Some(compressor) = layer.compressor.as_mut() else {
                continue;
            };
            let ratio = ratios.get(l).copied().unwrap_or(0).max(1);
            if !replay_from.is_multiple_of(ratio) {
                return Err(misaligned("replay start", replay_from, 0, l, ratio));
            }
            let mut attached = CompressorState {
                pending: PositionRing::starting_at(replay_from),
                ..CompressorState::default()
            };
            for block in blocks {
                let Some((compressed, keys)) = &block.kept.caches[l] else {
                    return fail(format!(
                        "prefix block at {} has no caches of layer {l}",
                        block.start()
                    ));
                };
                attached.compressed.extend(compressed.iter().cloned());
                attached.index_keys.extend(keys.iter().cloned());
            }
            // The attached entries stay where the prefix cache keeps them (shared with it).
            attached.packed = attached.compressed.len();
            *compressor = attached;
        }
        if engram_entries == end {
            let mut left = replay_from;
            for block in blocks {
                let take = left.min(block.kept.engram.len());
                self.engram.extend(&block.kept.engram[..take]);
                left -= take;
            }
        }
        self.len = replay_from;
        Ok(())
    }
}

fn misaligned(what: &str, start: usize, len: usize, layer: usize, ratio: usize) -> ModelError {
    ModelError::Sequence {
        message: format!(
            "{what} at {start} (+{len}) is not a multiple of layer {layer}'s compression ratio {ratio}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sequence of one ratio-2 KV source holding `len` tokens (entry `g` of group `g`).
    fn ratio_two_sequence(len: usize) -> SequenceState {
        let layer = LayerState {
            window: PositionRing::default(),
            compressor: Some(CompressorState::default()),
        };
        let mut seq = SequenceState::new(vec![layer], 0);
        for p in 0..len {
            seq.layers[0].window.push_at(p, vec![p as f32]);
            if let Some(c) = seq.layers[0].compressor.as_mut() {
                c.pending.push_at(p, vec![p as f32]);
                if p % 2 == 1 {
                    c.compressed.push(vec![(p / 2) as f32].into());
                    c.index_keys.push(vec![-((p / 2) as f32)].into());
                }
            }
        }
        seq.len = len;
        seq
    }

    #[test]
    fn prefix_blocks_attach_their_entries_and_refuse_bad_bounds() {
        let seq = ratio_two_sequence(20);
        let blocks: Vec<PrefixBlock> = (0..2)
            .map(|b| seq.prefix_block(b * 8, 8, &[2]).expect("aligned block"))
            .collect();
        assert_eq!(
            blocks[1].held_bytes(),
            8 * 4,
            "4 entries and 4 keys of one f32"
        );
        let error = |r: Result<(), ModelError>| r.expect_err("refused").to_string();
        let block_error = |r: Result<PrefixBlock, ModelError>| error(r.map(|_| ()));
        assert!(block_error(seq.prefix_block(16, 8, &[2])).contains("past the 20 tokens"));
        assert!(block_error(seq.prefix_block(3, 8, &[2])).contains("compression ratio 2"));

        let mut fresh = ratio_two_sequence(0);
        let refs: Vec<&PrefixBlock> = blocks.iter().collect();
        assert!(error(fresh.attach_prefix(&refs, 17, &[2])).contains("past the attached"));
        assert!(error(fresh.attach_prefix(&refs, 9, &[2])).contains("compression ratio 2"));
        assert!(error(fresh.attach_prefix(&refs[1..], 8, &[2])).contains("does not continue"));
        assert!(error(seq.clone().attach_prefix(&refs, 8, &[2])).contains("empty sequence"));
        fresh.attach_prefix(&refs, 10, &[2]).expect("attached");
        assert_eq!(fresh.len(), 10);
        assert_eq!(
            fresh.compressed_kv(0),
            seq.compressed_kv(0).map(|c| &c[..8])
        );
        assert_eq!(fresh.index_keys(0), seq.index_keys(0).map(|c| &c[..8]));
        let pending = &fresh.layers[0].compressor.as_ref().expect("source").pending;
        assert_eq!(
            pending.start(),
            10,
            "the replay refills the tail from its start"
        );
    }

    #[test]
    fn batched_steps_leave_each_sequence_entries_of_its_own() {
        use crate::backend::CpuBackend;
        use crate::backend::tensor::HostDeviceBuffer;
        let source = || LayerState {
            window: PositionRing::default(),
            compressor: Some(CompressorState::default()),
        };
        let mut seqs = [
            SequenceState::new(vec![source()], 0),
            SequenceState::new(vec![source()], 0),
        ];
        // 40 batched steps on a device, each completing a group of both sequences: one buffer of
        // the step's two entries (and one of its two keys), of which each sequence views its row.
        let steps = PACK_ENTRIES + 8;
        for step in 0..steps {
            let entries = HostDeviceBuffer::tensor(vec![step as f32, -(step as f32)]);
            let keys = HostDeviceBuffer::tensor(vec![0.5, 0.25]);
            for (s, seq) in seqs.iter_mut().enumerate() {
                let c = seq.layers[0].compressor.as_mut().expect("source");
                c.compressed.push(entries.range(s..s + 1));
                c.index_keys.push(keys.range(s..s + 1));
                seq.pack_caches(&CpuBackend::new());
            }
        }
        let [first, _] = seqs;
        // The first PACK_ENTRIES groups in buffers of their own, the last 8 still in the steps'.
        assert_eq!(first.held_bytes(), (2 * steps * 4) as u64);
        assert_eq!(first.pinned_bytes(), first.held_bytes() + 2 * 8 * 4);
        let entries = first.compressed_kv(0).expect("source");
        assert_eq!(
            (entries[3][0], entries[steps - 1][0]),
            (3.0, (steps - 1) as f32)
        );
        assert!(entries[0].device_view().is_none() && entries[steps - 1].device_view().is_some());
    }

    #[test]
    fn rollback_is_refused_beyond_the_history_and_the_rings() {
        let layer = LayerState {
            window: PositionRing::default(),
            compressor: Some(CompressorState::default()),
        };
        let mut seq = SequenceState::new(vec![layer], 0);
        for p in 0..40 {
            seq.layers[0].window.push_at(p, vec![p as f32]);
            if let Some(c) = seq.layers[0].compressor.as_mut() {
                c.pending.push_at(p, vec![p as f32]);
                if p % 2 == 1 {
                    c.compressed.push(vec![p as f32].into());
                    c.index_keys.push(vec![p as f32].into());
                }
            }
        }
        seq.len = 40;
        seq.trim(8);
        assert!(seq.rollback(41, 8, &[2]).is_err());
        assert!(seq.rollback(40 - MAX_BACKTRACK - 1, 8, &[2]).is_err());
        seq.rollback(35, 8, &[2])
            .expect("within the backtracking budget");
        assert_eq!(seq.len(), 35);
        assert_eq!(seq.compressed_kv(0).map(<[_]>::len), Some(17));
        assert_eq!(
            seq.layers[0].window.get(34),
            Some(&Tensor::from(vec![34.0]))
        );
        assert_eq!(seq.layers[0].window.get(35), None);
    }
}
