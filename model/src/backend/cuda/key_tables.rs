//! A step's key tables, put together on the device. The row addresses of a sequence's
//! append-only key lists ([`KeyList`]: compressed entries, index keys) and of its window rings
//! ([`PositionRing`]) stay on the device between steps, in their mirror slots
//! ([`DeviceKeyMirror`]); a step uploads only the rows appended since and the keys it lists one
//! by one, and one launch ([`copy_addresses`]) copies the rest from the mirrors. A decode step's
//! host work is then per sequence, not per key.

use deepinfer_kernels::ops::key_table::{AddressCopy, copy_addresses};

use std::ops::Range;
use std::sync::atomic::AtomicBool;

use super::*;
use crate::backend::{KeyList, PositionRing};

/// Key rows' addresses on the device. A list's: `addresses[..covers]` (the list's
/// [`crate::backend::KeyMirror::covers`]) in row order, the capacity past them unwritten. A
/// ring's: position `p` of its [`crate::backend::RingMirror::covers`] in slot `p % capacity`.
pub(super) struct DeviceKeyMirror {
    /// The runtime whose stream owns `addresses` (another device's mirror is never read).
    owner: usize,
    row_len: usize,
    /// Whether every address written so far is 16-byte aligned (only ever lowered).
    aligned_16: AtomicBool,
    /// The device address of `addresses`.
    address: u64,
    addresses: CudaSlice<u64>,
}

/// Where `count` consecutive table rows come from.
enum Source {
    /// The step's upload, from this offset.
    Upload(usize),
    /// A device list of addresses at this address.
    Device(u64),
}

/// A mirror to store in its list or ring once the copies are enqueued.
struct MirrorUpdate<'k> {
    of: Mirrored<'k>,
    mirror: Arc<DeviceKeyMirror>,
}

/// What a mirror records, and what it will cover.
enum Mirrored<'k> {
    List(&'k KeyList, usize),
    Ring(&'k PositionRing, Range<usize>),
}

/// Rows of a list or ring uploaded by the step: where they start in the upload, whether every
/// one lives on the device (a host row is uploaded for this launch only, so a mirror must not
/// keep it) and whether every address is 16-byte aligned.
struct Tail {
    at: usize,
    durable: bool,
    aligned: bool,
}

/// The key table of one launch: first the keys listed one by one ([`KeyTableBuilder::listed`]),
/// then whole key lists ([`KeyTableBuilder::list`]), each list once.
pub(super) struct KeyTableBuilder<'b, 'k> {
    backend: &'b CudaBackend,
    op: &'static str,
    row_len: usize,
    /// Addresses uploaded by the step: the listed keys.
    listed: Vec<u64>,
    /// Addresses uploaded by the step: the rows lists gained since their mirrors.
    tails: Vec<u64>,
    /// (first table row, rows, source) of the lists' rows, in table order.
    pieces: Vec<(usize, usize, Source)>,
    /// Rows of the table so far: the listed keys and every piece.
    rows: usize,
    /// (device destination, addresses, offset in `tails`): mirrors' new rows.
    mirror_writes: Vec<(u64, usize, usize)>,
    /// Grown mirrors' earlier rows, copied from the old to the new.
    mirror_moves: Vec<AddressCopy>,
    /// The first table row of each list taken, by the list's address.
    bases: HashMap<usize, u32>,
    updates: Vec<MirrorUpdate<'k>>,
    /// Mirrors the copies read from, kept until the launch is enqueued.
    read: Vec<Arc<DeviceKeyMirror>>,
    aligned_16: bool,
    keep: HostUploads,
}

impl<'b, 'k> KeyTableBuilder<'b, 'k> {
    pub(super) fn new(backend: &'b CudaBackend, op: &'static str, row_len: usize) -> Self {
        KeyTableBuilder {
            backend,
            op,
            row_len,
            listed: Vec::new(),
            tails: Vec::new(),
            pieces: Vec::new(),
            rows: 0,
            mirror_writes: Vec::new(),
            mirror_moves: Vec::new(),
            bases: HashMap::new(),
            updates: Vec::new(),
            read: Vec::new(),
            aligned_16: true,
            keep: HostUploads::default(),
        }
    }

    /// Appends `count` table rows from `source` to the table.
    fn piece(&mut self, count: usize, source: Source) {
        self.pieces.push((self.rows, count, source));
        self.rows += count;
    }

    /// The table row of `key`, listed on its own (before any list is taken).
    pub(super) fn listed(&mut self, key: &Tensor) -> Result<u32, CudaBackendError> {
        if !self.pieces.is_empty() {
            return Err(shape_err(
                self.op,
                "a listed key after a key list (listed keys come first)".to_string(),
            ));
        }
        let address = self.address(key)?;
        let row = rows_u32(self.op, self.rows)?;
        self.listed.push(address);
        self.rows += 1;
        Ok(row)
    }

    /// The first table row of `list`'s rows (all of them, in order).
    pub(super) fn list(&mut self, list: &'k KeyList) -> Result<u32, CudaBackendError> {
        self.first_row(list as *const KeyList as usize, |table| {
            let n = list.len();
            let (covered, mirror) = {
                let slot = list.mirror();
                match table.ours(&slot.device) {
                    Some(mirror) => (slot.covers.min(n), Some(mirror)),
                    None => (0, None),
                }
            };
            let tail = table.take(mirror.as_ref(), 0..covered, n, list[covered..].iter())?;
            // A list with a host row among its new rows keeps its mirror as it was.
            if n == 0 || !tail.durable {
                return Ok(());
            }
            let mirror = match mirror {
                Some(mirror) if mirror.addresses.len() >= n => mirror,
                old => {
                    let aligned = old
                        .as_ref()
                        .is_none_or(|m| m.aligned_16.load(Ordering::Relaxed));
                    let grown = table.new_mirror(mirror_capacity(n), aligned && tail.aligned)?;
                    if let Some(old) = old
                        && covered > 0
                    {
                        table.mirror_moves.push(AddressCopy {
                            src: old.address,
                            dst: grown.address,
                            count: rows_u32(table.op, covered)?,
                            reserved: 0,
                        });
                        table.read.push(old);
                    }
                    Arc::new(grown)
                }
            };
            table.keep(mirror, covered..n, &tail, Mirrored::List(list, n));
            Ok(())
        })
    }

    /// The first table row of `ring`'s rows (every position it holds, in order).
    pub(super) fn ring(&mut self, ring: &'k PositionRing) -> Result<u32, CudaBackendError> {
        self.first_row(ring as *const PositionRing as usize, |table| {
            let (start, end) = (ring.start(), ring.end());
            let n = end - start;
            // A mirror too small for the rows held is replaced, whatever it covers; so is one far
            // larger than they need (a long prefill chunk's, once the ring is trimmed to its
            // window), which would otherwise stay allocated as long as the sequence.
            let (covered_end, mirror) = {
                let slot = ring.mirror();
                let fits = |m: &Arc<DeviceKeyMirror>| {
                    (n..=4 * mirror_capacity(n)).contains(&m.addresses.len())
                };
                match table.ours(&slot.device).filter(fits) {
                    Some(mirror) if slot.covers.start <= start => {
                        (slot.covers.end.clamp(start, end), Some(mirror))
                    }
                    fits => (start, fits),
                }
            };
            let rows = ring.rows().skip(covered_end - start);
            let tail = table.take(mirror.as_ref(), start..covered_end, end, rows)?;
            if n == 0 || !tail.durable {
                return Ok(());
            }
            let mirror = match mirror {
                Some(mirror) => mirror,
                None => Arc::new(table.new_mirror(mirror_capacity(n), tail.aligned)?),
            };
            table.keep(
                mirror,
                covered_end..end,
                &tail,
                Mirrored::Ring(ring, start..end),
            );
            Ok(())
        })
    }

    /// The first table row of the list or ring at address `id`: where `take` puts its rows the
    /// first time, the same rows every later time.
    fn first_row(
        &mut self,
        id: usize,
        take: impl FnOnce(&mut Self) -> Result<(), CudaBackendError>,
    ) -> Result<u32, CudaBackendError> {
        if let Some(&base) = self.bases.get(&id) {
            return Ok(base);
        }
        let base_row = rows_u32(self.op, self.rows)?;
        take(self)?;
        self.bases.insert(id, base_row);
        Ok(base_row)
    }

    /// Appends a list's or ring's positions up to `end` to the table: the `covered` ones from
    /// their slots of `mirror` (position `p` in slot `p % capacity`; a list's never wrap), the
    /// rest (`rows`) from the step's upload.
    fn take<'r>(
        &mut self,
        mirror: Option<&Arc<DeviceKeyMirror>>,
        covered: Range<usize>,
        end: usize,
        rows: impl Iterator<Item = &'r Tensor>,
    ) -> Result<Tail, CudaBackendError> {
        let at = self.tails.len();
        let mut durable = true;
        for row in rows {
            durable &= row.device_view().is_some();
            let address = self.address(row)?;
            self.tails.push(address);
        }
        let aligned = self.tails[at..].iter().all(|a| a % 16 == 0);
        let tail = Tail {
            at,
            durable,
            aligned,
        };
        if let Some(mirror) = mirror
            && !covered.is_empty()
        {
            // The covered positions in order: from their first slot to the mirror's end, then
            // from its start.
            let capacity = mirror.addresses.len();
            for (_, slot, count) in ring_runs(covered.start, covered.len(), capacity) {
                self.piece(count, Source::Device(mirror.address + 8 * slot as u64));
            }
            self.aligned_16 &= mirror.aligned_16.load(Ordering::Relaxed);
            self.read.push(mirror.clone());
        }
        if end > covered.end {
            self.piece(end - covered.end, Source::Upload(tail.at));
        }
        self.aligned_16 &= tail.aligned;
        Ok(tail)
    }

    /// Makes `mirror` the list's or ring's (`of`) once the copies are enqueued, its slots of the
    /// positions `written` copied from the step's upload of `tail`.
    fn keep(
        &mut self,
        mirror: Arc<DeviceKeyMirror>,
        written: Range<usize>,
        tail: &Tail,
        of: Mirrored<'k>,
    ) {
        if !tail.aligned {
            mirror.aligned_16.store(false, Ordering::Relaxed);
        }
        let capacity = mirror.addresses.len();
        for (offset, slot, count) in ring_runs(written.start, written.len(), capacity) {
            let destination = mirror.address + 8 * slot as u64;
            self.mirror_writes
                .push((destination, count, tail.at + offset));
        }
        self.updates.push(MirrorUpdate { of, mirror });
    }

    /// The table on the device: one upload of the listed keys and the lists' new rows, one
    /// launch of the copies; then every list's mirror covers all its rows. The host rows the
    /// table points at were uploaded into the returned [`HostUploads`]: hold them until the
    /// launches reading the table are enqueued.
    pub(super) fn finish(self) -> Result<(DeviceKeyTable, HostUploads), CudaBackendError> {
        let (op, rt) = (self.op, &self.backend.rt);
        let rows = self.rows;
        let listed = self.listed.len();
        if rows == 0 {
            // SAFETY: an empty table is never read.
            let table = unsafe { DeviceKeyTable::upload(rt, &[], self.row_len) };
            return Ok((table.map_err(op_err(op))?, self.keep));
        }
        let mut uploaded = self.listed;
        uploaded.extend_from_slice(&self.tails);
        let upload = rt
            .htod(&uploaded)
            .map_err(driver_err(op, "uploading key addresses"))?;
        // SAFETY: the copies below write every one of the `rows` entries (the listed keys and
        // every list's pieces tile the table).
        let table = unsafe { rt.stream().alloc::<u64>(rows) }
            .map_err(driver_err(op, "allocating the key table"))?;
        let (upload_at, table_at) = (address_of_slice(rt, &upload), address_of_slice(rt, &table));
        let tail_at = |offset: usize| upload_at + 8 * (listed + offset) as u64;
        let mut copies = Vec::with_capacity(1 + self.pieces.len() + self.mirror_writes.len());
        if listed > 0 {
            copies.push(AddressCopy {
                src: upload_at,
                dst: table_at,
                count: rows_u32(op, listed)?,
                reserved: 0,
            });
        }
        for (first, count, source) in self.pieces {
            copies.push(AddressCopy {
                src: match source {
                    Source::Upload(offset) => tail_at(offset),
                    Source::Device(address) => address,
                },
                dst: table_at + 8 * first as u64,
                count: rows_u32(op, count)?,
                reserved: 0,
            });
        }
        for (dst, count, offset) in self.mirror_writes {
            copies.push(AddressCopy {
                src: tail_at(offset),
                dst,
                count: rows_u32(op, count)?,
                reserved: 0,
            });
        }
        copies.extend(self.mirror_moves);
        // SAFETY: the sources are the upload, kept until the launch is enqueued, and mirrors'
        // first `covers` rows (held in `self.read`); the destinations are the new table, the
        // mirrors' rows past what they cover (never read by these copies) and new mirrors: all
        // disjoint, all allocated on the runtime's stream, 8-byte aligned.
        unsafe { copy_addresses(rt, &copies) }.map_err(op_err(op))?;
        for MirrorUpdate { of, mirror } in self.updates {
            let device = Some(mirror as Arc<dyn Any + Send + Sync>);
            match of {
                Mirrored::List(list, covers) => {
                    let mut slot = list.mirror();
                    slot.covers = covers;
                    slot.device = device;
                }
                Mirrored::Ring(ring, covers) => {
                    let mut slot = ring.mirror();
                    slot.covers = covers;
                    slot.device = device;
                }
            }
        }
        drop((upload, self.read));
        // SAFETY: every entry is the address of a `row_len`-value row of a key the lists, the
        // caller's tensors or the returned uploads hold (checked by `address_of`), 16-byte
        // aligned where claimed.
        let table =
            unsafe { DeviceKeyTable::from_device(table, rows, self.row_len, self.aligned_16) };
        Ok((table.map_err(op_err(op))?, self.keep))
    }

    /// This backend's mirror for rows of this table's length, if `device` holds one.
    fn ours(&self, device: &Option<Arc<dyn Any + Send + Sync>>) -> Option<Arc<DeviceKeyMirror>> {
        let owner = self.backend.owner();
        device
            .as_ref()
            .and_then(|d| Arc::clone(d).downcast::<DeviceKeyMirror>().ok())
            .filter(|m| m.owner == owner && m.row_len == self.row_len)
    }

    /// A mirror of `capacity` rows, none written yet.
    fn new_mirror(
        &self,
        capacity: usize,
        aligned_16: bool,
    ) -> Result<DeviceKeyMirror, CudaBackendError> {
        // SAFETY: only the rows a mirror covers are ever read; the copies of the step that
        // creates it write them before its list or ring claims them.
        let addresses = unsafe { self.backend.rt.stream().alloc::<u64>(capacity) }
            .map_err(driver_err(self.op, "allocating a key mirror"))?;
        Ok(DeviceKeyMirror {
            owner: self.backend.owner(),
            row_len: self.row_len,
            aligned_16: AtomicBool::new(aligned_16),
            address: address_of_slice(&self.backend.rt, &addresses),
            addresses,
        })
    }

    fn address(&mut self, key: &Tensor) -> Result<u64, CudaBackendError> {
        if key.len() != self.row_len {
            return Err(shape_err(
                self.op,
                format!("a key of {} values; rows are {}", key.len(), self.row_len),
            ));
        }
        self.backend
            .address_of(self.op, key, 0, self.row_len, &mut self.keep)
    }
}

/// The smallest mirror allocated (rows): a list grows by one row every few steps.
const MIRROR_MIN_ROWS: usize = 64;

/// The capacity of a new mirror for `rows` rows: room to grow (a list appends, a ring slides).
fn mirror_capacity(rows: usize) -> usize {
    (2 * rows).max(MIRROR_MIN_ROWS)
}

/// The runs of a ring mirror's slots that hold `count` consecutive positions from `first`:
/// (offset in the positions, first slot, slots), at most two (`count <= capacity`).
fn ring_runs(
    first: usize,
    count: usize,
    capacity: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let slot = first % capacity;
    let head = count.min(capacity - slot);
    [(0, slot, head), (head, 0, count - head)]
        .into_iter()
        .filter(|&(_, _, slots)| slots > 0)
}

pub(super) fn rows_u32(op: &'static str, rows: usize) -> Result<u32, CudaBackendError> {
    u32::try_from(rows).map_err(|_| shape_err(op, "more than 2^32 key rows".to_string()))
}

fn address_of_slice(rt: &KernelRuntime, slice: &CudaSlice<u64>) -> u64 {
    let (address, _sync) = slice.device_ptr(rt.stream());
    address
}
