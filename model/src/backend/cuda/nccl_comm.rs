//! One NCCL communicator, created without blocking (`ncclCommInitRankConfig` with `blocking =
//! 0`) so that its creation can be waited for with a deadline and aborted
//! (`backend::comm_init`), and the calls `nccl.rs` makes on it. On such a communicator a call
//! may return before its work is queued on the stream (`ncclInProgress`): [`NcclComm::settle`]
//! waits for that up to a deadline. Dropping it aborts it (`ncclCommAbort`), which fails a
//! peer's pending call instead of leaving it waiting.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::Arc;
use std::time::Instant;

use deepinfer_kernels::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use deepinfer_kernels::cudarc::nccl::result::NcclStatus;
use deepinfer_kernels::cudarc::nccl::safe::NcclType;
use deepinfer_kernels::cudarc::nccl::sys;

use crate::backend::comm_init::{InitPoll, PendingInit};

/// `NCCL_CONFIG_UNDEF_INT`: NCCL's default for the field.
const UNDEF: c_int = c_int::MIN;
/// `ncclConfig_t`'s magic (`NCCL_CONFIG_INITIALIZER`).
const CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_VERSION(2, 30, 0)`: the layout of cudarc's `ncclConfig_t` (feature `nccl-02030`). An
/// older library (the H200 machine has 2.28) reads the fields it knows: NCCL's `parseCommConfig`
/// copies `min(size, its own sizeof(ncclConfig_t))` bytes, checks only the magic, and uses the
/// version to default fields that callers older than itself lacked; fields are only appended.
const CONFIG_VERSION: c_uint = 2 * 10_000 + 30 * 100;

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
fn nonblocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// `result` as an error naming NCCL's code (`ncclRemoteError`, ...).
fn check(during: &str, result: sys::ncclResult_t) -> Result<(), String> {
    result
        .result()
        .map(|_| ())
        .map_err(|e| format!("{during}: {:?}", e.0))
}

/// Why [`NcclComm::settle`] returned.
#[derive(Debug)]
pub enum Unsettled {
    /// Still in progress at the deadline.
    Late,
    Failed(String),
}

/// One rank's communicator (module doc).
#[derive(Debug)]
pub struct NcclComm {
    /// Null once aborted.
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
}

// SAFETY: NCCL lets a communicator be used from any thread, one call at a time; the handle is
// only used through `&self`/`&mut self` of its one owner (`nccl.rs` keeps it behind a mutex)
// and never copied out.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Starts creating global rank `rank` of `ranks` of the communicator of `id`, on the device
    /// whose context is current on this thread (`stream`'s, made current by the caller). Inside
    /// a group it starts at the group's end; either way it completes in the background
    /// ([`PendingInit`]). Panics like every cudarc NCCL call when `libnccl.so` is missing (the
    /// caller catches it).
    pub fn start(
        stream: Arc<CudaStream>,
        rank: usize,
        ranks: usize,
        id: [c_char; 128],
    ) -> Result<NcclComm, String> {
        let (rank_c, ranks_c) = match (c_int::try_from(rank), c_int::try_from(ranks)) {
            (Ok(rank), Ok(ranks)) => (rank, ranks),
            _ => return Err(format!("rank {rank} of {ranks}: too many ranks for NCCL")),
        };
        let mut config = nonblocking_config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` live across the call (NCCL copies the config, and writes
        // the new handle to `comm`, left null if it fails at once); the id is passed by value.
        let started = unsafe {
            sys::ncclCommInitRankConfig(
                &mut comm,
                ranks_c,
                sys::ncclUniqueId { internal: id },
                rank_c,
                &mut config,
            )
        };
        // Dropped (aborted) if the start failed.
        let made = NcclComm { comm, stream };
        check(&format!("starting rank {rank} of {ranks}"), started)?;
        if made.comm.is_null() {
            return Err(format!("starting rank {rank} of {ranks}: no communicator"));
        }
        Ok(made)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn live(&self) -> Result<sys::ncclComm_t, String> {
        match self.comm.is_null() {
            true => Err("the communicator was aborted".to_string()),
            false => Ok(self.comm),
        }
    }

    /// The communicator's state (`ncclCommGetAsyncError`): `Ok(true)` when its calls so far are
    /// done (or queued on the stream), `Ok(false)` while in progress.
    fn state(&self) -> Result<bool, String> {
        let comm = self.live()?;
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is live (not aborted: `abort` nulls it); `state` lives for the write.
        let queried = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        check("querying the communicator", queried)?;
        match state.result() {
            Ok(NcclStatus::InProgress) => Ok(false),
            Ok(_) => Ok(true),
            Err(e) => Err(format!("{:?}", e.0)),
        }
    }

    /// Waits until the calls made so far are queued on the stream, up to `deadline`.
    pub fn settle(&self, deadline: Instant) -> Result<(), Unsettled> {
        loop {
            match self.state() {
                Ok(true) => return Ok(()),
                Ok(false) if Instant::now() >= deadline => return Err(Unsettled::Late),
                Ok(false) => std::thread::yield_now(),
                Err(e) => return Err(Unsettled::Failed(e)),
            }
        }
    }

    /// Aborts the communicator (a peer's pending call fails); later calls fail.
    pub fn abort(&mut self) {
        if self.comm.is_null() {
            return;
        }
        // SAFETY: `self.comm` is live and nulled right after, so never used or aborted again.
        // Its result is not needed: the communicator is gone either way.
        let _ = unsafe { sys::ncclCommAbort(self.comm) };
        self.comm = std::ptr::null_mut();
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    /// Queues sending `data` to `peer` (`ncclSend`).
    pub fn send<T: NcclType>(&self, data: &impl DevicePtr<T>, peer: usize) -> Result<(), String> {
        let comm = self.live()?;
        let peer = c_int::try_from(peer).map_err(|_| format!("peer {peer}"))?;
        let (ptr, _read) = data.device_ptr(&self.stream);
        // SAFETY: `ptr` addresses `data.len()` values of `T` on this communicator's device,
        // which the caller keeps alive until the stream passed the transfer (`nccl.rs` waits
        // for it before dropping its buffers); `comm` is live.
        let sent = unsafe {
            sys::ncclSend(
                ptr as *const c_void,
                data.len(),
                T::as_nccl_type(),
                peer,
                comm,
                self.cu_stream(),
            )
        };
        check("queueing a send", sent)
    }

    /// Queues receiving `data` from `peer` (`ncclRecv`).
    pub fn recv<T: NcclType>(
        &self,
        data: &mut impl DevicePtrMut<T>,
        peer: usize,
    ) -> Result<(), String> {
        let comm = self.live()?;
        let peer = c_int::try_from(peer).map_err(|_| format!("peer {peer}"))?;
        let count = data.len();
        let (ptr, _write) = data.device_ptr_mut(&self.stream);
        // SAFETY: as in `send`, for `count` values written.
        let received = unsafe {
            sys::ncclRecv(
                ptr as *mut c_void,
                count,
                T::as_nccl_type(),
                peer,
                comm,
                self.cu_stream(),
            )
        };
        check("queueing a receive", received)
    }

    /// Queues gathering every rank's `send` into `into` (`ncclAllGather`; `into` holds
    /// `ranks * send.len()` values).
    pub fn all_gather<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        into: &mut impl DevicePtrMut<T>,
    ) -> Result<(), String> {
        let comm = self.live()?;
        let count = send.len();
        let (src, _read) = send.device_ptr(&self.stream);
        let (dst, _write) = into.device_ptr_mut(&self.stream);
        // SAFETY: as in `send`; `into` is sized by the caller for every rank's `count` values.
        let gathered = unsafe {
            sys::ncclAllGather(
                src as *const c_void,
                dst as *mut c_void,
                count,
                T::as_nccl_type(),
                comm,
                self.cu_stream(),
            )
        };
        check("queueing an all-gather", gathered)
    }
}

impl PendingInit for NcclComm {
    fn poll(&mut self) -> InitPoll {
        match self.state() {
            Ok(true) => InitPoll::Ready,
            Ok(false) => InitPoll::InProgress,
            Err(reason) => InitPoll::Failed(reason),
        }
    }

    fn abort(&mut self) {
        NcclComm::abort(self);
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.abort();
    }
}
