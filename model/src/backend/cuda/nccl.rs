//! [`RowTransport`] between EP ranks on different GPUs, over NCCL (cudarc's bindings, loaded at
//! run time like the rest of CUDA).
//!
//! Communicators are created once at start, by [`NcclDevices`]: the engine's ranks open their
//! backends one after another, each on its own thread, so it collects their streams and the
//! last rank to open creates every communicator of this process (each rank's [`NcclRank`]
//! takes its communicator at its first collective). Several nodes (an [`NcclWorld`]: node 0's
//! unique id from [`unique_id`], handed to every node by the node bootstrap, this process's
//! first global rank and the communicator's size): [`NcclTransport::join`], one non-blocking
//! `ncclCommInitRankConfig` per GPU of this process as global rank `first + local`
//! (`nccl_comm`), grouped (`ncclGroupStart/End`, each GPU's context current for its call) as
//! NCCL requires when one thread inits several ranks; one node ([`NcclDevices::new`] without a
//! world): the same through a fresh unique id ([`NcclTransport::for_devices`]), one rank per
//! GPU (NCCL holds no two ranks of one communicator on one GPU). Every node's init joins the
//! same communicator, which exists once every rank of every node called it: the ranks are
//! polled (`backend::comm_init`) up to `[cluster] bootstrap_timeout_seconds`, past which (or
//! on a rank's error, or a rank of this process failing meanwhile) every communicator of this
//! process is aborted and the error names its ranks, the wait and the ranks that never joined.
//! On the backend's own stream, each all-to-all first all-gathers every rank's header (its
//! collective tag and its row counts for every rank), checks that all ranks are at the same
//! collective, then runs one NCCL group of sends and receives of the rows, their expert ids and
//! weights. NCCL has no timeout: the rank polls the calls' queueing (a non-blocking
//! communicator's calls may return first) and the group's completion up to the deadline and,
//! past it, drops (aborts) the communicator, so that every peer's NCCL call fails too; the
//! transport stays failed (the supervisor stops the engine, its rule 3). A missing `libnccl.so`
//! is an error ([`library_available`], and every first NCCL call runs under `catch_unwind`).
//!
//! Not run yet: it needs two GPUs (no multi-GPU machine was lent while this, the engine's
//! wiring, `NcclDevices`, and the multi-node join were written); the one-device transport
//! (`ep_transport.rs`) exercises everything above it, and `tests/tests/gpu_two.rs` holds the
//! two-GPU tests (one process, and two processes as two nodes) waiting for a run.

use std::sync::{Arc, Condvar, MutexGuard};
use std::time::{Duration, Instant};

use deepinfer_kernels::cudarc::driver::CudaStream;
use deepinfer_kernels::cudarc::nccl::result::{group_end, group_start};
use deepinfer_kernels::cudarc::nccl::safe::Id;

use super::ep_transport::{Delivered, RowExchange, RowMeta, RowTransport};
use super::nccl_comm::{NcclComm, Unsettled};
use super::*;
use crate::backend::comm_init::{InitWait, wait_for_init};
use crate::expert_exchange::{ExchangeError, ExchangePhase, ExchangeTag, wait_until};

const OP: &str = "NCCL all-to-all";
/// Header words before the counts: round, layer, epoch, phase.
const HEADER: usize = 4;

fn nccl_err(
    during: &str,
) -> impl FnOnce(deepinfer_kernels::cudarc::nccl::result::NcclError) -> CudaBackendError + '_ {
    move |e| shape_err(OP, format!("NCCL failed while {during}: {:?}", e.0))
}

/// Whether the NCCL library (`libnccl.so`) loads; never panics (cudarc's first NCCL call panics
/// without it).
pub fn library_available() -> Result<(), String> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate names.
    let present = std::panic::catch_unwind(|| unsafe {
        deepinfer_kernels::cudarc::nccl::sys::is_culib_present()
    })
    .unwrap_or(false);
    if present {
        return Ok(());
    }
    Err(format!(
        "the NCCL library (libnccl.so) did not load: tried {} (LD_LIBRARY_PATH must reach it)",
        deepinfer_kernels::cudarc::get_lib_name_candidates("nccl").join(", ")
    ))
}

/// A fresh NCCL unique id (`ncclGetUniqueId`): node 0 of a deployment over several nodes
/// creates it, and the node bootstrap hands its 128 bytes to every node ([`NcclWorld`]). A
/// missing `libnccl.so` is an error naming it, never a panic.
pub fn unique_id() -> Result<[std::ffi::c_char; 128], CudaBackendError> {
    library_available()
        .map_err(|reason| shape_err(OP, format!("creating the unique id: {reason}")))?;
    guarded("creating the unique id", Id::new).map(|id| *id.internal())
}

/// Runs `init` (cudarc panics when `libnccl.so` is missing) as an error, not a panic.
fn guarded<T>(
    during: &str,
    init: impl FnOnce() -> Result<T, deepinfer_kernels::cudarc::nccl::result::NcclError>,
) -> Result<T, CudaBackendError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(init))
        .map_err(|_| {
            shape_err(
                OP,
                format!("{during}: the NCCL library (libnccl.so) did not load"),
            )
        })?
        .map_err(nccl_err(during))
}

/// One EP rank's NCCL communicator.
#[derive(Debug)]
pub struct NcclTransport {
    /// `None` once aborted.
    comm: Mutex<Option<NcclComm>>,
    rank: usize,
    ranks: usize,
    timeout: Duration,
}

impl NcclTransport {
    /// One communicator per stream (one per GPU of this process, rank = position), joined
    /// through a fresh unique id as [`NcclTransport::join`] does (what `ncclCommInitAll` does,
    /// with its wait bounded).
    pub fn for_devices(
        streams: Vec<Arc<CudaStream>>,
        timeouts: NcclTimeouts,
        stop: impl Fn() -> Option<String>,
    ) -> Result<Vec<Arc<NcclTransport>>, CudaBackendError> {
        let world = NcclWorld {
            id: unique_id()?,
            first: 0,
            ranks: streams.len(),
        };
        NcclTransport::join(streams, &world, timeouts, stop)
    }

    /// This process's ranks of `world`, one per stream (global rank `world.first + position`),
    /// joined through node 0's unique id: one non-blocking `ncclCommInitRankConfig` per stream
    /// in one group, each with its stream's context current (the last one stays current: the
    /// caller restores its own), then polled until every rank of every node has joined. Past
    /// `timeouts.join`, on a rank's error, or when `stop` gives a reason, every communicator
    /// of this process is aborted and the error names the ranks and the wait
    /// (`backend::comm_init`).
    pub fn join(
        streams: Vec<Arc<CudaStream>>,
        world: &NcclWorld,
        timeouts: NcclTimeouts,
        stop: impl Fn() -> Option<String>,
    ) -> Result<Vec<Arc<NcclTransport>>, CudaBackendError> {
        let last = world.first + streams.len();
        if streams.is_empty() || last > world.ranks {
            return Err(shape_err(
                OP,
                format!(
                    "global ranks {}..{last} of a communicator of {} ranks",
                    world.first, world.ranks
                ),
            ));
        }
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            group_start().map_err(|e| format!("starting the group: {:?}", e.0))?;
            let mut comms = Vec::with_capacity(streams.len());
            let mut joined = Ok(());
            for (local, stream) in streams.iter().enumerate() {
                if let Err(e) = stream.context().bind_to_thread() {
                    joined = Err(format!(
                        "making GPU {}'s context current: {e}",
                        stream.context().ordinal()
                    ));
                    break;
                }
                match NcclComm::start(stream.clone(), world.first + local, world.ranks, world.id) {
                    Ok(comm) => comms.push(comm),
                    Err(e) => {
                        joined = Err(e);
                        break;
                    }
                }
            }
            // Always ended: the group's inits start here (and complete in the background).
            let ended = group_end().map_err(|e| format!("ending the group: {:?}", e.0));
            joined.and(ended).map(|_| comms)
        }))
        .map_err(|_| "the NCCL library (libnccl.so) did not load".to_string())
        .and_then(|started| started);
        // A failed start drops (aborts) the communicators started.
        let mut comms =
            started.map_err(|e| shape_err(OP, format!("joining the communicator: {e}")))?;
        let wait = InitWait {
            first: world.first,
            world: world.ranks,
            timeout: timeouts.join,
            every: Duration::from_millis(1),
        };
        wait_for_init(&mut comms, wait, stop)
            .map_err(|e| shape_err(OP, format!("joining the communicator: {e}")))?;
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(local, comm)| {
                Arc::new(NcclTransport {
                    comm: Mutex::new(Some(comm)),
                    rank: world.first + local,
                    ranks: world.ranks,
                    timeout: timeouts.exchange,
                })
            })
            .collect())
    }

    /// Waits for the work queued on `stream` until the deadline; past it the communicator is
    /// aborted.
    fn wait(
        &self,
        comm: &mut Option<NcclComm>,
        stream: &CudaStream,
        tag: ExchangeTag,
    ) -> Result<(), CudaBackendError> {
        let deadline = Instant::now() + self.timeout;
        // A non-blocking communicator's calls may not be queued yet: first until they are.
        let settled = match comm.as_ref() {
            Some(comm) => comm.settle(deadline),
            None => return Err(self.failed(tag)),
        };
        if let Err(Unsettled::Failed(reason)) = settled {
            comm.take(); // dropping it aborts it: the peers' calls fail too
            return Err(shape_err(
                OP,
                format!("rank {} at {tag}: {reason}", self.rank),
            ));
        }
        let done = stream
            .record_event(None)
            .map_err(driver_err(OP, "recording the collective's end"))?;
        while !done.is_complete() {
            if Instant::now() >= deadline {
                comm.take(); // dropping it aborts it: the peers' calls fail too
                return Err(CudaBackendError::Exchange {
                    op: OP,
                    source: ExchangeError::Timeout {
                        rank: self.rank,
                        tag,
                        missing: Vec::new(),
                        waited_ms: self.timeout.as_millis(),
                    },
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    fn failed(&self, tag: ExchangeTag) -> CudaBackendError {
        CudaBackendError::Exchange {
            op: OP,
            source: ExchangeError::PeerFailed {
                rank: self.rank,
                tag,
                failed: self.rank,
                reason: "the communicator was aborted".to_string(),
            },
        }
    }
}

fn tag_words(tag: ExchangeTag) -> [u64; HEADER] {
    [
        tag.round,
        tag.layer as u64,
        u64::from(tag.epoch),
        tag.phase as u64,
    ]
}

impl RowTransport for NcclTransport {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn all_to_all_rows(
        &self,
        _backend: &CudaBackend,
        exchange: RowExchange<'_>,
    ) -> Result<Delivered, CudaBackendError> {
        let RowExchange {
            rank,
            tag,
            rows,
            width,
            counts,
            meta,
        } = exchange;
        let mut guard = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(comm) = guard.as_ref() else {
            return Err(self.failed(tag));
        };
        let stream = comm.stream().clone();
        let ranks = self.ranks;

        // Headers first: every rank's tag and counts.
        let mut header: Vec<u64> = tag_words(tag).to_vec();
        header.extend(counts.iter().map(|&n| n as u64));
        let header = stream
            .clone_htod(&header)
            .map_err(driver_err(OP, "uploading the header"))?;
        // Stays zeroed: filled by an NCCL all-gather, not a kernel audited here.
        let mut headers = stream
            .alloc_zeros::<u64>(ranks * (HEADER + ranks))
            .map_err(driver_err(OP, "allocating the headers"))?;
        comm.all_gather(&header, &mut headers)
            .map_err(|e| shape_err(OP, format!("gathering the headers: {e}")))?;
        self.wait(&mut guard, &stream, tag)?;
        let headers = stream
            .clone_dtoh(&headers)
            .map_err(driver_err(OP, "reading the headers"))?;
        let mut incoming = Vec::with_capacity(ranks);
        for (source, words) in headers.chunks_exact(HEADER + ranks).enumerate() {
            if words[..HEADER] != tag_words(tag) {
                guard.take();
                return Err(shape_err(
                    OP,
                    format!(
                        "rank {rank} is at {tag}, rank {source} at (round, layer, epoch, phase) \
                         {:?}: the ranks' steps do not match",
                        &words[..HEADER]
                    ),
                ));
            }
            incoming.push(words[HEADER + rank] as usize);
        }

        // Then the rows, ids and weights, in one group.
        let sent: usize = counts.iter().sum();
        let received: usize = incoming.iter().sum();
        // Dispatched rows carry their ids and weights (decided by the phase, the same on every
        // rank, so that every send has its receive).
        let with_meta = tag.phase == ExchangePhase::Dispatch;
        let mut ids: Vec<u32> = meta.iter().flat_map(|m| m.experts.clone()).collect();
        let mut weights: Vec<f32> = meta.iter().flat_map(|m| m.weights.clone()).collect();
        if with_meta && (ids.len() != sent || weights.len() != sent) {
            return Err(shape_err(
                OP,
                format!(
                    "{sent} rows with {} ids and {} weights",
                    ids.len(),
                    weights.len()
                ),
            ));
        }
        // Never a zero-length upload.
        ids.push(0);
        weights.push(0.0);
        // Stay zeroed: filled by NCCL exchanges, not kernels audited here.
        let alloc_f32 = |n: usize| {
            stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(driver_err(OP, "allocating a receive buffer"))
        };
        let mut inbox = alloc_f32(received * width)?;
        let mut ids_in = stream
            .alloc_zeros::<u32>(received.max(1))
            .map_err(driver_err(OP, "allocating the received ids"))?;
        let mut weights_in = alloc_f32(received)?;
        let ids_out = stream
            .clone_htod(&ids)
            .map_err(driver_err(OP, "uploading the ids"))?;
        let weights_out = stream
            .clone_htod(&weights)
            .map_err(driver_err(OP, "uploading the weights"))?;
        let Some(comm) = guard.as_ref() else {
            return Err(self.failed(tag));
        };
        group_start().map_err(nccl_err("starting the group"))?;
        let (mut at_out, mut at_in) = (0, 0);
        let mut queued = Ok(());
        for peer in 0..ranks {
            let (n_out, n_in) = (counts[peer], incoming[peer]);
            let p = peer;
            if let Some(rows) = rows.filter(|_| n_out > 0) {
                queued = queued.and_then(|_| {
                    comm.send(&rows.slice(at_out * width..(at_out + n_out) * width), p)
                });
                if with_meta {
                    queued = queued
                        .and_then(|_| comm.send(&ids_out.slice(at_out..at_out + n_out), p))
                        .and_then(|_| comm.send(&weights_out.slice(at_out..at_out + n_out), p));
                }
            }
            if n_in > 0 {
                queued = queued.and_then(|_| {
                    comm.recv(
                        &mut inbox.slice_mut(at_in * width..(at_in + n_in) * width),
                        p,
                    )
                });
                if with_meta {
                    queued = queued
                        .and_then(|_| comm.recv(&mut ids_in.slice_mut(at_in..at_in + n_in), p))
                        .and_then(|_| comm.recv(&mut weights_in.slice_mut(at_in..at_in + n_in), p));
                }
            }
            at_out += n_out;
            at_in += n_in;
        }
        let ended = group_end();
        queued.map_err(|e| shape_err(OP, format!("queueing the sends and receives: {e}")))?;
        ended.map_err(nccl_err("ending the group"))?;
        self.wait(&mut guard, &stream, tag)?;

        // Per-source metadata on the host (a few bytes per row).
        let mut meta_in = Vec::with_capacity(ranks);
        if with_meta && received > 0 {
            let ids = stream
                .clone_dtoh(&ids_in)
                .map_err(driver_err(OP, "reading the received ids"))?;
            let weights = stream
                .clone_dtoh(&weights_in)
                .map_err(driver_err(OP, "reading the received weights"))?;
            let mut at = 0;
            for &n in &incoming {
                meta_in.push(RowMeta {
                    experts: ids[at..at + n].to_vec(),
                    weights: weights[at..at + n].to_vec(),
                });
                at += n;
            }
        } else {
            meta_in.resize(ranks, RowMeta::default());
        }
        Ok(Delivered {
            rows: (received > 0).then_some(inbox),
            counts: incoming,
            meta: meta_in,
        })
    }

    /// NCCL's copies are complete when `all_to_all_rows` returns: nothing is lent.
    fn finish(&self, _rank: usize, _tag: ExchangeTag) -> Result<(), CudaBackendError> {
        Ok(())
    }

    fn abort(&self, _rank: usize, _reason: &str) {
        self.comm
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }
}

/// The communicator a deployment over several nodes shares: this process's ranks are global
/// ranks `first..first + local ranks` of `ranks`, joined through node 0's unique id `id`
/// ([`unique_id`], handed over by the node bootstrap).
#[derive(Debug, Clone, Copy)]
pub struct NcclWorld {
    pub id: [std::ffi::c_char; 128],
    pub first: usize,
    pub ranks: usize,
}

/// How long the ranks of [`NcclDevices`] wait.
#[derive(Debug, Clone, Copy)]
pub struct NcclTimeouts {
    /// One collective, and a rank's wait for the communicators once the last rank opened.
    pub exchange: Duration,
    /// Creating the communicators: every rank of every node joining.
    pub join: Duration,
}

/// Where the communicators of [`NcclDevices`] are.
enum Creation {
    /// The stream of each rank whose backend has opened.
    Opening(Vec<Option<Arc<CudaStream>>>),
    /// The last rank to open creates them (the lock not held); `Some(why)` once a rank failed
    /// meanwhile, which gives the creation up.
    Creating(Option<String>),
    /// Rank r's transport at r.
    Created(Vec<Arc<NcclTransport>>),
    /// Why there are none (creating them failed, or a rank failed before they existed).
    Failed(String),
}

/// The EP ranks of this process, one GPU each, whose backends open one by one on their own
/// threads: the communicators are created together (one [`NcclTransport::for_devices`], or
/// across nodes one [`NcclTransport::join`]) by the last rank to open (module doc).
pub struct NcclDevices {
    /// This process's ranks.
    ranks: usize,
    /// `None`: every rank of the communicator is in this process.
    world: Option<NcclWorld>,
    timeouts: NcclTimeouts,
    state: Mutex<Creation>,
    created: Condvar,
}

impl std::fmt::Debug for NcclDevices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclDevices")
            .field("ranks", &self.ranks)
            .field("world", &self.world.map(|w| (w.first, w.ranks)))
            .finish_non_exhaustive()
    }
}

impl NcclDevices {
    /// `ranks` EP ranks of this process, each on its own GPU: all the communicator's, or with
    /// `world` this process's share of a communicator over several nodes (local rank r is
    /// global rank `world.first + r`); creating the communicators lasts at most
    /// `timeouts.join`, each collective `timeouts.exchange`.
    pub fn new(ranks: usize, timeouts: NcclTimeouts, world: Option<NcclWorld>) -> Arc<NcclDevices> {
        Arc::new(NcclDevices {
            ranks,
            world,
            timeouts,
            state: Mutex::new(Creation::Opening(vec![None; ranks])),
            created: Condvar::new(),
        })
    }

    fn state(&self) -> MutexGuard<'_, Creation> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The communicator's size: this process's ranks, or every node's.
    pub fn world_size(&self) -> usize {
        self.world.map_or(self.ranks, |w| w.ranks)
    }

    /// This process's EP rank `rank`'s backend has opened; its collectives run on `stream`
    /// (the backend's). The last rank to open creates every communicator of this process on
    /// this thread (across nodes, waiting there until every node's ranks joined): its error
    /// (e.g. no `libnccl.so`) is this call's, and the other ranks' first collective fails with
    /// it. A rank opened again before then replaces its stream; after, it is an error.
    pub fn open_rank(
        self: &Arc<Self>,
        rank: usize,
        stream: Arc<CudaStream>,
    ) -> Result<Arc<NcclRank>, CudaBackendError> {
        let mut state = self.state();
        let streams = match &mut *state {
            Creation::Opening(streams) if rank < streams.len() => streams,
            Creation::Opening(_) => {
                return Err(CudaBackendError::Exchange {
                    op: OP,
                    source: ExchangeError::Rank {
                        rank,
                        ranks: self.ranks,
                    },
                });
            }
            Creation::Created(_) | Creation::Creating(_) => {
                return Err(shape_err(
                    OP,
                    format!(
                        "EP rank {rank} opened again after the communicators were created \
                         (they run on the streams of the backends first opened)"
                    ),
                ));
            }
            Creation::Failed(reason) => {
                return Err(shape_err(OP, format!("no NCCL communicators: {reason}")));
            }
        };
        let own = stream.context().clone();
        streams[rank] = Some(stream);
        if streams.iter().all(Option::is_some) {
            let streams: Vec<Arc<CudaStream>> = streams.iter_mut().flat_map(Option::take).collect();
            // Created without the lock held: a rank failing meanwhile gives the creation up.
            *state = Creation::Creating(None);
            drop(state);
            let stop = || match &*self.state() {
                Creation::Creating(Some(why)) => Some(why.clone()),
                _ => None,
            };
            let created = match &self.world {
                None => NcclTransport::for_devices(streams, self.timeouts, stop),
                Some(world) => NcclTransport::join(streams, world, self.timeouts, stop),
            };
            // Joining made each GPU's context current in turn: this rank's again.
            let restored = own
                .bind_to_thread()
                .map_err(driver_err(OP, "restoring the rank's context"));
            let created = created.and_then(|transports| restored.map(|()| transports));
            let mut state = self.state();
            *state = match &created {
                Ok(transports) => Creation::Created(transports.clone()),
                Err(e) => Creation::Failed(format!("creating the communicators failed: {e}")),
            };
            self.created.notify_all();
            drop(state);
            created?;
        }
        Ok(Arc::new(NcclRank {
            devices: self.clone(),
            rank,
        }))
    }

    /// Rank `rank`'s transport, waiting for the communicators up to the deadline (their
    /// creation's, then a collective's).
    fn transport(
        &self,
        rank: usize,
        tag: ExchangeTag,
    ) -> Result<Arc<NcclTransport>, CudaBackendError> {
        let waited = self.timeouts.join + self.timeouts.exchange;
        let deadline = Instant::now() + waited;
        let mut state = self.state();
        loop {
            let missing = match &*state {
                Creation::Created(transports) => {
                    return transports
                        .get(rank)
                        .cloned()
                        .ok_or(CudaBackendError::Exchange {
                            op: OP,
                            source: ExchangeError::Rank {
                                rank,
                                ranks: self.ranks,
                            },
                        });
                }
                Creation::Failed(reason) => {
                    return Err(shape_err(OP, format!("no NCCL communicators: {reason}")));
                }
                Creation::Opening(streams) => (0..streams.len())
                    .filter(|&r| streams[r].is_none())
                    .collect(),
                Creation::Creating(_) => Vec::new(),
            };
            state = wait_until(&self.created, state, deadline).map_err(|_| {
                CudaBackendError::Exchange {
                    op: OP,
                    source: ExchangeError::Timeout {
                        rank,
                        tag,
                        missing,
                        waited_ms: waited.as_millis(),
                    },
                }
            })?;
        }
    }
}

/// One EP rank of [`NcclDevices`]: its [`NcclTransport`] once the communicators exist.
#[derive(Debug)]
pub struct NcclRank {
    devices: Arc<NcclDevices>,
    rank: usize,
}

impl RowTransport for NcclRank {
    fn ranks(&self) -> usize {
        self.devices.world_size()
    }

    fn all_to_all_rows(
        &self,
        backend: &CudaBackend,
        exchange: RowExchange<'_>,
    ) -> Result<Delivered, CudaBackendError> {
        self.devices
            .transport(self.rank, exchange.tag)?
            .all_to_all_rows(backend, exchange)
    }

    fn finish(&self, rank: usize, tag: ExchangeTag) -> Result<(), CudaBackendError> {
        self.devices.transport(self.rank, tag)?.finish(rank, tag)
    }

    /// Before the communicators exist, no rank will get one (the others' waits end at once).
    fn abort(&self, rank: usize, reason: &str) {
        let mut state = self.devices.state();
        let transport = match &mut *state {
            Creation::Created(transports) => transports.get(self.rank).cloned(),
            Creation::Opening(_) => {
                *state = Creation::Failed(format!("EP rank {} failed first: {reason}", self.rank));
                self.devices.created.notify_all();
                None
            }
            Creation::Creating(why) => {
                why.get_or_insert_with(|| format!("EP rank {} failed: {reason}", self.rank));
                None
            }
            Creation::Failed(_) => None,
        };
        drop(state);
        if let Some(transport) = transport {
            transport.abort(rank, reason);
        }
    }
}
