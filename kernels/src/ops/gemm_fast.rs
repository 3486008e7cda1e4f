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

use super::gemm::DeviceFp8Weight;
use super::quant::{ActGroup, DeviceActFp8};
use super::{dim, expect_len};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::FastGemmParams;
use crate::runtime::KernelRuntime;

const OP: &str = "gemm_fp8_fast";
/// K bytes per pipeline stage and the padded shared-memory row (`STEP_K`, `ROW_BYTES`).
const STEP_K: u32 = 128;
const ROW_BYTES: u32 = STEP_K + 32;
/// Output features per weight-scale band (one warp's mma rows).
const BAND: usize = 16;

/// A tile configuration of the fast GEMM: token rows per block, warps per block (16 output
/// features each) and pipeline stages; must match the instantiations in `gemm_fp8_fast.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastTile {
    /// Chosen by M: the smallest token tile that holds M, 128 above 64 rows.
    Auto,
    Rows8,
    Rows32,
    Rows64,
    Rows128,
}

/// (token rows, warps, stages) of each tile, in [`FastTile`] order after `Auto`.
const TILES: [(FastTile, u32, u32, u32); 4] = [
    (FastTile::Rows8, 8, 2, 8),
    (FastTile::Rows32, 32, 2, 6),
    (FastTile::Rows64, 64, 2, 5),
    (FastTile::Rows128, 128, 8, 3),
];

impl FastTile {
    fn resolve(self, rows: usize) -> FastTile {
        match self {
            FastTile::Auto => TILES
                .iter()
                .find(|(_, tokens, _, _)| rows <= *tokens as usize)
                .map_or(FastTile::Rows128, |t| t.0),
            tile => tile,
        }
    }

    /// (token rows, warps, stages).
    fn shape(self) -> (u32, u32, u32) {
        let (_, tokens, warps, stages) = TILES
            .iter()
            .copied()
            .find(|t| t.0 == self)
            .unwrap_or(TILES[3]);
        (tokens, warps, stages)
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
        let (tokens, warps, stages) = self.shape();
        let groups_per_stage = STEP_K / group.elements() as u32;
        let stage = 16 * warps * ROW_BYTES
            + tokens * ROW_BYTES
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

/// An FP8 weight prepared for the fast GEMM: the checkpoint's codes and UE8M0 tile scales
/// ([`DeviceFp8Weight`]) plus the scales as f32 per 16-row band and k-group
/// (`[ceil(out / 16), inp / tile]`), the layout the kernel streams with the codes.
#[derive(Debug)]
pub struct FastFp8Weight {
    pub weight: DeviceFp8Weight,
    pub band_scales: CudaSlice<f32>,
}

impl FastFp8Weight {
    /// Uploads checkpoint bytes (checked as [`DeviceFp8Weight::upload`] does; `inp` must also
    /// be a multiple of `tile`, the activation group).
    pub fn upload(
        rt: &KernelRuntime,
        out: usize,
        inp: usize,
        tile: usize,
        codes: &[u8],
        scales: &[u8],
    ) -> Result<FastFp8Weight, KernelError> {
        const OP: &str = "FastFp8Weight::upload";
        let weight = DeviceFp8Weight::upload(rt, out, inp, tile, codes, scales)?;
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
        Ok(FastFp8Weight {
            weight,
            band_scales,
        })
    }
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
    let (n, k) = (w.weight.out, w.weight.inp);
    if a.group.elements() != w.weight.tile {
        return Err(KernelError::Shape {
            op: OP,
            message: format!(
                "{}-element activation groups with {}x{} weight tiles (they must match)",
                a.group.elements(),
                w.weight.tile,
                w.weight.tile
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
    let (tokens, warps, _) = tile.shape();
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
        .arg(&w.weight.codes)
        .arg(&w.band_scales)
        .arg(y)
        .arg(&params);
    // SAFETY: the kernel's signature is (const u8* a, const float* sa, const u8* w, const float*
    // wsb, bf16* y, FastGemmParams). The activation buffers hold rows * k codes and rows * k /
    // group scales (DeviceActFp8's invariant), the weight codes [n, k] were length-checked at
    // upload and the band scales hold ceil(n / 16) * k / group values; every load is bounds-
    // checked against m, n, k in the kernel, and y holds m * n values.
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
        // Stage::BYTES for G = 32, 2 warps, 8 tokens: 32 * 160 + 8 * 160 + 4 * 8 * 4 + 4 * 2 * 4.
        assert_eq!(FastTile::Rows8.shared_bytes(ActGroup::G32), 6_560 * 8);
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
    fn e8m0_scales_decode_to_powers_of_two() {
        assert_eq!(e8m0_value(127), 1.0);
        assert_eq!(e8m0_value(130), 8.0);
        assert_eq!(e8m0_value(0), 2f32.powi(-127));
        assert!(e8m0_value(255).is_nan());
    }
}
