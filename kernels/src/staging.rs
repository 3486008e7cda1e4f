//! Pinned staging for large host-to-device copies. A copy from pageable host memory larger than
//! the driver's inline limit is staged through the driver's own pinned buffers, which waits for
//! the stream to reach the copy: the host stops running ahead of the device at every large upload
//! (a step's key tables, its embedded rows). [`PinnedStaging`] copies such values into a ring of
//! page-locked memory and queues an asynchronous copy from there; an event recorded after each
//! copy says when its bytes may be written again. [`RingSpace`] is the ring's bookkeeping, apart
//! so that the CPU tests can check it: a region handed out never overlaps one still in flight.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, DriverError};
use cudarc::driver::{result, sys};

/// Copies of at least this many bytes go through the ring; smaller ones the driver queues inline.
pub const STAGED_MIN_BYTES: usize = 64 * 1024;
/// Bytes of page-locked memory per runtime (allocated at the first staged copy).
const RING_BYTES: usize = 128 << 20;
/// Start of each region (bytes).
const ALIGN: usize = 256;

/// Where the next copy goes in a ring of `capacity` bytes, and which copies in flight must have
/// finished first. Regions are handed out in order, wrapping to 0 when one would pass the end;
/// each region's fence `F` is kept, oldest first, until a later region needs its bytes.
#[derive(Debug)]
pub struct RingSpace<F> {
    capacity: usize,
    /// The end of the newest region.
    head: usize,
    inflight: VecDeque<(Range<usize>, F)>,
}

impl<F> RingSpace<F> {
    pub fn new(capacity: usize) -> RingSpace<F> {
        RingSpace {
            capacity,
            head: 0,
            inflight: VecDeque::new(),
        }
    }

    /// Drops the oldest regions whose fences `done` says have passed, returning their fences.
    pub fn retire(&mut self, mut done: impl FnMut(&F) -> bool) -> Vec<F> {
        let mut retired = Vec::new();
        while let Some((_, fence)) = self.inflight.front() {
            if !done(fence) {
                break;
            }
            retired.extend(self.inflight.pop_front().map(|(_, fence)| fence));
        }
        retired
    }

    /// A region of `bytes` starting at a multiple of `align`: its start and the fences of the
    /// regions in flight that it reuses (oldest first, taken out of the ring: wait for each before
    /// writing). `None` for an empty copy or one over half the ring (copy it another way).
    pub fn reserve(&mut self, bytes: usize, align: usize) -> Option<(usize, Vec<F>)> {
        if bytes == 0 || bytes > self.capacity / 2 {
            return None;
        }
        let aligned = self.head.next_multiple_of(align.max(1));
        let wrapped = aligned + bytes > self.capacity;
        let start = if wrapped { 0 } else { aligned };
        let end = start + bytes;
        let mut waits = Vec::new();
        // The oldest regions lie just past `head`: those in the tail a wrap skips, then those
        // the new region covers. A region that neither is in the tail nor overlaps ends the
        // search: every later one lies further from `head`, beyond the new region.
        while let Some((range, _)) = self.inflight.front() {
            let in_skipped_tail = wrapped && range.start >= self.head;
            let overlaps = range.start < end && start < range.end;
            if !(in_skipped_tail || overlaps) {
                break;
            }
            waits.extend(self.inflight.pop_front().map(|(_, fence)| fence));
        }
        self.head = end;
        Some((start, waits))
    }

    /// Records the fence of the region just reserved at `range`.
    pub fn push(&mut self, range: Range<usize>, fence: F) {
        self.inflight.push_back((range, fence));
    }

    /// Every fence still in flight, oldest first, taken out of the ring.
    pub fn drain(&mut self) -> Vec<F> {
        self.inflight.drain(..).map(|(_, fence)| fence).collect()
    }
}

/// The page-locked ring of one runtime (module doc).
#[derive(Debug)]
pub struct PinnedStaging {
    ctx: Arc<CudaContext>,
    /// `RING_BYTES` of page-locked memory, or null until the first staged copy.
    base: *mut u8,
    ring: RingSpace<sys::CUevent>,
    /// Events of retired regions, for reuse.
    spare: Vec<sys::CUevent>,
}

// SAFETY: the ring's memory and events belong to this value alone; the runtime keeps it behind
// a mutex, so one thread at a time writes the memory or touches an event.
unsafe impl Send for PinnedStaging {}

impl PinnedStaging {
    pub fn new(ctx: Arc<CudaContext>) -> PinnedStaging {
        PinnedStaging {
            ctx,
            base: std::ptr::null_mut(),
            ring: RingSpace::new(RING_BYTES),
            spare: Vec::new(),
        }
    }

    /// `values` in a new device buffer, copied through the ring on `stream`; `None` when they do
    /// not fit half the ring (copy them from pageable memory instead).
    pub fn upload<T: DeviceRepr>(
        &mut self,
        stream: &Arc<CudaStream>,
        values: &[T],
    ) -> Result<Option<CudaSlice<T>>, DriverError> {
        let bytes = std::mem::size_of_val(values);
        self.ctx.bind_to_thread()?;
        // SAFETY: a retired region's event was recorded on this context; querying it has no
        // effect (an error other than "not ready" leaves it in flight, waited for later).
        let retired = self
            .ring
            .retire(|&event| unsafe { result::event::query(event) }.is_ok());
        self.spare.extend(retired);
        let Some((start, waits)) = self.ring.reserve(bytes, ALIGN) else {
            return Ok(None);
        };
        // SAFETY: the device buffer is written by the copy below before anything reads it.
        let mut dst = unsafe { stream.alloc::<T>(values.len()) }?;
        if self.base.is_null() {
            // SAFETY: the context is current (bound above); freed in `drop`.
            self.base = unsafe { result::malloc_host(RING_BYTES, 0) }?.cast();
        }
        for event in waits {
            // SAFETY: the event was recorded after the copy that last read this region.
            unsafe { result::event::synchronize(event) }?;
            self.spare.push(event);
        }
        // SAFETY: `start + bytes <= RING_BYTES` (`reserve`), no copy in flight reads these bytes
        // (their fences were waited for), and `values` is `bytes` long.
        let staged = unsafe {
            let staged = self.base.add(start);
            std::ptr::copy_nonoverlapping(values.as_ptr().cast::<u8>(), staged, bytes);
            staged
        };
        {
            let (device, _recorded) = dst.device_ptr_mut(stream);
            // SAFETY: `device` holds `bytes`; the staged bytes stay untouched until the event
            // below has passed (the ring waits for it before handing the region out again).
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    device,
                    staged.cast::<c_void>(),
                    bytes,
                    stream.cu_stream(),
                )
            }
            .result()?;
        }
        let event = match self.spare.pop() {
            Some(event) => event,
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?,
        };
        // SAFETY: the event belongs to this context and the stream is live.
        unsafe { result::event::record(event, stream.cu_stream()) }?;
        self.ring.push(start..start + bytes, event);
        Ok(Some(dst))
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        if self.base.is_null() {
            return; // nothing was staged: no memory, no event
        }
        // A failure here has no one to report to: the memory is the process's until it ends.
        let _ = self.ctx.bind_to_thread();
        for event in self.ring.drain() {
            // SAFETY: each event was recorded on this context; the copies it fences must end
            // before the memory they read is freed.
            unsafe {
                let _ = result::event::synchronize(event);
                let _ = result::event::destroy(event);
            }
        }
        for event in self.spare.drain(..) {
            // SAFETY: no copy waits on a spare event.
            let _ = unsafe { result::event::destroy(event) };
        }
        // SAFETY: allocated by `malloc_host`; every copy from it has ended (above).
        let _ = unsafe { result::free_host(self.base.cast()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
        a.start < b.end && b.start < a.end
    }

    #[test]
    fn regions_follow_each_other_aligned_until_the_ring_wraps() {
        let mut ring: RingSpace<u32> = RingSpace::new(4096);
        assert_eq!(ring.reserve(100, 256), Some((0, vec![])));
        ring.push(0..100, 1);
        assert_eq!(ring.reserve(1000, 256), Some((256, vec![])));
        ring.push(256..1256, 2);
        assert_eq!(ring.reserve(2000, 256), Some((1280, vec![])));
        ring.push(1280..3280, 3);
        // 3328 + 1000 passes 4096: back to 0, over regions 1 and 2 (not 3, at 1280..3280).
        assert_eq!(ring.reserve(1000, 256), Some((0, vec![1, 2])));
        ring.push(0..1000, 4);
        // Past 1000: 1024..2024 covers region 3.
        assert_eq!(ring.reserve(1000, 256), Some((1024, vec![3])));
    }

    #[test]
    fn a_wrap_waits_for_the_regions_in_the_skipped_tail() {
        let mut ring: RingSpace<u32> = RingSpace::new(4096);
        for (i, start) in [0usize, 1024, 2048, 3072].into_iter().enumerate() {
            assert_eq!(ring.reserve(1000, 1024), Some((start, vec![])));
            ring.push(start..start + 1000, i as u32);
        }
        // Region 0 was retired; the wrap skips nothing live but covers 0..1500 → region 1.
        assert_eq!(ring.retire(|&f| f == 0), vec![0]);
        assert_eq!(ring.reserve(1500, 256), Some((0, vec![1])));
        ring.push(0..1500, 4);
        // A wrap also takes the regions in the tail it skips (older than every region at 0).
        let mut ring: RingSpace<u32> = RingSpace::new(4096);
        for (i, start) in [0usize, 1024, 2048, 3072].into_iter().enumerate() {
            assert_eq!(ring.reserve(1000, 1024), Some((start, vec![])));
            ring.push(start..start + 1000, i as u32);
        }
        assert_eq!(ring.reserve(1000, 1024), Some((0, vec![0])));
        ring.push(0..1000, 4);
        assert_eq!(ring.reserve(1500, 256), Some((1024, vec![1, 2])));
        ring.push(1024..2524, 5);
        // 2560 + 1600 passes the end: region 3 (3072..4072) lies in the skipped tail.
        assert_eq!(ring.reserve(1600, 256), Some((0, vec![3, 4, 5])));
    }

    #[test]
    fn empty_or_oversized_copies_are_not_staged_and_retire_keeps_order() {
        let mut ring: RingSpace<u32> = RingSpace::new(4096);
        assert_eq!(ring.reserve(0, 256), None);
        assert_eq!(ring.reserve(2049, 256), None);
        assert_eq!(ring.reserve(2048, 256), Some((0, vec![])));
        ring.push(0..2048, 7);
        assert_eq!(ring.reserve(16, 256), Some((2048, vec![])));
        ring.push(2048..2064, 8);
        // Only a done prefix retires: 8 done behind 7 not done stays.
        assert!(ring.retire(|&f| f == 8).is_empty());
        assert_eq!(ring.retire(|_| true), vec![7, 8]);
        assert!(ring.drain().is_empty());
    }

    /// Random sizes and retirements: a region handed out never overlaps one still in flight, lies
    /// inside the ring and starts aligned; every fence comes back exactly once.
    #[test]
    fn no_region_handed_out_overlaps_one_in_flight() {
        let capacity = 1 << 16;
        let mut ring: RingSpace<u64> = RingSpace::new(capacity);
        let mut live: Vec<(Range<usize>, u64)> = Vec::new();
        let mut returned = 0u64;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for fence in 0..20_000u64 {
            let bytes = 1 + (next() % (capacity as u64 / 3)) as usize;
            let retire_below = next() % 4;
            let retired = ring.retire(|&f| f % 4 < retire_below && f + 8 < fence);
            let (start, waits) = ring.reserve(bytes, 256).expect("under half the ring");
            for f in retired.iter().chain(&waits) {
                let at = live
                    .iter()
                    .position(|(_, g)| g == f)
                    .expect("in flight once");
                live.remove(at);
                returned += 1;
            }
            let region = start..start + bytes;
            assert!(
                region.end <= capacity && start.is_multiple_of(256),
                "{region:?}"
            );
            for (range, f) in &live {
                assert!(
                    !overlaps(range, &region),
                    "{region:?} over {range:?} of fence {f}"
                );
            }
            ring.push(region.clone(), fence);
            live.push((region, fence));
        }
        returned += ring.drain().len() as u64;
        assert_eq!(returned, 20_000);
    }
}
