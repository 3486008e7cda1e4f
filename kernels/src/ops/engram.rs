//! Engram on the device: hashing of n-gram contexts into table row ids and the FP8 table lookup
//! (`deepinfer_model::engram`'s `NgramHasher::rows_of_contexts` and `EngramTable::gather`),
//! bit-exact, one thread per output element.
//!
//! Tables live in device memory ([`DeviceEngramTable`], uploaded once). The released model's
//! tables fit an H200 many times over; a table too large for device memory would be placed in
//! pinned, device-mapped host memory instead (`cuMemHostAlloc` with `DEVICEMAP`) and read by the
//! same gather kernel through its device pointer, each lookup then crossing PCIe/NVLink-C2C.

use cudarc::driver::CudaSlice;

use super::{dim, ensure, expect_len, launch_config, whole_rows};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::{KernelRuntime, KernelValue};

const THREADS: u32 = 256;
/// Channels per table scale.
pub const SCALE_GROUP: usize = 32;

/// `engram::HashParams` in `cuda/engram/engram.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HashParams {
    tokens: u32,
    layers: u32,
    max_ngram: u32,
    columns: u32,
    heads: u32,
}

/// `engram::GatherParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GatherParams {
    ids: u32,
    table_rows: u32,
    head_dim: u32,
}

// SAFETY: plain `#[repr(C)]` structs of integers, laid out as their CUDA mirrors.
unsafe impl KernelValue for HashParams {}
// SAFETY: as above.
unsafe impl KernelValue for GatherParams {}

/// The hashing parameters on the device: `[layers, max_ngram]` multipliers and
/// `[layers, columns]` primes and offsets.
pub struct DeviceEngramHasher {
    pub layers: usize,
    pub max_ngram: usize,
    pub columns: usize,
    multipliers: CudaSlice<u64>,
    primes: CudaSlice<u64>,
    offsets: CudaSlice<u64>,
}

impl DeviceEngramHasher {
    /// Uploads flat `multipliers [layers · max_ngram]`, `primes` and `offsets [layers · columns]`.
    pub fn upload(
        rt: &KernelRuntime,
        max_ngram: usize,
        multipliers: &[u64],
        primes: &[u64],
        offsets: &[u64],
    ) -> Result<DeviceEngramHasher, KernelError> {
        const OP: &str = "DeviceEngramHasher::upload";
        ensure(
            max_ngram >= 2
                && !multipliers.is_empty()
                && multipliers.len().is_multiple_of(max_ngram),
            OP,
            || {
                format!(
                    "{} multipliers are not whole layers of max_ngram = {max_ngram} (>= 2)",
                    multipliers.len()
                )
            },
        )?;
        let layers = multipliers.len() / max_ngram;
        let columns = primes.len() / layers;
        ensure(
            columns != 0 && columns.is_multiple_of(max_ngram - 1),
            OP,
            || {
                format!(
                    "{} primes over {layers} layers are not whole heads of {} n-gram sizes",
                    primes.len(),
                    max_ngram - 1
                )
            },
        )?;
        expect_len(OP, "primes", primes.len(), layers * columns)?;
        expect_len(OP, "offsets", offsets.len(), layers * columns)?;
        ensure(!primes.contains(&0), OP, || "a bucket modulus is 0")?;
        let upload = |values: &[u64]| {
            rt.htod(values).map_err(KernelError::driver(
                "uploading the engram hashing parameters",
            ))
        };
        Ok(DeviceEngramHasher {
            layers,
            max_ngram,
            columns,
            multipliers: upload(multipliers)?,
            primes: upload(primes)?,
            offsets: upload(offsets)?,
        })
    }
}

/// `rows [tokens, layers, columns]` of `contexts [tokens, max_ngram]`.
pub fn engram_hash_rows(
    rt: &KernelRuntime,
    hasher: &DeviceEngramHasher,
    contexts: &CudaSlice<u64>,
    rows: &mut CudaSlice<u32>,
) -> Result<(), KernelError> {
    const OP: &str = "engram_hash_rows";
    let tokens = whole_rows(OP, contexts.len(), hasher.max_ngram, || {
        format!(
            "{} context ids are not whole contexts of {}",
            contexts.len(),
            hasher.max_ngram
        )
    })?;
    let total = tokens * hasher.layers * hasher.columns;
    expect_len(OP, "rows", rows.len(), total)?;
    if total == 0 {
        return Ok(());
    }
    let params = HashParams {
        tokens: dim(OP, "tokens", tokens)?,
        layers: dim(OP, "layers", hasher.layers)?,
        max_ngram: dim(OP, "max_ngram", hasher.max_ngram)?,
        columns: dim(OP, "columns", hasher.columns)?,
        heads: dim(OP, "heads", hasher.columns / (hasher.max_ngram - 1))?,
    };
    let cfg = launch_config(
        (dim(OP, "blocks", total.div_ceil(THREADS as usize))?, 1, 1),
        THREADS,
        0,
    );
    let mut launch = rt.launcher(KernelId::EngramHashRows)?;
    launch
        .arg(contexts)
        .arg(&hasher.multipliers)
        .arg(&hasher.primes)
        .arg(&hasher.offsets)
        .arg(rows)
        .arg(&params);
    // SAFETY: signature (const u64* contexts, const u64* multipliers, const u64* primes,
    // const u64* offsets, u32* rows, HashParams); lengths checked here and at upload.
    unsafe { launch.launch(cfg) }
}

/// An Engram table in device memory: `[rows, head_dim]` E4M3 codes, `[rows, head_dim / 32]`
/// UE8M0 scales.
pub struct DeviceEngramTable {
    pub rows: usize,
    pub head_dim: usize,
    codes: CudaSlice<u8>,
    scales: CudaSlice<u8>,
}

impl DeviceEngramTable {
    /// Uploads a table (see the module header for tables that do not fit).
    pub fn upload(
        rt: &KernelRuntime,
        rows: usize,
        head_dim: usize,
        codes: &[u8],
        scales: &[u8],
    ) -> Result<DeviceEngramTable, KernelError> {
        const OP: &str = "DeviceEngramTable::upload";
        ensure(
            head_dim != 0 && head_dim.is_multiple_of(SCALE_GROUP),
            OP,
            || format!("head_dim {head_dim} is not a positive multiple of {SCALE_GROUP}"),
        )?;
        expect_len(OP, "codes", codes.len(), rows * head_dim)?;
        expect_len(OP, "scales", scales.len(), rows * head_dim / SCALE_GROUP)?;
        let stream = rt.stream();
        let upload = |bytes: &[u8]| {
            if bytes.is_empty() {
                // Stays zeroed: a one-time placeholder of an empty table (never launched over).
                stream.alloc_zeros::<u8>(1)
            } else {
                rt.htod(bytes)
            }
            .map_err(KernelError::driver("uploading an engram table"))
        };
        Ok(DeviceEngramTable {
            rows,
            head_dim,
            codes: upload(codes)?,
            scales: upload(scales)?,
        })
    }
}

/// `out [ids, head_dim]` = the bf16 rows `ids` of `table` (ids outside it: zeros).
pub fn engram_gather_f32(
    rt: &KernelRuntime,
    table: &DeviceEngramTable,
    ids: &CudaSlice<u32>,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "engram_gather_f32";
    let total = ids.len() * table.head_dim;
    expect_len(OP, "out", out.len(), total)?;
    if total == 0 {
        return Ok(());
    }
    let params = GatherParams {
        ids: dim(OP, "ids", ids.len())?,
        table_rows: dim(OP, "table rows", table.rows)?,
        head_dim: dim(OP, "head_dim", table.head_dim)?,
    };
    let cfg = launch_config(
        (dim(OP, "blocks", total.div_ceil(THREADS as usize))?, 1, 1),
        THREADS,
        0,
    );
    let mut launch = rt.launcher(KernelId::EngramGatherF32)?;
    launch
        .arg(&table.codes)
        .arg(&table.scales)
        .arg(ids)
        .arg(out)
        .arg(&params);
    // SAFETY: signature (const u8* codes, const u8* scales, const u32* ids, float* out,
    // GatherParams); lengths checked here and at upload; ids beyond the table are not read.
    unsafe { launch.launch(cfg) }
}

#[cfg(test)]
mod tests {
    use super::super::assert_mirrors;
    use super::*;

    #[test]
    fn params_mirror_the_cuda_structs() {
        let header = include_str!("../../cuda/engram/engram.cuh");
        assert_mirrors::<HashParams>(
            header,
            20,
            &["tokens", "layers", "max_ngram", "columns", "heads"],
        );
        assert_mirrors::<GatherParams>(header, 12, &["ids", "table_rows", "head_dim"]);
    }
}
