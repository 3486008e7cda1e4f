//! What a prefix cache keeps of one block of a sequence's positions, in both families: the
//! block's span with what the family keeps of it ([`PrefixBlock`]), and the checks both families'
//! `prefix_block` / `attach_prefix` start with ([`processed_block_end`], [`attached_end`]).

use crate::error::ModelError;

/// What a prefix cache keeps of one block of a sequence's positions `[start, start + len)`
/// (`start` and `len` multiples of every compression ratio): `K` is what the family keeps of
/// them (`v4::PrefixBlock`, `v41::PrefixBlock`).
#[derive(Debug, Clone)]
pub struct PrefixBlock<K> {
    start: usize,
    len: usize,
    pub(crate) kept: K,
}

impl<K> PrefixBlock<K> {
    /// The block of positions `[start, start + len)`, keeping `kept`.
    pub(crate) fn new(start: usize, len: usize, kept: K) -> PrefixBlock<K> {
        PrefixBlock { start, len, kept }
    }

    /// First position of the block.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Positions in the block.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block holds no position.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The end of the block `[start, start + len)`; an error when a sequence of `processed` tokens
/// has not processed it all.
pub(crate) fn processed_block_end(
    start: usize,
    len: usize,
    processed: usize,
) -> Result<usize, ModelError> {
    let end = start + len;
    if end > processed {
        return Err(ModelError::Sequence {
            message: format!(
                "prefix block [{start}, {end}) reaches past the {processed} tokens processed"
            ),
        });
    }
    Ok(end)
}

/// The end of the consecutive prefix `blocks` (from position 0) attached to a sequence of
/// `seq_len` tokens. An error unless the sequence is empty, and `discontinuity`'s error for the
/// first block that does not start where the previous ones end (`end`) or whose kept part `fits`
/// rejects (kept for another model).
pub(crate) fn attached_end<K>(
    seq_len: usize,
    blocks: &[&PrefixBlock<K>],
    fits: impl Fn(&K) -> bool,
    discontinuity: impl Fn(&PrefixBlock<K>, usize) -> ModelError,
) -> Result<usize, ModelError> {
    if seq_len != 0 {
        return Err(ModelError::Sequence {
            message: format!(
                "a prefix attaches to an empty sequence, this one holds {seq_len} tokens"
            ),
        });
    }
    let mut end = 0;
    for block in blocks {
        if block.start != end || !fits(&block.kept) {
            return Err(discontinuity(block, end));
        }
        end += block.len;
    }
    Ok(end)
}
