//! Device pointer tables of key rows. A sequence's keys (window entries, compressed entries,
//! index keys) may lie in many separately allocated device buffers, a row being (buffer, element
//! offset); [`DeviceKeyTable`] holds one device address per row so that the attention and
//! index-score launchers ([`KeyRows::Table`]) read them where they are, without a gather copy.
//! [`key_row_address`] gives a row's address; [`DeviceKeyTable::upload`] puts a table on the
//! device.
//!
//! Lifetime contract: a table holds plain addresses, not the buffers. Whoever builds one promises
//! (that is why the constructors are `unsafe`) that every buffer it points into stays allocated
//! until every launch reading the table has run. The launchers enqueue on the runtime's one
//! in-order stream, so it is enough to hold the buffers (e.g. an `Arc` per buffer, as a tensor
//! type does) until after the launch was enqueued, provided the buffers are freed on that same
//! stream (cudarc frees a `CudaSlice` stream-ordered, on the stream it was allocated on);
//! buffers of another stream must be held until the runtime's stream has been synchronised.

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};

use super::{ensure, shape_error};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::{KernelRuntime, Launch};

/// A copy of `count` addresses (u64) from device address `src` to device address `dst`
/// ([`copy_addresses`]); mirrors `AddressCopy` in `cuda/common/movement.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressCopy {
    pub src: u64,
    pub dst: u64,
    pub count: u32,
    pub reserved: u32,
}

// SAFETY: a plain `#[repr(C)]` struct of integers, laid out as its CUDA mirror.
unsafe impl DeviceRepr for AddressCopy {}

/// Runs every copy of `copies` in one launch (one upload of the list): how a step's key table
/// is put together from the address lists that stay on the device between steps and the few
/// addresses the step uploads.
///
/// # Safety
/// Every `src` and `dst` range lies inside a live device allocation of this runtime's stream,
/// 8-byte aligned; the `dst` ranges overlap neither each other nor any `src` range (the copies
/// run concurrently).
pub unsafe fn copy_addresses(
    rt: &KernelRuntime,
    copies: &[AddressCopy],
) -> Result<(), KernelError> {
    const OP: &str = "copy_addresses";
    if let Some(bad) = copies
        .iter()
        .find(|c| c.count > 0 && (c.src == 0 || c.dst == 0 || (c.src | c.dst) % 8 != 0))
    {
        return Err(shape_error(
            OP,
            format!(
                "a copy of {} addresses from {:#x} to {:#x} (null or not 8-byte aligned)",
                bad.count, bad.src, bad.dst
            ),
        ));
    }
    if copies.is_empty() {
        return Ok(());
    }
    let n = u32::try_from(copies.len())
        .map_err(|_| shape_error(OP, format!("{} copies exceed u32", copies.len())))?;
    let dcopies = rt
        .htod(copies)
        .map_err(KernelError::driver("uploading the address copies"))?;
    let cfg = super::launch_config((n.min(1024), 1, 1), 256, 0);
    let mut launch = rt.launcher(KernelId::CopyAddresses)?;
    launch.arg(&dcopies).arg(&n);
    // SAFETY: signature (const AddressCopy* copies, u32 n); every range is inside a live
    // allocation and the destinations are disjoint from each other and from the sources (the
    // caller's contract).
    unsafe { launch.launch(cfg) }
}

/// The device address of the `row_len` f32 values starting at element `offset` of `buffer`.
/// The address stays valid while `buffer` is allocated; taking it costs no driver call (the
/// runtime keeps cudarc's cross-stream event tracking off: `buffer` must belong to its stream).
pub fn key_row_address(
    rt: &KernelRuntime,
    buffer: &CudaSlice<f32>,
    offset: usize,
    row_len: usize,
) -> Result<u64, KernelError> {
    const OP: &str = "key_row_address";
    let fits = offset
        .checked_add(row_len)
        .is_some_and(|end| end <= buffer.len());
    ensure(row_len != 0 && fits, OP, || {
        format!(
            "a row of {row_len} values at element {offset} does not fit a buffer of {} values (rows must be non-empty)",
            buffer.len()
        )
    })?;
    let (base, _read_recorded) = buffer.device_ptr(rt.stream());
    // `offset < buffer.len()`, so the byte offset lies inside the allocation and cannot overflow.
    Ok(base + (offset * size_of::<f32>()) as u64)
}

/// One device address per key row, each row `row_len` f32 values, in table order: row `r` of a
/// [`crate::ops::attention::DeviceKeyLists`] or of a visible prefix is `addresses[r]`.
pub struct DeviceKeyTable {
    rows: usize,
    row_len: usize,
    /// Whether every row is known to start on a 16-byte boundary (float4 loads).
    aligned_16: bool,
    /// `[rows]` addresses (at least one element: a device buffer cannot be empty).
    addresses: CudaSlice<u64>,
}

impl DeviceKeyTable {
    /// Uploads `addresses` (one per row, e.g. from [`key_row_address`]) as a table of rows of
    /// `row_len` f32 values: one host-to-device copy. Null or misaligned addresses are rejected.
    ///
    /// # Safety
    /// Every address must point at `row_len` f32 values of device memory of `rt`'s context that
    /// stays allocated until every launch reading this table has run (see the module's lifetime
    /// contract); the launchers dereference them without further checks.
    pub unsafe fn upload(
        rt: &KernelRuntime,
        addresses: &[u64],
        row_len: usize,
    ) -> Result<DeviceKeyTable, KernelError> {
        const OP: &str = "DeviceKeyTable::upload";
        ensure(row_len != 0, OP, || "rows of 0 values")?;
        if let Some((row, address)) = addresses
            .iter()
            .enumerate()
            .find(|&(_, &a)| a == 0 || !a.is_multiple_of(size_of::<f32>() as u64))
        {
            return Err(shape_error(
                OP,
                format!("row {row} has address {address:#x} (null or not f32-aligned)"),
            ));
        }
        let device = if addresses.is_empty() {
            rt.htod(&[0u64]) // never read: no row can be listed
        } else {
            rt.htod(addresses)
        }
        .map_err(KernelError::driver("uploading the key row addresses"))?;
        Ok(DeviceKeyTable {
            rows: addresses.len(),
            row_len,
            aligned_16: addresses.iter().all(|a| a.is_multiple_of(16)),
            addresses: device,
        })
    }

    /// A table already on the device (e.g. written by [`copy_addresses`]): its first `rows`
    /// entries, every one of them 16-byte aligned when `aligned_16` says so.
    ///
    /// # Safety
    /// As [`DeviceKeyTable::upload`], for each of the first `rows` entries of `addresses` at the
    /// time each launch reading the table runs, and `aligned_16` true only if they are.
    pub unsafe fn from_device(
        addresses: CudaSlice<u64>,
        rows: usize,
        row_len: usize,
        aligned_16: bool,
    ) -> Result<DeviceKeyTable, KernelError> {
        ensure(
            row_len != 0 && rows <= addresses.len(),
            "DeviceKeyTable::from_device",
            || {
                format!(
                    "{rows} rows of {row_len} values in a table of {} addresses (rows must be non-empty)",
                    addresses.len()
                )
            },
        )?;
        Ok(DeviceKeyTable {
            rows,
            row_len,
            aligned_16,
            addresses,
        })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// Whether every row starts on a 16-byte boundary (known for uploaded tables).
    pub fn rows_aligned_16(&self) -> bool {
        self.aligned_16
    }

    /// The addresses on the device (`u64` each; only the first [`DeviceKeyTable::rows`] count).
    pub fn addresses(&self) -> &CudaSlice<u64> {
        &self.addresses
    }
}

/// Where a row-batched attention or index-score launch reads its key rows.
#[derive(Clone, Copy)]
pub enum KeyRows<'a> {
    /// Rows of one buffer `[rows, head_dim]`.
    Flat(&'a CudaSlice<f32>),
    /// One device address per row ([`DeviceKeyTable`]; the same kernel body, bitwise the same
    /// results as the flat rows on the same key values).
    Table(&'a DeviceKeyTable),
}

impl<'k> KeyRows<'k> {
    /// Checks that the source holds `rows` rows of `head_dim` values.
    pub(crate) fn check_covers(
        &self,
        op: &'static str,
        rows: usize,
        head_dim: usize,
    ) -> Result<(), KernelError> {
        match self {
            KeyRows::Flat(keys) if keys.len() < rows * head_dim => Err(shape_error(
                op,
                format!(
                    "keys hold {} values, fewer than {rows} keys of {head_dim}",
                    keys.len()
                ),
            )),
            KeyRows::Table(table) if table.row_len != head_dim || table.rows < rows => {
                Err(shape_error(
                    op,
                    format!(
                        "the key table has {} rows of {} values; the launch needs {rows} rows of \
                         {head_dim}",
                        table.rows, table.row_len
                    ),
                ))
            }
            KeyRows::Flat(_) | KeyRows::Table(_) => Ok(()),
        }
    }

    /// The kernel of this source: `flat` or `table`.
    pub(crate) fn kernel(&self, flat: KernelId, table: KernelId) -> KernelId {
        match self {
            KeyRows::Flat(_) => flat,
            KeyRows::Table(_) => table,
        }
    }

    /// Pushes the source as the kernel's `keys` (`const float*`) or `key_ptrs`
    /// (`const unsigned long long*`) argument.
    pub(crate) fn push<'a>(self, launch: &mut Launch<'a>)
    where
        'k: 'a,
    {
        match self {
            KeyRows::Flat(keys) => launch.arg(keys),
            KeyRows::Table(table) => launch.arg(table.addresses()),
        };
    }
}
