//! `deepinfer-node` on a V4-family checkpoint directory (`DEEPINFER_HF_MODEL_DIR`): a tiny V4
//! with the DeepSeek vocabulary and random weights, the shipped tokenizer; the family comes from
//! its `config.json`. A chat line (V4 template) and a completions line both complete.

use std::process::Command;

use deepinfer_actors::frontend::codec::TextCodec;
use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::{ModelConfig, ModelFamily};

#[test]
fn batch_file_through_the_binary_on_a_v4_directory() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("v4-model");
    std::fs::create_dir_all(&model).unwrap();
    let mut cfg = ModelConfig::tiny_v4();
    cfg.vocab_size = 129_280;
    cfg.max_position_embeddings = 1024;
    write_random_checkpoint(&cfg, 8, &model, 1).unwrap();
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    let lines = [
        r#"{"custom_id":"chat-1","method":"POST","url":"/v1/chat/completions","body":{"model":"deepseek-v4-flash","messages":[{"role":"user","content":"Hi"}],"max_tokens":3,"seed":5}}"#,
        r#"{"custom_id":"comp-1","method":"POST","url":"/v1/completions","body":{"prompt":"Hello","max_tokens":2,"temperature":0}}"#,
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_deepinfer-node"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .env("DEEPINFER_HF_MODEL_DIR", &model)
        .args([
            "--input",
            input.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stderr.contains("2 requests: 2 succeeded, 0 failed"),
        "{stderr}"
    );
    let out: Vec<serde_json::Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(out[0]["custom_id"], "chat-1");
    assert_eq!(out[0]["response"]["body"]["object"], "chat.completion");
    assert_eq!(out[1]["response"]["body"]["object"], "text_completion");
    // A body without `model` reports the directory's name.
    assert_eq!(out[1]["response"]["body"]["model"], "v4-model");
    for line in &out {
        let body = &line["response"]["body"];
        assert!(
            body["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
            "{body}"
        );
    }
    // The chat prompt was encoded with the V4 template.
    let codec = TextCodec::load_for(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../configs/tokenizer/tokenizer.json"),
        0,
        ModelFamily::V4,
    )
    .unwrap();
    let body: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    let encoded = codec.encode_chat(&body["body"]).unwrap();
    assert_eq!(
        out[0]["response"]["body"]["usage"]["prompt_tokens"].as_u64(),
        Some(encoded.tokens.len() as u64)
    );
}
