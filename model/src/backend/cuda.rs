//! `CudaBackend`: [`Backend`] on one NVIDIA GPU through the kernels of `deepinfer-kernels`. Every op
//! computes what [`super::CpuBackend`] computes, in the same operation order, so the results are
//! bit-identical (the sgemm order of the plain linears, torch's CPU sum order of the means of
//! squares, the sequential f64 sums of attention and the indexer, the vectorised `exp`). No kernel
//! splits a reduction by the batch, so a sequence's numbers do not depend on what else runs (batch
//! invariance).
//!
//! Beyond the layer math: token sampling (`sample_rows`: the logits go up, only the ids come
//! back), the MoE router after its gate linear, and Engram hashing and table lookup (the tables
//! are uploaded once, like weights, and stay in device memory).
//!
//! Data path of this first step: weights are uploaded once and cached on the device; activations
//! are copied to the device and back for every op (the device-resident data path, with no copy
//! inside a decode step but the sampled tokens, is a later step).
//!
//! Weight cache: only the weights the model passes (never temporaries: the fp32 linears over FP8 /
//! FP4 weights are overridden to dequantise on the device from the cached FP8 / FP4 copy, so the
//! trait's default, which hands dequantised host blocks to `linear_f32`, never reaches the cache).
//! The model's weights are immutable host buffers that live as long as the model, so
//! a weight is keyed by its host address and length plus a content fingerprint (every element of a
//! buffer up to 4096 elements, 64 evenly spaced ones beyond). A host buffer that is freed and
//! replaced by another of the same length at the same address with the same sampled content would
//! hit a stale entry: do not pass short-lived buffers as weights, or call
//! [`CudaBackend::clear_weight_cache`] after freeing them.
//!
//! Errors: [`CudaBackend::open`] returns [`CudaBackendError`] (no driver, no NVRTC, unsupported
//! GPU, compile failure), never panics. The `try_*` methods return errors too. [`Backend`]'s
//! methods return plain values, so a device failure inside one of them (out of memory, a lost
//! device) has no error channel: it panics with the op and the driver's message.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::attention::{
    DeviceKeyLists, MAX_QUERIES_PER_LAUNCH as MAX_QUERIES_PER_ATTENTION_LAUNCH,
    sparse_attention_sink_rows_f32,
};
use deepinfer_kernels::ops::engram::{
    DeviceEngramHasher, DeviceEngramTable, engram_gather_f32, engram_hash_rows,
};
use deepinfer_kernels::ops::gemm::{DeviceFp4Weight, DeviceFp8Weight, gemm_fp4, gemm_fp8};
use deepinfer_kernels::ops::index::{
    DeviceVisiblePrefixes, MAX_QUERIES_PER_LAUNCH as MAX_QUERIES_PER_INDEX_LAUNCH,
    index_scores_rows_f32,
};
use deepinfer_kernels::ops::linear::{
    dequant_fp4_rows_f32, dequant_fp8_rows_f32, linear_sgemm_f32,
};
use deepinfer_kernels::ops::mhc::{
    HcMixesConfig, MAX_TOKENS_PER_LAUNCH, hc_collapse_rows_f32, hc_expand_rows_f32,
    hc_mixes_rows_f32,
};
use deepinfer_kernels::ops::moe::{Selection, route_experts_f32, selected_count};
use deepinfer_kernels::ops::norm::rms_norm_f32;
use deepinfer_kernels::ops::qdq::{QdqPoint, qdq_f32};
use deepinfer_kernels::ops::quant::{ActGroup, DeviceActFp8, quantize_act_fp8_f32};
use deepinfer_kernels::ops::rope::{RopeShape, rope_interleaved_f32};
use deepinfer_kernels::ops::sampling::{SampleRow, SampleScratch, sample_rows_f32};
use deepinfer_kernels::{KernelError, KernelRuntime};
use half::bf16;

use super::{
    Backend, ExpertRoute, ExpertSelection, HcMix, HcParams, Precision, RopeTable, RowSampling,
    SampleRowsError, check_sample_rows,
};
use crate::engram::{EngramTable, NgramHasher};
use crate::weights::{Fp4Weight, Fp8Weight};

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

/// A host weight's identity: address, length, content fingerprint (see the module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct HostKey {
    addr: usize,
    len: usize,
    fingerprint: u64,
}

/// Weight rows dequantised to f32 at a time by the fp32 linears over FP8 / FP4 weights.
const DEQUANT_ROWS: usize = 1024;

/// Buffers up to this many elements are fingerprinted in full.
const FULL_FINGERPRINT_LEN: usize = 4096;
/// Elements sampled from a longer buffer.
const FINGERPRINT_SAMPLES: usize = 64;

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
    fp8: HashMap<(HostKey, HostKey), Arc<DeviceFp8Weight>>,
    fp4: HashMap<(HostKey, HostKey), Arc<DeviceFp4Weight>>,
    /// Engram tables (codes, scales), uploaded on first lookup.
    engram_tables: HashMap<(HostKey, HostKey), Arc<DeviceEngramTable>>,
}

/// The CUDA implementation of [`Backend`] on one device.
pub struct CudaBackend {
    rt: KernelRuntime,
    name: String,
    weights: Mutex<WeightCache>,
    transfers: Arc<TransferCounters>,
}

/// Device-to-host copies a [`CudaBackend`] made: results of ops (activations, routes, Engram row
/// ids) and, apart, the sampled token ids (the one copy a decode step is meant to have).
#[derive(Debug, Default)]
pub struct TransferCounters {
    to_host_copies: AtomicU64,
    to_host_bytes: AtomicU64,
    sampled_id_copies: AtomicU64,
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

    fn result<T>(&self, values: usize) {
        self.to_host_copies.fetch_add(1, Ordering::Relaxed);
        self.to_host_bytes.fetch_add(
            (values * std::mem::size_of::<T>()) as u64,
            Ordering::Relaxed,
        );
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
    /// Opens device `ordinal` and compiles (or loads from the disk cache) every kernel. Without a
    /// CUDA driver this is [`CudaBackendError::Open`] with `KernelError::NoDriver`, not a panic.
    pub fn open(ordinal: usize) -> Result<CudaBackend, CudaBackendError> {
        let rt = KernelRuntime::open(ordinal)
            .map_err(|source| CudaBackendError::Open { ordinal, source })?;
        let report = rt.report();
        let name = format!("cuda:{ordinal} ({}, {})", report.device_name, report.arch);
        Ok(CudaBackend {
            rt,
            name,
            weights: Mutex::new(WeightCache::default()),
            transfers: Arc::new(TransferCounters::default()),
        })
    }

    /// The device-to-host copies this backend makes (shared: keep a clone to read them after the
    /// backend was handed to a model).
    pub fn transfer_counters(&self) -> Arc<TransferCounters> {
        self.transfers.clone()
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
        cache.f32s.len() + cache.fp8.len() + cache.fp4.len() + cache.engram_tables.len()
    }

    fn upload(&self, op: &'static str, values: &[f32]) -> Result<CudaSlice<f32>, CudaBackendError> {
        self.rt
            .stream()
            .clone_htod(values)
            .map_err(driver_err(op, "uploading an activation"))
    }

    fn alloc(&self, op: &'static str, len: usize) -> Result<CudaSlice<f32>, CudaBackendError> {
        self.rt
            .stream()
            .alloc_zeros::<f32>(len)
            .map_err(driver_err(op, "allocating an output"))
    }

    fn download(
        &self,
        op: &'static str,
        values: &CudaSlice<f32>,
    ) -> Result<Vec<f32>, CudaBackendError> {
        self.transfers.result::<f32>(values.len());
        self.rt
            .stream()
            .clone_dtoh(values)
            .map_err(driver_err(op, "downloading a result"))
    }

    /// The cached device copy of a weight under `key` in the cache `map` selects, uploading it
    /// with `upload` on first use.
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
                    .stream()
                    .clone_htod(weight)
                    .map_err(driver_err(op, "uploading a weight"))
            },
        )
    }

    fn cached_fp8(&self, w: &Fp8Weight) -> Result<Arc<DeviceFp8Weight>, CudaBackendError> {
        self.cached(
            (HostKey::bytes(&w.data), HostKey::bytes(&w.scales)),
            |cache| &mut cache.fp8,
            || {
                DeviceFp8Weight::upload(&self.rt, w.out, w.inp, w.block, &w.data, &w.scales)
                    .map_err(op_err("gemm_fp8"))
            },
        )
    }

    fn cached_fp4(&self, w: &Fp4Weight) -> Result<Arc<DeviceFp4Weight>, CudaBackendError> {
        self.cached(
            (HostKey::bytes(&w.packed), HostKey::bytes(&w.scales)),
            |cache| &mut cache.fp4,
            || {
                DeviceFp4Weight::upload(&self.rt, w.out, w.inp, &w.packed, &w.scales)
                    .map_err(op_err("gemm_fp4"))
            },
        )
    }

    /// Uploads activations `[rows, inp]` (f32 storage) and quantises them to FP8 with `group`.
    fn quantised_activations(
        &self,
        op: &'static str,
        x: &[f32],
        inp: usize,
        group: ActGroup,
    ) -> Result<DeviceActFp8, CudaBackendError> {
        if inp == 0 || !x.len().is_multiple_of(inp) {
            return Err(shape_err(
                op,
                format!("x holds {} values, not whole rows of {inp}", x.len()),
            ));
        }
        let dx = self.upload(op, x)?;
        quantize_act_fp8_f32(&self.rt, &dx, x.len() / inp, inp, group).map_err(op_err(op))
    }

    fn download_bf16(
        &self,
        op: &'static str,
        y: &CudaSlice<bf16>,
    ) -> Result<Vec<f32>, CudaBackendError> {
        self.transfers.result::<bf16>(y.len());
        Ok(self
            .rt
            .stream()
            .clone_dtoh(y)
            .map_err(driver_err(op, "downloading a result"))?
            .iter()
            .map(|v| v.to_f32())
            .collect())
    }

    /// [`Backend::gemm_fp8`], with errors.
    pub fn try_gemm_fp8(&self, x: &[f32], w: &Fp8Weight) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "gemm_fp8";
        let group = match w.block {
            32 => ActGroup::G32,
            128 => ActGroup::G128,
            block => {
                return Err(shape_err(
                    OP,
                    format!("weight block {block} (only 32 and 128)"),
                ));
            }
        };
        if x.is_empty() {
            return Ok(Vec::new());
        }
        let a = self.quantised_activations(OP, x, w.inp, group)?;
        let dw = self.cached_fp8(w)?;
        let mut y = self
            .rt
            .stream()
            .alloc_zeros::<bf16>(a.rows * w.out)
            .map_err(driver_err(OP, "allocating an output"))?;
        gemm_fp8(&self.rt, &a, &dw, &mut y).map_err(op_err(OP))?;
        self.download_bf16(OP, &y)
    }

    /// [`Backend::gemm_fp4`], with errors.
    pub fn try_gemm_fp4(&self, x: &[f32], w: &Fp4Weight) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "gemm_fp4";
        if x.is_empty() {
            return Ok(Vec::new());
        }
        let a = self.quantised_activations(OP, x, w.inp, ActGroup::G32)?;
        let dw = self.cached_fp4(w)?;
        let mut y = self
            .rt
            .stream()
            .alloc_zeros::<bf16>(a.rows * w.out)
            .map_err(driver_err(OP, "allocating an output"))?;
        gemm_fp4(&self.rt, &a, &dw, &mut y).map_err(op_err(OP))?;
        self.download_bf16(OP, &y)
    }

    /// [`Backend::linear_f32`] / [`Backend::linear_bf16`], with errors. Like the CPU reference, a
    /// weight shorter than `out` rows yields only the rows it has.
    pub fn try_linear(
        &self,
        x: &[f32],
        w: &[f32],
        out: usize,
        inp: usize,
        output: Rounding,
    ) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "linear";
        if inp == 0 || !x.len().is_multiple_of(inp) {
            return Err(shape_err(
                OP,
                format!("x holds {} values, not whole rows of {inp}", x.len()),
            ));
        }
        let rows = x.len() / inp;
        let out = out.min(w.len() / inp);
        if rows == 0 || out == 0 {
            return Ok(Vec::new());
        }
        let dw = self.cached_f32(OP, &w[..out * inp])?;
        let dx = self.upload(OP, x)?;
        let mut dy = self.alloc(OP, rows * out)?;
        linear_sgemm_f32(&self.rt, &dx, &dw, &mut dy, (rows, out, inp), output)
            .map_err(op_err(OP))?;
        self.download(OP, &dy)
    }

    /// [`Backend::linear_fp8_f32`], with errors: the FP8 weight (cached on the device) is
    /// dequantised exactly to f32 on the device, [`DEQUANT_ROWS`] rows at a time, and multiplied
    /// in the CPU sgemm order, as the default method does on the host.
    pub fn try_linear_fp8_f32(
        &self,
        x: &[f32],
        w: &Fp8Weight,
    ) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "linear_fp8_f32";
        let dw = self.cached_fp8(w)?;
        self.dequantised_linear(OP, x, (w.out, w.inp), |start, rows, block| {
            dequant_fp8_rows_f32(&self.rt, &dw, start, rows, block)
        })
    }

    /// [`Backend::linear_fp4_f32`], with errors (see [`CudaBackend::try_linear_fp8_f32`]).
    pub fn try_linear_fp4_f32(
        &self,
        x: &[f32],
        w: &Fp4Weight,
    ) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "linear_fp4_f32";
        let dw = self.cached_fp4(w)?;
        self.dequantised_linear(OP, x, (w.out, w.inp), |start, rows, block| {
            dequant_fp4_rows_f32(&self.rt, &dw, start, rows, block)
        })
    }

    /// `x · Wᵀ` (fp32 out) with `W [out, inp]` dequantised block by block by `dequant` (first row,
    /// rows, output buffer). Each output is one sgemm-order chain, so the blocking never shows.
    fn dequantised_linear(
        &self,
        op: &'static str,
        x: &[f32],
        (out, inp): (usize, usize),
        dequant: impl Fn(usize, usize, &mut CudaSlice<f32>) -> Result<(), KernelError>,
    ) -> Result<Vec<f32>, CudaBackendError> {
        if inp == 0 || !x.len().is_multiple_of(inp) {
            return Err(shape_err(
                op,
                format!("x holds {} values, not whole rows of {inp}", x.len()),
            ));
        }
        let rows = x.len() / inp;
        if rows == 0 || out == 0 {
            return Ok(Vec::new());
        }
        let dx = self.upload(op, x)?;
        let mut y = vec![0.0f32; rows * out];
        for start in (0..out).step_by(DEQUANT_ROWS) {
            let count = DEQUANT_ROWS.min(out - start);
            let mut block = self.alloc(op, count * inp)?;
            dequant(start, count, &mut block).map_err(op_err(op))?;
            let mut part = self.alloc(op, rows * count)?;
            linear_sgemm_f32(
                &self.rt,
                &dx,
                &block,
                &mut part,
                (rows, count, inp),
                Rounding::F32,
            )
            .map_err(op_err(op))?;
            let part = self.download(op, &part)?;
            for (r, chunk) in part.chunks_exact(count).enumerate() {
                y[r * out + start..r * out + start + count].copy_from_slice(chunk);
            }
        }
        Ok(y)
    }

    /// [`Backend::rms_norm_at`], with errors.
    pub fn try_rms_norm(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        precision: Precision,
    ) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "rms_norm";
        let cols = weight.len();
        if cols == 0 || !x.len().is_multiple_of(cols) {
            return Err(shape_err(
                OP,
                format!("x holds {} values, not whole rows of {cols}", x.len()),
            ));
        }
        if x.is_empty() {
            return Ok(Vec::new());
        }
        let dw = self.cached_f32(OP, weight)?;
        let dx = self.upload(OP, x)?;
        let mut dy = self.alloc(OP, x.len())?;
        rms_norm_f32(
            &self.rt,
            &dx,
            &dw,
            &mut dy,
            x.len() / cols,
            cols,
            eps,
            rounding(precision),
        )
        .map_err(op_err(OP))?;
        self.download(OP, &dy)
    }

    /// [`Backend::rope_at`], with errors. The cos/sin rows of the rows' positions are built on the host
    /// with the CPU reference's angle rule (f64 sine and cosine of `f32(position · freq)`).
    pub fn try_rope(
        &self,
        x: &mut [f32],
        stride: usize,
        vectors_per_row: usize,
        positions: &[usize],
        table: &RopeTable,
        inverse: bool,
        precision: Precision,
    ) -> Result<(), CudaBackendError> {
        const OP: &str = "rope";
        let pairs = table.freqs.len();
        let row_width = stride * vectors_per_row;
        if row_width == 0 || 2 * pairs > stride || !x.len().is_multiple_of(row_width) {
            return Err(shape_err(
                OP,
                format!(
                    "x ({} values) must be whole rows of {vectors_per_row} vectors of {stride}, each \
                     holding the {} rotated channels",
                    x.len(),
                    2 * pairs
                ),
            ));
        }
        let rows = x.len() / row_width;
        if positions.len() < rows {
            return Err(shape_err(
                OP,
                format!("{rows} rows but {} positions", positions.len()),
            ));
        }
        if rows == 0 || pairs == 0 {
            return Ok(());
        }
        let mut cos = Vec::with_capacity(rows * pairs);
        let mut sin = Vec::with_capacity(rows * pairs);
        for &position in &positions[..rows] {
            for freq in &table.freqs {
                let angle = f64::from(position as f32 * freq);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let row_index: Vec<i32> = (0..rows)
            .map(|r| i32::try_from(r).map_err(|_| shape_err(OP, format!("{rows} rows"))))
            .collect::<Result<_, _>>()?;
        let stream = self.rt.stream();
        let dpos = stream
            .clone_htod(&row_index)
            .map_err(driver_err(OP, "uploading positions"))?;
        let dcos = self.upload(OP, &cos)?;
        let dsin = self.upload(OP, &sin)?;
        let mut dx = self.upload(OP, x)?;
        let shape = RopeShape {
            tokens: rows,
            heads: vectors_per_row,
            head_dim: stride,
            rope_dim: 2 * pairs,
            table_rows: rows,
        };
        rope_interleaved_f32(
            &self.rt,
            &mut dx,
            &dpos,
            &dcos,
            &dsin,
            shape,
            inverse,
            rounding(precision),
        )
        .map_err(op_err(OP))?;
        self.transfers.result::<f32>(x.len());
        stream
            .memcpy_dtoh(&dx, x)
            .map_err(driver_err(OP, "downloading a result"))?;
        stream
            .synchronize()
            .map_err(driver_err(OP, "synchronising"))?;
        Ok(())
    }

    /// The QDQ points, with errors.
    pub fn try_qdq(&self, x: &mut [f32], point: QdqPoint) -> Result<(), CudaBackendError> {
        const OP: &str = "qdq";
        if x.is_empty() {
            return Ok(());
        }
        let mut dx = self.upload(OP, x)?;
        qdq_f32(&self.rt, &mut dx, point).map_err(op_err(OP))?;
        let stream = self.rt.stream();
        self.transfers.result::<f32>(x.len());
        stream
            .memcpy_dtoh(&dx, x)
            .map_err(driver_err(OP, "downloading a result"))?;
        stream
            .synchronize()
            .map_err(driver_err(OP, "synchronising"))?;
        Ok(())
    }

    /// [`Backend::sparse_attention_at`], with errors: the one-query case of
    /// [`CudaBackend::try_sparse_attention_rows`].
    pub fn try_sparse_attention(
        &self,
        q: &[f32],
        keys: &[&[f32]],
        sink: &[f32],
        scale: f32,
        precision: Precision,
    ) -> Result<Vec<f32>, CudaBackendError> {
        self.try_sparse_attention_rows(q, &[keys.to_vec()], sink, scale, precision)
    }

    /// [`Backend::hc_mixes`], with errors: the one-token case of
    /// [`CudaBackend::try_hc_mixes_rows`].
    pub fn try_hc_mixes(
        &self,
        x: &[f32],
        params: &HcParams,
        hc: usize,
        sinkhorn_iters: usize,
        hc_eps: f32,
        norm_eps: f32,
    ) -> Result<HcMix, CudaBackendError> {
        let mut mixes = self.try_hc_mixes_rows(x, params, hc, sinkhorn_iters, hc_eps, norm_eps)?;
        match (mixes.pop(), mixes.is_empty()) {
            (Some(mix), true) => Ok(mix),
            _ => Err(shape_err(
                "hc_mixes",
                format!("x ({} values) is not one token's streams", x.len()),
            )),
        }
    }

    /// [`Backend::hc_collapse_at`], with errors: the one-token case of
    /// [`CudaBackend::try_hc_collapse_rows`].
    pub fn try_hc_collapse(
        &self,
        x: &[f32],
        weights: &[f32],
        precision: Precision,
    ) -> Result<Vec<f32>, CudaBackendError> {
        self.try_hc_collapse_rows(x, weights, weights.len(), precision)
    }

    /// [`Backend::hc_expand_at`], with errors: the one-token case of
    /// [`CudaBackend::try_hc_expand_rows`].
    pub fn try_hc_expand(
        &self,
        y: &[f32],
        residual: &[f32],
        mix: &HcMix,
        precision: Precision,
    ) -> Result<Vec<f32>, CudaBackendError> {
        self.try_hc_expand_rows(y, residual, std::slice::from_ref(mix), precision)
    }

    /// [`Backend::index_scores_at`], with errors: the one-query case of
    /// [`CudaBackend::try_index_scores_rows`] over every key.
    pub fn try_index_scores(
        &self,
        q: &[f32],
        weights: &[f32],
        keys: &[f32],
        head_dim: usize,
        precision: Precision,
    ) -> Result<Vec<f32>, CudaBackendError> {
        if head_dim == 0 || !keys.len().is_multiple_of(head_dim) {
            return Err(shape_err(
                "index_scores",
                format!(
                    "keys ({} values) are not whole {head_dim}-wide keys",
                    keys.len()
                ),
            ));
        }
        let visible = [keys.len() / head_dim];
        let mut scores =
            self.try_index_scores_rows(q, weights, keys, head_dim, &visible, precision)?;
        Ok(scores.pop().unwrap_or_default())
    }
}

impl CudaBackend {
    /// [`Backend::sample_rows`], with errors: the logits are uploaded, every row sampled by the
    /// device's sampling kernel, and only the ids come back. Rows that restrict (top-k / top-p)
    /// take a sort scratch of the vocabulary's next power of two per row.
    pub fn try_sample_rows(
        &self,
        logits: &[f32],
        vocab: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, CudaBackendError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let dlogits = self.upload("sample_rows", logits)?;
        self.sample_device_rows(&dlogits, vocab, rows)
    }

    /// [`Backend::sample_linear`], with errors: the fp32 logits `x · Wᵀ` (in the order of
    /// [`Backend::linear_f32`]) are computed into a device buffer and sampled there; only the ids
    /// come back to the host.
    pub fn try_sample_linear(
        &self,
        x: &[f32],
        w: &[f32],
        out: usize,
        inp: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, CudaBackendError> {
        const OP: &str = "sample_linear";
        if inp == 0 || out == 0 || x.len() != rows.len() * inp || w.len() < out * inp {
            return Err(shape_err(
                OP,
                format!(
                    "x holds {} values and w {}: not {} rows of {inp} against {out} outputs",
                    x.len(),
                    w.len(),
                    rows.len()
                ),
            ));
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let dw = self.cached_f32(OP, &w[..out * inp])?;
        let dx = self.upload(OP, x)?;
        let mut dlogits = self.alloc(OP, rows.len() * out)?;
        linear_sgemm_f32(
            &self.rt,
            &dx,
            &dw,
            &mut dlogits,
            (rows.len(), out, inp),
            Rounding::F32,
        )
        .map_err(op_err(OP))?;
        self.sample_device_rows(&dlogits, out, rows)
    }

    /// Samples `rows.len()` rows of `vocab` logits already on the device (`sample_rows`'s math);
    /// only the ids are downloaded.
    fn sample_device_rows(
        &self,
        dlogits: &CudaSlice<f32>,
        vocab: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, CudaBackendError> {
        const OP: &str = "sample_rows";
        let vocab_u32 =
            u32::try_from(vocab).map_err(|_| shape_err(OP, format!("vocabulary of {vocab}")))?;
        let host_rows: Vec<SampleRow> = rows
            .iter()
            .map(|r| SampleRow {
                seed: r.params.seed,
                position: r.position,
                temperature: r.params.temperature,
                top_p: r.params.top_p,
                // At or beyond the vocabulary top-k keeps everything, as it does on the CPU.
                top_k: u32::try_from(r.params.top_k).map_or(vocab_u32, |k| k.min(vocab_u32)),
                reserved: 0,
            })
            .collect();
        let restricted = host_rows.iter().any(|r| r.restricts(vocab));
        let stream = self.rt.stream();
        let drows = stream
            .clone_htod(&host_rows)
            .map_err(driver_err(OP, "uploading the row parameters"))?;
        let mut scratch =
            SampleScratch::new(&self.rt, rows.len(), vocab, restricted).map_err(op_err(OP))?;
        let mut dtokens = stream
            .alloc_zeros::<u32>(rows.len())
            .map_err(driver_err(OP, "allocating the tokens"))?;
        sample_rows_f32(
            &self.rt,
            dlogits,
            &drows,
            &host_rows,
            &mut scratch,
            &mut dtokens,
            vocab,
        )
        .map_err(op_err(OP))?;
        self.transfers
            .sampled_id_copies
            .fetch_add(1, Ordering::Relaxed);
        stream
            .clone_dtoh(&dtokens)
            .map_err(driver_err(OP, "downloading the tokens"))
    }

    /// [`Backend::route_experts`], with errors.
    pub fn try_route_experts(
        &self,
        logits: &[f32],
        bias: &[f32],
        selection: ExpertSelection<'_>,
        route_scale: f32,
    ) -> Result<Vec<ExpertRoute>, CudaBackendError> {
        const OP: &str = "route_experts";
        let n_experts = bias.len();
        if n_experts == 0 || logits.len() < n_experts {
            return Ok(Vec::new());
        }
        let rows = logits.len() / n_experts;
        let logits = &logits[..rows * n_experts];
        let stream = self.rt.stream();
        let dbias = self.cached_f32(OP, bias)?;
        let dlogits = self.upload(OP, logits)?;
        let forced_ids: Vec<u32>;
        let dforced;
        let device_selection = match selection {
            ExpertSelection::TopK(k) => Selection::TopK(k),
            ExpertSelection::Forced(forced) => {
                // Ids at or beyond the expert count are dropped, as on the CPU.
                forced_ids = forced
                    .iter()
                    .filter(|&&e| e < n_experts)
                    .map(|&e| e as u32)
                    .collect();
                if forced_ids.is_empty() {
                    let empty = ExpertRoute {
                        experts: Vec::new(),
                        weights: Vec::new(),
                    };
                    return Ok(vec![empty; rows]);
                }
                dforced = stream
                    .clone_htod(&forced_ids)
                    .map_err(driver_err(OP, "uploading the forced experts"))?;
                Selection::Forced(&dforced)
            }
        };
        let selected = selected_count(device_selection, n_experts);
        if selected == 0 {
            let empty = ExpertRoute {
                experts: Vec::new(),
                weights: Vec::new(),
            };
            return Ok(vec![empty; rows]);
        }
        let mut dexperts = stream
            .alloc_zeros::<u32>(rows * selected)
            .map_err(driver_err(OP, "allocating the experts"))?;
        let mut dweights = self.alloc(OP, rows * selected)?;
        route_experts_f32(
            &self.rt,
            &dlogits,
            &dbias,
            device_selection,
            route_scale,
            &mut dexperts,
            &mut dweights,
        )
        .map_err(op_err(OP))?;
        self.transfers.result::<u32>(dexperts.len());
        let experts = stream
            .clone_dtoh(&dexperts)
            .map_err(driver_err(OP, "downloading the experts"))?;
        let weights = self.download(OP, &dweights)?;
        Ok(experts
            .chunks_exact(selected)
            .zip(weights.chunks_exact(selected))
            .map(|(experts, weights)| ExpertRoute {
                experts: experts.iter().map(|&e| e as usize).collect(),
                weights: weights.to_vec(),
            })
            .collect())
    }

    /// [`Backend::engram_hash`], with errors. The hashing parameters (a few hundred bytes) are
    /// uploaded with the contexts.
    pub fn try_engram_hash(
        &self,
        hasher: &NgramHasher,
        contexts: &[u64],
    ) -> Result<Vec<u32>, CudaBackendError> {
        const OP: &str = "engram_hash";
        let max_ngram = hasher.max_ngram();
        let tokens = contexts.len() / max_ngram;
        if tokens == 0 {
            return Ok(Vec::new());
        }
        let layout = hasher.layout();
        let multipliers: Vec<u64> = hasher.multipliers().iter().flatten().copied().collect();
        let primes: Vec<u64> = layout.primes.iter().flatten().copied().collect();
        let offsets: Vec<u64> = layout.offsets.iter().flatten().copied().collect();
        let dhasher =
            DeviceEngramHasher::upload(&self.rt, max_ngram, &multipliers, &primes, &offsets)
                .map_err(op_err(OP))?;
        let stream = self.rt.stream();
        let dcontexts = stream
            .clone_htod(&contexts[..tokens * max_ngram])
            .map_err(driver_err(OP, "uploading the contexts"))?;
        let mut drows = stream
            .alloc_zeros::<u32>(tokens * dhasher.layers * dhasher.columns)
            .map_err(driver_err(OP, "allocating the row ids"))?;
        engram_hash_rows(&self.rt, &dhasher, &dcontexts, &mut drows).map_err(op_err(OP))?;
        self.transfers.result::<u32>(drows.len());
        stream
            .clone_dtoh(&drows)
            .map_err(driver_err(OP, "downloading the row ids"))
    }

    /// [`Backend::engram_gather`], with errors. The table is uploaded to device memory on first
    /// use and cached like a weight (see the module header); only the ids travel per call.
    pub fn try_engram_gather(
        &self,
        table: &EngramTable,
        row_ids: &[u32],
    ) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "engram_gather";
        if row_ids.is_empty() {
            return Ok(Vec::new());
        }
        let dtable = self.cached(
            (
                HostKey::bytes(table.codes()),
                HostKey::bytes(table.scales()),
            ),
            |cache| &mut cache.engram_tables,
            || {
                DeviceEngramTable::upload(
                    &self.rt,
                    table.rows(),
                    table.head_dim(),
                    table.codes(),
                    table.scales(),
                )
                .map_err(op_err(OP))
            },
        )?;
        let dids = self
            .rt
            .stream()
            .clone_htod(row_ids)
            .map_err(driver_err(OP, "uploading the row ids"))?;
        let mut dout = self.alloc(OP, row_ids.len() * table.head_dim())?;
        engram_gather_f32(&self.rt, &dtable, &dids, &mut dout).map_err(op_err(OP))?;
        self.download(OP, &dout)
    }
}

/// The row-batched ops (every token of every sequence of a step in one call): one upload per
/// input, one launch and one download per op, each row computed exactly as the one-token op
/// computes it alone (batch invariance).
impl CudaBackend {
    /// [`Backend::hc_mixes_rows`], with errors: `x [n, hc · dim]`, all tokens in one pair of
    /// launches (the partials, then the sums and Sinkhorn per token).
    pub fn try_hc_mixes_rows(
        &self,
        x: &[f32],
        params: &HcParams,
        hc: usize,
        sinkhorn_iters: usize,
        hc_eps: f32,
        norm_eps: f32,
    ) -> Result<Vec<HcMix>, CudaBackendError> {
        const OP: &str = "hc_mixes_rows";
        let projections = (2 + hc) * hc;
        if hc == 0 || params.proj.is_empty() || !params.proj.len().is_multiple_of(projections) {
            return Err(shape_err(
                OP,
                format!(
                    "proj ({} values) is not {projections} whole projections (hc = {hc})",
                    params.proj.len()
                ),
            ));
        }
        let width = params.proj.len() / projections;
        if !x.len().is_multiple_of(width) {
            return Err(shape_err(
                OP,
                format!("x ({} values) is not whole {width}-wide tokens", x.len()),
            ));
        }
        let tokens = x.len() / width;
        if tokens == 0 {
            return Ok(Vec::new());
        }
        let dproj = self.cached_f32(OP, &params.proj)?;
        let dbase = self.cached_f32(OP, &params.base)?;
        let dscale = self.cached_f32(OP, &params.scale)?;
        let dx = self.upload(OP, x)?;
        let per_token = 2 * hc + hc * hc;
        let mut dout = self.alloc(OP, tokens * per_token)?;
        let config = HcMixesConfig {
            hc,
            sinkhorn_iters,
            hc_eps,
            norm_eps,
        };
        hc_mixes_rows_f32(
            &self.rt, &dx, width, &dproj, &dbase, &dscale, &mut dout, config,
        )
        .map_err(op_err(OP))?;
        Ok(self
            .download(OP, &dout)?
            .chunks_exact(per_token)
            .map(|out| HcMix {
                pre: out[..hc].to_vec(),
                post: out[hc..2 * hc].to_vec(),
                comb: out[2 * hc..].to_vec(),
            })
            .collect())
    }

    /// [`Backend::hc_collapse_rows_at`], with errors: `x [n, hc, dim]`, `weights [n, hc]`.
    pub fn try_hc_collapse_rows(
        &self,
        x: &[f32],
        weights: &[f32],
        hc: usize,
        precision: Precision,
    ) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "hc_collapse_rows";
        if hc == 0 || !weights.len().is_multiple_of(hc) {
            return Err(shape_err(
                OP,
                format!(
                    "weights ({} values) are not whole tokens of hc = {hc}",
                    weights.len()
                ),
            ));
        }
        let tokens = weights.len() / hc;
        if tokens == 0 && x.is_empty() {
            return Ok(Vec::new());
        }
        if tokens == 0 || x.is_empty() || !x.len().is_multiple_of(tokens * hc) {
            return Err(shape_err(
                OP,
                format!(
                    "x ({} values) is not {tokens} tokens of {hc} whole streams",
                    x.len()
                ),
            ));
        }
        if tokens > MAX_TOKENS_PER_LAUNCH {
            let stream_len = x.len() / (tokens * hc);
            return concat_chunks(
                weights
                    .chunks(MAX_TOKENS_PER_LAUNCH * hc)
                    .zip(x.chunks(MAX_TOKENS_PER_LAUNCH * hc * stream_len))
                    .map(|(w, x)| self.try_hc_collapse_rows(x, w, hc, precision)),
            );
        }
        let dx = self.upload(OP, x)?;
        let dw = self.upload(OP, weights)?;
        let mut dy = self.alloc(OP, x.len() / hc)?;
        hc_collapse_rows_f32(&self.rt, &dx, &dw, &mut dy, hc, rounding(precision))
            .map_err(op_err(OP))?;
        self.download(OP, &dy)
    }

    /// [`Backend::hc_expand_rows_at`], with errors: `y [n, dim]`, `residual [n, hc, dim]`, one
    /// mix per token (all with the same `hc`).
    pub fn try_hc_expand_rows(
        &self,
        y: &[f32],
        residual: &[f32],
        mixes: &[HcMix],
        precision: Precision,
    ) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "hc_expand_rows";
        let Some(first) = mixes.first() else {
            return if y.is_empty() && residual.is_empty() {
                Ok(Vec::new())
            } else {
                Err(shape_err(OP, format!("no mixes for {} outputs", y.len())))
            };
        };
        let hc = first.post.len();
        if let Some((t, bad)) = mixes
            .iter()
            .enumerate()
            .find(|(_, m)| m.post.len() != hc || m.comb.len() != hc * hc)
        {
            return Err(shape_err(
                OP,
                format!(
                    "mix {t} has {} post and {} comb values; mix 0 has hc = {hc}",
                    bad.post.len(),
                    bad.comb.len()
                ),
            ));
        }
        let tokens = mixes.len();
        if hc == 0 || y.is_empty() || !y.len().is_multiple_of(tokens) {
            return Err(shape_err(
                OP,
                format!(
                    "{tokens} tokens of {hc} streams and a {}-value output",
                    y.len()
                ),
            ));
        }
        if residual.len() != hc * y.len() {
            return Err(shape_err(
                OP,
                format!(
                    "residual has {} values, expected {hc} streams of the {}-value output",
                    residual.len(),
                    y.len()
                ),
            ));
        }
        if tokens > MAX_TOKENS_PER_LAUNCH {
            let dim = y.len() / tokens;
            return concat_chunks(
                mixes
                    .chunks(MAX_TOKENS_PER_LAUNCH)
                    .zip(y.chunks(MAX_TOKENS_PER_LAUNCH * dim))
                    .zip(residual.chunks(MAX_TOKENS_PER_LAUNCH * hc * dim))
                    .map(|((m, y), r)| self.try_hc_expand_rows(y, r, m, precision)),
            );
        }
        let coefficients: Vec<f32> = mixes
            .iter()
            .flat_map(|m| m.post.iter().chain(&m.comb))
            .copied()
            .collect();
        let dy = self.upload(OP, y)?;
        let dres = self.upload(OP, residual)?;
        let dmix = self.upload(OP, &coefficients)?;
        let mut dout = self.alloc(OP, hc * y.len())?;
        hc_expand_rows_f32(
            &self.rt,
            &dy,
            &dres,
            &dmix,
            &mut dout,
            hc,
            rounding(precision),
        )
        .map_err(op_err(OP))?;
        self.download(OP, &dout)
    }

    /// [`Backend::sparse_attention_rows_at`], with errors: every distinct key (by its host
    /// address) is uploaded once into one buffer, each query gets its list of rows in it, and one
    /// launch computes every (head, query).
    pub fn try_sparse_attention_rows(
        &self,
        q: &[f32],
        keys: &[Vec<&[f32]>],
        sink: &[f32],
        scale: f32,
        precision: Precision,
    ) -> Result<Vec<f32>, CudaBackendError> {
        const OP: &str = "sparse_attention_rows";
        let queries = keys.len();
        if queries == 0 {
            return if q.is_empty() {
                Ok(Vec::new())
            } else {
                Err(shape_err(
                    OP,
                    format!("{} query values but no key lists", q.len()),
                ))
            };
        }
        let heads = sink.len();
        if heads == 0 || q.is_empty() || !q.len().is_multiple_of(queries * heads) {
            return Err(shape_err(
                OP,
                format!(
                    "q ({} values) is not {queries} queries of {heads} whole heads",
                    q.len()
                ),
            ));
        }
        let head_dim = q.len() / (queries * heads);
        if queries > MAX_QUERIES_PER_ATTENTION_LAUNCH {
            let width = heads * head_dim;
            return concat_chunks(
                keys.chunks(MAX_QUERIES_PER_ATTENTION_LAUNCH)
                    .zip(q.chunks(MAX_QUERIES_PER_ATTENTION_LAUNCH * width))
                    .map(|(keys, q)| {
                        self.try_sparse_attention_rows(q, keys, sink, scale, precision)
                    }),
            );
        }
        // Distinct keys in first-seen order; a query's list names their rows.
        let mut row_of: HashMap<usize, u32> = HashMap::new();
        let mut flat: Vec<f32> = Vec::new();
        let mut lists: Vec<Vec<u32>> = Vec::with_capacity(queries);
        for (t, query_keys) in keys.iter().enumerate() {
            let mut list = Vec::with_capacity(query_keys.len());
            for (i, key) in query_keys.iter().enumerate() {
                if key.len() != head_dim {
                    return Err(shape_err(
                        OP,
                        format!(
                            "key {i} of query {t} has {} values, head_dim is {head_dim}",
                            key.len()
                        ),
                    ));
                }
                let next = u32::try_from(row_of.len())
                    .map_err(|_| shape_err(OP, "more than 2^32 distinct keys".to_string()))?;
                let row = *row_of.entry(key.as_ptr() as usize).or_insert_with(|| {
                    flat.extend_from_slice(key);
                    next
                });
                list.push(row);
            }
            lists.push(list);
        }
        let dlists = DeviceKeyLists::upload(&self.rt, &lists, row_of.len()).map_err(op_err(OP))?;
        let dsink = self.cached_f32(OP, sink)?;
        let dq = self.upload(OP, q)?;
        // No keys at all still needs a non-empty device buffer; the kernel reads none of it.
        let dkeys = if flat.is_empty() {
            self.alloc(OP, 1)?
        } else {
            self.upload(OP, &flat)?
        };
        let mut dout = self.alloc(OP, q.len())?;
        sparse_attention_sink_rows_f32(
            &self.rt,
            &dq,
            &dkeys,
            &dlists,
            &dsink,
            &mut dout,
            head_dim,
            scale,
            rounding(precision),
        )
        .map_err(op_err(OP))?;
        self.download(OP, &dout)
    }

    /// [`Backend::index_scores_rows_at`], with errors: `q [n, heads · head_dim]`, `weights
    /// [n, heads]`; query `t` scores the first `visible[t]` keys (at most all of them, as the
    /// trait's default clamps), one launch for all.
    #[allow(clippy::too_many_arguments)]
    pub fn try_index_scores_rows(
        &self,
        q: &[f32],
        weights: &[f32],
        keys: &[f32],
        head_dim: usize,
        visible: &[usize],
        precision: Precision,
    ) -> Result<Vec<Vec<f32>>, CudaBackendError> {
        const OP: &str = "index_scores_rows";
        let queries = visible.len();
        if queries == 0 {
            return Ok(Vec::new());
        }
        if head_dim == 0 || !keys.len().is_multiple_of(head_dim) {
            return Err(shape_err(
                OP,
                format!(
                    "keys ({} values) are not whole {head_dim}-wide keys",
                    keys.len()
                ),
            ));
        }
        if weights.is_empty() || !weights.len().is_multiple_of(queries) {
            return Err(shape_err(
                OP,
                format!(
                    "weights ({} values) are not {queries} queries of whole heads",
                    weights.len()
                ),
            ));
        }
        let heads = weights.len() / queries;
        if q.len() != queries * heads * head_dim {
            return Err(shape_err(
                OP,
                format!(
                    "q has {} values, expected {queries} queries of {heads} heads of {head_dim}",
                    q.len()
                ),
            ));
        }
        if queries > MAX_QUERIES_PER_INDEX_LAUNCH {
            return concat_chunks(
                visible
                    .chunks(MAX_QUERIES_PER_INDEX_LAUNCH)
                    .zip(q.chunks(MAX_QUERIES_PER_INDEX_LAUNCH * heads * head_dim))
                    .zip(weights.chunks(MAX_QUERIES_PER_INDEX_LAUNCH * heads))
                    .map(|((visible, q), w)| {
                        self.try_index_scores_rows(q, w, keys, head_dim, visible, precision)
                    }),
            );
        }
        let n_keys = keys.len() / head_dim;
        let seen: Vec<usize> = visible.iter().map(|&v| v.min(n_keys)).collect();
        let max_seen = seen.iter().copied().max().unwrap_or(0);
        if max_seen == 0 {
            return Ok(vec![Vec::new(); queries]);
        }
        let dvisible =
            DeviceVisiblePrefixes::upload(&self.rt, &seen, max_seen).map_err(op_err(OP))?;
        let dq = self.upload(OP, q)?;
        let dw = self.upload(OP, weights)?;
        let dkeys = self.upload(OP, &keys[..max_seen * head_dim])?;
        let mut dscores = self.alloc(OP, dvisible.total())?;
        index_scores_rows_f32(
            &self.rt,
            &dq,
            &dw,
            &dkeys,
            &dvisible,
            &mut dscores,
            heads,
            head_dim,
            rounding(precision),
        )
        .map_err(op_err(OP))?;
        let flat = self.download(OP, &dscores)?;
        let mut rest = flat.as_slice();
        Ok(seen
            .iter()
            .map(|&count| {
                let (scores, tail) = rest.split_at(count);
                rest = tail;
                scores.to_vec()
            })
            .collect())
    }
}

/// The results of consecutive row chunks (calls longer than one launch's grid takes), joined.
fn concat_chunks<T>(
    chunks: impl Iterator<Item = Result<Vec<T>, CudaBackendError>>,
) -> Result<Vec<T>, CudaBackendError> {
    let mut joined = Vec::new();
    for chunk in chunks {
        joined.extend(chunk?);
    }
    Ok(joined)
}

/// The kernels' rounding for a model precision.
fn rounding(precision: Precision) -> Rounding {
    match precision {
        Precision::Bf16 => Rounding::Bf16,
        Precision::F32 => Rounding::F32,
    }
}

/// A device failure inside a [`Backend`] method, which has no error channel (module header).
fn device_fault<T>(err: CudaBackendError) -> T {
    panic!("{err}")
}

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn gemm_fp8(&self, x: &[f32], w: &Fp8Weight) -> Vec<f32> {
        self.try_gemm_fp8(x, w).unwrap_or_else(device_fault)
    }

    fn gemm_fp4(&self, x: &[f32], w: &Fp4Weight) -> Vec<f32> {
        self.try_gemm_fp4(x, w).unwrap_or_else(device_fault)
    }

    fn linear_bf16(&self, x: &[f32], w: &[f32], out: usize, inp: usize) -> Vec<f32> {
        self.try_linear(x, w, out, inp, Rounding::Bf16)
            .unwrap_or_else(device_fault)
    }

    fn linear_f32(&self, x: &[f32], w: &[f32], out: usize, inp: usize) -> Vec<f32> {
        self.try_linear(x, w, out, inp, Rounding::F32)
            .unwrap_or_else(device_fault)
    }

    fn linear_fp8_f32(&self, x: &[f32], w: &Fp8Weight) -> Vec<f32> {
        self.try_linear_fp8_f32(x, w).unwrap_or_else(device_fault)
    }

    fn linear_fp4_f32(&self, x: &[f32], w: &Fp4Weight) -> Vec<f32> {
        self.try_linear_fp4_f32(x, w).unwrap_or_else(device_fault)
    }

    fn rms_norm_at(&self, x: &[f32], weight: &[f32], eps: f32, precision: Precision) -> Vec<f32> {
        self.try_rms_norm(x, weight, eps, precision)
            .unwrap_or_else(device_fault)
    }

    fn rope_at(
        &self,
        x: &mut [f32],
        stride: usize,
        vectors_per_row: usize,
        positions: &[usize],
        table: &RopeTable,
        inverse: bool,
        precision: Precision,
    ) {
        self.try_rope(
            x,
            stride,
            vectors_per_row,
            positions,
            table,
            inverse,
            precision,
        )
        .unwrap_or_else(device_fault)
    }

    fn q8_qdq(&self, x: &mut [f32]) {
        self.try_qdq(x, QdqPoint::Q8).unwrap_or_else(device_fault)
    }

    fn q4e_qdq(&self, x: &mut [f32]) {
        self.try_qdq(x, QdqPoint::Q4e).unwrap_or_else(device_fault)
    }

    fn q4m_qdq(&self, x: &mut [f32]) {
        self.try_qdq(x, QdqPoint::Q4m).unwrap_or_else(device_fault)
    }

    fn sparse_attention_at(
        &self,
        q: &[f32],
        keys: &[&[f32]],
        sink: &[f32],
        scale: f32,
        precision: Precision,
    ) -> Vec<f32> {
        self.try_sparse_attention(q, keys, sink, scale, precision)
            .unwrap_or_else(device_fault)
    }

    fn hc_mixes(
        &self,
        x: &[f32],
        params: &HcParams,
        hc: usize,
        sinkhorn_iters: usize,
        hc_eps: f32,
        norm_eps: f32,
    ) -> HcMix {
        self.try_hc_mixes(x, params, hc, sinkhorn_iters, hc_eps, norm_eps)
            .unwrap_or_else(device_fault)
    }

    fn hc_collapse_at(&self, x: &[f32], weights: &[f32], precision: Precision) -> Vec<f32> {
        self.try_hc_collapse(x, weights, precision)
            .unwrap_or_else(device_fault)
    }

    fn hc_expand_at(
        &self,
        y: &[f32],
        residual: &[f32],
        mix: &HcMix,
        precision: Precision,
    ) -> Vec<f32> {
        self.try_hc_expand(y, residual, mix, precision)
            .unwrap_or_else(device_fault)
    }

    fn index_scores_at(
        &self,
        q: &[f32],
        weights: &[f32],
        keys: &[f32],
        head_dim: usize,
        precision: Precision,
    ) -> Vec<f32> {
        self.try_index_scores(q, weights, keys, head_dim, precision)
            .unwrap_or_else(device_fault)
    }

    fn hc_mixes_rows(
        &self,
        x: &[f32],
        params: &HcParams,
        hc: usize,
        sinkhorn_iters: usize,
        hc_eps: f32,
        norm_eps: f32,
    ) -> Vec<HcMix> {
        self.try_hc_mixes_rows(x, params, hc, sinkhorn_iters, hc_eps, norm_eps)
            .unwrap_or_else(device_fault)
    }

    fn hc_collapse_rows_at(
        &self,
        x: &[f32],
        weights: &[f32],
        hc: usize,
        precision: Precision,
    ) -> Vec<f32> {
        self.try_hc_collapse_rows(x, weights, hc, precision)
            .unwrap_or_else(device_fault)
    }

    fn hc_expand_rows_at(
        &self,
        y: &[f32],
        residual: &[f32],
        mixes: &[HcMix],
        precision: Precision,
    ) -> Vec<f32> {
        self.try_hc_expand_rows(y, residual, mixes, precision)
            .unwrap_or_else(device_fault)
    }

    fn sparse_attention_rows_at(
        &self,
        q: &[f32],
        keys: &[Vec<&[f32]>],
        sink: &[f32],
        scale: f32,
        precision: Precision,
    ) -> Vec<f32> {
        self.try_sparse_attention_rows(q, keys, sink, scale, precision)
            .unwrap_or_else(device_fault)
    }

    fn index_scores_rows_at(
        &self,
        q: &[f32],
        weights: &[f32],
        keys: &[f32],
        head_dim: usize,
        visible: &[usize],
        precision: Precision,
    ) -> Vec<Vec<f32>> {
        self.try_index_scores_rows(q, weights, keys, head_dim, visible, precision)
            .unwrap_or_else(device_fault)
    }

    fn sample_rows(
        &self,
        logits: &[f32],
        vocab: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError> {
        check_sample_rows(logits, vocab, rows)?;
        Ok(self
            .try_sample_rows(logits, vocab, rows)
            .unwrap_or_else(device_fault))
    }

    fn sample_linear(
        &self,
        x: &[f32],
        w: &[f32],
        out: usize,
        inp: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError> {
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
        Ok(self
            .try_sample_linear(x, w, out, inp, rows)
            .unwrap_or_else(device_fault))
    }

    fn route_experts(
        &self,
        logits: &[f32],
        bias: &[f32],
        selection: ExpertSelection<'_>,
        route_scale: f32,
    ) -> Vec<ExpertRoute> {
        self.try_route_experts(logits, bias, selection, route_scale)
            .unwrap_or_else(device_fault)
    }

    fn engram_hash(&self, hasher: &NgramHasher, contexts: &[u64]) -> Vec<u32> {
        self.try_engram_hash(hasher, contexts)
            .unwrap_or_else(device_fault)
    }

    fn engram_gather(&self, table: &EngramTable, row_ids: &[u32]) -> Vec<f32> {
        self.try_engram_gather(table, row_ids)
            .unwrap_or_else(device_fault)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let opened = std::panic::catch_unwind(|| CudaBackend::open(0).map(|_| ()));
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
