//! One memory-mapped safetensors file: opening, header parsing through `safetensors`, and precise
//! diagnostics (which byte count, which tensor) when the header or the file length is wrong.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;
use safetensors::tensor::{Metadata, SafeTensorError, TensorInfo};

use crate::error::ModelError;

/// Bytes of the little-endian header length that starts every safetensors file.
const HEADER_LEN_BYTES: usize = 8;

/// A mapped shard with its parsed header.
pub(crate) struct Shard {
    pub(crate) path: PathBuf,
    mmap: Mmap,
    /// Offset of the data section (8 + header length).
    data_start: usize,
    metadata: Metadata,
}

impl Shard {
    pub(crate) fn open(path: &Path) -> Result<Shard, ModelError> {
        let file = File::open(path).map_err(|source| ModelError::io(path, source))?;
        // SAFETY: the mapping is read-only and lives as long as `Shard`; checkpoint files are not
        // modified while an engine has them open (the same contract every safetensors loader uses).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::io(path, source))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|err| diagnose(path, &mmap, err))?;
        Ok(Shard {
            path: path.to_path_buf(),
            mmap,
            data_start: HEADER_LEN_BYTES + header_len,
            metadata,
        })
    }

    /// Names of every tensor in the shard, in file order.
    pub(crate) fn names(&self) -> Vec<String> {
        self.metadata.offset_keys()
    }

    pub(crate) fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.metadata.info(name)
    }

    /// The raw bytes of `info` (validated against the file length when the shard was opened).
    pub(crate) fn bytes(&self, info: &TensorInfo) -> &[u8] {
        let (start, end) = info.data_offsets;
        &self.mmap[self.data_start + start..self.data_start + end]
    }

    /// Where the bytes of `info` start in the file.
    pub(crate) fn offset(&self, info: &TensorInfo) -> usize {
        self.data_start + info.data_offsets.0
    }
}

fn header_error(path: &Path, tensor: &str, message: String) -> ModelError {
    ModelError::Checkpoint {
        file: path.to_path_buf(),
        tensor: tensor.to_string(),
        message,
    }
}

/// Turns a `safetensors` header error into a message with expected and found sizes.
fn diagnose(path: &Path, bytes: &[u8], err: SafeTensorError) -> ModelError {
    let file_len = bytes.len();
    const HEADER: &str = "(header)";
    if file_len < HEADER_LEN_BYTES {
        return header_error(
            path,
            HEADER,
            format!("file is {file_len} bytes, shorter than the 8-byte header length"),
        );
    }
    let mut len_bytes = [0u8; HEADER_LEN_BYTES];
    len_bytes.copy_from_slice(&bytes[..HEADER_LEN_BYTES]);
    let header_len = u64::from_le_bytes(len_bytes);
    let header_end = (header_len as u128) + HEADER_LEN_BYTES as u128;
    if header_end > file_len as u128 {
        return header_error(
            path,
            HEADER,
            format!(
                "header length field says {header_len} bytes, but the file has only {} bytes after it \
                 (truncated or not a safetensors file)",
                file_len - HEADER_LEN_BYTES
            ),
        );
    }
    match err {
        SafeTensorError::MetadataIncompleteBuffer => {
            let header = &bytes[HEADER_LEN_BYTES..header_end as usize];
            let data_len = file_len - header_end as usize;
            let (tensor, declared_end) = last_tensor_end(header).unwrap_or_default();
            let cut = if declared_end > data_len {
                "truncated"
            } else {
                "has trailing bytes"
            };
            header_error(
                path,
                if tensor.is_empty() { HEADER } else { &tensor },
                format!(
                    "file {cut}: header declares {declared_end} data bytes (last tensor `{tensor}`), \
                     found {data_len}"
                ),
            )
        }
        SafeTensorError::InvalidOffset(tensor) => header_error(
            path,
            &tensor,
            "data offsets are not contiguous with the previous tensor".to_string(),
        ),
        other => header_error(
            path,
            HEADER,
            format!("malformed safetensors header: {other}"),
        ),
    }
}

/// The tensor with the largest end offset in a header, and that offset.
fn last_tensor_end(header: &[u8]) -> Option<(String, usize)> {
    let value: serde_json::Value = serde_json::from_slice(header).ok()?;
    value
        .as_object()?
        .iter()
        .filter_map(|(name, entry)| {
            let end = entry.get("data_offsets")?.get(1)?.as_u64()?;
            Some((name.clone(), usize::try_from(end).ok()?))
        })
        .max_by_key(|(_, end)| *end)
}
