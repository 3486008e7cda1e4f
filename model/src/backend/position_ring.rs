//! [`PositionRing`]: per-position rows for a sequence's most recent positions (every window,
//! compressor tail, DSpark context and MTP stream of both families), with a slot where a device
//! backend keeps the rows' addresses between steps ([`RingMirror`]): a decode step's window then
//! sends the one row it appended, not every row of the window again.

use std::any::Any;
use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{Backend, Pinned, Tensor};

/// Per-position rows for the most recent positions: `rows[i]` belongs to position `start + i`
/// (each row a [`Tensor`]: in device memory on a device backend). The rows held are always
/// consecutive positions; every change goes through the methods, which keep the mirror's claim
/// true.
#[derive(Default)]
pub struct PositionRing {
    start: usize,
    rows: VecDeque<Tensor>,
    mirror: Mutex<RingMirror>,
}

/// A backend's record of a [`PositionRing`]: `device` (the backend's own type) holds the
/// addresses of the rows of the positions `covers`, each in the slot of its position modulo the
/// record's capacity. The ring narrows `covers` when rows it counted are dropped or replaced;
/// only the backend that stored `device` reads it.
#[derive(Default)]
pub struct RingMirror {
    pub covers: Range<usize>,
    pub device: Option<Arc<dyn Any + Send + Sync>>,
}

/// The keys of a query's window: the rows of `ring` at `positions` (every one held), listed
/// from position `from` to the end, then from the start up to `from` (`from ==
/// positions.start`: in position order).
#[derive(Debug, Clone)]
pub struct WindowKeys<'a> {
    pub ring: &'a PositionRing,
    pub positions: Range<usize>,
    pub from: usize,
}

impl<'a> WindowKeys<'a> {
    /// How many keys.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// The positions in the order the keys are listed: at most two runs.
    pub fn runs(&self) -> [Range<usize>; 2] {
        [
            self.from..self.positions.end,
            self.positions.start..self.from,
        ]
    }

    /// The keys in listed order.
    pub fn rows(&self) -> impl Iterator<Item = &'a Tensor> + Clone + 'a {
        let ring: &'a PositionRing = self.ring;
        self.runs().into_iter().flat_map(move |run| {
            ring.rows
                .range(run.start - ring.start..run.end - ring.start)
        })
    }
}

impl PositionRing {
    /// An empty ring whose first row will be that of `position`.
    pub fn starting_at(position: usize) -> PositionRing {
        PositionRing {
            start: position,
            ..PositionRing::default()
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

    /// Appends the row of the position after the newest one held (a mirror stays true).
    pub fn push(&mut self, row: impl Into<Tensor>) {
        self.rows.push_back(row.into());
    }

    /// Appends the row of `position`; a gap (positions never computed, as after a bounded replay)
    /// drops the older rows so that the ring stays contiguous.
    pub fn push_at(&mut self, position: usize, row: impl Into<Tensor>) {
        if self.end() != position {
            self.rows.clear();
            self.start = position;
            self.narrow_mirror(position..position);
        }
        self.rows.push_back(row.into());
    }

    /// The row of `position`, if held.
    pub fn get(&self, position: usize) -> Option<&Tensor> {
        position
            .checked_sub(self.start)
            .and_then(|i| self.rows.get(i))
    }

    /// The keys of the held positions in `first..=last` (a window ending at `last`), in
    /// position order.
    pub fn window(&self, first: usize, last: usize) -> WindowKeys<'_> {
        let positions = self.held(first, last);
        WindowKeys {
            ring: self,
            from: positions.start,
            positions,
        }
    }

    /// [`PositionRing::window`], listed in the order of `slots` ring slots (position `p` in slot
    /// `p % slots`, slot 0 first), as DeepSeek's DSpark lists a context window.
    pub fn slot_window(&self, first: usize, last: usize, slots: usize) -> WindowKeys<'_> {
        let positions = self.held(first, last);
        let wrap = match slots {
            0 => first,
            _ => first + (slots - first % slots) % slots,
        };
        WindowKeys {
            ring: self,
            from: wrap.clamp(positions.start, positions.end),
            positions,
        }
    }

    /// The held positions of `first..=last` (an empty range inside the ring's when none is).
    fn held(&self, first: usize, last: usize) -> Range<usize> {
        let start = first.clamp(self.start, self.end());
        let end = last.saturating_add(1).min(self.end());
        start..end.max(start)
    }

    /// The rows held, oldest first.
    pub fn rows(&self) -> impl ExactSizeIterator<Item = &Tensor> + '_ {
        self.rows.iter()
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
    /// so that the rows a long chunk left do not keep that chunk's whole buffers alive (the
    /// copies leave the mirror).
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
        let start = self.start;
        self.narrow_mirror(start..start);
    }

    /// Bytes of the rows held (f32 values).
    pub fn held_bytes(&self) -> u64 {
        self.rows.iter().map(|row| row.len() as u64 * 4).sum()
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
        let mirror = self
            .mirror
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let end = mirror.covers.end.min(len);
        mirror.covers = mirror.covers.start.min(end)..end;
    }

    /// The backend's mirror of this ring, locked for reading and updating.
    pub fn mirror(&self) -> MutexGuard<'_, RingMirror> {
        self.mirror.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn narrow_mirror(&mut self, covers: Range<usize>) {
        let mirror = self
            .mirror
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        mirror.covers = covers;
    }
}

/// A copy holds the same rows and no mirror (a backend's record belongs to one ring).
impl Clone for PositionRing {
    fn clone(&self) -> PositionRing {
        PositionRing {
            start: self.start,
            rows: self.rows.clone(),
            mirror: Mutex::default(),
        }
    }
}

/// The same positions and rows, whatever the mirrors hold.
impl PartialEq for PositionRing {
    fn eq(&self, other: &PositionRing) -> bool {
        self.start == other.start && self.rows == other.rows
    }
}

impl fmt::Debug for PositionRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PositionRing")
            .field("start", &self.start)
            .field("rows", &self.rows)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::tensor::HostDeviceBuffer;

    fn ring_of(positions: Range<usize>) -> PositionRing {
        let mut ring = PositionRing::starting_at(positions.start);
        for p in positions {
            ring.push(vec![p as f32]);
        }
        ring
    }

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
    fn a_window_is_the_held_positions_of_its_range_in_order() {
        let ring = ring_of(5..12);
        let values = |w: WindowKeys<'_>| -> Vec<f32> { w.rows().map(|r| r[0]).collect() };
        assert_eq!(values(ring.window(8, 10)), vec![8.0, 9.0, 10.0]);
        assert_eq!(
            ring.window(0, 6).positions,
            5..7,
            "clipped at the oldest row"
        );
        assert_eq!(ring.window(10, 40).positions, 10..12, "and at the newest");
        assert!(ring.window(20, 30).is_empty());
        assert!(ring.window(0, 2).is_empty());
        let empty = PositionRing::starting_at(3);
        assert!(empty.window(0, 9).is_empty());
    }

    /// DSpark's context order: slot by slot of a `slots`-slot ring (position `p` in slot
    /// `p % slots`), the slots of positions not held skipped; for every window end, ring extent
    /// and slot count, the two runs of `slot_window` list exactly that.
    #[test]
    fn a_slot_window_lists_the_held_positions_slot_by_slot() {
        for slots in [1, 3, 8] {
            for held in [0..20, 4..20, 9..13] {
                let ring = ring_of(held.clone());
                for last in 0..24usize {
                    let first = (last + 1).saturating_sub(slots);
                    let by_slot: Vec<f32> = (0..=last - first)
                        .filter_map(|slot| {
                            let offset = (slot + slots - first % slots) % slots;
                            ring.get(first + offset).map(|row| row[0])
                        })
                        .collect();
                    let window = ring.slot_window(first, last, slots);
                    let listed: Vec<f32> = window.rows().map(|row| row[0]).collect();
                    assert_eq!(listed, by_slot, "slots {slots}, held {held:?}, last {last}");
                    assert_eq!(window.len(), by_slot.len());
                }
            }
        }
    }

    #[test]
    fn every_change_that_drops_or_replaces_rows_narrows_the_mirror() {
        let mut ring = ring_of(0..10);
        let claim = |ring: &PositionRing| ring.mirror().covers.clone();
        ring.mirror().covers = 2..10;
        ring.push(vec![10.0]);
        ring.trim(6);
        assert_eq!(claim(&ring), 2..10, "appending and trimming keep the claim");
        ring.truncate(12);
        assert_eq!(claim(&ring), 2..10, "dropping nothing keeps it");
        ring.truncate(8);
        assert_eq!(claim(&ring), 2..8, "dropped rows leave it");
        ring.push_at(8, vec![80.0]);
        assert_eq!(claim(&ring), 2..8);
        ring.truncate(1);
        assert_eq!(claim(&ring), 1..1);

        let mut gap = ring_of(0..4);
        gap.mirror().covers = 0..4;
        gap.push_at(9, vec![9.0]);
        assert_eq!(claim(&gap), 9..9, "a gap empties it");

        let backend = crate::backend::CpuBackend::new();
        let mut host = ring_of(0..4);
        host.mirror().covers = 0..4;
        host.compact(&backend);
        assert_eq!(claim(&host), 0..4, "host rows are not copied");
        let chunk = HostDeviceBuffer::tensor((0..8).map(|v| v as f32).collect());
        let mut views = PositionRing::starting_at(4);
        for row in chunk.split_rows(2) {
            views.push(row);
        }
        views.mirror().covers = 4..8;
        views.compact(&backend);
        assert_eq!(claim(&views), 4..4, "copied rows leave it");
        assert_eq!(views.get(6).map(|row| row.to_vec()), Some(vec![4.0, 5.0]));
    }

    #[test]
    fn a_copy_has_the_rows_and_no_mirror() {
        let ring = ring_of(3..7);
        {
            let mut mirror = ring.mirror();
            mirror.covers = 3..7;
            mirror.device = Some(Arc::new(7u32));
        }
        let copy = ring.clone();
        assert_eq!(copy, ring);
        assert!(copy.mirror().covers.is_empty());
        assert!(copy.mirror().device.is_none());
    }
}
