//! Device benchmark for the H200: the CUDA kernels one op at a time at real V4.1 widths (`ops`),
//! and whole forward steps of a model on `CudaBackend` (`whole_step`): the v41-tiny fixture and
//! real-width V4.1 (`block`) and V4-Flash (`v4block`) blocks, prefill throughput and decode-step
//! latency at batch 1, 8, 64, each with its bytes, FLOPs and H200 roofline ratio (the V4 block
//! also projected to the whole V4-Flash beside SGLang's published H200 figures); the V4.1 block's
//! sequence state at long contexts against the state pool's byte model (`state`).
//! bench/README.md explains the numbers.
//!
//! Usage (on the H200, after `../shared/tools/gpu-stage.sh cargo build -p deepinfer-bench --release
//! --features cuda --bin device_bench`):
//!
//! ```text
//! DEEPINFER_FIXTURES=$PWD/tests/fixtures bash .gpu/run.sh device_bench \
//!     [--quick] [--sweep] [--sections ops,fast,tiny,block,v4block,profile,state] [--context N]
//!     [--state-contexts N,N,...] [--block-dir DIR] [--numerics fast|exact|both]
//! ```
//!
//! `fast` times the tensor-core FP8 GEMM of the `fast` numerics beside cuBLAS bf16 and the exact
//! kernel. `profile` (in `--sections`) runs the block section with a per-op profile of each phase.
//! `--quick` runs few iterations (a cheap first try), `--sweep` adds the GEMM work-split sweep to
//! the per-op section and the fast GEMMs' tile sweeps (dense FP8, routed FP4 experts) to `fast` (`fast_sweep`), `--context` is the prefilled length of the block's sequences (1024; 128
//! with `--quick`), `--block-dir` where the block's random checkpoint is written (and reused by a
//! later run on the same machine; default /tmp/deepinfer-bench-v41-block; the V4 block's goes
//! beside it, `<DIR>-v4`). `state` fills the
//! block's state to each of `--state-contexts` (8192,32768,131072; 8192 with `--quick`) and
//! decodes from there. `--numerics` picks the blocks' numerics (both by default).

mod cublaslt_fp8;
mod fast_ops;
mod fast_sweep;
mod head_start;
mod ops;
mod whole_step;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use deepinfer_bench::block::BlockFamily;
use deepinfer_model::backend::cuda::Numerics;

/// What to run, from the command line.
struct Options {
    quick: bool,
    sweep: bool,
    ops: bool,
    /// The fast-numerics GEMM against its peers (`fast_ops`).
    fast: bool,
    tiny: bool,
    block: bool,
    /// The real-width V4-Flash block (`whole_step::block` with `BlockFamily::V4`).
    v4block: bool,
    /// The per-op profile of the block's phases (runs the block section).
    profile: bool,
    context: Option<usize>,
    /// The block's state at long contexts against the byte model (`whole_step::state`).
    state: bool,
    state_contexts: Option<Vec<usize>>,
    block_dir: PathBuf,
    /// The numerics the blocks run in (`--numerics fast|exact|both`; both by default).
    block_numerics: Vec<Numerics>,
}

/// `--state-contexts` by default (`--quick`: the first only).
const STATE_CONTEXTS: [usize; 3] = [8192, 32768, 131_072];

fn token_count(flag: &str, value: &str) -> Result<usize> {
    let count: usize = value
        .parse()
        .with_context(|| format!("{flag} {value:?} is not a token count"))?;
    if count == 0 {
        bail!("{flag} must be at least 1");
    }
    Ok(count)
}

fn parse_options() -> Result<Options> {
    let mut options = Options {
        quick: false,
        sweep: false,
        ops: true,
        fast: true,
        tiny: true,
        block: true,
        v4block: true,
        profile: false,
        context: None,
        state: true,
        state_contexts: None,
        block_dir: PathBuf::from("/tmp/deepinfer-bench-v41-block"),
        block_numerics: vec![Numerics::Fast, Numerics::Exact],
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => options.quick = true,
            "--sweep" => options.sweep = true,
            "--sections" => {
                let list = args
                    .next()
                    .context("--sections needs a list, e.g. ops,fast,tiny,block")?;
                options.ops = false;
                options.fast = false;
                options.tiny = false;
                options.block = false;
                options.v4block = false;
                options.state = false;
                for section in list.split(',') {
                    match section {
                        "ops" => options.ops = true,
                        "fast" => options.fast = true,
                        "tiny" => options.tiny = true,
                        "block" => options.block = true,
                        "v4block" => options.v4block = true,
                        "profile" => options.profile = true,
                        "state" => options.state = true,
                        other => {
                            bail!(
                                "unknown section {other:?} in --sections (ops, fast, tiny, block, \
                                 v4block, profile, state)"
                            )
                        }
                    }
                }
            }
            "--context" => {
                let value = args.next().context("--context needs a token count")?;
                options.context = Some(token_count("--context", &value)?);
            }
            "--state-contexts" => {
                let list = args
                    .next()
                    .context("--state-contexts needs a list, e.g. 8192,32768")?;
                let contexts = list
                    .split(',')
                    .map(|value| token_count("--state-contexts", value))
                    .collect::<Result<Vec<_>>>()?;
                options.state_contexts = Some(contexts);
            }
            "--block-dir" => {
                options.block_dir = PathBuf::from(args.next().context("--block-dir needs a path")?);
            }
            "--numerics" => {
                options.block_numerics = match args.next().as_deref() {
                    Some("fast") => vec![Numerics::Fast],
                    Some("exact") => vec![Numerics::Exact],
                    Some("both") => vec![Numerics::Fast, Numerics::Exact],
                    other => bail!("--numerics needs fast, exact or both, not {other:?}"),
                };
            }
            other => bail!(
                "unknown argument {other:?}; usage: device_bench [--quick] [--sweep] \
                 [--sections ops,fast,tiny,block,v4block,profile,state] [--context N] \
                 [--state-contexts N,N,...] [--block-dir DIR] [--numerics fast|exact|both]"
            ),
        }
    }
    Ok(options)
}

fn main() -> Result<()> {
    let options = parse_options()?;
    let fixture = if options.tiny {
        // The repository's fixtures: `$DEEPINFER_FIXTURES` on the H200, where the build's source
        // tree is absent.
        let dir = std::env::var_os("DEEPINFER_FIXTURES")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"))
            .join("v41/v41-tiny");
        anyhow::ensure!(
            dir.join("config.json").is_file(),
            "the v41-tiny fixture is missing at {} (set DEEPINFER_FIXTURES to the repository's \
             tests/fixtures, or leave `tiny` out of --sections)",
            dir.display()
        );
        Some(dir)
    } else {
        None
    };
    if options.ops {
        ops::run(options.quick, options.sweep)?;
    }
    if options.fast {
        fast_ops::run(options.quick, options.sweep)?;
    }
    let mut rows = Vec::new();
    if let Some(dir) = &fixture {
        rows.extend(whole_step::fixture(dir, options.quick)?);
        whole_step::print(&rows);
    }
    let context = options
        .context
        .unwrap_or(if options.quick { 128 } else { 1024 });
    let v4_dir = {
        let mut name = options.block_dir.as_os_str().to_owned();
        name.push("-v4");
        PathBuf::from(name)
    };
    let blocks = [
        (
            options.block || options.profile,
            BlockFamily::V41,
            &options.block_dir,
        ),
        (options.v4block, BlockFamily::V4, &v4_dir),
    ];
    for (wanted, family, dir) in blocks {
        if !wanted {
            continue;
        }
        // The block in the numerics asked for (fast: tensor-core FP8 GEMMs).
        for &numerics in &options.block_numerics {
            rows.extend(whole_step::block(
                dir,
                family,
                context,
                options.quick,
                options.profile,
                numerics,
            )?);
        }
        whole_step::print(&rows);
    }
    whole_step::print_v4_projection(&rows);
    if options.state {
        let contexts = options.state_contexts.clone().unwrap_or_else(|| {
            let all = STATE_CONTEXTS.to_vec();
            if options.quick {
                all[..1].to_vec()
            } else {
                all
            }
        });
        rows.extend(whole_step::state(&options.block_dir, &contexts)?);
        whole_step::print(&rows);
    }
    Ok(())
}
