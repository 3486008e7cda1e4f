//! Golden tests of the V4.1 forward pass on the CPU reference backend against DeepSeek's official
//! reference outputs (`tests/fixtures/v41/v41-tiny`, tolerances from its README), plus the
//! chunking / verify / rollback invariance of the per-sequence state.

mod golden_support;

use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::{ForwardTrace, LogitsWanted, Model, SequenceState};
use golden_support::{
    V41Fixture as Fixture, argmax, bit_equal, expected_rows, greedy_agreement, ids, max_abs_diff,
    rel_rms,
};
use serde_json::Value;

impl Fixture {
    fn tokens(&self) -> Vec<u32> {
        ids(&self.case()["cases"]["text"]["input_ids"])
    }

    fn decode_run(&self) -> &Value {
        &self.case()["cases"]["text"]["runs"]["decode"]
    }

    /// `max − min` of `logits_full`, the README's logit range.
    fn logit_range(&self) -> f32 {
        self.range_of("logits_full")
    }
}

/// Injects the reference's streams and collapse weights at the entry of every block (and of the
/// final collapse), so each block is compared on the reference's own inputs.
fn inject_reference_streams(fx: &Fixture, trace: &mut ForwardTrace, n: usize) {
    let cfg = fx.model.config();
    let (hc, dim, layers) = (cfg.hc.mult, cfg.dim, cfg.n_layers);
    let layer_out = fx.f32("text.prefill.layer_out");
    let layer_pre = fx.f32("text.prefill.layer_pre");
    let (size, pre_size) = (n * hc * dim, n * hc);
    trace.inject.streams = vec![None; layers + 1];
    trace.inject.pre = vec![None; layers + 1];
    for l in 1..=layers {
        trace.inject.streams[l] = Some(layer_out[(l - 1) * size..l * size].to_vec());
        trace.inject.pre[l] = Some(layer_pre[(l - 1) * pre_size..l * pre_size].to_vec());
    }
}

/// Per backbone layer of a free-running (nothing injected) prefill against the reference: the
/// streams' relative RMS error and the first rows whose index top-k / routed experts differ.
struct LayerDivergence {
    stream_rms: f32,
    first_topk_mismatch: Option<usize>,
    first_route_mismatch: Option<usize>,
}

fn layer_divergence(fx: &Fixture, trace: &ForwardTrace, n: usize) -> Vec<LayerDivergence> {
    let cfg = fx.model.config();
    let (hc, dim, k) = (cfg.hc.mult, cfg.dim, cfg.n_activated_experts);
    let layer_out = fx.f32("text.prefill.layer_out");
    let route_idx = fx.i32("text.prefill.route_idx");
    let size = n * hc * dim;
    (0..cfg.n_layers)
        .map(|l| {
            let first_route_mismatch = (0..n).find(|&t| {
                let expect: Vec<usize> = route_idx[(l * n + t) * k..(l * n + t + 1) * k]
                    .iter()
                    .map(|&v| v as usize)
                    .collect();
                trace.route_idx[l][t] != expect
            });
            let first_topk_mismatch = cfg.index_source_layers.contains(&l).then(|| {
                let width = cfg.index_topk.min(n / cfg.compress_ratio(l));
                let expect = expected_rows(&fx.i32(&format!("text.prefill.topk.L{l}")), width);
                (0..n).find(|&t| trace.topk[l][t] != expect[t])
            });
            LayerDivergence {
                stream_rms: rel_rms(&trace.layer_out[l], &layer_out[l * size..(l + 1) * size]),
                first_topk_mismatch: first_topk_mismatch.flatten(),
                first_route_mismatch,
            }
        })
        .collect()
}

/// Free-running prefill and decode against the reference logits.
///
/// The model is chaotic at the fixture's scale: one bf16 rounding that lands on the other side
/// moves an activation by an E4M3 step when it sits on a quantiser tie, and index top-k / routing
/// decisions follow. So the free-running logits match only as far as every rounding does, and the
/// README tolerance (max|Δ|/range ≤ 0.005) needs the reference's fp32 arithmetic bit for bit.
/// Where it stands (per-layer numbers printed below):
/// - Reproduced: the GEMM order of the mHC mixes (K-blocks of 256 whose partials are added
///   pairwise, not in K order), the reference's torch CPU summation order for every mean of
///   squares (RMSNorm, mHC mixes, Engram gate) and the gate's dot product, the vectorised `exp` in
///   the sigmoids (mHC `pre`/`post`, Engram gate), SiLU and softplus, SLEEF's `log1p` in the
///   router's softplus, and the accurate `exp` of the reference's standalone `torch.exp` in the
///   mHC `comb` softmax. The mixes' order moved the free-running logits from 0.149 to 0.104 of the
///   range; the `comb` `exp` from 0.104 to 0.052 (rows within the README tolerance 31 → 72, greedy
///   tokens agreeing 1 → 9 of 17): with the vectorised `exp` there the `comb` coefficients were an
///   ulp off often enough to flip 13 expand roundings per prefill (5 attention-site, 8 FFN-site).
///   Blocks 0 and 1 are now bit-exact free-running; the first top-k mismatch is at layer 6 row 71.
/// - Left, and not ownable: 5 block-local expand flips per prefill with the reference's inputs
///   (blocks 2, 3, 5, 6, 8 at positions 71, 68, 11, 18, 2; block 2 position 71 is where the
///   free-running prefill first departs). Each is one element of the post-attention streams whose
///   fp32 sum sits on, or 2 and 32 fp32 ulps from, a bf16 midpoint; flipping that one element (and
///   no other) reproduces the reference's FFN-site `pre` bit for bit. Checked against torch 2.11
///   itself used as an arithmetic oracle: its Sinkhorn (`sum` orders, divisions, `+ eps`), sigmoids
///   and expand sums equal this backend's bit for bit on all 38 400 `comb` and 9 600 attention-site
///   `pre`/`post` values once its `torch.exp` is replaced by the correctly rounded one, so the only
///   free operation is that `exp`, which is MKL's `vsExp` in high-accuracy mode (errors up to ~0.55
///   ulp, not correctly rounded, and CPU-dependent: MKL's AVX2 path on this project's machines
///   rounds other inputs the other way). At each flip one `comb` logit's exact `e^z` lies 0.44–0.5
///   ulp from a rounding midpoint (block 2 position 71: `z = -2.6681757`, 0.484 ulp), and rounding
///   just that `exp` the other way reproduces the reference. Reproducing these would take the
///   reference machine's MKL `exp`, so the correctly rounded one stays. A throwaway probe that
///   rounded those 5 inputs the other way (bit patterns, not code) made the free-running prefill
///   bit-exact in every block and logits_full 1.3e-7 of the range (100 of 100 rows), and the decode
///   rows within the prompt 8.7e-4 (the reference's own prefill-vs-decode difference); the greedy
///   steps past the prompt still drift (text.decode.logits 0.095): the first discrete difference is
///   decode step 31 (position 106), the index top-k of layers 6, 8 and 10 with no recorded tie, and
///   rounding any one of that step's 34 near-midpoint `comb` exps the other way does not change it.
///   There layer 6 keeps key 6 (score 0.0049743652, tied with another key at the 8th place) where
///   the reference keeps key 71 (0.00491333 here); the index keys equal the fixture's, so the
///   reference's index query or head weights at that position differ (cause not found; the fixture
///   records no per-block decode tensors).
/// - Not reproducible with chunking invariance: the reference's elementwise kernels run the last
///   `numel mod 32` elements of a tensor through the scalar (correctly rounded) `exp` instead of the
///   vectorised one. With `numel = 4·T` for the mHC sigmoids that is the last 4 prompt positions
///   and every decode step (checked offline: it explains all 6 `pre` mismatches of rows 96–99),
///   so the reference's own numbers depend on how a sequence is chunked; this backend keeps one
///   `exp` for every row. (Measured with a throwaway probe: libm-style `exp`/`log1p` in every
///   decode step, as the reference's one-token calls, changed none of the decode numbers below.)
#[test]
fn free_running_prefill_and_decode_match_until_the_first_rounding_flip() {
    // Bounds reached (printed): logits max|Δ|/range (0.0518 prefill, 0.0978 decode steps), rows
    // within the README tolerance, greedy tokens agreeing with the reference's.
    const FREE_RUNNING: f32 = 0.053;
    const DECODE: f32 = 0.099;
    const ROWS_WITHIN_TOLERANCE: usize = 72;
    const GREEDY_AGREE: usize = 9;
    // Blocks before the first block-local expand flip (block 2) are bit-exact.
    const BIT_EXACT_BLOCKS: usize = 2;
    // Blocks with no index top-k / routing mismatch (the first is at layer 6).
    const SELECTIONS_EXACT_BLOCKS: usize = 6;
    let fx = Fixture::load();
    let cfg = fx.model.config().clone();
    let vocab = cfg.vocab_size;
    let tokens = fx.tokens();
    let n = tokens.len();
    let range = fx.logit_range();
    let mut seq = fx.model.new_sequence();
    let mut trace = ForwardTrace::default();
    let logits = fx
        .model
        .forward_traced(&mut seq, &tokens, LogitsWanted::All, Some(&mut trace))
        .expect("prefill");
    let divergence = layer_divergence(&fx, &trace, n);
    for (l, d) in divergence.iter().enumerate() {
        eprintln!(
            "free-running block {l}: layer_out relRMS {:.2e}, first topk mismatch at row {:?}, first route mismatch at row {:?}",
            d.stream_rms, d.first_topk_mismatch, d.first_route_mismatch
        );
    }
    for (l, d) in divergence.iter().enumerate().take(BIT_EXACT_BLOCKS) {
        assert_eq!(d.stream_rms, 0.0, "block {l} is bit-exact");
    }
    for (l, d) in divergence.iter().enumerate().take(4) {
        assert!(d.stream_rms <= 1e-4, "block {l}: relRMS {}", d.stream_rms);
    }
    for (l, d) in divergence.iter().enumerate().take(SELECTIONS_EXACT_BLOCKS) {
        assert!(
            d.first_topk_mismatch.is_none() && d.first_route_mismatch.is_none(),
            "block {l}: a selection differs"
        );
    }

    let reference = fx.f32("logits_full");
    let prefill_row_errors: Vec<f32> = (0..n)
        .map(|t| {
            let row = t * vocab..(t + 1) * vocab;
            max_abs_diff(&logits[row.clone()], &reference[row]) / range
        })
        .collect();
    let within = prefill_row_errors
        .iter()
        .filter(|&&e| e <= fx.tolerance())
        .count();
    let overall = prefill_row_errors.iter().fold(0.0f32, |m, &e| m.max(e));
    eprintln!(
        "free-running logits_full: {within} of {n} rows within the tolerance {}; overall max|Δ|/range = {overall:.3e}",
        fx.tolerance()
    );
    assert!(
        within >= ROWS_WITHIN_TOLERANCE,
        "only {within} rows within tolerance"
    );
    assert!(
        overall <= FREE_RUNNING,
        "logits_full max|Δ|/range {overall}"
    );

    let run = fx.decode_run();
    let prefill_len = run["prefill_len"].as_u64().expect("prefill_len") as usize;
    let fed: Vec<u32> = run["fed_tokens"]
        .as_array()
        .expect("fed")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect();
    let mut seq = fx.model.new_sequence();
    let prefill = fx
        .model
        .forward(&mut seq, &tokens[..prefill_len], LogitsWanted::All)
        .expect("prefill");
    assert_eq!(
        prefill[..],
        logits[..prefill_len * vocab],
        "the P-token prefill rows equal the one-shot rows"
    );
    let decode_expected = fx.f32("text.decode.logits");
    // `logits_decode`: rows < P from the P-token prefill, rows ≥ P from the decode steps.
    let schedule = fx.f32("logits_decode");
    let mut schedule_error = max_abs_diff(
        &prefill[..prefill_len * vocab],
        &schedule[..prefill_len * vocab],
    ) / range;
    let mut decode_error = 0.0f32;
    let mut row_errors = Vec::new();
    let mut argmaxes = Vec::new();
    for (s, &token) in fed.iter().enumerate() {
        let row = fx
            .model
            .forward(&mut seq, &[token], LogitsWanted::Last)
            .expect("decode step");
        let error = max_abs_diff(&row, &decode_expected[s * vocab..(s + 1) * vocab]);
        decode_error = decode_error.max(error / range);
        row_errors.push(error);
        if prefill_len + s < n {
            let t = prefill_len + s;
            schedule_error = schedule_error
                .max(max_abs_diff(&row, &schedule[t * vocab..(t + 1) * vocab]) / range);
            let one_shot = &logits[(prefill_len + s) * vocab..(prefill_len + s + 1) * vocab];
            assert_eq!(
                row[..],
                one_shot[..],
                "decode step {s} equals the one-shot row"
            );
        }
        argmaxes.push(argmax(&row));
    }
    let as_u32s = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    let greedy = as_u32s(&run["greedy_tokens"]);
    let margins: Vec<f32> = run["greedy_top2_margins"]
        .as_array()
        .expect("margins")
        .iter()
        .map(|m| m.as_f64().expect("margin") as f32)
        .collect();
    let first_greedy_step = n - 1 - prefill_len;
    let (agree, decidable) =
        greedy_agreement(&greedy, &margins, &argmaxes, &row_errors, first_greedy_step);
    eprintln!(
        "free-running logits_decode: max|Δ|/range = {schedule_error:.3e}; text.decode.logits: {decode_error:.3e}; \
         greedy tokens: first {agree} of {} agree, {decidable} decidable by the margin rule",
        greedy.len()
    );
    assert!(
        schedule_error <= DECODE && decode_error <= DECODE,
        "logits_decode {schedule_error}, text.decode.logits {decode_error}"
    );
    assert!(
        agree >= decidable,
        "greedy token {agree} differs although its margin exceeds twice our error"
    );
    assert!(
        agree >= GREEDY_AGREE,
        "only the first {agree} greedy tokens agree"
    );
}

#[test]
fn every_block_matches_reference_given_reference_inputs() {
    // README bounds: relRMS 2e-2 (streams, caches), 1e-2 (pre, route_w), logits 5e-3 of the range,
    // selections on 95% of rows. This backend is orders of magnitude inside them (see the printed
    // numbers); the tighter bounds below make a regression visible.
    const STREAM_RMS: f32 = 1e-4;
    const COEFF_RMS: f32 = 1e-5;
    const LOGITS: f32 = 1e-5;
    // Bit-exact counts reached (of 4800 `pre` coefficients and 2400 routing weights): they need
    // the reference's summation orders (torch's row sum for the means of squares, the mixes GEMM's
    // pairwise K-blocks), its accurate `exp` in the `comb` softmax (4765 / 2384 with the
    // vectorised one) and its SLEEF `log1p` (2384 with a correctly rounded one); an exactly
    // rounded sum gives ~4500 and ~2280.
    const PRE_BIT_EXACT: usize = 4775;
    // The 13 routing weights left: 12 are where the reference's router `sqrt` (torch's
    // `Tensor.sqrt` runs MKL's `vsSqrt`, not correctly rounded) rounds down an exact root 0.47–0.5
    // ulp below the correctly rounded one (rounding those 12 down makes all 2400 exact in a
    // throwaway probe); one is block 5 position 11, downstream of that block's expand flip.
    const ROUTE_W_BIT_EXACT: usize = 2387;
    // Of 1 228 800 stream elements: 11 differ (5 block-local mHC expand roundings, see
    // `free_running_prefill_and_decode_match_until_the_first_rounding_flip`); 27 with the
    // vectorised `exp` in the `comb` softmax.
    const LAYER_OUT_BIT_EXACT: usize = 1_228_789;
    let fx = Fixture::load();
    let cfg = fx.model.config().clone();
    let tokens = fx.tokens();
    let n = tokens.len();
    let mut seq = fx.model.new_sequence();
    let mut trace = ForwardTrace::default();
    inject_reference_streams(&fx, &mut trace, n);
    let logits = fx
        .model
        .forward_traced(&mut seq, &tokens, LogitsWanted::All, Some(&mut trace))
        .expect("prefill");

    let range = fx.logit_range();
    let logits_err = max_abs_diff(&logits, &fx.f32("logits_full")) / range;
    eprintln!(
        "logits_full (reference streams into the head): max|Δ|/range = {logits_err:.3e} (range {range})"
    );

    let (hc, dim) = (cfg.hc.mult, cfg.dim);
    let layer_out = fx.f32("text.prefill.layer_out");
    let layer_pre = fx.f32("text.prefill.layer_pre");
    let window_kv = fx.f32("text.prefill.window_kv");
    let route_idx = fx.i32("text.prefill.route_idx");
    let route_w = fx.f32("text.prefill.route_w");
    let k = cfg.n_activated_experts;
    let mut route_mismatch = 0;
    let (mut pre_exact, mut route_w_exact, mut out_exact) = (0, 0, 0);
    for l in 0..cfg.n_layers {
        let size = n * hc * dim;
        let out_err = rel_rms(&trace.layer_out[l], &layer_out[l * size..(l + 1) * size]);
        let kv_err = rel_rms(
            &trace.window_kv[l],
            &window_kv[l * n * cfg.head_dim..(l + 1) * n * cfg.head_dim],
        );
        let pre_err = rel_rms(
            &trace.layer_pre[l],
            &layer_pre[l * n * hc..(l + 1) * n * hc],
        );
        let ours_w: Vec<f32> = trace.route_w[l].iter().flatten().copied().collect();
        let w_err = rel_rms(&ours_w, &route_w[l * n * k..(l + 1) * n * k]);
        pre_exact += bit_equal(
            &trace.layer_pre[l],
            &layer_pre[l * n * hc..(l + 1) * n * hc],
        );
        route_w_exact += bit_equal(&ours_w, &route_w[l * n * k..(l + 1) * n * k]);
        out_exact += bit_equal(&trace.layer_out[l], &layer_out[l * size..(l + 1) * size]);
        for t in 0..n {
            let expect: Vec<usize> = route_idx[(l * n + t) * k..(l * n + t + 1) * k]
                .iter()
                .map(|&v| v as usize)
                .collect();
            if trace.route_idx[l][t] != expect {
                route_mismatch += 1;
            }
        }
        eprintln!(
            "block {l}: layer_out relRMS {out_err:.2e}, window_kv {kv_err:.2e}, layer_pre {pre_err:.2e}, route_w {w_err:.2e}"
        );
        assert!(
            out_err <= STREAM_RMS && kv_err <= STREAM_RMS,
            "block {l}: layer_out {out_err}, window_kv {kv_err}"
        );
        assert!(
            pre_err <= COEFF_RMS && w_err <= COEFF_RMS,
            "block {l}: layer_pre {pre_err}, route_w {w_err}"
        );
        // Block 0 reads the embeddings only: every rounding of it matches.
        assert!(l != 0 || out_err == 0.0, "block 0: layer_out {out_err}");
    }
    eprintln!(
        "bit-exact: layer_pre {pre_exact} of {}, route_w {route_w_exact} of {}, layer_out {out_exact} of {}",
        cfg.n_layers * n * hc,
        cfg.n_layers * n * k,
        cfg.n_layers * n * hc * dim
    );
    assert!(
        pre_exact >= PRE_BIT_EXACT && route_w_exact >= ROUTE_W_BIT_EXACT,
        "bit-exact layer_pre {pre_exact}, route_w {route_w_exact}"
    );
    assert!(
        out_exact >= LAYER_OUT_BIT_EXACT,
        "bit-exact layer_out {out_exact}"
    );
    let route_rows = cfg.n_layers * n;
    eprintln!("route_idx: {route_mismatch} of {route_rows} rows differ");
    assert!(
        route_mismatch <= 2,
        "route_idx differs on {route_mismatch} of {route_rows} rows"
    );

    for layer in cfg
        .engram
        .as_ref()
        .map(|e| e.layer_ids.clone())
        .unwrap_or_default()
    {
        let err = rel_rms(
            &trace.engram_out[layer],
            &fx.f32(&format!("text.prefill.engram_out.L{layer}")),
        );
        eprintln!("engram_out.L{layer}: relRMS {err:.2e}");
        // The gate's sums in the reference's order and its vectorised `exp`: bit-exact.
        assert_eq!(err, 0.0, "engram_out.L{layer}");
    }
    let final_err = rel_rms(&trace.final_hidden, &fx.f32("text.prefill.final_hidden"));
    let main_err = rel_rms(&trace.main_hidden, &fx.f32("text.prefill.main_hidden"));
    eprintln!("final_hidden relRMS {final_err:.2e}, main_hidden relRMS {main_err:.2e}");
    assert!(final_err <= STREAM_RMS && main_err <= STREAM_RMS);

    for &source in &cfg.kv_source_layers {
        let ours: Vec<f32> = seq
            .compressed_kv(source)
            .expect("kv source")
            .iter()
            .flatten()
            .copied()
            .collect();
        let keys: Vec<f32> = seq
            .index_keys(source)
            .expect("kv source")
            .iter()
            .flatten()
            .copied()
            .collect();
        let kv_err = rel_rms(
            &ours,
            &fx.f32(&format!("text.prefill.compress_kv.L{source}")),
        );
        let key_err = rel_rms(&keys, &fx.f32(&format!("text.prefill.index_k.L{source}")));
        eprintln!(
            "compress_kv.L{source} relRMS {kv_err:.2e}, index_k.L{source} relRMS {key_err:.2e}"
        );
        assert!(kv_err <= STREAM_RMS && key_err <= STREAM_RMS);
    }

    for &source in &cfg.index_source_layers {
        let expect = expected_rows(
            &fx.i32(&format!("text.prefill.topk.L{source}")),
            cfg.index_topk,
        );
        let ties = fx.i32(&format!("text.prefill.topk_tie.L{source}"));
        let mismatched: Vec<usize> = (0..n)
            .filter(|&t| trace.topk[source][t] != expect[t])
            .collect();
        let untied: Vec<usize> = mismatched
            .iter()
            .copied()
            .filter(|&t| ties[t] == 0)
            .collect();
        eprintln!(
            "topk.L{source}: {} of {n} rows differ ({} without a recorded tie: {untied:?})",
            mismatched.len(),
            untied.len()
        );
        assert!(
            mismatched.len() <= 1,
            "topk.L{source} differs on rows {mismatched:?}"
        );
    }
    assert!(
        logits_err <= LOGITS && LOGITS <= fx.tolerance(),
        "logits_full max|Δ|/range {logits_err}"
    );
    assert_eq!(
        argmax(&logits[(n - 1) * cfg.vocab_size..]),
        fx.case()["cases"]["text"]["runs"]["prefill"]["greedy_next"]
            .as_u64()
            .expect("greedy_next") as u32
    );
}

/// DSpark on the reference's taps: the context rings are fed the reference prefill's
/// `main_hidden`, the anchor is the reference's, and the proposals after decode steps at positions
/// 75..99 are compared with `text.decode.dspark_*`.
#[test]
fn dspark_matches_reference_given_reference_taps() {
    let fx = Fixture::load();
    let cfg = fx.model.config().clone();
    let vocab = cfg.vocab_size;
    let tokens = fx.tokens();
    let n = tokens.len();
    let prefill_len = fx.decode_run()["prefill_len"]
        .as_u64()
        .expect("prefill_len") as usize;
    let taps = fx.f32("text.prefill.main_hidden");
    let tap_width = taps.len() / n;
    let block = cfg.dspark.as_ref().expect("dspark").block_size;
    let dspark_ids = fx.i32("text.decode.dspark_ids");
    let dspark_logits = fx.f32("text.decode.dspark_logits");
    let dspark_confidence = fx.f32("text.decode.dspark_confidence");
    let reliable: Vec<usize> = fx.decode_run()["dspark_reliable_len"]
        .as_array()
        .expect("reliable")
        .iter()
        .map(|v| v.as_u64().expect("len") as usize)
        .collect();
    let range = fx.logit_range();
    let tolerance = fx.tolerance();

    let mut seq = fx.model.new_sequence();
    let mut trace = ForwardTrace::default();
    let (mut logits_err, mut conf_err, mut conf_max) = (0.0f32, 0.0f32, 0.0f32);
    let mut id_mismatches = Vec::new();
    let mut step_errors = Vec::new();
    let mut at = 0;
    for (s, end) in (prefill_len + 1..=n).enumerate() {
        trace.inject.main_hidden = Some(taps[at * tap_width..end * tap_width].to_vec());
        fx.model
            .forward_traced(
                &mut seq,
                &tokens[at..end],
                LogitsWanted::Last,
                Some(&mut trace),
            )
            .expect("forward");
        at = end;
        let ids = &dspark_ids[s * (block + 1)..(s + 1) * (block + 1)];
        let proposal = fx.model.draft(&seq, ids[0] as u32).expect("draft");
        let ours: Vec<i32> = proposal.tokens.iter().map(|&t| t as i32).collect();
        if ours[..reliable[s]] != ids[..reliable[s]] {
            id_mismatches.push(s);
        }
        // Slot i's logits depend on the token drafted at slot i − 1: compare where inputs agree.
        let agreeing = (0..block).take_while(|&i| ours[i] == ids[i]).count();
        let expect = &dspark_logits[s * block * vocab..(s + 1) * block * vocab];
        let step_err = max_abs_diff(
            &proposal.logits[..agreeing * vocab],
            &expect[..agreeing * vocab],
        ) / range;
        step_errors.push(step_err);
        logits_err = logits_err.max(step_err);
        let expect_conf = &dspark_confidence[s * block..s * block + agreeing];
        conf_err = conf_err.max(max_abs_diff(&proposal.confidence[..agreeing], expect_conf));
        conf_max = expect_conf.iter().fold(conf_max, |m, v| m.max(v.abs()));
    }
    eprintln!(
        "dspark over {} steps: logits max|Δ|/range = {logits_err:.3e}, confidence max|Δ| = {conf_err:.3e} (max|ref| {conf_max}), \
         id mismatches within the reliable length at steps {id_mismatches:?}",
        n - prefill_len
    );
    let exact_steps = step_errors.iter().filter(|&&e| e <= 1e-3).count();
    eprintln!(
        "dspark steps within 1e-3 of the range: {exact_steps} of {}; per step: {}",
        step_errors.len(),
        step_errors
            .iter()
            .map(|e| format!("{e:.1e}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    // The rings hold the prefill's taps; the reference drafted from its decode run's taps, which
    // differ by its own schedule noise, so an isolated step may flip one rounding.
    assert!(
        exact_steps * 5 >= step_errors.len() * 4,
        "only {exact_steps} steps match"
    );
    assert!(logits_err <= 2.0 * tolerance, "dspark_logits {logits_err}");
    assert!(
        conf_err <= 10.0 * tolerance * conf_max.max(1.0),
        "dspark_confidence {conf_err}"
    );
    assert!(
        id_mismatches.is_empty(),
        "dspark_ids differ at steps {id_mismatches:?}"
    );
}

/// Runs `tokens` in the given chunk sizes and returns every logits row.
fn run_chunked(model: &Model, tokens: &[u32], chunks: &[usize]) -> (Vec<f32>, SequenceState) {
    let mut seq = model.new_sequence();
    let mut logits = Vec::new();
    let mut at = 0;
    for &size in chunks {
        logits.extend(
            model
                .forward(&mut seq, &tokens[at..at + size], LogitsWanted::All)
                .expect("chunk"),
        );
        at += size;
    }
    assert_eq!(at, tokens.len());
    (logits, seq)
}

#[test]
fn chunked_prefill_decode_and_verify_are_bitwise_equal_to_one_shot() {
    let fx = Fixture::load();
    let model = &fx.model;
    let tokens = fx.tokens();
    let n = tokens.len();
    let vocab = model.config().vocab_size;
    let (one_shot, _) = run_chunked(model, &tokens, &[n]);
    let sixteens: Vec<usize> = (0..n).step_by(16).map(|s| 16.min(n - s)).collect();
    let mut verify_like = vec![75];
    verify_like.extend([2, 3, 4, 5, 6, 5]);
    for chunks in [
        vec![37, 63],
        vec![1, 99],
        sixteens,
        verify_like,
        [vec![70], vec![1; 30]].concat(),
    ] {
        let (logits, _) = run_chunked(model, &tokens, &chunks);
        let differing = logits
            .iter()
            .zip(&one_shot)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing, 0,
            "chunking {chunks:?}: {differing} logits differ from the one-shot prefill"
        );
    }
    // `Last` returns exactly the last row of `All`.
    let mut seq = model.new_sequence();
    let last = model
        .forward(&mut seq, &tokens[..50], LogitsWanted::Last)
        .expect("prefill");
    assert_eq!(last, one_shot[49 * vocab..50 * vocab]);
}

#[test]
fn rollback_after_partial_verify_equals_never_drafted() {
    let fx = Fixture::load();
    let model = &fx.model;
    let tokens = fx.tokens();
    let n = tokens.len();
    let vocab = model.config().vocab_size;
    let (one_shot, reference_seq) = run_chunked(model, &tokens, &[n]);
    let reference_draft = model.draft(&reference_seq, 7).expect("draft");
    // Accept 0..=5 of 5 wrong drafts after the true token, at odd and even boundaries.
    for (prefill, accepted) in [(75, 2), (75, 1), (76, 0), (80, 5), (81, 3)] {
        let mut seq = model.new_sequence();
        model
            .forward(&mut seq, &tokens[..prefill], LogitsWanted::Last)
            .expect("prefill");
        let mut verify = tokens[prefill..prefill + 1 + accepted].to_vec();
        verify.extend(
            (0..5 - accepted)
                .map(|i| (tokens[prefill + 1 + accepted] + 1 + i as u32) % vocab as u32),
        );
        let verified = model
            .forward(&mut seq, &verify, LogitsWanted::All)
            .expect("verify");
        let keep = prefill + 1 + accepted;
        assert_eq!(
            verified[..(1 + accepted) * vocab],
            one_shot[prefill * vocab..keep * vocab]
        );
        model.rollback(&mut seq, keep).expect("rollback");
        assert_eq!(seq.len(), keep);
        let rest = model
            .forward(&mut seq, &tokens[keep..], LogitsWanted::All)
            .expect("continue");
        let differing = rest
            .iter()
            .zip(&one_shot[keep * vocab..])
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing, 0,
            "prefill {prefill}, accepted {accepted}: {differing} logits differ after rollback"
        );
        assert_eq!(model.draft(&seq, 7).expect("draft"), reference_draft);
    }
    // Rolling back further than the rings keep is refused, not silently wrong.
    let mut seq = model.new_sequence();
    model
        .forward(&mut seq, &tokens[..60], LogitsWanted::Last)
        .expect("prefill");
    assert!(model.rollback(&mut seq, 30).is_err());
    assert!(model.rollback(&mut seq, 61).is_err());
    assert!(model.forward(&mut seq, &[], LogitsWanted::All).is_err());
    assert!(
        model
            .forward(&mut seq, &[vocab as u32], LogitsWanted::All)
            .is_err()
    );
}

/// The same invariances on a random checkpoint of a differently shaped config (window 8, top-4
/// selections, candidate blocks of 2 so the two-level restriction binds), written by the loader's
/// `write_random_checkpoint` in the real format.
#[test]
fn random_checkpoint_is_chunking_and_rollback_invariant() {
    let mut cfg = deepinfer_model::config::ModelConfig::tiny_v41();
    cfg.window_size = 8;
    cfg.index_topk = 4;
    if let Some(candidate) = cfg.candidate.as_mut() {
        candidate.topk_blocks = 2;
        candidate.block_size = 2;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    deepinfer_model::checkpoint::synth::write_random_checkpoint(&cfg, 7, dir.path(), 2)
        .expect("random checkpoint");
    let pad = cfg.engram.as_ref().expect("engram").pad_token_id;
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, pad).expect("stub vocab");
    let model = Model::load_with_vocab(dir.path(), Some(vocab)).expect("random model loads");
    let tokens: Vec<u32> = (0..48u32)
        .map(|i| (i * 197 + 31) % cfg.vocab_size as u32)
        .collect();
    let (one_shot, reference_seq) = run_chunked(&model, &tokens, &[48]);
    assert!(one_shot.iter().all(|v| v.is_finite()));
    for chunks in [
        vec![13, 1, 1, 20, 13],
        vec![1; 48],
        vec![7, 6, 5, 4, 3, 2, 21],
    ] {
        let (logits, _) = run_chunked(&model, &tokens, &chunks);
        assert!(
            logits
                .iter()
                .zip(&one_shot)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "chunking {chunks:?}"
        );
    }
    let vocab_size = cfg.vocab_size;
    let mut seq = model.new_sequence();
    model
        .forward(&mut seq, &tokens[..31], LogitsWanted::Last)
        .expect("prefill");
    let mut verify = tokens[31..33].to_vec();
    verify.extend([5, 6, 7, 8]);
    model
        .forward(&mut seq, &verify, LogitsWanted::All)
        .expect("verify");
    model.rollback(&mut seq, 33).expect("rollback");
    let rest = model
        .forward(&mut seq, &tokens[33..], LogitsWanted::All)
        .expect("continue");
    assert!(
        rest.iter()
            .zip(&one_shot[33 * vocab_size..])
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    assert_eq!(
        model.draft(&seq, 3).expect("draft"),
        model.draft(&reference_seq, 3).expect("draft")
    );
}

/// Decoder bounded replay (spec §3.5): refused below `window + MAX_BACKTRACK`, exact when nothing is
/// dropped, and otherwise an approximation confined to the decoder: the encoder caches (compressed
/// KV and index keys of every source, the boundary layer's included) equal the full prefill's.
#[test]
fn bounded_replay_truncates_only_the_decoder() {
    let fx = Fixture::load();
    let model = &fx.model;
    let cfg = model.config().clone();
    let vocab = cfg.vocab_size;
    let tokens = fx.tokens();
    let n = tokens.len();
    let minimum = cfg.window_size + deepinfer_model::v41::MAX_BACKTRACK;
    let (full, full_seq) = run_chunked(model, &tokens, &[n]);

    assert!(
        model
            .prefill_bounded(
                &mut model.new_sequence(),
                &tokens,
                LogitsWanted::All,
                minimum - 1
            )
            .is_err()
    );
    let mut seq = model.new_sequence();
    let untouched = model
        .prefill_bounded(&mut seq, &tokens, LogitsWanted::All, n)
        .expect("keep everything");
    assert_eq!(untouched, full);
    assert!(
        model
            .prefill_bounded(&mut seq, &tokens[..1], LogitsWanted::All, n)
            .is_err(),
        "only a prefill"
    );

    let mut seq = model.new_sequence();
    let tail = model
        .prefill_bounded(&mut seq, &tokens, LogitsWanted::All, minimum)
        .expect("bounded prefill");
    assert_eq!(tail.len(), minimum * vocab);
    assert_eq!(seq.len(), n);
    for &source in &cfg.kv_source_layers {
        assert_eq!(
            seq.compressed_kv(source),
            full_seq.compressed_kv(source),
            "compressed KV of source {source}"
        );
        assert_eq!(
            seq.index_keys(source),
            full_seq.index_keys(source),
            "index keys of source {source}"
        );
    }
    let first_kept = n - minimum;
    assert_ne!(
        tail[..vocab],
        full[first_kept * vocab..(first_kept + 1) * vocab],
        "the first kept query lost its decoder window"
    );
    let last_err =
        max_abs_diff(&tail[(minimum - 1) * vocab..], &full[(n - 1) * vocab..]) / fx.logit_range();
    let same_top1 = argmax(&tail[(minimum - 1) * vocab..]) == argmax(&full[(n - 1) * vocab..]);
    eprintln!(
        "bounded replay keep {minimum}: last row max|Δ|/range {last_err:.3e}, same top-1: {same_top1}"
    );
    let next = model
        .forward(&mut seq, &[tokens[5]], LogitsWanted::Last)
        .expect("decode after bounded prefill");
    assert!(next.iter().all(|v| v.is_finite()));
    model
        .rollback(&mut seq, n)
        .expect("rollback after bounded prefill");
}
