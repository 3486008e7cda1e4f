//! Per-position rows kept across steps: the [`PositionRing`] of every window, compressor tail,
//! DSpark context and MTP stream of both families, and the rollback budget [`MAX_BACKTRACK`] the
//! rings keep beyond what the next token needs.

use std::collections::VecDeque;

use crate::backend::{Backend, KeyList, Pinned, Tensor};
use crate::error::ModelError;

/// How many most recent tokens a rollback may drop (anchor + 5 drafts of DSpark).
pub const MAX_BACKTRACK: usize = 6;

/// Per-position rows for the most recent positions: `rows[i]` belongs to position `start + i`
/// (each row a [`Tensor`]: in device memory on a device backend).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PositionRing {
    start: usize,
    rows: VecDeque<Tensor>,
}

impl PositionRing {
    /// An empty ring whose first row will be that of `position`.
    pub fn starting_at(position: usize) -> PositionRing {
        PositionRing {
            start: position,
            rows: VecDeque::new(),
        }
    }

    /// Oldest position held.
    pub fn start(&self) -> usize {
        self.start
    }

    /// The position after the newest one held.
    pub fn end(&self) -> usize {
        self.start + self.rows.len()
    }

    /// Appends the row of the position after the newest one held.
    pub fn push(&mut self, row: impl Into<Tensor>) {
        self.rows.push_back(row.into());
    }

    /// Appends the row of `position`; a gap (positions never computed, as after a bounded replay)
    /// drops the older rows so that the ring stays contiguous.
    pub fn push_at(&mut self, position: usize, row: impl Into<Tensor>) {
        if self.start + self.rows.len() != position {
            self.rows.clear();
            self.start = position;
        }
        self.rows.push_back(row.into());
    }

    /// The row of `position`, if held.
    pub fn get(&self, position: usize) -> Option<&Tensor> {
        position
            .checked_sub(self.start)
            .and_then(|i| self.rows.get(i))
    }

    /// Drops the oldest rows until at most `capacity` remain.
    pub fn trim(&mut self, capacity: usize) {
        self.trim_before(capacity, usize::MAX);
    }

    /// [`PositionRing::trim`], but keeps every row of a position `>= keep_from`.
    pub fn trim_before(&mut self, capacity: usize, keep_from: usize) {
        while self.rows.len() > capacity && self.start < keep_from {
            self.rows.pop_front();
            self.start += 1;
        }
    }

    /// Copies the rows held into one buffer of their own when they are views into device memory,
    /// so that the rows a long chunk left do not keep that chunk's whole buffers alive.
    pub fn compact(&mut self, backend: &dyn Backend) {
        let Some(width) = self.rows.front().map(Tensor::len) else {
            return;
        };
        if self.rows.iter().all(|row| row.device_view().is_none()) {
            return; // host rows are copies already
        }
        let pieces: Vec<(&Tensor, usize)> = self.rows.iter().map(|row| (row, 0)).collect();
        let packed = backend.gather(&pieces, width);
        self.rows = packed.split_rows(width).into();
    }

    /// Bytes of the rows held (f32 values).
    pub fn held_bytes(&self) -> u64 {
        tensor_bytes(&self.rows)
    }

    /// Counts the allocations the rows keep alive into `pinned`.
    pub fn pin(&self, pinned: &mut Pinned) {
        pinned.add_tensors(&self.rows);
    }

    /// Drops every row of a position `>= len`.
    pub fn truncate(&mut self, len: usize) {
        let keep = len.saturating_sub(self.start).min(self.rows.len());
        self.rows.truncate(keep);
        if self.rows.is_empty() {
            self.start = self.start.min(len);
        }
    }
}

/// Entries an append-only cache (compressed KV, index keys) gathers at once ([`pack_rows`]): few
/// enough that what a cache pins beyond what it holds stays small, many enough that a sequence
/// of a batched decode copies its entries once every `PACK_ENTRIES` of them.
pub(crate) const PACK_ENTRIES: usize = 32;

/// Copies the rows of `list` from `from` on into one buffer of their own when they pin more
/// than they hold: views of buffers that also hold rows the list does not keep (a batched step's
/// buffer shares the other sequences' rows, which would stay alive as long as this list; a
/// rollback drops rows of a buffer). Rows that are the whole of their buffers (a sequence's
/// chunk, host rows) are left as they are. The values never change; the rows replaced leave the
/// list's mirror (dropped and appended again, [`KeyList`]'s two changes).
pub(crate) fn pack_rows(list: &mut KeyList, from: usize, backend: &dyn Backend) {
    let Some(rows) = list.get(from..) else {
        return;
    };
    let Some(width) = rows.first().map(Tensor::len) else {
        return;
    };
    let mut pinned = Pinned::default();
    pinned.add_tensors(rows);
    if pinned.bytes() <= tensor_bytes(rows) || rows.iter().any(|r| r.len() != width) {
        return;
    }
    let pieces: Vec<(&Tensor, usize)> = rows.iter().map(|row| (row, 0)).collect();
    let own = backend.gather(&pieces, width).split_rows(width);
    list.truncate(from);
    list.extend(own);
}

/// Bytes of the f32 values of `rows`.
pub(crate) fn tensor_bytes<'a>(rows: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    rows.into_iter().map(|row| row.len() as u64 * 4).sum()
}

/// The error of a rollback to `len` tokens of a sequence that holds only `held`.
pub(crate) fn past_end(len: usize, held: usize) -> ModelError {
    ModelError::Sequence {
        message: format!("cannot roll back to {len} tokens: the sequence holds only {held}"),
    }
}

/// The error of a rollback from `current` to `len` tokens that the rings no longer allow.
pub(crate) fn too_far(len: usize, current: usize) -> ModelError {
    ModelError::Sequence {
        message: format!(
            "cannot roll back from {current} to {len} tokens: only the last {MAX_BACKTRACK} tokens can be dropped"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_positions_through_trim_truncate_and_gaps() {
        let mut ring = PositionRing::default();
        for p in 0..10 {
            ring.push_at(p, vec![p as f32]);
        }
        ring.trim_before(4, 3);
        assert_eq!(
            (ring.start(), ring.end()),
            (3, 10),
            "rows from 3 on are kept"
        );
        ring.trim(4);
        assert_eq!(ring.start(), 6);
        assert_eq!(ring.get(5), None);
        assert_eq!(ring.get(9), Some(&Tensor::from(vec![9.0])));
        ring.truncate(8);
        assert_eq!(ring.get(8), None);
        assert_eq!(ring.get(7), Some(&Tensor::from(vec![7.0])));
        ring.push_at(8, vec![80.0]);
        assert_eq!(ring.get(8), Some(&Tensor::from(vec![80.0])));
        // A gap restarts the ring at the new position.
        ring.push_at(20, vec![20.0]);
        assert_eq!((ring.start(), ring.get(8)), (20, None));
    }

    #[test]
    fn pack_rows_copies_rows_out_of_shared_buffers_only() {
        use crate::backend::CpuBackend;
        use crate::backend::tensor::HostDeviceBuffer;
        let pinned = |rows: &[Tensor]| {
            let mut pinned = Pinned::default();
            pinned.add_tensors(rows);
            pinned.bytes()
        };
        // A sequence's own chunk: every row of the buffer is kept, nothing is copied.
        let chunk = HostDeviceBuffer::tensor((0..12).map(|v| v as f32).collect());
        let mut own = KeyList::from(chunk.split_rows(3));
        pack_rows(&mut own, 0, &CpuBackend::new());
        assert!(own.iter().all(|row| row.device_view().is_some()));
        assert_eq!(pinned(&own), 12 * 4);
        // Then four batched steps, each buffer shared with two other sequences' rows.
        own.extend((0..4).map(|s| {
            let values = (0..9).map(|v| (100 + 9 * s + v) as f32).collect();
            HostDeviceBuffer::tensor(values).rows(1..2, 3)
        }));
        own.mirror().covers = 6;
        assert_eq!(pinned(&own[4..]), 4 * 9 * 4);
        pack_rows(&mut own, 4, &CpuBackend::new());
        assert_eq!(pinned(&own), tensor_bytes(own.iter()));
        assert_eq!(
            own[6].to_vec(),
            vec![121.0, 122.0, 123.0],
            "the same values"
        );
        assert!(own[3].device_view().is_some(), "rows before `from` stay");
        assert_eq!(own.mirror().covers, 4, "the replaced rows leave the mirror");
    }
}
