//! The `fast` FP8 block-scaled GEMM (ARCHITECTURE.md §3): tensor cores (mma.sync m16n8k32 E4M3,
//! fp32 accumulation) with one promotion per scale group along K,
//! `acc = fma(T_g, s_w · s_a, acc)` in K order (`cuda/gemm/gemm_fp8_fast.cuh`). Not bitwise equal
//! to the CPU reference (the tensor core's in-group sum is not the exact one), but deterministic
//! and batch invariant: every [`FastTile`] computes the same bits for a row, so the tile chosen by
//! M never shows.
//!
//! Error bound against the exact value (f64) — what the GPU tests assert: with `P = Σ_k |a_k w_k|`
//! over a group, the tensor core's fp32-range sum of the group's exact products is within
//! `(G - 1) · 2^-13 · P` (it keeps at least 13 fraction bits per addition on Hopper, DeepSeek-V3
//! §3.3.2 observes ~14), each of the `K / G` promotions adds at most `2^-24 |acc|`, and the bf16
//! output rounding at most `2^-9 |y|`.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use super::gemm::check_fp8_weight;
use super::quant::{ActGroup, DeviceActFp8};
use super::{dim, expect_len};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::FastGemmParams;
use crate::runtime::KernelRuntime;

const OP: &str = "gemm_fp8_fast";
/// K bytes of one weight chunk (`STEP_K` in the kernel).
const STEP_K: u32 = 128;
/// Output features per weight band (one warp's mma rows) and bytes of one band's step.
const BAND: usize = 16;
const CHUNK: usize = BAND * STEP_K as usize;

/// A tile configuration of the fast GEMM: token rows per block, warps per block (16 output
/// features each), pipeline stages and K bytes per stage; must match the instantiations in
/// `gemm_fp8_fast.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastTile {
    /// Chosen by M: the smallest token tile that holds M, 128 above 64 rows.
    Auto,
    Rows8,
    Rows32,
    Rows64,
    Rows128,
}

/// (token rows, warps, stages, K bytes per stage) of each tile, in [`FastTile`] order after
/// `Auto`. The decode tiles take 512 or 256 bytes of K per barrier: fewer, larger steps.
const TILES: [(FastTile, u32, u32, u32, u32); 4] = [
    (FastTile::Rows8, 8, 2, 4, 512),
    (FastTile::Rows32, 32, 2, 3, 512),
    (FastTile::Rows64, 64, 2, 4, 256),
    (FastTile::Rows128, 128, 8, 3, 128),
];

impl FastTile {
    fn resolve(self, rows: usize) -> FastTile {
        match self {
            FastTile::Auto => TILES
                .iter()
                .find(|(_, tokens, ..)| rows <= *tokens as usize)
                .map_or(FastTile::Rows128, |t| t.0),
            tile => tile,
        }
    }

    /// (token rows, warps, stages, K bytes per stage).
    fn shape(self) -> (u32, u32, u32, u32) {
        let (_, tokens, warps, stages, step) = TILES
            .iter()
            .copied()
            .find(|t| t.0 == self)
            .unwrap_or(TILES[3]);
        (tokens, warps, stages, step)
    }

    fn kernel(self, group: ActGroup) -> KernelId {
        match (group, self) {
            (ActGroup::G32, FastTile::Rows8) => KernelId::GemmFp8FastT32B8,
            (ActGroup::G32, FastTile::Rows32) => KernelId::GemmFp8FastT32B32,
            (ActGroup::G32, FastTile::Rows64) => KernelId::GemmFp8FastT32B64,
            (ActGroup::G32, _) => KernelId::GemmFp8FastT32B128,
            (ActGroup::G128, FastTile::Rows8) => KernelId::GemmFp8FastT128B8,
            (ActGroup::G128, FastTile::Rows32) => KernelId::GemmFp8FastT128B32,
            (ActGroup::G128, FastTile::Rows64) => KernelId::GemmFp8FastT128B64,
            (ActGroup::G128, _) => KernelId::GemmFp8FastT128B128,
        }
    }

    /// Dynamic shared memory of a launch (`Stage::BYTES · STAGES` in the kernel).
    fn shared_bytes(self, group: ActGroup) -> u32 {
        let (tokens, warps, stages, step) = self.shape();
        let groups_per_stage = step / group.elements() as u32;
        let stage = warps * CHUNK as u32 * (step / STEP_K)
            + tokens * (step + 32)
            + 4 * tokens * groups_per_stage
            + 4 * warps * groups_per_stage;
        stage.div_ceil(16) * 16 * stages
    }
}

/// The dynamic shared memory kernel `id` needs, for the runtime to allow it at load time (`None`
/// for every kernel that is not a fast GEMM).
pub(crate) fn dynamic_shared_bytes(id: KernelId) -> Option<u32> {
    [ActGroup::G32, ActGroup::G128]
        .into_iter()
        .find_map(|group| {
            TILES
                .iter()
                .find(|t| t.0.kernel(group) == id)
                .map(|t| t.0.shared_bytes(group))
        })
}

/// Allows `function` the dynamic shared memory of fast GEMM `id` (above the 48 KiB default).
pub(crate) fn allow_shared(
    id: KernelId,
    function: &cudarc::driver::CudaFunction,
) -> Result<(), KernelError> {
    if let Some(bytes) = dynamic_shared_bytes(id) {
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
/// 128-byte step of K, the band's codes as one 2 KiB chunk in mma fragment order (see
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

impl FastFp8Weight {
    /// Re-lays and uploads checkpoint bytes (checked as `DeviceFp8Weight::upload` does; `inp`
    /// must also be a multiple of `tile`, the activation group).
    pub fn upload(
        rt: &KernelRuntime,
        out: usize,
        inp: usize,
        tile: usize,
        codes: &[u8],
        scales: &[u8],
    ) -> Result<FastFp8Weight, KernelError> {
        const OP: &str = "FastFp8Weight::upload";
        check_fp8_weight(OP, out, inp, tile, codes, scales)?;
        if !inp.is_multiple_of(tile) {
            return Err(KernelError::Shape {
                op: OP,
                message: format!("[{out}, {inp}]: inp must be a multiple of the tile {tile}"),
            });
        }
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
            .htod(&fragment_chunks(codes, out, inp))
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

/// The codes `[out, inp]` as the kernel streams them: for band b (rows 16b ..) and step s (K bytes
/// 128s ..) the chunk at `(b · steps + s) · 2048` holds, for group j = 0..4 and lane = 0..32
/// (g = lane / 4, t = lane % 4), the 8 bytes of row 16b + g at K 128s + 32j + 8t, then those of
/// row 16b + g + 8: lane's A fragment of group j. Rows past `out` and K past `inp` are zero.
fn fragment_chunks(codes: &[u8], out: usize, inp: usize) -> Vec<u8> {
    let steps = inp.div_ceil(STEP_K as usize);
    let mut chunks = vec![0u8; out.div_ceil(BAND) * steps * CHUNK];
    for (c, chunk) in chunks.chunks_exact_mut(CHUNK).enumerate() {
        let (band, step) = (c / steps, c % steps);
        for (piece, bytes) in chunk.chunks_exact_mut(8).enumerate() {
            let (j, lane, half) = (piece / 64, (piece / 2) % 32, piece % 2);
            let row = BAND * band + lane / 4 + 8 * half;
            let k = STEP_K as usize * step + 32 * j + 8 * (lane % 4);
            if row < out && k < inp {
                bytes.copy_from_slice(&codes[row * inp + k..row * inp + k + 8]);
            }
        }
    }
    chunks
}

/// The value of a UE8M0 scale: `2^(e - 127)`, 255 is NaN.
fn e8m0_value(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::NAN,
        e => f32::from_bits(u32::from(e) << 23),
    }
}

/// `y = a · wᵀ` on tensor cores, bf16 `y [a.rows, w.out]`. The activation group must be the
/// weight's tile side (32: V4.1, 128: V4).
pub fn gemm_fp8_fast(
    rt: &KernelRuntime,
    a: &DeviceActFp8,
    w: &FastFp8Weight,
    y: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    gemm_fp8_fast_tiled(rt, a, w, y, FastTile::Auto)
}

/// [`gemm_fp8_fast`] with an explicit tile (the result does not depend on it).
pub fn gemm_fp8_fast_tiled(
    rt: &KernelRuntime,
    a: &DeviceActFp8,
    w: &FastFp8Weight,
    y: &mut CudaSlice<bf16>,
    tile: FastTile,
) -> Result<(), KernelError> {
    let (n, k) = (w.out, w.inp);
    if a.group.elements() != w.tile {
        return Err(KernelError::Shape {
            op: OP,
            message: format!(
                "{}-element activation groups with {}x{} weight tiles (they must match)",
                a.group.elements(),
                w.tile,
                w.tile
            ),
        });
    }
    if a.cols != k {
        return Err(KernelError::Shape {
            op: OP,
            message: format!("activation has {} columns, weight has {k} inputs", a.cols),
        });
    }
    expect_len(OP, "y", y.len(), a.rows * n)?;
    if a.rows == 0 {
        return Ok(());
    }
    let tile = tile.resolve(a.rows);
    let (tokens, warps, ..) = tile.shape();
    let params = FastGemmParams {
        m: dim(OP, "m", a.rows)?,
        n: dim(OP, "n", n)?,
        k: dim(OP, "k", k)?,
    };
    let row_blocks = params.m.div_ceil(tokens);
    if row_blocks > 65_535 {
        return Err(KernelError::Shape {
            op: OP,
            message: format!("m = {} needs {row_blocks} row blocks (> 65535)", a.rows),
        });
    }
    let kernel = tile.kernel(a.group);
    let cfg = LaunchConfig {
        grid_dim: (params.n.div_ceil(16 * warps), row_blocks, 1),
        block_dim: (warps * 32, 1, 1),
        shared_mem_bytes: tile.shared_bytes(a.group),
    };
    let function = rt.function(kernel)?;
    let mut launch = rt.stream().launch_builder(function);
    launch
        .arg(&a.codes)
        .arg(&a.scales)
        .arg(&w.chunks)
        .arg(&w.band_scales)
        .arg(y)
        .arg(&params);
    // SAFETY: the kernel's signature is (const u8* a, const float* sa, const u8* w, const float*
    // wsb, bf16* y, FastGemmParams). The activation buffers hold rows * k codes and rows * k /
    // group scales (DeviceActFp8's invariant), the weight chunks hold ceil(n / 16) * ceil(k / 128)
    // chunks of 2 KiB and the band scales ceil(n / 16) * k / group values (built at upload from
    // n, k); every load is bounds-checked against m, n, k in the kernel, and y holds m * n values.
    unsafe { launch.launch(cfg) }.map_err(KernelError::driver(format!(
        "launching {}",
        kernel.symbol()
    )))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_smallest_tile_that_holds_the_rows() {
        assert_eq!(FastTile::Auto.resolve(1), FastTile::Rows8);
        assert_eq!(FastTile::Auto.resolve(8), FastTile::Rows8);
        assert_eq!(FastTile::Auto.resolve(9), FastTile::Rows32);
        assert_eq!(FastTile::Auto.resolve(64), FastTile::Rows64);
        assert_eq!(FastTile::Auto.resolve(65), FastTile::Rows128);
        assert_eq!(FastTile::Rows32.resolve(1), FastTile::Rows32);
    }

    #[test]
    fn shared_memory_matches_the_kernel_layout_and_fits_the_h200() {
        // Stage::BYTES for G = 32, 2 warps, 8 tokens, 512 bytes of K:
        // 2 * 4 * 2048 + 8 * 544 + 4 * 8 * 16 + 4 * 2 * 16, four stages.
        assert_eq!(FastTile::Rows8.shared_bytes(ActGroup::G32), 21_376 * 4);
        for group in [ActGroup::G32, ActGroup::G128] {
            for (tile, ..) in TILES {
                assert!(tile.shared_bytes(group) <= 227 * 1024, "{tile:?}");
                assert_eq!(
                    dynamic_shared_bytes(tile.kernel(group)),
                    Some(tile.shared_bytes(group))
                );
            }
        }
        assert_eq!(dynamic_shared_bytes(KernelId::GemmFp8T32G32), None);
    }

    #[test]
    fn chunks_hold_each_lanes_fragments_and_zero_padding() {
        // 20 rows (a partial second band), 160 inputs (a partial second step).
        let (out, inp) = (20usize, 160usize);
        let codes: Vec<u8> = (0..out * inp).map(|i| (i % 251) as u8 + 1).collect();
        let chunks = fragment_chunks(&codes, out, inp);
        assert_eq!(chunks.len(), 2 * 2 * CHUNK);
        let at = |band: usize, step: usize, j: usize, lane: usize, half: usize| {
            let base = (band * 2 + step) * CHUNK + j * 512 + lane * 16 + half * 8;
            &chunks[base..base + 8]
        };
        // Band 0, step 0, group 1, lane 6 (g = 1, t = 2): row 1 then row 9, K 32 + 16.
        assert_eq!(at(0, 0, 1, 6, 0), &codes[inp + 48..inp + 56]);
        assert_eq!(at(0, 0, 1, 6, 1), &codes[9 * inp + 48..9 * inp + 56]);
        // Band 1, step 1, group 0, lane 13 (g = 3, t = 1): row 19, K 136; row 27 is past out.
        assert_eq!(at(1, 1, 0, 13, 0), &codes[19 * inp + 136..19 * inp + 144]);
        assert_eq!(at(1, 1, 0, 13, 1), &[0u8; 8]);
        // Group 1 of step 1 starts at K 160 = inp: zero.
        assert_eq!(at(1, 1, 1, 0, 0), &[0u8; 8]);
    }

    #[test]
    fn e8m0_scales_decode_to_powers_of_two() {
        assert_eq!(e8m0_value(127), 1.0);
        assert_eq!(e8m0_value(130), 8.0);
        assert_eq!(e8m0_value(0), 2f32.powi(-127));
        assert!(e8m0_value(255).is_nan());
    }
}
