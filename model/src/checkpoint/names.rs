//! Tensor-name spellings: every checkpoint is addressed by the official DeepSeek names (`embed.weight`,
//! `layers.N.attn.kv_norm.weight`, `hc_head_fn`, `mtp.S.*`, ...). A transformers 5.17
//! `save_pretrained` of a V4 model (the v4-tiny fixture) writes the official names back with a
//! `model.` prefix and four differences, which [`official_name`] undoes:
//!
//! | stored by transformers               | official                          |
//! |--------------------------------------|-----------------------------------|
//! | `model.embed_tokens.weight`          | `embed.weight`                    |
//! | `model.hc_head.hc_{fn,base,scale}`   | `hc_head_{fn,base,scale}`         |
//! | `model.layers.N.attn.norm.weight`    | `layers.N.attn.kv_norm.weight`    |
//! | `lm_head.weight`                     | `head.weight`                     |
//! | `model.<anything else>`              | `<anything else>`                 |
//!
//! (transformers renames the official `.kv_norm.` to `.norm.` when it saves, because its load-time
//! rule maps the compressors' `.norm.` onto `.kv_norm.`; only the attention's own norm, directly
//! under `attn.`, is affected — `attn.compressor.norm` and `attn.indexer.compressor.norm` are
//! official as saved.) Names without a `model.` prefix are official already: V4.1 and official V4
//! checkpoints pass through unchanged.

/// The official name of a tensor stored as `stored`, or `None` when `stored` is already official.
pub fn official_name(stored: &str) -> Option<String> {
    if stored == "lm_head.weight" {
        return Some("head.weight".to_string());
    }
    let rest = stored.strip_prefix("model.")?;
    if rest == "embed_tokens.weight" {
        return Some("embed.weight".to_string());
    }
    if let Some(part) = rest.strip_prefix("hc_head.hc_") {
        return Some(format!("hc_head_{part}"));
    }
    if let Some(layer_rest) = rest.strip_prefix("layers.")
        && let Some((layer, tail)) = layer_rest.split_once('.')
        && tail == "attn.norm.weight"
    {
        return Some(format!("layers.{layer}.attn.kv_norm.weight"));
    }
    Some(rest.to_string())
}

#[cfg(test)]
mod tests {
    use super::official_name;

    #[test]
    fn transformers_names_map_onto_official_ones() {
        let cases = [
            ("model.embed_tokens.weight", "embed.weight"),
            ("head.weight", "head.weight"),
            ("lm_head.weight", "head.weight"),
            ("model.norm.weight", "norm.weight"),
            ("model.hc_head.hc_fn", "hc_head_fn"),
            ("model.hc_head.hc_scale", "hc_head_scale"),
            (
                "model.layers.3.attn.norm.weight",
                "layers.3.attn.kv_norm.weight",
            ),
            (
                "model.layers.3.attn.compressor.norm.weight",
                "layers.3.attn.compressor.norm.weight",
            ),
            (
                "model.layers.2.attn.indexer.compressor.norm.weight",
                "layers.2.attn.indexer.compressor.norm.weight",
            ),
            ("model.layers.0.hc_attn_fn", "layers.0.hc_attn_fn"),
            (
                "model.layers.5.ffn.gate.tid2eid",
                "layers.5.ffn.gate.tid2eid",
            ),
            (
                "model.layers.12.attn_norm.weight",
                "layers.12.attn_norm.weight",
            ),
        ];
        for (stored, official) in cases {
            assert_eq!(
                official_name(stored).as_deref().unwrap_or(stored),
                official,
                "{stored}"
            );
        }
        // Official names are left alone.
        for name in [
            "layers.0.attn.kv_norm.weight",
            "mtp.0.e_proj.weight",
            "hc_head_fn",
        ] {
            assert_eq!(official_name(name), None);
        }
    }
}
