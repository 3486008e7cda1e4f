//! Checkpoint loading in the real V4.1 format: the golden fixture's tensors against the inventory,
//! synthetic sharded checkpoints (every tensor read back through its typed call, statistics like the
//! fixture's), byte round trips per dtype, and every failure mode (missing tensor, wrong dtype or
//! shape, truncated file, malformed header, index pointing at a missing shard) as a named error.
//! V4: the v4-tiny fixture (transformers names, float32) against `v4_inventory`, the real V4-Flash /
//! 0731 inventories against the published tensor and dtype counts, and reduced random checkpoints
//! in the official format (FP8 128×128, FP4 experts, MTP / DSpark, sharded) read back.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use deepinfer_model::checkpoint::{
    Checkpoint, Dtype, INDEX_FILE, StoredLinear, TensorKind, TensorSpec, v4_inventory,
    v41_inventory, write_random_checkpoint,
};
use deepinfer_model::config::ModelConfig;
use deepinfer_model::error::ModelError;
use safetensors::tensor::TensorView;

fn v41_tiny() -> PathBuf {
    deepinfer_tests::fixture_dir("v41/v41-tiny")
}

fn real_config() -> ModelConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/deepseek-v4.1-flash.config.json");
    ModelConfig::from_file(&path).expect("real config parses")
}

/// A random tiny checkpoint written into a fresh temporary directory.
fn synth_checkpoint(seed: u64, shards: usize) -> (tempfile::TempDir, Vec<PathBuf>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let files = write_random_checkpoint(&ModelConfig::tiny_v41(), seed, dir.path(), shards)
        .expect("synthetic checkpoint is written");
    (dir, files)
}

fn mean_and_rms(values: &[f32]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let rms = (values
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        / n)
        .sqrt();
    (mean, rms)
}

/// Reads one inventory entry through the typed call that matches its kind and returns its values
/// dequantised to f32.
fn read_entry(ckpt: &Checkpoint, spec: &TensorSpec) -> Result<Vec<f32>, ModelError> {
    match &spec.kind {
        TensorKind::Fp8 { out, inp } => Ok(ckpt.fp8_weight(&spec.name, *out, *inp)?.to_f32()),
        TensorKind::Fp8Tiled { out, inp, block } => Ok(ckpt
            .fp8_weight_blocked(&spec.name, *out, *inp, *block)?
            .to_f32()),
        TensorKind::ExpertTable { rows, k, .. } => Ok(ckpt
            .i64(&spec.name, &[*rows, *k])?
            .into_iter()
            .map(|expert| expert as f32)
            .collect()),
        TensorKind::Fp4 { out, inp } => Ok(ckpt.fp4_weight(&spec.name, *out, *inp)?.to_f32()),
        TensorKind::Fp8Rows { rows, width } => {
            // An Engram table is a row-blocked FP8 weight: block 1 x 32 is not a square tile, so
            // read the raw bytes and dequantise with the per-row group scales.
            let codes = ckpt.bytes(
                &format!("{}.weight", spec.name),
                Dtype::F8_E4M3,
                &[*rows, *width],
            )?;
            let scales = ckpt.bytes(
                &format!("{}.scale", spec.name),
                Dtype::F8_E8M0,
                &[*rows, width / 32],
            )?;
            Ok(codes
                .iter()
                .enumerate()
                .map(|(i, &code)| {
                    let (row, col) = (i / width, i % width);
                    deepinfer_model::weights::e4m3_to_f32(code)
                        * deepinfer_model::weights::e8m0_to_f32(
                            scales[row * (width / 32) + col / 32],
                        )
                })
                .collect())
        }
        TensorKind::Bf16 { shape, .. } => ckpt.bf16(&spec.name, shape),
        TensorKind::F32 { shape, .. } => ckpt.f32(&spec.name, shape),
    }
}

fn is_vision(name: &str) -> bool {
    name.starts_with("vision.") || name.starts_with("aligner.")
}

#[test]
fn fixture_holds_exactly_the_inventory_of_its_config() {
    let cfg = ModelConfig::from_file(&v41_tiny().join("config.json")).expect("config");
    let ckpt = Checkpoint::open(&v41_tiny()).expect("fixture opens");
    let mut expected = BTreeMap::new();
    for spec in v41_inventory(&cfg) {
        for (name, dtype, shape) in spec.stored() {
            expected.insert(name, (dtype, shape));
        }
    }
    let found: BTreeMap<String, (Dtype, Vec<usize>)> = ckpt
        .names()
        .into_iter()
        .filter(|name| !is_vision(name))
        .map(|name| {
            let tensor = ckpt.tensor(name).expect("listed tensor");
            (name.to_string(), (tensor.dtype, tensor.shape.to_vec()))
        })
        .collect();
    let missing: Vec<_> = expected
        .keys()
        .filter(|k| !found.contains_key(*k))
        .collect();
    let extra: Vec<_> = found
        .keys()
        .filter(|k| !expected.contains_key(*k))
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:?}, extra {extra:?}"
    );
    assert_eq!(found, expected);
    // 1 175 tensors in the fixture, 23 of them in its 2-layer vision tower and aligner.
    assert_eq!(expected.len(), 1152);
    assert_eq!(ckpt.len(), 1175);
}

#[test]
fn fixture_reads_through_every_typed_call() {
    let cfg = ModelConfig::tiny_v41();
    let ckpt = Checkpoint::open(&v41_tiny()).expect("fixture opens");
    for spec in v41_inventory(&cfg) {
        let values = read_entry(&ckpt, &spec).unwrap_or_else(|err| panic!("{}: {err}", spec.name));
        assert!(
            values.iter().all(|v| v.is_finite()),
            "{} has non-finite values",
            spec.name
        );
    }
    // Spot values: the attention sink is F32, the first wq_a tile scale is 2^-10 (byte 117).
    let wq_a = ckpt
        .fp8_weight("layers.0.attn.wq_a", 64, 256)
        .expect("wq_a");
    assert_eq!(wq_a.scales.len(), 2 * 8);
    assert!(wq_a.scales.iter().all(|&s| s == 117), "{:?}", wq_a.scales);
    let sink = ckpt
        .bf16_or_f32("layers.0.attn.attn_sink", &[4])
        .expect("sink");
    assert_eq!(
        sink,
        ckpt.f32("layers.0.attn.attn_sink", &[4]).expect("f32 sink")
    );
}

#[test]
fn real_inventory_counts_every_text_tensor() {
    let cfg = real_config();
    let specs = v41_inventory(&cfg);
    let stored: usize = specs.iter().map(|spec| spec.stored().len()).sum();
    // 96 085 tensors in the published checkpoint, 263 of them in the vision tower and aligner.
    assert_eq!(stored, 96_085 - 263);
    let routed_bytes: usize = specs
        .iter()
        .filter(|spec| {
            matches!(spec.kind, TensorKind::Fp4 { .. }) && spec.name.starts_with("layers.")
        })
        .map(TensorSpec::stored_bytes)
        .sum();
    // Spec §7.1: one routed expert is 18.80 MB (FP4 + scales), 40 x 384 of them 288.78 GB.
    assert_eq!(routed_bytes, 40 * 384 * 18_800_640);
    let engram_bytes: usize = specs
        .iter()
        .filter(|spec| matches!(spec.kind, TensorKind::Fp8Rows { .. }))
        .map(TensorSpec::stored_bytes)
        .sum();
    // rows x 264 B (256 FP8 + 8 scales) over both tables.
    assert_eq!(engram_bytes, (384_006_168 + 384_016_682) * 264);
}

#[test]
fn narrow_inventory_has_the_tier_b_geometry() {
    let specs = v41_inventory(&ModelConfig::narrow_v41());
    let kind = |name: &str| {
        specs
            .iter()
            .find(|spec| spec.name == name)
            .map(|spec| spec.kind.clone())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    assert_eq!(
        kind("layers.0.attn.wq_b"),
        TensorKind::Fp8 {
            out: 8 * 512,
            inp: 256
        }
    );
    assert_eq!(
        kind("layers.0.attn.wo_a"),
        TensorKind::Fp8 {
            out: 8 * 128,
            inp: 512
        }
    );
    assert_eq!(
        kind("layers.4.attn.indexer.wq_b"),
        TensorKind::Fp8 {
            out: 8 * 128,
            inp: 256
        }
    );
    assert_eq!(
        kind("layers.1.engram.wkv"),
        TensorKind::Fp8 {
            out: 5 * 1024,
            inp: 24 * 256
        }
    );
    assert_eq!(
        kind("layers.11.ffn.experts.15.w2"),
        TensorKind::Fp4 {
            out: 1024,
            inp: 256
        }
    );
    assert_eq!(
        kind("mtp.0.main_proj"),
        TensorKind::Fp8 {
            out: 1024,
            inp: 3 * 1024
        }
    );
    let total: usize = specs.iter().map(TensorSpec::stored_bytes).sum();
    assert!(total < 256 << 20, "Tier B stays small: {total} bytes");
}

#[test]
fn synthetic_checkpoint_reopens_with_every_tensor() {
    let cfg = ModelConfig::tiny_v41();
    let (dir, files) = synth_checkpoint(7, 3);
    assert_eq!(files.len(), 3);
    for (k, file) in files.iter().enumerate() {
        assert_eq!(
            file.file_name().and_then(|n| n.to_str()),
            Some(format!("model-{:05}-of-00003.safetensors", k + 1).as_str())
        );
    }
    let reparsed = ModelConfig::from_file(&dir.path().join("config.json")).expect("config.json");
    assert_eq!(reparsed, cfg);
    let ckpt = Checkpoint::open(dir.path()).expect("reopens");
    assert_eq!(ckpt.files().len(), 3);
    let specs = v41_inventory(&cfg);
    let stored: usize = specs.iter().map(|spec| spec.stored().len()).sum();
    assert_eq!(ckpt.len(), stored);
    for spec in &specs {
        let values = read_entry(&ckpt, spec).unwrap_or_else(|err| panic!("{}: {err}", spec.name));
        assert!(values.iter().all(|v| v.is_finite()), "{}", spec.name);
    }
    // The index's total_size is the sum of the tensor bytes.
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(INDEX_FILE)).expect("index"))
            .expect("index JSON");
    let total: usize = specs.iter().map(TensorSpec::stored_bytes).sum();
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total as u64));
}

#[test]
fn synthetic_statistics_match_the_fixture() {
    let cfg = ModelConfig::tiny_v41();
    let (dir, _) = synth_checkpoint(11, 2);
    let synth = Checkpoint::open(dir.path()).expect("synthetic opens");
    let fixture = Checkpoint::open(&v41_tiny()).expect("fixture opens");
    let mut compared = 0;
    for spec in v41_inventory(&cfg) {
        let ours = read_entry(&synth, &spec).expect("synthetic entry");
        let theirs = read_entry(&fixture, &spec).expect("fixture entry");
        if ours.len() < 16 {
            continue; // too few samples for a meaningful comparison
        }
        // Sampling noise of an n-element statistic is ~1/sqrt(n); allow 4 of those, at least 20%.
        let noise = 4.0 / (ours.len() as f64).sqrt();
        let (our_mean, our_rms) = mean_and_rms(&ours);
        let (their_mean, their_rms) = mean_and_rms(&theirs);
        let ratio = our_rms / their_rms;
        let tolerance = 1.0 + noise.max(0.2);
        assert!(
            ratio < tolerance && ratio > 1.0 / tolerance,
            "{}: rms {our_rms:.4} vs fixture {their_rms:.4}",
            spec.name
        );
        assert!(
            (our_mean - their_mean).abs() < 1.25 * noise * their_rms,
            "{}: mean {our_mean:.4} vs fixture {their_mean:.4}",
            spec.name
        );
        compared += 1;
    }
    assert!(compared > 600, "compared {compared} inventory entries");
    // Scale bytes sit in the fixture's ranges: FP8 tiles 117/118 for wq_a, FP4 groups 121..=123.
    let wq_a = synth
        .fp8_weight("layers.3.attn.wq_a", 64, 256)
        .expect("wq_a");
    assert!(
        wq_a.scales.iter().all(|s| (116..=118).contains(s)),
        "{:?}",
        wq_a.scales
    );
    let w1 = synth
        .fp4_weight("layers.3.ffn.experts.5.w1", 64, 256)
        .expect("w1");
    let distinct: BTreeSet<u8> = w1.scales.iter().copied().collect();
    assert_eq!(distinct, BTreeSet::from([121, 122, 123]));
}

#[test]
fn tensor_values_do_not_depend_on_sharding_but_on_the_seed() {
    let (one, _) = synth_checkpoint(5, 1);
    let (four, _) = synth_checkpoint(5, 4);
    let (other, _) = synth_checkpoint(6, 1);
    let one = Checkpoint::open(one.path()).expect("1 shard");
    let four = Checkpoint::open(four.path()).expect("4 shards");
    let other = Checkpoint::open(other.path()).expect("other seed");
    assert_eq!(one.files().len(), 1);
    assert_eq!(four.files().len(), 4);
    assert_eq!(one.names(), four.names());
    for name in one.names() {
        assert_eq!(
            one.tensor(name).expect("present").bytes,
            four.tensor(name).expect("present").bytes,
            "{name}"
        );
    }
    let name = "layers.2.attn.compressor.wkv.weight";
    assert_ne!(
        one.tensor(name).expect("present").bytes,
        other.tensor(name).expect("present").bytes
    );
}

/// Writes a single safetensors file with one tensor of each dtype and known bytes.
fn write_known_file(dir: &Path) -> PathBuf {
    let f32_bytes: Vec<u8> = [1.5f32, -2.25, 3.0e-20, 65504.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    // bf16 bit patterns of 1.0, -0.5, 0.0078125, 3.0
    let bf16_bytes: Vec<u8> = [0x3f80u16, 0xbf00, 0x3c00, 0x4040]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let fp8_codes: Vec<u8> = (0..32 * 64).map(|i| (i % 126) as u8).collect();
    let fp8_scales = vec![120u8, 121];
    let fp4_packed: Vec<u8> = (0..2 * 32).map(|i| (i * 37 % 256) as u8).collect();
    let fp4_scales = vec![127u8, 128, 126, 125];
    let tensors: Vec<(&str, Dtype, Vec<usize>, &[u8])> = vec![
        ("a.f32", Dtype::F32, vec![2, 2], &f32_bytes),
        ("a.bf16", Dtype::BF16, vec![4], &bf16_bytes),
        ("q.weight", Dtype::F8_E4M3, vec![32, 64], &fp8_codes),
        ("q.scale", Dtype::F8_E8M0, vec![1, 2], &fp8_scales),
        ("e.weight", Dtype::I8, vec![2, 32], &fp4_packed),
        ("e.scale", Dtype::F8_E8M0, vec![2, 2], &fp4_scales),
    ];
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), bytes).expect("valid view"),
            )
        })
        .collect();
    let path = dir.join("known.safetensors");
    safetensors::serialize_to_file(views, None, &path).expect("written");
    path
}

#[test]
fn bytes_round_trip_for_every_dtype() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_known_file(dir.path());
    let ckpt = Checkpoint::open(dir.path()).expect("unindexed directory opens");
    assert_eq!(
        ckpt.f32("a.f32", &[2, 2]).expect("f32"),
        vec![1.5, -2.25, 3.0e-20, 65504.0]
    );
    assert_eq!(
        ckpt.bf16("a.bf16", &[4]).expect("bf16"),
        vec![1.0, -0.5, 0.0078125, 3.0]
    );
    assert_eq!(
        ckpt.bf16_or_f32("a.bf16", &[4]).expect("either"),
        vec![1.0, -0.5, 0.0078125, 3.0]
    );
    assert_eq!(
        ckpt.bf16_or_f32("a.f32", &[2, 2]).expect("either")[1],
        -2.25
    );

    let fp8 = ckpt.fp8_weight("q", 32, 64).expect("fp8");
    assert_eq!((fp8.out, fp8.inp, fp8.block), (32, 64, 32));
    assert_eq!(
        fp8.data,
        (0..32 * 64).map(|i| (i % 126) as u8).collect::<Vec<u8>>()
    );
    assert_eq!(fp8.scales, vec![120, 121]);
    // Element (0, 40) = code 40 = 0x28: exponent 5, mantissa 0 -> 2^-2, times tile scale 2^(121-127).
    assert_eq!(fp8.dequant_row(0)[40], 0.25 * 2f32.powi(-6));

    let fp4 = ckpt.fp4_weight("e", 2, 64).expect("fp4");
    assert_eq!(
        fp4.packed,
        (0..64).map(|i| (i * 37 % 256) as u8).collect::<Vec<u8>>()
    );
    assert_eq!(fp4.scales, vec![127, 128, 126, 125]);
    // Row 1, byte 0 = 32 * 37 % 256 = 160 = 0xa0: column 64 -> low nibble 0 (= 0), column 65 -> 0xa (= -1)
    // in group 0 with scale 2^(126-127).
    let row1 = fp4.dequant_row(1);
    assert_eq!((row1[0], row1[1]), (0.0, -0.5));
}

/// The name of the tensor whose data comes last in a safetensors file.
fn last_tensor_in(bytes: &[u8]) -> String {
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value =
        serde_json::from_slice(&bytes[8..8 + header_len]).expect("header");
    header
        .as_object()
        .expect("object")
        .iter()
        .filter_map(|(name, entry)| Some((entry.get("data_offsets")?[1].as_u64()?, name.clone())))
        .max()
        .expect("a tensor")
        .1
}

fn expect_checkpoint_error(err: ModelError, file: &Path, tensor: &str, needles: &[&str]) {
    match &err {
        ModelError::Checkpoint {
            file: found_file,
            tensor: found_tensor,
            message,
        } => {
            assert_eq!(found_file, file, "{err}");
            assert_eq!(found_tensor, tensor, "{err}");
            for needle in needles {
                assert!(
                    message.contains(needle),
                    "message {message:?} lacks {needle:?}"
                );
            }
        }
        other => panic!("expected a Checkpoint error, got {other:?}"),
    }
}

#[test]
fn missing_tensor_wrong_dtype_and_wrong_shape_are_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write_known_file(dir.path());
    let ckpt = Checkpoint::open(dir.path()).expect("opens");
    match ckpt.f32("layers.0.attn.attn_sink", &[4]) {
        Err(ModelError::MissingTensor { tensor, searched }) => {
            assert_eq!(tensor, "layers.0.attn.attn_sink");
            assert_eq!(searched, dir.path());
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    assert!(!ckpt.contains("layers.0.attn.attn_sink") && ckpt.contains("a.f32"));
    let err = ckpt.bf16("a.f32", &[2, 2]).expect_err("F32 is not BF16");
    expect_checkpoint_error(
        err,
        &file,
        "a.f32",
        &["expected BF16 [2, 2]", "found F32 [2, 2]"],
    );
    let err = ckpt.f32("a.f32", &[4]).expect_err("wrong shape");
    expect_checkpoint_error(
        err,
        &file,
        "a.f32",
        &["expected F32 [4]", "found F32 [2, 2]"],
    );
    let err = ckpt.fp8_weight("q", 64, 32).expect_err("transposed");
    expect_checkpoint_error(
        err,
        &file,
        "q.weight",
        &["expected F8_E4M3 [64, 32]", "found F8_E4M3 [32, 64]"],
    );
    let err = ckpt
        .fp8_weight_blocked("q", 32, 64, 16)
        .expect_err("wrong block");
    expect_checkpoint_error(
        err,
        &file,
        "q.scale",
        &["expected F8_E8M0 [2, 4]", "found F8_E8M0 [1, 2]"],
    );
    let err = ckpt
        .fp4_weight("q", 32, 128)
        .expect_err("an FP8 tensor is not packed FP4");
    expect_checkpoint_error(
        err,
        &file,
        "q.weight",
        &["expected I8 [32, 64]", "found F8_E4M3 [32, 64]"],
    );
    let err = ckpt
        .fp4_weight("e", 2, 48)
        .expect_err("not a multiple of 32");
    expect_checkpoint_error(err, dir.path(), "e.weight", &["multiple of 32", "48"]);
    let err = ckpt
        .bf16_or_f32("q.weight", &[32, 64])
        .expect_err("fp8 is neither");
    expect_checkpoint_error(
        err,
        &file,
        "q.weight",
        &["expected BF16 [32, 64] or F32 [32, 64]"],
    );
}

#[test]
fn truncated_and_malformed_files_are_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write_known_file(dir.path());
    let pristine = std::fs::read(&file).expect("read");

    // Cut the last 10 bytes: the last tensor's data ends past the end of the file.
    std::fs::write(&file, &pristine[..pristine.len() - 10]).expect("write");
    let err = Checkpoint::open(dir.path()).expect_err("truncated");
    let data_len = {
        let header_len = u64::from_le_bytes(pristine[..8].try_into().expect("8 bytes")) as usize;
        pristine.len() - 8 - header_len
    };
    let declared = data_len.to_string();
    let found = (data_len - 10).to_string();
    let last_tensor = last_tensor_in(&pristine);
    expect_checkpoint_error(err, &file, &last_tensor, &["truncated", &declared, &found]);

    // Smaller than the length prefix.
    std::fs::write(&file, &pristine[..5]).expect("write");
    let err = Checkpoint::open(dir.path()).expect_err("tiny file");
    expect_checkpoint_error(err, &file, "(header)", &["5 bytes"]);

    // A header length beyond the file.
    let mut huge = pristine.clone();
    huge[..8].copy_from_slice(&1_000_000u64.to_le_bytes());
    std::fs::write(&file, &huge).expect("write");
    let err = Checkpoint::open(dir.path()).expect_err("header length");
    expect_checkpoint_error(err, &file, "(header)", &["1000000"]);

    // Garbage in the header JSON.
    let mut garbled = pristine.clone();
    garbled[8] = b'[';
    garbled[9] = b'!';
    std::fs::write(&file, &garbled).expect("write");
    let err = Checkpoint::open(dir.path()).expect_err("bad JSON");
    expect_checkpoint_error(err, &file, "(header)", &["malformed safetensors header"]);

    // An empty directory holds no checkpoint.
    std::fs::remove_file(&file).expect("remove");
    let err = Checkpoint::open(dir.path()).expect_err("empty");
    expect_checkpoint_error(err, dir.path(), "(none)", &[INDEX_FILE]);
}

#[test]
fn index_errors_are_named() {
    let (dir, files) = synth_checkpoint(3, 3);
    let index_path = dir.path().join(INDEX_FILE);
    let pristine = std::fs::read_to_string(&index_path).expect("index");

    // A tensor the index assigns to a shard that does not hold it.
    let mut index: serde_json::Value = serde_json::from_str(&pristine).expect("json");
    index["weight_map"]["layers.0.attn.bogus"] =
        serde_json::json!("model-00002-of-00003.safetensors");
    std::fs::write(&index_path, index.to_string()).expect("write");
    let err = Checkpoint::open(dir.path()).expect_err("absent tensor");
    expect_checkpoint_error(err, &files[1], "layers.0.attn.bogus", &["absent"]);

    // A shard that does not exist: the error names the index, the shard and its first tensor.
    std::fs::write(&index_path, &pristine).expect("restore");
    std::fs::remove_file(&files[2]).expect("remove shard");
    let err = Checkpoint::open(dir.path()).expect_err("missing shard");
    let index: serde_json::Value = serde_json::from_str(&pristine).expect("json");
    let first_in_shard = index["weight_map"]
        .as_object()
        .expect("map")
        .iter()
        .filter(|(_, file)| file.as_str() == Some("model-00003-of-00003.safetensors"))
        .map(|(name, _)| name.clone())
        .min()
        .expect("the last shard holds tensors");
    expect_checkpoint_error(
        err,
        &index_path,
        &first_in_shard,
        &["model-00003-of-00003.safetensors", "does not exist"],
    );

    // An index that is not JSON, or lacks a weight map.
    std::fs::write(&index_path, "{ nope").expect("write");
    let err = Checkpoint::open(dir.path()).expect_err("bad index");
    expect_checkpoint_error(err, &index_path, "(index)", &["not valid JSON"]);
    std::fs::write(&index_path, "{}").expect("write");
    let err = Checkpoint::open(dir.path()).expect_err("no weight map");
    expect_checkpoint_error(err, &index_path, "(index)", &["weight_map"]);
}

#[test]
fn unindexed_directories_load_every_shard_and_reject_duplicates() {
    let (dir, files) = synth_checkpoint(4, 2);
    let indexed = Checkpoint::open(dir.path()).expect("indexed");
    std::fs::remove_file(dir.path().join(INDEX_FILE)).expect("remove index");
    let unindexed = Checkpoint::open(dir.path()).expect("unindexed");
    assert_eq!(indexed.names(), unindexed.names());
    std::fs::copy(
        &files[0],
        dir.path().join("model-00003-of-00003.safetensors"),
    )
    .expect("copy");
    let err = Checkpoint::open(dir.path()).expect_err("duplicates");
    assert!(
        matches!(&err, ModelError::Checkpoint { message, .. } if message.contains("also present")),
        "{err:?}"
    );
}

fn v4_tiny() -> PathBuf {
    deepinfer_tests::fixture_dir("v4/v4-tiny")
}

fn v4_data_config(name: &str) -> ModelConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name);
    ModelConfig::from_file(&path).expect("V4 config parses")
}

/// Inventory names/dtypes/shapes against the checkpoint's (official) names.
fn assert_holds_exactly(ckpt: &Checkpoint, specs: &[TensorSpec]) -> usize {
    let mut expected = BTreeMap::new();
    for spec in specs {
        for (name, dtype, shape) in spec.stored() {
            expected.insert(name, (dtype, shape));
        }
    }
    let found: BTreeMap<String, (Dtype, Vec<usize>)> = ckpt
        .names()
        .into_iter()
        .map(|name| {
            let tensor = ckpt.tensor(name).expect("listed tensor");
            (name.to_string(), (tensor.dtype, tensor.shape.to_vec()))
        })
        .collect();
    let missing: Vec<_> = expected
        .keys()
        .filter(|k| !found.contains_key(*k))
        .collect();
    let extra: Vec<_> = found
        .keys()
        .filter(|k| !expected.contains_key(*k))
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:?}, extra {extra:?}"
    );
    assert_eq!(found, expected);
    expected.len()
}

#[test]
fn v4_fixture_holds_exactly_the_inventory_of_its_config() {
    let cfg = ModelConfig::from_file(&v4_tiny().join("config.json")).expect("config");
    let ckpt = Checkpoint::open(&v4_tiny()).expect("fixture opens");
    let specs = v4_inventory(&cfg);
    // 304 tensors, all float32 except the three I64 tid2eid tables.
    assert_eq!(assert_holds_exactly(&ckpt, &specs), 304);
    assert_eq!(ckpt.len(), 304);
    let i64_tables = ckpt
        .names()
        .into_iter()
        .filter(|name| ckpt.tensor(name).expect("present").dtype == Dtype::I64)
        .count();
    assert_eq!(i64_tables, 3);
    // The transformers spellings are mapped onto the official names.
    assert_eq!(
        ckpt.stored_name("embed.weight"),
        "model.embed_tokens.weight"
    );
    assert_eq!(ckpt.stored_name("head.weight"), "head.weight");
    assert_eq!(ckpt.stored_name("hc_head_fn"), "model.hc_head.hc_fn");
    assert_eq!(
        ckpt.stored_name("layers.3.attn.kv_norm.weight"),
        "model.layers.3.attn.norm.weight"
    );
    assert_eq!(
        ckpt.stored_name("layers.3.attn.compressor.norm.weight"),
        "model.layers.3.attn.compressor.norm.weight"
    );
    assert!(!ckpt.contains("model.norm.weight") && ckpt.contains("norm.weight"));
}

#[test]
fn v4_fixture_reads_through_every_typed_call() {
    let cfg = ModelConfig::tiny_v4();
    let ckpt = Checkpoint::open(&v4_tiny()).expect("fixture opens");
    for spec in v4_inventory(&cfg) {
        let values = read_entry(&ckpt, &spec).unwrap_or_else(|err| panic!("{}: {err}", spec.name));
        assert!(values.iter().all(|v| v.is_finite()), "{}", spec.name);
    }
    // tid2eid rows hold 2 distinct experts below 8 (the fixture's seeded re-initialisation).
    let table = ckpt
        .i64("layers.1.ffn.gate.tid2eid", &[1024, 2])
        .expect("tid2eid");
    assert!(
        table
            .chunks(2)
            .all(|row| row[0] != row[1] && row.iter().all(|&e| (0..8).contains(&e)))
    );
    assert!(ckpt.i64("layers.3.ffn.gate.tid2eid", &[1024, 2]).is_err());
    // `linear` reads the float32 projections as dense weights, whatever their block argument.
    let wq_a = ckpt
        .linear("layers.2.attn.wq_a", 32, 64, 128)
        .expect("wq_a");
    assert!(matches!(
        wq_a,
        StoredLinear::Dense {
            out: 32,
            inp: 64,
            ..
        }
    ));
    assert_eq!(
        wq_a.to_f32(),
        ckpt.f32("layers.2.attn.wq_a.weight", &[32, 64])
            .expect("f32")
    );
    // The attention kv norm (stored as `attn.norm`) is the 64-wide one, the HCA compressor's too.
    assert_eq!(
        ckpt.f32("layers.3.attn.kv_norm.weight", &[64])
            .expect("kv norm")
            .len(),
        64
    );
}

#[test]
fn real_v4_inventories_match_the_published_checkpoints() {
    let count = |specs: &[TensorSpec], dtype: Dtype| {
        specs
            .iter()
            .flat_map(TensorSpec::stored)
            .filter(|(_, d, _)| *d == dtype)
            .count()
    };
    let flash = v4_inventory(&v4_data_config("deepseek-v4-flash.config.json"));
    let stored: usize = flash.iter().map(|spec| spec.stored().len()).sum();
    // Spec §5.1: 69 187 tensors; BF16 433, F32 417, F8_E4M3 375, F8_E8M0 34 167, I8 33 792, I64 3.
    assert_eq!(stored, 69_187);
    assert_eq!(
        [
            Dtype::BF16,
            Dtype::F32,
            Dtype::F8_E4M3,
            Dtype::F8_E8M0,
            Dtype::I8,
            Dtype::I64
        ]
        .map(|dtype| count(&flash, dtype)),
        [433, 417, 375, 34_167, 33_792, 3]
    );
    let bytes: usize = flash.iter().map(TensorSpec::stored_bytes).sum();
    assert_eq!(bytes, 159_609_485_896, "published total_size");
    let mtp: usize = flash
        .iter()
        .filter(|spec| spec.name.starts_with("mtp."))
        .map(|spec| spec.stored().len())
        .sum();
    assert_eq!(mtp, 1_575);
    let kind = |specs: &[TensorSpec], name: &str| {
        specs
            .iter()
            .find(|spec| spec.name == name)
            .map(|spec| spec.kind.clone())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    assert_eq!(
        kind(&flash, "layers.5.attn.wo_a"),
        TensorKind::Fp8Tiled {
            out: 8192,
            inp: 4096,
            block: 128
        }
    );
    let wq_b = TensorSpec {
        name: "layers.0.attn.wq_b".into(),
        kind: kind(&flash, "layers.0.attn.wq_b"),
    };
    assert_eq!(wq_b.stored()[1].2, vec![256, 8]);
    assert_eq!(
        kind(&flash, "layers.42.ffn.experts.255.w2"),
        TensorKind::Fp4 {
            out: 4096,
            inp: 2048
        }
    );
    assert!(matches!(
        kind(&flash, "layers.2.ffn.gate.tid2eid"),
        TensorKind::ExpertTable {
            rows: 129_280,
            k: 6,
            n_experts: 256
        }
    ));
    assert!(
        matches!(kind(&flash, "layers.4.attn.compressor.ape"), TensorKind::F32 { ref shape, .. } if shape == &vec![4, 1024])
    );
    assert!(
        matches!(kind(&flash, "layers.3.attn.compressor.ape"), TensorKind::F32 { ref shape, .. } if shape == &vec![128, 512])
    );

    let dspark = v4_inventory(&v4_data_config("deepseek-v4-flash-0731.config.json"));
    let stored: usize = dspark.iter().map(|spec| spec.stored().len()).sum();
    // Spec §4.2 / §5.1: 72 317 tensors, 4 705 of them in the DSpark namespace
    // (BF16 20, F32 27, F8_E4M3 25, I8 2 304 there).
    assert_eq!(stored, 72_317);
    let bytes: usize = dspark.iter().map(TensorSpec::stored_bytes).sum();
    assert_eq!(bytes, 166_878_536_440, "published total_size");
    let drafter: Vec<TensorSpec> = dspark
        .iter()
        .filter(|spec| spec.name.starts_with("mtp."))
        .cloned()
        .collect();
    assert_eq!(
        drafter
            .iter()
            .map(|spec| spec.stored().len())
            .sum::<usize>(),
        4_705
    );
    assert_eq!(
        [Dtype::BF16, Dtype::F32, Dtype::F8_E4M3, Dtype::I8].map(|dtype| count(&drafter, dtype)),
        [20, 27, 25, 2_304]
    );
    assert_eq!(
        kind(&dspark, "mtp.0.main_proj"),
        TensorKind::Fp8Tiled {
            out: 4096,
            inp: 3 * 4096,
            block: 128
        }
    );
}

#[test]
fn v4_synthetic_checkpoint_in_the_official_format_loads_back() {
    let cfg = ModelConfig::reduced_v4();
    let dir = tempfile::tempdir().expect("tempdir");
    let files = write_random_checkpoint(&cfg, 21, dir.path(), 3).expect("written");
    assert_eq!(files.len(), 3);
    let reparsed = ModelConfig::from_file(&dir.path().join("config.json")).expect("config.json");
    assert_eq!(reparsed, cfg);
    let written: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("config.json")).expect("config"),
    )
    .expect("JSON");
    assert_eq!(
        written["quantization_config"]["weight_block_size"],
        serde_json::json!([128, 128])
    );
    assert_eq!(written["expert_dtype"], "fp4");
    let ckpt = Checkpoint::open(dir.path()).expect("reopens");
    assert_eq!(ckpt.files().len(), 3);
    let specs = v4_inventory(&cfg);
    assert_holds_exactly(&ckpt, &specs);
    for spec in &specs {
        let values = read_entry(&ckpt, spec).unwrap_or_else(|err| panic!("{}: {err}", spec.name));
        assert!(values.iter().all(|v| v.is_finite()), "{}", spec.name);
    }
    // FP8 with 128 x 128 tiles: wq_a [160, 256] has 2 x 2 scales (one partial tile row).
    let wq_a = match ckpt
        .linear("layers.0.attn.wq_a", 160, 256, 128)
        .expect("wq_a")
    {
        StoredLinear::Fp8(weight) => weight,
        other => panic!("expected FP8, got {other:?}"),
    };
    assert_eq!((wq_a.block, wq_a.scales.len()), (128, 4));
    let (_, rms) = mean_and_rms(&wq_a.to_f32());
    let std = 1.6 / 256f64.sqrt(); // gain of wq_a over sqrt(fan-in)
    assert!((rms / std - 1.0).abs() < 0.1, "wq_a rms {rms} vs {std}");
    // Every tile's largest magnitude lands in the top E4M3 binade (scale = p2(amax / 448)).
    let dequant = wq_a.to_f32();
    for tile_row in 0..2 {
        for tile_col in 0..2 {
            let scale = deepinfer_model::weights::e8m0_to_f32(wq_a.scales[tile_row * 2 + tile_col]);
            let amax = (tile_row * 128..((tile_row + 1) * 128).min(160))
                .flat_map(|r| (tile_col * 128..(tile_col + 1) * 128).map(move |c| (r, c)))
                .map(|(r, c)| dequant[r * 256 + c].abs())
                .fold(0f32, f32::max);
            assert!(
                amax / scale > 224.0 && amax / scale <= 448.0,
                "tile ({tile_row},{tile_col})"
            );
        }
    }
    assert!(matches!(
        ckpt.linear("layers.4.ffn.experts.7.w2", 256, 96, 128)
            .expect("expert"),
        StoredLinear::Fp4(_)
    ));
    assert!(matches!(
        ckpt.linear("mtp.0.e_proj", 256, 256, 128).expect("e_proj"),
        StoredLinear::Fp8(_)
    ));
    let table = ckpt
        .i64("layers.2.ffn.gate.tid2eid", &[512, 2])
        .expect("tid2eid");
    assert!(
        table
            .chunks(2)
            .all(|row| row[0] != row[1] && row.iter().all(|&e| (0..8).contains(&e)))
    );
    let distinct: BTreeSet<i64> = table.iter().copied().collect();
    assert_eq!(distinct.len(), 8, "every expert is used somewhere");
    let bias = ckpt.f32("layers.3.ffn.gate.bias", &[8]).expect("bias");
    assert!(bias.iter().any(|&b| b != 0.0));
    assert!(
        !ckpt.contains("layers.3.ffn.gate.tid2eid") && !ckpt.contains("layers.2.ffn.gate.bias")
    );
}

#[test]
fn v4_synthetic_dspark_checkpoint_loads_back() {
    let cfg = ModelConfig::reduced_v4_dspark();
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, 5, dir.path(), 2).expect("written");
    assert_eq!(
        ModelConfig::from_file(&dir.path().join("config.json")).expect("parses"),
        cfg
    );
    let ckpt = Checkpoint::open(dir.path()).expect("reopens");
    let n = assert_holds_exactly(&ckpt, &v4_inventory(&cfg));
    assert_eq!(n, ckpt.len());
    assert!(
        ckpt.contains("mtp.2.markov_head.markov_w1.weight")
            && !ckpt.contains("mtp.0.e_proj.weight")
    );
    let main_proj = ckpt
        .linear("mtp.0.main_proj", 256, 3 * 256, 128)
        .expect("main_proj");
    assert_eq!(main_proj.shape(), [256, 768]);
}

#[test]
fn a_tensor_stored_under_both_spellings_is_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bytes: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let views: Vec<(String, TensorView<'_>)> = ["norm.weight", "model.norm.weight"]
        .iter()
        .map(|name| {
            (
                name.to_string(),
                TensorView::new(Dtype::F32, vec![2], &bytes).expect("view"),
            )
        })
        .collect();
    let path = dir.path().join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path).expect("written");
    let err = Checkpoint::open(dir.path()).expect_err("ambiguous");
    expect_checkpoint_error(err, &path, "model.norm.weight", &["`norm.weight`"]);
}

#[test]
fn v4_synthetic_float32_checkpoint_has_the_fixture_layout() {
    // A random checkpoint of the fixture's config (float32 storage) holds exactly the fixture's
    // tensors under the official names, in one shard without an index as well as sharded.
    let cfg = ModelConfig::tiny_v4();
    let fixture = Checkpoint::open(&v4_tiny()).expect("fixture opens");
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, 9, dir.path(), 2).expect("written");
    let synth = Checkpoint::open(dir.path()).expect("reopens");
    assert_eq!(synth.names(), fixture.names());
    for name in fixture.names() {
        let (ours, theirs) = (
            synth.tensor(name).expect("synthetic"),
            fixture.tensor(name).expect("fixture"),
        );
        assert_eq!(
            (ours.dtype, ours.shape),
            (theirs.dtype, theirs.shape),
            "{name}"
        );
    }
    let reparsed = ModelConfig::from_file(&dir.path().join("config.json")).expect("config.json");
    assert_eq!(reparsed, cfg);
}
