//! Shared by the golden test binaries: reading a fixture's `case.json` and
//! `expected.safetensors`, and the comparisons its README prescribes (max |Δ|, relative RMS,
//! bitwise counts, selections with −1 padding).

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use std::path::Path;

use deepinfer_model::Model;
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

/// The V4.1 fixture `v41-tiny`: its model (with the stub Engram vocabulary of its README) and its
/// reference data.
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
    /// The v41-tiny fixture (a missing one fails the test).
    pub fn load() -> V41Fixture {
        V41Fixture {
            model: deepinfer_tests::v41_tiny_model(),
            data: Expected::read(&deepinfer_tests::fixture_dir("v41/v41-tiny")),
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

/// The index of the largest value (the first on ties): the greedy token.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
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
