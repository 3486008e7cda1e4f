//! Checkpoint loading in the real V4.1 format (spec §6): sharded safetensors files, located through
//! `model.safetensors.index.json` when present, memory-mapped, and read through typed calls that
//! check each tensor's dtype and shape and name the file, the tensor, the expected and the found
//! layout on any mismatch. `synth` writes random checkpoints in the same format.
//!
//! One loader serves V4.1, official V4 and transformers-saved V4 files: tensors are addressed by
//! their official names, and names stored in the transformers spelling (`model.` prefix) are
//! mapped onto them when the checkpoint is opened (`names`). `linear` reads a projection in
//! whatever format it is stored (FP8 tiles, packed FP4, BF16/F32); `inventory_v4` lists the V4
//! tensors.

mod expert_filter;
pub mod inventory;
pub mod inventory_v4;
mod linear;
pub mod names;
mod shard;
pub mod synth;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub use expert_filter::ExpertFilter;
pub use inventory::{Init, TensorKind, TensorSpec, v41_inventory};
pub use inventory_v4::{inventory_for, v4_inventory};
pub use linear::StoredLinear;
pub use safetensors::Dtype;
pub use synth::write_random_checkpoint;

use crate::error::ModelError;
use crate::weights::{FP4_GROUP, Fp4Weight, Fp8Weight};
use shard::Shard;

/// File name of the shard index (`{"weight_map": {tensor: shard file}}`).
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// Tile edge of the dense FP8 weight scales in V4.1.
pub const FP8_BLOCK: usize = 32;

/// A borrowed view of one tensor inside a mapped shard.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub file: &'a Path,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    /// Where `bytes` start in `file`.
    pub offset: usize,
}

/// An opened checkpoint directory: mapped shards and a tensor -> shard map.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Official tensor name -> index of the shard holding it.
    location: HashMap<String, usize>,
    /// Official name -> name as stored, for tensors stored in the transformers spelling.
    stored_names: HashMap<String, String>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.location.len())
            .finish()
    }
}

fn layout(dtype: Dtype, shape: &[usize]) -> String {
    format!("{dtype:?} {shape:?}")
}

impl Checkpoint {
    /// Opens `dir`: reads `model.safetensors.index.json` if present (every shard it names must
    /// exist and hold the tensors it lists), else the single file `model.safetensors` if present
    /// (the transformers convention; other safetensors files next to it, such as a fixture's
    /// `expected.safetensors`, are not weights), else maps every `*.safetensors` file in it.
    pub fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        let index_path = dir.join(INDEX_FILE);
        if index_path.exists() {
            Checkpoint::open_indexed(dir, &index_path)
        } else {
            Checkpoint::open_unindexed(dir)
        }
    }

    fn open_indexed(dir: &Path, index_path: &Path) -> Result<Checkpoint, ModelError> {
        let text = std::fs::read_to_string(index_path)
            .map_err(|source| ModelError::io(index_path, source))?;
        let index_error = |tensor: &str, message: String| ModelError::Checkpoint {
            file: index_path.to_path_buf(),
            tensor: tensor.to_string(),
            message,
        };
        let root: serde_json::Value = serde_json::from_str(&text)
            .map_err(|err| index_error("(index)", format!("not valid JSON: {err}")))?;
        let weight_map = root
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .ok_or_else(|| {
                index_error(
                    "(index)",
                    "expected an object field `weight_map`".to_string(),
                )
            })?;
        // Group tensors by shard file, keeping a deterministic shard order.
        let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, file) in weight_map {
            let file = file.as_str().ok_or_else(|| {
                index_error(tensor, format!("expected a shard file name, found {file}"))
            })?;
            if file.contains('/') || file.contains('\\') || file.is_empty() {
                return Err(index_error(
                    tensor,
                    format!(
                        "shard name \"{file}\" must be a plain file name in {}",
                        dir.display()
                    ),
                ));
            }
            by_file.entry(file).or_default().push(tensor);
        }
        let mut shards = Vec::with_capacity(by_file.len());
        let mut location = HashMap::with_capacity(weight_map.len());
        for (file, tensors) in by_file {
            let path = dir.join(file);
            if !path.is_file() {
                let first = tensors.iter().min().copied().unwrap_or("(none)");
                return Err(index_error(
                    first,
                    format!(
                        "index maps {} tensor(s) to shard {file}, which does not exist",
                        tensors.len()
                    ),
                ));
            }
            let shard = Shard::open(&path)?;
            for tensor in tensors {
                if shard.info(tensor).is_none() {
                    return Err(ModelError::Checkpoint {
                        file: path.clone(),
                        tensor: tensor.to_string(),
                        message: format!(
                            "listed in {INDEX_FILE} for this shard but absent from it"
                        ),
                    });
                }
                location.insert(tensor.to_string(), shards.len());
            }
            shards.push(shard);
        }
        Checkpoint::from_shards(dir, shards, location)
    }

    fn open_unindexed(dir: &Path) -> Result<Checkpoint, ModelError> {
        let single = dir.join(SINGLE_FILE);
        let paths = if single.is_file() {
            vec![single]
        } else {
            let entries = std::fs::read_dir(dir).map_err(|source| ModelError::io(dir, source))?;
            let mut paths = Vec::new();
            for entry in entries {
                let path = entry.map_err(|source| ModelError::io(dir, source))?.path();
                if path.extension().is_some_and(|ext| ext == "safetensors") && path.is_file() {
                    paths.push(path);
                }
            }
            paths.sort();
            paths
        };
        if paths.is_empty() {
            return Err(ModelError::Checkpoint {
                file: dir.to_path_buf(),
                tensor: "(none)".to_string(),
                message: format!("expected {INDEX_FILE} or *.safetensors files, found neither"),
            });
        }
        let mut shards = Vec::with_capacity(paths.len());
        let mut location = HashMap::new();
        for path in paths {
            let shard = Shard::open(&path)?;
            for name in shard.names() {
                if let Some(&previous) = location.get(&name) {
                    let first: &Shard = &shards[previous];
                    return Err(ModelError::Checkpoint {
                        file: path.clone(),
                        tensor: name,
                        message: format!("also present in {}", first.path.display()),
                    });
                }
                location.insert(name, shards.len());
            }
            shards.push(shard);
        }
        Checkpoint::from_shards(dir, shards, location)
    }

    /// Finishes either way of opening: re-keys transformers-spelled tensors under their official
    /// names ([`adopt_official_names`]) and assembles the checkpoint.
    fn from_shards(
        dir: &Path,
        shards: Vec<Shard>,
        mut location: HashMap<String, usize>,
    ) -> Result<Checkpoint, ModelError> {
        let stored_names = adopt_official_names(&mut location, &shards)?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            location,
            stored_names,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The shard files, in load order.
    pub fn files(&self) -> Vec<&Path> {
        self.shards
            .iter()
            .map(|shard| shard.path.as_path())
            .collect()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.location.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.location.is_empty()
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.location.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Whether a tensor named `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// Looks a tensor up without checking its layout.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>, ModelError> {
        let missing = || ModelError::MissingTensor {
            tensor: name.to_string(),
            searched: self.dir.clone(),
        };
        let (key, &shard_index) = self.location.get_key_value(name).ok_or_else(missing)?;
        let shard = &self.shards[shard_index];
        let stored = self.stored_names.get(name).map_or(name, String::as_str);
        let info = shard.info(stored).ok_or_else(missing)?;
        Ok(TensorRef {
            name: key,
            file: &shard.path,
            dtype: info.dtype,
            shape: &info.shape,
            bytes: shard.bytes(info),
            offset: shard.offset(info),
        })
    }

    /// Looks a tensor up and checks that its dtype is one of `dtypes` and its shape is `shape`.
    pub fn expect(
        &self,
        name: &str,
        dtypes: &[Dtype],
        shape: &[usize],
    ) -> Result<TensorRef<'_>, ModelError> {
        let tensor = self.tensor(name)?;
        if !dtypes.contains(&tensor.dtype) || tensor.shape != shape {
            let expected = dtypes
                .iter()
                .map(|&dtype| layout(dtype, shape))
                .collect::<Vec<_>>()
                .join(" or ");
            return Err(ModelError::Checkpoint {
                file: tensor.file.to_path_buf(),
                tensor: name.to_string(),
                message: format!(
                    "expected {expected}, found {}",
                    layout(tensor.dtype, tensor.shape)
                ),
            });
        }
        Ok(tensor)
    }

    /// The raw bytes of a tensor of the given dtype and shape, borrowed from the mapping (for large
    /// tables such as the Engram embeddings).
    pub fn bytes(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<&[u8], ModelError> {
        Ok(self.expect(name, &[dtype], shape)?.bytes)
    }

    /// An F32 tensor.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(decode_f32(self.expect(name, &[Dtype::F32], shape)?.bytes))
    }

    /// A BF16 tensor widened to f32 (values stay bf16-exact).
    pub fn bf16(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(decode_bf16(self.expect(name, &[Dtype::BF16], shape)?.bytes))
    }

    /// An I64 tensor (e.g. the `tid2eid` hash-routing table).
    pub fn i64(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, ModelError> {
        let bytes = self.expect(name, &[Dtype::I64], shape)?.bytes;
        Ok(bytes
            .chunks_exact(8)
            .map(|chunk| {
                let mut word = [0u8; 8];
                word.copy_from_slice(chunk);
                i64::from_le_bytes(word)
            })
            .collect())
    }

    /// The name a tensor has in its shard file (differs from `name` for transformers-saved files).
    pub fn stored_name<'a>(&'a self, name: &'a str) -> &'a str {
        self.stored_names.get(name).map_or(name, String::as_str)
    }

    /// A BF16 or F32 tensor as f32.
    pub fn bf16_or_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let tensor = self.expect(name, &[Dtype::BF16, Dtype::F32], shape)?;
        Ok(match tensor.dtype {
            Dtype::BF16 => decode_bf16(tensor.bytes),
            _ => decode_f32(tensor.bytes),
        })
    }

    /// A dense FP8 weight with V4.1's 32×32 tiles: `<prefix>.weight` F8_E4M3 `[out, inp]` and
    /// `<prefix>.scale` F8_E8M0 `[ceil(out/32), ceil(inp/32)]`.
    pub fn fp8_weight(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<Fp8Weight, ModelError> {
        self.fp8_weight_blocked(prefix, out, inp, FP8_BLOCK)
    }

    /// A dense FP8 weight with `block × block` scale tiles.
    pub fn fp8_weight_blocked(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
        block: usize,
    ) -> Result<Fp8Weight, ModelError> {
        let data = self.bytes(&format!("{prefix}.weight"), Dtype::F8_E4M3, &[out, inp])?;
        let scale_shape = [out.div_ceil(block), inp.div_ceil(block)];
        let scales = self.bytes(&format!("{prefix}.scale"), Dtype::F8_E8M0, &scale_shape)?;
        Ok(Fp8Weight {
            out,
            inp,
            block,
            data: data.to_vec(),
            scales: scales.to_vec(),
        })
    }

    /// A packed FP4 expert weight: `<prefix>.weight` I8 `[out, inp/2]` (low nibble = even column)
    /// and `<prefix>.scale` F8_E8M0 `[out, inp/32]`.
    pub fn fp4_weight(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<Fp4Weight, ModelError> {
        let weight_name = format!("{prefix}.weight");
        if !inp.is_multiple_of(FP4_GROUP) {
            return Err(ModelError::Checkpoint {
                file: self.dir.clone(),
                tensor: weight_name,
                message: format!(
                    "an FP4 weight needs an input dimension that is a multiple of {FP4_GROUP}, \
                     asked for {inp}"
                ),
            });
        }
        let packed = self.bytes(&weight_name, Dtype::I8, &[out, inp / 2])?;
        let scales = self.bytes(
            &format!("{prefix}.scale"),
            Dtype::F8_E8M0,
            &[out, inp / FP4_GROUP],
        )?;
        Ok(Fp4Weight {
            out,
            inp,
            packed: packed.to_vec(),
            scales: scales.to_vec(),
        })
    }
}

/// Re-keys tensors stored in the transformers spelling under their official names
/// ([`names::official_name`]) and returns official -> stored for them. Two stored tensors with the
/// same official name are an error naming both.
fn adopt_official_names(
    location: &mut HashMap<String, usize>,
    shards: &[Shard],
) -> Result<HashMap<String, String>, ModelError> {
    let renamed: Vec<(String, String)> = location
        .keys()
        .filter_map(|stored| {
            names::official_name(stored).map(|official| (official, stored.clone()))
        })
        .collect();
    let mut stored_names = HashMap::with_capacity(renamed.len());
    for (official, stored) in &renamed {
        let shard = location
            .remove(stored)
            .expect("invariant: the name was just read from the map");
        let clash = location.contains_key(official) || stored_names.contains_key(official);
        if clash {
            let other = stored_names
                .get(official)
                .map_or(official.as_str(), String::as_str);
            return Err(ModelError::Checkpoint {
                file: shards[shard].path.clone(),
                tensor: stored.clone(),
                message: format!(
                    "its official name `{official}` is also the name of the stored tensor `{other}`"
                ),
            });
        }
        location.insert(official.clone(), shard);
        stored_names.insert(official.clone(), stored.clone());
    }
    Ok(stored_names)
}

/// Little-endian f32 bytes to values (the mapping need not be 4-byte aligned).
fn decode_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
        .collect()
}

/// Little-endian bf16 bytes widened to f32.
fn decode_bf16(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|chunk| f32::from_bits(u32::from(u16::from_le_bytes([chunk[0], chunk[1]])) << 16))
        .collect()
}
