//! The Engram "compressed vocabulary": every token id mapped onto a smaller id space in which tokens
//! that normalise alike (" The", "the", "THE") share one id. Engram n-gram hashes run over these
//! ids, and every hash multiplier depends on the size of the map, so it must be reproduced exactly
//! (v41-architecture.md §3.7; DeepSeek-V4.1-Flash's tokenizer gives 99,092 ids).
//!
//! The map is derived from the tokenizer the way DeepSeek's reference does it: decode each token on
//! its own (special tokens kept), normalise the text with NFKC → NFD → strip accents → lowercase →
//! collapse `[ \t\r\n]+` to one space → protect a lone space → strip → restore; a partial UTF-8
//! token (its text contains U+FFFD) is keyed by its raw vocabulary string, and a text that
//! normalises to nothing keeps its original text. Ids are handed out in order of first appearance.

use std::collections::HashMap;

use deepinfer_model::config::EngramConfig;
use deepinfer_model::engram::CompressedVocab;
use tokenizers::normalizers::{
    Lowercase, NFD, NFKC, Replace, Sequence, Strip, StripAccents, replace::ReplacePattern,
};
use tokenizers::{NormalizedString, Normalizer, Tokenizer};

/// A private-use character that keeps a token made of exactly one space from being stripped away.
const LONE_SPACE_SENTINEL: &str = "\u{e000}";

/// The token → compressed-id map of one tokenizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompressedTokenMap {
    /// `ids[token]` is the compressed id of `token`.
    pub ids: Vec<u32>,
    /// Number of distinct compressed ids (the model's `engram_compressed_vocab_size`).
    pub size: usize,
}

/// Why a compressed map could not be built.
#[derive(Debug, thiserror::Error)]
pub enum CompressedVocabError {
    #[error("engram vocabulary: building the normaliser failed: {0}")]
    Normaliser(String),
    #[error("engram vocabulary: decoding token {token} failed: {message}")]
    Decode { token: u32, message: String },
    #[error("engram vocabulary: normalising token {token} failed: {message}")]
    Normalise { token: u32, message: String },
    #[error(
        "engram vocabulary: the tokenizer gives {found} compressed ids but the model's config says \
         engram_compressed_vocab_size = {expected}; this tokenizer does not belong to this checkpoint"
    )]
    SizeMismatch { expected: usize, found: usize },
    #[error("engram vocabulary: the pad token {pad} is outside the tokenizer ({size} tokens)")]
    PadOutOfRange { pad: u32, size: usize },
}

fn normaliser() -> Result<Sequence, CompressedVocabError> {
    let replace = |pattern: ReplacePattern, content: &str| {
        Replace::new(pattern, content).map_err(|e| CompressedVocabError::Normaliser(e.to_string()))
    };
    Ok(Sequence::new(vec![
        NFKC.into(),
        NFD.into(),
        StripAccents.into(),
        Lowercase.into(),
        replace(ReplacePattern::Regex("[ \t\r\n]+".into()), " ")?.into(),
        replace(ReplacePattern::Regex("^ $".into()), LONE_SPACE_SENTINEL)?.into(),
        Strip::new(true, true).into(),
        replace(ReplacePattern::String(LONE_SPACE_SENTINEL.into()), " ")?.into(),
    ]))
}

/// Builds the compressed map over every id of `tokenizer` (added tokens included).
pub fn compressed_token_map(
    tokenizer: &Tokenizer,
) -> Result<CompressedTokenMap, CompressedVocabError> {
    let normaliser = normaliser()?;
    let vocab_size = tokenizer.get_vocab_size(true);
    let mut key_to_id: HashMap<String, u32> = HashMap::with_capacity(vocab_size);
    let mut ids = Vec::with_capacity(vocab_size);
    for token in 0..vocab_size as u32 {
        let text = tokenizer
            .decode(&[token], false)
            .map_err(|e| CompressedVocabError::Decode {
                token,
                message: e.to_string(),
            })?;
        let key = if text.contains('\u{fffd}') {
            tokenizer.id_to_token(token).unwrap_or(text)
        } else {
            let mut normalized = NormalizedString::from(text.as_str());
            normaliser
                .normalize(&mut normalized)
                .map_err(|e| CompressedVocabError::Normalise {
                    token,
                    message: e.to_string(),
                })?;
            if normalized.get().is_empty() {
                text
            } else {
                normalized.get().to_owned()
            }
        };
        let next = key_to_id.len() as u32;
        ids.push(*key_to_id.entry(key).or_insert(next));
    }
    Ok(CompressedTokenMap {
        size: key_to_id.len(),
        ids,
    })
}

impl CompressedTokenMap {
    /// Checks the map against the checkpoint's `engram_compressed_vocab_size`.
    pub fn expect_size(self, expected: usize) -> Result<Self, CompressedVocabError> {
        if self.size == expected {
            Ok(self)
        } else {
            Err(CompressedVocabError::SizeMismatch {
                expected,
                found: self.size,
            })
        }
    }
}

impl CompressedTokenMap {
    /// The model's Engram vocabulary: the map checked against the checkpoint's
    /// `engram_compressed_vocab_size`, with the compressed id of its pad token.
    pub fn into_engram_vocab(
        self,
        engram: &EngramConfig,
    ) -> Result<CompressedVocab, CompressedVocabError> {
        let map = self.expect_size(engram.compressed_vocab_size)?;
        let pad = *map.ids.get(engram.pad_token_id as usize).ok_or(
            CompressedVocabError::PadOutOfRange {
                pad: engram.pad_token_id,
                size: map.ids.len(),
            },
        )?;
        Ok(CompressedVocab { ids: map.ids, pad })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped_tokenizer() -> Tokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../configs/tokenizer/tokenizer.json"
        );
        Tokenizer::from_file(path).expect("the shipped tokenizer loads")
    }

    #[test]
    fn deepseek_tokenizer_gives_the_published_compressed_vocab_size() {
        let tokenizer = shipped_tokenizer();
        let map = compressed_token_map(&tokenizer).expect("map builds");
        assert_eq!(map.ids.len(), 129_280);
        // DeepSeek-V4.1-Flash config: engram_compressed_vocab_size = 99092. V4.1 renames only one
        // added token (id 128799), which is a distinct key either way.
        assert_eq!(map.size, 99_092);
        let map = map.expect_size(99_092).expect("size matches");

        // Case and leading space fold together; distinct words do not.
        let id = |s: &str| {
            let enc = tokenizer.encode(s, false).expect("encodes");
            assert_eq!(enc.get_ids().len(), 1, "{s:?} is one token");
            map.ids[enc.get_ids()[0] as usize]
        };
        assert_eq!(id("The"), id(" the"));
        assert_eq!(id("the"), id(" THE"));
        assert_ne!(id("the"), id("cat"));
        // BOS, EOS and pad keep ids of their own.
        assert_ne!(map.ids[0], map.ids[1]);
        assert_ne!(map.ids[1], map.ids[2]);
    }

    #[test]
    fn engram_vocab_takes_the_pad_id_and_checks_it() {
        let mut engram = deepinfer_model::config::ModelConfig::tiny_v41()
            .engram
            .expect("tiny V4.1 has Engram");
        engram.compressed_vocab_size = 2;
        engram.pad_token_id = 2;
        let map = CompressedTokenMap {
            ids: vec![0, 1, 1],
            size: 2,
        };
        let vocab = map.clone().into_engram_vocab(&engram).expect("valid");
        assert_eq!((vocab.ids, vocab.pad), (vec![0, 1, 1], 1));
        engram.pad_token_id = 3;
        let err = map.into_engram_vocab(&engram).unwrap_err().to_string();
        assert!(
            err.contains("pad token 3 is outside the tokenizer (3 tokens)"),
            "{err}"
        );
    }

    #[test]
    fn wrong_size_is_a_clear_error() {
        let map = CompressedTokenMap {
            ids: vec![0, 1, 0],
            size: 2,
        };
        let err = map.expect_size(3).unwrap_err().to_string();
        assert!(err.contains("engram_compressed_vocab_size = 3"), "{err}");
        assert!(err.contains("2 compressed ids"), "{err}");
    }
}
