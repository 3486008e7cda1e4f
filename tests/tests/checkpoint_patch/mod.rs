//! Rewrites one tensor of a checkpoint the synth writer wrote (same shard, same dtype and shape),
//! for tests that need a value the generator does not produce.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// Applies `patch` to the raw bytes of tensor `name` (which must be stored as `dtype`) in its
/// shard of the checkpoint in `dir`, and writes the shard back.
pub fn patch_tensor(dir: &Path, name: &str, dtype: Dtype, patch: impl FnOnce(&mut [u8])) {
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("index parses");
    let file = index["weight_map"][name]
        .as_str()
        .expect("tensor in the index");
    let path = dir.join(file);
    let bytes = std::fs::read(&path).expect("shard");
    let shard = SafeTensors::deserialize(&bytes).expect("shard parses");
    let mut tensors: Vec<_> = shard
        .tensors()
        .into_iter()
        .map(|(n, view)| (n, view.dtype(), view.shape().to_vec(), view.data().to_vec()))
        .collect();
    let target = tensors
        .iter_mut()
        .find(|(n, ..)| n == name)
        .expect("tensor in its shard");
    assert_eq!(target.1, dtype, "{name}: stored dtype");
    patch(&mut target.3);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, dtype, shape, data)| {
            let view = TensorView::new(*dtype, shape.clone(), data).expect("view");
            (n.clone(), view)
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &path).expect("shard rewritten");
}
