//! Engram against the `v41-tiny` golden fixture: exact hash rows, and the streams after the
//! Engram of layers 1 and 4 fed with the reference's own inputs.

use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};

use super::{CompressedVocab, Engram, EngramHistory, EngramRows};
use crate::backend::CpuBackend;
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::quant::round_bf16;

/// `$DEEPINFER_FIXTURES/v41/v41-tiny`, else the repository's `tests/fixtures/v41/v41-tiny`; a
/// missing fixture fails the test.
fn fixture_dir() -> PathBuf {
    let dir = std::env::var_os("DEEPINFER_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"))
        .join("v41/v41-tiny");
    assert!(
        dir.join("config.json").is_file(),
        "fixture v41/v41-tiny is missing: no {}",
        dir.join("config.json").display()
    );
    dir
}

type TestResult = Result<(), Box<dyn std::error::Error>>;

struct Fixture {
    case: serde_json::Value,
    expected: Vec<u8>,
}

impl Fixture {
    fn open() -> Result<Fixture, Box<dyn std::error::Error>> {
        let dir = fixture_dir();
        let case = serde_json::from_slice(&std::fs::read(dir.join("case.json"))?)?;
        let expected = std::fs::read(dir.join("expected.safetensors"))?;
        Ok(Fixture { case, expected })
    }

    fn ids(&self, case: &str, key: &str) -> Result<Vec<i64>, Box<dyn std::error::Error>> {
        let list = self.case["cases"][case][key]
            .as_array()
            .ok_or(format!("case.json: cases.{case}.{key}"))?;
        Ok(list.iter().filter_map(serde_json::Value::as_i64).collect())
    }

    fn tensor(
        &self,
        name: &str,
        dtype: Dtype,
    ) -> Result<(Vec<usize>, Vec<u8>), Box<dyn std::error::Error>> {
        let file = SafeTensors::deserialize(&self.expected)?;
        let view = file.tensor(name)?;
        if view.dtype() != dtype {
            return Err(format!("{name}: expected {dtype:?}, found {:?}", view.dtype()).into());
        }
        Ok((view.shape().to_vec(), view.data().to_vec()))
    }

    /// Tensor `name` of `dtype`, its 4-byte values decoded by `decode`.
    fn words<T>(
        &self,
        name: &str,
        dtype: Dtype,
        decode: fn([u8; 4]) -> T,
    ) -> Result<(Vec<usize>, Vec<T>), Box<dyn std::error::Error>> {
        let (shape, bytes) = self.tensor(name, dtype)?;
        let values = bytes
            .chunks_exact(4)
            .map(|b| decode([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok((shape, values))
    }

    fn f32s(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), Box<dyn std::error::Error>> {
        self.words(name, Dtype::F32, f32::from_le_bytes)
    }

    fn i32s(&self, name: &str) -> Result<(Vec<usize>, Vec<i32>), Box<dyn std::error::Error>> {
        self.words(name, Dtype::I32, i32::from_le_bytes)
    }
}

fn load_engram() -> Result<Engram, Box<dyn std::error::Error>> {
    let dir = fixture_dir();
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(&dir)?;
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, 2)?;
    Engram::load(&ckpt, &cfg, vocab)?.ok_or_else(|| "the fixture config has an Engram".into())
}

fn tokens_of(ids: &[i64]) -> Vec<u32> {
    ids.iter().map(|&id| id as u32).collect()
}

fn check_hash(case: &str, chunks: &[usize]) -> TestResult {
    let fixture = Fixture::open()?;
    let engram = load_engram()?;
    let tokens = tokens_of(&fixture.ids(case, "input_ids")?);
    let dead: Vec<bool> = match fixture.ids(case, "token_types") {
        Ok(types) => types.iter().map(|&t| t != -1).collect(),
        Err(_) => vec![false; tokens.len()],
    };
    let (shape, expected) = fixture.i32s(&format!("{case}.prefill.engram_hash"))?;
    assert_eq!(shape, [tokens.len(), 2, 6]);
    let mut history = EngramHistory::new();
    let mut rows = Vec::new();
    let mut start = 0;
    for &end in chunks.iter().chain(std::iter::once(&tokens.len())) {
        let chunk =
            engram
                .hasher()
                .hash_chunk(&mut history, &tokens[start..end], &dead[start..end]);
        rows.extend(chunk.as_slice().iter().map(|&r| r as i32));
        start = end;
    }
    let mismatches = rows.iter().zip(&expected).filter(|(a, b)| a != b).count();
    assert_eq!(
        mismatches,
        0,
        "{case}: {mismatches} of {} hash rows differ",
        expected.len()
    );
    assert_eq!(history.len(), tokens.len());
    Ok(())
}

#[test]
fn text_hash_matches_reference_exactly() -> TestResult {
    check_hash("text", &[])
}

#[test]
fn text_hash_in_chunks_matches_reference_exactly() -> TestResult {
    // The decode schedule: a 75-token prefill, then one token at a time.
    check_hash("text", &(75..100).collect::<Vec<_>>())
}

#[test]
fn vl_hash_with_image_span_matches_reference_exactly() -> TestResult {
    check_hash("vl", &[30])
}

/// Relative RMS error and the largest difference in bf16 ulps of the reference value.
fn compare(ours: &[f32], reference: &[f32]) -> (f64, f32, usize) {
    let (mut diff2, mut ref2, mut max_ulps, mut unequal) = (0.0_f64, 0.0_f64, 0.0_f32, 0);
    for (&a, &b) in ours.iter().zip(reference) {
        let d = f64::from(a - b);
        diff2 += d * d;
        ref2 += f64::from(b) * f64::from(b);
        if a != b {
            unequal += 1;
            let ulp = (round_bf16(b.abs() * (1.0 + 1.0 / 128.0)) - b.abs()).max(f32::MIN_POSITIVE);
            max_ulps = max_ulps.max((a - b).abs() / ulp);
        }
    }
    ((diff2 / ref2).sqrt(), max_ulps, unequal)
}

/// The fixture's text prompt at the Engram: the Engram, the prompt's tokens and their table rows,
/// and the prefill's layer outputs (`per_layer` values a layer).
struct Prefill {
    fixture: Fixture,
    engram: Engram,
    tokens: Vec<u32>,
    rows: EngramRows,
    layer_out: Vec<f32>,
    per_layer: usize,
}

impl Prefill {
    fn open() -> Result<Prefill, Box<dyn std::error::Error>> {
        let fixture = Fixture::open()?;
        let engram = load_engram()?;
        let tokens = tokens_of(&fixture.ids("text", "input_ids")?);
        let rows = engram
            .hasher()
            .hash_chunk(&mut EngramHistory::new(), &tokens, &[]);
        let (shape, layer_out) = fixture.f32s("text.prefill.layer_out")?;
        let per_layer = shape[1..].iter().product::<usize>();
        Ok(Prefill {
            fixture,
            engram,
            tokens,
            rows,
            layer_out,
            per_layer,
        })
    }
}

#[test]
fn engram_out_matches_reference() -> TestResult {
    let Prefill {
        fixture,
        engram,
        rows,
        layer_out,
        per_layer,
        ..
    } = Prefill::open()?;
    for (engram_idx, layer_id) in [(0_usize, 1_usize), (1, 4)] {
        let mut x = layer_out[(layer_id - 1) * per_layer..layer_id * per_layer].to_vec();
        let before = x.clone();
        engram.apply(&CpuBackend, engram_idx, &rows, &mut x, &[]);
        let (_, expected) = fixture.f32s(&format!("text.prefill.engram_out.L{layer_id}"))?;
        let (rel_rms, max_ulps, unequal) = compare(&x, &expected);
        let (change_rms, _, _) = compare(&before, &expected);
        eprintln!(
            "engram L{layer_id}: rel RMS {rel_rms:.3e} (input vs output {change_rms:.3e}), max {max_ulps:.1} bf16 ulp, {unequal}/{} values differ",
            x.len()
        );
        assert!(
            change_rms > 1e-2,
            "the Engram must change the streams noticeably for this test to mean anything"
        );
        assert!(rel_rms < 1e-3, "L{layer_id}: relative RMS {rel_rms:.3e}");
        assert!(
            max_ulps <= 1.0,
            "L{layer_id}: max difference {max_ulps} bf16 ulp"
        );
        assert!(
            unequal <= 8,
            "L{layer_id}: {unequal} values differ from the reference"
        );
    }
    Ok(())
}

#[test]
fn dead_tokens_pass_through() -> TestResult {
    let Prefill {
        engram,
        tokens,
        rows,
        layer_out,
        per_layer,
        ..
    } = Prefill::open()?;
    let before = layer_out[..per_layer].to_vec();
    let dead: Vec<bool> = (0..tokens.len()).map(|t| t % 3 == 0).collect();
    let mut x = before.clone();
    engram.apply(&CpuBackend, 0, &rows, &mut x, &dead);
    let token_width = per_layer / tokens.len();
    for (t, (new, old)) in x
        .chunks_exact(token_width)
        .zip(before.chunks_exact(token_width))
        .enumerate()
    {
        assert_eq!(new == old, dead[t], "token {t}");
    }
    Ok(())
}

#[test]
fn inconsistent_vocabulary_or_layout_is_refused() -> TestResult {
    let dir = fixture_dir();
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(&dir)?;
    let short_vocab = CompressedVocab::halving_stub(cfg.vocab_size - 2, 2)?;
    let err = Engram::load(&ckpt, &cfg, short_vocab)
        .err()
        .ok_or("a 255-id vocabulary must be refused")?;
    assert!(
        err.to_string().contains("engram_compressed_vocab_size"),
        "{err}"
    );

    let mut wrong_rows = cfg.clone();
    if let Some(engram) = wrong_rows.engram.as_mut() {
        engram.num_embeddings[1] += 1;
    }
    let err = Engram::load(
        &ckpt,
        &wrong_rows,
        CompressedVocab::halving_stub(cfg.vocab_size, 2)?,
    )
    .err()
    .ok_or("a table size that disagrees with the primes must be refused")?;
    assert!(err.to_string().contains("engram_num_embeddings"), "{err}");

    let mut no_engram = cfg.clone();
    no_engram.engram = None;
    assert!(
        Engram::load(
            &ckpt,
            &no_engram,
            CompressedVocab::halving_stub(cfg.vocab_size, 2)?
        )?
        .is_none()
    );
    Ok(())
}
