//! Golden tests of the V4.1 vision path (`vl` case of `tests/fixtures/v41/v41-tiny`, tolerances
//! from its README): preprocessing, ViT, aligner, the image-span layout and the whole prompt with
//! an image through prefill, decode and DSpark, plus chunking invariance around an image span.
//! `vl.prefill.engram_hash` (dead image positions) is covered by the Engram module's own fixture
//! test (`vl_hash_with_image_span_matches_reference_exactly`).

mod golden_support;

use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::v41::StepExtras;
use deepinfer_model::v41::vision::{
    self, EncodedImage, ImageInput, PlacedImage, TokenType, VisionError,
};
use deepinfer_model::{EntryOutput, StepEntry, StepOptions};
use deepinfer_model::{ForwardTrace, LogitsWanted, Model, SequenceState};
use deepinfer_tests::forward_one;
use golden_support::v41_rules::{
    COEFF_RMS, Golden, SAME_ARITHMETIC_LOGITS, STREAM_RMS, check_compressed_caches,
    check_decode_run, check_prefill_selections, inject_reference_topk, row_errors, summary,
};
use golden_support::{
    V41Fixture as Fixture, argmax, bit_equal, expected_rows, ids, max_abs_diff, rel_rms,
};
use serde_json::Value;

impl Fixture {
    fn vl(&self) -> &Value {
        &self.case()["cases"]["vl"]
    }

    fn usize_at(value: &Value) -> usize {
        value.as_u64().expect("unsigned") as usize
    }

    fn tokens(&self) -> Vec<u32> {
        ids(&self.vl()["input_ids"])
    }

    /// The fixture image as the model's input.
    fn image(&self) -> ImageInput {
        let image = &self.vl()["image"];
        ImageInput {
            pixels: self
                .i32("vl.image_pixels")
                .into_iter()
                .map(|v| u8::try_from(v).expect("pixel byte"))
                .collect(),
            width: Self::usize_at(&image["width"]),
            height: Self::usize_at(&image["height"]),
        }
    }

    fn image_start(&self) -> usize {
        Self::usize_at(&self.vl()["image"]["start"])
    }

    /// `max − min` of the case's one-shot prefill logits (the README's logit range).
    fn logit_range(&self) -> f32 {
        self.range_of("vl.prefill.logits")
    }
}

/// The prompt's token types: text, then the image's span at its start.
fn prompt_token_types(n: usize, start: usize, image: &EncodedImage) -> Vec<TokenType> {
    let mut types = vec![TokenType::Text; n];
    for (i, kind) in image.token_types().into_iter().enumerate() {
        types[start + i] = kind;
    }
    types
}

/// Runs `tokens[range]` (which holds the image's whole span, or none of it) as one chunk.
fn run_chunk(
    model: &Model,
    seq: &mut SequenceState,
    tokens: &[u32],
    range: std::ops::Range<usize>,
    image: &EncodedImage,
    image_start: usize,
    trace: Option<&mut ForwardTrace>,
) -> Result<Vec<f32>, VisionError> {
    let placed: Vec<PlacedImage<'_>> = if range.contains(&image_start) {
        vec![PlacedImage {
            start: image_start - range.start,
            image,
        }]
    } else {
        Vec::new()
    };
    let chunk = &tokens[range];
    let images = model.place_images(chunk, &placed)?;
    let options = StepOptions {
        family: StepExtras {
            trace,
            images: Some(&images),
            cp: None,
        },
        ..StepOptions::default()
    };
    let entry = StepEntry::new(seq, chunk, LogitsWanted::All);
    Ok(model
        .forward_step(&mut [entry], options)
        .and_then(EntryOutput::one_entry_logits)?)
}

#[test]
fn image_patches_vit_aligner_and_token_types_match_reference() {
    const VIT_RMS: f32 = 1e-2;
    let fx = Fixture::load("v41-tiny");
    let tower = fx.model.vision_tower().expect("fixture has a vision tower");
    let image = fx.image();
    let prepared = vision::preprocess::prepare(&image, &tower.cfg).expect("prepare");
    let case_image = &fx.vl()["image"];
    assert_eq!(
        (
            prepared.grid.n_vit_h,
            prepared.grid.n_vit_w,
            prepared.grid.n_llm_h,
            prepared.grid.n_llm_w,
            prepared.grid.span_len()
        ),
        (
            Fixture::usize_at(&case_image["n_vit_h"]),
            Fixture::usize_at(&case_image["n_vit_w"]),
            Fixture::usize_at(&case_image["n_llm_h"]),
            Fixture::usize_at(&case_image["n_llm_w"]),
            Fixture::usize_at(&case_image["span_len"]),
        )
    );
    let patches = fx.f32("vl.image_patches");
    assert_eq!(
        bit_equal(&prepared.patches, &patches),
        patches.len(),
        "image_patches are exact"
    );

    let backend = fx.model.backend();
    let vit_out = tower
        .vit
        .forward(backend, &prepared.patches, &prepared.grid);
    let expected_vit = fx.f32("vl.vit_out");
    let vit_err = rel_rms(&vit_out, &expected_vit);
    // The aligner alone, on the reference's ViT output.
    let aligned_ref = tower.aligner.forward(&expected_vit, &prepared.grid);
    let expected_aligner = fx.f32("vl.aligner_out");
    let aligner_alone_err = rel_rms(&aligned_ref, &expected_aligner);
    let encoded = fx.model.encode_image(&image).expect("encode");
    let aligner_err = rel_rms(&encoded.rows, &expected_aligner);
    eprintln!(
        "vit_out relRMS {vit_err:.3e} ({} of {} bit-exact); aligner_out relRMS {aligner_err:.3e} \
         ({} of {} bit-exact), on the reference's vit_out {aligner_alone_err:.3e} ({} bit-exact)",
        bit_equal(&vit_out, &expected_vit),
        expected_vit.len(),
        bit_equal(&encoded.rows, &expected_aligner),
        expected_aligner.len(),
        bit_equal(&aligned_ref, &expected_aligner),
    );
    assert!(vit_err <= VIT_RMS, "vit_out relRMS {vit_err}");
    assert!(aligner_err <= VIT_RMS, "aligner_out relRMS {aligner_err}");
    assert!(
        aligner_alone_err <= VIT_RMS,
        "aligner relRMS {aligner_alone_err}"
    );

    let n = fx.tokens().len();
    let types: Vec<i32> = prompt_token_types(n, fx.image_start(), &encoded)
        .iter()
        .map(|t| t.code())
        .collect();
    assert_eq!(types, fx.i32("vl.token_types"), "token_types are exact");

    // The prompt with one placeholder expands to the fixture's input ids.
    let tokens = fx.tokens();
    let start = fx.image_start();
    let image_token = fx.model.config().image_token_id.expect("image token");
    let mut placeholder_prompt = tokens[..start].to_vec();
    placeholder_prompt.push(image_token);
    placeholder_prompt.extend_from_slice(&tokens[start + encoded.span_len()..]);
    let expanded = vision::expand_image_placeholders(
        &placeholder_prompt,
        image_token,
        std::slice::from_ref(&encoded),
    )
    .expect("expand");
    assert_eq!(expanded.tokens, tokens);
    assert_eq!(expanded.image_starts, [start]);
}

/// A checkpoint without `vision.*` tensors (the synthetic writer's) loads as text-only and
/// refuses images with a clear error; a malformed pixel buffer is refused before any compute.
#[test]
fn images_are_refused_without_a_vision_tower_or_with_bad_pixels() {
    let cfg = deepinfer_model::config::ModelConfig::tiny_v41();
    let dir = tempfile::tempdir().expect("temp dir");
    deepinfer_model::checkpoint::synth::write_random_checkpoint(&cfg, 3, dir.path(), 1)
        .expect("random checkpoint");
    let pad = cfg.engram.as_ref().expect("engram").pad_token_id;
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, pad).expect("stub vocab");
    let model = Model::load_with_vocab(dir.path(), Some(vocab)).expect("text-only model loads");
    assert!(model.vision_tower().is_none());
    let image = ImageInput {
        pixels: vec![0; 28 * 28 * 3],
        width: 28,
        height: 28,
    };
    assert!(matches!(
        model.encode_image(&image),
        Err(VisionError::NoVisionTower { .. })
    ));

    let fx = Fixture::load("v41-tiny");
    let short = ImageInput {
        pixels: vec![0; 10],
        width: 28,
        height: 28,
    };
    assert!(matches!(
        fx.model.encode_image(&short),
        Err(VisionError::PixelBuffer {
            expected: 2352,
            found: 10,
            ..
        })
    ));
}

/// The whole `vl` prompt, free-running, against the README's rules: the one-shot prefill
/// (`vl.prefill.*`: every logits row within `tolerance`, the per-tensor checks, index top-k exact
/// on every row without a recorded tie, every image-span row routed as the reference does — with
/// `bias_vl`), then the decode run (P-token prefill with the image, teacher-forced steps, greedy
/// steps, a DSpark proposal after each) by the shared decode rules.
#[test]
fn vl_prompt_prefill_decode_and_dspark_follow_the_readme_rules() {
    let fx = Fixture::load("v41-tiny");
    let g = Golden::vl(&fx);
    let model = &fx.model;
    let cfg = model.config().clone();
    let (vocab, k) = (cfg.vocab_size, cfg.n_activated_experts);
    let tokens = fx.tokens();
    let n = tokens.len();
    let start = fx.image_start();
    let image = model.encode_image(&fx.image()).expect("encode");

    let mut seq = model.new_sequence();
    let mut trace = ForwardTrace::default();
    let logits = run_chunk(
        model,
        &mut seq,
        &tokens,
        0..n,
        &image,
        start,
        Some(&mut trace),
    )
    .expect("prefill");
    let errors = row_errors(&logits, &fx.f32(g.full), vocab, g.range());
    let hidden_err = rel_rms(&trace.final_hidden, &g.f32("prefill.final_hidden"));
    let main_hidden_err = rel_rms(&trace.main_hidden, &g.f32("prefill.main_hidden"));
    let pre_err = rel_rms(&trace.layer_pre.concat(), &g.f32("prefill.layer_pre"));
    let route_w: Vec<f32> = trace.route_w.iter().flatten().flatten().copied().collect();
    let route_w_err = rel_rms(&route_w, &g.f32("prefill.route_w"));
    let route_idx = expected_rows(&g.i32("prefill.route_idx"), k);
    let route_rows_differing: Vec<(usize, usize)> = (0..cfg.n_layers * n)
        .map(|row| (row / n, row % n))
        .filter(|&(l, t)| trace.route_idx[l][t] != route_idx[l * n + t])
        .collect();
    eprintln!(
        "vl prefill logits: {}; final_hidden relRMS {hidden_err:.3e}; main_hidden \
         {main_hidden_err:.3e}; layer_pre {pre_err:.3e}; route_w {route_w_err:.3e}; route_idx \
         (layer, row) differing {route_rows_differing:?}",
        summary(&errors)
    );
    check_prefill_selections(&g, &trace, n);
    check_compressed_caches(&g, &seq);
    assert!(
        errors.iter().all(|&e| e <= fx.tolerance()),
        "vl.prefill.logits beyond the tolerance"
    );
    assert!(hidden_err <= STREAM_RMS && main_hidden_err <= STREAM_RMS);
    assert!(pre_err <= COEFF_RMS && route_w_err <= COEFF_RMS);
    assert!(route_rows_differing.len() * 100 <= 5 * cfg.n_layers * n);
    assert!(
        route_rows_differing
            .iter()
            .all(|&(_, t)| !(start..start + image.span_len()).contains(&t)),
        "an image-span row routes differently"
    );
    assert_eq!(
        argmax(&logits[(n - 1) * vocab..]),
        fx.vl()["runs"]["prefill"]["greedy_next"]
            .as_u64()
            .expect("greedy_next") as u32
    );
    check_decode_run(&g, &logits, |seq, len| {
        run_chunk(model, seq, &tokens, 0..len, &image, start, None).expect("decode-run prefill")
    });
}

/// The `vl` prefill with the reference's index selections injected (`vl.prefill.topk.*`): what is
/// left is the arithmetic of every block on image and text rows alike.
#[test]
fn vl_prefill_matches_reference_given_reference_selections() {
    let fx = Fixture::load("v41-tiny");
    let model = &fx.model;
    let cfg = model.config().clone();
    let vocab = cfg.vocab_size;
    let tokens = fx.tokens();
    let n = tokens.len();
    let image = model.encode_image(&fx.image()).expect("encode");
    let mut trace = ForwardTrace::default();
    inject_reference_topk(&Golden::vl(&fx), &mut trace, n);
    let logits = run_chunk(
        model,
        &mut model.new_sequence(),
        &tokens,
        0..n,
        &image,
        fx.image_start(),
        Some(&mut trace),
    )
    .expect("prefill");
    let reference = fx.f32("vl.prefill.logits");
    let err = max_abs_diff(&logits, &reference) / fx.logit_range();
    let hidden_err = rel_rms(&trace.final_hidden, &fx.f32("vl.prefill.final_hidden"));
    let pre_err = rel_rms(&trace.layer_pre.concat(), &fx.f32("vl.prefill.layer_pre"));
    eprintln!(
        "vl prefill given the reference selections: logits max|Δ|/range {err:.3e}, final_hidden \
         relRMS {hidden_err:.3e} ({} of {} bit-exact), layer_pre {pre_err:.3e}",
        bit_equal(&trace.final_hidden, &fx.f32("vl.prefill.final_hidden")),
        n * cfg.dim
    );
    assert_eq!(logits.len(), n * vocab);
    assert!(err <= SAME_ARITHMETIC_LOGITS, "logits {err}");
}

/// A prompt with an image, chunked anywhere outside the image's span, gives the one-shot logits
/// bit for bit; a chunk that cuts the span, or a span over text tokens, is refused.
#[test]
fn chunking_around_an_image_span_is_bitwise_invariant() {
    let fx = Fixture::load("v41-tiny");
    let model = &fx.model;
    let tokens = fx.tokens();
    let n = tokens.len();
    let start = fx.image_start();
    let image = model.encode_image(&fx.image()).expect("encode");
    let span = image.span_len();
    let mut seq = model.new_sequence();
    let one_shot =
        run_chunk(model, &mut seq, &tokens, 0..n, &image, start, None).expect("one shot");
    for cuts in [
        vec![start, start + span],
        vec![7, start + span + 1, 45],
        vec![1, 2, 3, start + span, start + span + 1],
    ] {
        let mut seq = model.new_sequence();
        let mut logits = Vec::new();
        let mut at = 0;
        for end in cuts.iter().copied().chain([n]) {
            logits.extend(
                run_chunk(model, &mut seq, &tokens, at..end, &image, start, None).expect("chunk"),
            );
            at = end;
        }
        assert!(
            logits
                .iter()
                .zip(&one_shot)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "chunking at {cuts:?}"
        );
    }
    // The span must lie inside the chunk and over image tokens.
    let cut = [PlacedImage {
        start,
        image: &image,
    }];
    assert!(matches!(
        model.place_images(&tokens[..start + 3], &cut),
        Err(VisionError::SpanOutsideChunk { .. })
    ));
    let shifted = [PlacedImage {
        start: start - 1,
        image: &image,
    }];
    assert!(matches!(
        model.place_images(&tokens, &shifted),
        Err(VisionError::SpanToken { .. })
    ));
    // Spans placed in one chunk do not run with another.
    let placed = [PlacedImage {
        start,
        image: &image,
    }];
    let images = model.place_images(&tokens, &placed).expect("placed");
    let mut seq = model.new_sequence();
    let other = [tokens.clone(), vec![tokens[0]]].concat();
    let entry = StepEntry::new(&mut seq, &other[1..], LogitsWanted::Last);
    let error = model
        .forward_step(&mut [entry], StepOptions::with_images(&images))
        .expect_err("spans of another chunk");
    assert!(error.to_string().contains("image spans"), "{error}");
    assert!(seq.is_empty(), "a refused step changes nothing");
    // Without images the entry is a plain step.
    let text = &tokens[..start];
    let mut a = model.new_sequence();
    let mut b = model.new_sequence();
    let none = model.place_images(text, &[]).expect("no spans");
    assert_eq!(
        model
            .forward_step(
                &mut [StepEntry::new(&mut a, text, LogitsWanted::All)],
                StepOptions::with_images(&none)
            )
            .and_then(EntryOutput::one_entry_logits)
            .expect("text"),
        forward_one(model, &mut b, text, LogitsWanted::All).expect("text")
    );
}
