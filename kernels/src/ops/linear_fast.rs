//! The `fast` linears `y = x · Wᵀ` of a bf16 weight on tensor cores (mma.sync m16n8k16, bf16
//! operands, fp32 accumulation; `cuda/linear/linear_fast.cuh`), by [`FastProduct`]:
//! - [`FastProduct::Bf16`], `x` rounded to bf16: the V4.1 linears the reference runs in bf16
//!   (`Backend::linear_bf16`, `Backend::linear_grouped_bf16`: the grouped `wo_a`, the compressor
//!   and indexer projections) and V4's dense projections (`Backend::linear`, f32 outputs; V4's
//!   float32 activations rounded to bf16 on the way in);
//! - [`FastProduct::SplitBf16x3`], the split-x bf16x3 product: `x` split exactly into three bf16
//!   pieces `x = x₁ + x₂ + x₃` (`x₁ = bf16(x)`, `x₂ = bf16(x − x₁)`, `x₃ = bf16(x − x₁ − x₂)`),
//!   three mma per step (`x₃ w`, `x₂ w`, then `x₁ w` on one accumulator) — `Backend::linear_f32`
//!   (V4.1's router gate, the compressor's `wkv` and `wgate`, heads: fp32 in the reference, its
//!   bf16 weights promoted) with fp32-level accuracy, for weights whose values are bf16.
//!
//! Both are one kernel body (the pieces a template parameter). Not bitwise equal to the CPU's
//! sgemm order, but deterministic and batch invariant: K is cut into [`PARTS`] parts by `inp`
//! alone, each summed in K order, the parts added in order, and the tile chosen by the shape
//! ([`FastLinearTile`]: three decode tiles, a wide prefill tile and its one-part form) never changes an output's
//! arithmetic. A grouped weight ([`FastBf16Weight::upload_grouped`]: `wo_a`'s 8 groups) runs its
//! groups as independent linears in one launch (grid z), each group bitwise its linear alone.
//!
//! Error bounds against the exact value `y` (f64) — what the GPU tests assert. The tensor core's
//! model: the products of bf16 values are exact in fp32, and an mma adds 16 of them to its fp32
//! accumulator within `17 · 2^-23` of the magnitudes it adds (every addend aligned to the
//! largest and cut to fp32 precision, 16 of the 17 losing less than `2^-23` of the largest, and
//! the result's normalisation as much of their sum; NVIDIA documents no more).
//! - [`FastProduct::Bf16`], `y` of the bf16 operands, `S = Σ_k |x_k w_k|`: `⌈K / 16⌉` mma, each
//!   within `17 · 2^-23 · S`, each of the `PARTS − 1` part additions rounds once (`2^-24`), so
//!   `|ŷ − y| ≤ e` with `e = (17 · ⌈K / 16⌉ + PARTS) · 2^-23 · S`, and the bf16 output adds
//!   `2^-8 (|y| + e)`.
//! - [`FastProduct::SplitBf16x3`], `y` of the f32 `x` and the bf16 `w`, `S = Σ_k |x_k w_k|`:
//!   the split is exact (`x` has 24 significant bits, each piece takes the next 8 of what is left
//!   and each difference is exact in fp32) for `x_k`, `w_k` and `x_k w_k` in `[2^-100, 2^100]` or
//!   zero, where every piece and piece product stays a normal fp32 (below that, bf16's subnormals
//!   drop bits of `x₂`, `x₃`). With `T = Σ_k (|x₁| + |x₂| + |x₃|) |w_k| ≤ (1 + 2^-6) S`, part p
//!   runs `n ≤ 6 ⌈K / 256⌉` mma (2 steps × 3 pieces per 32-element chunk, at most
//!   `⌈⌈K / 32⌉ / PARTS⌉` chunks a part) on an accumulator bounded by its sum so far, `T_p`
//!   (`1 + 17 n 2^-23 ≤ 1.01` for K ≤ 65 536), so its error is at most
//!   `17 · 2^-23 · n · 1.01 · T_p`; the `PARTS − 1` part additions round once each
//!   (`2^-24 · 1.02 T`). Summed over the parts, `|ŷ − y| ≤ e` with
//!   `e = (105 · ⌈K / 256⌉ + 5) · 2^-23 · S` — about `0.41 · K · 2^-23 · S`, while rounding `x`
//!   to bf16 alone may cost `2^-9 S` (x = 1 + 3 · 2^-9 → 1 + 2^-7).

use cudarc::driver::CudaSlice;
use half::bf16;

use super::{Rounding, dim, ensure, expect_len, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::{LinearParams, LinearReduceParams};
use crate::runtime::KernelRuntime;

const OP: &str = "linear_bf16_fast";
/// K parts (warps per block); must match `linear_fast::PARTS`.
pub const PARTS: usize = 8;
/// K elements per chunk (weight rows are padded to a multiple); `linear_fast::CHUNK`.
const CHUNK: usize = 32;
/// Largest `inp`.
const MAX_INP: usize = 65_536;
/// The grid's y limit (row tiles of one launch).
const MAX_GRID_Y: usize = 65_535;
/// The grid's z limit (groups of one launch).
const MAX_GROUPS: usize = 65_535;

/// A bf16 weight `[out, inp]` on the device for [`linear_bf16_fast`]: rows padded with zeros to
/// a multiple of 32 elements (16-byte aligned chunks). With `groups > 1` it is `groups`
/// independent weights of `out / groups` rows each: group `g` maps columns
/// `[g · inp, (g + 1) · inp)` of the input to columns `[g · out / groups, (g + 1) · out / groups)`
/// of the output.
pub struct FastBf16Weight {
    /// `out` rows of `inp.div_ceil(32) · 32` bf16 values.
    pub codes: CudaSlice<bf16>,
    pub out: usize,
    pub inp: usize,
    pub groups: usize,
}

impl FastBf16Weight {
    /// Uploads `w [out, inp]` (f32 storage of bf16 values: rounded to nearest, exact for them).
    pub fn upload(
        rt: &KernelRuntime,
        out: usize,
        inp: usize,
        w: &[f32],
    ) -> Result<FastBf16Weight, KernelError> {
        FastBf16Weight::upload_grouped(rt, 1, out, inp, w)
    }

    /// Uploads `groups` weights `[out / groups, inp]`, one after the other in `w [out, inp]`.
    pub fn upload_grouped(
        rt: &KernelRuntime,
        groups: usize,
        out: usize,
        inp: usize,
        w: &[f32],
    ) -> Result<FastBf16Weight, KernelError> {
        ensure(inp != 0 && inp <= MAX_INP, OP, || {
            format!("inp = {inp} must be in 1..={MAX_INP}")
        })?;
        ensure(
            groups != 0 && out.is_multiple_of(groups) && groups <= MAX_GROUPS,
            OP,
            || format!("{groups} groups must divide out = {out} (at most {MAX_GROUPS} groups)"),
        )?;
        expect_len(OP, "w", w.len(), out * inp)?;
        let stride = inp.div_ceil(CHUNK) * CHUNK;
        let mut codes = vec![bf16::ZERO; out * stride];
        for (padded, row) in codes.chunks_exact_mut(stride).zip(w.chunks_exact(inp)) {
            for (code, &v) in padded.iter_mut().zip(row) {
                *code = bf16::from_f32(v);
            }
        }
        let codes = rt
            .htod(&codes)
            .map_err(KernelError::driver("uploading a fast bf16 weight"))?;
        Ok(FastBf16Weight {
            codes,
            out,
            inp,
            groups,
        })
    }
}

/// Whether every value is a bf16 value (f32 storage whose low 16 bits are zero): the weights the
/// split-x bf16x3 product computes in fp32 accuracy ([`FastBf16Weight::upload`] would round any
/// other).
pub fn exactly_bf16(values: &[f32]) -> bool {
    values.iter().all(|v| v.to_bits() & 0xffff == 0)
}

/// How [`linear_bf16_fast`] takes `x` (f32 storage) onto the tensor cores, and its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastProduct {
    /// `x` rounded to bf16 (nearest even: exact for bf16 values); the fp32 sum rounded to bf16
    /// when [`Rounding::Bf16`], else as it is.
    Bf16(Rounding),
    /// `x` split exactly into three bf16 pieces (module doc); the fp32 sum as it is.
    SplitBf16x3,
}

impl FastProduct {
    /// The bf16 pieces `x` takes onto the tensor cores (the kernels' `PIECES`).
    const fn pieces(self) -> u32 {
        match self {
            FastProduct::Bf16(_) => 1,
            FastProduct::SplitBf16x3 => 3,
        }
    }

    /// The rounding of the outputs.
    fn output(self) -> Rounding {
        match self {
            FastProduct::Bf16(output) => output,
            FastProduct::SplitBf16x3 => Rounding::F32,
        }
    }
}

/// A tile of [`linear_bf16_fast`]; every tile gives the same bits (`cuda/linear/linear_fast.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastLinearTile {
    /// Decode: 8 warps on one 16 × 8 mma tile, warp `p` summing K part `p`.
    T1x1,
    /// Decode: 8 warps on 2 × 2 mma tiles (32 rows × 16 columns).
    T2x2,
    /// 8 warps on 4 × 2 mma tiles (64 rows × 16 columns): many small blocks, for shapes too
    /// narrow to fill the device with wide blocks.
    T4x2,
    /// Prefill: 128 rows × 256 columns a block, each warp 32 × 128 of them over all of K, the
    /// chunks staged in shared memory ([`wide_shared_bytes`]).
    Wide,
    /// Prefill with too few wide blocks to fill the device (a narrow output: the router's 384):
    /// the wide block over one of the [`PARTS`] K parts (grid z: group × part, no running
    /// totals), its part's sums to a buffer that `linear_fast_reduce` adds in part order: the
    /// additions of the wide tile's running total.
    WidePart,
}

/// Dynamic shared memory of the wide tile with x in `pieces` bf16 pieces, over every K part or
/// one (`linear_fast::wide_shared_bytes<PIECES, ONE_PART>`): the running totals (128 f32 a
/// thread, 256 threads; not over one part), then 2 stage buffers of 2 chunks (the bf16 product)
/// or 1 (the split-x product, whose 3 pieces take the second chunk's room), a chunk being x's
/// pieces (128 rows of 32 bf16 each) and 256 weight rows of 32 bf16.
pub const fn wide_shared_bytes(pieces: u32, one_part: bool) -> u32 {
    let totals = if one_part { 0 } else { 128 * 4 * 256 };
    let stage_chunks = if pieces == 1 { 2 } else { 1 };
    totals + 2 * stage_chunks * (pieces * 128 * 32 * 2 + 256 * 32 * 2)
}
/// The wide tile needs about a wave of blocks (row tiles × column tiles × groups) to be taken: a
/// multiprocessor holds one wide block (its 208 or 224 KiB of shared memory and 255 registers a
/// thread), and below a wave its one-part form's 8 blocks a wide block fill more of them. About:
/// a wave less a 32nd of it (128 blocks on the H100's and H200's 132 multiprocessors).
const fn wide_min_blocks(sms: usize) -> usize {
    sms - sms / 32
}
/// The one-part wide tile needs this many blocks (× [`PARTS`]) to be taken: below,
/// [`FastLinearTile::T4x2`]'s many blocks use more of the device.
const WIDE_PART_MIN_BLOCKS: usize = 32;
/// Threads per block of the part reduction.
const REDUCE_THREADS: u32 = 256;
const _: () = assert!(
    wide_shared_bytes(1, false) <= 227 * 1024 && wide_shared_bytes(3, false) <= 227 * 1024,
    "a block's shared memory on sm_90 and sm_100"
);

impl FastLinearTile {
    pub const ALL: [FastLinearTile; 5] = [
        FastLinearTile::T1x1,
        FastLinearTile::T2x2,
        FastLinearTile::T4x2,
        FastLinearTile::Wide,
        FastLinearTile::WidePart,
    ];

    fn kernel(self, product: FastProduct) -> KernelId {
        match (product, self) {
            (FastProduct::Bf16(_), FastLinearTile::T1x1) => KernelId::LinearBf16FastT1x1,
            (FastProduct::Bf16(_), FastLinearTile::T2x2) => KernelId::LinearBf16FastT2x2,
            (FastProduct::Bf16(_), FastLinearTile::T4x2) => KernelId::LinearBf16FastT4x2,
            (FastProduct::Bf16(_), FastLinearTile::Wide) => KernelId::LinearBf16FastWide,
            (FastProduct::Bf16(_), FastLinearTile::WidePart) => KernelId::LinearBf16FastWidePart,
            (FastProduct::SplitBf16x3, FastLinearTile::T1x1) => KernelId::LinearBf16x3FastT1x1,
            (FastProduct::SplitBf16x3, FastLinearTile::T2x2) => KernelId::LinearBf16x3FastT2x2,
            (FastProduct::SplitBf16x3, FastLinearTile::T4x2) => KernelId::LinearBf16x3FastT4x2,
            (FastProduct::SplitBf16x3, FastLinearTile::Wide) => KernelId::LinearBf16x3FastWide,
            (FastProduct::SplitBf16x3, FastLinearTile::WidePart) => {
                KernelId::LinearBf16x3FastWidePart
            }
        }
    }

    /// The outputs of a block: (rows, columns).
    fn block(self) -> (usize, usize) {
        match self {
            FastLinearTile::T1x1 => (16, 8),
            FastLinearTile::T2x2 => (32, 16),
            FastLinearTile::T4x2 => (64, 16),
            FastLinearTile::Wide | FastLinearTile::WidePart => (128, 256),
        }
    }

    fn shared_bytes(self, product: FastProduct) -> u32 {
        match self {
            FastLinearTile::Wide => wide_shared_bytes(product.pieces(), false),
            FastLinearTile::WidePart => wide_shared_bytes(product.pieces(), true),
            _ => 0,
        }
    }

    /// The tile for `rows` rows of `groups` groups of `out` outputs each: by rows (more rows
    /// share each weight load as they grow), the wide tile once it makes enough blocks, else
    /// its one-part form (a block per part) from a full row tile on, once that does.
    fn choose(rows: usize, out: usize, groups: usize, sms: usize) -> FastLinearTile {
        let (wide_rows, wide_cols) = FastLinearTile::Wide.block();
        let wide_blocks = rows.div_ceil(wide_rows) * out.div_ceil(wide_cols) * groups;
        match rows {
            0..=16 => FastLinearTile::T1x1,
            17..=64 => FastLinearTile::T2x2,
            _ if wide_blocks >= wide_min_blocks(sms) => FastLinearTile::Wide,
            _ if rows >= wide_rows && wide_blocks * PARTS >= WIDE_PART_MIN_BLOCKS => {
                FastLinearTile::WidePart
            }
            _ => FastLinearTile::T4x2,
        }
    }
}

/// The dynamic shared memory kernel `id` needs, if it is a wide tile (`None` otherwise).
pub(crate) fn dynamic_shared_bytes(id: KernelId) -> Option<u32> {
    match id {
        KernelId::LinearBf16FastWide => Some(wide_shared_bytes(1, false)),
        KernelId::LinearBf16x3FastWide => Some(wide_shared_bytes(3, false)),
        KernelId::LinearBf16FastWidePart => Some(wide_shared_bytes(1, true)),
        KernelId::LinearBf16x3FastWidePart => Some(wide_shared_bytes(3, true)),
        _ => None,
    }
}

/// `y [rows, w.out] = x [rows, w.groups · w.inp] · wᵀ`, group by group (f32 storage), `x` taken
/// onto the tensor cores and `y` rounded as `product` says, with `tile` (`None` in production:
/// chosen by the shape; every tile gives the same bits).
pub fn linear_bf16_fast(
    rt: &KernelRuntime,
    x: &CudaSlice<f32>,
    w: &FastBf16Weight,
    y: &mut CudaSlice<f32>,
    rows: usize,
    tile: Option<FastLinearTile>,
    product: FastProduct,
) -> Result<(), KernelError> {
    let (x_width, group_out) = (w.groups * w.inp, w.out / w.groups);
    let tile = tile.unwrap_or_else(|| {
        FastLinearTile::choose(rows, group_out, w.groups, rt.multiprocessors())
    });
    expect_len(OP, "x", x.len(), rows * x_width)?;
    expect_len(OP, "y", y.len(), rows * w.out)?;
    if rows == 0 || w.out == 0 {
        return Ok(());
    }
    let (tile_rows, tile_cols) = tile.block();
    let one_part = tile == FastLinearTile::WidePart;
    let chunk_rows = MAX_GRID_Y * tile_rows;
    for first in (0..rows).step_by(chunk_rows) {
        let count = chunk_rows.min(rows - first);
        let params = LinearParams {
            rows: dim(OP, "rows", count)?,
            out: dim(OP, "out", group_out)?,
            inp: dim(OP, "inp", w.inp)?,
            round_bf16: product.output().flag(),
        };
        let x_rows = x.slice(first * x_width..(first + count) * x_width);
        let mut y_rows = y.slice_mut(first * w.out..(first + count) * w.out);
        let z = if one_part { w.groups * PARTS } else { w.groups };
        ensure(z <= MAX_GROUPS, OP, || {
            format!("{} groups × {PARTS} parts (> {MAX_GROUPS})", w.groups)
        })?;
        let grid = launch_config(
            (
                dim(OP, "column tiles", group_out.div_ceil(tile_cols))?,
                dim(OP, "row tiles", count.div_ceil(tile_rows))?,
                dim(OP, "grid z", z)?,
            ),
            (32 * PARTS) as u32,
            tile.shared_bytes(product),
        );
        // The one-part tile's part sums, [PARTS][count][w.out].
        let outputs = count * w.out;
        // SAFETY: the one-part launch writes every part's sum of every row < count and column <
        // w.out (grid: every column and row tile of every group and part) before the reduction
        // reads them, in stream order; other tiles never allocate it.
        let mut partials = if one_part {
            Some(unsafe { rt.alloc_written::<f32>(PARTS * outputs) }.map_err(
                KernelError::driver("allocating the fast linear's part sums"),
            )?)
        } else {
            None
        };
        let mut launch = rt.launcher(tile.kernel(product))?;
        launch.arg(&x_rows).arg(&w.codes);
        match partials.as_mut() {
            Some(partials) => launch.arg(partials),
            None => launch.arg(&mut y_rows),
        };
        launch.arg(&params);
        // SAFETY: signature (const float* x, const uint4* w, float* y, LinearParams), the
        // one-part tile's float* partials in y's place; x holds params.rows * groups * inp
        // values and y params.rows * groups * params.out (checked above; grid.z = groups, the
        // one-part tile's groups * PARTS), partials PARTS times y's; w holds groups * params.out
        // rows of inp.div_ceil(32) * 32 bf16 (FastBf16Weight::upload_grouped), read 16 bytes at
        // a time from 16-byte aligned chunks (the allocation is aligned, a row is a multiple of
        // 64 bytes); x is read 16 bytes at a time only when inp is a multiple of 4 (a row chunk
        // starts at a multiple of groups * inp values: 16-byte aligned); the kernel
        // bounds-checks rows, columns and k against params and offsets each group by them; the
        // wide tiles' dynamic shared memory is allowed at load (`dynamic_shared_bytes`).
        unsafe { launch.launch(grid) }?;
        if let Some(partials) = &partials {
            reduce_parts(rt, partials, &mut y_rows, outputs, product)?;
        }
    }
    Ok(())
}

/// `y[i] = ((partials[0][i] + partials[1][i]) + …) + partials[PARTS − 1][i]` for `i < count`,
/// rounded as `product` says (`linear_fast_reduce`).
fn reduce_parts(
    rt: &KernelRuntime,
    partials: &CudaSlice<f32>,
    y: &mut cudarc::driver::CudaViewMut<'_, f32>,
    count: usize,
    product: FastProduct,
) -> Result<(), KernelError> {
    let params = LinearReduceParams {
        count: dim(OP, "outputs", count)?,
        round_bf16: product.output().flag(),
    };
    let cfg = launch_config(
        (params.count.div_ceil(REDUCE_THREADS).min(1 << 16), 1, 1),
        REDUCE_THREADS,
        0,
    );
    let mut launch = rt.launcher(KernelId::LinearFastReduce)?;
    launch.arg(partials).arg(y).arg(&params);
    // SAFETY: signature (const float* partials, float* y, LinearReduceParams); partials holds
    // PARTS * count values (allocated so by the caller), y count (rows * w.out); the kernel
    // strides over i < count.
    unsafe { launch.launch(cfg) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H100's and H200's multiprocessors, where the tile rules were measured.
    const H200_SMS: usize = 132;

    #[test]
    fn decode_rows_take_the_decode_tiles() {
        for (rows, tile) in [
            (1, FastLinearTile::T1x1),
            (16, FastLinearTile::T1x1),
            (17, FastLinearTile::T2x2),
            (64, FastLinearTile::T2x2),
        ] {
            // Even where wide blocks would fill the device.
            assert_eq!(
                FastLinearTile::choose(rows, 8192, 8, H200_SMS),
                tile,
                "{rows} rows"
            );
        }
    }

    #[test]
    fn prefill_takes_the_wide_tile_once_it_makes_enough_blocks() {
        use FastLinearTile::{T4x2, Wide, WidePart};
        for (rows, out, groups, tile) in [
            // The grouped wo_a (8 groups of 1024 outputs, 4 column tiles a group): 32 wide
            // blocks a row tile, a wave from 4 row tiles on; from one full row tile until then
            // the one-part tile (256 blocks at 128 rows, where 32 wide blocks left 100
            // multiprocessors idle); less than a row tile keeps the many small blocks.
            (65, 1024, 8, T4x2),
            (127, 1024, 8, T4x2),
            (128, 1024, 8, WidePart),
            (384, 1024, 8, WidePart),
            (385, 1024, 8, Wide),
            (1024, 1024, 8, Wide),
            (4096, 1024, 8, Wide),
            // One group of 1024 outputs: the wide tile from 32 row tiles (3969 rows) on.
            (896, 1024, 1, WidePart),
            (3968, 1024, 1, WidePart),
            (3969, 1024, 1, Wide),
            // Narrow outputs (the 1024-token prefill's router, 384 outputs: 16 wide blocks) take
            // the one-part tile from 4 row tiles (32 one-part blocks) on.
            (1024, 384, 1, WidePart),
            (1024, 256, 1, WidePart),
            (385, 256, 1, WidePart),
            (384, 256, 1, T4x2),
            (4096, 256, 1, WidePart),
            (16384, 256, 1, Wide),
            (65, 7168, 1, T4x2),
            (127, 7168, 1, T4x2),
            (128, 7168, 1, WidePart),
            (512, 7168, 1, WidePart),
            (513, 7168, 1, Wide),
        ] {
            assert_eq!(
                FastLinearTile::choose(rows, out, groups, H200_SMS),
                tile,
                "{rows} rows of {groups} x {out}"
            );
        }
        // A wave is the device's: on 148 multiprocessors (a B200) the grouped wo_a's 128 wide
        // blocks at 385 rows are short of one (144), 160 at 513 rows are not.
        assert_eq!(FastLinearTile::choose(385, 1024, 8, 148), WidePart);
        assert_eq!(FastLinearTile::choose(513, 1024, 8, 148), Wide);
    }

    #[test]
    fn tiles_have_their_kernels_blocks_and_shared_memory() {
        let kernels = |product| -> Vec<KernelId> {
            FastLinearTile::ALL
                .iter()
                .map(|t| t.kernel(product))
                .collect()
        };
        let bf16 = [
            KernelId::LinearBf16FastT1x1,
            KernelId::LinearBf16FastT2x2,
            KernelId::LinearBf16FastT4x2,
            KernelId::LinearBf16FastWide,
            KernelId::LinearBf16FastWidePart,
        ];
        assert_eq!(kernels(FastProduct::Bf16(Rounding::Bf16)), bf16);
        assert_eq!(kernels(FastProduct::Bf16(Rounding::F32)), bf16);
        assert_eq!(
            kernels(FastProduct::SplitBf16x3),
            [
                KernelId::LinearBf16x3FastT1x1,
                KernelId::LinearBf16x3FastT2x2,
                KernelId::LinearBf16x3FastT4x2,
                KernelId::LinearBf16x3FastWide,
                KernelId::LinearBf16x3FastWidePart
            ]
        );
        // Only a bf16 product rounded to bf16 asks the kernel to round.
        assert_eq!(FastProduct::Bf16(Rounding::Bf16).output().flag(), 1);
        assert_eq!(FastProduct::Bf16(Rounding::F32).output().flag(), 0);
        assert_eq!(FastProduct::SplitBf16x3.output().flag(), 0);
        // Blocks start at multiples of the 16 x 8 mma tile: an output keeps its place in it.
        for tile in FastLinearTile::ALL {
            let (rows, cols) = tile.block();
            assert!(rows % 16 == 0 && cols % 8 == 0, "{tile:?}");
        }
        // The wide tile's shared memory (linear_fast.cuh's static_assert): 224 KiB for the bf16
        // product, 208 KiB for the split-x one, under the 227 KiB a block may opt into on sm_90
        // and sm_100; the one-part forms' 96 and 80 KiB (no totals); each kernel asks for its
        // own tile's and product's, and only the wide tiles ask for dynamic shared memory.
        assert_eq!(wide_shared_bytes(1, false), 224 * 1024);
        assert_eq!(wide_shared_bytes(3, false), 208 * 1024);
        assert_eq!(wide_shared_bytes(1, true), 96 * 1024);
        assert_eq!(wide_shared_bytes(3, true), 80 * 1024);
        for product in [FastProduct::Bf16(Rounding::Bf16), FastProduct::SplitBf16x3] {
            for tile in FastLinearTile::ALL {
                let dynamic = dynamic_shared_bytes(tile.kernel(product)).unwrap_or(0);
                assert_eq!(dynamic, tile.shared_bytes(product), "{tile:?} {product:?}");
            }
        }
        let wide = [
            KernelId::LinearBf16FastWide,
            KernelId::LinearBf16x3FastWide,
            KernelId::LinearBf16FastWidePart,
            KernelId::LinearBf16x3FastWidePart,
        ];
        for id in KernelId::ALL {
            assert_eq!(
                dynamic_shared_bytes(id).is_some(),
                wide.contains(&id),
                "{}",
                id.symbol()
            );
        }
    }

    /// A weight takes the split-x product only when every value is bf16: one stray low bit, in
    /// any place, keeps it off.
    #[test]
    fn exactly_bf16_sees_any_value_off_bf16() {
        let mut values: Vec<f32> = [1.0f32, -0.0, 3.0e38, -1.5e-38, 0.0078125, 65280.0]
            .iter()
            .map(|&v| f32::from_bits(v.to_bits() & 0xffff_0000))
            .collect();
        assert!(exactly_bf16(&values));
        assert!(exactly_bf16(&[]));
        for at in 0..values.len() {
            let kept = values[at];
            values[at] = f32::from_bits(kept.to_bits() | 1);
            assert!(
                !exactly_bf16(&values),
                "value {at} off bf16 by its last bit"
            );
            values[at] = kept;
        }
        assert!(!exactly_bf16(&[0.1]), "0.1 is not a bf16 value");
    }
}
