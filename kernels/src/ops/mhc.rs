//! mHC on the device (`CpuBackend::hc_mixes_rows` / `hc_collapse_rows_at` / `hc_expand_rows_at`)
//! for a batch of tokens in one launch: the coefficients (projection in the CPU sgemm order, sigmoids,
//! Sinkhorn; one block per K chain of the sgemm order and tile of 32 tokens (64 at prefill for
//! hc <= 4) computes the fixed-order projection partials, one block per token its sum of squares, then one block per
//! token combines them), the collapse of `hc` streams into one bf16 row and the
//! expansion back (grid.y = token, each token with its own weights / mixes). All f32 storage; bit-exact with the CPU
//! reference (the mean of squares in torch's CPU sum order, as `sum_squares_f32_torch`), and a
//! token's results never depend on the others (batch invariant).

use cudarc::driver::CudaSlice;

use super::{Rounding, dim, ensure, expect_len, launch_config, sgemm_chains, whole_rows};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::{HcElementwiseParams, HcMixesParams};
use crate::runtime::KernelRuntime;

const THREADS: u32 = 256;
/// Dynamic shared memory the combining block stages a token's partials in.
const MAX_PARTIAL_BYTES: usize = 40 * 1024;
/// Must match `mhc::PARTIAL_THREADS`.
const PARTIAL_THREADS: u32 = 256;
/// Must match `mhc::TOKEN_TILE`, `mhc::WIDE_TILE` and `mhc::WIDE_HC`: the tokens of one K-chain
/// block, and the sum-of-squares blocks in front of a token tile's K-chain blocks, are
/// [`token_tile`]'s.
const TOKEN_TILE: usize = 32;
const WIDE_TILE: usize = 64;
const WIDE_HC: usize = 4;
const ELEMENTWISE_THREADS: u32 = 256;
/// Must match `mhc::MAX_HC`.
pub const MAX_HC: usize = 8;
/// Must match `mhc::PARTIAL_STAGES` and `mhc::TILE_STRIDE`: a K-chain block stages its passes in
/// `PARTIAL_STAGES` slots of `tile + projections` rows of `TILE_STRIDE` floats.
const PARTIAL_STAGES: usize = 4;
const TILE_STRIDE: usize = 36;

/// The tokens of a K-chain block when a launch holds `tokens` tokens of `hc` streams
/// (`mhc::token_tile`): past 32 tokens, tiles of 64 in registers for hc <= 4.
fn token_tile(tokens: usize, hc: usize) -> usize {
    if tokens > TOKEN_TILE && hc <= WIDE_HC {
        WIDE_TILE
    } else {
        TOKEN_TILE
    }
}

/// The dynamic shared memory of the partials launch for tiles of `tile` tokens and `projections`
/// projections (`mhc::partial_stage_floats`).
fn partial_stage_bytes(tile: usize, projections: usize) -> usize {
    PARTIAL_STAGES * (tile + projections) * TILE_STRIDE * 4
}

/// The dynamic shared memory the partials kernel is allowed: the most of `MAX_HC`'s projections
/// (32-token tiles) and `WIDE_HC`'s (64-token tiles).
pub(crate) fn dynamic_shared_bytes(id: KernelId) -> Option<u32> {
    let most = partial_stage_bytes(TOKEN_TILE, (2 + MAX_HC) * MAX_HC)
        .max(partial_stage_bytes(WIDE_TILE, (2 + WIDE_HC) * WIDE_HC)) as u32;
    (id == KernelId::HcMixesPartialsF32).then_some(most)
}
/// The most tokens one collapse / expand launch takes (the grid's y limit).
pub const MAX_TOKENS_PER_LAUNCH: usize = 65_535;

/// The scalar settings of [`hc_mixes_rows_f32`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcMixesConfig {
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub norm_eps: f32,
}

/// The mHC coefficients of every token of `x [tokens, width]` (`width = hc · dim` values per
/// token): a partials launch (grid: one block per K chain of the sgemm order plus one
/// sum-of-squares block per token, × tiles of [`token_tile`] tokens) into a scratch buffer, then one block
/// per token: `out [tokens, 2 · hc + hc²]`, each row `pre ++ post ++ comb`.
/// `proj [(2 + hc) · hc, width]`, `base [(2 + hc) · hc]`, `scale [3]` are shared by all tokens.
#[allow(clippy::too_many_arguments)]
pub fn hc_mixes_rows_f32(
    rt: &KernelRuntime,
    x: &CudaSlice<f32>,
    width: usize,
    proj: &CudaSlice<f32>,
    base: &CudaSlice<f32>,
    scale: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    config: HcMixesConfig,
) -> Result<(), KernelError> {
    const OP: &str = "hc_mixes_f32";
    let HcMixesConfig {
        hc,
        sinkhorn_iters,
        hc_eps,
        norm_eps,
    } = config;
    let n = width;
    ensure(
        hc != 0 && hc <= MAX_HC && n != 0 && n.is_multiple_of(hc),
        OP,
        || {
            format!(
                "hc = {hc} must be in 1..={MAX_HC} and a token's width ({n} values) a positive \
                 multiple of it"
            )
        },
    )?;
    ensure(!x.is_empty() && x.len().is_multiple_of(n), OP, || {
        format!(
            "x holds {} values, not a positive number of {n}-wide tokens",
            x.len()
        )
    })?;
    let tokens = x.len() / n;
    let projections = (2 + hc) * hc;
    expect_len(OP, "proj", proj.len(), projections * n)?;
    expect_len(OP, "base", base.len(), projections)?;
    expect_len(OP, "scale", scale.len(), 3)?;
    expect_len(OP, "out", out.len(), tokens * (2 * hc + hc * hc))?;
    let params = HcMixesParams {
        hc: dim(OP, "hc", hc)?,
        n: dim(OP, "n", n)?,
        sinkhorn_iters: dim(OP, "sinkhorn_iters", sinkhorn_iters)?,
        hc_eps,
        norm_eps,
    };
    let tasks = projections * sgemm_chains(n);
    let per_token_scratch = tasks + 1;
    ensure(per_token_scratch * 4 <= MAX_PARTIAL_BYTES, OP, || {
        format!(
            "{projections} projections of {n} values need {} bytes of partials per token (> \
                 {MAX_PARTIAL_BYTES})",
            per_token_scratch * 4
        )
    })?;
    // SAFETY: every value is written by hc_mixes_partials_f32 (each task's partial and the sum of
    // squares of each token) before hc_mixes_f32 reads it, in stream order.
    let mut scratch = unsafe { rt.alloc_written::<f32>(tokens * per_token_scratch) }
        .map_err(KernelError::driver("allocating the hc_mixes partials"))?;
    let token_grid = dim(OP, "tokens", tokens)?;
    ensure(token_grid <= MAX_TOKENS_PER_LAUNCH as u32, OP, || {
        format!("{tokens} tokens exceed {MAX_TOKENS_PER_LAUNCH} per launch")
    })?;
    let tile = token_tile(tokens, hc);
    let (blocks, token_tiles) = partials_grid(tokens, n, hc);
    let partials_cfg = launch_config(
        (
            dim(OP, "partial blocks", blocks)?,
            dim(OP, "token tiles", token_tiles)?,
            1,
        ),
        PARTIAL_THREADS,
        dim(OP, "partials' shared memory", partial_stage_bytes(tile, projections))?,
    );
    let mut launch = rt.launcher(KernelId::HcMixesPartialsF32)?;
    launch
        .arg(x)
        .arg(proj)
        .arg(&mut scratch)
        .arg(&params)
        .arg(&token_grid);
    // SAFETY: signature (const float* x, const float* proj, float* scratch, HcMixesParams,
    // u32_t tokens); x holds tokens * n and proj projections * n values (checked above), scratch
    // tokens * (tasks + 1); grid.x = `tile` sum-of-squares blocks + one block per K chain,
    // grid.y = the token tiles covering `tokens` (the kernel skips tokens >= tokens), `tile` the
    // kernel's own mhc::token_tile(tokens, hc); the dynamic shared memory holds the staged passes
    // of `tile` tokens and `projections` (at most the allowed most).
    unsafe { launch.launch(partials_cfg) }?;
    let cfg = launch_config(
        (token_grid, 1, 1),
        THREADS,
        dim(OP, "shared memory", tasks * 4)?,
    );
    let mut launch = rt.launcher(KernelId::HcMixesF32)?;
    launch
        .arg(&scratch)
        .arg(base)
        .arg(scale)
        .arg(out)
        .arg(&params);
    // SAFETY: signature (const float* scratch, const float* base, const float* scale, float* out,
    // HcMixesParams); one block per token, scratch holding tokens * (tasks + 1) values written
    // by the launch above and out tokens * (2hc + hc²) (checked above), the dynamic shared memory
    // holding one token's tasks partials (its sum of squares is read in place); hc <= MAX_HC, the
    // hc the kernel is instantiated for.
    unsafe { launch.launch(cfg) }
}

/// The partials launch's grid for `tokens` tokens of `hc` streams of `n` values: ([`token_tile`]
/// sum-of-squares blocks + one block per K chain of the sgemm order, token tiles covering
/// `tokens`).
fn partials_grid(tokens: usize, n: usize, hc: usize) -> (usize, usize) {
    let tile = token_tile(tokens, hc);
    (tile + sgemm_chains(n), tokens.div_ceil(tile))
}

fn elementwise_params(
    op: &'static str,
    hc: usize,
    dim_: usize,
    tokens: usize,
    rounding: Rounding,
) -> Result<HcElementwiseParams, KernelError> {
    ensure(
        hc != 0 && dim_ != 0 && tokens != 0 && tokens <= MAX_TOKENS_PER_LAUNCH,
        op,
        || {
            format!(
                "hc = {hc}, dim = {dim_} and tokens = {tokens} must be positive (tokens <= \
                 {MAX_TOKENS_PER_LAUNCH})"
            )
        },
    )?;
    Ok(HcElementwiseParams {
        hc: dim(op, "hc", hc)?,
        dim: dim(op, "dim", dim_)?,
        round_bf16: rounding.flag(),
    })
}

/// `y [t, dim] = round(Σ_k w [t, k] · x [t, k, dim])` for every token `t` of `w [tokens, hc]`, in
/// one launch (grid.y = token).
pub fn hc_collapse_rows_f32(
    rt: &KernelRuntime,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    hc: usize,
    rounding: Rounding,
) -> Result<(), KernelError> {
    const OP: &str = "hc_collapse_f32";
    let tokens = whole_rows(OP, w.len(), hc, || {
        format!("w holds {} values, not whole tokens of hc = {hc}", w.len())
    })?;
    let width = y.len().checked_div(tokens).unwrap_or(0);
    let params = elementwise_params(OP, hc, width, tokens, rounding)?;
    expect_len(OP, "y", y.len(), tokens * width)?;
    expect_len(OP, "x", x.len(), tokens * hc * width)?;
    let cfg = launch_config(
        (
            params.dim.div_ceil(ELEMENTWISE_THREADS),
            dim(OP, "tokens", tokens)?,
            1,
        ),
        ELEMENTWISE_THREADS,
        0,
    );
    let mut launch = rt.launcher(KernelId::HcCollapseF32)?;
    launch.arg(x).arg(w).arg(y).arg(&params);
    // SAFETY: signature (const float* x, const float* w, float* y, HcElementwiseParams); x holds
    // tokens * hc * dim, w tokens * hc and y tokens * dim values (checked above), grid.y = tokens
    // <= the grid limit; the kernel bounds-checks d.
    unsafe { launch.launch(cfg) }
}

/// `out [t, k, dim] = round(post_k · y [t] + Σ_j comb[j, k] · residual [t, j, dim])` for every
/// token `t` with its own mixes, read in place from [`hc_mixes_rows_f32`]'s rows
/// (`mixes [tokens, 2 · hc + hc²]`, each `pre ++ post ++ comb`), in one launch (grid.y = token).
pub fn hc_expand_rows_f32(
    rt: &KernelRuntime,
    y: &CudaSlice<f32>,
    residual: &CudaSlice<f32>,
    mixes: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    hc: usize,
    rounding: Rounding,
) -> Result<(), KernelError> {
    const OP: &str = "hc_expand_f32";
    let mix_width = 2 * hc + hc * hc;
    let tokens = whole_rows(OP, mixes.len(), mix_width, || {
        format!(
            "mixes hold {} values, not whole tokens of {mix_width} (hc = {hc})",
            mixes.len()
        )
    })?;
    let width = y.len().checked_div(tokens).unwrap_or(0);
    let params = elementwise_params(OP, hc, width, tokens, rounding)?;
    expect_len(OP, "y", y.len(), tokens * width)?;
    expect_len(OP, "residual", residual.len(), tokens * hc * width)?;
    expect_len(OP, "out", out.len(), tokens * hc * width)?;
    ensure(hc <= MAX_HC, OP, || {
        format!("hc = {hc} streams (at most {MAX_HC})")
    })?;
    let cfg = launch_config(
        (
            params.dim.div_ceil(ELEMENTWISE_THREADS),
            dim(OP, "tokens", tokens)?,
            1,
        ),
        ELEMENTWISE_THREADS,
        0,
    );
    let mut launch = rt.launcher(KernelId::HcExpandF32)?;
    launch.arg(y).arg(residual).arg(mixes).arg(out).arg(&params);
    // SAFETY: signature (const float* y, const float* residual, const float* mixes, float* out,
    // HcElementwiseParams); y holds tokens * dim, residual and out tokens * hc * dim, mixes
    // tokens * (2hc + hc²) values (checked above), hc <= MAX_HC (the kernel's residual registers),
    // grid.y = tokens <= the grid limit; the kernel bounds-checks d < dim.
    unsafe { launch.launch(cfg) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = include_str!("../../cuda/mhc/mhc.cuh");

    #[test]
    fn launcher_constants_match_the_kernel() {
        assert!(SOURCE.contains(&format!(" PARTIAL_THREADS = {PARTIAL_THREADS};")));
        assert!(SOURCE.contains(&format!(" TOKEN_TILE = {TOKEN_TILE};")));
        assert!(SOURCE.contains(&format!(" WIDE_TILE = {WIDE_TILE};")));
        assert!(SOURCE.contains(&format!(" WIDE_HC = {WIDE_HC};")));
        assert!(SOURCE.contains(
            "return tokens > TOKEN_TILE && hc <= WIDE_HC ? WIDE_TILE : TOKEN_TILE;"
        ));
        assert!(SOURCE.contains(&format!(" MAX_HC = {MAX_HC};")));
        assert!(SOURCE.contains(&format!(" THREADS = {THREADS};")));
        assert!(SOURCE.contains(&format!(" PARTIAL_STAGES = {PARTIAL_STAGES};")));
        assert!(SOURCE.contains("TILE_K = 32;") && SOURCE.contains("TILE_STRIDE = TILE_K + 4;"));
        assert_eq!(TILE_STRIDE, 32 + 4);
    }

    #[test]
    fn the_partials_stages_fit_the_allowed_shared_memory() {
        // V4.1 (hc 4, 24 projections) at decode stays under the 48 KiB default, its 64-token
        // prefill tiles do not; MAX_HC's 80 projections of 32-token tiles are the most, and fit
        // an SM.
        assert_eq!(partial_stage_bytes(32, 24), 4 * 56 * 36 * 4);
        assert!(partial_stage_bytes(32, 24) <= 48 * 1024);
        assert_eq!(partial_stage_bytes(64, 24), 4 * 88 * 36 * 4);
        let most = dynamic_shared_bytes(KernelId::HcMixesPartialsF32).unwrap() as usize;
        assert_eq!(most, partial_stage_bytes(32, 80));
        assert!(partial_stage_bytes(64, 24) < most);
        assert!(most + 5 * 1024 <= 227 * 1024);
        assert_eq!(dynamic_shared_bytes(KernelId::HcMixesF32), None);
    }

    #[test]
    fn the_partials_grid_covers_every_token_and_chain() {
        // The real V4.1 width (hc 4 x dim 5120): 64 chains of 320 products; 32-token tiles up to
        // 32 tokens, then 64-token tiles.
        assert_eq!(partials_grid(1, 20_480, 4), (32 + 64, 1));
        assert_eq!(partials_grid(32, 20_480, 4), (32 + 64, 1));
        assert_eq!(partials_grid(33, 20_480, 4), (64 + 64, 1));
        assert_eq!(partials_grid(70, 20_480, 4), (64 + 64, 2));
        assert_eq!(partials_grid(1024, 20_480, 4), (64 + 64, 16));
        // Past WIDE_HC always 32-token tiles.
        assert_eq!(partials_grid(1024, 20_480, 5), (32 + 64, 32));
        // Below 512 values a single chain.
        assert_eq!(partials_grid(17, 7, 1), (32 + 1, 1));
        for hc in 1..=MAX_HC {
            for tokens in 1..200 {
                let tile = token_tile(tokens, hc);
                assert_eq!(tile == WIDE_TILE, tokens > 32 && hc <= 4);
                let (blocks, tiles) = partials_grid(tokens, 4120, hc);
                assert_eq!(blocks, tile + sgemm_chains(4120));
                assert!(tiles * tile >= tokens && (tiles - 1) * tile < tokens);
            }
        }
    }
}
