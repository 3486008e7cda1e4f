//! `deepinfer-node` end to end on the built-in demo model (random weights, real tokenizer):
//! an OpenAI Batch file in, one output line per input line out, a malformed line in place.

use std::process::Command;

#[test]
fn batch_file_through_the_binary_on_the_demo_model() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    let lines = [
        r#"{"custom_id":"chat-1","method":"POST","url":"/v1/chat/completions","body":{"model":"deepseek-v4.1-flash","messages":[{"role":"user","content":"Hi"}],"max_tokens":3,"seed":5}}"#,
        r#"{"custom_id":"broken", "body": "#,
        r#"{"custom_id":"comp-1","method":"POST","url":"/v1/completions","body":{"prompt":"Hello","max_tokens":2,"temperature":0}}"#,
        r#"{"prompt":"plain","max_tokens":1}"#,
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_deepinfer-node"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .env_remove("DEEPINFER_HF_MODEL_DIR")
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
    assert!(stderr.contains("random weights"), "{stderr}");
    assert!(
        stderr.contains("4 requests: 3 succeeded, 1 failed"),
        "{stderr}"
    );
    let out: Vec<serde_json::Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<_> = out.iter().map(|v| v["custom_id"].clone()).collect();
    assert_eq!(
        ids,
        vec![
            "chat-1".into(),
            serde_json::Value::Null,
            "comp-1".into(),
            "line-4".into()
        ]
    );
    assert_eq!(out[1]["error"]["code"], "invalid_line");
    assert_eq!(out[0]["response"]["body"]["object"], "chat.completion");
    assert_eq!(out[2]["response"]["body"]["object"], "text_completion");
    for i in [0, 2, 3] {
        let usage = &out[i]["response"]["body"]["usage"];
        assert!(usage["completion_tokens"].as_u64().unwrap() >= 1, "{usage}");
    }
}
