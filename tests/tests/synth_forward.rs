//! A synthetic checkpoint must behave like a real one in a forward pass: residual streams of the
//! same magnitude as the golden fixture's model (whose weights follow the released checkpoint's
//! statistics) after every block, the same logit scale, finite everywhere. Guards the statistics in
//! `checkpoint::synth` against drifting into a model whose activations explode or vanish.

use std::path::Path;

use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::{EntryOutput, StepEntry, StepOptions};
use deepinfer_model::{ForwardTrace, LogitsWanted, Model};

fn rms(values: &[f32]) -> f64 {
    let sum_sq: f64 = values.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    (sum_sq / values.len() as f64).sqrt()
}

/// Runs a 64-token prefill; returns the RMS of the hc streams after every block and of the logits.
fn prefill_magnitudes(dir: &Path) -> (Vec<f64>, f64) {
    let cfg = ModelConfig::tiny_v41();
    // The fixture's stub tokenizer: token 2k and 2k+1 share compressed id k; pad 2 -> 1.
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, 2).expect("stub vocabulary");
    let model = Model::load_with_vocab(dir, Some(vocab)).expect("model loads");
    let tokens: Vec<u32> = (0..64u32).map(|i| (i * 37 + 11) % 500).collect();
    let mut seq = model.new_sequence();
    let mut trace = ForwardTrace::default();
    let logits = model
        .forward_step(
            &mut [StepEntry::new(&mut seq, &tokens, LogitsWanted::All)],
            StepOptions::traced(&mut trace),
        )
        .and_then(EntryOutput::one_entry_logits)
        .expect("forward");
    assert_eq!(logits.len(), 64 * cfg.vocab_size);
    assert!(
        logits.iter().all(|v| v.is_finite()),
        "non-finite logits from {}",
        dir.display()
    );
    assert_eq!(trace.layer_out.len(), cfg.n_layers);
    (
        trace.layer_out.iter().map(|streams| rms(streams)).collect(),
        rms(&logits),
    )
}

#[test]
fn synthetic_model_has_the_fixture_activation_scale() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&ModelConfig::tiny_v41(), 42, dir.path(), 2).expect("written");
    let (synthetic_layers, synthetic_logits) = prefill_magnitudes(dir.path());
    let (fixture_layers, fixture_logits) =
        prefill_magnitudes(&deepinfer_tests::fixture_dir("v41/v41-tiny"));
    for (layer, (ours, theirs)) in synthetic_layers.iter().zip(&fixture_layers).enumerate() {
        let ratio = ours / theirs;
        assert!(
            (0.67..1.5).contains(&ratio),
            "layer {layer}: stream rms {ours:.4} (synthetic) vs {theirs:.4} (fixture)"
        );
    }
    let ratio = synthetic_logits / fixture_logits;
    assert!(
        (0.8..1.25).contains(&ratio),
        "logit rms {synthetic_logits:.4} (synthetic) vs {fixture_logits:.4} (fixture)"
    );
}
