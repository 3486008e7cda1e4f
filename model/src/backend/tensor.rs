//! [`Tensor`]: the f32 values (activations, KV rows) that [`super::Backend`] ops take and return.
//! On the CPU backend a tensor is a host `Vec`; on a device backend it is a view of device memory
//! (a shared buffer and an offset), so a chain of ops never leaves the device. Reading a device
//! tensor on the host (`Deref` to `[f32]`, [`Tensor::into_vec`]) copies it back once, keeps the
//! copy, and the backend counts it: that is how a decode step proves it made no such copy.
//! [`Pinned`] counts the memory tensors keep alive: whole allocations, not the values viewed.

use std::any::Any;
use std::collections::HashSet;
use std::fmt;
use std::ops::{Deref, Range};
use std::sync::{Arc, OnceLock};

/// Device memory a backend hands out for a [`Tensor`]; the backend recovers its own type with
/// [`DeviceBuffer::as_any`].
pub trait DeviceBuffer: Send + Sync + fmt::Debug {
    /// Values in the buffer.
    fn len(&self) -> usize;
    /// Whether the buffer holds no value.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `len` values from `offset` to the host (a device failure has no error channel here,
    /// like a [`super::Backend`] op: it panics naming the copy).
    fn download(&self, offset: usize, len: usize) -> Vec<f32>;
    /// The device address of the buffer's first value, where the backend reads rows by address
    /// (key tables): every view keeps it ([`DeviceView::address`]), so a row's address is found
    /// without touching the buffer. `None` (the default) for buffers read otherwise.
    fn device_address(&self) -> Option<u64> {
        None
    }
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A tensor's values in device memory: `len` values of `buffer` from `offset`.
#[derive(Debug, Clone)]
pub struct DeviceView {
    pub buffer: Arc<dyn DeviceBuffer>,
    pub offset: usize,
    /// `buffer.device_address()`, read once when the buffer became a tensor.
    base: Option<u64>,
}

impl DeviceView {
    /// The device address of value `offset` of the view (f32 values), when its buffer has one.
    pub fn address(&self, offset: usize) -> Option<u64> {
        let bytes = (self.offset + offset) * std::mem::size_of::<f32>();
        self.base.map(|base| base + bytes as u64)
    }
}

/// Row-major f32 values on the host or on a device ([module docs](self)).
#[derive(Clone)]
pub struct Tensor {
    len: usize,
    device: Option<DeviceView>,
    /// The host values: always set for a host tensor, filled on first read for a device one.
    host: OnceLock<Vec<f32>>,
}

impl Tensor {
    /// A host tensor.
    pub fn host(values: Vec<f32>) -> Tensor {
        Tensor {
            len: values.len(),
            device: None,
            host: OnceLock::from(values),
        }
    }

    /// `len` values of `buffer` from `offset` (`offset + len` must not pass the buffer's end).
    pub fn device(buffer: Arc<dyn DeviceBuffer>, offset: usize, len: usize) -> Tensor {
        assert!(
            offset + len <= buffer.len(),
            "a device tensor of {len} values at {offset} passes the end of its {}-value buffer",
            buffer.len()
        );
        let base = buffer.device_address();
        Tensor {
            len,
            device: Some(DeviceView {
                buffer,
                offset,
                base,
            }),
            host: OnceLock::new(),
        }
    }

    /// An empty host tensor.
    pub fn empty() -> Tensor {
        Tensor::host(Vec::new())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the values live on a device, if they do.
    pub fn device_view(&self) -> Option<&DeviceView> {
        self.device.as_ref()
    }

    /// Whether reading the values on the host needs no copy (a host tensor, or a device tensor
    /// read before).
    pub fn on_host(&self) -> bool {
        self.host.get().is_some()
    }

    /// The values on the host (a device tensor is copied back on the first call).
    pub fn as_host(&self) -> &[f32] {
        self.host.get_or_init(|| match &self.device {
            Some(view) => view.buffer.download(view.offset, self.len),
            None => Vec::new(),
        })
    }

    /// The values as a host `Vec` (copied back from a device if not read before).
    pub fn into_vec(mut self) -> Vec<f32> {
        match self.host.take() {
            Some(values) => values,
            None => self.as_host().to_vec(),
        }
    }

    /// The host values to change in place: the tensor becomes a host tensor.
    pub fn host_mut(&mut self) -> &mut Vec<f32> {
        self.as_host();
        self.device = None;
        self.host.get_mut().expect("filled by as_host")
    }

    /// The device buffer to change in place, when this tensor is the only holder of all of it
    /// (its host copy, if any, is dropped: the caller is about to change the values).
    pub fn device_buffer_mut(&mut self) -> Option<&mut dyn DeviceBuffer> {
        let view = self.device.as_mut()?;
        if view.offset != 0 || view.buffer.len() != self.len {
            return None;
        }
        let buffer = Arc::get_mut(&mut view.buffer)?;
        self.host = OnceLock::new();
        Some(buffer)
    }

    /// Rows `rows` of `width` values each: a view of the same memory on a device, a copy on the
    /// host.
    pub fn rows(&self, rows: Range<usize>, width: usize) -> Tensor {
        self.range(rows.start * width..rows.end * width)
    }

    /// Values `range`: a view of the same memory on a device (its host copy too, if read
    /// before), a copy on the host.
    pub fn range(&self, range: Range<usize>) -> Tensor {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "values {range:?} of a {}-value tensor",
            self.len
        );
        let host = match self.host.get() {
            Some(values) => OnceLock::from(values[range.clone()].to_vec()),
            None => OnceLock::new(),
        };
        Tensor {
            len: range.len(),
            device: self.device.as_ref().map(|view| DeviceView {
                buffer: view.buffer.clone(),
                offset: view.offset + range.start,
                base: view.base,
            }),
            host,
        }
    }

    /// Each `width`-wide row as its own tensor (views on a device).
    pub fn split_rows(&self, width: usize) -> Vec<Tensor> {
        if width == 0 {
            return Vec::new();
        }
        (0..self.len / width)
            .map(|r| self.rows(r..r + 1, width))
            .collect()
    }

    /// The allocations the tensor keeps alive, each whole: its device buffer (all of it, however
    /// few of its values the view covers) and its host values (their capacity), where it has
    /// them.
    pub fn allocations(&self) -> impl Iterator<Item = Allocation> + '_ {
        let device = self.device.as_ref().map(|view| Allocation {
            at: Arc::as_ptr(&view.buffer).cast::<u8>() as usize,
            bytes: (view.buffer.len() * std::mem::size_of::<f32>()) as u64,
        });
        let host = self.host.get().map(Allocation::of_vec);
        device.into_iter().chain(host)
    }
}

/// One allocation: where it starts (which tells it apart from every other live one) and its
/// bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Allocation {
    pub at: usize,
    pub bytes: u64,
}

impl Allocation {
    /// The heap allocation of `values` (its capacity, not its length).
    pub fn of_vec<T>(values: &Vec<T>) -> Allocation {
        Allocation {
            at: values.as_ptr() as usize,
            bytes: (values.capacity() * std::mem::size_of::<T>()) as u64,
        }
    }
}

/// The bytes of the distinct allocations a set of tensors keeps alive, each counted once however
/// many tensors view it: what freeing them all would return.
#[derive(Debug, Clone, Default)]
pub struct Pinned {
    seen: HashSet<usize>,
    bytes: u64,
}

impl Pinned {
    /// Counts `allocation` unless counted before (an empty one adds nothing).
    pub fn add(&mut self, allocation: Allocation) {
        if allocation.bytes > 0 && self.seen.insert(allocation.at) {
            self.bytes += allocation.bytes;
        }
    }

    /// Counts the allocations of every tensor of `tensors`.
    pub fn add_tensors<'a>(&mut self, tensors: impl IntoIterator<Item = &'a Tensor>) {
        for tensor in tensors {
            for allocation in tensor.allocations() {
                self.add(allocation);
            }
        }
    }

    /// Bytes of the allocations counted.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Default for Tensor {
    fn default() -> Tensor {
        Tensor::empty()
    }
}

impl Deref for Tensor {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        self.as_host()
    }
}

impl<'a> IntoIterator for &'a Tensor {
    type Item = &'a f32;
    type IntoIter = std::slice::Iter<'a, f32>;
    fn into_iter(self) -> Self::IntoIter {
        self.as_host().iter()
    }
}

impl From<Vec<f32>> for Tensor {
    fn from(values: Vec<f32>) -> Tensor {
        Tensor::host(values)
    }
}

impl From<&[f32]> for Tensor {
    fn from(values: &[f32]) -> Tensor {
        Tensor::host(values.to_vec())
    }
}

impl From<&Vec<f32>> for Tensor {
    fn from(values: &Vec<f32>) -> Tensor {
        Tensor::host(values.clone())
    }
}

impl From<Tensor> for Vec<f32> {
    fn from(t: Tensor) -> Vec<f32> {
        t.into_vec()
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.device, self.host.get()) {
            (None, Some(values)) => f.debug_tuple("Tensor").field(values).finish(),
            (Some(view), _) => f
                .debug_struct("Tensor")
                .field("len", &self.len)
                .field("device", view)
                .finish(),
            (None, None) => f.write_str("Tensor([])"),
        }
    }
}

/// Compares values (a device tensor is read back).
impl PartialEq for Tensor {
    fn eq(&self, other: &Tensor) -> bool {
        self.as_host() == other.as_host()
    }
}

impl PartialEq<Vec<f32>> for Tensor {
    fn eq(&self, other: &Vec<f32>) -> bool {
        self.as_host() == other.as_slice()
    }
}

impl PartialEq<[f32]> for Tensor {
    fn eq(&self, other: &[f32]) -> bool {
        self.as_host() == other
    }
}

/// A "device" buffer in host memory, for the tests of what views of a device buffer pin.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct HostDeviceBuffer(pub Vec<f32>);

#[cfg(test)]
impl HostDeviceBuffer {
    /// `values` as a device tensor of a buffer of their own.
    pub(crate) fn tensor(values: Vec<f32>) -> Tensor {
        let len = values.len();
        Tensor::device(Arc::new(HostDeviceBuffer(values)), 0, len)
    }
}

#[cfg(test)]
impl DeviceBuffer for HostDeviceBuffer {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn download(&self, offset: usize, len: usize) -> Vec<f32> {
        self.0[offset..offset + len].to_vec()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A "device" buffer in host memory that counts its downloads.
    #[derive(Debug)]
    struct Counted {
        values: Vec<f32>,
        downloads: Arc<AtomicUsize>,
    }

    impl DeviceBuffer for Counted {
        fn len(&self) -> usize {
            self.values.len()
        }
        fn download(&self, offset: usize, len: usize) -> Vec<f32> {
            self.downloads.fetch_add(1, Ordering::Relaxed);
            self.values[offset..offset + len].to_vec()
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    #[test]
    fn a_device_tensor_is_copied_back_once_and_views_share_its_memory() {
        let downloads = Arc::new(AtomicUsize::new(0));
        let buffer: Arc<dyn DeviceBuffer> = Arc::new(Counted {
            values: (0..12).map(|v| v as f32).collect(),
            downloads: downloads.clone(),
        });
        let t = Tensor::device(buffer, 2, 8);
        let row = t.rows(1..2, 3);
        assert_eq!(downloads.load(Ordering::Relaxed), 0);
        assert_eq!(row.device_view().map(|v| v.offset), Some(5));
        assert_eq!(&row[..], &[5.0, 6.0, 7.0]);
        assert_eq!(&row[..], &[5.0, 6.0, 7.0]);
        assert_eq!(downloads.load(Ordering::Relaxed), 1);
        assert_eq!(t[0], 2.0);
        assert_eq!(downloads.load(Ordering::Relaxed), 2);
        // A view of a read tensor carries its host copy: no further download.
        assert_eq!(&t.range(6..8)[..], &[8.0, 9.0]);
        assert_eq!(downloads.load(Ordering::Relaxed), 2);
        let mut owned = t.clone();
        owned.host_mut()[0] = -1.0;
        assert!(owned.device_view().is_none());
        assert_eq!((owned[0], t[0]), (-1.0, 2.0));
    }

    /// A buffer with a device address, as the CUDA backend's.
    #[derive(Debug)]
    struct Addressed(usize);

    impl DeviceBuffer for Addressed {
        fn len(&self) -> usize {
            self.0
        }
        fn download(&self, _offset: usize, len: usize) -> Vec<f32> {
            vec![0.0; len]
        }
        fn device_address(&self) -> Option<u64> {
            Some(0x7f00_0000_1000)
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    #[test]
    fn views_keep_their_buffers_address_at_their_offset() {
        let t = Tensor::device(Arc::new(Addressed(64)), 4, 40);
        let row = t.rows(2..3, 8).range(3..8);
        let view = row.device_view().expect("a view");
        assert_eq!(view.offset, 4 + 16 + 3);
        assert_eq!(view.address(0), Some(0x7f00_0000_1000 + 4 * 23));
        assert_eq!(view.address(2), Some(0x7f00_0000_1000 + 4 * 25));
        let counted = Tensor::device(
            Arc::new(Counted {
                values: vec![0.0; 8],
                downloads: Arc::default(),
            }),
            0,
            8,
        );
        assert_eq!(counted.device_view().and_then(|v| v.address(1)), None);
    }

    #[test]
    fn pinned_counts_each_whole_buffer_once() {
        let buffer: Arc<dyn DeviceBuffer> = Arc::new(Addressed(64));
        let rows = Tensor::device(buffer.clone(), 0, 64).split_rows(16);
        let mut pinned = Pinned::default();
        pinned.add_tensors(&rows[1..2]);
        assert_eq!(pinned.bytes(), 64 * 4, "one row pins its whole buffer");
        pinned.add_tensors(&rows);
        assert_eq!(pinned.bytes(), 64 * 4, "counted once");
        pinned.add_tensors(&[Tensor::device(Arc::new(Addressed(8)), 2, 2)]);
        assert_eq!(pinned.bytes(), 72 * 4);
        let mut values = Vec::with_capacity(10);
        values.extend([1.0_f32, 2.0]);
        let host = Tensor::host(values);
        pinned.add_tensors([&host, &host.clone()]);
        // The clone is a copy of its own (capacity 2); the original keeps its capacity of 10.
        assert_eq!(pinned.bytes(), (72 + 10 + 2) * 4);
        let row = host.range(0..1);
        assert_eq!(row.allocations().map(|a| a.bytes).sum::<u64>(), 4);
    }

    #[test]
    fn host_tensors_split_and_convert() {
        let t = Tensor::from(vec![1.0, 2.0, 3.0, 4.0]);
        let rows = t.split_rows(2);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1], vec![3.0, 4.0]);
        assert!(t.on_host());
        assert_eq!(t.into_vec(), vec![1.0, 2.0, 3.0, 4.0]);
    }
}
