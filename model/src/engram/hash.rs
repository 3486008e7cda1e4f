//! Engram n-gram hashing: the compressed vocabulary, the per-sequence history of compressed ids,
//! the NumPy-derived multipliers, and the table row ids of a chunk.

use std::collections::HashMap;

use super::numpy_rng::Pcg64;
use super::primes::EngramLayout;
use crate::backend::Allocation;
use crate::error::ModelError;

/// Token id → compressed id, plus the compressed id that fills n-gram slots with no history.
///
/// Contract for a real tokenizer (the derivation lives in the runtime crate): for every token id
/// `i < len(tokenizer)`, decode `[i]` with the raw tokenizer keeping special tokens; if the text
/// contains U+FFFD the key is the token's raw vocabulary string, otherwise it is the text after
/// NFKC → NFD → strip accents → lowercase → collapse `[ \t\r\n]+` to one space → (a lone space
/// survives) strip, falling back to the original text when that is empty. Pass those keys in
/// token-id order to [`CompressedVocab::from_keys`]; ids are assigned by first appearance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompressedVocab {
    /// Compressed id of every token id (dense: `0..distinct_count()`).
    pub ids: Vec<u32>,
    /// Compressed id of the engram pad token.
    pub pad: u32,
}

impl CompressedVocab {
    /// Assigns compressed ids in order of first appearance of each key over increasing token id;
    /// `pad` becomes the compressed id of `pad_token_id`.
    pub fn from_keys<K: AsRef<str>>(
        keys: impl IntoIterator<Item = K>,
        pad_token_id: u32,
    ) -> Result<CompressedVocab, ModelError> {
        let mut first_seen: HashMap<String, u32> = HashMap::new();
        let mut ids = Vec::new();
        for key in keys {
            let key = key.as_ref();
            let id = match first_seen.get(key) {
                Some(&id) => id,
                None => {
                    let id =
                        u32::try_from(first_seen.len()).map_err(|_| ModelError::Unsupported {
                            what: "more than 2^32 distinct engram keys".to_string(),
                        })?;
                    first_seen.insert(key.to_string(), id);
                    id
                }
            };
            ids.push(id);
        }
        Self::with_pad_token(ids, pad_token_id)
    }

    /// The fixtures' stub tokenizer: token `2k` decodes to `"w{k}"` and `2k+1` to `" W{k}"`,
    /// which both normalise to `w{k}`, so the compressed id is `token_id / 2`.
    pub fn halving_stub(
        vocab_size: usize,
        pad_token_id: u32,
    ) -> Result<CompressedVocab, ModelError> {
        let ids = (0..vocab_size)
            .map(|token| {
                u32::try_from(token / 2).map_err(|_| ModelError::Unsupported {
                    what: format!("stub vocabulary of {vocab_size} tokens"),
                })
            })
            .collect::<Result<Vec<u32>, ModelError>>()?;
        Self::with_pad_token(ids, pad_token_id)
    }

    fn with_pad_token(ids: Vec<u32>, pad_token_id: u32) -> Result<CompressedVocab, ModelError> {
        let pad = usize::try_from(pad_token_id)
            .ok()
            .and_then(|i| ids.get(i).copied())
            .ok_or_else(|| ModelError::Sequence {
                message: format!(
                    "engram pad token {pad_token_id} is outside the {}-token vocabulary",
                    ids.len()
                ),
            })?;
        Ok(CompressedVocab { ids, pad })
    }

    /// Number of compressed ids (`max id + 1`; equals the distinct key count for a dense map).
    pub fn distinct_count(&self) -> usize {
        self.ids.iter().max().map_or(0, |&m| m as usize + 1)
    }

    /// Compressed id of `token`; a token beyond the map hashes as pad.
    fn compress(&self, token: u32) -> u32 {
        self.ids.get(token as usize).copied().unwrap_or(self.pad)
    }
}

/// Per-sequence history of compressed ids by absolute position (`None` = dead, i.e. an image
/// span). Survives chunk and decode boundaries; `truncate` rolls it back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngramHistory {
    compressed: Vec<Option<u32>>,
}

impl EngramHistory {
    /// An empty history (position 0 is next).
    pub fn new() -> EngramHistory {
        EngramHistory::default()
    }

    /// Number of positions recorded.
    pub fn len(&self) -> usize {
        self.compressed.len()
    }

    /// Whether nothing is recorded yet.
    pub fn is_empty(&self) -> bool {
        self.compressed.is_empty()
    }

    /// Bytes of the entries recorded (one `Option<u32>` per position).
    pub fn held_bytes(&self) -> u64 {
        (self.compressed.len() * std::mem::size_of::<Option<u32>>()) as u64
    }

    /// The heap allocation of the entries (its capacity).
    pub fn allocation(&self) -> Allocation {
        Allocation::of_vec(&self.compressed)
    }

    /// Keeps the first `len` positions (no-op when `len >= self.len()`).
    pub fn truncate(&mut self, len: usize) {
        self.compressed.truncate(len);
    }

    /// The entries of positions `range` (what a prefix-cache block keeps), if recorded.
    pub(crate) fn entries(&self, range: std::ops::Range<usize>) -> Option<&[Option<u32>]> {
        self.compressed.get(range)
    }

    /// Appends the entries of the positions after the last one recorded (a prefix-cache hit).
    pub(crate) fn extend(&mut self, entries: &[Option<u32>]) {
        self.compressed.extend_from_slice(entries);
    }
}

/// Table row ids of a chunk, `[n_tokens, n_layers, columns]` row-major (global rows, offsets
/// included; columns n-gram-major then head), the layout of the fixtures' `engram_hash`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngramRows {
    n_tokens: usize,
    n_layers: usize,
    columns: usize,
    rows: Vec<u32>,
}

impl EngramRows {
    /// Tokens in the chunk.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// Engram layers hashed.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Row ids per token and layer.
    pub fn columns(&self) -> usize {
        self.columns
    }

    /// All row ids, `[n_tokens, n_layers, columns]`.
    pub fn as_slice(&self) -> &[u32] {
        &self.rows
    }

    /// The `columns` row ids of `token` for engram layer `layer` (indices into this struct's
    /// ranges; out of range panics like slice indexing).
    pub fn of(&self, token: usize, layer: usize) -> &[u32] {
        let start = (token * self.n_layers + layer) * self.columns;
        &self.rows[start..start + self.columns]
    }

    /// The row ids of `tokens` (indices into this chunk, each below `n_tokens`), in that order:
    /// a context-parallel rank's own tokens of a chunk hashed whole.
    pub fn select(&self, tokens: &[usize]) -> EngramRows {
        let width = self.n_layers * self.columns;
        EngramRows {
            n_tokens: tokens.len(),
            n_layers: self.n_layers,
            columns: self.columns,
            rows: tokens
                .iter()
                .flat_map(|&t| &self.rows[t * width..(t + 1) * width])
                .copied()
                .collect(),
        }
    }
}

/// `max_ngram` multipliers of an engram layer: NumPy `default_rng(10007·layer_id)
/// .integers(0, bound, max_ngram, int64)` with `bound = max(1, (i64::MAX div vocab) div 2)`,
/// mapped `v ↦ 2v + 1`. Every product `compressed_id · multiplier` then fits in an int64.
pub fn hash_multipliers(
    layer_id: usize,
    max_ngram: usize,
    compressed_vocab_size: usize,
) -> Result<Vec<u64>, ModelError> {
    let unsupported = |what: String| ModelError::Unsupported { what };
    let vocab = i64::try_from(compressed_vocab_size)
        .ok()
        .filter(|&v| v > 0)
        .ok_or_else(|| {
            unsupported(format!(
                "engram compressed vocab size {compressed_vocab_size}"
            ))
        })?;
    let seed = layer_id as u128 * 10007;
    let bound = ((i64::MAX / vocab) / 2).max(1);
    let draws = Pcg64::from_seed(seed)
        .integers_i64(0, bound, max_ngram)
        .ok_or_else(|| unsupported(format!("engram multiplier bound {bound}")))?;
    Ok(draws.into_iter().map(|v| 2 * v as u64 + 1).collect())
}

/// The pure hashing half of an Engram: layout, multipliers and vocabulary.
#[derive(Debug, Clone)]
pub struct NgramHasher {
    layout: EngramLayout,
    multipliers: Vec<Vec<u64>>,
    max_ngram: usize,
    vocab: CompressedVocab,
}

impl NgramHasher {
    /// Builds the hasher for `layer_ids` (in order). The vocabulary's ids must lie below
    /// `compressed_vocab_size`, which keeps every product inside an int64.
    pub fn new(
        layer_ids: &[usize],
        max_ngram: usize,
        n_heads: usize,
        bucket_start: u64,
        compressed_vocab_size: usize,
        vocab: CompressedVocab,
    ) -> Result<NgramHasher, ModelError> {
        if max_ngram < 2 || n_heads == 0 {
            return Err(ModelError::Unsupported {
                what: format!("engram with max n-gram {max_ngram} and {n_heads} heads"),
            });
        }
        if vocab.distinct_count() > compressed_vocab_size
            || vocab.pad as usize >= compressed_vocab_size
        {
            return Err(ModelError::Unsupported {
                what: format!(
                    "compressed vocabulary with {} ids (pad {}) for engram_compressed_vocab_size {compressed_vocab_size}",
                    vocab.distinct_count(),
                    vocab.pad
                ),
            });
        }
        let layout = EngramLayout::compute(layer_ids.len(), max_ngram, n_heads, bucket_start);
        if layout
            .table_rows
            .iter()
            .any(|&rows| rows > u64::from(u32::MAX))
        {
            return Err(ModelError::Unsupported {
                what: format!(
                    "engram tables of {:?} rows (row ids are u32)",
                    layout.table_rows
                ),
            });
        }
        let multipliers = layer_ids
            .iter()
            .map(|&layer| hash_multipliers(layer, max_ngram, compressed_vocab_size))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(NgramHasher {
            layout,
            multipliers,
            max_ngram,
            vocab,
        })
    }

    /// The bucket layout.
    pub fn layout(&self) -> &EngramLayout {
        &self.layout
    }

    /// `[layer][lag]` multipliers.
    pub fn multipliers(&self) -> &[Vec<u64>] {
        &self.multipliers
    }

    /// Compressed ids per n-gram slot (`max_ngram`, lag 0 first).
    pub fn max_ngram(&self) -> usize {
        self.max_ngram
    }

    /// The n-gram contexts of `tokens` at the positions after `history`, which is extended by
    /// the chunk: `[tokens, max_ngram]` compressed ids, lag 0 first. `dead[i]` marks an
    /// image-span token (missing entries count as live); a dead token's slot and all larger lags
    /// hold pad.
    pub fn contexts_of_chunk(
        &self,
        history: &mut EngramHistory,
        tokens: &[u32],
        dead: &[bool],
    ) -> Vec<u64> {
        let start = history.len();
        history
            .compressed
            .extend(tokens.iter().enumerate().map(|(i, &token)| {
                if dead.get(i).copied().unwrap_or(false) {
                    None
                } else {
                    Some(self.vocab.compress(token))
                }
            }));
        let mut contexts = Vec::with_capacity(tokens.len() * self.max_ngram);
        for position in start..history.len() {
            let mut blocked = false;
            for lag in 0..self.max_ngram {
                let source = position
                    .checked_sub(lag)
                    .and_then(|p| history.compressed[p]);
                blocked |= source.is_none();
                contexts.push(u64::from(match source {
                    Some(id) if !blocked => id,
                    _ => self.vocab.pad,
                }));
            }
        }
        contexts
    }

    /// Table row ids of n-gram contexts (`[tokens, max_ngram]`, see
    /// [`NgramHasher::contexts_of_chunk`]): `[tokens, layers, columns]`, the hashing of
    /// [`NgramHasher::hash_chunk`]. Per layer the rolling hash of lags `0..=n−1` is
    /// `⊕ context[lag] · multiplier[lag]` (wrapping u64), and column `(n−2)·heads + h` is
    /// `rolling % prime + offset`. A trailing partial context is ignored.
    pub fn rows_of_contexts(&self, contexts: &[u64]) -> Vec<u32> {
        let columns = self.layout.columns();
        let heads = columns / (self.max_ngram - 1);
        let n_tokens = contexts.len() / self.max_ngram;
        let mut rows = Vec::with_capacity(n_tokens * self.multipliers.len() * columns);
        for context in contexts.chunks_exact(self.max_ngram) {
            for (layer, multipliers) in self.multipliers.iter().enumerate() {
                let mut rolling = context[0].wrapping_mul(multipliers[0]);
                let mut column = 0;
                for lag in 1..self.max_ngram {
                    rolling ^= context[lag].wrapping_mul(multipliers[lag]);
                    for _head in 0..heads {
                        let bucket = rolling % self.layout.primes[layer][column];
                        // Fits: the layout's table rows were checked against u32 at construction.
                        rows.push((bucket + self.layout.offsets[layer][column]) as u32);
                        column += 1;
                    }
                }
            }
        }
        rows
    }

    /// Row ids of every engram layer for `tokens` at the positions after `history`, which is
    /// extended by the chunk: the contexts gathered from the history, hashed by
    /// [`NgramHasher::rows_of_contexts`] (on the host: the hashing is integer work on ids the
    /// host holds). `dead` is empty (no image tokens) or one flag per token. Token ids must be
    /// below the model's vocabulary (the forward pass checks); an id beyond the compressed map
    /// hashes as pad.
    pub fn hash_chunk(
        &self,
        history: &mut EngramHistory,
        tokens: &[u32],
        dead: &[bool],
    ) -> EngramRows {
        let contexts = self.contexts_of_chunk(history, tokens, dead);
        EngramRows {
            n_tokens: tokens.len(),
            n_layers: self.multipliers.len(),
            columns: self.layout.columns(),
            rows: self.rows_of_contexts(&contexts),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The multipliers of (layer, compressed vocabulary) at `max_ngram` 4, as the reference
    /// derives them.
    #[test]
    fn multipliers_match_the_reference() {
        let cases: [(usize, usize, [u64; 4]); 4] = [
            // case.json → engram.multipliers (layers 1 and 4, compressed vocab 256).
            (
                1,
                256,
                [
                    29662608052400909,
                    1873410163432121,
                    13919202536988139,
                    28638879857136817,
                ],
            ),
            (
                4,
                256,
                [
                    31841131192811251,
                    1950019090429101,
                    28509641033320619,
                    7337012813361983,
                ],
            ),
            // The released model, spec §3.7: layers 1 and 14, compressed vocab 99 092.
            (
                1,
                99_092,
                [
                    76632096046245,
                    4839876093313,
                    35959672319349,
                    73987337458391,
                ],
            ),
            (
                14,
                99_092,
                [
                    67716810739261,
                    51510806800915,
                    30921347202721,
                    82619226485591,
                ],
            ),
        ];
        for (layer, vocab, expected) in cases {
            assert_eq!(
                hash_multipliers(layer, 4, vocab).ok(),
                Some(expected.to_vec()),
                "layer {layer}, compressed vocab {vocab}"
            );
        }
    }

    #[test]
    fn keys_are_numbered_by_first_appearance() -> Result<(), ModelError> {
        let vocab = CompressedVocab::from_keys(["a", "b", "a", "c", "b"], 3)?;
        assert_eq!(vocab.ids, [0, 1, 0, 2, 1]);
        assert_eq!(vocab.pad, 2);
        assert_eq!(vocab.distinct_count(), 3);
        assert!(CompressedVocab::from_keys(["a"], 1).is_err());
        let stub = CompressedVocab::halving_stub(8, 2)?;
        assert_eq!(stub.ids, [0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(stub.pad, 1);
        Ok(())
    }

    fn fixture_hasher() -> Result<NgramHasher, ModelError> {
        NgramHasher::new(
            &[1, 4],
            4,
            2,
            100,
            256,
            CompressedVocab::halving_stub(512, 2)?,
        )
    }

    #[test]
    fn hash_of_first_positions_follows_the_formula() -> Result<(), ModelError> {
        let hasher = fixture_hasher()?;
        let mut history = EngramHistory::new();
        let rows = hasher.hash_chunk(&mut history, &[10, 21], &[]);
        let m = &hasher.multipliers()[1];
        // Position 1: c = [10, 5, pad, pad] (compressed ids 21/2 = 10, 10/2 = 5; pad = 1).
        let r1 = (10 * m[0]) ^ (5 * m[1]);
        let r3 = r1 ^ m[2] ^ m[3];
        let expected_2gram_head1 = (r1 % 131) as u32;
        let expected_4gram_head1 = (r3 % 157 + 707) as u32;
        assert_eq!(rows.of(1, 1)[0], expected_2gram_head1);
        assert_eq!(rows.of(1, 1)[5], expected_4gram_head1);
        assert_eq!(history.len(), 2);
        Ok(())
    }

    #[test]
    fn chunked_hashing_and_rollback_match_one_shot() -> Result<(), ModelError> {
        let hasher = fixture_hasher()?;
        let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 512).collect();
        let dead: Vec<bool> = (0..40).map(|i| (12..17).contains(&i)).collect();
        let one_shot = hasher.hash_chunk(&mut EngramHistory::new(), &tokens, &dead);

        let mut history = EngramHistory::new();
        let mut chunked = Vec::new();
        for (range_start, range_end) in [(0, 13), (13, 14), (14, 30), (30, 40)] {
            let rows = hasher.hash_chunk(
                &mut history,
                &tokens[range_start..range_end],
                &dead[range_start..range_end],
            );
            chunked.extend_from_slice(rows.as_slice());
        }
        assert_eq!(chunked, one_shot.as_slice());

        // Roll back to 25, hash different tokens, roll back again, re-hash the originals.
        history.truncate(25);
        let other = hasher.hash_chunk(&mut history, &[1, 2, 3], &[]);
        assert_ne!(other.as_slice(), &one_shot.as_slice()[25 * 12..28 * 12]);
        history.truncate(25);
        let again = hasher.hash_chunk(&mut history, &tokens[25..], &dead[25..]);
        assert_eq!(again.as_slice(), &one_shot.as_slice()[25 * 12..]);

        // A dead token blocks look-back: position 17 sees pad for lags ≥ 1, like position 0
        // with the same token.
        let after_span = hasher.hash_chunk(&mut EngramHistory::new(), &tokens[17..18], &[]);
        assert_eq!(one_shot.of(17, 0), after_span.of(0, 0));
        Ok(())
    }
}
