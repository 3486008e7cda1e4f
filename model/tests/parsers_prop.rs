//! Property tests of the parsers of untrusted checkpoint input: `config.json`
//! (`ModelConfig::from_json_str`) and safetensors headers and data (`Checkpoint::open`, then
//! `Model::load`). A valid tiny V4.1 checkpoint is written once; random values put at random
//! places of its config, and random edits and cuts of its safetensors file, give a value or an
//! error, never a panic.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use deepinfer_model::Model;
use deepinfer_model::checkpoint::{Checkpoint, write_random_checkpoint};
use deepinfer_model::config::ModelConfig;
use proptest::prelude::*;
use serde_json::{Value, json};

/// The valid checkpoint: its directory (kept for the whole run), config text and shard bytes.
struct Valid {
    dir: tempfile::TempDir,
    config: String,
    shard: Vec<u8>,
    shard_name: String,
}

/// `n` cases from a fixed seed: CI runs the same inputs every time (a failure is reproducible,
/// and no run meets an input the previous ones did not).
fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: n,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x00de_e971_f3e5),
        ..ProptestConfig::default()
    }
}

fn valid() -> &'static Valid {
    static VALID: OnceLock<Valid> = OnceLock::new();
    VALID.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        write_random_checkpoint(&ModelConfig::tiny_v41(), 3, dir.path(), 1).expect("written");
        let config = std::fs::read_to_string(dir.path().join("config.json")).expect("config");
        let shard_path = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").path())
            .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .expect("a shard");
        Valid {
            config,
            shard: std::fs::read(&shard_path).expect("shard"),
            shard_name: shard_path.file_name().unwrap().to_string_lossy().into(),
            dir,
        }
    })
}

/// A copy of the valid checkpoint (its index too) with `config` and `shard` in place of its files.
fn checkpoint_with(config: &str, shard: &[u8]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(valid().dir.path()).expect("dir") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).expect("copy");
    }
    std::fs::write(dir.path().join("config.json"), config).expect("config");
    std::fs::write(dir.path().join(&valid().shard_name), shard).expect("shard");
    dir
}

/// Small values only: a config that asks for huge tables would make a load allocate them.
fn small_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-3i64..300).prop_map(Value::from),
        (-2.0f64..2.0).prop_map(|f| json!(f)),
        "[a-z_]{0,8}".prop_map(Value::from),
        prop::collection::vec(-2i64..20, 0..14).prop_map(|v| json!(v)),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-3i64..300).prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,8}".prop_map(Value::from),
        prop::collection::vec(-2i64..20, 0..14).prop_map(|v| json!(v)),
        Just(json!({})),
    ]
}

/// Replaces the `index`-th value of a depth-first walk of `value` by `by`.
fn replace_nth(value: &mut Value, index: &mut usize, by: &Value) -> bool {
    if *index == 0 {
        *value = by.clone();
        return true;
    }
    *index -= 1;
    let children: Vec<&mut Value> = match value {
        Value::Object(map) => map.values_mut().collect(),
        Value::Array(items) => items.iter_mut().collect(),
        _ => return false,
    };
    children
        .into_iter()
        .any(|child| replace_nth(child, index, by))
}

fn config_of(edits: &[(usize, Value)]) -> String {
    let mut value: Value = serde_json::from_str(&valid().config).expect("valid json");
    for (at, by) in edits {
        let mut index = *at % 400;
        replace_nth(&mut value, &mut index, by);
    }
    value.to_string()
}

/// The shard with the 8-byte length and the JSON header edited (`edits`: offset, byte) and cut
/// at `cut` (a fraction of the file, when given).
fn shard_of(edits: &[(usize, u8)], cut: Option<f64>, header_only: bool) -> Vec<u8> {
    let mut bytes = valid().shard.clone();
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let span = if header_only { header_end } else { bytes.len() };
    for &(at, byte) in edits {
        let at = at % span;
        bytes[at] = byte;
    }
    if let Some(fraction) = cut {
        bytes.truncate((bytes.len() as f64 * fraction) as usize);
    }
    bytes
}

fn load(dir: &Path) {
    if Checkpoint::open(dir).is_ok() {
        let _ = Model::load(dir);
    }
}

proptest! {
    #![proptest_config(cases(1000))]

    /// Random values at random places of a valid config.json, and arbitrary text.
    #[test]
    fn config_json_never_panics(
        edits in prop::collection::vec((any::<usize>(), leaf()), 1..4),
        text in ".{0,40}",
    ) {
        let origin = PathBuf::from("config.json");
        let _ = ModelConfig::from_json_str(&config_of(&edits), &origin);
        let _ = ModelConfig::from_json_str(&text, &origin);
    }

}

proptest! {
    #![proptest_config(cases(500))]

    /// Random byte edits of a safetensors header (its length and its JSON) and cuts of the
    /// file: `Checkpoint::open` gives an error or a checkpoint whose tensors can be read.
    #[test]
    fn safetensors_headers_never_panic(
        edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        cut in prop::option::of(0.0f64..1.0),
    ) {
        let dir = checkpoint_with(&valid().config, &shard_of(&edits, cut, true));
        if let Ok(checkpoint) = Checkpoint::open(dir.path()) {
            for name in checkpoint.names() {
                let _ = checkpoint.tensor(name);
            }
        }
    }
}

proptest! {
    #![proptest_config(cases(64))]

    /// The whole load (config, header, data) over edited configs and shards: `Model::load`
    /// gives a model or an error.
    #[test]
    fn checkpoint_loading_never_panics(
        config_edits in prop::collection::vec((any::<usize>(), small_leaf()), 0..2),
        shard_edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        header_only in any::<bool>(),
    ) {
        let dir = checkpoint_with(&config_of(&config_edits), &shard_of(&shard_edits, None, header_only));
        load(dir.path());
    }
}
