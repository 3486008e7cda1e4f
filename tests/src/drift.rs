//! Shared by the tests that measure an approximation against exact logits (decoder bounded
//! replay in `replay_logits.rs`, prefix-cache hits in `prefix_cache.rs`): the demo model, the
//! prompts, and the drift of one run's logits rows from another's with the asserted rule.

use deepinfer_actors::engram_vocab::compressed_token_map;
use deepinfer_actors::frontend::codec::load_v41_tokenizer;
use deepinfer_actors::model_source::{DEMO_SEED, demo_config, shipped_tokenizer};
use deepinfer_model::{Model, checkpoint};

/// The built-in demo model (`model_source::build_demo`'s recipe, loaded as a bare `Model`).
pub fn demo_model(dir: &std::path::Path) -> Model {
    demo_model_with_positions(dir, None)
}

/// The demo model with room for `positions` tokens (`None`: the demo's own limit), written into
/// `dir` and loaded.
pub fn demo_model_with_positions(dir: &std::path::Path, positions: Option<usize>) -> Model {
    let tokenizer = load_v41_tokenizer(&shipped_tokenizer()).expect("shipped tokenizer");
    let map = compressed_token_map(&tokenizer).expect("compressed token map");
    let mut cfg = demo_config(map.size);
    if let Some(positions) = positions {
        cfg.max_position_embeddings = positions;
    }
    checkpoint::write_random_checkpoint(&cfg, DEMO_SEED, dir, 2).expect("demo checkpoint");
    let engram = cfg.engram.as_ref().expect("the demo has Engram");
    let vocab = map.into_engram_vocab(engram).expect("engram vocabulary");
    Model::load_with_vocab(dir, Some(vocab)).expect("demo model loads")
}

/// A deterministic prompt of `n` ids in `[offset, offset + span)`, with a repeated stretch (the
/// Engram n-grams fire).
pub fn prompt(n: usize, offset: u32, span: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            let i = if (60..80).contains(&i) { i - 50 } else { i };
            offset + (i.wrapping_mul(7919).wrapping_add(31) % span)
        })
        .collect()
}

pub fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > row[best] { i } else { best })
}

/// Logits rows of one run: the prompt rows at positions `>= from` and the decode rows.
pub struct Rows {
    pub prompt: Vec<f32>,
    pub decode: Vec<f32>,
}

/// How far replay-on rows are from replay-off rows, relative to the range of the off logits.
#[derive(Debug, Clone, Copy)]
pub struct Drift {
    pub prompt_max: f32,
    pub prompt_mean: f32,
    pub decode_max: f32,
    pub decode_mean: f32,
    pub prompt_top1: (usize, usize),
    pub decode_top1: (usize, usize),
    /// Largest KL(off || on) of one row (nats).
    pub prompt_kl: f64,
    pub decode_kl: f64,
    /// First kept-prompt offset from which every row (decode rows included) is bitwise equal.
    pub exact_from: usize,
}

/// `log softmax` of one logits row, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    row.iter().map(|&v| f64::from(v) - max - sum.ln()).collect()
}

/// The largest KL(p || q) over the rows of two `[rows, vocab]` logits blocks.
pub fn max_kl(p: &[f32], q: &[f32], vocab: usize) -> f64 {
    p.chunks_exact(vocab)
        .zip(q.chunks_exact(vocab))
        .map(|(p, q)| {
            let (lp, lq) = (log_softmax(p), log_softmax(q));
            lp.iter()
                .zip(&lq)
                .map(|(a, b)| a.exp() * (a - b))
                .sum::<f64>()
        })
        .fold(0.0, f64::max)
}

pub fn drift(off: &Rows, on: &Rows, vocab: usize) -> Drift {
    assert_eq!(off.prompt.len(), on.prompt.len());
    assert_eq!(off.decode.len(), on.decode.len());
    let (lo, hi) = off
        .prompt
        .iter()
        .chain(&off.decode)
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let range = hi - lo;
    let stats = |a: &[f32], b: &[f32]| {
        let max = a
            .iter()
            .zip(b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        let sum: f64 = a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).sum();
        let agree = a
            .chunks_exact(vocab)
            .zip(b.chunks_exact(vocab))
            .filter(|(x, y)| argmax(x) == argmax(y))
            .count();
        (
            max / range,
            (sum / a.len().max(1) as f64) as f32 / range,
            (agree, a.len() / vocab),
        )
    };
    let (prompt_max, prompt_mean, prompt_top1) = stats(&off.prompt, &on.prompt);
    let (decode_max, decode_mean, decode_top1) = stats(&off.decode, &on.decode);
    let rows_off: Vec<&[f32]> = off
        .prompt
        .chunks_exact(vocab)
        .chain(off.decode.chunks_exact(vocab))
        .collect();
    let rows_on: Vec<&[f32]> = on
        .prompt
        .chunks_exact(vocab)
        .chain(on.decode.chunks_exact(vocab))
        .collect();
    let exact_from = rows_off
        .iter()
        .zip(&rows_on)
        .rposition(|(a, b)| a != b)
        .map_or(0, |last_moved| last_moved + 1);
    Drift {
        prompt_kl: max_kl(&off.prompt, &on.prompt, vocab),
        decode_kl: max_kl(&off.decode, &on.decode, vocab),
        exact_from,
        prompt_max,
        prompt_mean,
        decode_max,
        decode_mean,
        prompt_top1,
        decode_top1,
    }
}

pub fn report(model: &str, keep: u32, prompt_len: usize, d: &Drift) {
    eprintln!(
        "replay drift [{model}, prompt {prompt_len}, keep {keep}]: kept prompt rows max|Δ|/range \
         {:.3e} mean {:.3e} max KL {:.3e} top-1 {}/{}; decode rows max|Δ|/range {:.3e} mean {:.3e} \
         max KL {:.3e} top-1 {}/{}; bitwise equal from kept offset {}",
        d.prompt_max,
        d.prompt_mean,
        d.prompt_kl,
        d.prompt_top1.0,
        d.prompt_top1.1,
        d.decode_max,
        d.decode_mean,
        d.decode_kl,
        d.decode_top1.0,
        d.decode_top1.1,
        d.exact_from
    );
}

/// Rows of the kept suffix from this offset on are exact: a decoder layer's output at `s` reads
/// its window `[s - window + 1, s]`, so each of the `n_layers - boundary` decoder layers widens
/// the region touched by the truncation by `window - 1` positions (the encoder caches, the
/// boundary layer's compressor included, are exact for every position).
pub fn dependency_halo(model: &Model) -> usize {
    let cfg = model.config();
    let boundary = cfg
        .compress_ratios
        .iter()
        .position(|&r| r == 1)
        .expect("a ratio-1 decoder boundary");
    (cfg.window_size - 1) * (cfg.n_layers - boundary)
}

/// Asserted bounds of one measurement (the measured values with margin).
pub struct Bounds {
    pub prompt_max: f32,
    pub prompt_mean: f32,
    pub decode_max: f32,
    pub decode_mean: f32,
    /// Largest per-row KL(off || on) of the decode rows (nats); the prompt rows' is <= 0.4.
    pub decode_kl: f64,
    pub min_prompt_top1: usize,
    pub min_decode_top1: usize,
}

pub fn check(d: &Drift, b: &Bounds, halo: usize) {
    assert!(
        d.prompt_max > 0.0 && d.exact_from > 0,
        "replay must change the first kept rows (it truncates the decoder's cone): {d:?}"
    );
    assert!(
        d.exact_from <= halo,
        "rows past the dependency halo ({halo}) must be exact: {d:?}"
    );
    check_bounds(d, b);
}

/// The bounds of `b` on a measured drift `d` (its prompt rows' largest KL at most 0.4 nats).
pub fn check_bounds(d: &Drift, b: &Bounds) {
    assert!(
        d.prompt_max <= b.prompt_max && d.prompt_mean <= b.prompt_mean,
        "{d:?}"
    );
    assert!(
        d.decode_max <= b.decode_max && d.decode_mean <= b.decode_mean,
        "{d:?}"
    );
    assert!(d.prompt_kl <= 0.4 && d.decode_kl <= b.decode_kl, "{d:?}");
    assert!(d.prompt_top1.0 >= b.min_prompt_top1, "{d:?}");
    assert!(d.decode_top1.0 >= b.min_decode_top1, "{d:?}");
}

/// The bounds `replay_logits.rs` asserts for decoder bounded replay on the v41-tiny fixture at
/// `keep` 22 (window 16 + 6), 64 or 140 (200-token prompts, 8 greedy decode steps; the measured
/// values are in that test's docs).
pub fn fixture_bounds(keep: u32) -> Bounds {
    match keep {
        22 => Bounds {
            prompt_max: 0.45,
            prompt_mean: 0.045,
            decode_max: 0.09,
            decode_mean: 0.011,
            decode_kl: 0.02,
            min_prompt_top1: 9,
            min_decode_top1: 6,
        },
        64 => Bounds {
            prompt_max: 0.4,
            prompt_mean: 0.02,
            decode_max: 0.012,
            decode_mean: 0.002,
            decode_kl: 0.0005,
            min_prompt_top1: 45,
            min_decode_top1: 7,
        },
        140 => Bounds {
            prompt_max: 0.4,
            prompt_mean: 0.01,
            decode_max: 0.0,
            decode_mean: 0.0,
            decode_kl: 0.0,
            min_prompt_top1: 120,
            min_decode_top1: 8,
        },
        other => panic!("no measured bounds at keep {other}"),
    }
}

/// The bounds `replay_logits.rs` asserts for decoder bounded replay on the demo model (a
/// 600-token prompt, keep 140, 4 greedy decode steps).
pub fn demo_bounds() -> Bounds {
    Bounds {
        prompt_max: 0.4,
        prompt_mean: 0.007,
        decode_max: 0.0,
        decode_mean: 0.0,
        decode_kl: 0.0,
        min_prompt_top1: 110,
        min_decode_top1: 4,
    }
}
