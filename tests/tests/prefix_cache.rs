//! The prefix cache (`deepinfer_actors::prefix_cache`) end to end on the model: a request
//! served from a hit against the same request with the cache off.
//!
//! The rule: the parts the design calls exact are bitwise equal (the attached compressed-KV
//! entries and index keys; any request that was a miss, its writes to the cache included), and the
//! logits rows after a hit, whose replayed windows saw a truncated past, drift no more than
//! decoder bounded replay's rows drift at the same keep (`replay_logits.rs`'s bounds, shared in
//! `deepinfer_tests::drift`): the hit replays `keep` tokens (the ReplayActor's rule).
//!
//! V4 family (`deepinfer_model::v4::PrefixBlock`): a block keeps the rows of every ring the next
//! token reads too, so a hit resumes at its end and is bitwise the cold sequence, MTP logits and
//! DSpark drafts included (`v4_blocks_resume_bitwise_with_every_ring`).

use std::collections::HashMap;

use deepinfer_actors::prefix_cache::{
    CachedPrefill, PrefillRule, PrefixCache, exact_replay_tokens, feed, insert_blocks, prefill,
};
use deepinfer_model::any_model::AnyModel;
use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::state_bytes::StateBytes;
use deepinfer_model::{EntryOutput, StepEntry, StepOptions};
use deepinfer_model::{LogitsWanted, Model, PrefixBlock, SequenceState, v4};
use deepinfer_tests::drift::{
    Bounds, Drift, Rows, argmax, check_bounds, demo_model, drift, fixture_bounds, prompt, report,
};
use deepinfer_tests::forward_one;

const SALT: u64 = 0x5eed;
const CHUNK: usize = 64;

/// The ReplayActor's rule: a hit replays the decoder's kept tokens.
fn rule(keep: usize) -> PrefillRule {
    PrefillRule {
        replay_tokens: keep,
        decoder_keep: Some(keep),
    }
}

fn cache(model: &Model, budget: u64) -> PrefixCache<PrefixBlock> {
    PrefixCache::new(StateBytes::of(model.config()).block_tokens, budget)
}

/// `steps` decode rows after `seq`, teacher-forced with `tokens` (or greedy when `tokens` is
/// empty); returns the rows and the tokens fed.
fn decode(
    model: &Model,
    seq: &mut SequenceState,
    last_row: &[f32],
    tokens: &[u32],
    steps: usize,
) -> (Vec<f32>, Vec<u32>) {
    let (mut rows, mut fed) = (Vec::new(), Vec::new());
    let mut next = argmax(last_row) as u32;
    for step in 0..steps {
        let token = tokens.get(step).copied().unwrap_or(next);
        fed.push(token);
        let row = forward_one(model, seq, &[token], LogitsWanted::Last).expect("decode");
        next = argmax(&row) as u32;
        rows.extend(row);
    }
    (rows, fed)
}

/// The cache-off run: the prompt prefilled with decoder bounded replay (rows of the kept
/// suffix), then `steps` greedy decode rows.
fn cold(
    model: &Model,
    tokens: &[u32],
    keep: usize,
    steps: usize,
) -> (Rows, Vec<u32>, SequenceState) {
    let vocab = model.config().vocab_size;
    let mut seq = model.new_sequence();
    let prompt = feed(
        model,
        &mut seq,
        tokens,
        0,
        rule(keep),
        CHUNK,
        LogitsWanted::All,
    )
    .expect("cold prefill");
    let (decode, greedy) = decode(model, &mut seq, &prompt[prompt.len() - vocab..], &[], steps);
    (Rows { prompt, decode }, greedy, seq)
}

/// The prompt through the cache, then the cold run's decode tokens teacher-forced.
fn through(
    model: &Model,
    cache: &mut PrefixCache<PrefixBlock>,
    tokens: &[u32],
    rule: PrefillRule,
    forced: &[u32],
) -> (Rows, CachedPrefill) {
    let vocab = model.config().vocab_size;
    let mut run = prefill(model, cache, SALT, tokens, rule, CHUNK, LogitsWanted::All)
        .expect("prefill through the cache");
    let last = run.logits[run.logits.len() - vocab..].to_vec();
    let (decode, _) = decode(model, &mut run.seq, &last, forced, forced.len());
    let prompt = std::mem::take(&mut run.logits);
    (Rows { prompt, decode }, run)
}

/// Every KV source's compressed entries and index keys of the first `tokens` positions are
/// bitwise the same in both sequences.
fn assert_attached_entries_exact(
    model: &Model,
    hit: &SequenceState,
    off: &SequenceState,
    tokens: usize,
) {
    let ratios = &model.config().compress_ratios;
    let mut checked = 0;
    for (l, &ratio) in ratios.iter().enumerate() {
        let (Some(on), Some(cold)) = (hit.compressed_kv(l), off.compressed_kv(l)) else {
            continue;
        };
        let groups = tokens / ratio.max(1);
        assert!(
            on[..groups] == cold[..groups],
            "layer {l}: compressed KV of the hit"
        );
        let (on, cold) = (
            hit.index_keys(l).expect("keys"),
            off.index_keys(l).expect("keys"),
        );
        assert!(
            on[..groups] == cold[..groups],
            "layer {l}: index keys of the hit"
        );
        checked += 1;
    }
    assert!(checked > 0, "the model has KV sources");
}

/// The rule for the rows after a hit that replays `keep` tokens: each row, prompt or decode,
/// drifts no more than `replay_logits.rs` lets a kept prompt row drift under bounded replay at
/// the same keep (max and mean |Δ|/range, KL <= 0.4 nats), and the kept prompt rows agree on
/// top-1 as often. Decode rows get the prompt rows' bounds, not bounded replay's tighter decode
/// bounds: after a hit the compressed entries the request appends come from replayed encoder
/// states too, and decode reads them (a replay of [`exact_replay_tokens`] removes all drift).
fn hit_bounds(keep: usize) -> Bounds {
    let replay = fixture_bounds(keep as u32);
    Bounds {
        decode_max: replay.prompt_max,
        decode_mean: replay.prompt_mean,
        decode_kl: 0.4,
        min_decode_top1: 0,
        ..replay
    }
}

/// A writer (a miss, bitwise its cold run) fills the cache; readers share its first 200 tokens:
/// one diverging at 200 (a hit of 192 tokens, 3 blocks of 64), one diverging at 129 (inside a
/// ratio-2 group and a block: a hit of 2 blocks) and one whose prompt ends at 201 (inside a group;
/// the hit stops at the decoder start, 2 blocks). Returns each reader's hit and drift after
/// asserting the hit, its replay start and its exactly attached entries.
fn hits_on_the_fixture(keep: usize, replay: usize) -> Vec<(usize, Drift)> {
    let model = deepinfer_tests::v41_tiny_model();
    let vocab = model.config().vocab_size;
    let rule = PrefillRule {
        replay_tokens: replay,
        decoder_keep: Some(keep),
    };
    let mut cache = cache(&model, 1 << 30);
    assert_eq!(
        cache.block_tokens(),
        64,
        "V4.1 ratios 2 and 1: 64-token blocks"
    );
    let shared = prompt(200, 3, 497);
    let writer = [&shared[..], &prompt(30, 11, 400)].concat();
    let (writer_cold, greedy, _) = cold(&model, &writer, keep, 8);
    let (writer_on, run) = through(&model, &mut cache, &writer, rule, &greedy);
    assert_eq!(run.hit_tokens, 0, "an empty cache misses");
    assert!(writer_on.prompt == writer_cold.prompt && writer_on.decode == writer_cold.decode);
    assert_eq!(cache.stats().blocks, 3, "230 tokens: 3 complete blocks");

    // (prompt, tokens shared with the writer)
    let readers = [
        ([&shared[..], &prompt(30, 40, 300)].concat(), 200),
        ([&shared[..129], &prompt(60, 90, 300)].concat(), 129),
        (writer[..201].to_vec(), 201),
    ];
    let mut drifts = Vec::new();
    for (reader, shared) in readers {
        let (off, greedy, off_seq) = cold(&model, &reader, keep, 8);
        let (on, run) = through(&model, &mut cache, &reader, rule, &greedy);
        // Whole blocks, ending at or before the decoder start; adopted when the replay starts
        // after 0 (rounded down to the ratio 2).
        let found = shared.min(reader.len() - keep) / 64 * 64;
        let from = found.saturating_sub(replay) / 2 * 2;
        let (hit, from) = if from > 0 { (found, from) } else { (0, 0) };
        assert_eq!(
            (run.hit_tokens, run.replay_from),
            (hit, from),
            "prompt of {}",
            reader.len()
        );
        assert_attached_entries_exact(&model, &run.seq, &off_seq, hit);
        let d = drift(&off, &on, vocab);
        report("prefix hit, v41-tiny", replay as u32, reader.len(), &d);
        drifts.push((hit, d));
    }
    drifts
}

/// Hits replaying `keep` tokens (at least two adopted) each change the rows and stay within
/// [`hit_bounds`].
fn keep_hits_drift_within_the_rule(keep: usize) {
    let drifts = hits_on_the_fixture(keep, keep);
    assert!(drifts.iter().filter(|(hit, _)| *hit > 0).count() >= 2);
    for (hit, d) in drifts {
        assert!(
            hit == 0 || d.prompt_max > 0.0,
            "a hit replays a truncated past: {d:?}"
        );
        check_bounds(&d, &hit_bounds(keep));
    }
}

#[test]
fn hits_replaying_keep_22_drift_within_the_rule() {
    keep_hits_drift_within_the_rule(22);
}

#[test]
fn hits_replaying_keep_64_drift_within_the_rule() {
    keep_hits_drift_within_the_rule(64);
}

/// A replay of the exact halo (112 tokens on the fixture) makes every row after a hit bitwise
/// the cold run's, decode rows included.
#[test]
fn hits_replaying_the_exact_halo_are_bitwise_cold_prefills() {
    let model = deepinfer_tests::v41_tiny_model();
    let exact = exact_replay_tokens(model.config()).expect("a decoder boundary");
    let drifts = hits_on_the_fixture(22, exact);
    assert_eq!(
        drifts.iter().map(|(hit, _)| *hit).collect::<Vec<_>>(),
        [192, 128, 128]
    );
    for (_, d) in drifts {
        assert!(d.prompt_max == 0.0 && d.decode_max == 0.0, "{d:?}");
    }
}

/// A hit whose replay would start at 0 is not adopted: the request is a cold prefill, bitwise.
/// A replay shorter than the window plus the largest rollback is refused.
#[test]
fn a_hit_shorter_than_the_replay_is_a_bitwise_cold_prefill() {
    let model = deepinfer_tests::v41_tiny_model();
    let mut cache = cache(&model, 1 << 30);
    let shared = prompt(70, 3, 497);
    through(&model, &mut cache, &shared, rule(64), &[]);
    let reader = [&shared[..], &prompt(100, 7, 400)].concat();
    let (off, greedy, _) = cold(&model, &reader, 64, 3);
    let (on, run) = through(&model, &mut cache, &reader, rule(64), &greedy);
    assert_eq!((run.hit_tokens, run.replay_from), (0, 0));
    assert!(on.prompt == off.prompt && on.decode == off.decode);
    assert_eq!(
        cache.stats().hit_lookups,
        1,
        "the block was found, then not adopted"
    );
    let short = PrefillRule {
        replay_tokens: 21,
        decoder_keep: Some(64),
    };
    let error = prefill(
        &model,
        &mut cache,
        SALT,
        &reader,
        short,
        CHUNK,
        LogitsWanted::Last,
    )
    .expect_err("a replay shorter than window 16 + 6");
    assert!(error.to_string().contains("= 22 are needed"), "{error}");
}

/// A hit on a prefix another sequence is still extending: the writer's blocks enter the cache
/// chunk by chunk; a reader hits the three it has so far while the writer goes on. The writer's
/// rows are bitwise its cold run's, the reader's within the rule.
#[test]
fn a_hit_on_a_prefix_another_sequence_is_extending() {
    let model = deepinfer_tests::v41_tiny_model();
    let (vocab, ratios) = (model.config().vocab_size, &model.config().compress_ratios);
    let keep = 22;
    let mut cache = cache(&model, 1 << 30);
    let writer = prompt(230, 3, 497);
    let (writer_cold, writer_greedy, _) = cold(&model, &writer, keep, 8);

    let mut seq = model.new_sequence();
    let mut rows = Vec::new();
    for (i, piece) in writer.chunks(CHUNK).enumerate() {
        rows.extend(
            model
                .forward_step(
                    &mut [StepEntry {
                        decoder_from: Some(writer.len() - keep),
                        ..StepEntry::new(&mut seq, piece, LogitsWanted::All)
                    }],
                    StepOptions::default(),
                )
                .and_then(EntryOutput::one_entry_logits)
                .expect("writer chunk"),
        );
        insert_blocks(&mut cache, SALT, &writer, &seq, ratios).expect("insert");
        if i == 2 {
            assert_eq!(cache.stats().blocks, 3);
            let reader = [&writer[..200], &prompt(30, 40, 300)].concat();
            let (off, greedy, off_seq) = cold(&model, &reader, keep, 8);
            let (on, run) = through(&model, &mut cache, &reader, rule(keep), &greedy);
            assert_eq!(run.hit_tokens, 192);
            assert_attached_entries_exact(&model, &run.seq, &off_seq, 192);
            let d = drift(&off, &on, vocab);
            report(
                "prefix hit while extended, v41-tiny",
                keep as u32,
                reader.len(),
                &d,
            );
            check_bounds(&d, &hit_bounds(keep));
        }
    }
    let last = rows[rows.len() - vocab..].to_vec();
    let (decode_rows, _) = decode(&model, &mut seq, &last, &writer_greedy, 8);
    assert!(rows == writer_cold.prompt && decode_rows == writer_cold.decode);
}

/// Many distinct prefixes through a cache of 5 blocks: the cached bytes (measured from the
/// blocks held after every request) stay within the budget, blocks are evicted, and every
/// request's rows are its cold run's (a miss) or within the rule (a hit).
#[test]
fn eviction_under_a_small_budget_keeps_memory_and_outputs_right() {
    let model = deepinfer_tests::v41_tiny_model();
    let vocab = model.config().vocab_size;
    let keep = 22;
    let probe = {
        let mut seq = model.new_sequence();
        feed(
            &model,
            &mut seq,
            &prompt(64, 1, 400),
            0,
            rule(keep),
            CHUNK,
            LogitsWanted::Last,
        )
        .expect("probe");
        seq.prefix_block(0, 64, &model.config().compress_ratios)
            .expect("one block")
            .held_bytes()
            + 64 * 4
    };
    let budget = 5 * probe;
    let mut cache = cache(&model, budget);
    let prefixes: Vec<Vec<u32>> = (0..6u32).map(|p| prompt(140, p, 400)).collect();
    let mut colds: HashMap<Vec<u32>, Rows> = HashMap::new();
    let (mut hits, mut misses) = (0, 0);
    for round in 0..3u32 {
        for (p, prefix) in prefixes.iter().enumerate() {
            let order = if round == 1 {
                prefixes.len() - 1 - p
            } else {
                p
            };
            let _ = prefix;
            let tokens = [&prefixes[order][..], &prompt(20, 30 + round % 2, 200)].concat();
            let off = colds
                .entry(tokens.clone())
                .or_insert_with(|| cold(&model, &tokens, keep, 0).0);
            let (on, run) = through(&model, &mut cache, &tokens, rule(keep), &[]);
            let measured: u64 = cache
                .blocks()
                .map(|block| block.held_bytes() + 64 * 4)
                .sum();
            assert_eq!(
                measured,
                cache.stats().bytes,
                "the accounting is the blocks' bytes"
            );
            assert!(
                measured <= budget,
                "{measured} cached bytes over the {budget}-byte budget"
            );
            if run.hit_tokens == 0 {
                misses += 1;
                assert!(on.prompt == off.prompt, "a miss is a cold prefill");
            } else {
                hits += 1;
                let d = drift(off, &on, vocab);
                check_bounds(&d, &hit_bounds(keep));
            }
        }
    }
    let stats = cache.stats();
    eprintln!("eviction: {hits} hits, {misses} misses, {stats:?}");
    assert!(stats.evictions > 0 && hits > 0 && misses > 0, "{stats:?}");
}

/// The demo model (DeepSeek vocabulary, context 1024, the fixture's window and boundary): a
/// 600-token shared prefix; the reader hits 448 tokens (7 blocks, up to its decoder start) and
/// replays the default keep 140, which covers the demo's exact halo (112): every row is bitwise
/// the cache-off run's, decode rows included. At keep 64 (a replay shorter than the halo) the
/// rows drift within the rule.
#[test]
fn hits_on_the_demo_model_are_exact_at_the_default_keep_and_within_the_rule_at_64() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = demo_model(dir.path());
    let vocab = model.config().vocab_size;
    let keep = 140;
    assert!(exact_replay_tokens(model.config()).is_some_and(|exact| exact <= keep));
    let mut cache = cache(&model, 1 << 30);
    let shared = prompt(600, 1000, 60_000);
    let writer = [&shared[..], &prompt(20, 7, 50_000)].concat();
    through(&model, &mut cache, &writer, rule(keep), &[]);
    let reader = [&shared[..], &prompt(24, 300, 50_000)].concat();
    let (off, greedy, off_seq) = cold(&model, &reader, keep, 4);
    let (on, run) = through(&model, &mut cache, &reader, rule(keep), &greedy);
    assert_eq!((run.hit_tokens, run.replay_from), (448, 308));
    assert_attached_entries_exact(&model, &run.seq, &off_seq, 448);
    let d = drift(&off, &on, vocab);
    report("prefix hit, demo", keep as u32, reader.len(), &d);
    assert!(on.prompt == off.prompt && on.decode == off.decode, "{d:?}");

    let keep = 64;
    let reader = [&shared[..], &prompt(40, 900, 50_000)].concat();
    let (off, greedy, off_seq) = cold(&model, &reader, keep, 8);
    let (on, run) = through(&model, &mut cache, &reader, rule(keep), &greedy);
    assert_eq!((run.hit_tokens, run.replay_from), (576, 512));
    assert_attached_entries_exact(&model, &run.seq, &off_seq, 576);
    let d = drift(&off, &on, vocab);
    report("prefix hit, demo", keep as u32, reader.len(), &d);
    assert!(d.prompt_max > 0.0, "{d:?}");
    check_bounds(&d, &hit_bounds(keep));
}

/// A V4 writer fed `2 · block + 37` tokens in chunks that do not end at block ends, holding the
/// rows of the blocks each chunk completes and taking them after it; a fresh sequence attached to
/// the two blocks and the writer then get the same chunks: every logits row, the MTP block's
/// logits and the DSpark drafts after each chunk are bitwise equal. Block bytes are
/// `StateBytes::prefix_block_bytes` (the first block at most); a block whose rows the forward did
/// not hold, and an attach that would not resume at the blocks' end, are refused.
fn check_v4_resume(name: &str, model: &v4::Model) {
    let cfg = model.config();
    let bytes = StateBytes::of(cfg);
    let (n, window) = (bytes.block_tokens, cfg.window_size);
    let vocab = cfg.vocab_size as u32;
    let tokens: Vec<u32> = (0..(2 * n + 38) as u32)
        .map(|i| (i * 37 + 11) % vocab)
        .collect();
    let mut writer = model.new_sequence();
    let mut blocks = Vec::new();
    for chunk in [0..n - 3, n - 3..2 * n - 6, 2 * n - 6..2 * n] {
        let completed = chunk.start / n..chunk.end / n;
        for b in completed.clone() {
            writer.hold_block_rows(b * n);
        }
        model
            .forward_step(
                &mut [v4::StepEntry::new(
                    &mut writer,
                    &tokens[chunk],
                    LogitsWanted::Last,
                )],
                StepOptions::default(),
            )
            .and_then(EntryOutput::one_entry_logits)
            .expect("writer forward");
        for b in completed {
            blocks.push(writer.prefix_block(b * n, n, window).expect("held block"));
        }
    }
    assert_eq!(blocks.len(), 2, "{name}");
    assert_eq!(blocks[1].held_bytes(), bytes.prefix_block_bytes(), "{name}");
    assert!(
        blocks[0].held_bytes() <= bytes.prefix_block_bytes(),
        "{name}"
    );

    let refs: Vec<&v4::PrefixBlock> = blocks.iter().collect();
    let mut hit = model.new_sequence();
    let error = hit
        .attach_prefix(&refs, n, window)
        .expect_err("not the end");
    assert!(error.to_string().contains("resumes at the end"), "{error}");
    hit.attach_prefix(&refs, 2 * n, window).expect("attached");
    assert_eq!(hit.len(), 2 * n);
    let again = hit
        .attach_prefix(&refs, 2 * n, window)
        .expect_err("not empty");
    assert!(again.to_string().contains("empty sequence"), "{again}");

    let mut fed = 2 * n;
    for len in [5, 1, 31] {
        let chunk = &tokens[fed..fed + len];
        let want = LogitsWanted::All;
        let cold = model
            .forward_step(
                &mut [v4::StepEntry::new(&mut writer, chunk, want)],
                StepOptions::default(),
            )
            .and_then(EntryOutput::one_entry_logits)
            .expect("cold");
        let resumed = model
            .forward_step(
                &mut [v4::StepEntry::new(&mut hit, chunk, want)],
                StepOptions::default(),
            )
            .and_then(EntryOutput::one_entry_logits)
            .expect("resumed");
        assert!(cold == resumed, "{name}: rows of the chunk at {fed}");
        fed += len;
        let anchor = tokens[fed];
        if cfg.n_mtp_layers() > 0 {
            let mtp = |seq: &v4::SequenceState| model.mtp_logits(seq, anchor).expect("mtp");
            assert!(mtp(&writer) == mtp(&hit), "{name}: MTP logits at {fed}");
        }
        if model.has_dspark() {
            let draft = |seq: &v4::SequenceState| model.draft(seq, anchor).expect("draft");
            assert_eq!(draft(&writer), draft(&hit), "{name}: drafts at {fed}");
        }
    }

    let mut unheld = model.new_sequence();
    model
        .forward_step(
            &mut [v4::StepEntry::new(
                &mut unheld,
                &tokens[..2 * n],
                LogitsWanted::Last,
            )],
            StepOptions::default(),
        )
        .and_then(EntryOutput::one_entry_logits)
        .expect("forward");
    let error = unheld.prefix_block(0, n, window).expect_err("rows dropped");
    assert!(
        error.to_string().contains("no longer held"),
        "{name}: {error}"
    );
    println!(
        "{name}: blocks of {n} tokens, {} bytes each, resume bitwise",
        bytes.prefix_block_bytes()
    );
}

#[test]
fn v4_blocks_resume_bitwise_with_every_ring() {
    let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
    let AnyModel::V4(fixture) = AnyModel::load(&dir, None).expect("the v4-tiny fixture loads")
    else {
        panic!("v4-tiny is a V4 checkpoint");
    };
    check_v4_resume("v4-tiny", &fixture);
    for (name, cfg) in [
        ("reduced V4 (MTP block)", ModelConfig::reduced_v4()),
        ("reduced V4 (DSpark)", ModelConfig::reduced_v4_dspark()),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        write_random_checkpoint(&cfg, 11, dir.path(), 1).expect("checkpoint written");
        let AnyModel::V4(model) = AnyModel::load(dir.path(), None).expect("loads") else {
            panic!("{name} is a V4 checkpoint");
        };
        check_v4_resume(name, &model);
    }
}
