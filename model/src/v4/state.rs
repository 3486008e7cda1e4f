//! Per-sequence state of a V4 model (spec v4-architecture.md §3.1, §3.6): per layer the window of
//! K=V rows and, for CSA/HCA layers, the compressor caches (the raw `kv ‖ gate` rows of the recent
//! tokens and the append-only compressed entries; CSA layers have a second cache for the indexer
//! keys). Rings keep `MAX_BACKTRACK` rows beyond what the next token needs, so a rollback of up to
//! [`MAX_BACKTRACK`] tokens restores exactly the state of a run that never saw the dropped tokens.
//! The speculative heads keep their own rings: the MTP block its window (the entry of position
//! `i` pairs the last-layer streams of `i` with token `i+1`) and the last-layer streams of the
//! newest positions; a DSpark drafter one context ring per stage.
//!
//! Prefix-cache blocks ([`PrefixBlock`]) are exact: a block of positions `[start, end)` (both
//! multiples of every compression ratio) keeps its groups' compressed entries and index keys and,
//! of every ring, the rows of its positions the next token reads once the sequence ends at `end`
//! (the window's last `window` rows, an overlapping compressor's previous group, the MTP rows,
//! the DSpark context). A hit resumes at its end with every row the next token reads as a cold
//! prefill left it, and replays nothing ([`SequenceState::attach_prefix`]). The rings drop those
//! rows at the end of the forward that computes them, so a block is taken after a forward that
//! held them ([`SequenceState::hold_block_rows`]).

use std::ops::Range;

use crate::backend::{Backend, KeyList, Pinned, PositionRing, Tensor};
use crate::error::ModelError;
use crate::layers::prefix::{attached_end, processed_block_end};
use crate::layers::ring::{
    MAX_BACKTRACK, PACK_ENTRIES, pack_rows, past_end, tensor_bytes, too_far,
};

/// One compressor's cache.
#[derive(Debug, Clone)]
pub struct CompressorCache {
    /// Tokens per entry.
    pub(crate) ratio: usize,
    /// Whether an entry also pools the previous window (CSA).
    pub(crate) overlapping: bool,
    /// Per-token `kv ‖ gate` projections (before the position bias) of the recent positions.
    pub(crate) pending: PositionRing,
    /// Complete entries (normalised, rotated), one per `ratio` tokens.
    pub(crate) entries: KeyList,
    /// Entries [`CompressorCache::pack`] has seen (the rest came after).
    packed: usize,
}

impl CompressorCache {
    pub(crate) fn new(ratio: usize, overlapping: bool) -> CompressorCache {
        CompressorCache {
            ratio,
            overlapping,
            pending: PositionRing::default(),
            entries: KeyList::new(),
            packed: 0,
        }
    }

    /// Once [`PACK_ENTRIES`] entries came since the last look, copies them into a buffer of their
    /// own if they pin more than they hold ([`pack_rows`]: after batched steps, whose buffers
    /// hold every sequence's entries).
    fn pack(&mut self, backend: &dyn Backend) {
        let entries = self.entries.len();
        if entries < self.packed + PACK_ENTRIES {
            return;
        }
        pack_rows(&mut self.entries, self.packed, backend);
        self.packed = entries;
    }

    /// Raw rows a future entry may still need: the partial window, plus the previous window when
    /// overlapping, plus the backtracking budget.
    fn capacity(&self) -> usize {
        let windows = if self.overlapping { 2 } else { 1 };
        windows * self.ratio + MAX_BACKTRACK
    }

    /// The first position whose raw row the entries after `len` tokens need.
    fn first_needed(&self, len: usize) -> usize {
        let start = len - len % self.ratio;
        if self.overlapping {
            start.saturating_sub(self.ratio)
        } else {
            start
        }
    }
}

/// State of one layer.
#[derive(Debug, Clone, Default)]
pub struct LayerState {
    /// K=V rows (after `kv_norm` and RoPE).
    pub(crate) window: PositionRing,
    /// The attention compressor (CSA, HCA).
    pub(crate) main: Option<CompressorCache>,
    /// The indexer's key compressor (CSA).
    pub(crate) index: Option<CompressorCache>,
}

/// State of the V4-Flash MTP block.
#[derive(Debug, Clone, Default)]
pub struct MtpState {
    /// The block's own window: K=V rows of the positions it processed (`0 … len − 2`).
    pub(crate) layer: LayerState,
    /// Backbone last-layer streams `[hc · dim]` (before the hyper-head) of the newest positions.
    pub(crate) hidden: PositionRing,
}

/// Everything a V4 sequence carries between forward calls.
#[derive(Debug, Clone)]
pub struct SequenceState {
    pub(crate) len: usize,
    pub(crate) layers: Vec<LayerState>,
    /// The MTP block's state, when the model has one (boxed: most sequences have none).
    pub(crate) mtp: Option<Box<MtpState>>,
    /// One context ring per DSpark stage (`kv_s(p)` of every processed position).
    pub(crate) dspark: Vec<PositionRing>,
    /// The next forward's trim keeps every ring row of a position at or after it.
    hold_from: Option<usize>,
}

/// What the next token reads of one ring.
#[derive(Debug, Clone, Copy)]
enum RingNeed {
    /// The last `window` rows (backbone and MTP windows, DSpark context).
    Window { lag: usize },
    /// The rows of the groups a future entry pools.
    Compressor { ratio: usize, overlapping: bool },
    /// The streams of the last position (the MTP block's next entry).
    LastRow,
}

impl RingNeed {
    /// The positions of the ring the next token reads after `len` tokens (`len` a multiple of
    /// every ratio).
    fn positions(self, len: usize, window: usize) -> Range<usize> {
        match self {
            RingNeed::Window { lag } => len.saturating_sub(window)..len.saturating_sub(lag),
            RingNeed::Compressor { ratio, overlapping } => {
                let windows = if overlapping { 1 } else { 0 };
                len.saturating_sub(windows * ratio)..len
            }
            RingNeed::LastRow => len.saturating_sub(1)..len,
        }
    }
}

impl CompressorCache {
    fn need(&self) -> RingNeed {
        RingNeed::Compressor {
            ratio: self.ratio,
            overlapping: self.overlapping,
        }
    }
}

impl SequenceState {
    pub(crate) fn new(layers: Vec<LayerState>, mtp: bool, dspark_stages: usize) -> SequenceState {
        SequenceState {
            len: 0,
            layers,
            mtp: mtp.then(Box::default),
            dspark: vec![PositionRing::default(); dspark_stages],
            hold_from: None,
        }
    }

    /// Every ring with what the next token reads of it, in one fixed order (per layer its window,
    /// compressor and indexer rows; the MTP window and streams; the DSpark stages).
    fn rings(&self) -> Vec<(RingNeed, &PositionRing)> {
        let window = RingNeed::Window { lag: 0 };
        let mut rings = Vec::new();
        for layer in &self.layers {
            rings.push((window, &layer.window));
            for cache in [&layer.main, &layer.index].into_iter().flatten() {
                rings.push((cache.need(), &cache.pending));
            }
        }
        if let Some(mtp) = &self.mtp {
            rings.push((RingNeed::Window { lag: 1 }, &mtp.layer.window));
            rings.push((RingNeed::LastRow, &mtp.hidden));
        }
        rings.extend(self.dspark.iter().map(|ring| (window, ring)));
        rings
    }

    /// The rings of [`SequenceState::rings`], in its order.
    fn rings_mut(&mut self) -> Vec<&mut PositionRing> {
        let mut rings = Vec::new();
        for layer in &mut self.layers {
            rings.push(&mut layer.window);
            for cache in [&mut layer.main, &mut layer.index].into_iter().flatten() {
                rings.push(&mut cache.pending);
            }
        }
        if let Some(mtp) = &mut self.mtp {
            rings.push(&mut mtp.layer.window);
            rings.push(&mut mtp.hidden);
        }
        rings.extend(self.dspark.iter_mut());
        rings
    }

    /// Keeps through the next forward (whose trim then drops none of them; the forward after it
    /// trims as usual) every ring row the [`PrefixBlock`] starting at `start` takes: the step
    /// that completes that block calls it first, [`SequenceState::prefix_block`] after it.
    pub fn hold_block_rows(&mut self, start: usize) {
        // The MTP window lags one position behind the block.
        let from = start.saturating_sub(1);
        self.hold_from = Some(self.hold_from.map_or(from, |held| held.min(from)));
    }

    /// Tokens seen so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token has been seen.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The compressed entries of CSA/HCA `layer`.
    pub fn compressed_entries(&self, layer: usize) -> Option<&[Tensor]> {
        self.layers
            .get(layer)?
            .main
            .as_ref()
            .map(|c| c.entries.rows())
    }

    /// The indexer keys of CSA `layer`.
    pub fn index_keys(&self, layer: usize) -> Option<&[Tensor]> {
        self.layers
            .get(layer)?
            .index
            .as_ref()
            .map(|c| c.entries.rows())
    }

    /// Bytes of every row and entry the state holds (`crate::state_bytes::StateBytes::bytes`
    /// models it).
    pub fn held_bytes(&self) -> u64 {
        let layer_bytes = |layer: &LayerState| {
            layer.window.held_bytes()
                + [&layer.main, &layer.index]
                    .into_iter()
                    .flatten()
                    .map(|c| c.pending.held_bytes() + tensor_bytes(c.entries.iter()))
                    .sum::<u64>()
        };
        let layers: u64 = self.layers.iter().map(layer_bytes).sum();
        let mtp = self
            .mtp
            .as_ref()
            .map_or(0, |m| layer_bytes(&m.layer) + m.hidden.held_bytes());
        let dspark: u64 = self.dspark.iter().map(PositionRing::held_bytes).sum();
        layers + mtp + dspark
    }

    /// Bytes of the distinct allocations the state keeps alive: every buffer a row or entry
    /// views, whole (on a device, a view of a step's buffer pins all of it). At least
    /// [`SequenceState::held_bytes`].
    pub fn pinned_bytes(&self) -> u64 {
        let mut pinned = Pinned::default();
        let pin_layer = |layer: &LayerState, pinned: &mut Pinned| {
            layer.window.pin(pinned);
            for cache in [&layer.main, &layer.index].into_iter().flatten() {
                cache.pending.pin(pinned);
                pinned.add_tensors(cache.entries.iter());
            }
        };
        for layer in &self.layers {
            pin_layer(layer, &mut pinned);
        }
        if let Some(mtp) = &self.mtp {
            pin_layer(&mtp.layer, &mut pinned);
            mtp.hidden.pin(&mut pinned);
        }
        for ring in &self.dspark {
            ring.pin(&mut pinned);
        }
        pinned.bytes()
    }

    /// Drops ring rows no future token (or rollback) needs, except those a hold keeps
    /// ([`SequenceState::hold_block_rows`], released here).
    pub(crate) fn trim(&mut self, window: usize) {
        let keep = self.hold_from.take().unwrap_or(usize::MAX);
        for layer in &mut self.layers {
            layer.window.trim_before(window + MAX_BACKTRACK, keep);
            for cache in [&mut layer.main, &mut layer.index].into_iter().flatten() {
                let capacity = cache.capacity();
                cache.pending.trim_before(capacity, keep);
            }
        }
        if let Some(mtp) = &mut self.mtp {
            mtp.layer.window.trim_before(window + MAX_BACKTRACK, keep);
            mtp.hidden.trim_before(MAX_BACKTRACK + 1, keep);
        }
        for ring in &mut self.dspark {
            ring.trim_before(window + MAX_BACKTRACK, keep);
        }
    }

    /// [`CompressorCache::pack`] of every compressor (after every step).
    pub(crate) fn pack_caches(&mut self, backend: &dyn Backend) {
        for layer in &mut self.layers {
            for cache in [&mut layer.main, &mut layer.index].into_iter().flatten() {
                cache.pack(backend);
            }
        }
    }

    /// Copies every ring's rows into buffers of their own when they are views into device memory,
    /// so that the few rows a long chunk leaves do not keep that chunk's whole buffers alive.
    pub(crate) fn compact(&mut self, backend: &dyn Backend) {
        for ring in self.rings_mut() {
            ring.compact(backend);
        }
    }

    /// Drops every token after the first `len`; refused when the rings no longer hold what the
    /// shorter sequence needs.
    pub(crate) fn rollback(&mut self, len: usize, window: usize) -> Result<(), ModelError> {
        if len > self.len {
            return Err(past_end(len, self.len));
        }
        let too_far = || too_far(len, self.len);
        for layer in &self.layers {
            if layer.window.start() > len.saturating_sub(window) {
                return Err(too_far());
            }
            for cache in [&layer.main, &layer.index].into_iter().flatten() {
                if cache.pending.start() > cache.first_needed(len) {
                    return Err(too_far());
                }
            }
        }
        if let Some(mtp) = &self.mtp {
            // The next MTP entry (position len − 1) needs the streams of len − 1 and the window
            // before it.
            let streams_lost = len > 0 && mtp.hidden.get(len - 1).is_none();
            if streams_lost || mtp.layer.window.start() > len.saturating_sub(window) {
                return Err(too_far());
            }
        }
        if self
            .dspark
            .iter()
            .any(|ring| ring.start() > len.saturating_sub(window))
        {
            return Err(too_far());
        }
        for layer in &mut self.layers {
            layer.window.truncate(len);
            for cache in [&mut layer.main, &mut layer.index].into_iter().flatten() {
                cache.pending.truncate(len);
                cache.entries.truncate(len / cache.ratio);
                cache.packed = cache.packed.min(cache.entries.len());
            }
        }
        if let Some(mtp) = &mut self.mtp {
            mtp.layer.window.truncate(len.saturating_sub(1));
            mtp.hidden.truncate(len);
        }
        for ring in &mut self.dspark {
            ring.truncate(len);
        }
        self.len = len;
        Ok(())
    }
}

/// What a prefix cache keeps of one block of a V4 sequence's positions `[start, start + len)`
/// (`start` and `len` multiples of every compression ratio; [module docs](self)): every
/// compressor's entries of the block's groups and, per ring, the rows of the block's positions
/// that the next token reads once the sequence ends at the block's end. All exact: a hit attaches
/// them as first computed and replays nothing.
pub type PrefixBlock = crate::layers::prefix::PrefixBlock<BlockCaches>;

/// What a V4 [`PrefixBlock`] keeps.
#[derive(Debug, Clone)]
pub struct BlockCaches {
    /// Per layer, per compressor (attention, then indexer): the block's entries.
    entries: Vec<Vec<Vec<Tensor>>>,
    /// Per ring ([`SequenceState::rings`] order): the rows the block contributes.
    rings: Vec<PositionRing>,
}

impl PrefixBlock {
    /// Bytes of the entries and rows kept (f32 values).
    pub fn held_bytes(&self) -> u64 {
        let entries: u64 = self.kept.entries.iter().flatten().map(tensor_bytes).sum();
        entries
            + self
                .kept
                .rings
                .iter()
                .map(PositionRing::held_bytes)
                .sum::<u64>()
    }
}

fn sequence_error(message: String) -> ModelError {
    ModelError::Sequence { message }
}

impl SequenceState {
    /// The [`PrefixBlock`] of positions `[start, start + len)` of a model with window `window`;
    /// an error when the sequence has not processed them all, a bound is not a multiple of a
    /// compressor's ratio, or a row the block keeps is no longer held (take a block after the
    /// forward that completes it, with its rows held: [`SequenceState::hold_block_rows`]).
    pub fn prefix_block(
        &self,
        start: usize,
        len: usize,
        window: usize,
    ) -> Result<PrefixBlock, ModelError> {
        let end = processed_block_end(start, len, self.len)?;
        let mut entries = Vec::with_capacity(self.layers.len());
        for (l, layer) in self.layers.iter().enumerate() {
            let mut caches = Vec::new();
            for cache in [&layer.main, &layer.index].into_iter().flatten() {
                let ratio = cache.ratio.max(1);
                if !start.is_multiple_of(ratio) || !len.is_multiple_of(ratio) {
                    return Err(sequence_error(format!(
                        "prefix block [{start}, {end}) is not aligned to layer {l}'s \
                         compression ratio {ratio}"
                    )));
                }
                caches.push(cache.entries[start / ratio..end / ratio].to_vec());
            }
            entries.push(caches);
        }
        let mut rings = Vec::new();
        for (need, ring) in self.rings() {
            let after = need.positions(end, window);
            let from = need.positions(start, window).end.max(after.start);
            let mut kept = PositionRing::starting_at(from);
            for p in from..after.end {
                let row = ring.get(p).ok_or_else(|| {
                    sequence_error(format!(
                        "prefix block [{start}, {end}): the row of position {p} is no longer \
                         held (a ring holds {}..{})",
                        ring.start(),
                        ring.end()
                    ))
                })?;
                kept.push(row.clone());
            }
            rings.push(kept);
        }
        Ok(PrefixBlock::new(start, len, BlockCaches { entries, rings }))
    }

    /// Attaches consecutive prefix `blocks` (from position 0) of a model with window `window` to
    /// an empty sequence, which then holds exactly what a cold prefill of their positions left
    /// for the next token: `resume_at` must be the blocks' end (a V4 hit replays nothing).
    pub fn attach_prefix(
        &mut self,
        blocks: &[&PrefixBlock],
        resume_at: usize,
        window: usize,
    ) -> Result<(), ModelError> {
        let ring_count = self.rings().len();
        let end = attached_end(
            self.len,
            blocks,
            |kept| kept.entries.len() == self.layers.len() && kept.rings.len() == ring_count,
            |block, end| {
                sequence_error(format!(
                    "prefix block at {} ({} layers, {} rings) does not continue a prefix of \
                     {end} tokens of this model ({} layers, {ring_count} rings)",
                    block.start(),
                    block.kept.entries.len(),
                    block.kept.rings.len(),
                    self.layers.len()
                ))
            },
        )?;
        if resume_at != end {
            return Err(sequence_error(format!(
                "a V4 hit resumes at the end of its blocks ({end}), not at {resume_at}"
            )));
        }
        for block in blocks {
            for (l, layer) in self.layers.iter().enumerate() {
                let caches = [&layer.main, &layer.index].into_iter().flatten().count();
                if block.kept.entries[l].len() != caches {
                    return Err(sequence_error(format!(
                        "prefix block at {} keeps {} compressors of layer {l}, the model has \
                         {caches}",
                        block.start(),
                        block.kept.entries[l].len()
                    )));
                }
            }
        }
        let mut rings = Vec::with_capacity(ring_count);
        for (r, (need, _)) in self.rings().into_iter().enumerate() {
            let need = need.positions(end, window);
            let mut rebuilt = PositionRing::starting_at(need.start);
            for p in need.clone() {
                let lacking = || {
                    let (from, to) = (need.start, need.end);
                    sequence_error(format!(
                        "the prefix blocks lack the row of position {p} of ring {r}, whose rows \
                         {from}..{to} the next token reads"
                    ))
                };
                let row = blocks.iter().find_map(|b| b.kept.rings[r].get(p));
                rebuilt.push(row.ok_or_else(lacking)?.clone());
            }
            rings.push(rebuilt);
        }
        for (ring, rebuilt) in self.rings_mut().into_iter().zip(rings) {
            *ring = rebuilt;
        }
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let caches = [&mut layer.main, &mut layer.index].into_iter().flatten();
            for (c, cache) in caches.enumerate() {
                cache.entries = KeyList::from(
                    blocks
                        .iter()
                        .flat_map(|block| block.kept.entries[l][c].iter().cloned())
                        .collect::<Vec<Tensor>>(),
                );
                // The attached entries stay where the prefix cache keeps them (shared with it).
                cache.packed = cache.entries.len();
            }
        }
        self.len = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One CSA-like layer (ratio 4, overlapping) fed `len` tokens with window `window`.
    fn filled(len: usize, window: usize) -> SequenceState {
        let mut cache = CompressorCache::new(4, true);
        let mut layer = LayerState::default();
        for p in 0..len {
            layer.window.push_at(p, vec![p as f32]);
            cache.pending.push_at(p, vec![p as f32]);
            if (p + 1) % 4 == 0 {
                cache.entries.push(Tensor::from(vec![p as f32]));
            }
        }
        layer.main = Some(cache);
        let mut seq = SequenceState::new(vec![layer], false, 0);
        seq.len = len;
        seq.trim(window);
        seq
    }

    /// One CSA-like layer (ratio 4, overlapping) fed 16 tokens with window 8 in one forward,
    /// which completes two blocks of 8 whose rows it holds when `held`.
    fn fed_sixteen(held: bool) -> SequenceState {
        let mut seq = SequenceState::new(vec![LayerState::default()], false, 0);
        seq.layers[0].main = Some(CompressorCache::new(4, true));
        if held {
            seq.hold_block_rows(8);
            seq.hold_block_rows(0);
        }
        let layer = &mut seq.layers[0];
        for p in 0..16 {
            layer.window.push_at(p, vec![p as f32]);
            let cache = layer.main.as_mut().expect("compressor");
            cache.pending.push_at(p, vec![p as f32]);
            if (p + 1) % 4 == 0 {
                cache.entries.push(Tensor::from(vec![p as f32]));
            }
        }
        seq.len = 16;
        seq.trim(8);
        seq
    }

    #[test]
    fn prefix_blocks_keep_what_the_next_token_reads_and_attach_whole() {
        let unheld = fed_sixteen(false);
        let error = unheld.prefix_block(0, 8, 8).expect_err("rows 0, 1 trimmed");
        assert!(
            error.to_string().contains("position 0 is no longer held"),
            "{error}"
        );
        let seq = fed_sixteen(true);
        let misaligned = seq.prefix_block(2, 8, 8).expect_err("misaligned");
        assert!(misaligned.to_string().contains("ratio 4"), "{misaligned}");
        let blocks = [seq.prefix_block(0, 8, 8), seq.prefix_block(8, 8, 8)]
            .map(|block| block.expect("held block"));
        // Window rows 8..16, the compressor's previous group 12..16, entries 2 and 3.
        assert_eq!(blocks[1].held_bytes(), (8 + 4 + 2) * 4);
        let mut fresh = SequenceState::new(vec![LayerState::default()], false, 0);
        fresh.layers[0].main = Some(CompressorCache::new(4, true));
        let gap = fresh
            .attach_prefix(&[&blocks[1]], 8, 8)
            .expect_err("no block 0");
        assert!(gap.to_string().contains("does not continue"), "{gap}");
        fresh
            .attach_prefix(&[&blocks[0], &blocks[1]], 16, 8)
            .expect("attached");
        let layer = &fresh.layers[0];
        let cache = layer.main.as_ref().expect("compressor");
        assert_eq!(
            (fresh.len(), layer.window.start(), layer.window.end()),
            (16, 8, 16)
        );
        assert_eq!((cache.pending.start(), cache.pending.end()), (12, 16));
        assert_eq!(fresh.compressed_entries(0), seq.compressed_entries(0));
        assert_eq!(layer.window.get(9), seq.layers[0].window.get(9));
    }

    #[test]
    fn rollback_drops_entries_and_rows_of_the_dropped_tokens() {
        let mut seq = filled(40, 8);
        seq.rollback(40 - MAX_BACKTRACK, 8).expect("within budget");
        assert_eq!(seq.len(), 34);
        assert_eq!(seq.compressed_entries(0).map(<[_]>::len), Some(8));
        let cache = seq.layers[0].main.as_ref().expect("compressor");
        assert_eq!(cache.pending.get(33).map(|r| r.to_vec()), Some(vec![33.0]));
        assert_eq!(cache.pending.get(34).map(|r| r.to_vec()), None);
        // The previous window (28..31) that entry 8 will pool is still held.
        assert_eq!(cache.pending.get(28).map(|r| r.to_vec()), Some(vec![28.0]));
    }

    #[test]
    fn rollback_beyond_the_rings_or_the_sequence_is_refused() {
        let mut seq = filled(40, 8);
        assert!(seq.rollback(41, 8).is_err());
        assert!(seq.rollback(40 - MAX_BACKTRACK - 3, 8).is_err());
        assert_eq!(seq.len(), 40, "a refused rollback changes nothing");
    }

    /// A sequence of `len` tokens with an MTP block (entries up to `len − 2`, streams up to
    /// `len − 1`) and two DSpark rings, trimmed for window `window`.
    fn speculative(len: usize, window: usize) -> SequenceState {
        let mut seq = SequenceState::new(Vec::new(), true, 2);
        let mtp = seq.mtp.as_mut().expect("mtp state");
        for p in 0..len {
            if p + 1 < len {
                mtp.layer.window.push_at(p, vec![p as f32]);
            }
            mtp.hidden.push_at(p, vec![p as f32]);
            for ring in &mut seq.dspark {
                ring.push_at(p, vec![p as f32]);
            }
        }
        seq.len = len;
        seq.trim(window);
        seq
    }

    #[test]
    fn compact_gives_every_ring_buffers_of_its_own() {
        use crate::backend::CpuBackend;
        use crate::backend::tensor::HostDeviceBuffer;
        // A 64-token chunk on a device: every ring's rows are views of the chunk's buffers.
        let (chunk, width) = (64, 4);
        let buffer = || {
            HostDeviceBuffer::tensor((0..chunk * width).map(|v| v as f32).collect())
                .split_rows(width)
        };
        let mut seq = SequenceState::new(vec![LayerState::default()], true, 2);
        seq.layers[0].main = Some(CompressorCache::new(4, true));
        for ring in seq.rings_mut() {
            for (p, row) in buffer().into_iter().enumerate() {
                ring.push_at(p, row);
            }
        }
        seq.len = chunk;
        seq.trim(8);
        // Six rings (window, compressor, MTP window and streams, two DSpark stages), each row of
        // each a view that keeps its ring's whole chunk buffer alive.
        assert_eq!(seq.pinned_bytes(), 6 * (chunk * width * 4) as u64);
        seq.compact(&CpuBackend::new());
        assert_eq!(seq.pinned_bytes(), seq.held_bytes());
        let mtp = seq.mtp.as_ref().expect("mtp state");
        assert_eq!(
            mtp.hidden.get(chunk - 1).map(|r| r.to_vec()),
            Some(vec![252.0, 253.0, 254.0, 255.0])
        );
    }

    #[test]
    fn rollback_keeps_the_speculative_rows_the_shorter_sequence_needs() {
        let mut seq = speculative(40, 8);
        seq.rollback(40 - MAX_BACKTRACK, 8).expect("within budget");
        let mtp = seq.mtp.as_ref().expect("mtp state");
        // The next MTP entry (position 33) needs the streams of 33 and the entries 26..=32.
        assert_eq!(mtp.hidden.get(33).map(|r| r.to_vec()), Some(vec![33.0]));
        assert_eq!(mtp.hidden.get(34).map(|r| r.to_vec()), None);
        assert_eq!(
            mtp.layer.window.get(26).map(|r| r.to_vec()),
            Some(vec![26.0])
        );
        assert_eq!(
            mtp.layer.window.get(32).map(|r| r.to_vec()),
            Some(vec![32.0])
        );
        assert_eq!(mtp.layer.window.get(33).map(|r| r.to_vec()), None);
        for ring in &seq.dspark {
            assert_eq!(ring.get(26).map(|r| r.to_vec()), Some(vec![26.0]));
            assert_eq!(ring.get(33).map(|r| r.to_vec()), Some(vec![33.0]));
            assert_eq!(ring.get(34).map(|r| r.to_vec()), None);
        }
        let mut seq = speculative(40, 8);
        assert!(seq.rollback(40 - MAX_BACKTRACK - 1, 8).is_err());
        assert_eq!(seq.len(), 40, "a refused rollback changes nothing");
    }
}
