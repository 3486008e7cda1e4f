//! `TextCodec`: the DeepSeek tokenizer and the chat encoding of the served family, loaded once
//! per engine.
//!
//! Owns the tokenizer (loaded from `tokenizer.json`; for V4.1, when the file is the V4 one
//! shipped in `configs/tokenizer/`, the added token 128799 `<｜place▁holder▁no▁799｜>` is
//! renamed to V4.1's `<｜System｜>`, see configs/tokenizer/README.md) and the prompt encoding
//! from `deepseek-recipe-encoding`: `DeepseekV41Encoding` for V4.1, `DeepseekV4Encoding` for
//! the V4 family (V4-Flash shares the V4 template). Chat bodies are converted with
//! `deepseek-recipe`.

use std::path::{Path, PathBuf};

use deepinfer_model::config::ModelFamily;
use deepseek_recipe::openai::ChatCompletionRequest;
use deepseek_recipe::request::{ConversionOptions, ModelVersion, ProtocolRequest};
use deepseek_recipe_encoding::dsv4::DeepseekV4Encoding;
use deepseek_recipe_encoding::dsv41::DeepseekV41Encoding;
use deepseek_recipe_encoding::{PromptEncoding, PromptTokenizer};
use tokenizers::Tokenizer;

use crate::error::{EngineError, ValidationError};
use crate::grammar::{Constraint, take_grammar_response_format};

/// The added-token id V4.1 uses for `<｜System｜>`.
pub const V41_SYSTEM_TOKEN_ID: u64 = 128_799;
/// Its spelling.
pub const V41_SYSTEM_TOKEN: &str = "<｜System｜>";
/// The V4 placeholder at that id.
pub const V4_PLACEHOLDER_799: &str = "<｜place▁holder▁no▁799｜>";
/// The model name `deepseek-recipe` knows for V4.1 chat requests.
pub const V41_MODEL_NAME: &str = "DeepSeek-V4.1-Flash";
/// The model name V4-family chat requests are converted under (an alias of `deepseek-recipe`'s
/// V4 version, whose template V4-Flash shares).
pub const V4_MODEL_NAME: &str = "DeepSeek-V4-Flash";

/// deepseek-recipe's conversion settings for chat bodies of `family`, and the model name bodies
/// are converted under. Thinking mode is off unless the body asks for it (the OpenAI surface
/// makes it explicit); `max_tokens` is bounded by the model's context (checked by the frontend),
/// not by the recipe's API limit.
pub fn conversion_options(family: ModelFamily) -> (&'static str, ConversionOptions) {
    let options = ConversionOptions::new()
        .with_default_thinking_mode(false)
        .with_thinking_max_tokens_upper_bound(u32::MAX)
        .with_non_thinking_max_tokens_upper_bound(u32::MAX);
    match family {
        ModelFamily::V41 => (V41_MODEL_NAME, options),
        ModelFamily::V4 => (
            V4_MODEL_NAME,
            options.with_model_alias(V4_MODEL_NAME, ModelVersion::DeepseekV4Pro),
        ),
    }
}

/// The prompt encoding of the served family.
enum ChatEncoding {
    V41(DeepseekV41Encoding),
    V4(DeepseekV4Encoding),
}

/// A chat body converted and encoded. Sampling fields are `None` when the body sets none.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedChat {
    pub tokens: Vec<u32>,
    /// The body's `temperature` as given (0 = greedy, in thinking mode too).
    pub temperature: Option<f32>,
    /// The body's `top_p`, as deepseek-recipe resolves it for the model (V4.1 thinking mode
    /// raises it to at least 0.95).
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    /// Structured output the body asks for (`response_format`).
    pub constraint: Option<Constraint>,
}

/// Tokenizer + the family's prompt encoding.
pub struct TextCodec {
    tokenizer: Tokenizer,
    encoding: ChatEncoding,
    bos_token_id: u32,
}

impl std::fmt::Debug for TextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextCodec")
            .field("vocab", &self.vocab_size())
            .finish()
    }
}

fn tokenizer_error(path: &Path, message: impl Into<String>) -> EngineError {
    EngineError::Tokenizer {
        path: PathBuf::from(path),
        message: message.into(),
    }
}

/// Reads `tokenizer.json` and, for V4.1, renames the V4 placeholder at 128799 to `<｜System｜>`.
pub fn load_v41_tokenizer(path: &Path) -> Result<Tokenizer, EngineError> {
    let text = std::fs::read_to_string(path).map_err(|e| tokenizer_error(path, e.to_string()))?;
    let mut json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| tokenizer_error(path, format!("not JSON: {e}")))?;
    let added = json
        .get_mut("added_tokens")
        .and_then(|a| a.as_array_mut())
        .ok_or_else(|| tokenizer_error(path, "no `added_tokens` array"))?;
    for token in added.iter_mut() {
        let is_799 = token.get("id").and_then(|i| i.as_u64()) == Some(V41_SYSTEM_TOKEN_ID);
        if is_799 && token.get("content").and_then(|c| c.as_str()) == Some(V4_PLACEHOLDER_799) {
            token["content"] = serde_json::Value::String(V41_SYSTEM_TOKEN.to_string());
        }
    }
    serde_json::from_value::<Tokenizer>(json).map_err(|e| tokenizer_error(path, e.to_string()))
}

impl TextCodec {
    /// Loads the tokenizer (V4.1 naming) and builds the V4.1 chat encoding once.
    pub fn load(path: &Path, bos_token_id: u32) -> Result<Self, EngineError> {
        Self::load_for(path, bos_token_id, ModelFamily::V41)
    }

    /// Loads the tokenizer and builds the chat encoding of `family` once (V4: the file as is).
    pub fn load_for(
        path: &Path,
        bos_token_id: u32,
        family: ModelFamily,
    ) -> Result<Self, EngineError> {
        let (tokenizer, encoding) = match family {
            ModelFamily::V41 => {
                let tokenizer = load_v41_tokenizer(path)?;
                if tokenizer.token_to_id(V41_SYSTEM_TOKEN).is_none() {
                    return Err(tokenizer_error(
                        path,
                        format!("no {V41_SYSTEM_TOKEN} token after loading"),
                    ));
                }
                let encoding =
                    DeepseekV41Encoding::new().with_tokenizer(PromptTokenizer::new(&tokenizer));
                (tokenizer, ChatEncoding::V41(encoding))
            }
            ModelFamily::V4 => {
                let tokenizer =
                    Tokenizer::from_file(path).map_err(|e| tokenizer_error(path, e.to_string()))?;
                let encoding =
                    DeepseekV4Encoding::new().with_tokenizer(PromptTokenizer::new(&tokenizer));
                (tokenizer, ChatEncoding::V4(encoding))
            }
        };
        Ok(TextCodec {
            tokenizer,
            encoding,
            bos_token_id,
        })
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// BOS + the encoding of raw text (a completions prompt).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, ValidationError> {
        let encoding =
            self.tokenizer
                .encode_fast(text, false)
                .map_err(|e| ValidationError::Encoding {
                    detail: e.to_string(),
                })?;
        let mut ids = Vec::with_capacity(encoding.get_ids().len() + 1);
        ids.push(self.bos_token_id);
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// Converts an OpenAI chat body with `deepseek-recipe` and encodes it with the family's
    /// template. The body's `model` is replaced by the family's name (this engine serves one
    /// model).
    pub fn encode_chat(&self, body: &serde_json::Value) -> Result<EncodedChat, ValidationError> {
        let mut body = body.clone();
        let grammar_format =
            take_grammar_response_format(&mut body).map_err(|e| ValidationError::Conversion {
                detail: e.to_string(),
            })?;
        let Some(object) = body.as_object_mut() else {
            return Err(ValidationError::Conversion {
                detail: "the body is not a JSON object".into(),
            });
        };
        let (model_name, options) = conversion_options(match self.encoding {
            ChatEncoding::V41(_) => ModelFamily::V41,
            ChatEncoding::V4(_) => ModelFamily::V4,
        });
        let temperature = object
            .get("temperature")
            .and_then(serde_json::Value::as_f64)
            .map(|t| t as f32);
        let has_top_p = object.get("top_p").is_some_and(|p| !p.is_null());
        object.insert("model".into(), serde_json::Value::String(model_name.into()));
        let request: ChatCompletionRequest =
            serde_json::from_value(body).map_err(|e| ValidationError::Conversion {
                detail: e.to_string(),
            })?;
        let converted = request
            .convert(options)
            .map_err(|e| ValidationError::Conversion {
                detail: e.to_string(),
            })?;
        let encoded = match &self.encoding {
            ChatEncoding::V41(encoding) => encoding.encode(&converted.conversation),
            ChatEncoding::V4(encoding) => encoding.encode(&converted.conversation),
        };
        let tokens = encoded.map_err(|e| ValidationError::Encoding {
            detail: e.to_string(),
        })?;
        let options = &converted.inference_options;
        Ok(EncodedChat {
            tokens,
            temperature,
            top_p: options.top_p.filter(|_| has_top_p),
            seed: options.seed,
            max_tokens: options.max_tokens,
            stop: converted.parsing_options.stop_sequences.clone(),
            constraint: grammar_format.or_else(|| {
                options
                    .output_constraint
                    .as_ref()
                    .and_then(Constraint::from_output_constraint)
            }),
        })
    }

    /// Text of generated tokens (special tokens kept, as the model wrote them).
    pub fn decode(&self, tokens: &[u32]) -> String {
        self.tokenizer.decode(tokens, false).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tokenizer/tokenizer.json")
    }

    #[test]
    fn v41_system_token_is_renamed_and_chat_encodes() {
        let codec = TextCodec::load(&shipped(), 0).unwrap();
        assert_eq!(codec.vocab_size(), 129_280);
        let chat = serde_json::json!({
            "model": "anything",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! 毕老师 1 + 1 = 2"}],
            "temperature": 0.3, "seed": 11, "stop": ["\n\n"], "max_tokens": 7
        });
        let enc = codec.encode_chat(&chat).unwrap();
        // BOS, then the V4.1 system token, as the reference encoding starts.
        assert_eq!(&enc.tokens[..2], &[0, 128_799]);
        // The user text encodes as the Python reference does (rust-stack.md §C.1).
        let user = [
            19923, 3, 223, 5464, 5008, 223, 19, 940, 223, 19, 438, 223, 20,
        ];
        assert!(
            enc.tokens.windows(user.len()).any(|w| w == user),
            "{:?}",
            enc.tokens
        );
        assert_eq!(
            (enc.seed, enc.max_tokens, enc.stop.clone()),
            (Some(11), Some(7), vec!["\n\n".to_string()])
        );
        assert_eq!(codec.decode(&user), "Hello! 毕老师 1 + 1 = 2");
    }

    /// A V4-family codec keeps the tokenizer as shipped and renders the V4 template: BOS, then
    /// (after the thinking preamble) the system text without a system token, the user turn and
    /// the assistant token; the V4.1 one starts with its system token.
    #[test]
    fn v4_chat_encodes_with_the_v4_template() {
        let v4 = TextCodec::load_for(&shipped(), 0, ModelFamily::V4).unwrap();
        let v41 = TextCodec::load(&shipped(), 0).unwrap();
        let chat = serde_json::json!({
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! 毕老师 1 + 1 = 2"}],
            "seed": 5, "max_tokens": 3
        });
        let enc = v4.encode_chat(&chat).unwrap();
        assert_eq!(enc.tokens[0], 0, "BOS first");
        assert!(
            !enc.tokens.contains(&(V41_SYSTEM_TOKEN_ID as u32)),
            "{:?}",
            enc.tokens
        );
        // The system text (no BOS), `<｜User｜>`, the user text, `<｜Assistant｜>`.
        let mut turn = v4.encode_text("Be brief.").unwrap()[1..].to_vec();
        turn.push(128_803);
        turn.extend([
            19923, 3, 223, 5464, 5008, 223, 19, 940, 223, 19, 438, 223, 20,
        ]);
        turn.push(128_804);
        assert!(
            enc.tokens.windows(turn.len()).any(|w| w == turn),
            "{:?}",
            enc.tokens
        );
        assert_eq!((enc.seed, enc.max_tokens), (Some(5), Some(3)));
        let enc41 = v41.encode_chat(&chat).unwrap();
        assert_eq!(&enc41.tokens[..2], &[0, 128_799]);
        assert_ne!(enc.tokens, enc41.tokens);
    }

    #[test]
    fn bad_chat_and_bad_file_are_clear_errors() {
        let codec = TextCodec::load(&shipped(), 0).unwrap();
        let err = codec
            .encode_chat(&serde_json::json!({"messages": "nope"}))
            .unwrap_err();
        assert!(matches!(err, ValidationError::Conversion { .. }));
        let err = TextCodec::load(Path::new("/nonexistent/tokenizer.json"), 0).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/tokenizer.json"));
    }
}
