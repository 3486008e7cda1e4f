//! Shared by the golden test binaries: reading a fixture's `case.json` and
//! `expected.safetensors`, and the comparisons its README prescribes (max |Δ|, relative RMS,
//! bitwise counts, selections with −1 padding).

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

pub mod v41_rules;

use std::path::Path;

use deepinfer_model::Model;
pub use deepinfer_model::backend::cpu::argmax;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// A fixture's reference data: `case.json` and the tensors of `expected.safetensors`.
pub struct Expected {
    case: Value,
    bytes: Vec<u8>,
}

impl Expected {
    pub fn read(dir: &Path) -> Expected {
        let case = serde_json::from_str(
            &std::fs::read_to_string(dir.join("case.json")).expect("case.json"),
        )
        .expect("case json");
        let bytes = std::fs::read(dir.join("expected.safetensors")).expect("expected.safetensors");
        Expected { case, bytes }
    }

    pub fn case(&self) -> &Value {
        &self.case
    }

    fn words(&self, name: &str, dtype: Dtype) -> Vec<[u8; 4]> {
        let tensors = SafeTensors::deserialize(&self.bytes).expect("expected.safetensors parses");
        let view = tensors
            .tensor(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(view.dtype(), dtype, "{name}");
        view.data()
            .chunks_exact(4)
            .map(|b| [b[0], b[1], b[2], b[3]])
            .collect()
    }

    /// An F32 tensor, flattened.
    pub fn f32(&self, name: &str) -> Vec<f32> {
        self.words(name, Dtype::F32)
            .into_iter()
            .map(f32::from_le_bytes)
            .collect()
    }

    /// An I32 tensor, flattened.
    pub fn i32(&self, name: &str) -> Vec<i32> {
        self.words(name, Dtype::I32)
            .into_iter()
            .map(i32::from_le_bytes)
            .collect()
    }

    /// The top-level `tolerance` of `case.json` (a fraction of the logit range).
    pub fn tolerance(&self) -> f32 {
        self.case["tolerance"].as_f64().expect("tolerance") as f32
    }

    /// `max − min` of a tensor: the READMEs' logit range of a case's one-shot prefill logits.
    pub fn range_of(&self, name: &str) -> f32 {
        let (lo, hi) = self
            .f32(name)
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        hi - lo
    }
}

/// A V4.1 fixture (`v41-tiny`, `v41-odd`): its model (with the stub Engram vocabulary of its
/// README) and its reference data.
pub struct V41Fixture {
    pub model: Model,
    pub data: Expected,
}

impl std::ops::Deref for V41Fixture {
    type Target = Expected;
    fn deref(&self) -> &Expected {
        &self.data
    }
}

impl V41Fixture {
    /// The fixture `v41/<name>` (a missing one fails the test).
    pub fn load(name: &str) -> V41Fixture {
        let rel = format!("v41/{name}");
        V41Fixture {
            model: deepinfer_tests::v41_model(&rel),
            data: Expected::read(&deepinfer_tests::fixture_dir(&rel)),
        }
    }
}

/// Token ids of a JSON array.
pub fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("an array of ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// `‖a − b‖₂ / ‖b‖₂`.
pub fn rel_rms(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt() as f32
}

/// How many elements are bit-identical.
pub fn bit_equal(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() == y.to_bits())
        .count()
}

/// Expected selection rows of width `width` (−1 padding dropped).
pub fn expected_rows(flat: &[i32], width: usize) -> Vec<Vec<usize>> {
    flat.chunks_exact(width)
        .map(|r| r.iter().filter(|&&v| v >= 0).map(|&v| v as usize).collect())
        .collect()
}

/// The README's greedy rule: `(agree, decidable)` — how many of the reference's greedy tokens
/// our argmaxes repeat before the first difference, and how many decisions come before the
/// first whose reference top-2 margin is below twice our own logit error on that row. Row
/// `first + g` of `argmaxes` / `row_errors` is greedy step `g`.
pub fn greedy_agreement(
    greedy: &[u32],
    margins: &[f32],
    argmaxes: &[u32],
    row_errors: &[f32],
    first: usize,
) -> (usize, usize) {
    let agree = greedy
        .iter()
        .zip(&argmaxes[first..])
        .take_while(|(a, b)| a == b)
        .count();
    let decidable = (0..greedy.len())
        .take_while(|&g| margins[g] >= 2.0 * row_errors[first + g])
        .count();
    (agree, decidable)
}

/// The README's rule 4 on rows of `vocab` logits: `(top-1 agreements, median KL(reference ‖ ours))`
/// — a row agrees when each side's top token is among the other's top 5.
pub fn logprob_closeness(ours: &[f32], reference: &[f32], vocab: usize) -> (usize, f64) {
    fn top5(row: &[f32]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        order.truncate(5);
        order
    }
    /// `ln Σ e^v` of a row.
    fn log_normaliser(row: &[f32]) -> f64 {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        f64::from(max)
            + row
                .iter()
                .map(|&v| f64::from(v - max).exp())
                .sum::<f64>()
                .ln()
    }
    let mut agree = 0;
    let mut kls: Vec<f64> = ours
        .chunks_exact(vocab)
        .zip(reference.chunks_exact(vocab))
        .map(|(a, r)| {
            let (top_a, top_r) = (top5(a), top5(r));
            if top_r.contains(&top_a[0]) && top_a.contains(&top_r[0]) {
                agree += 1;
            }
            let (za, zr) = (log_normaliser(a), log_normaliser(r));
            a.iter()
                .zip(r)
                .map(|(&x, &y)| {
                    let log_ref = f64::from(y) - zr;
                    log_ref.exp() * (log_ref - (f64::from(x) - za))
                })
                .sum()
        })
        .collect();
    kls.sort_by(f64::total_cmp);
    let median = kls.get(kls.len() / 2).copied().unwrap_or(0.0);
    (agree, median)
}

/// The reference's top-2 margin of every row of `vocab` logits.
pub fn top2_margins(rows: &[f32], vocab: usize) -> Vec<f32> {
    rows.chunks_exact(vocab)
        .map(|row| {
            let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in row {
                if v > first {
                    second = first;
                    first = v;
                } else if v > second {
                    second = v;
                }
            }
            first - second
        })
        .collect()
}
