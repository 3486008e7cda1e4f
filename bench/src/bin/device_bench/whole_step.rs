//! Whole-step sections of the device benchmark: whole model forwards on `CudaBackend` for the
//! v41-tiny fixture and for the real-width one-block V4.1 and V4 models (`deepinfer_bench::block`):
//! prefill throughput and decode-step latency at batch 1, 8, 64, with the bytes and FLOPs each
//! step needs (`deepinfer_bench::cost`) and the ratio of the H200 roofline floor to the measured
//! time; for the V4 block, the whole V4-Flash projected from it beside SGLang's published H200
//! figures.
//!
//! A step over B sequences is one `forward_step` (every op once over the step's rows, as the
//! rank executor runs it); activations and KV rows stay on the device and only the sampled ids come
//! back, which is also when a step has finished (weights stay cached on the device after their
//! first use). Every timed run follows an untimed warm-up that uploads the weights.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use deepinfer_bench::block::{BlockFamily, BlockWidth, Prepared, block_config, prepare_checkpoint};
use deepinfer_bench::cost::{self, Cost};
use deepinfer_bench::steps::{
    BatchMeasurement, decode_step, decode_steps, measure_batch, measure_decode_from, percentile,
    prefill, prompt_lengths, prompt_tokens,
};
use deepinfer_kernels::kernel_timer::{KernelStats, KernelTimer};
use deepinfer_model::any_model::AnyModel;
use deepinfer_model::backend::cuda::{CudaBackend, Numerics, OpProfile, OpStats};
use deepinfer_model::checkpoint::Checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::state_bytes::StateBytes;

use crate::head_start::HeadStart;

/// One line of the whole-step table.
pub struct StepRow {
    pub model: &'static str,
    pub phase: &'static str,
    pub batch: usize,
    /// Tokens the measured time covers (prefill: all prompt tokens; decode: one per sequence).
    pub tokens: usize,
    /// Prefill: total seconds; decode: median step seconds.
    pub seconds: f64,
    /// Decode: 90th-percentile step seconds.
    pub p90_seconds: Option<f64>,
    /// What the measured time covers needs (prefill: all prompts; decode: the middle step).
    pub cost: Cost,
}

/// Batch sizes, decode steps per batch and prompt lengths of one run.
struct Plan {
    batches: &'static [(usize, usize)],
    shortest_prompt: usize,
    longest_prompt: usize,
}

const FULL_TINY: Plan = Plan {
    batches: &[(1, 20), (8, 10), (64, 4)],
    shortest_prompt: 4,
    longest_prompt: 24,
};
const QUICK_TINY: Plan = Plan {
    batches: &[(1, 3), (8, 2)],
    shortest_prompt: 4,
    longest_prompt: 12,
};
/// Block decode: (batch, steps). Enough steps that the median holds still between runs (the fast
/// decode steps of session 25's 3 … 10-step medians moved by up to 25% from one run to the next).
const FULL_BLOCK_DECODE: &[(usize, usize)] = &[(1, 64), (8, 32), (64, 16)];
const QUICK_BLOCK_DECODE: &[(usize, usize)] = &[(1, 16), (8, 8)];

fn decode_row(model: &'static str, cfg: &ModelConfig, run: &BatchMeasurement) -> Result<StepRow> {
    let steps = &run.step_seconds;
    let median = percentile(steps, 0.5).context("no decode steps were timed")?;
    Ok(StepRow {
        model,
        phase: "decode",
        batch: run.batch(),
        tokens: run.batch(),
        seconds: median,
        p90_seconds: percentile(steps, 0.9),
        cost: cost::decode_step(cfg, &run.positions_at_step(steps.len() / 2)),
    })
}

/// The v41-tiny fixture in `dir`: per batch, one prefill step over prompts of different lengths
/// and decode steps.
pub fn fixture(dir: &Path, quick: bool) -> Result<Vec<StepRow>> {
    let cfg = ModelConfig::from_file(&dir.join("config.json"))
        .with_context(|| format!("fixture config in {}", dir.display()))?;
    let engram = cfg
        .engram
        .as_ref()
        .context("the v41-tiny fixture config has no Engram section")?;
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, engram.pad_token_id)?;
    let ckpt = Checkpoint::open(dir)?;
    let backend = CudaBackend::open(0, Numerics::Exact)?;
    let model = AnyModel::from_checkpoint(cfg.clone(), &ckpt, Some(vocab), Box::new(backend))?;
    println!("v41-tiny: {} on {}", dir.display(), model.backend().name());
    let plan = if quick { &QUICK_TINY } else { &FULL_TINY };

    let started = Instant::now();
    measure_batch(&model, &[plan.longest_prompt], 2, 999)?;
    println!(
        "v41-tiny warm-up (weight uploads): {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let mut rows = Vec::new();
    for &(batch, steps) in plan.batches {
        let lens = prompt_lengths(batch, plan.shortest_prompt, plan.longest_prompt);
        let run = measure_batch(&model, &lens, steps, 100 * batch as u64)?;
        rows.push(StepRow {
            model: "v41-tiny",
            phase: "prefill",
            batch,
            tokens: run.prompt_tokens(),
            seconds: run.prefill_seconds,
            p90_seconds: None,
            cost: cost::prefill_step(&cfg, &lens),
        });
        rows.push(decode_row("v41-tiny", &cfg, &run)?);
    }
    Ok(rows)
}

/// Decode steps of each profiled batch and the prefill's chunk: enough for a stable table, few
/// because every op waits for the device.
const PROFILED_DECODE_STEPS: usize = 3;

/// Timed prefills of the real-width block per launch mode (the rows report the median).
const PREFILL_RUNS: usize = 3;

/// Vocabulary of the real-width block (its head is not what the block measures).
const BLOCK_VOCAB: usize = 1024;

/// Positions the block's config allows unless a longer run needs more: one value for every
/// context up to it (the `block` and `state` sections included), so that a later section or run
/// reuses the checkpoint on disk.
const BLOCK_MAX_POSITIONS: usize = 131_072 + 1024;

/// Tokens per forward call when the `state` section fills a long context.
const STATE_PREFILL_CHUNK: usize = 4096;

/// Decode steps timed per context in the `state` section.
const STATE_DECODE_STEPS: usize = 16;

/// The real-width one-block model of `family`, its random checkpoint in `dir` (written there
/// unless an identical one is present): prefill of one `context`-token prompt, then decode steps over
/// batches of distinct prefilled `context`-token prompts (that one first). With `profile`, each phase is run once more with the
/// backend's per-op profile on and its table printed ([`print_profile`]).
pub fn block(
    dir: &Path,
    family: BlockFamily,
    context: usize,
    quick: bool,
    profile: bool,
    numerics: Numerics,
) -> Result<Vec<StepRow>> {
    const VOCAB: usize = BLOCK_VOCAB;
    // The fast rows are timed twice: with the runtime's programmatic dependent launches (the
    // default) and with plain stream-ordered launches (`plain`), the same kernels and bits.
    // Each decode batch is also timed device-only (`head_start`): the step's kernels back to back
    // behind a hold of the stream, what a captured graph of the step could reach.
    let (label, plain, device_only) = match (family, numerics) {
        (BlockFamily::V41, Numerics::Fast) => (
            "v41 block fast",
            Some("v41 fast, plain launches"),
            "v41 fast, device only",
        ),
        (BlockFamily::V41, Numerics::Exact) => ("v41 block exact", None, "v41 exact, device only"),
        (BlockFamily::V4, Numerics::Fast) => (
            "v4 block fast",
            Some("v4 fast, plain launches"),
            "v4 fast, device only",
        ),
        (BlockFamily::V4, Numerics::Exact) => ("v4 block exact", None, "v4 exact, device only"),
    };
    let name = family.name();
    let decode = if quick {
        QUICK_BLOCK_DECODE
    } else {
        FULL_BLOCK_DECODE
    };
    let longest_decode = decode.iter().map(|&(_, steps)| steps).max().unwrap_or(0);
    let cfg = block_config(
        family,
        BlockWidth::Real,
        VOCAB,
        BLOCK_MAX_POSITIONS.max(context + longest_decode),
    );
    write_block_checkpoint(&cfg, dir)?;
    let started = Instant::now();
    let ckpt = Checkpoint::open(dir)?;
    let backend = CudaBackend::open(0, numerics)?;
    let transfers = backend.transfer_counters();
    let op_profile = backend.op_profile();
    let kernel_timer = backend.kernel_timer();
    let dependent_launch = backend.runtime().dependent_launch();
    let head_start = HeadStart::new(backend.runtime())?;
    let model = AnyModel::from_checkpoint(cfg.clone(), &ckpt, None, Box::new(backend))?;
    println!(
        "{name} block loaded on {} in {:.1} s",
        model.backend().name(),
        started.elapsed().as_secs_f64()
    );

    // Warm-up: a prompt long enough to touch nearly every expert (E(n) of the experts for n
    // tokens) and as long as the timed ones, so that the timed prefills find the memory pool,
    // the RoPE tables and the step's buffers at their size (the first prefill of a size grows
    // them: ~1 ms of a 1024-token prefill on the H200, session 37).
    let warm_up = context.max(if quick { 32 } else { 256 });
    let started = Instant::now();
    let mut seq = model.new_sequence();
    prefill(&model, &mut seq, &prompt_tokens(7, warm_up, 3, VOCAB))?;
    println!(
        "{name} block warm-up ({warm_up} tokens, ~{:.0} experts uploaded): {:.2} s",
        cost::expected_experts(&cfg, warm_up),
        started.elapsed().as_secs_f64()
    );

    // The prefill rows: the median of PREFILL_RUNS prefills of one prompt (a fresh sequence
    // each) per launch mode, the modes alternated so that drift on the machine falls on both.
    let prompt = prompt_tokens(8, context, 3, VOCAB);
    let modes: Vec<(&'static str, bool)> = match plain {
        Some(plain) => vec![(label, true), (plain, false)],
        None => vec![(label, true)],
    };
    let mut times = vec![Vec::with_capacity(PREFILL_RUNS); modes.len()];
    let mut first_run = None;
    for _ in 0..PREFILL_RUNS {
        for (&(_, dependent), times) in modes.iter().zip(&mut times) {
            dependent_launch.store(dependent, Ordering::Relaxed);
            let mut run = model.new_sequence();
            let started = Instant::now();
            let logits = prefill(&model, &mut run, &prompt)?;
            times.push(started.elapsed().as_secs_f64());
            first_run.get_or_insert((run, logits));
        }
    }
    dependent_launch.store(true, Ordering::Relaxed);
    let (seq, logits) = first_run.context("no prefill ran")?;
    let mut rows = Vec::new();
    for (&(model_label, _), times) in modes.iter().zip(&times) {
        rows.push(StepRow {
            model: model_label,
            phase: "prefill",
            batch: 1,
            tokens: context,
            seconds: percentile(times, 0.5).context("no prefill timed")?,
            p90_seconds: None,
            cost: cost::prefill(&cfg, context),
        });
    }
    // The decode batches' sequences: this prompt's and, for the larger batches, distinct
    // prompts of the same length (independent sequences route as the floor's expected experts
    // count; copies of one sequence would share their routes).
    let largest_batch = decode.iter().map(|&(batch, _)| batch).max().unwrap_or(1);
    let mut prefilled = vec![seq.clone()];
    let mut first = vec![deepinfer_bench::steps::argmax(&logits)];
    for i in 1..largest_batch {
        let mut other = model.new_sequence();
        let tokens = prompt_tokens(8 + i as u64, context, 3, VOCAB);
        first.push(deepinfer_bench::steps::argmax(&prefill(
            &model, &mut other, &tokens,
        )?));
        prefilled.push(other);
    }
    if profile {
        set_profiling(&op_profile, &kernel_timer, true);
        let mut profiled = model.new_sequence();
        let started = Instant::now();
        prefill(&model, &mut profiled, &prompt_tokens(8, context, 3, VOCAB))?;
        let seconds = started.elapsed().as_secs_f64();
        set_profiling(&op_profile, &kernel_timer, false);
        print_profile(
            &format!("{name} block prefill, {context} tokens"),
            (&op_profile, &kernel_timer),
            1,
            seconds,
        )?;
    }
    for &(batch, steps) in decode {
        let before = transfers.snapshot();
        let lengths_before = transfers.by_length();
        let (prefilled, first) = (&prefilled[..batch], &first[..batch]);
        let run = measure_decode_from(&model, prefilled, first, steps)?;
        let copied = transfers.snapshot() - before;
        let lengths: Vec<String> = transfers
            .by_length()
            .into_iter()
            .filter_map(|(len, n)| {
                let n = n - lengths_before.get(&len).copied().unwrap_or(0);
                (n > 0).then(|| format!("{len} values x {n}"))
            })
            .collect();
        // What the rule counts: every device-to-host copy of a decode step but the ids.
        println!(
            "{name} block decode B={batch}: per step {:.0} device-to-host copies of op results \
             ({:.2} MB) and {:.0} of sampled ids",
            copied.to_host_copies as f64 / steps as f64,
            copied.to_host_bytes as f64 / steps as f64 / 1e6,
            copied.sampled_id_copies as f64 / steps as f64,
        );
        if !lengths.is_empty() {
            println!("  copies over {steps} steps: {}", lengths.join(", "));
        }
        rows.push(decode_row(label, &cfg, &run)?);
        // A hold of twice the ordinary step (at least 2 ms) outlasts the host's issue of the step.
        let ordinary = percentile(&run.step_seconds, 0.5).context("no decode steps were timed")?;
        let hold = Duration::from_secs_f64((2.0 * ordinary).max(2e-3));
        let (mut copies, mut next) = (prefilled.to_vec(), first.to_vec());
        let step_seconds = head_start.device_only(steps, hold, || {
            Ok(decode_step(&model, &mut copies, &mut next)?)
        })?;
        let held = BatchMeasurement {
            prompt_lens: prefilled.iter().map(|seq| seq.len()).collect(),
            prefill_seconds: 0.0,
            step_seconds,
        };
        rows.push(decode_row(device_only, &cfg, &held)?);
        if let Some(plain) = plain {
            dependent_launch.store(false, Ordering::Relaxed);
            let run = measure_decode_from(&model, prefilled, first, steps);
            dependent_launch.store(true, Ordering::Relaxed);
            rows.push(decode_row(plain, &cfg, &run?)?);
        }
        if profile {
            // The steady state: the copies' first step (which builds their device mirrors) runs
            // before the profile starts.
            let (mut copies, mut next) = (prefilled.to_vec(), first.to_vec());
            decode_steps(&model, &mut copies, &mut next, 1)?;
            set_profiling(&op_profile, &kernel_timer, true);
            let profiled = decode_steps(&model, &mut copies, &mut next, PROFILED_DECODE_STEPS)?;
            set_profiling(&op_profile, &kernel_timer, false);
            print_profile(
                &format!("{name} block decode B={batch}"),
                (&op_profile, &kernel_timer),
                PROFILED_DECODE_STEPS,
                profiled.iter().sum(),
            )?;
        }
    }
    Ok(rows)
}

/// The real-width block's sequence state at long contexts (fast numerics): for each context, a
/// prompt prefilled in chunks of [`STATE_PREFILL_CHUNK`] tokens, then [`STATE_DECODE_STEPS`]
/// decode steps of that sequence (timed: one decode row per context). Then, side by side, the
/// byte model's prediction (`StateBytes`, what the state pool admits by), the bytes the state
/// holds (its own count of the values it keeps), the bytes it pins (the distinct allocations its
/// rows and entries keep alive, whole) and the device bytes it takes: what the stream-ordered
/// pool's used bytes fall by when the sequence is dropped. Growth of the pool that outlives the
/// sequence is the backend's (its RoPE tables grow to the next power of two of the longest
/// position seen: 256 bytes a position at RoPE dim 64), printed apart (`cached_MB`), as is the
/// pool's mapped growth while the sequence lived (`reserved_MB`: live allocations pin whole
/// segments).
pub fn state(dir: &Path, contexts: &[usize]) -> Result<Vec<StepRow>> {
    let longest = contexts.iter().copied().max().unwrap_or(0);
    let cfg = block_config(
        BlockFamily::V41,
        BlockWidth::Real,
        BLOCK_VOCAB,
        BLOCK_MAX_POSITIONS.max(longest + STATE_DECODE_STEPS + 1),
    );
    write_block_checkpoint(&cfg, dir)?;
    let ckpt = Checkpoint::open(dir)?;
    let backend = CudaBackend::open(0, Numerics::Fast)?;
    let memory = backend.memory_probe();
    let model = AnyModel::from_checkpoint(cfg.clone(), &ckpt, None, Box::new(backend))?;
    let plan = StateBytes::of(&cfg);
    // Warm-up: one chunk uploads the experts it routes to and grows the prefill's workspaces.
    let mut warm = model.new_sequence();
    prefill(
        &model,
        &mut warm,
        &prompt_tokens(7, STATE_PREFILL_CHUNK, 3, BLOCK_VOCAB),
    )?;
    drop(warm);
    let mut rows = Vec::new();
    println!(
        "\n{:>8} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>11} {:>10}",
        "tokens",
        "plan_MB",
        "held_MB",
        "pinned_MB",
        "freed_MB",
        "pinned/plan",
        "freed/plan",
        "cached_MB",
        "reserved_MB",
        "prefill_s"
    );
    for &context in contexts {
        let pool_before = memory.pool_used_and_reserved()?.unwrap_or_default();
        let prompt = prompt_tokens(8, context, 3, BLOCK_VOCAB);
        let mut seq = model.new_sequence();
        let started = Instant::now();
        let mut logits = Vec::new();
        for chunk in prompt.chunks(STATE_PREFILL_CHUNK) {
            logits = prefill(&model, &mut seq, chunk)?;
        }
        let prefill_seconds = started.elapsed().as_secs_f64();
        let mut next = [deepinfer_bench::steps::argmax(&logits)];
        let step_seconds = decode_steps(
            &model,
            std::slice::from_mut(&mut seq),
            &mut next,
            STATE_DECODE_STEPS,
        )?;
        let tokens = seq.len();
        let (planned, held, pinned) = (plan.bytes(tokens), seq.held_bytes(), seq.pinned_bytes());
        let pool_live = memory.pool_used_and_reserved()?.unwrap_or_default();
        drop(seq);
        let pool_after = memory.pool_used_and_reserved()?.unwrap_or_default();
        let freed = pool_live.0.saturating_sub(pool_after.0);
        let mb = |bytes: u64| bytes as f64 / 1e6;
        println!(
            "{tokens:>8} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.4} {:>10.4} {:>9.2} {:>11.2} {prefill_seconds:>10.1}",
            mb(planned),
            mb(held),
            mb(pinned),
            mb(freed),
            pinned as f64 / planned as f64,
            freed as f64 / planned as f64,
            mb(pool_after.0.saturating_sub(pool_before.0)),
            mb(pool_live.1.saturating_sub(pool_before.1)),
        );
        let run = BatchMeasurement {
            prompt_lens: vec![context],
            prefill_seconds,
            step_seconds,
        };
        rows.push(decode_row("v41 block state", &cfg, &run)?);
    }
    Ok(rows)
}

/// Writes the block's random checkpoint for `cfg` into `dir` (or reuses the one there).
fn write_block_checkpoint(cfg: &ModelConfig, dir: &Path) -> Result<()> {
    let started = Instant::now();
    let prepared = prepare_checkpoint(cfg, 41, dir, 8)?;
    println!(
        "{:?} block checkpoint in {}: {} in {:.1} s",
        cfg.family,
        dir.display(),
        match prepared {
            Prepared::Written => "written",
            Prepared::Reused => "reused",
        },
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Turns the per-op profile and the per-kernel device times on or off together.
fn set_profiling(ops: &OpProfile, kernels: &KernelTimer, on: bool) {
    ops.set_enabled(on);
    kernels.set_enabled(on);
}

/// The kernels printed under a profile, the longest first.
const PROFILED_KERNELS: usize = 16;

/// Prints (and empties) the per-op profile gathered over `steps` steps that took `seconds` in
/// all with the profile on: per op and step its calls, wall time (and of it the time until the op
/// returned, `host_us`: its host work), share of the step, kernel launches (and of them on tensor
/// cores: `tc`, the fast numerics' kernels) and host-to-device copies; the last line is the
/// step's time outside every op (the model's host code between ops and the trait's default
/// methods). Then the [`PROFILED_KERNELS`] kernels with the most device time per step (between
/// the events around each launch) and the device time of all launches.
pub fn print_profile(
    title: &str,
    (profile, kernels): (&OpProfile, &KernelTimer),
    steps: usize,
    seconds: f64,
) -> Result<()> {
    let mut ops: Vec<(&'static str, OpStats)> = profile.take().into_iter().collect();
    ops.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
    let per_step = |v: f64| v / steps as f64;
    let step_us = per_step(seconds) * 1e6;
    println!(
        "\nprofile: {title} (per step, {steps} steps, each op synchronised; step {step_us:.0} us)"
    );
    println!(
        "{:<28} {:>7} {:>10} {:>10} {:>7} {:>9} {:>7} {:>8} {:>10} {:>10}",
        "op",
        "calls",
        "time_us",
        "host_us",
        "share",
        "launches",
        "tc",
        "h2d",
        "h2d_KB",
        "before_us"
    );
    let (mut inside, mut before) = (0.0, 0.0);
    for (name, stats) in &ops {
        inside += stats.seconds;
        before += stats.before_seconds;
        println!(
            "{:<28} {:>7.1} {:>10.1} {:>10.1} {:>6.1}% {:>9.1} {:>7.1} {:>8.1} {:>10.1} {:>10.1}",
            name,
            per_step(stats.calls as f64),
            per_step(stats.seconds) * 1e6,
            per_step(stats.host_seconds) * 1e6,
            100.0 * stats.seconds / seconds,
            per_step(stats.launches as f64),
            per_step(stats.tensor_core_launches as f64),
            per_step(stats.htod_copies as f64),
            per_step(stats.htod_bytes as f64) / 1e3,
            per_step(stats.before_seconds) * 1e6,
        );
    }
    println!(
        "{:<28} {:>7} {:>10.1} {:>10} {:>6.1}%   (before the ops: {:.1} us; before_us: the host time \
         between the op before and this one's start)",
        "(outside ops)",
        "",
        per_step(seconds - inside) * 1e6,
        "",
        100.0 * (seconds - inside) / seconds,
        per_step(before) * 1e6,
    );
    let mut by_kernel: Vec<(String, KernelStats)> = kernels.take()?.into_iter().collect();
    by_kernel.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
    let device: f64 = by_kernel.iter().map(|(_, k)| k.seconds).sum();
    println!(
        "{:<36} {:>9} {:>10} {:>7}   (device time per step between each launch's events)",
        "kernel", "launches", "device_us", "share"
    );
    for (name, stats) in by_kernel.iter().take(PROFILED_KERNELS) {
        println!(
            "{:<36} {:>9.1} {:>10.1} {:>6.1}%",
            name,
            per_step(stats.launches as f64),
            per_step(stats.seconds) * 1e6,
            100.0 * stats.seconds / seconds,
        );
    }
    println!(
        "{:<36} {:>9.1} {:>10.1} {:>6.1}%",
        "(all kernels)",
        per_step(by_kernel.iter().map(|(_, k)| k.launches).sum::<u64>() as f64),
        per_step(device) * 1e6,
        100.0 * device / seconds,
    );
    Ok(())
}

/// Prints the whole-step table and what its columns mean.
pub fn print(rows: &[StepRow]) {
    println!();
    println!(
        "{:<15} {:<7} {:>3} {:>6} {:>10} {:>9} {:>8} {:>9} {:>9} {:>10} {:>10} {:>6} {:>9} {:>8}",
        "model",
        "phase",
        "B",
        "tokens",
        "time_ms",
        "p90_ms",
        "tok/s",
        "weight_MB",
        "state_MB",
        "GFLOP",
        "floor_us",
        "bound",
        "roofline",
        "x_floor"
    );
    for r in rows {
        let p90 = r
            .p90_seconds
            .map_or_else(|| "-".to_string(), |s| format!("{:.2}", s * 1e3));
        let floor = r.cost.floor_seconds();
        println!(
            "{:<15} {:<7} {:>3} {:>6} {:>10.2} {:>9} {:>8.1} {:>9.1} {:>9.2} {:>10.3} {:>10.2} {:>6} {:>8.4}% {:>8.0}",
            r.model,
            r.phase,
            r.batch,
            r.tokens,
            r.seconds * 1e3,
            p90,
            r.tokens as f64 / r.seconds,
            r.cost.weight_bytes / 1e6,
            r.cost.state_bytes / 1e6,
            r.cost.flops / 1e9,
            floor * 1e6,
            r.cost.bound(),
            100.0 * floor / r.seconds,
            r.seconds / floor,
        );
    }
    println!(
        "\nprefill: B prompts of different lengths in one step (blocks: one prompt); time_ms = that step, \
         tok/s = prompt tokens / time. decode: every sequence appends one token; time_ms = median step, p90_ms = 90th \
         percentile, tok/s = B / median (blocks: B distinct prefilled prompts, the routers balanced). \
         A step over B sequences is one forward over all their rows on the device; only the sampled ids come back. weight_MB = distinct weights at checkpoint width, once per pass (routed experts: the expected \
         distinct experts E(n) = E(1-(1-k/E)^n) of n tokens); state_MB = KV/state reads of all queries; GFLOP = GEMMs, \
         mHC, attention and index scores (bench/src/cost.rs); floor = max(bytes / 4.28 TB/s, FLOPs / 790 TFLOP/s); \
         roofline = floor / time; x_floor = time / floor."
    );
}

/// Backbone layers of the released V4-Flash (spec v4-architecture.md §1.1).
const V4_FLASH_LAYERS: usize = 43;

/// SGLang's published V4-Flash figures on the H200 (`shared/reference/anchors.md`: the V4-Flash
/// cookbook, v0.5.15, random 8K in / 1K out, FP4): time per output token at batch 1 (TP4 + MTP)
/// and total (input + output) tokens per second per GPU at high concurrency.
const SGLANG_H200_TPOT_MS: f64 = 3.37;
const SGLANG_H200_TOTAL_TOK_S_PER_GPU: f64 = 4500.0;

/// The whole V4-Flash on one GPU projected from the V4 block's rows: every one of its 43 layers
/// costs what the measured CSA block costs (the block's head and embedding are a small vocabulary's;
/// 20 of the 43 layers are cheaper HCA and 2 sliding-window layers, and the real head adds
/// ~1 GB of bf16 reads per step, so this is a projection, not a measurement), beside SGLang's
/// published H200 figures: per-token latency at B = 1 and tokens per second per GPU.
pub fn print_v4_projection(rows: &[StepRow]) {
    let v4: Vec<&StepRow> = rows
        .iter()
        .filter(|r| r.model.starts_with("v4 block"))
        .collect();
    if v4.is_empty() {
        return;
    }
    println!(
        "\nV4-Flash projected from the one-block steps ({V4_FLASH_LAYERS} layers x the block's step, one GPU)"
    );
    println!(
        "{:<15} {:<7} {:>3} {:>12} {:>14} {:>12} {:>26}",
        "model", "phase", "B", "step_ms", "ms/token/seq", "tok/s/GPU", "SGLang H200 (published)"
    );
    for r in v4 {
        let step = r.seconds * V4_FLASH_LAYERS as f64;
        let per_token = match r.phase {
            "decode" => step,
            _ => step / r.tokens as f64,
        };
        let peer = match (r.phase, r.batch) {
            ("decode", 1) => format!("{SGLANG_H200_TPOT_MS:.2} ms/token (TP4+MTP)"),
            _ => format!("{SGLANG_H200_TOTAL_TOK_S_PER_GPU:.0} tok/s/GPU (high conc.)"),
        };
        println!(
            "{:<15} {:<7} {:>3} {:>12.2} {:>14.3} {:>12.0} {:>26}",
            r.model,
            r.phase,
            r.batch,
            step * 1e3,
            per_token * 1e3,
            r.tokens as f64 / step,
            peer
        );
    }
}
