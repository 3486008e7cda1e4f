//! `CudaBackend`: [`Backend`] on one NVIDIA GPU through the kernels of `deepinfer-kernels`, in one
//! of two [`Numerics`] (ARCHITECTURE.md §3). `Exact`: every op computes what
//! [`super::CpuBackend`] computes, in the same operation order, so the results are bit-identical
//! (the sgemm order of the plain linears, torch's CPU sum order of the means of squares, the
//! sequential f64 sums of attention and the indexer, the vectorised `exp`). `Fast`: the FP8 and
//! FP4 block-scaled GEMMs (`gemm_fp8`, `gemm_fp4`, the shared expert and the FP4 routed experts
//! of `moe_rows`) run on tensor cores (`ops::gemm_fast`, `ops::routed_fast`, within a stated
//! error bound of the exact value), and so do the bf16 linears (`ops::linear_fast`), the V4
//! family's projections (`linear`: FP8/FP4 on the fast GEMMs with f32 outputs, dense ones on the
//! fast bf16 linear; `dense.rs`), V4's FP4 routed experts and its shared expert (`v4.rs`), and the
//! row-batched sink attention (`ops::attention::sparse_attention_sink_rows_ptr_fast`, where its
//! shape allows: bf16 operands at the bf16 rounding points of V4.1, each f32 operand in two bf16
//! pieces at V4's f32 precision); every other
//! op is still the exact one (the fp32 `linear_f32`: router gates, heads, V4's grouped `wo_a`).
//! No kernel of either splits a reduction by the batch, so a sequence's numbers do not depend on
//! what else runs (batch invariance).
//!
//! Beyond the layer math: token sampling (only the ids come back), the whole MoE layer
//! (`moe.rs`), the indexer's selection (`rows.rs`: top-k and candidate mask left on the device and
//! read there by the attention), and Engram table lookup (the tables are uploaded once, like
//! weights, and stay in device memory). Modules: `dense.rs` (GEMMs, linears, norms, RoPE, QDQ),
//! `rows.rs` (row ops and keys), `moe.rs`, `small.rs` (elementwise and pooling ops), `tokens.rs`
//! (sampling, routing, Engram), `ep.rs` (the MoE as one EP rank of several), `ep_transport.rs`
//! and `nccl.rs` (moving routed rows between EP ranks).
//!
//! Data path: weights are uploaded once and cached on the device. Activations are [`Tensor`]s in
//! device memory ([`CudaBuffer`]): an op takes its inputs where they are (a host tensor is
//! uploaded; a view into part of a buffer is copied device to device into a whole one) and leaves
//! its result on the device. Nothing comes back to the host unless the model reads a tensor there,
//! and every such copy is counted ([`TransferCounters`]); the sampled ids are counted apart.
//!
//! Expert tables (`moe.rs`) are cached per layer by the host address and length of its expert
//! list, under the same rule as the weights below.
//!
//! Weight cache: only the weights the model passes (never temporaries: `linear` over FP8 / FP4
//! weights dequantises on the device from the cached FP8 / FP4 copy; no dequantised host block
//! reaches the cache).
//! The model's weights are immutable host buffers that live as long as the model, so
//! a weight is keyed by its host address and length plus a content fingerprint (every element of a
//! buffer up to 256 elements, 16 evenly spaced ones and the last beyond: a lookup reads at most
//! 17 of a large weight's pages, since every weight op looks its weights up). A host buffer that is freed and
//! replaced by another of the same length at the same address with the same sampled content would
//! hit a stale entry: do not pass short-lived buffers as weights, or call
//! [`CudaBackend::clear_weight_cache`] after freeing them.
//!
//! Errors: [`CudaBackend::open`] returns [`CudaBackendError`] (no driver, no NVRTC, unsupported
//! GPU, compile failure), never panics. The `try_*` methods return errors too. [`Backend`]'s
//! methods return plain values, so a device failure inside one of them (out of memory, a lost
//! device) has no error channel: it panics with the op and the driver's message.

mod dense;
#[cfg(test)]
mod expert_fixtures;
mod key_tables;
use key_tables::{KeyTableBuilder, rows_u32};
pub mod ep;
pub mod ep_transport;
mod moe;
pub mod nccl;
mod nccl_comm;
mod profile;
mod quantised;
mod rows;
mod small;
mod tokens;
mod v4;

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::backend::QdqPoint as ModelQdq;
use deepinfer_kernels::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use deepinfer_kernels::kernel_timer::KernelTimer;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::attention::{
    AttentionRows, DeviceKeyLists, FastAttentionBlocks, ListSegment,
    MAX_QUERIES_PER_LAUNCH as MAX_QUERIES_PER_ATTENTION_LAUNCH, fast_attention_supports,
    sparse_attention_sink_rows_f32, sparse_attention_sink_rows_ptr_fast,
};
use deepinfer_kernels::ops::engram::{DeviceEngramTable, engram_gather_f32};
use deepinfer_kernels::ops::gemm::{
    DeviceFp4Weight, DeviceFp8Weight, GemmSplit, gemm_fp4, gemm_fp8,
};
use deepinfer_kernels::ops::gemm_fast::{FastTile, RoundedToBf16, gemm_fp4_fast, gemm_fp8_fast};
use deepinfer_kernels::ops::index::{
    DeviceVisiblePrefixes, IndexRows, MAX_QUERIES_PER_LAUNCH as MAX_QUERIES_PER_INDEX_LAUNCH,
    fast_index_supports, index_scores_rows_f32, index_scores_rows_ptr_fast,
};
use deepinfer_kernels::ops::key_table::{DeviceKeyTable, KeyRows, key_row_address};
use deepinfer_kernels::ops::linear::{
    dequant_fp4_rows_f32, dequant_fp8_rows_f32, linear_sgemm_f32,
};
use deepinfer_kernels::ops::linear_fast::{
    FastBf16Weight, FastProduct, exactly_bf16, linear_bf16_fast,
};
use deepinfer_kernels::ops::mhc::{
    HcMixesConfig, MAX_TOKENS_PER_LAUNCH, hc_collapse_rows_f32, hc_expand_rows_f32,
    hc_mixes_rows_f32,
};
use deepinfer_kernels::ops::moe::{Selection as RouteSelection, route_experts_f32, selected_count};
use deepinfer_kernels::ops::movement::{bf16_to_f32, gather_addresses_f32};
use deepinfer_kernels::ops::norm::{rms_norm_act_quant_f32, rms_norm_f32};
use deepinfer_kernels::ops::qdq::{QdqPoint, qdq_f32};
use deepinfer_kernels::ops::quant::{ActGroup, DeviceActFp8, quantize_act_fp8};
use deepinfer_kernels::ops::rope::{
    ROPE_QDQ_MAX_COLS, RopeQdqInput, RopeRotation, RopeShape, rope_interleaved_f32, rope_qdq_f32,
};
use deepinfer_kernels::ops::sampling::{SampleRow, SampleScratch, sample_rows_f32};
use deepinfer_kernels::ops::topk::{apply_mask_rows, candidate_mask_rows, top_k_rows};
use deepinfer_kernels::runtime::{pooled_memory, release_pooled_memory};
use deepinfer_kernels::{KernelError, KernelRuntime};
pub use deepinfer_topology::Numerics;
use half::bf16;

use super::select::DeviceRows;
use super::weights::{ExpertLinear, ExpertWeights, Linear};
use super::{
    AttentionQueries, Backend, CandidateMask, Candidates, DenseWeight, DeviceBuffer,
    EngramInjection, ExpertRoute, ExpertSelection, Groups, HcCollapse, HcExpand, HcMixes, HcMixing,
    HcParams, HyperHead, IndexQueries, MaskedRows, MoeLayer, PoolSlot, Precision, QueryKeys,
    RmsNorm, Rotation, Routing, RowSampling, SampleRowsError, SelectFrom, SelectPart, Selection,
    StreamShape, Tensor, check_sample_rows, linear_by_groups, select,
};
use crate::engram::lookup::EngramTable;
use crate::weights::{Fp4Weight, Fp8Weight};

pub use deepinfer_kernels::poison::POISON_ENV;
pub use profile::{OpProfile, OpStats, PROFILE_ENV};

/// Why the CUDA backend could not open or run an op.
#[derive(Debug, thiserror::Error)]
pub enum CudaBackendError {
    /// The device could not be opened (no driver, no NVRTC, unsupported GPU, kernel compilation).
    #[error("cannot open CUDA device {ordinal}: {source}")]
    Open { ordinal: usize, source: KernelError },
    /// A kernel launch, copy or allocation failed, or the op's shapes do not fit together.
    #[error("CUDA backend op {op}: {source}")]
    Op {
        op: &'static str,
        source: KernelError,
    },
    /// A collective of expert parallelism failed (a peer rank failed, timed out or is out of step).
    #[error("CUDA backend op {op}: {source}")]
    Exchange {
        op: &'static str,
        source: crate::expert_exchange::ExchangeError,
    },
}

/// Attaches the op name to a kernel error.
fn op_err(op: &'static str) -> impl FnOnce(KernelError) -> CudaBackendError {
    move |source| CudaBackendError::Op { op, source }
}

/// Attaches the op name and what was being done to a driver error.
fn driver_err(
    op: &'static str,
    during: &'static str,
) -> impl FnOnce(deepinfer_kernels::cudarc::driver::DriverError) -> CudaBackendError {
    move |source| CudaBackendError::Op {
        op,
        source: KernelError::Driver {
            during: during.to_string(),
            source,
        },
    }
}

fn shape_err(op: &'static str, message: String) -> CudaBackendError {
    CudaBackendError::Op {
        op,
        source: KernelError::Shape { op, message },
    }
}

/// How many rows of `width` values `x` holds, or a shape error of `op` unless they are whole.
fn whole_rows(op: &'static str, x: &Tensor, width: usize) -> Result<usize, CudaBackendError> {
    if width == 0 || !x.len().is_multiple_of(width) {
        return Err(shape_err(
            op,
            format!("x holds {} values, not whole rows of {width}", x.len()),
        ));
    }
    Ok(x.len() / width)
}

/// `x`'s buffer when `x` is the whole of one of this backend's buffers.
fn whole_buffer(x: &Tensor) -> Option<&CudaBuffer> {
    let view = x.device_view()?;
    let buffer = view.buffer.as_any().downcast_ref::<CudaBuffer>()?;
    (view.offset == 0 && buffer.data.len() == x.len()).then_some(buffer)
}

/// The kept FP8 activations of a buffer, locked (a panic elsewhere leaves them usable: they are
/// replaced whole).
fn lock(
    memo: &Mutex<Option<Arc<DeviceActFp8>>>,
) -> std::sync::MutexGuard<'_, Option<Arc<DeviceActFp8>>> {
    memo.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A host weight's identity: address, length, content fingerprint (see the module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct HostKey {
    addr: usize,
    len: usize,
    fingerprint: u64,
}

/// The most weight values the fp32 linears over FP8 / FP4 weights dequantise at a time (256 MiB
/// of f32 scratch).
const DEQUANT_ELEMENTS: usize = 1 << 26;

/// Buffers up to this many elements are fingerprinted in full.
const FULL_FINGERPRINT_LEN: usize = 256;
/// Elements sampled from a longer buffer.
const FINGERPRINT_SAMPLES: usize = 16;

impl HostKey {
    fn of<T: Copy>(values: &[T], bits: impl Fn(T) -> u64) -> HostKey {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut mix = |v: u64| {
            hash ^= v;
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        };
        if values.len() <= FULL_FINGERPRINT_LEN {
            values.iter().for_each(|&v| mix(bits(v)));
        } else {
            let step = values.len() / FINGERPRINT_SAMPLES;
            (0..FINGERPRINT_SAMPLES).for_each(|i| mix(bits(values[i * step])));
            mix(bits(values[values.len() - 1]));
        }
        HostKey {
            addr: values.as_ptr() as usize,
            len: values.len(),
            fingerprint: hash,
        }
    }

    fn f32s(values: &[f32]) -> HostKey {
        HostKey::of(values, |v| u64::from(v.to_bits()))
    }

    fn bytes(values: &[u8]) -> HostKey {
        HostKey::of(values, u64::from)
    }
}

/// Device copies of host weights.
#[derive(Default)]
struct WeightCache {
    f32s: HashMap<HostKey, Arc<CudaSlice<f32>>>,
    /// bf16 linear weights prepared for the tensor-core linear of the `fast` numerics.
    bf16_fast: HashMap<(HostKey, usize), Arc<FastBf16Weight>>,
    /// The weights of `Backend::linear_f32` in the `fast` numerics, sorted once, when first
    /// cached: bf16 ones for the split-x bf16x3 linear, any other for the exact kernel.
    f32_linear_fast: HashMap<HostKey, Arc<dense::FastF32Weight>>,
    /// The device forms of FP8 and FP4 weights (`quantised.rs`), by the weight's codes and scales.
    quantised: HashMap<(HostKey, HostKey), quantised::Forms>,
    /// Engram tables (codes, scales), uploaded on first lookup.
    engram_tables: HashMap<(HostKey, HostKey), Arc<DeviceEngramTable>>,
    /// The expert tables of MoE layers, keyed by the host address and length of the layer's
    /// expert list (immutable model weights, like the rest of the cache).
    expert_tables: HashMap<(usize, usize), Arc<moe::DeviceExperts>>,
    /// The exact (V4) expert tables, keyed alike.
    exact_expert_tables: HashMap<(usize, usize), Arc<v4::DeviceExactExperts>>,
    /// The cos/sin rows of each RoPE table (by its frequencies) from position 0, grown by
    /// doubling as longer positions come (`dense.rs`, `try_rope`). Not weights: not counted by
    /// [`CudaBackend::cached_weights`].
    rope_tables: HashMap<HostKey, Arc<dense::DeviceRopeTable>>,
}

/// The CUDA implementation of [`Backend`] on one device.
pub struct CudaBackend {
    rt: KernelRuntime,
    name: String,
    numerics: Numerics,
    weights: Mutex<WeightCache>,
    transfers: Arc<TransferCounters>,
    profile: Arc<OpProfile>,
    /// The EP rank this backend serves as (none: every expert runs here).
    experts: Arc<ep::ExpertSlot>,
    /// The latest RoPE position rows uploaded, newest first ([`CudaBackend::device_positions`]).
    positions: Mutex<KeptPositions>,
}

/// Position rows on the host and their device copies, newest first.
type KeptPositions = VecDeque<(Vec<i32>, Arc<CudaSlice<i32>>)>;

/// How many distinct position rows [`CudaBackend::device_positions`] keeps: a step's own rows
/// and its compressor groups' first positions, with room to spare.
const KEPT_POSITIONS: usize = 4;

/// Reads a [`CudaBackend`]'s GPU memory (shared: keep it to read after the backend was handed to
/// a model).
#[derive(Debug, Clone)]
pub struct DeviceMemoryProbe {
    stream: Arc<CudaStream>,
}

impl DeviceMemoryProbe {
    /// `(free, total)` bytes of the device once its stream is idle, the memory the runtime keeps
    /// for reuse counted as free (handed back first).
    pub fn free_and_total(&self) -> Result<(u64, u64), CudaBackendError> {
        const OP: &str = "memory_probe";
        release_pooled_memory(&self.stream).map_err(op_err(OP))?;
        let (free, total) = self
            .stream
            .context()
            .mem_get_info()
            .map_err(driver_err(OP, "reading the free device memory"))?;
        Ok((free as u64, total as u64))
    }

    /// `(used, reserved)` bytes of the device's stream-ordered pool once the stream is idle and
    /// the pool trimmed: what live tensors hold, and what stays mapped because live tensors
    /// share its segments (reserved − used: fragmentation); `None` without such a pool.
    pub fn pool_used_and_reserved(&self) -> Result<Option<(u64, u64)>, CudaBackendError> {
        const OP: &str = "memory_probe";
        release_pooled_memory(&self.stream).map_err(op_err(OP))?;
        pooled_memory(&self.stream).map_err(op_err(OP))
    }
}

/// The host tensors one call uploaded to address their rows ([`CudaBackend::address_of`]): each
/// once, keyed by its values' place in host memory, held until the call's kernels are launched.
#[derive(Default)]
struct HostUploads {
    slices: Vec<CudaSlice<f32>>,
    index: HashMap<(usize, usize), usize>,
}

/// Device-to-host copies a [`CudaBackend`] made: results of ops (activations, routes, Engram row
/// ids) and, apart, the sampled token ids (the one copy a decode step is meant to have).
#[derive(Debug, Default)]
pub struct TransferCounters {
    to_host_copies: AtomicU64,
    to_host_bytes: AtomicU64,
    sampled_id_copies: AtomicU64,
    /// Copies of op results by their length in values (what was copied, for a report).
    by_length: Mutex<std::collections::BTreeMap<usize, u64>>,
}

/// A snapshot of [`TransferCounters`]; the difference of two is what happened in between.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferCounts {
    /// Copies of op results other than sampled ids, and their bytes.
    pub to_host_copies: u64,
    pub to_host_bytes: u64,
    /// Copies of sampled token ids.
    pub sampled_id_copies: u64,
}

impl TransferCounters {
    /// The counts so far.
    pub fn snapshot(&self) -> TransferCounts {
        TransferCounts {
            to_host_copies: self.to_host_copies.load(Ordering::Relaxed),
            to_host_bytes: self.to_host_bytes.load(Ordering::Relaxed),
            sampled_id_copies: self.sampled_id_copies.load(Ordering::Relaxed),
        }
    }

    /// Copies of op results so far, by their length in values.
    pub fn by_length(&self) -> std::collections::BTreeMap<usize, u64> {
        self.by_length
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn result<T>(&self, values: usize) {
        *self
            .by_length
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(values)
            .or_default() += 1;
        self.to_host_copies.fetch_add(1, Ordering::Relaxed);
        self.to_host_bytes.fetch_add(
            (values * std::mem::size_of::<T>()) as u64,
            Ordering::Relaxed,
        );
    }
}

/// The device memory behind a [`Tensor`] of this backend; reading it on the host is counted.
#[derive(Debug)]
pub struct CudaBuffer {
    data: CudaSlice<f32>,
    stream: Arc<CudaStream>,
    transfers: Arc<TransferCounters>,
    /// The values' FP8 activations from their last quantisation for a GEMM, so that the next GEMM
    /// reading the same values (a step's normed inputs feed several projections) takes them
    /// instead of quantising again: the same codes and scales, one launch fewer. Dropped when the
    /// values change ([`CudaBackend::in_place`]).
    fp8: Mutex<Option<Arc<DeviceActFp8>>>,
}

impl DeviceBuffer for CudaBuffer {
    fn len(&self) -> usize {
        self.data.len()
    }

    fn download(&self, offset: usize, len: usize) -> Vec<f32> {
        if len == 0 {
            return Vec::new();
        }
        self.transfers.result::<f32>(len);
        self.stream
            .clone_dtoh(&self.data.slice(offset..offset + len))
            .unwrap_or_else(|err| panic!("CUDA backend: copying a tensor to the host: {err}"))
    }

    fn device_address(&self) -> Option<u64> {
        Some(self.data.device_ptr(&self.stream).0)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// An op's input as one whole device buffer ([`CudaBackend::input`]).
enum Input<'a> {
    /// The tensor's own buffer.
    Whole(&'a CudaSlice<f32>),
    /// A copy made for the op (an upload or a device-to-device copy of a view).
    Copied(CudaSlice<f32>),
}

impl Input<'_> {
    /// A buffer the caller may change.
    fn into_owned(
        self,
        backend: &CudaBackend,
        op: &'static str,
    ) -> Result<CudaSlice<f32>, CudaBackendError> {
        match self {
            Input::Whole(data) => backend
                .rt
                .stream()
                .clone_dtod(data)
                .map_err(driver_err(op, "copying a tensor")),
            Input::Copied(data) => Ok(data),
        }
    }
}

impl Deref for Input<'_> {
    type Target = CudaSlice<f32>;
    fn deref(&self) -> &CudaSlice<f32> {
        match self {
            Input::Whole(data) => data,
            Input::Copied(data) => data,
        }
    }
}

impl std::ops::Sub for TransferCounts {
    type Output = TransferCounts;
    fn sub(self, earlier: TransferCounts) -> TransferCounts {
        TransferCounts {
            to_host_copies: self.to_host_copies - earlier.to_host_copies,
            to_host_bytes: self.to_host_bytes - earlier.to_host_bytes,
            sampled_id_copies: self.sampled_id_copies - earlier.sampled_id_copies,
        }
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("name", &self.name)
            .finish()
    }
}

impl CudaBackend {
    /// Opens device `ordinal` with `numerics` and compiles (or loads from the disk cache) every
    /// kernel. Without a CUDA driver this is [`CudaBackendError::Open`] with
    /// `KernelError::NoDriver`, not a panic.
    pub fn open(ordinal: usize, numerics: Numerics) -> Result<CudaBackend, CudaBackendError> {
        let rt = KernelRuntime::open(ordinal)
            .map_err(|source| CudaBackendError::Open { ordinal, source })?;
        let report = rt.report();
        let mode = match numerics {
            Numerics::Fast => "fast",
            Numerics::Exact => "exact",
        };
        let name = format!(
            "cuda:{ordinal} ({}, {}, {mode} numerics)",
            report.device_name, report.arch
        );
        Ok(CudaBackend {
            rt,
            name,
            numerics,
            weights: Mutex::new(WeightCache::default()),
            transfers: Arc::new(TransferCounters::default()),
            profile: Arc::new(OpProfile::default()),
            experts: Arc::default(),
            positions: Mutex::default(),
        })
        .inspect(|backend| {
            let on = std::env::var_os(PROFILE_ENV).is_some_and(|v| v == "1");
            backend.profile.set_enabled(on);
            backend.rt.kernel_timer().set_enabled(on);
        })
    }

    /// The per-op profile (off unless turned on; shared like [`CudaBackend::transfer_counters`]).
    pub fn op_profile(&self) -> Arc<OpProfile> {
        self.profile.clone()
    }

    /// The device time per kernel (off unless turned on, with the op profile by
    /// [`PROFILE_ENV`]; shared like [`CudaBackend::op_profile`]).
    pub fn kernel_timer(&self) -> Arc<KernelTimer> {
        self.rt.kernel_timer()
    }

    /// The device-to-host copies this backend makes (shared: keep a clone to read them after the
    /// backend was handed to a model).
    pub fn transfer_counters(&self) -> Arc<TransferCounters> {
        self.transfers.clone()
    }

    /// The device memory this backend's GPU has free and in all, in bytes (the driver's count
    /// after the pending work of its stream finished, so freed buffers are counted free).
    pub fn memory_probe(&self) -> DeviceMemoryProbe {
        DeviceMemoryProbe {
            stream: self.rt.stream().clone(),
        }
    }

    /// The numerics this backend computes with.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// The kernel runtime (context, stream, loaded kernels).
    pub fn runtime(&self) -> &KernelRuntime {
        &self.rt
    }

    /// Drops every cached device weight (needed only if host weight buffers were freed and may be
    /// reused at the same address: see the module header).
    pub fn clear_weight_cache(&self) {
        *self.weights.lock().unwrap_or_else(PoisonError::into_inner) = WeightCache::default();
    }

    /// Number of cached device weights (f32, FP8, FP4, Engram tables).
    pub fn cached_weights(&self) -> usize {
        let cache = self.weights.lock().unwrap_or_else(PoisonError::into_inner);
        cache.f32s.len()
            + cache.quantised.values().map(Vec::len).sum::<usize>()
            + cache.engram_tables.len()
            + cache.expert_tables.len()
            + cache.exact_expert_tables.len()
    }

    /// Runs the fallible body of the [`Backend`] op `name` in its profile scope. A device failure
    /// is a panic: the trait has no error channel (module header).
    fn run<T>(&self, name: &'static str, body: impl FnOnce() -> Result<T, CudaBackendError>) -> T {
        let _op = self.op_scope(name);
        body().unwrap_or_else(|err| panic!("{err}"))
    }

    fn upload(&self, op: &'static str, values: &[f32]) -> Result<CudaSlice<f32>, CudaBackendError> {
        self.rt
            .htod(values)
            .map_err(driver_err(op, "uploading an activation"))
    }

    /// A new output of `len` values that `op`'s launches write in full: uninitialised (no
    /// memset), or poisoned under [`POISON_ENV`] ([`KernelRuntime::alloc_written`]).
    ///
    /// # Safety
    ///
    /// The op's launches write every element before anything reads one.
    unsafe fn alloc_written<T: DeviceRepr>(
        &self,
        op: &'static str,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaBackendError> {
        // SAFETY: the caller's contract.
        unsafe { self.rt.alloc_written::<T>(len) }.map_err(driver_err(op, "allocating an output"))
    }

    /// A new output of `len` zeros (a memset): for launches that may leave elements unwritten.
    fn alloc_zeroed<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &'static str,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaBackendError> {
        self.rt
            .stream()
            .alloc_zeros::<T>(len)
            .map_err(driver_err(op, "allocating an output"))
    }

    /// An f32 result on the host ([`CudaBackend::to_host`]).
    fn download(
        &self,
        op: &'static str,
        values: &CudaSlice<f32>,
    ) -> Result<Vec<f32>, CudaBackendError> {
        self.to_host(op, values, "downloading a result")
    }

    /// `values` copied to the host and counted as a result transfer; a failure names `what`.
    fn to_host<T: DeviceRepr + Default + Clone>(
        &self,
        op: &'static str,
        values: &CudaSlice<T>,
        what: &'static str,
    ) -> Result<Vec<T>, CudaBackendError> {
        self.transfers.result::<T>(values.len());
        self.rt
            .stream()
            .clone_dtoh(values)
            .map_err(driver_err(op, what))
    }

    /// The cached device copy of a weight under `key` in the cache `map` selects, uploading it
    /// with `upload` on first use.
    fn lock_weights(&self) -> std::sync::MutexGuard<'_, WeightCache> {
        self.weights.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn cached<K: std::hash::Hash + Eq, V>(
        &self,
        key: K,
        map: impl FnOnce(&mut WeightCache) -> &mut HashMap<K, Arc<V>>,
        upload: impl FnOnce() -> Result<V, CudaBackendError>,
    ) -> Result<Arc<V>, CudaBackendError> {
        let mut cache = self.weights.lock().unwrap_or_else(PoisonError::into_inner);
        let entries = map(&mut cache);
        if let Some(found) = entries.get(&key) {
            return Ok(found.clone());
        }
        let uploaded = Arc::new(upload()?);
        entries.insert(key, uploaded.clone());
        Ok(uploaded)
    }

    /// The device table of a layer's expert list `experts`, built by `build` (from the list) once
    /// and cached with the weights (in the map `map` picks) under the list's host address and
    /// length; `None`, and nothing cached, when `build` finds the experts unfit. The cache is not
    /// held while `build` runs (it caches the experts' weights).
    fn cached_expert_table<V>(
        &self,
        experts: &[ExpertWeights<ExpertLinear>],
        map: impl Fn(&mut WeightCache) -> &mut HashMap<(usize, usize), Arc<V>>,
        build: impl FnOnce(&[&ExpertWeights<ExpertLinear>]) -> Result<Option<V>, CudaBackendError>,
    ) -> Result<Option<Arc<V>>, CudaBackendError> {
        let key = (experts.as_ptr() as usize, experts.len());
        if let Some(found) = map(&mut self.lock_weights()).get(&key) {
            return Ok(Some(found.clone()));
        }
        let all: Vec<&ExpertWeights<ExpertLinear>> = experts.iter().collect();
        let Some(built) = build(&all)? else {
            return Ok(None);
        };
        let built = Arc::new(built);
        map(&mut self.lock_weights()).insert(key, built.clone());
        Ok(Some(built))
    }

    fn cached_f32(
        &self,
        op: &'static str,
        weight: &[f32],
    ) -> Result<Arc<CudaSlice<f32>>, CudaBackendError> {
        self.cached(
            HostKey::f32s(weight),
            |cache| &mut cache.f32s,
            || {
                self.rt
                    .htod(weight)
                    .map_err(driver_err(op, "uploading a weight"))
            },
        )
    }

    /// The fast bf16 weight of `groups` weights `[out / groups, inp]` in `weight` (one group: a
    /// plain linear's), cached by the host values and the grouping.
    fn cached_bf16_fast(
        &self,
        weight: &[f32],
        groups: usize,
        out: usize,
        inp: usize,
    ) -> Result<Arc<FastBf16Weight>, CudaBackendError> {
        self.cached(
            (HostKey::f32s(weight), groups),
            |cache| &mut cache.bf16_fast,
            || {
                FastBf16Weight::upload_grouped(&self.rt, groups, out, inp, weight)
                    .map_err(op_err("linear_bf16"))
            },
        )
    }

    /// The device weight `[out, inp]` of `Backend::linear_f32` in the `fast` numerics, cached by
    /// the host values: the split-x bf16x3 linear's when every value is bf16 (checked here, on
    /// first use), else the f32 values for the exact kernel.
    fn cached_f32_linear_fast(
        &self,
        op: &'static str,
        weight: &[f32],
        out: usize,
        inp: usize,
    ) -> Result<Arc<dense::FastF32Weight>, CudaBackendError> {
        self.cached(
            HostKey::f32s(weight),
            |cache| &mut cache.f32_linear_fast,
            || {
                Ok(if exactly_bf16(weight) {
                    dense::FastF32Weight::Bf16x3(
                        FastBf16Weight::upload(&self.rt, out, inp, weight).map_err(op_err(op))?,
                    )
                } else {
                    dense::FastF32Weight::Sgemm(
                        self.rt
                            .htod(weight)
                            .map_err(driver_err(op, "uploading a weight"))?,
                    )
                })
            },
        )
    }

    /// Activations `[rows, inp]` (f32 storage) quantised to FP8 with `group`: the ones kept on
    /// `x`'s buffer when `x` is a whole buffer quantised so before, else quantised now (uploaded
    /// first when on the host) and kept on the buffer. While the runtime captures a graph nothing
    /// is taken or kept: a replay must quantise what the buffer holds then, and a quantisation
    /// kept past the capture would hold the graph's own memory.
    fn quantised_activations(
        &self,
        op: &'static str,
        x: &Tensor,
        inp: usize,
        group: ActGroup,
    ) -> Result<Arc<DeviceActFp8>, CudaBackendError> {
        let rows = whole_rows(op, x, inp)?;
        let memo = whole_buffer(x)
            .filter(|_| !self.rt.capturing())
            .map(|buffer| &buffer.fp8);
        if let Some(kept) = memo.and_then(|memo| {
            lock(memo)
                .clone()
                .filter(|a| a.group == group && a.cols == inp)
        }) {
            return Ok(kept);
        }
        let dx = self.input(op, x)?;
        let a = Arc::new(quantize_act_fp8(&self.rt, &dx, rows, inp, group).map_err(op_err(op))?);
        if let Some(memo) = memo {
            *lock(memo) = Some(a.clone());
        }
        Ok(a)
    }

    /// A device result as a tensor.
    fn tensor(&self, data: CudaSlice<f32>) -> Tensor {
        self.tensor_kept(data, None)
    }

    /// A device result as a tensor that keeps `act`, its values' FP8 activations, for the GEMMs
    /// that read it.
    fn tensor_with_fp8(&self, data: CudaSlice<f32>, act: DeviceActFp8) -> Tensor {
        self.tensor_kept(data, Some(Arc::new(act)))
    }

    fn tensor_kept(&self, data: CudaSlice<f32>, fp8: Option<Arc<DeviceActFp8>>) -> Tensor {
        let len = data.len();
        let buffer = CudaBuffer {
            data,
            stream: self.rt.stream().clone(),
            transfers: self.transfers.clone(),
            fp8: Mutex::new(fp8),
        };
        Tensor::device(Arc::new(buffer), 0, len)
    }

    /// bf16 GEMM outputs widened into an f32 tensor on the device.
    fn widen(&self, op: &'static str, y: &CudaSlice<bf16>) -> Result<Tensor, CudaBackendError> {
        // SAFETY: bf16_to_f32's grid-stride loop writes every value.
        let mut out = unsafe { self.alloc_written(op, y.len()) }?;
        bf16_to_f32(&self.rt, y, &mut out).map_err(op_err(op))?;
        Ok(self.tensor(out))
    }

    /// `x` as one whole device buffer: borrowed when it is one already, else uploaded (a host
    /// tensor) or copied device to device (a view into part of a buffer).
    fn input<'a>(&self, op: &'static str, x: &'a Tensor) -> Result<Input<'a>, CudaBackendError> {
        if let Some(buffer) = whole_buffer(x) {
            return Ok(Input::Whole(&buffer.data));
        }
        if let Some(view) = x.device_view()
            && let Some(buffer) = view.buffer.as_any().downcast_ref::<CudaBuffer>()
        {
            let part = buffer.data.slice(view.offset..view.offset + x.len());
            return self
                .rt
                .stream()
                .clone_dtod(&part)
                .map(Input::Copied)
                .map_err(driver_err(op, "copying a tensor view"));
        }
        self.upload(op, x.as_host()).map(Input::Copied)
    }

    /// Runs `change` on `x`'s values in device memory and returns them: in place when `x` is the
    /// only holder of a whole device buffer, else on a device copy.
    fn in_place(
        &self,
        op: &'static str,
        mut x: Tensor,
        change: impl FnOnce(&mut CudaSlice<f32>) -> Result<(), CudaBackendError>,
    ) -> Result<Tensor, CudaBackendError> {
        if let Some(buffer) = x
            .device_buffer_mut()
            .and_then(|b| b.as_any_mut().downcast_mut::<CudaBuffer>())
        {
            buffer
                .fp8
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            change(&mut buffer.data)?;
            return Ok(x);
        }
        let mut data = self.input(op, &x)?.into_owned(self, op)?;
        change(&mut data)?;
        Ok(self.tensor(data))
    }

    /// The device address of the `len` values of `t` from `offset` (uploading a host tensor into
    /// `keep`, once per call however many of its rows are addressed; the caller holds `keep`
    /// until the kernels reading the address have been launched).
    /// This backend's identity for device state it leaves in model-owned slots (a
    /// [`KeyList`](crate::backend::KeyList)'s mirror): its CUDA context.
    fn owner(&self) -> usize {
        Arc::as_ptr(self.rt.context()) as usize
    }

    fn address_of(
        &self,
        op: &'static str,
        t: &Tensor,
        offset: usize,
        len: usize,
        keep: &mut HostUploads,
    ) -> Result<u64, CudaBackendError> {
        if offset + len > t.len() {
            return Err(shape_err(
                op,
                format!("{len} values at {offset} of a {}-value tensor", t.len()),
            ));
        }
        // Only this backend's buffers have an address, kept in every view: the table's work stays
        // in the tensors' own fields (a B = 64 step lists ~40k keys, each in its own buffer).
        if let Some(address) = t.device_view().and_then(|view| view.address(offset)) {
            if len == 0 {
                return Err(shape_err(
                    op,
                    "a row of 0 values has no address".to_string(),
                ));
            }
            return Ok(address);
        }
        let host = t.as_host();
        let key = (host.as_ptr() as usize, host.len());
        let at = match keep.index.get(&key) {
            Some(&at) => at,
            None => {
                keep.slices.push(self.upload(op, host)?);
                keep.index.insert(key, keep.slices.len() - 1);
                keep.slices.len() - 1
            }
        };
        key_row_address(&self.rt, &keep.slices[at], offset, len).map_err(op_err(op))
    }

    /// [`Backend::gather`], with errors: one launch over the pieces' addresses (in its parameters
    /// up to `GATHER_INLINE` pieces, else an uploaded table).
    pub fn try_gather(
        &self,
        pieces: &[(&Tensor, usize)],
        width: usize,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "gather";
        if pieces.is_empty() || width == 0 {
            return Ok(Tensor::empty());
        }
        let mut keep = HostUploads::default();
        let addresses = pieces
            .iter()
            .map(|(t, offset)| self.address_of(OP, t, *offset, width, &mut keep))
            .collect::<Result<Vec<u64>, _>>()?;
        // SAFETY: gather_ptrs_f32 strides over every piece and every value of it.
        let mut out = unsafe { self.alloc_written(OP, pieces.len() * width) }?;
        // Small tables travel in the launch's parameters: no upload per gather.
        gather_addresses_f32(&self.rt, &addresses, width, &mut out).map_err(op_err(OP))?;
        drop(keep);
        Ok(self.tensor(out))
    }

    /// [`Backend::table_rows`], with errors: the table uploaded once (the weight cache), then one
    /// gather launch over the rows' device addresses.
    pub fn try_table_rows(
        &self,
        table: &[f32],
        width: usize,
        ids: &[u32],
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "table_rows";
        if ids.is_empty() || width == 0 {
            return Ok(Tensor::empty());
        }
        if !table.len().is_multiple_of(width) {
            return Err(shape_err(
                OP,
                format!(
                    "a {}-value table is not whole {width}-value rows",
                    table.len()
                ),
            ));
        }
        let rows = table.len() / width;
        if let Some((at, &id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= rows) {
            return Err(shape_err(
                OP,
                format!("id {at} is row {id} of a {rows}-row table"),
            ));
        }
        let resident = self.cached_f32(OP, table)?;
        let addresses = ids
            .iter()
            .map(|&id| key_row_address(&self.rt, &resident, id as usize * width, width))
            .collect::<Result<Vec<u64>, _>>()
            .map_err(op_err(OP))?;
        // SAFETY: gather_ptrs_f32 strides over every piece and every value of it.
        let mut out = unsafe { self.alloc_written(OP, ids.len() * width) }?;
        gather_addresses_f32(&self.rt, &addresses, width, &mut out).map_err(op_err(OP))?;
        Ok(self.tensor(out))
    }
}

/// The kernels' rounding for a model precision.
fn rounding(precision: Precision) -> Rounding {
    match precision {
        Precision::Bf16 => Rounding::Bf16,
        Precision::F32 => Rounding::F32,
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn gemm_fp8(&self, x: &Tensor, w: &Fp8Weight) -> Tensor {
        self.run("gemm_fp8", || self.try_gemm_fp8(x, w))
    }

    fn gemm_fp4(&self, x: &Tensor, w: &Fp4Weight) -> Tensor {
        self.run("gemm_fp4", || self.try_gemm_fp4(x, w))
    }

    fn linear_bf16(&self, x: &Tensor, w: DenseWeight<'_>) -> Tensor {
        self.run("linear_bf16", || self.try_linear(x, w, Rounding::Bf16))
    }

    fn linear_grouped_bf16(&self, x: &Tensor, w: &[f32], shape: Groups) -> Tensor {
        self.run("linear_grouped_bf16", || {
            self.try_linear_grouped_bf16(x, w, shape)
        })
    }

    fn linear_f32(&self, x: &Tensor, w: DenseWeight<'_>) -> Tensor {
        self.run("linear_f32", || self.try_linear(x, w, Rounding::F32))
    }

    fn gather(&self, pieces: &[(&Tensor, usize)], width: usize) -> Tensor {
        self.run("gather", || self.try_gather(pieces, width))
    }

    fn table_rows(&self, table: &[f32], width: usize, ids: &[u32]) -> Tensor {
        self.run("table_rows", || self.try_table_rows(table, width, ids))
    }

    fn linear(&self, x: &Tensor, w: &Linear) -> Tensor {
        self.run("linear", || self.try_linear_v4(x, w))
    }

    fn rms_norm(&self, x: &Tensor, norm: RmsNorm<'_>) -> Tensor {
        self.run("rms_norm", || self.try_rms_norm(x, norm))
    }

    fn rope(&self, x: Tensor, layout: (usize, usize), rotation: &Rotation<'_>) -> Tensor {
        self.run("rope", || self.try_rope(x, layout, rotation))
    }

    fn rope_qdq(
        &self,
        x: Tensor,
        norm: Option<RmsNorm<'_>>,
        layout: (usize, usize),
        rotation: &Rotation<'_>,
        point: ModelQdq,
    ) -> Tensor {
        self.run("rope_qdq", || {
            self.try_rope_qdq(x, norm, layout, rotation, point)
        })
    }

    fn hc_mixes_rows(&self, x: &Tensor, params: &HcParams, mixing: &HcMixing) -> HcMixes {
        self.run("hc_mixes_rows", || {
            self.try_hc_mixes_rows(x, params, mixing)
        })
    }

    fn hc_collapse_rows_at(&self, x: &Tensor, collapse: HcCollapse<'_>) -> Tensor {
        self.run("hc_collapse_rows_at", || {
            self.try_hc_collapse_rows(x, collapse)
        })
    }

    fn hc_expand_rows_at(&self, y: &Tensor, expand: HcExpand<'_>) -> Tensor {
        self.run("hc_expand_rows_at", || self.try_hc_expand_rows(y, expand))
    }

    fn sparse_attention_rows(
        &self,
        queries: AttentionQueries<'_>,
        keys: &[QueryKeys<'_>],
    ) -> Tensor {
        self.run("sparse_attention_rows", || {
            self.try_sparse_attention_rows(queries, keys)
        })
    }

    fn select_rows(
        &self,
        queries: IndexQueries<'_>,
        from: SelectFrom<'_>,
    ) -> (Selection, Option<CandidateMask>) {
        self.run("select_rows", || self.try_select_rows(queries, from))
    }

    fn index_scores_rows_at(
        &self,
        queries: IndexQueries<'_>,
        part: SelectPart<'_>,
    ) -> Vec<Vec<f32>> {
        self.run("index_scores_rows_at", || {
            self.try_index_scores_rows(queries, part)
        })
    }

    fn sample_rows(
        &self,
        logits: &[f32],
        vocab: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError> {
        check_sample_rows(logits, vocab, rows)?;
        Ok(self.run("sample_rows", || self.try_sample_rows(logits, vocab, rows)))
    }

    fn sample_masked(
        &self,
        rows: MaskedRows<'_, RowSampling>,
    ) -> Result<Vec<u32>, SampleRowsError> {
        rows.check()?;
        Ok(self.run("sample_masked", || self.try_sample_masked(rows)))
    }

    fn token_logprobs_masked(
        &self,
        picks: MaskedRows<'_, super::LogprobPick>,
    ) -> Result<Vec<crate::sampling::TokenLogprobs>, SampleRowsError> {
        picks.check()?;
        Ok(self.run("token_logprobs_masked", || {
            self.try_token_logprobs_masked(picks)
        }))
    }

    fn sample_linear(
        &self,
        x: &Tensor,
        head: DenseWeight<'_>,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError> {
        let (out, inp) = (head.out, head.inp);
        if rows.is_empty() && x.is_empty() {
            return Ok(Vec::new());
        }
        if out == 0 {
            return Err(SampleRowsError::EmptyVocab { rows: rows.len() });
        }
        if inp == 0 || x.len() != rows.len() * inp {
            return Err(SampleRowsError::LogitsShape {
                found: x.len() / inp.max(1) * out,
                rows: rows.len(),
                vocab: out,
            });
        }
        Ok(self.run("sample_linear", || self.try_sample_linear(x, head, rows)))
    }

    fn route_experts(&self, logits: &Tensor, routing: Routing<'_>) -> Vec<ExpertRoute> {
        self.run("route_experts", || self.try_route_experts(logits, routing))
    }

    // Engram hashing is not a backend op: its inputs are the step's token ids, which are on the
    // host (`NgramHasher::hash_chunk`), and its row ids go straight to `engram_gather` (uploaded,
    // never copied back). The device kernel `engram_hash_rows` has its conformance test in
    // `tests/tests/gpu.rs`.

    fn add(&self, x: Tensor, y: &Tensor) -> Tensor {
        self.run("add", || self.try_add(x, y))
    }

    /// A device tensor as it is, a host one uploaded.
    fn resident(&self, x: Tensor) -> Tensor {
        self.run("resident", || {
            if x.is_empty() || x.device_view().is_some() {
                return Ok(x);
            }
            let data = self.upload("resident", x.as_host())?;
            Ok(self.tensor(data))
        })
    }

    fn argmax_rows(&self, x: &Tensor, width: usize) -> Vec<u32> {
        self.run("argmax_rows", || self.try_argmax_rows(x, width))
    }

    fn moe_rows(&self, x: &Tensor, layer: &MoeLayer<'_>) -> Option<Tensor> {
        self.run("moe_rows", || self.try_moe_rows(x, layer))
    }

    fn engram_gather(&self, table: &EngramTable, row_ids: &[u32]) -> Tensor {
        self.run("engram_gather", || self.try_engram_gather(table, row_ids))
    }

    fn scale_at(&self, x: Tensor, scale: f32, precision: Precision) -> Tensor {
        self.run("scale_at", || self.try_scale(x, scale, precision))
    }

    fn stream_means_at(
        &self,
        streams: &Tensor,
        shape: StreamShape,
        precision: Precision,
    ) -> Tensor {
        self.run("stream_means_at", || {
            self.try_stream_means(streams, shape, precision)
        })
    }

    fn gated_pool_rows(&self, groups: &[Vec<&Tensor>], head_dim: usize) -> Tensor {
        self.run("gated_pool_rows", || {
            self.try_gated_pool_rows(groups, head_dim)
        })
    }

    fn engram_inject(&self, streams: Tensor, injection: EngramInjection<'_>) -> Tensor {
        self.run("engram_inject", || {
            self.try_engram_inject(streams, injection)
        })
    }

    fn hyper_head_weights_rows(&self, x: &Tensor, head: &HyperHead<'_>) -> Tensor {
        self.run("hyper_head_weights_rows", || {
            self.try_hyper_head_weights_rows(x, head)
        })
    }

    fn compressor_pool_rows(&self, entries: &[Vec<PoolSlot<'_>>], width: usize) -> Tensor {
        self.run("compressor_pool_rows", || {
            self.try_compressor_pool_rows(entries, width)
        })
    }

    fn moe_rows_exact(
        &self,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        hashed: Option<&[Vec<usize>]>,
    ) -> Option<Tensor> {
        self.run("moe_rows_exact", || {
            self.try_moe_rows_exact(x, layer, hashed)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_rows_counts_rows_or_names_the_op_and_the_length() {
        let x = Tensor::from(&[0.0f32; 12][..]);
        assert_eq!(whole_rows("op", &x, 4).expect("3 rows of 4"), 3);
        assert_eq!(whole_rows("op", &Tensor::empty(), 4).expect("no rows"), 0);
        for width in [0, 5] {
            let err = whole_rows("gemm_fp8", &x, width).expect_err("not whole rows");
            let text = err.to_string();
            assert!(
                text.contains("gemm_fp8") && text.contains("x holds 12 values"),
                "{text}"
            );
        }
    }

    #[test]
    fn a_weight_changed_in_place_gets_a_new_cache_key() {
        let mut small = vec![0.5f32; 100];
        let before = HostKey::f32s(&small);
        small[63] = -0.5;
        assert_ne!(
            HostKey::f32s(&small),
            before,
            "every element of a small buffer counts"
        );
        let mut large = vec![0.25f32; 100_000];
        let before = HostKey::f32s(&large);
        assert_eq!(HostKey::f32s(&large), before, "the key is stable");
        // A sampled element (0, step, 2·step, …, and the last) changes the key.
        let step = large.len() / FINGERPRINT_SAMPLES;
        large[7 * step] = 1.0;
        assert_ne!(HostKey::f32s(&large), before);
        assert_ne!(
            HostKey::f32s(&large[..99_999]),
            HostKey::f32s(&large),
            "length is part of the key"
        );
    }

    #[test]
    fn opening_without_a_driver_is_an_error_not_a_panic() {
        if deepinfer_kernels::runtime::driver_available().is_ok() {
            return; // a GPU machine: tests/tests/gpu.rs covers the open path
        }
        let opened = std::panic::catch_unwind(|| CudaBackend::open(0, Numerics::Exact).map(|_| ()));
        let err = opened.expect("no panic").expect_err("no driver");
        assert!(matches!(
            err,
            CudaBackendError::Open {
                ordinal: 0,
                source: KernelError::NoDriver { .. }
            }
        ));
        assert!(
            err.to_string()
                .starts_with("cannot open CUDA device 0: no CUDA driver"),
            "{err}"
        );
    }
}
