//! The `fast` block-scaled GEMMs (ARCHITECTURE.md §3): tensor cores on E4M3 with fp32 sums
//! (warpgroup MMAs on sm_90a, Hopper's native FP8 path; mma.sync m16n8k32 elsewhere) with one
//! promotion per scale group along K,
//! `acc = fma(T_g, s_w · s_a, acc)` in K order (`cuda/gemm/gemm_fast.cuh`), for FP8 weights
//! ([`FastFp8Weight`], [`gemm_fp8_fast`]) and FP4 E2M1 weights, whose codes are converted exactly
//! to E4M3 in registers ([`FastFp4Weight`], [`gemm_fp4_fast`]; the routed experts use the same
//! body, `ops::routed_fast`). Not bitwise equal to the CPU reference (the tensor core's in-group
//! sum is not the exact one), but deterministic and batch invariant: every [`FastTile`] computes
//! the same bits for a row, so the tile chosen by M never shows. A launch takes one weight or
//! two of one format and shape ([`Projections`]: the shared expert's `w1` and `w3`), each into
//! its own plane of `y` with its own launch's bits. The K parts ([`k_parts`]) are blocks of their
//! own (split: the part sums added by `gemm_fast_reduce`) or, where a 128-row launch fills the
//! SMs without them ([`FastKernels::folds`]), one block adds its parts in the same order itself:
//! the same bits either way.
//!
//! The output ([`FastOutput`]) is bf16 (rounded to nearest even once: V4.1's rounding point), that
//! value in f32 storage ([`RoundedToBf16`]) or f32 (the fp32 sum as it is: V4's float32 linears);
//! all come from the same sum, so a bf16 output is always its f32 output rounded once.
//!
//! Error bound against the exact value (f64) — what the GPU tests assert: with `P = Σ_k |a_k w_k|`
//! over a group, the tensor core's fp32-range sum of the group's exact products is within
//! `(G - 1) · 2^-13 · P` (it keeps at least 13 fraction bits per addition on Hopper, DeepSeek-V3
//! §3.3.2 observes ~14), each of the `K / G` promotions and each of the `parts - 1` additions of
//! a K part's sum ([`k_parts`]) adds at most `2^-24` times the running sum, and a bf16 output
//! rounding at most `2^-9 |y|` (an f32 output adds nothing).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr};
use half::bf16;

use super::gemm::{Fp4Bytes, Fp4Form, Fp8Bytes, Fp8Form};
use super::quant::{ActGroup, DeviceActFp8};
use super::{dim, ensure, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::{FastGemmParams, FastReduceParams};
use crate::runtime::KernelRuntime;

/// Where a fast GEMM stores `y` and how it rounds it (`store` in the kernels' params): a bf16
/// buffer (rounded to nearest even), an f32 buffer (the fp32 sum as it is) or [`RoundedToBf16`]
/// (an f32 buffer of the bf16-rounded values). The sum is the same in all three. Sealed: the
/// kernels write only these.
pub trait FastOutput: sealed::Buffer {
    /// The kernels' `store` (`STORE_*` in `cuda/gemm/gemm_fast.cuh`).
    const STORE: u32;
}

impl FastOutput for CudaSlice<bf16> {
    const STORE: u32 = 0;
}

impl FastOutput for CudaSlice<f32> {
    const STORE: u32 = 1;
}

/// An f32 output buffer that takes each value rounded to bf16: V4.1's rounding point, stored as
/// the f32 tensors the model reads (no widening launch after the GEMM).
pub struct RoundedToBf16<'a>(pub &'a mut CudaSlice<f32>);

impl FastOutput for RoundedToBf16<'_> {
    const STORE: u32 = 2;
}

mod sealed {
    use cudarc::driver::{CudaSlice, DeviceRepr};
    use half::bf16;

    /// One weight or two: the planes a dense fast launch computes ([`super::Projections`]).
    pub trait OneOrTwo {}

    impl<W> OneOrTwo for &W {}

    impl<W> OneOrTwo for [&W; 2] {}

    /// The device buffer behind a [`super::FastOutput`].
    pub trait Buffer {
        type Value: DeviceRepr;
        fn buffer(&mut self) -> &mut CudaSlice<Self::Value>;
    }

    impl Buffer for CudaSlice<bf16> {
        type Value = bf16;
        fn buffer(&mut self) -> &mut CudaSlice<bf16> {
            self
        }
    }

    impl Buffer for CudaSlice<f32> {
        type Value = f32;
        fn buffer(&mut self) -> &mut CudaSlice<f32> {
            self
        }
    }

    impl Buffer for super::RoundedToBf16<'_> {
        type Value = f32;
        fn buffer(&mut self) -> &mut CudaSlice<f32> {
            self.0
        }
    }
}

/// K codes of one weight chunk (`STEP_K` in the kernel).
const STEP_K: usize = 128;
/// Output features per weight band (one warp's mma rows).
const BAND: usize = 16;

/// Blocks a launch counted in 32 output features per block should have: two waves of the H100's
/// and H200's 132 SMs (the 8-row decode tile's 4 warps make it one wave of 64-feature blocks).
/// A constant, not the device's count: the K parts fix the sums' order, so that a weight's
/// products have the same bits on every device of one MMA.
const TARGET_BLOCKS: usize = 2 * 132;
/// K codes per part are a multiple of this (the largest stage, so parts cut no stage).
const PART_QUANTUM: usize = 512;
/// Threads per block of the part reduction.
const REDUCE_THREADS: u32 = 256;

/// The K parts of the dense fast GEMMs for a weight `[n, k]`: `(span, parts)`, K cut into
/// `parts` consecutive spans of `span` codes (the last one shorter), each summed from zero in K
/// order, the part sums added in part order (`cuda/gemm/gemm_fast.cuh`). A function of the shape
/// alone — never of M — so that a decode launch has about [`TARGET_BLOCKS`] blocks to stream the
/// weights and every tile gives the same bits.
pub fn k_parts(n: usize, k: usize) -> (usize, usize) {
    let column_blocks = n.div_ceil(32).max(1);
    let wanted = TARGET_BLOCKS.div_ceil(column_blocks).max(1);
    let span = k
        .div_ceil(wanted)
        .div_ceil(PART_QUANTUM)
        .max(1)
        .saturating_mul(PART_QUANTUM);
    (span, k.div_ceil(span).max(1))
}

/// A tile configuration of the fast GEMMs: token rows per block, warps per block (16 output
/// features each), pipeline stages and K codes per stage (`DENSE_TILES`, `ROUTED_TILES`);
/// must match the instantiations in `gemm_fast.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastTile {
    /// Chosen by the rows (M; a routed launch's mean rows per expert): the smallest of the
    /// kernels' tiles that holds them, their largest (128 rows) above.
    Auto,
    Rows8,
    Rows32,
    Rows64,
    Rows128,
}

/// The shape of a fast GEMM kernel build (the `GEMM_FAST` / `GEMM_FAST_ROUTED` macros' arguments
/// in `cuda/gemm/gemm_fast.cuh`): token rows per block, warps per block (16 output features each),
/// pipeline stages and K codes per stage (a multiple of 128). Warps come in whole warpgroups (4 or
/// 8: the sm_90a kernels' warpgroup MMAs). It changes which thread computes an output, never how:
/// every shape gives the same bits for the same K parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileShape {
    pub tokens: u32,
    pub warps: u32,
    pub stages: u32,
    pub step: u32,
}

/// The shape of each dense tile, in [`FastTile`] order after `Auto`. The 8-row tile is the fastest
/// of `device_bench --sections fast --sweep` on the H200 at M = 1 and 8 with the production's K
/// parts (wq_b 29.8 → 15.5 µs; bench/README.md, session 16). The 32- and 64-row tiles take its 4
/// warps and 256 codes per stage: two blocks of 8 warps in all fit an SM's shared memory (with 2
/// warps, 512 codes or 4 stages, two blocks held 4 warps). The 128-row tile's 8 warps (two
/// warpgroups) keep an SM's registers for one block; 256 codes per stage beat 128 in the
/// session-23 wgmma sweep (H100, M = 1024 on 5120 → 6144: 314 against 331 µs). It takes 2
/// stages so that its running totals (it folds its K parts: [`FastKernels::folds`], 64 KiB)
/// fit beside them: 3 stages, the products and the totals would be 277 KiB. A stage is several
/// µs of that tile's promotions, far longer than its copies take to land, so one stage ahead
/// keeps them in time; the sweep's best 8-warp prefill build had 2 stages (b64 w8 s2 k256,
/// session 23).
const DENSE_TILES: [(FastTile, TileShape); 4] = [
    (FastTile::Rows8, tile(8, 4, 3, 256)),
    (FastTile::Rows32, tile(32, 4, 3, 256)),
    (FastTile::Rows64, tile(64, 4, 3, 256)),
    (FastTile::Rows128, tile(128, 8, 2, 256)),
];

/// The routed experts' tiles, `Auto`'s choice by the mean rows per expert (the dense tiles'
/// rows). A routed tile's block reads its expert's activation rows once for all of its features,
/// so the 32- and 64-row tiles take 8 warps (128 features): at prefill (~16 rows per expert)
/// 2-warp blocks re-read the rows for every 32 features. `device_bench --sections fast --sweep`
/// times the routed kernel built for every tile at the V4.1 experts' shapes and rows (H200,
/// bench/README.md session 21): the 8-row tile is its fastest at 6 … 384 rows (2 stages of 512
/// codes: 148.6 against 158.0 µs at 48 rows, 720 against 760 µs at 384 rows on w1/w3). A
/// 16-row tile was a little faster in the sweep's uniform routes at 6144 rows but slower in the
/// block's prefill (4.88 ms on the H200 against the 32-row tile's 4.10 on an H100), so it is
/// not built. The 32-row tile takes 3 stages of 256 codes: the sweep of session 39 (H100, 6144
/// rows, the kernels since session 36's compile-time copies) timed it 2.3–2.8% under 2 stages on
/// each projection (w1 + w3 1841 against 1886 µs, w2 1005 against 1034), where session 23's
/// wgmma port had found 2 stages faster.
/// Changing a tile is its line here and its `GEMM_FAST_ROUTED` line in `gemm_fast.cu`
/// (`tiles_and_kernels_match_the_instantiations`).
const ROUTED_TILES: [(FastTile, TileShape); 4] = [
    (FastTile::Rows8, tile(8, 4, 2, 512)),
    (FastTile::Rows32, tile(32, 8, 3, 256)),
    (FastTile::Rows64, tile(64, 8, 3, 128)),
    (FastTile::Rows128, tile(128, 8, 3, 128)),
];

const fn tile(tokens: u32, warps: u32, stages: u32, step: u32) -> TileShape {
    TileShape {
        tokens,
        warps,
        stages,
        step,
    }
}

impl FastTile {
    /// The tile `kernels` run for this choice at `rows` token rows (per expert, for routed
    /// launches): [`FastTile::Auto`] takes the smallest of their tiles that holds the rows (their
    /// largest above); the others stay.
    pub(crate) fn resolve(self, kernels: FastKernels, rows: usize) -> FastTile {
        let tiles = kernels.tiles();
        match self {
            FastTile::Auto => tiles
                .iter()
                .find(|(_, shape)| rows <= shape.tokens as usize)
                .map_or(tiles[tiles.len() - 1].0, |t| t.0),
            tile => tile,
        }
    }
}

/// The kernel families of `gemm_fast.cu`: the weight layout (`Fp8Chunks<G>` or `Fp4Chunks`) and
/// dense or routed rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastKernels {
    /// FP8 weights, square scale tiles of the activation group's side.
    Fp8(ActGroup),
    /// FP4 E2M1 weights with 1×32 UE8M0 scales.
    Fp4,
    /// FP4 routed experts (`ops::routed_fast`).
    Fp4Routed,
}

impl FastKernels {
    const ALL: [FastKernels; 4] = [
        FastKernels::Fp8(ActGroup::G32),
        FastKernels::Fp8(ActGroup::G128),
        FastKernels::Fp4,
        FastKernels::Fp4Routed,
    ];

    /// Bytes of a lane's share of one 32-code group (`PIECE`): 16 FP8 codes or 16 FP4 codes.
    fn piece(self) -> u32 {
        match self {
            FastKernels::Fp8(_) => 16,
            FastKernels::Fp4 | FastKernels::Fp4Routed => 8,
        }
    }

    /// Bytes of a band's weight scales of one k-group (`SCALE_BYTES`): one f32, or 16 UE8M0.
    fn scale_bytes(self) -> u32 {
        match self {
            FastKernels::Fp8(_) => 4,
            FastKernels::Fp4 | FastKernels::Fp4Routed => 16,
        }
    }

    fn group(self) -> u32 {
        match self {
            FastKernels::Fp8(group) => group.elements() as u32,
            FastKernels::Fp4 | FastKernels::Fp4Routed => 32,
        }
    }

    /// The tiles of these kernels: the routed ones' or the dense ones'.
    fn tiles(self) -> &'static [(FastTile, TileShape)] {
        match self {
            FastKernels::Fp4Routed => &ROUTED_TILES,
            FastKernels::Fp8(_) | FastKernels::Fp4 => &DENSE_TILES,
        }
    }

    /// The shape of `tile` (`Auto`, which has none: the largest one).
    pub(crate) fn shape(self, tile: FastTile) -> TileShape {
        let tiles = self.tiles();
        tiles
            .iter()
            .find(|t| t.0 == tile)
            .map_or(tiles[tiles.len() - 1].1, |t| t.1)
    }

    /// The tile [`FastTile::Auto`] takes at `rows` token rows (per expert, for the routed
    /// kernels) and its shape: the production's choice, which the benchmark's sweep labels.
    pub fn auto_tile(self, rows: usize) -> (FastTile, TileShape) {
        let tile = FastTile::Auto.resolve(self, rows);
        (tile, self.shape(tile))
    }

    /// The macro line that builds these kernels with `shape` as `name` (`gemm_fast.cu`'s lines;
    /// the benchmark's sweep compiles others).
    pub fn instantiation(self, name: &str, shape: TileShape) -> String {
        format!(
            "{}({name}, {}{}, {}, {}, {})",
            self.macro_name(),
            self.weight_args(),
            shape.warps,
            shape.tokens,
            shape.stages,
            shape.step
        )
    }

    /// `GEMM_FAST` or `GEMM_FAST_ROUTED`.
    fn macro_name(self) -> &'static str {
        match self {
            FastKernels::Fp4Routed => "GEMM_FAST_ROUTED",
            _ => "GEMM_FAST",
        }
    }

    /// The macros' weight arguments: the chunk type, then the group (dense kernels).
    fn weight_args(self) -> String {
        match self {
            FastKernels::Fp8(g) => format!("fastgemm::Fp8Chunks<{0}>, {0}, ", g.elements()),
            FastKernels::Fp4 => "fastgemm::Fp4Chunks, 32, ".to_string(),
            FastKernels::Fp4Routed => "fastgemm::Fp4Chunks, ".to_string(),
        }
    }

    /// Token rows and warps per block of `tile`.
    pub(crate) fn block(self, tile: FastTile) -> (u32, u32) {
        (self.shape(tile).tokens, self.shape(tile).warps)
    }

    /// The kernel of `tile` as [`FastTile::resolve`] gives it for these kernels.
    pub(crate) fn kernel(self, tile: FastTile) -> KernelId {
        use FastTile::{Rows8, Rows32, Rows64};
        match (self, tile) {
            (FastKernels::Fp8(ActGroup::G32), Rows8) => KernelId::GemmFp8FastT32B8,
            (FastKernels::Fp8(ActGroup::G32), Rows32) => KernelId::GemmFp8FastT32B32,
            (FastKernels::Fp8(ActGroup::G32), Rows64) => KernelId::GemmFp8FastT32B64,
            (FastKernels::Fp8(ActGroup::G32), _) => KernelId::GemmFp8FastT32B128,
            (FastKernels::Fp8(ActGroup::G128), Rows8) => KernelId::GemmFp8FastT128B8,
            (FastKernels::Fp8(ActGroup::G128), Rows32) => KernelId::GemmFp8FastT128B32,
            (FastKernels::Fp8(ActGroup::G128), Rows64) => KernelId::GemmFp8FastT128B64,
            (FastKernels::Fp8(ActGroup::G128), _) => KernelId::GemmFp8FastT128B128,
            (FastKernels::Fp4, Rows8) => KernelId::GemmFp4FastB8,
            (FastKernels::Fp4, Rows32) => KernelId::GemmFp4FastB32,
            (FastKernels::Fp4, Rows64) => KernelId::GemmFp4FastB64,
            (FastKernels::Fp4, _) => KernelId::GemmFp4FastB128,
            (FastKernels::Fp4Routed, Rows8) => KernelId::GemmFp4FastRoutedB8,
            (FastKernels::Fp4Routed, Rows32) => KernelId::GemmFp4FastRoutedB32,
            (FastKernels::Fp4Routed, Rows64) => KernelId::GemmFp4FastRoutedB64,
            (FastKernels::Fp4Routed, _) => KernelId::GemmFp4FastRoutedB128,
        }
    }

    /// Dynamic shared memory of a staged launch with `shape` (`Stage::BYTES · STAGES` in the
    /// kernel, then the warps' scale products where it forms them, then the running totals of a
    /// tile that folds its K parts).
    pub fn shared_bytes(self, shape: TileShape) -> u32 {
        let TileShape {
            tokens,
            warps,
            stages,
            step,
        } = shape;
        let groups_per_stage = step / self.group();
        let stage = warps * 128 * self.piece() * (step / STEP_K as u32)
            + tokens * step
            + 4 * (tokens + 4) * groups_per_stage
            + self.scale_bytes() * warps * groups_per_stage;
        stage.div_ceil(16) * 16 * stages + self.products_bytes(shape) + self.totals_bytes(shape)
    }

    /// Bytes of the warps' scale products after the stages (`PRODUCTS` in the kernel): two
    /// groups' f32 for every token of the block per warp, where the weight scale is one per band
    /// (FP8) and the tile has 32 tokens or more.
    fn products_bytes(self, shape: TileShape) -> u32 {
        match self {
            FastKernels::Fp8(_) if shape.tokens >= 32 => shape.warps * 2 * shape.tokens * 4,
            _ => 0,
        }
    }

    /// Whether the tile `shape` of these kernels can add a launch's K parts itself (`FOLDS` in
    /// `gemm_fast_dense`): the dense tiles of 128 rows or more.
    fn tile_folds(self, shape: TileShape) -> bool {
        !matches!(self, FastKernels::Fp4Routed) && shape.tokens >= 128
    }

    /// Bytes of a folding tile's running totals after the products: a float4 per thread and n8
    /// token tile, the block's every output in f32.
    fn totals_bytes(self, shape: TileShape) -> u32 {
        if self.tile_folds(shape) {
            shape.tokens / 8 * shape.warps * 32 * 16
        } else {
            0
        }
    }

    /// Whether the dense launch of `tile` ([`FastTile::resolve`]d at `m` rows) on `planes`
    /// weights `[n, k]` (1, or 2: [`Projections`]) adds its K parts ([`k_parts`]) in the kernel,
    /// one block over all of them, rather than in blocks of a part and `gemm_fast_reduce`; the
    /// bits are the same (`cuda/gemm/gemm_fast.cuh`); `folded` below says when.
    /// `sms`: the device's multiprocessors ([`KernelRuntime::multiprocessors`]).
    pub fn folds(
        self,
        tile: FastTile,
        m: usize,
        (n, k): (usize, usize),
        planes: usize,
        sms: usize,
    ) -> bool {
        let tile = tile.resolve(self, m);
        let shape = self.shape(tile);
        let blocks = dense_blocks(self.block(tile), m, n, planes);
        self.tile_folds(shape) && folded(blocks, k_parts(n, k).1, sms)
    }
}

/// Blocks of a dense launch a K part: column blocks × row blocks × planes, for a tile of
/// `(tokens, warps)` (16 features a warp).
fn dense_blocks((tokens, warps): (u32, u32), m: usize, n: usize, planes: usize) -> usize {
    n.div_ceil(16 * warps as usize) * m.div_ceil(tokens as usize) * planes
}

/// Whether a launch of a folding tile (one block an SM) with `blocks` blocks a part adds its
/// `parts` in the kernel on a device of `sms` multiprocessors — a function of M, the shape and
/// the device, never of the bits, which are the same either way. Counted in waves of `sms`
/// blocks of one part's length, the folded launch takes `ceil(blocks / sms) · parts`, the split
/// one `ceil(blocks · parts / sms)` and then the reduction, with the partials written and read
/// back: about an eighth of the split tile's time at prefill (ncu, H100, a 1024-token prefill of
/// the V4.1 block: `gemm_fast_reduce` 135 µs beside the tile's 1157). So it folds when that
/// takes at most an eighth more waves. Where it would not, the split blocks fill the SMs
/// better: at M = 1024 V4.1's `wkv` (5120 → 512, 10 parts) folded is 32 blocks, split 320;
/// `wo_b` (8192 → 5120, 2 parts) 320 blocks, 6 waves against 5. Past a few waves every launch
/// folds (the loss is within a wave).
fn folded(blocks: usize, parts: usize, sms: usize) -> bool {
    let folded = blocks.div_ceil(sms) * parts;
    let split = (blocks * parts).div_ceil(sms);
    parts > 1 && 8 * folded <= 9 * split
}

/// The dynamic shared memory kernel `id` needs, for the runtime to allow it at load time (`None`
/// for every kernel that is not a fast GEMM).
pub(crate) fn dynamic_shared_bytes(id: KernelId) -> Option<u32> {
    FastKernels::ALL.into_iter().find_map(|kernels| {
        kernels
            .tiles()
            .iter()
            .find(|t| kernels.kernel(t.0) == id)
            .map(|t| kernels.shared_bytes(t.1))
    })
}

/// Allows `function` the dynamic shared memory of fast GEMM `id`, of the fast linear's wide
/// tile, of the fast attention, of the fast indexer or of the mHC partials (above the 48 KiB
/// default).
pub(crate) fn allow_shared(
    id: KernelId,
    function: &cudarc::driver::CudaFunction,
) -> Result<(), KernelError> {
    if let Some(bytes) = dynamic_shared_bytes(id)
        .or_else(|| super::linear_fast::dynamic_shared_bytes(id))
        .or_else(|| super::attention::dynamic_shared_bytes(id))
        .or_else(|| super::index::dynamic_shared_bytes(id))
        .or_else(|| super::mhc::dynamic_shared_bytes(id))
    {
        function
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(KernelError::driver(format!(
                "allowing {bytes} bytes of shared memory to {}",
                id.symbol()
            )))?;
    }
    Ok(())
}

/// An FP8 weight `[out, inp]` laid out for the fast GEMM: `chunks` holds, per 16-row band and
/// 128 codes of K, the band's codes as one 2 KiB chunk in A fragment order (see
/// [`fragment_chunks`]); `band_scales` the UE8M0 tile scales as f32 per band and k-group
/// (`[ceil(out / 16), inp / tile]`).
#[derive(Debug)]
pub struct FastFp8Weight {
    pub out: usize,
    pub inp: usize,
    pub tile: usize,
    pub chunks: CudaSlice<u8>,
    pub band_scales: CudaSlice<f32>,
}

impl Fp8Form for FastFp8Weight {
    /// Re-lays and uploads checkpoint bytes (checked as `DeviceFp8Weight::upload` does; `inp`
    /// must also be a multiple of `tile`, the activation group).
    fn upload(rt: &KernelRuntime, w: Fp8Bytes<'_>) -> Result<FastFp8Weight, KernelError> {
        const OP: &str = "FastFp8Weight::upload";
        w.check(OP)?;
        let Fp8Bytes {
            out,
            inp,
            tile,
            codes,
            scales,
        } = w;
        ensure(inp.is_multiple_of(tile), OP, || {
            format!("[{out}, {inp}]: inp must be a multiple of the tile {tile}")
        })?;
        let groups = inp / tile;
        let bands = out.div_ceil(BAND);
        let mut band_scales = Vec::with_capacity(bands * groups);
        for band in 0..bands {
            let row = band * BAND / tile;
            band_scales.extend(
                scales[row * groups..(row + 1) * groups]
                    .iter()
                    .map(|&e| e8m0_value(e)),
            );
        }
        let band_scales = rt
            .htod(&band_scales)
            .map_err(KernelError::driver("uploading fast FP8 weight scales"))?;
        let chunks = rt
            .htod(&fragment_chunks(
                codes,
                out,
                inp,
                FP8_HALF_PIECE,
                copy_piece,
            ))
            .map_err(KernelError::driver("uploading fast FP8 weight codes"))?;
        Ok(FastFp8Weight {
            out,
            inp,
            tile,
            chunks,
            band_scales,
        })
    }
}

/// An FP4 E2M1 weight `[out, inp]` (1×32 UE8M0 scales) laid out for the fast GEMM: `chunks`
/// holds, per 16-row band and 128 codes of K, the band's packed codes as one 1 KiB chunk in mma
/// fragment order (see [`fragment_chunks`], its 8 codes of a row re-packed by
/// [`fp4_piece_order`]); `band_scales` the UE8M0 bytes per band, k-group and row of the band
/// (`[ceil(out / 16), inp / 32, 16]`, rows past `out` zero).
#[derive(Debug, Clone)]
pub struct FastFp4Weight {
    pub out: usize,
    pub inp: usize,
    pub chunks: CudaSlice<u8>,
    pub band_scales: CudaSlice<u8>,
}

impl Fp4Form for FastFp4Weight {
    /// Re-lays and uploads checkpoint bytes (checked as `DeviceFp4Weight::upload` does).
    fn upload(rt: &KernelRuntime, w: Fp4Bytes<'_>) -> Result<FastFp4Weight, KernelError> {
        w.check("FastFp4Weight::upload")?;
        let band_scales = rt
            .htod(&fp4_band_scales(w.scales, w.out, w.inp / 32))
            .map_err(KernelError::driver("uploading fast FP4 weight scales"))?;
        let chunks = rt
            .htod(&fragment_chunks(
                w.packed,
                w.out,
                w.inp / 2,
                FP4_HALF_PIECE,
                fp4_piece_order,
            ))
            .map_err(KernelError::driver("uploading fast FP4 weight codes"))?;
        Ok(FastFp4Weight {
            out: w.out,
            inp: w.inp,
            chunks,
            band_scales,
        })
    }
}

/// Bytes of one row's 8 codes in a lane's fragment piece: FP8 (one byte per code), FP4 (two
/// codes per byte).
const FP8_HALF_PIECE: usize = 8;
const FP4_HALF_PIECE: usize = 4;

/// The weight rows (`out` rows of `row_bytes` bytes, `half` bytes holding 8 codes: 8 for FP8, 4
/// for FP4) as the kernel reads them. For band b (rows 16b ..) and step s (codes 128s ..) the
/// chunk at `(b · steps + s) · 256 · half` holds, for group j = 0..4 and lane = 0..32 (g = lane /
/// 4, t = lane % 4), `half` bytes of row 16b + g, then those of row 16b + g + 8: the row's two
/// runs of 4 codes that sit in the A fragment's k slots 4t .. and 16 + 4t .. (codes c and c + 16,
/// c = 128s + 32j + 4t), each piece written by `lay` (the two runs, destination). Rows past `out`
/// and codes past the row are zero.
fn fragment_chunks(
    bytes: &[u8],
    out: usize,
    row_bytes: usize,
    half: usize,
    lay: fn(&[u8], &[u8], &mut [u8]),
) -> Vec<u8> {
    let step_bytes = STEP_K / 8 * half;
    let chunk_bytes = BAND * step_bytes;
    let steps = row_bytes.div_ceil(step_bytes);
    let run = half / 2; // bytes of 4 codes
    let mut chunks = vec![0u8; out.div_ceil(BAND) * steps * chunk_bytes];
    for (c, chunk) in chunks.chunks_exact_mut(chunk_bytes).enumerate() {
        let (band, step) = (c / steps, c % steps);
        for (piece, dst) in chunk.chunks_exact_mut(half).enumerate() {
            let (j, lane, second) = (piece / 64, (piece / 2) % 32, piece % 2);
            let row = BAND * band + lane / 4 + 8 * second;
            let at = step_bytes * step + 4 * half * j + run * (lane % 4);
            if row < out && at < row_bytes {
                let src = row * row_bytes + at;
                let far = src + 2 * half; // 16 codes on
                lay(&bytes[src..src + run], &bytes[far..far + run], dst);
            }
        }
    }
    chunks
}

/// A piece as it is (FP8 codes): the two runs one after the other.
fn copy_piece(first: &[u8], second: &[u8], dst: &mut [u8]) {
    let (low, high) = dst.split_at_mut(first.len());
    low.copy_from_slice(first);
    high.copy_from_slice(second);
}

/// A row's two runs of 4 FP4 codes of a lane (2 bytes each, code 2i in the low nibble of byte i
/// as in the checkpoint) packed as the kernel's `e2m1x8_to_e4m3` reads them: byte i holds code i
/// of the first run in its low nibble and code i of the second in its high nibble.
fn fp4_piece_order(first: &[u8], second: &[u8], dst: &mut [u8]) {
    let code = |run: &[u8], i: usize| (run[i / 2] >> (4 * (i % 2))) & 0xf;
    for (i, byte) in dst.iter_mut().enumerate() {
        *byte = code(first, i) | (code(second, i) << 4);
    }
}

/// FP4 row scales `[out, groups]` per 16-row band: `[ceil(out / 16)][groups][16]`, rows past
/// `out` zero.
fn fp4_band_scales(scales: &[u8], out: usize, groups: usize) -> Vec<u8> {
    let mut banded = vec![0u8; out.div_ceil(BAND) * groups * BAND];
    for (i, e) in banded.iter_mut().enumerate() {
        let (band, group, r) = (i / (groups * BAND), (i / BAND) % groups, i % BAND);
        let row = BAND * band + r;
        if row < out {
            *e = scales[row * groups + group];
        }
    }
    banded
}

/// The value of a UE8M0 scale: `2^(e - 127)`, 255 is NaN.
fn e8m0_value(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::NAN,
        e => f32::from_bits(u32::from(e) << 23),
    }
}

/// The weights of one dense fast launch: one weight (`&w`: `y [m, n]`), or two of one format and
/// shape (`[&w0, &w1]`: the shared expert's `w1` and `w3`), computed in one launch into the planes
/// of `y [2][m][n]`. Plane `p` is bitwise weight `p`'s own launch: the same K parts ([`k_parts`]
/// of the one shape), tile and order; one `gemm_fast_reduce` adds the part sums of both planes
/// (or the blocks fold them). Sealed: one or two weights, as the kernels take.
pub trait Projections<W>: sealed::OneOrTwo {
    /// The weights, plane by plane.
    fn weights(&self) -> &[&W];
}

impl<W> Projections<W> for &W {
    fn weights(&self) -> &[&W] {
        std::slice::from_ref(self)
    }
}

impl<W> Projections<W> for [&W; 2] {
    fn weights(&self) -> &[&W] {
        self
    }
}

/// The format and shape of a dense fast weight: what two weights must share to run in one
/// launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DenseForm {
    /// FP8 `[out, inp]`, one UE8M0 scale per `tile` × `tile`.
    Fp8 { out: usize, inp: usize, tile: usize },
    /// FP4 E2M1 `[out, inp]`, one UE8M0 scale per row and 32 inputs.
    Fp4 { out: usize, inp: usize },
}

impl DenseForm {
    /// `(out, inp)`: the GEMM's `(n, k)`.
    fn shape(self) -> (usize, usize) {
        match self {
            DenseForm::Fp8 { out, inp, .. } | DenseForm::Fp4 { out, inp } => (out, inp),
        }
    }
}

impl std::fmt::Display for DenseForm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            DenseForm::Fp8 { out, inp, tile } => {
                write!(f, "FP8 [{out}, {inp}] in {tile}x{tile} tiles")
            }
            DenseForm::Fp4 { out, inp } => write!(f, "FP4 [{out}, {inp}]"),
        }
    }
}

/// A shape error of `op` unless `second` has `first`'s format and shape (a pair of weights in one
/// launch), naming both.
fn check_pair(op: &'static str, first: DenseForm, second: DenseForm) -> Result<(), KernelError> {
    ensure(first == second, op, || {
        let pair = format!("{first} and {second}");
        format!("a pair of weights in one launch must share format and shape: {pair}")
    })
}

/// A weight laid out for the dense fast kernels: its format and shape, and its device buffers.
pub(crate) trait DenseWeight {
    type Scale: DeviceRepr;
    fn form(&self) -> DenseForm;
    /// The fragment chunks and band scales.
    fn buffers(&self) -> (&CudaSlice<u8>, &CudaSlice<Self::Scale>);
}

impl DenseWeight for FastFp8Weight {
    type Scale = f32;
    fn form(&self) -> DenseForm {
        let (out, inp, tile) = (self.out, self.inp, self.tile);
        DenseForm::Fp8 { out, inp, tile }
    }
    fn buffers(&self) -> (&CudaSlice<u8>, &CudaSlice<f32>) {
        (&self.chunks, &self.band_scales)
    }
}

impl DenseWeight for FastFp4Weight {
    type Scale = u8;
    fn form(&self) -> DenseForm {
        let (out, inp) = (self.out, self.inp);
        DenseForm::Fp4 { out, inp }
    }
    fn buffers(&self) -> (&CudaSlice<u8>, &CudaSlice<u8>) {
        (&self.chunks, &self.band_scales)
    }
}

/// `y = a · wᵀ` on tensor cores for an FP8 weight or a pair of them ([`Projections`]), `y
/// [a.rows, w.out]` (a pair: `[2][a.rows][w.out]`) as [`FastOutput`] stores it. The activation
/// group must be the weight's tile side (32: V4.1, 128: V4). `tile` is the block shape
/// ([`FastTile::Auto`] in production: chosen by the rows); the result does not depend on it.
pub fn gemm_fp8_fast<Y: FastOutput>(
    rt: &KernelRuntime,
    a: &DeviceActFp8,
    w: impl Projections<FastFp8Weight>,
    y: &mut Y,
    tile: FastTile,
) -> Result<(), KernelError> {
    const OP: &str = "gemm_fp8_fast";
    let weights = w.weights();
    check_fp8_groups(OP, a, weights[0])?;
    let span = k_parts(weights[0].out, weights[0].inp).0;
    let kernel = FastKernel::production(rt, FastKernels::Fp8(a.group), tile, a.rows, span)?;
    launch_dense(rt, OP, &kernel, a, weights, y)
}

/// The activation groups of an FP8 fast GEMM must be the weight's tile side.
fn check_fp8_groups(
    op: &'static str,
    a: &DeviceActFp8,
    w: &FastFp8Weight,
) -> Result<(), KernelError> {
    ensure(a.group.elements() == w.tile, op, || {
        format!(
            "{}-element activation groups with {}x{} weight tiles (they must match)",
            a.group.elements(),
            w.tile,
            w.tile
        )
    })
}

/// A build of a fast GEMM family with another tile, for the benchmark's tile sweep: `function`
/// is `kernels.instantiation(name, shape)` ([`FastKernels::instantiation`]) compiled and loaded
/// by the caller with `kernels.shared_bytes(shape)` of dynamic shared memory allowed; `span` the
/// K codes of each part (a multiple of `shape.step`). With the production's span ([`k_parts`];
/// routed: K, one part) it gives the production's bits; with another span, another (equally
/// valid) sum order. Launched by [`gemm_fp8_fast_variant`] and
/// [`super::routed_fast::gemm_fp4_routed_fast_variant`].
pub struct FastVariant {
    pub name: String,
    pub function: CudaFunction,
    pub kernels: FastKernels,
    pub shape: TileShape,
    pub span: usize,
}

/// [`gemm_fp8_fast`] through a [`FastVariant`] of `FastKernels::Fp8` (checked as the production
/// launch is, and the variant's family and span against the activations and its stage).
pub fn gemm_fp8_fast_variant<Y: FastOutput>(
    rt: &KernelRuntime,
    a: &DeviceActFp8,
    w: impl Projections<FastFp8Weight>,
    y: &mut Y,
    variant: &FastVariant,
) -> Result<(), KernelError> {
    const OP: &str = "gemm_fp8_fast_variant";
    let weights = w.weights();
    check_fp8_groups(OP, a, weights[0])?;
    let kernel = FastKernel::variant(OP, variant, FastKernels::Fp8(a.group))?;
    launch_dense(rt, OP, &kernel, a, weights, y)
}

/// `y = a · wᵀ` on tensor cores for an FP4 weight or a pair of them ([`Projections`]), `y` as
/// in [`gemm_fp8_fast`]; `a` in 32-element groups; `tile` as in [`gemm_fp8_fast`].
pub fn gemm_fp4_fast<Y: FastOutput>(
    rt: &KernelRuntime,
    a: &DeviceActFp8,
    w: impl Projections<FastFp4Weight>,
    y: &mut Y,
    tile: FastTile,
) -> Result<(), KernelError> {
    const OP: &str = "gemm_fp4_fast";
    let weights = w.weights();
    a.group.require_g32(OP, "FP4 weights")?;
    let span = k_parts(weights[0].out, weights[0].inp).0;
    let kernel = FastKernel::production(rt, FastKernels::Fp4, tile, a.rows, span)?;
    launch_dense(rt, OP, &kernel, a, weights, y)
}

/// The kernel a fast launch runs: its function and name, token rows and warps per block, dynamic
/// shared memory, K codes per part and whether its tile can add a launch's parts itself.
pub(crate) struct FastKernel<'a> {
    pub(crate) name: &'a str,
    pub(crate) function: &'a CudaFunction,
    /// Token rows and warps per block.
    pub(crate) block: (u32, u32),
    pub(crate) shared_bytes: u32,
    pub(crate) span: usize,
    /// `FOLDS` in the kernel (dense tiles of 128 rows).
    pub(crate) folds: bool,
}

impl<'a> FastKernel<'a> {
    /// The production kernel of `kernels` with `tile` at `rows` token rows (per expert, for the
    /// routed kernels; [`FastTile::resolve`]) over K parts of `span` codes.
    pub(crate) fn production(
        rt: &'a KernelRuntime,
        kernels: FastKernels,
        tile: FastTile,
        rows: usize,
        span: usize,
    ) -> Result<FastKernel<'a>, KernelError> {
        let tile = tile.resolve(kernels, rows);
        let id = kernels.kernel(tile);
        Ok(FastKernel {
            name: id.symbol(),
            function: rt.function(id)?,
            block: kernels.block(tile),
            shared_bytes: kernels.shared_bytes(kernels.shape(tile)),
            span,
            folds: kernels.tile_folds(kernels.shape(tile)),
        })
    }

    /// The build `variant`, which must be one of `kernels` with stages of a multiple of 128 codes
    /// and K parts of a multiple of its stage.
    pub(crate) fn variant(
        op: &'static str,
        variant: &'a FastVariant,
        kernels: FastKernels,
    ) -> Result<FastKernel<'a>, KernelError> {
        let shape = variant.shape;
        let step = shape.step as usize;
        ensure(
            variant.kernels == kernels
                && step != 0
                && step.is_multiple_of(STEP_K)
                && variant.span != 0
                && variant.span.is_multiple_of(step)
                && shape.tokens != 0
                && shape.tokens.is_multiple_of(8),
            op,
            || {
                format!(
                    "{}: a build of {:?} for {kernels:?}, {} token rows, span {} with {step} \
                     codes per stage (the families must match, the rows be a multiple of 8, the \
                     span a multiple of the stage, the stage a multiple of 128 codes)",
                    variant.name, variant.kernels, shape.tokens, variant.span
                )
            },
        )?;
        Ok(FastKernel {
            name: &variant.name,
            function: &variant.function,
            block: (shape.tokens, shape.warps),
            shared_bytes: kernels.shared_bytes(shape),
            span: variant.span,
            folds: kernels.tile_folds(shape),
        })
    }
}

/// Launches a dense fast GEMM `kernel` on `weights` (one, or two of one format and shape: a
/// mismatched pair is refused), weight `p` into plane `p` of `y`: its K parts in blocks of their
/// own and `gemm_fast_reduce`, or folded (a block over all the parts, where the tile can and
/// `folded` finds it fills the SMs no worse).
fn launch_dense<W: DenseWeight, Y: FastOutput>(
    rt: &KernelRuntime,
    op: &'static str,
    kernel: &FastKernel,
    a: &DeviceActFp8,
    weights: &[&W],
    y: &mut Y,
) -> Result<(), KernelError> {
    let form = weights[0].form();
    for w in &weights[1..] {
        check_pair(op, form, w.form())?;
    }
    let (n, k) = form.shape();
    let projections = weights.len();
    // y: `projections` planes of [rows, n].
    a.check_gemm(op, (projections * n, k), y.buffer().len())?;
    if a.rows == 0 {
        return Ok(());
    }
    let (tokens, warps) = kernel.block;
    let span = kernel.span;
    let parts = k.div_ceil(span).max(1);
    let fold = kernel.folds
        && folded(
            dense_blocks(kernel.block, a.rows, n, projections),
            parts,
            rt.multiprocessors(),
        );
    // A block per K part, its sums in partials and the reduction after (else one along K).
    let split = parts > 1 && !fold;
    // The outputs of every plane (the reduction's count; plane offsets in u32 rows).
    let count = projections * a.rows * n;
    dim(op, "outputs", count)?;
    let params = FastGemmParams {
        m: dim(op, "m", a.rows)?,
        n: dim(op, "n", n)?,
        k: dim(op, "k", k)?,
        span: dim(op, "span", span)?,
        parts: dim(op, "parts", parts)?,
        store: Y::STORE,
        projections: dim(op, "projections", projections)?,
        folded: u32::from(fold),
    };
    let row_blocks = params.m.div_ceil(tokens);
    ensure(row_blocks <= 65_535, op, || {
        format!("m = {} needs {row_blocks} row blocks (> 65535)", a.rows)
    })?;
    let planes_and_parts = params.projections * if split { params.parts } else { 1 };
    ensure(planes_and_parts <= 65_535, op, || {
        format!("{projections} planes of {parts} K parts (> 65535 blocks in z)")
    })?;
    let cfg = launch_config(
        (params.n.div_ceil(16 * warps), row_blocks, planes_and_parts),
        warps * 32,
        kernel.shared_bytes,
    );
    // The parts' sums [parts][projections][m][n] of a split launch (else one value, unread).
    // SAFETY: split, every block writes its part's sums of its plane, rows and columns,
    // so the launch writes all parts * count values before the reduction reads them, in stream
    // order; with one block along K the kernel never touches the buffer.
    let mut partials =
        unsafe { rt.alloc_written::<f32>(if split { parts * count } else { 1 }) }
            .map_err(KernelError::driver("allocating the fast GEMM's part sums"))?;
    // Plane 1's weight: the second, or the first again (never read with one projection).
    let (w0, ws0) = weights[0].buffers();
    let (w1, ws1) = weights[projections - 1].buffers();
    let mut launch = rt.launcher_of(kernel.function, kernel.name);
    launch
        .arg(&a.codes)
        .arg(&a.scales)
        .arg(w0)
        .arg(ws0)
        .arg(w1)
        .arg(ws1)
        .arg(y.buffer())
        .arg(&mut partials)
        .arg(&params);
    // SAFETY: the kernel's signature is (const u8* a, const float* sa, const u8* w0, const u8*
    // ws0, const u8* w1, const u8* ws1, void* y, float* partials, FastGemmParams): y is written
    // as Y::Value (store = Y::STORE: bf16 for 0, f32 for 1 and 2; FastOutput is sealed to
    // these). The activation buffers hold rows * k codes and rows * k / group scales
    // (DeviceActFp8's invariant); each weight (both of shape n, k: check_pair) holds ceil(n / 16)
    // * ceil(k / 128) chunks and ceil(n / 16) * k / group band scales of the kernel's scale size
    // (built at upload from n, k: FastFp8Weight, FastFp4Weight); block z reads weight z / parts
    // < projections (1 or 2: Projections is sealed) over K codes [p span, min(k, (p + 1) span)),
    // p = z % parts, parts = ceil(k / span), or, folded (z = plane; only for a tile built with
    // FOLDS: kernel.folds, its totals in kernel.shared_bytes), over all of K; every load is
    // bounds-checked against m, n, k in the kernel; y holds projections * m * n values (checked
    // above), partials parts * count when split.
    unsafe { launch.launch(cfg) }?;
    if split {
        reduce_parts(rt, op, &partials, y, count, parts)?;
    }
    Ok(())
}

/// `y[i] = out(((P_0[i] + P_1[i]) + …))` over the `parts` part sums `partials` `[parts][count]`
/// (`out`: [`FastOutput`]).
pub(crate) fn reduce_parts<Y: FastOutput>(
    rt: &KernelRuntime,
    op: &'static str,
    partials: &CudaSlice<f32>,
    y: &mut Y,
    count: usize,
    parts: usize,
) -> Result<(), KernelError> {
    let params = FastReduceParams {
        count: dim(op, "outputs", count)?,
        parts: dim(op, "parts", parts)?,
        store: Y::STORE,
    };
    let cfg = launch_config(
        (params.count.div_ceil(REDUCE_THREADS).min(1 << 16), 1, 1),
        REDUCE_THREADS,
        0,
    );
    let kernel = KernelId::GemmFastReduce;
    let mut launch = rt.launcher(kernel)?;
    launch.arg(partials).arg(y.buffer()).arg(&params);
    // SAFETY: signature (const float* partials, void* y, FastReduceParams), y written as
    // Y::Value (store = Y::STORE); partials holds parts * count values (allocated so by the
    // caller), y count (checked: m * n); the kernel strides over i < count.
    unsafe { launch.launch(cfg) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H100's and H200's multiprocessors, where the rules below were measured.
    const H200_SMS: usize = 132;

    #[test]
    fn auto_takes_the_smallest_tile_that_holds_the_rows() {
        let (dense, routed) = (FastKernels::Fp4, FastKernels::Fp4Routed);
        for kernels in [dense, routed] {
            assert_eq!(FastTile::Auto.resolve(kernels, 1), FastTile::Rows8);
            assert_eq!(FastTile::Auto.resolve(kernels, 8), FastTile::Rows8);
            assert_eq!(FastTile::Auto.resolve(kernels, 17), FastTile::Rows32);
            assert_eq!(FastTile::Auto.resolve(kernels, 64), FastTile::Rows64);
            assert_eq!(FastTile::Auto.resolve(kernels, 65), FastTile::Rows128);
            assert_eq!(FastTile::Rows32.resolve(kernels, 1), FastTile::Rows32);
        }
        // A 1024-token prefill: 6144 rows over 384 experts.
        assert_eq!(
            routed.auto_tile(6144_usize.div_ceil(384)).0,
            FastTile::Rows32
        );
    }

    #[test]
    fn shared_memory_matches_the_kernel_layout_and_fits_the_h200() {
        // Stage::BYTES for FP8, G = 32, 4 warps, 8 tokens, 256 codes of K:
        // 4 * 2 * 2048 + 8 * 256 + 4 * 12 * 8 + 4 * 4 * 8, three stages.
        let fp8 = FastKernels::Fp8(ActGroup::G32);
        assert_eq!(fp8.shared_bytes(fp8.shape(FastTile::Rows8)), 18_944 * 3);
        // 8 warps, 128 tokens: 8 * 2 * 2048 + 128 * 256 + 4 * 132 * 8 + 4 * 8 * 8, two stages,
        // then the scale products, 8 * 2 * 128 * 4, and the running totals, 128 * 128 * 4.
        assert_eq!(
            fp8.shared_bytes(fp8.shape(FastTile::Rows128)),
            70_016 * 2 + 8_192 + 65_536
        );
        // Three stages would not fit with the totals.
        let three = TileShape {
            stages: 3,
            ..fp8.shape(FastTile::Rows128)
        };
        assert!(fp8.shared_bytes(three) + 1024 > 227 * 1024);
        // Two blocks of the 64-row dense tile and three of the routed one fit an SM (228 KiB,
        // 1 KiB reserved per block; the routed kernels' static rows, 8 bytes a token row, on top).
        assert!(2 * (fp8.shared_bytes(fp8.shape(FastTile::Rows64)) + 1024) <= 228 * 1024);
        let routed = FastKernels::Fp4Routed;
        assert!(3 * (routed.shared_bytes(routed.shape(FastTile::Rows64)) + 1536) <= 228 * 1024);
        assert!(2 * (routed.shared_bytes(routed.shape(FastTile::Rows32)) + 1536) <= 228 * 1024);
        // FP4: 1 KiB chunks and 16 scale bytes per band and group:
        // 4 * 2 * 1024 + 8 * 256 + 4 * 12 * 8 + 16 * 4 * 8, three stages.
        assert_eq!(
            FastKernels::Fp4.shared_bytes(FastKernels::Fp4.shape(FastTile::Rows8)),
            11_136 * 3
        );
        let mut ids = Vec::new();
        for kernels in FastKernels::ALL {
            for &(tile, shape) in kernels.tiles() {
                // The routed kernels' static rows (at most 2 x 128 u32) come on top.
                assert!(
                    kernels.shared_bytes(shape) + 1024 <= 227 * 1024,
                    "{kernels:?} {tile:?}"
                );
                assert_eq!(
                    dynamic_shared_bytes(kernels.kernel(tile)),
                    Some(kernels.shared_bytes(shape))
                );
                ids.push(kernels.kernel(tile));
            }
        }
        ids.sort_by_key(|id| id.symbol());
        ids.dedup();
        assert_eq!(ids.len(), 16, "every (kernels, tile) has its own kernel");
        assert_eq!(dynamic_shared_bytes(KernelId::GemmFp8T32G32), None);
    }

    #[test]
    fn tiles_and_kernels_match_the_instantiations() {
        let source = include_str!("../../cuda/gemm/gemm_fast.cu");
        for kernels in FastKernels::ALL {
            for &(tile, shape) in kernels.tiles() {
                let line = kernels.instantiation(kernels.kernel(tile).symbol(), shape);
                assert!(source.contains(&line), "{line} not in gemm_fast.cu");
            }
        }
        assert_eq!(
            FastKernels::Fp4Routed.instantiation("x", tile(16, 8, 3, 256)),
            "GEMM_FAST_ROUTED(x, fastgemm::Fp4Chunks, 8, 16, 3, 256)"
        );
    }

    #[test]
    fn fp8_chunks_hold_each_lanes_fragments_and_zero_padding() {
        // 20 rows (a partial second band), 160 inputs (a partial second step).
        let (out, inp) = (20usize, 160usize);
        let codes: Vec<u8> = (0..out * inp).map(|i| (i % 251) as u8 + 1).collect();
        let chunks = fragment_chunks(&codes, out, inp, FP8_HALF_PIECE, copy_piece);
        const CHUNK: usize = 2048;
        assert_eq!(chunks.len(), 2 * 2 * CHUNK);
        let at = |band: usize, step: usize, j: usize, lane: usize, half: usize| {
            let base = (band * 2 + step) * CHUNK + j * 512 + lane * 16 + half * 8;
            &chunks[base..base + 8]
        };
        // The codes [from, from + 4) and [from + 16, from + 20) of `row`.
        let runs = |row: usize, from: usize| {
            let first = &codes[row * inp + from..row * inp + from + 4];
            let second = &codes[row * inp + from + 16..row * inp + from + 20];
            [first, second].concat()
        };
        // Band 0, step 0, group 1, lane 6 (g = 1, t = 2): row 1 then row 9, K 32 + 8 and 32 + 24.
        assert_eq!(at(0, 0, 1, 6, 0), runs(1, 40));
        assert_eq!(at(0, 0, 1, 6, 1), runs(9, 40));
        // Band 1, step 1, group 0, lane 13 (g = 3, t = 1): row 19, K 132 and 148; row 27 is past
        // out.
        assert_eq!(at(1, 1, 0, 13, 0), runs(19, 132));
        assert_eq!(at(1, 1, 0, 13, 1), &[0u8; 8]);
        // Group 1 of step 1 starts at K 160 = inp: zero.
        assert_eq!(at(1, 1, 1, 0, 0), &[0u8; 8]);
    }

    #[test]
    fn fp4_chunks_hold_each_lanes_packed_codes_and_zero_padding() {
        // 20 rows, 160 inputs = 80 packed bytes per row: a partial second step of 64 bytes.
        let (out, inp) = (20usize, 160usize);
        let row_bytes = inp / 2;
        let packed: Vec<u8> = (0..out * row_bytes).map(|i| (i % 251) as u8 + 1).collect();
        let chunks = fragment_chunks(&packed, out, row_bytes, FP4_HALF_PIECE, copy_piece);
        const CHUNK: usize = 1024;
        assert_eq!(chunks.len(), 2 * 2 * CHUNK);
        let at = |band: usize, step: usize, j: usize, lane: usize, half: usize| {
            let base = (band * 2 + step) * CHUNK + j * 256 + lane * 8 + half * 4;
            &chunks[base..base + 4]
        };
        // The packed bytes of codes [from, from + 4) and [from + 16, from + 20) of `row`.
        let runs = |row: usize, from: usize| {
            let at = row * row_bytes + from / 2;
            [&packed[at..at + 2], &packed[at + 8..at + 10]].concat()
        };
        // Band 0, step 0, group 1, lane 6 (g = 1, t = 2): codes 40 .. 44 and 56 .. 60 of row 1,
        // then of row 9.
        assert_eq!(at(0, 0, 1, 6, 0), runs(1, 40));
        assert_eq!(at(0, 0, 1, 6, 1), runs(9, 40));
        // Band 1, step 1, group 0, lane 13 (g = 3, t = 1): row 19, codes 132 and 148; row 27 is
        // past out.
        assert_eq!(at(1, 1, 0, 13, 0), runs(19, 132));
        assert_eq!(at(1, 1, 0, 13, 1), &[0u8; 4]);
        // Group 1 of step 1 starts at code 160 = inp: zero.
        assert_eq!(at(1, 1, 1, 0, 0), &[0u8; 4]);
        // The upload's layout: the same places, each piece re-packed (padding stays zero).
        let laid = fragment_chunks(&packed, out, row_bytes, FP4_HALF_PIECE, fp4_piece_order);
        for (piece, raw) in laid.chunks_exact(4).zip(chunks.chunks_exact(4)) {
            let mut expected = [0u8; 4];
            fp4_piece_order(&raw[..2], &raw[2..], &mut expected);
            assert_eq!(piece, expected);
        }
        // Row 1's piece of lane 6, group 1: byte i the codes 40 + i and 56 + i.
        let code = |c: usize| (packed[row_bytes + c / 2] >> (4 * (c % 2))) & 0xf;
        let base = 256 + 6 * 8;
        for i in 0..4 {
            assert_eq!(laid[base + i], code(40 + i) | (code(56 + i) << 4));
        }
    }

    #[test]
    fn fp4_band_scales_are_per_band_group_and_row() {
        // 18 rows, 3 groups: two bands, the second with 2 rows.
        let scales: Vec<u8> = (0..18 * 3).map(|i| i as u8 + 1).collect();
        let banded = fp4_band_scales(&scales, 18, 3);
        assert_eq!(banded.len(), 2 * 3 * 16);
        // Band 0, group 2, row 5.
        assert_eq!(banded[2 * 16 + 5], scales[5 * 3 + 2]);
        // Band 1, group 1, row 17 (r = 1); row 18 (r = 2) is past out.
        assert_eq!(banded[(3 + 1) * 16 + 1], scales[17 * 3 + 1]);
        assert_eq!(banded[(3 + 1) * 16 + 2], 0);
    }

    /// The value of an E4M3 byte (finite codes).
    fn e4m3(b: u8) -> f32 {
        let (e, m) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
        let v = if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e - 7)
        };
        if b & 0x80 != 0 { -v } else { v }
    }

    /// Every tile of the kernels, `Auto` aside.
    const TILES: [FastTile; 4] = [FastTile::Rows8, FastTile::Rows32, FastTile::Rows64, FastTile::Rows128];

    /// Fails unless each line is in gemm_fast.cuh: the kernel rules a test restates in Rust.
    fn assert_in_kernel_source(lines: &[&str]) {
        let header = include_str!("../../cuda/gemm/gemm_fast.cuh");
        for line in lines {
            assert!(header.contains(line), "{line} not in gemm_fast.cuh");
        }
    }

    #[test]
    fn the_scale_products_space_is_sized_for_exactly_the_tiles_that_form_them() {
        // gemm_fast_tile forms a warp's scale products in shared memory after the stages where
        // PRODUCTS holds: one weight scale per band (FP8) and 32 tokens or more. products_bytes
        // must size exactly those launches, or the kernel writes past its shared memory.
        assert_in_kernel_source(&[
            "constexpr bool PRODUCTS = W::BAND_SCALE && BT >= 32;",
            "static constexpr bool BAND_SCALE = true;  // one scale for the band's 16 rows",
            "static constexpr bool BAND_SCALE = false;  // a scale per row",
        ]);
        for kernels in FastKernels::ALL {
            for tile in TILES {
                let shape = kernels.shape(tile);
                let forms = matches!(kernels, FastKernels::Fp8(_)) && shape.tokens >= 32;
                let expected = if forms { shape.warps * 2 * shape.tokens * 4 } else { 0 };
                assert_eq!(kernels.products_bytes(shape), expected, "{kernels:?} {tile:?}");
            }
        }
    }

    #[test]
    fn the_running_totals_space_is_sized_for_exactly_the_tiles_that_fold() {
        // A folding tile (FOLDS, gemm_fast_dense) keeps its running totals after the products:
        // [TILES][THREADS] float4, thread x's n8 tile i at i THREADS + x. totals_bytes must size
        // exactly those launches, or the kernel writes past its shared memory; FastKernel::folds
        // must be set for exactly them, or a folded launch runs a tile that sums K in one chain.
        assert_in_kernel_source(&[
            "constexpr bool FOLDS = BT >= 128;",
            "const bool folded = FOLDS && p.folded;",
            "constexpr u32_t PRODUCTS_BYTES = PRODUCTS ? WARPS * 2 * BT * 4 : 0;",
            "reinterpret_cast<float4*>(smem + STAGES * L::BYTES + PRODUCTS_BYTES) + i * THREADS",
            "gemm_fast_tile<W, 32, WARPS, BT, STAGES, STEP, false>(",
        ]);
        for kernels in FastKernels::ALL {
            for tile in TILES {
                let shape = kernels.shape(tile);
                let folds = kernels != FastKernels::Fp4Routed && shape.tokens >= 128;
                assert_eq!(kernels.tile_folds(shape), folds, "{kernels:?} {tile:?}");
                // TILES (tokens / 8) float4 for each of THREADS (warps * 32).
                let expected = if folds { shape.tokens / 8 * shape.warps * 32 * 16 } else { 0 };
                assert_eq!(kernels.totals_bytes(shape), expected, "{kernels:?} {tile:?}");
            }
        }
    }

    #[test]
    fn launches_fold_their_k_parts_where_the_folded_blocks_fill_the_sms_no_worse() {
        let fp8 = FastKernels::Fp8(ActGroup::G32);
        let folds = |m, n, k, planes| fp8.folds(FastTile::Auto, m, (n, k), planes, H200_SMS);
        // A 1024-token prefill of the V4.1 block: the index's wq_b (1280 -> 4096, 3 parts:
        // 256 blocks in 2 waves of 3 parts against 6) folds; wq_a (80 blocks of 5 parts against
        // 4 waves), wkv (32 blocks of 10 parts against 3), wo_b and w2 (320 blocks: 6 against 5)
        // and the shared expert's pair (2 x 144 blocks of 4 parts: 12 against 9) stay split.
        assert!(folds(1024, 4096, 1280, 1));
        for (n, k, planes) in [
            (1280, 5120, 1),
            (512, 5120, 1),
            (5120, 8192, 1),
            (5120, 2304, 1),
            (2304, 5120, 2),
        ] {
            assert!(!folds(1024, n, k, planes), "{n}x{k} x{planes}");
        }
        // One part: nothing to fold (wq_b).
        assert!(!folds(1024, 32768, 1280, 1));
        // Longer prefills fold them all but the narrowest.
        for (n, k, planes) in [(5120, 8192, 1), (5120, 2304, 1), (2304, 5120, 2), (4096, 1280, 1)]
        {
            assert!(folds(4096, n, k, planes), "{n}x{k} x{planes}");
        }
        // Only the 128-row tile folds: never at 64 rows or fewer, nor when it is forced there.
        assert!(!folds(64, 4096, 1280, 1));
        assert!(!fp8.folds(FastTile::Rows64, 1024, (4096, 1280), 1, H200_SMS));
        assert!(fp8.folds(FastTile::Rows128, 1024, (4096, 1280), 1, H200_SMS));
        assert!(!FastKernels::Fp4Routed.folds(FastTile::Rows128, 1024, (4096, 1280), 1, H200_SMS));
        // The pair's two planes make twice the blocks: it folds where one weight does not.
        assert!(folds(257, 2304, 5120, 2) && !folds(257, 2304, 5120, 1));
        // The rule: waves of the folded launch at most 9/8 of the split one's.
        assert!(folded(132, 2, 132) && !folded(133, 2, 132) && folded(264, 2, 132));
        assert!(!folded(1000, 1, 132));
        // Waves are the device's: on 148 multiprocessors (a B200) 148 blocks of 2 parts fold.
        assert!(folded(148, 2, 148) && !folded(148, 2, 132));
        // wq_b at a 1024-token prefill folds on 132 multiprocessors (256 blocks: 2 waves of 3
        // parts: 6 waves against the split launch's 6); on 78 (12 against 10) it does not.
        assert!(!fp8.folds(FastTile::Auto, 1024, (4096, 1280), 1, 78));
    }

    #[test]
    fn the_kernels_e2m1_to_e4m3_conversion_is_exact_for_every_code_in_every_position() {
        // The kernel's e2m1x8_to_e4m3 (gemm_fast.cuh, these two lines) on a lane's 4 packed
        // bytes after the upload's fp4_piece_order: every byte is 2^-6 times its code's value.
        assert_in_kernel_source(&[
            "lo = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1c1c1c1cu);",
            "hi = (w & 0x80808080u) | ((w >> 2) & 0x1c1c1c1cu);",
        ]);
        let convert = |w: u32| {
            (
                ((w << 4) & 0x8080_8080) | ((w << 2) & 0x1c1c_1c1c),
                (w & 0x8080_8080) | ((w >> 2) & 0x1c1c_1c1c),
            )
        };
        let e2m1 = |code: u32| {
            let v = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(code & 7) as usize];
            if code & 8 != 0 { -v } else { v }
        };
        // Every code in every nibble, beside every code in a neighbouring nibble.
        for position in 0..8u32 {
            for code in 0..16u32 {
                for other in 0..16u32 {
                    let neighbour = (position + 1) % 8;
                    let packed = (code << (4 * position)) | (other << (4 * neighbour));
                    let mut laid = [0u8; 4];
                    let bytes = packed.to_le_bytes();
                    fp4_piece_order(&bytes[..2], &bytes[2..], &mut laid);
                    let (lo, hi) =
                        convert(u32::from_le_bytes([laid[0], laid[1], laid[2], laid[3]]));
                    let bytes = (u64::from(hi) << 32) | u64::from(lo);
                    for i in 0..8u32 {
                        let nibble = (packed >> (4 * i)) & 0xf;
                        let byte = ((bytes >> (8 * i)) & 0xff) as u8;
                        let got = e4m3(byte) * 64.0;
                        assert!(
                            got == e2m1(nibble) && got.is_sign_negative() == (nibble & 8 != 0),
                            "packed {packed:#010x}: code {i} = {nibble:#x} gave E4M3 {byte:#04x}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn k_parts_depend_on_the_shape_cover_k_and_cut_no_stage() {
        // The H200 figures' shapes: 5120 -> 6144 (192 column blocks) in 2 parts, wq_a 5120 ->
        // 1280 (40 column blocks) in 5 of 1024 codes, wq_b 1280 -> 32768 in one.
        assert_eq!(k_parts(6144, 5120), (2560, 2));
        assert_eq!(k_parts(1280, 5120), (1024, 5));
        assert_eq!(k_parts(32768, 1280), (1536, 1));
        // A short last part.
        assert_eq!(k_parts(203, 544), (512, 2));
        for (n, k) in [(1, 32), (7, 4096), (2304, 5120), (5120, 2304), (131, 1024)] {
            let (span, parts) = k_parts(n, k);
            assert!(span.is_multiple_of(PART_QUANTUM), "{n}x{k}: span {span}");
            assert!(
                parts >= 1 && (parts - 1) * span < k && parts * span >= k,
                "{n}x{k}"
            );
        }
    }

    #[test]
    fn a_pair_must_share_format_and_shape_and_its_error_names_both() {
        let fp8 = |out, inp, tile| DenseForm::Fp8 { out, inp, tile };
        let fp4 = DenseForm::Fp4 {
            out: 2304,
            inp: 5120,
        };
        assert_eq!(
            fp8(2304, 5120, 32).to_string(),
            "FP8 [2304, 5120] in 32x32 tiles"
        );
        assert_eq!(fp4.to_string(), "FP4 [2304, 5120]");
        assert!(check_pair("op", fp8(2304, 5120, 32), fp8(2304, 5120, 32)).is_ok());
        assert!(check_pair("op", fp4, fp4).is_ok());
        let first = fp8(2304, 5120, 32);
        for second in [
            fp8(2304, 5120, 128),
            fp8(2304, 4096, 32),
            fp8(2048, 5120, 32),
            fp4,
        ] {
            let error = check_pair("gemm_fp8_fast", first, second)
                .expect_err("a mismatched pair")
                .to_string();
            assert_eq!(
                error,
                format!(
                    "bad arguments to gemm_fp8_fast: a pair of weights in one launch must share \
                     format and shape: {first} and {second}"
                )
            );
        }
    }

    #[test]
    fn projections_are_one_weight_or_a_pair_in_plane_order() {
        let (w1, w3) = (1u8, 3u8);
        assert_eq!((&w1).weights(), [&w1]);
        assert_eq!([&w1, &w3].weights(), [&w1, &w3]);
    }

    #[test]
    fn e8m0_scales_decode_to_powers_of_two() {
        assert_eq!(e8m0_value(127), 1.0);
        assert_eq!(e8m0_value(130), 8.0);
        assert_eq!(e8m0_value(0), 2f32.powi(-127));
        assert!(e8m0_value(255).is_nan());
    }
}
