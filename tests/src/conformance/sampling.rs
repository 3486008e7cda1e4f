//! The sampling cases of the conformance harness: `sample_rows`, `sample_masked`,
//! `token_logprobs_masked` and `sample_linear` over vocabularies of 1 … 129 280 with ties, ±0,
//! ±∞ and NaN logits, top-k and top-p at their edges, masks of one, a few and most tokens and
//! masks narrower than the row; the errors of bad shapes and masks; on every backend, new seeds
//! or dropped masks change some token (each comparison can fail), and a row sampled alone or in a
//! reversed batch picks the same token.

use deepinfer_model::backend::{
    Backend, DenseWeight, LogprobPick, MaskedRows, RowSampling, Tensor,
};
use deepinfer_model::sampling::{
    AllowedTokens, MAX_TOP_LOGPROBS, SamplingParams, sample_allowed, token_logprobs,
};

use super::{Case, Op, Outputs};
use crate::data::Rng;

/// A logit row of one of several kinds: spread values, coarse values with many ties (exact
/// duplicates of the maximum included), a flat row, and rows with non-finite entries.
fn logit_row(rng: &mut Rng, vocab: usize, kind: u64) -> Vec<f32> {
    let mut row: Vec<f32> = match kind {
        // Coarse: multiples of 1/4 in [-4, 4): ties everywhere.
        1 => (0..vocab)
            .map(|_| (rng.below(32) as f32 - 16.0) / 4.0)
            .collect(),
        // Flat: every logit equal (top-p shares of exactly 1/vocab).
        2 => vec![0.75; vocab],
        _ => (0..vocab).map(|_| rng.uniform() * 12.0).collect(),
    };
    if kind == 3 && vocab > 3 {
        // -inf, +0/-0 ties and a tie for the top.
        row[1] = f32::NEG_INFINITY;
        row[2] = 0.0;
        row[3] = -0.0;
        let top = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) + 1.0;
        row[vocab / 2] = top;
        row[vocab - 1] = top;
    }
    if kind == 4 && vocab > 2 {
        // NaN entries: never greedy-picked; a NaN-first candidate list keeps its first entry.
        row[vocab / 3] = f32::NAN;
        row[vocab - 1] = f32::NAN;
    }
    row
}

/// The sampling parameters of row `i` of a batch over `vocab`: greedy, plain temperature, top-k
/// at its edges (1, vocab − 1, vocab, beyond), top-p at its edges (tiny, 0.5, 0.999999, 1) and
/// combinations, each with its own seed and position.
fn row_sampling(i: usize, vocab: usize) -> RowSampling {
    let temperatures = [0.0f32, 1.0, 0.7, 2.5, 0.05];
    let top_ks = [0usize, 1, 5, vocab.saturating_sub(1), vocab, vocab + 3, 40];
    let top_ps = [1.0f32, 0.9, 0.5, 1e-6, 0.999_999, 0.25];
    RowSampling {
        params: SamplingParams {
            temperature: temperatures[i % temperatures.len()],
            top_k: top_ks[(i / 2) % top_ks.len()],
            top_p: top_ps[(i / 3) % top_ps.len()],
            seed: 0x5eed_0000 + i as u64 * 7919,
        },
        position: (i as u64 * 104_729) % 100_003,
    }
}

/// `params` with every seed changed.
fn reseeded(params: &[RowSampling]) -> Vec<RowSampling> {
    params
        .iter()
        .map(|p| RowSampling {
            params: SamplingParams {
                seed: p.params.seed ^ 0xdead_beef,
                ..p.params
            },
            ..*p
        })
        .collect()
}

/// How many of `a` and `b` differ.
fn moved(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count()
}

/// `sample_rows` over vocabularies of 1, 7, 513, 3001 and 129 280 (new seeds move some token
/// beyond 100 ids); a top-p cut-off on a share boundary (4 equal logits, top_p 0.5: ids 0 and 1
/// only, both seen); bad shapes are errors.
pub fn sample_rows() -> Vec<Case> {
    let mut rng = Rng(31);
    let mut cases = Vec::new();
    for (vocab, rows) in [
        (1usize, 5usize),
        (7, 40),
        (513, 90),
        (3001, 64),
        (129_280, 12),
    ] {
        let mut logits = Vec::with_capacity(rows * vocab);
        for r in 0..rows {
            logits.extend(logit_row(&mut rng, vocab, (r % 5) as u64));
        }
        let params: Vec<RowSampling> = (0..rows).map(|i| row_sampling(i, vocab)).collect();
        cases.push(Case::new(
            format!("sample_rows vocab {vocab} {rows} rows"),
            Op::Sampling,
            move |b, o| {
                let ids = b.sample_rows(&logits, vocab, &params);
                if let (Ok(ids), true) = (&ids, vocab > 100) {
                    let other = b.sample_rows(&logits, vocab, &reseeded(&params));
                    let moved = other.map_or(0, |other| moved(&other, ids));
                    o.holds("new seeds move some token", moved > 0);
                }
                o.text("ids", ids);
            },
        ));
    }
    let flat = vec![1.0f32; 4 * 64];
    let params: Vec<RowSampling> = (0..64)
        .map(|i| RowSampling {
            params: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.5,
                seed: i,
            },
            position: i,
        })
        .collect();
    cases.push(Case::new(
        "sample_rows top_p on a share boundary, bad shapes",
        Op::Sampling,
        move |b, o| {
            let ids = b.sample_rows(&flat, 4, &params).unwrap_or_default();
            o.holds("top_p 0.5 keeps ids 0 and 1", ids.iter().all(|&t| t < 2));
            o.holds("both seen", ids.contains(&0) && ids.contains(&1));
            o.ids("ids", ids);
            o.text(
                "10 logits of 3 rows",
                b.sample_rows(&flat[..10], 4, &params[..3]),
            );
            o.text("an empty vocabulary", b.sample_rows(&[], 0, &params[..1]));
        },
    ));
    cases
}

/// A logit row shaped like a language model's at the real vocabulary: a bell-shaped bulk (sum of
/// four uniforms, spread `spread`) with a few strong candidates above it; `coarse` rounds every
/// logit to a multiple of 1/8, so the top-p cut-off falls inside runs of equal logits.
fn model_like_logits(rng: &mut Rng, vocab: usize, spread: f32, coarse: bool) -> Vec<f32> {
    (0..vocab)
        .map(|_| {
            let bulk = (rng.uniform() + rng.uniform() + rng.uniform() + rng.uniform()) * spread;
            let strong = if rng.below(4096) == 0 {
                6.0 + 6.0 * rng.uniform().abs()
            } else {
                0.0
            };
            let logit = bulk + strong;
            if coarse {
                (logit * 8.0).round() / 8.0
            } else {
                logit
            }
        })
        .collect()
}

/// 64 model-like rows at the real vocabulary, every combination of temperature {0, 0.7, 1.3} ×
/// top-k {0, 50} × top-p {0.9, 0.95, 1.0}; on every backend a second call, rows alone and the
/// reversed batch pick the same tokens, and new seeds move some row.
pub fn sample_rows_at_the_real_vocab() -> Vec<Case> {
    let (vocab, rows) = (129_280usize, 64usize);
    let mut rng = Rng(4096);
    let mut logits = Vec::with_capacity(rows * vocab);
    for r in 0..rows {
        let spread = [1.5f32, 3.0, 5.0, 8.0][r % 4];
        logits.extend(model_like_logits(&mut rng, vocab, spread, r % 8 == 7));
    }
    let params: Vec<RowSampling> = (0..rows)
        .map(|i| RowSampling {
            params: SamplingParams {
                temperature: [0.0f32, 0.7, 1.3][i % 3],
                top_k: [0usize, 50][(i / 3) % 2],
                top_p: [0.9f32, 0.95, 1.0][(i / 6) % 3],
                seed: 0xfeed_0000 + i as u64 * 131,
            },
            position: 5000 + i as u64 * 17,
        })
        .collect();
    vec![Case::new(
        "sample_rows vocab 129280, 64 mixed rows",
        Op::Sampling,
        move |b, o| {
            let sample = |logits: &[f32], params: &[RowSampling]| {
                b.sample_rows(logits, vocab, params).unwrap_or_default()
            };
            let ids = sample(&logits, &params);
            o.holds("64 ids", ids.len() == rows);
            o.holds(
                "a second call picks the same",
                sample(&logits, &params) == ids,
            );
            for r in [0usize, 7, 22, 41, 63] {
                let alone = sample(&logits[r * vocab..(r + 1) * vocab], &params[r..=r]);
                o.holds(format!("row {r} alone"), alone == ids[r..=r]);
            }
            let reversed_logits: Vec<f32> = (0..rows)
                .rev()
                .flat_map(|r| logits[r * vocab..(r + 1) * vocab].iter().copied())
                .collect();
            let reversed_params: Vec<RowSampling> = params.iter().rev().copied().collect();
            let mut reversed = sample(&reversed_logits, &reversed_params);
            reversed.reverse();
            o.holds("the reversed batch", reversed == ids);
            o.holds(
                "new seeds move some row",
                moved(&sample(&logits, &reseeded(&params)), &ids) > 0,
            );
            o.ids("ids", ids);
        },
    )]
}

/// The allowed-token mask of row `r` of a masked batch over `vocab` (`None`: unmasked): one
/// token, a few, most of them (all but a few), and a mask over fewer tokens than the row (its
/// padding disallowed); every mask allows at least one token.
fn row_mask(rng: &mut Rng, r: usize, vocab: usize) -> Option<AllowedTokens> {
    let pick = |rng: &mut Rng, n: usize| -> Vec<u32> {
        (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
    };
    match r % 5 {
        0 => None,
        1 => Some(AllowedTokens::from_tokens(vocab, &pick(rng, 1))),
        2 => Some(AllowedTokens::from_tokens(vocab, &pick(rng, 5))),
        3 => {
            let banned = pick(rng, 7.min(vocab.saturating_sub(1)));
            let kept: Vec<u32> = (0..vocab as u32).filter(|t| !banned.contains(t)).collect();
            Some(AllowedTokens::from_tokens(vocab, &kept))
        }
        _ => {
            let narrower = (vocab - vocab / 3).max(1);
            let kept: Vec<u32> = (0..narrower as u32).filter(|t| t % 3 != 1).collect();
            Some(AllowedTokens::from_tokens(narrower, &kept))
        }
    }
}

/// Logits rows (`[rows.len(), vocab]`) with one entry of `rows` and one optional mask each: the
/// owned form of [`MaskedRows`].
struct Masked<R> {
    logits: Vec<f32>,
    vocab: usize,
    rows: Vec<R>,
    masks: Vec<Option<AllowedTokens>>,
}

impl<R> Masked<R> {
    fn new(
        logits: Vec<f32>,
        vocab: usize,
        rows: Vec<R>,
        masks: Vec<Option<AllowedTokens>>,
    ) -> Self {
        Masked {
            logits,
            vocab,
            rows,
            masks,
        }
    }

    /// `op` of the rows with their masks, and of the rows unmasked.
    fn masked_and_not<T>(&self, op: impl Fn(MaskedRows<'_, R>) -> T) -> (T, T) {
        let logits = Tensor::from(&self.logits);
        let masks: Vec<Option<&AllowedTokens>> = self.masks.iter().map(Option::as_ref).collect();
        let none = vec![None; self.rows.len()];
        let rows_of = |allowed| MaskedRows {
            logits: &logits,
            vocab: self.vocab,
            rows: &self.rows,
            allowed,
        };
        (op(rows_of(&masks)), op(rows_of(&none)))
    }
}

/// The ids `sample_masked` picks from `batch` (each allowed by its row's mask; beyond 100 ids
/// some token moves without the masks).
fn masked_ids(batch: &Masked<RowSampling>, b: &dyn Backend, o: &mut Outputs) {
    let (ids, unmasked) = batch.masked_and_not(|rows| b.sample_masked(rows));
    let ids = ids.unwrap_or_default();
    for (r, (id, mask)) in ids.iter().zip(&batch.masks).enumerate() {
        if let Some(mask) = mask {
            o.holds(format!("row {r}: {id} is allowed"), mask.is_allowed(*id));
        }
    }
    if batch.vocab > 100 {
        let moved = unmasked.map_or(0, |u| moved(&u, &ids));
        o.holds("the masks change some token", moved > 0);
    }
    o.ids("ids", ids);
}

/// The log-probabilities of `batch`'s picks (beyond 100 ids some moves without the masks).
fn logprobs(batch: &Masked<LogprobPick>, b: &dyn Backend, o: &mut Outputs) {
    let (masked, unmasked) = batch.masked_and_not(|rows| b.token_logprobs_masked(rows));
    if let (Ok(masked), Ok(unmasked), true) = (&masked, &unmasked, batch.vocab > 100) {
        let moved = unmasked.iter().zip(masked).filter(|(a, b)| a != b).count();
        o.holds("the masks change some log-probability", moved > 0);
    }
    push_logprobs(o, masked);
}

/// `sample_masked` over vocabularies of 1, 7, 513 and 129 280 (every id allowed by its row's
/// mask; without the masks some token moves beyond 100 ids); a mask allowing nothing and one
/// wider than the row are errors naming the row.
pub fn sample_masked() -> Vec<Case> {
    let mut rng = Rng(0x3a5c_0001);
    let mut cases = Vec::new();
    for (vocab, rows) in [(1usize, 10usize), (7, 40), (513, 60), (129_280, 15)] {
        let mut logits = Vec::with_capacity(rows * vocab);
        for r in 0..rows {
            logits.extend(logit_row(&mut rng, vocab, (r % 5) as u64));
        }
        let params: Vec<RowSampling> = (0..rows).map(|i| row_sampling(i, vocab)).collect();
        let masks: Vec<Option<AllowedTokens>> =
            (0..rows).map(|r| row_mask(&mut rng, r, vocab)).collect();
        let batch = Masked::new(logits, vocab, params, masks);
        let name = format!("sample_masked vocab {vocab} {rows} rows");
        cases.push(Case::new(name, Op::Sampling, move |b, o| {
            masked_ids(&batch, b, o)
        }));
    }
    cases.push(Case::new(
        "sample_masked bad masks",
        Op::Sampling,
        |b, o| {
            let logits = Tensor::from(vec![1.0f32; 14]);
            let params: Vec<RowSampling> = (0..2).map(|i| row_sampling(i, 7)).collect();
            let nothing = AllowedTokens::from_tokens(7, &[]);
            let wide = AllowedTokens::from_tokens(8, &[7]);
            for (what, allowed) in [
                ("a mask allowing nothing", [None, Some(&nothing)]),
                ("a mask wider than the row", [Some(&wide), None]),
            ] {
                let rows = MaskedRows {
                    logits: &logits,
                    vocab: 7,
                    rows: &params,
                    allowed: &allowed,
                };
                o.text(what, b.sample_masked(rows));
            }
        },
    ));
    cases
}

/// `token_logprobs_masked` bit for bit over vocabularies of 1, 7, 513 and 129 280 with ties,
/// -inf, NaN, masks of one, a few and most tokens, 0 to 20 alternatives, for the token the
/// reference samples from each row (rows whose mask leaves only NaN logits, no distribution, left
/// out); unmasked, some masked row's numbers move beyond 100 ids.
pub fn token_logprobs_masked() -> Vec<Case> {
    let mut rng = Rng(0x10b5_0001);
    let mut cases = Vec::new();
    for (vocab, rows) in [(1usize, 10usize), (7, 40), (513, 60), (129_280, 15)] {
        let (mut logits, mut masks, mut picks) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rows {
            let row = logit_row(&mut rng, vocab, (r % 5) as u64);
            let mask = row_mask(&mut rng, r, vocab);
            let params = row_sampling(r, vocab);
            let Ok(token) = sample_allowed(&row, &params.params, params.position, mask.as_ref())
            else {
                continue;
            };
            let top = r % (MAX_TOP_LOGPROBS + 1);
            if token_logprobs(&row, mask.as_ref(), token, top).is_err() {
                continue;
            }
            logits.extend(row);
            masks.push(mask);
            picks.push(LogprobPick { token, top });
        }
        let name = format!("token_logprobs vocab {vocab} {} rows", picks.len());
        let batch = Masked::new(logits, vocab, picks, masks);
        cases.push(Case::new(name, Op::Sampling, move |b, o| {
            logprobs(&batch, b, o)
        }));
    }
    cases
}

/// Each row's token, log-probability and alternatives, by their bits (ids and bits are compared
/// exactly in both modes).
fn push_logprobs(
    o: &mut Outputs,
    rows: Result<Vec<deepinfer_model::sampling::TokenLogprobs>, impl std::fmt::Debug>,
) {
    match rows {
        Ok(rows) => {
            for (r, lp) in rows.iter().enumerate() {
                let top: Vec<(u32, u32)> = lp.top.iter().map(|&(t, l)| (t, l.to_bits())).collect();
                o.text(format!("row {r}"), (lp.token, lp.logprob.to_bits(), top));
            }
        }
        Err(err) => o.text("error", err),
    }
}

/// The head and the sampler in one op: 13 rows at vocab 3001 (greedy, seeded top-k / top-p and
/// temperature rows) pick what `sample_rows` picks from `linear_f32`'s logits on the same
/// backend; a wrong row count is an error.
pub fn sample_linear() -> Vec<Case> {
    let mut rng = Rng(0x5a11_ea7e);
    let (vocab, dim, rows) = (3001, 96, 13);
    let head: Vec<f32> = (0..vocab * dim).map(|_| rng.uniform() * 0.2).collect();
    let hidden: Vec<f32> = (0..rows * dim).map(|_| rng.uniform() * 2.0).collect();
    let params: Vec<RowSampling> = (0..rows)
        .map(|r| RowSampling {
            params: SamplingParams {
                temperature: [0.0, 0.7, 1.3][r % 3],
                top_k: [0, 50, 7][r % 3],
                top_p: [1.0, 0.9, 0.95][r % 3],
                seed: 1000 + r as u64,
            },
            position: 17 + 3 * r as u64,
        })
        .collect();
    vec![Case::new(
        "sample_linear vocab 3001, 13 rows",
        Op::LinearF32,
        move |b, o| {
            let head = DenseWeight {
                values: &head,
                out: vocab,
                inp: dim,
            };
            let hidden = Tensor::from(&hidden);
            let ids = b.sample_linear(&hidden, head, &params);
            let logits = b.linear_f32(&hidden, head).into_vec();
            let through_rows = b.sample_rows(&logits, vocab, &params);
            o.holds("the ids of sample_rows on linear_f32", through_rows == ids);
            o.text("ids", ids);
            o.text(
                "2 rows for 13 samplings",
                b.sample_linear(&hidden.rows(0..2, dim), head, &params),
            );
        },
    )]
}
