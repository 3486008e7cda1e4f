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

use cudarc::driver::{CudaSlice, DevicePtr};

use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::{KernelRuntime, Launch};

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
    if row_len == 0 || !fits {
        return Err(KernelError::Shape {
            op: OP,
            message: format!(
                "a row of {row_len} values at element {offset} does not fit a buffer of {} values (rows must be non-empty)",
                buffer.len()
            ),
        });
    }
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
        if row_len == 0 {
            return Err(KernelError::Shape {
                op: OP,
                message: "rows of 0 values".to_string(),
            });
        }
        if let Some((row, address)) = addresses
            .iter()
            .enumerate()
            .find(|&(_, &a)| a == 0 || !a.is_multiple_of(size_of::<f32>() as u64))
        {
            return Err(KernelError::Shape {
                op: OP,
                message: format!("row {row} has address {address:#x} (null or not f32-aligned)"),
            });
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

    /// A table already on the device (e.g. written by a kernel): its first `rows` entries.
    ///
    /// # Safety
    /// As [`DeviceKeyTable::upload`], for each of the first `rows` entries of `addresses` at the
    /// time each launch reading the table runs.
    pub unsafe fn from_device(
        addresses: CudaSlice<u64>,
        rows: usize,
        row_len: usize,
    ) -> Result<DeviceKeyTable, KernelError> {
        if row_len == 0 || rows > addresses.len() {
            return Err(KernelError::Shape {
                op: "DeviceKeyTable::from_device",
                message: format!(
                    "{rows} rows of {row_len} values in a table of {} addresses (rows must be non-empty)",
                    addresses.len()
                ),
            });
        }
        Ok(DeviceKeyTable {
            rows,
            row_len,
            aligned_16: false, // not known on the host
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
            KeyRows::Flat(keys) if keys.len() < rows * head_dim => Err(KernelError::Shape {
                op,
                message: format!(
                    "keys hold {} values, fewer than {rows} keys of {head_dim}",
                    keys.len()
                ),
            }),
            KeyRows::Table(table) if table.row_len != head_dim || table.rows < rows => {
                Err(KernelError::Shape {
                    op,
                    message: format!(
                        "the key table has {} rows of {} values; the launch needs {rows} rows of \
                         {head_dim}",
                        table.rows, table.row_len
                    ),
                })
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
