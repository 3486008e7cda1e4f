//! Time to first token with the prefix cache off and on (CPU reference backend): a 2048-token
//! shared system prompt plus a 50-token question, on the demo model's architecture (the v41-tiny
//! config, random weights) with its context raised to 4096. Cache off: the whole prompt is
//! prefilled. Cache on: an earlier request with the same system prompt filled the cache; the
//! question's request attaches the cached blocks that end before the decoder's kept suffix,
//! replays the last `keep` (140) of them and prefills the rest. Both run decoder bounded replay
//! (keep 140). Prints the median of `--runs N` (default 5) of each and the ratio off / on.
//!
//! `cargo run -p deepinfer-bench --bin prefix_ttft [-- --runs N]` (the model crate is optimised
//! in dev builds too).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use deepinfer_actors::prefix_cache::{PrefillRule, PrefixCache, prefill};
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::state_bytes::StateBytes;
use deepinfer_model::{LogitsWanted, Model, checkpoint};

const SYSTEM_TOKENS: usize = 2048;
const QUESTION_TOKENS: usize = 50;
const KEEP: usize = 140;
const CHUNK: usize = 512;
const SALT: u64 = 1;

fn main() -> Result<()> {
    let runs = parse_runs()?;
    let dir = tempfile_dir()?;
    let mut cfg = ModelConfig::tiny_v41();
    cfg.max_position_embeddings = 4096;
    checkpoint::write_random_checkpoint(&cfg, 7, &dir, 1).context("random checkpoint")?;
    let pad = cfg.engram.as_ref().map_or(0, |e| e.pad_token_id);
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, pad).context("Engram vocabulary")?;
    let model = Model::load_with_vocab(&dir, Some(vocab)).context("model loads")?;
    let tokens = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(7919).wrapping_add(seed)) % cfg.vocab_size as u32)
            .collect()
    };
    let system = tokens(SYSTEM_TOKENS, 31);
    let rule = PrefillRule {
        replay_tokens: KEEP,
        decoder_keep: Some(KEEP),
    };
    let block_tokens = StateBytes::of(model.config()).block_tokens;

    let run_prefill = |cache: &mut PrefixCache<_>, prompt: &[u32]| {
        prefill(&model, cache, SALT, prompt, rule, CHUNK, LogitsWanted::Last)
    };
    let (mut off, mut on) = (Vec::new(), Vec::new());
    let mut fed = (0, 0);
    for run in 0..runs as u32 {
        let prompt = [&system[..], &tokens(QUESTION_TOKENS, 1000 + run)].concat();
        // Cache off: a cache that never holds anything.
        let mut empty = PrefixCache::new(block_tokens, 0);
        let start = Instant::now();
        let cold = run_prefill(&mut empty, &prompt)?;
        off.push(start.elapsed());
        // Cache on: an earlier question filled it with the system prompt's blocks.
        let mut cache = PrefixCache::new(block_tokens, 1 << 32);
        let earlier = [&system[..], &tokens(QUESTION_TOKENS, 5000 + run)].concat();
        run_prefill(&mut cache, &earlier)?;
        let start = Instant::now();
        let hit = run_prefill(&mut cache, &prompt)?;
        on.push(start.elapsed());
        if hit.hit_tokens == 0 {
            bail!("the second request missed the cache");
        }
        fed = (
            prompt.len() - cold.replay_from,
            prompt.len() - hit.replay_from,
        );
        println!(
            "run {run}: off {:.1} ms, on {:.1} ms (hit {} tokens, replay from {})",
            ms(off[off.len() - 1]),
            ms(on[on.len() - 1]),
            hit.hit_tokens,
            hit.replay_from
        );
    }
    let (off, on) = (median(&mut off), median(&mut on));
    println!(
        "prefix_ttft: prompt {SYSTEM_TOKENS}+{QUESTION_TOKENS} tokens, keep {KEEP}: TTFT cache off \
         {:.1} ms ({} tokens fed), cache on {:.1} ms ({} tokens fed), ratio off/on {:.2}",
        ms(off),
        fed.0,
        ms(on),
        fed.1,
        off.as_secs_f64() / on.as_secs_f64()
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

fn parse_runs() -> Result<usize> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => Ok(5),
        [flag, n] if flag == "--runs" => {
            let n: usize = n
                .parse()
                .with_context(|| format!("--runs {n}: not a count"))?;
            if n == 0 {
                bail!("--runs must be at least 1");
            }
            Ok(n)
        }
        other => bail!("usage: prefix_ttft [--runs N], got {other:?}"),
    }
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
