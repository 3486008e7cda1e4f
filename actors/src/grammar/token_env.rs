//! The token environment llguidance needs, built once per tokenizer from DeepSeek's
//! `tokenizer.json` on the project's tokenizers 0.23 (not `toktrie_hf_tokenizers`, which pins
//! another tokenizers and leaves `｜DSML｜` without bytes): the bytes of every token with every
//! added token marked special, the token trie, and a canonical tokenizer for plain text.

use std::path::Path;

use serde::Deserialize;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::GrammarError;

const EOS_TEXT: &str = "<｜end▁of▁sentence｜>";
const THINK_START_TEXT: &str = "<think>";
const THINK_END_TEXT: &str = "</think>";
const DSML_TEXT: &str = "｜DSML｜";

/// The token ids the grammar layer treats specially.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialTokens {
    /// End of sequence; allowed by a mask exactly when the constraint is complete.
    pub eos: TokenId,
    /// `<think>`: a prompt ending in it starts the unconstrained reasoning section.
    pub think_start: TokenId,
    /// `</think>`: ends the reasoning section; the constraint applies after it.
    pub think_end: TokenId,
    /// `｜DSML｜`, the tag token of tool calls (`None`: this tokenizer cannot call tools).
    pub dsml: Option<TokenId>,
}

#[derive(Deserialize)]
struct AddedToken {
    id: usize,
    content: String,
}

/// `toktrie::TokenizerEnv` for a DeepSeek tokenizer. Wrap it in an `Arc` to get a `TokEnv`.
pub struct DeepSeekTokEnv {
    trie: TokTrie,
    plain_text: tokenizers::Tokenizer,
    special: SpecialTokens,
}

impl std::fmt::Debug for DeepSeekTokEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeepSeekTokEnv")
            .field("vocab_size", &self.trie.vocab_size())
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl DeepSeekTokEnv {
    /// Read and build from a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Self, GrammarError> {
        let text = std::fs::read_to_string(path).map_err(|source| GrammarError::TokenizerRead {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// Build from the text of a `tokenizer.json`.
    pub fn from_json_str(text: &str) -> Result<Self, GrammarError> {
        let json: serde_json::Value =
            serde_json::from_str(text).map_err(GrammarError::TokenizerJson)?;
        let added: Vec<AddedToken> = serde_json::from_value(json["added_tokens"].clone())
            .map_err(|e| GrammarError::TokenizerContent(format!("added_tokens: {e}")))?;

        let mut token_bytes = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| GrammarError::TokenizerContent(e.to_string()))?;
        // Every added token is special, `special: false` ones included (`<think>`, `｜DSML｜`,
        // `<｜User｜>` ...): text never produces them, and a grammar names them as `<[id]>`.
        for token in &added {
            let mut bytes = Vec::with_capacity(token.content.len() + 1);
            bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
            bytes.extend_from_slice(token.content.as_bytes());
            if token_bytes.len() <= token.id {
                token_bytes.resize(token.id + 1, Vec::new());
            }
            token_bytes[token.id] = bytes;
        }

        let find = |text: &'static str| {
            added
                .iter()
                .find(|t| t.content == text)
                .map(|t| t.id as TokenId)
                .ok_or(GrammarError::MissingSpecialToken(text))
        };
        let special = SpecialTokens {
            eos: find(EOS_TEXT)?,
            think_start: find(THINK_START_TEXT)?,
            think_end: find(THINK_END_TEXT)?,
            dsml: find(DSML_TEXT).ok(),
        };

        let vocab_size = u32::try_from(token_bytes.len()).map_err(|_| {
            GrammarError::TokenizerContent(format!("{} tokens is too many", token_bytes.len()))
        })?;
        let trie = TokTrie::from(&TokRxInfo::new(vocab_size, special.eos), &token_bytes);

        let plain_text = plain_text_tokenizer(json)?;
        Ok(Self {
            trie,
            plain_text,
            special,
        })
    }

    /// The special token ids.
    pub fn special_tokens(&self) -> SpecialTokens {
        self.special
    }

    /// Number of token ids (the width of a mask).
    pub fn vocab_size(&self) -> usize {
        self.trie.vocab_size()
    }

    /// The bytes the tokens stand for; special tokens as their text (`<think>`, `｜DSML｜`).
    pub fn decode(&self, tokens: &[TokenId]) -> Vec<u8> {
        self.trie.decode(tokens)
    }

    /// Canonical tokens of plain text (added tokens are not recognised in it).
    pub fn tokenize_text(&self, text: &str) -> Vec<TokenId> {
        self.tokenize_bytes(text.as_bytes())
    }

    fn encode_plain(&self, text: &str) -> Vec<TokenId> {
        match self.plain_text.encode_fast(text, false) {
            Ok(encoding) => encoding.get_ids().to_vec(),
            Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
        }
    }
}

impl TokenizerEnv for DeepSeekTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |text| self.encode_plain(text))
    }
}

/// The tokenizer without its added vocabulary, so that text such as `<think>` stays text.
fn plain_text_tokenizer(
    mut json: serde_json::Value,
) -> Result<tokenizers::Tokenizer, GrammarError> {
    json["added_tokens"] = serde_json::Value::Array(Vec::new());
    serde_json::from_value(json)
        .map_err(|e| GrammarError::TokenizerContent(format!("cannot build the tokenizer: {e}")))
}
