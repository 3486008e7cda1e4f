//! Time to first token with the prefix cache off and on, through the engine (CPU reference
//! backend, one DP rank): a 2048-token shared system prompt plus a 50-token question, on the
//! demo model's architecture (the v41-tiny config, random weights) with its context raised to
//! 4096. Cache off: the whole prompt is prefilled. Cache on (`[prefix_cache]`, the default
//! bounded replay): an earlier request with the same system prompt filled the cache; the
//! question's request attaches the cached blocks that end before the decoder's kept suffix,
//! replays the last `keep` (140) of them and prefills the rest. Both run decoder bounded replay
//! (keep 140). With `--v4`: the v4-tiny fixture (`tests/fixtures/v4/v4-tiny`), no decoder
//! bounded replay, `replay = "exact"`: the hit attaches 32 blocks (2048 tokens: their ring rows
//! included) and resumes at their end, so only the question is fed. TTFT: from `generate` to the
//! first token event. Prints the median of `--runs N` (default 5) of each and the ratio off / on.
//! With `--cuda` (a build with the `cuda` feature, on a GPU): the same V4.1 workload on the CUDA
//! backend (device 0, `fast` numerics, the cache's `replay = "exact"`: the hit attaches every
//! cached block and resumes at its end, as on the CPU with `--v4`).
//!
//! `cargo run -p deepinfer-bench --bin prefix_ttft [-- [--v4 | --cuda] [--runs N]]` (the model
//! crate is optimised in dev builds too).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use deepinfer_actors::gpu::open_cuda_backend;
use deepinfer_actors::rank::factory::{ModelFactory, RankDevices};
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest, GenerationEvent, ModelFacts};
use deepinfer_model::any_model::AnyModel;

use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::{Model, checkpoint};
use deepinfer_topology::{NodeConfig, Numerics};

const SYSTEM_TOKENS: usize = 2048;
const QUESTION_TOKENS: usize = 50;
const KEEP: usize = 140;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let (runs, target) = parse_args()?;
    let v4 = target == Target::V4;
    let dir = tempfile_dir()?;
    let (model, off_sections, on_sections) = if v4 {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/v4/v4-tiny");
        let model = AnyModel::load(std::path::Path::new(fixture), None)
            .with_context(|| format!("the v4-tiny fixture at {fixture}"))?;
        (model, String::new(), V4_CACHE_ON.to_string())
    } else {
        let mut cfg = ModelConfig::tiny_v41();
        cfg.max_position_embeddings = 4096;
        checkpoint::write_random_checkpoint(&cfg, 7, &dir, 1).context("random checkpoint")?;
        let pad = cfg.engram.as_ref().map_or(0, |e| e.pad_token_id);
        let vocab =
            CompressedVocab::halving_stub(cfg.vocab_size, pad).context("Engram vocabulary")?;
        let model = Model::load_with_vocab(&dir, Some(vocab)).context("model loads")?;
        let keep = format!("[replay]\ndecoder_keep_tokens = {KEEP}\n");
        let on = keep.clone()
            + if target == Target::Cuda {
                V4_CACHE_ON
            } else {
                CACHE_ON
            };
        (Arc::new(model).into(), keep, on)
    };
    let vocab = model.config().vocab_size as u32;
    let tokens = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(7919).wrapping_add(seed)) % vocab)
            .collect()
    };
    let system = tokens(SYSTEM_TOKENS, 31);
    let (off_engine, on_engine) = (
        engine(&model, target, &off_sections).await?,
        engine(&model, target, &on_sections).await?,
    );
    let (mut off, mut on) = (Vec::new(), Vec::new());
    let mut skipped = 0;
    for run in 0..runs as u32 {
        let prompt = [&system[..], &tokens(QUESTION_TOKENS, 1000 + run)].concat();
        off.push(ttft(&off_engine, &prompt).await?);
        // An earlier question fills the cache with the system prompt's blocks (evicting none:
        // the budget holds them all).
        let earlier = [&system[..], &tokens(QUESTION_TOKENS, 5000 + run)].concat();
        ttft(&on_engine, &earlier).await?;
        let before = skipped_tokens(&on_engine).await?;
        on.push(ttft(&on_engine, &prompt).await?);
        skipped = skipped_tokens(&on_engine).await? - before;
        if skipped == 0 {
            bail!("the question missed the cache");
        }
        println!(
            "run {run}: off {:.1} ms, on {:.1} ms ({skipped} cached tokens not fed)",
            ms(off[off.len() - 1]),
            ms(on[on.len() - 1]),
        );
    }
    for engine in [off_engine, on_engine] {
        engine
            .shutdown(Duration::from_secs(60))
            .await
            .context("shutdown")?;
    }
    let (off, on) = (median(&mut off), median(&mut on));
    let prompt_len = SYSTEM_TOKENS + QUESTION_TOKENS;
    let rule = match target {
        Target::V4 => "v4-tiny, hits resume".to_string(),
        Target::Cpu => format!("keep {KEEP}"),
        Target::Cuda => format!("CUDA, fast numerics, keep {KEEP}, hits resume"),
    };
    println!(
        "prefix_ttft: prompt {SYSTEM_TOKENS}+{QUESTION_TOKENS} tokens, {rule}: TTFT cache off \
         {:.1} ms ({prompt_len} tokens fed), cache on {:.1} ms ({} tokens fed), ratio off/on {:.2}",
        ms(off),
        ms(on),
        prompt_len as u64 - skipped,
        off.as_secs_f64() / on.as_secs_f64()
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

const CACHE_ON: &str = "[prefix_cache]\nbytes_per_rank = 4294967296\n";
const V4_CACHE_ON: &str = "[prefix_cache]\nbytes_per_rank = 4294967296\nreplay = \"exact\"\n";

/// What the benchmark times.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    /// The V4.1 workload on the CPU reference backend.
    Cpu,
    /// The v4-tiny fixture on the CPU.
    V4,
    /// The V4.1 workload on CUDA device 0.
    Cuda,
}

/// A one-rank engine over `model` (on CUDA device 0 for [`Target::Cuda`]) with `extra` topology
/// sections.
async fn engine(model: &AnyModel, target: Target, extra: &str) -> Result<Engine> {
    let device = match target {
        Target::Cuda => {
            "backend = \"cuda\"\narch = \"sm90\"\ngpus_per_node = 1\nnumerics = \"fast\""
        }
        Target::Cpu | Target::V4 => "backend = \"cpu\"",
    };
    let text = format!("[device]\n{device}\n[parallel]\ndp = 1\nep = 1\n{extra}");
    let node = NodeConfig::from_toml_str(&text, "prefix_ttft").context("topology")?;
    let executor = match target {
        Target::Cuda => ModelFactory::per_device(
            model.clone(),
            "prefix_ttft on CUDA",
            RankDevices {
                per_node: 1,
                open: Arc::new(|_dp, ordinal| open_cuda_backend(ordinal, Numerics::Fast)),
                experts: None,
            },
        ),
        Target::Cpu | Target::V4 => ModelFactory::new(model.clone(), "prefix_ttft"),
    };
    let config = EngineConfig {
        node,
        executor: Arc::new(executor),
        model: ModelFacts::of(model.config()),
        tokenizer: None,
    };
    Engine::start(config).await.context("engine starts")
}

/// From submission to the first token of a one-token request.
async fn ttft(engine: &Engine, prompt: &[u32]) -> Result<Duration> {
    let request = GenerateRequest::from_tokens(prompt.to_vec())
        .max_tokens(1)
        .ignore_eos(true);
    let start = Instant::now();
    let mut stream = engine.generate(request).await.context("admitted")?;
    while let Some(event) = stream.next().await {
        match event {
            GenerationEvent::Token { .. } => return Ok(start.elapsed()),
            GenerationEvent::Error(error) => bail!("the request failed: {error}"),
            _ => {}
        }
    }
    bail!("the request ended without a token")
}

/// The tokens the rank's prefix-cache hits did not feed so far.
async fn skipped_tokens(engine: &Engine) -> Result<u64> {
    let stats = engine.handle().scheduler_stats().await.context("stats")?;
    Ok(stats[0].prefix.counters.skipped_tokens)
}

/// `[--v4 | --cuda] [--runs N]`: the runs (default 5) and what to time.
fn parse_args() -> Result<(usize, Target)> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let target = match args.first().map(String::as_str) {
        Some("--v4") => Target::V4,
        Some("--cuda") => Target::Cuda,
        _ => Target::Cpu,
    };
    if target != Target::Cpu {
        args.remove(0);
    }
    let runs = match args.as_slice() {
        [] => 5,
        [flag, n] if flag == "--runs" => {
            let n: usize = n
                .parse()
                .with_context(|| format!("--runs {n}: not a count"))?;
            if n == 0 {
                bail!("--runs must be at least 1");
            }
            n
        }
        other => bail!("usage: prefix_ttft [--v4 | --cuda] [--runs N], got {other:?}"),
    };
    Ok((runs, target))
}

fn tempfile_dir() -> Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("deepinfer-prefix-ttft-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
