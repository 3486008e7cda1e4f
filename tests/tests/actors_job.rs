//! The offline job end to end on the fake backend with the shipped DeepSeek tokenizer:
//! OpenAI Batch lines in, one output line per input line out, in order, errors in place, each
//! response the one of its own line's request (run alone for comparison).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use deepinfer_actors::job::format::{line_seed, parse_line};
use deepinfer_actors::job::{JobOptions, run_job, sample_batch};
use deepinfer_actors::openai::ServedModel;
use deepinfer_actors::rank::fake::FakeConfig;
use deepinfer_actors::{Engine, EngineConfig, FinishReason, GenerateRequest};
use deepinfer_model::config::ModelFamily;
use deepinfer_topology::NodeConfig;
use serde_json::{Value, json};

fn tokenizer() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/tokenizer/tokenizer.json")
}

async fn engine() -> Engine {
    let node = NodeConfig::from_toml_str(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = 4\nep = 1\n\
         [scheduler]\nmax_batched_tokens = 256\nmax_running_requests = 16\nprefill_chunk_tokens = 64\n\
         overlap_depth = 2\nadmission_queue_capacity = 32\n[sampling]\nmax_tokens = 8\n",
        "job test",
    )
    .unwrap();
    let mut config = EngineConfig::fake(
        node,
        FakeConfig {
            vocab_size: 129_280,
            ..FakeConfig::default()
        },
    );
    config.tokenizer = Some(tokenizer());
    Engine::start(config).await.unwrap()
}

/// The fake model, as the job reports it.
fn served() -> ServedModel {
    ServedModel {
        name: "deepinfer-test".into(),
        family: ModelFamily::V41,
        context_tokens: 4096,
        thinking_by_default: false,
    }
}

fn input_lines() -> Vec<String> {
    (0..100)
        .map(|i| match i {
            17 => "{\"custom_id\": \"broken\", \"body\": ".to_string(),
            42 => json!({"custom_id": "r42", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}).to_string(),
            _ if i % 3 == 0 => json!({"custom_id": format!("r{i}"), "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": format!("Question {i}?")}],
                          "max_tokens": 3, "seed": i}})
            .to_string(),
            _ if i % 3 == 1 => json!({"custom_id": format!("r{i}"), "method": "POST", "url": "/v1/completions",
                "body": {"model": "deepseek-v4.1-flash", "prompt": format!("Story number {i}"), "max_tokens": 4, "temperature": 0}})
            .to_string(),
            _ => json!({"prompt": format!("Plain prompt {i}"), "max_tokens": 2, "temperature": 0}).to_string(),
        })
        .collect()
}

/// Line `i` of [`input_lines`] as a request of its own, parsed and seeded as the job does (`None`
/// for the two bad lines), to run alone: seeded lines give the same tokens in any batch. The
/// line's marker: its seed (chat) or its number at the end of its prompt (the fake model's next
/// token depends on the last one), so two lines' responses differ.
fn solo_request(i: usize) -> Option<GenerateRequest> {
    let line = parse_line(&input_lines()[i], i + 1, &served()).ok()?;
    let request = line.request.ok()?;
    Some(
        request
            .choice_requests(Some(line_seed(&line.custom_id)))
            .remove(0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jsonl_job_gives_one_line_per_input_line_in_order() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let engine = engine().await;
        let input = input_lines().join("\n") + "\n";
        let options = JobOptions::new(served(), 32);
        let counted = Arc::new(AtomicUsize::new(0));
        let counter = counted.clone();
        let mut out = Vec::new();
        let summary = run_job(
            &engine.handle(),
            input.as_bytes(),
            &options,
            &mut out,
            Arc::new(move || {
                counter.fetch_add(1, Ordering::Relaxed);
            }),
            tokio::sync::watch::channel(false).1,
        )
        .await
        .unwrap();
        // Each line's own request run alone: its response must be that line's, not another's.
        let mut alone = Vec::new();
        for i in 0..100 {
            alone.push(match solo_request(i) {
                Some(request) => Some(
                    engine
                        .generate(request)
                        .await
                        .unwrap()
                        .collect()
                        .await
                        .unwrap(),
                ),
                None => None,
            });
        }
        engine.shutdown(Duration::from_secs(30)).await.unwrap();
        assert_eq!(
            (summary.lines, summary.succeeded, summary.failed),
            (100, 98, 2)
        );
        assert_eq!(counted.load(Ordering::Relaxed), 100);
        let lines: Vec<Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 100);
        for (i, line) in lines.iter().enumerate() {
            assert_eq!(line["id"], format!("batch_req_{}", i + 1));
            match i {
                17 => {
                    assert_eq!(line["custom_id"], Value::Null);
                    assert_eq!(line["error"]["code"], "invalid_line");
                    assert!(
                        line["error"]["message"]
                            .as_str()
                            .unwrap()
                            .starts_with("line 18: not valid JSON")
                    );
                }
                42 => {
                    assert_eq!(line["custom_id"], "r42");
                    assert!(
                        line["error"]["message"]
                            .as_str()
                            .unwrap()
                            .contains("/v1/embeddings")
                    );
                }
                _ => {
                    let expected_id = if i % 3 == 2 {
                        format!("line-{}", i + 1)
                    } else {
                        format!("r{i}")
                    };
                    assert_eq!(line["custom_id"], expected_id);
                    assert_eq!(line["error"], Value::Null);
                    let response = &line["response"];
                    assert_eq!(response["status_code"], 200);
                    let body = &response["body"];
                    let (object, max) = match i % 3 {
                        0 => ("chat.completion", 3),
                        1 => ("text_completion", 4),
                        _ => ("text_completion", 2),
                    };
                    assert_eq!(body["object"], object);
                    let usage = &body["usage"];
                    let completion = usage["completion_tokens"].as_u64().unwrap();
                    assert!(completion <= max, "line {i}: {completion} > {max}");
                    assert!(usage["prompt_tokens"].as_u64().unwrap() > 2);
                    assert_eq!(
                        usage["total_tokens"].as_u64().unwrap(),
                        usage["prompt_tokens"].as_u64().unwrap() + completion
                    );
                    let choice = &body["choices"][0];
                    let finish = choice["finish_reason"].as_str().unwrap();
                    assert!(
                        finish == "length" && completion == max || finish == "stop",
                        "line {i}: {finish} after {completion}"
                    );
                    // The per-line marker: the prompt and the output of this line's own request.
                    let own = alone[i].as_ref().expect("a request line");
                    assert_eq!(
                        (usage["prompt_tokens"].as_u64(), completion),
                        (
                            Some(own.usage.prompt_tokens as u64),
                            own.usage.completion_tokens as u64
                        ),
                        "line {i}: usage of another line's request"
                    );
                    if object == "chat.completion" {
                        assert_eq!(choice["message"]["role"], "assistant");
                        let content = choice["message"]["content"].as_str().unwrap();
                        assert!(
                            own.text.ends_with(content),
                            "line {i}: {content:?} is not the answer of its own request {:?}",
                            own.text
                        );
                        // The model served, whatever the body named.
                        assert_eq!(body["model"], "deepinfer-test");
                    } else {
                        assert_eq!(
                            choice["text"].as_str(),
                            Some(own.text.as_str()),
                            "line {i}: the text of another line's request"
                        );
                    }
                }
            }
        }
    })
    .await
    .expect("job timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_stop_sequence_truncates_the_output() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let engine = engine().await;
        let request = GenerateRequest::from_text("The sea is")
            .max_tokens(12)
            .ignore_eos(true);
        let full = engine
            .generate(request.clone())
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        assert_eq!(full.reason, FinishReason::Length);
        // A stop string taken from the middle of the greedy output.
        let chars: Vec<char> = full.text.chars().collect();
        assert!(chars.len() >= 6, "{:?}", full.text);
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
        let cut = full.text.find(&stop).unwrap();
        let stopped = engine
            .generate(request.stop(stop.clone()))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        assert_eq!(stopped.reason, FinishReason::Stop);
        assert_eq!(stopped.text, full.text[..cut]);
        engine.shutdown(Duration::from_secs(10)).await.unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_batch_runs() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let engine = engine().await;
        let options = JobOptions::new(served(), 8);
        let mut out = Vec::new();
        let summary = run_job(
            &engine.handle(),
            sample_batch().as_bytes(),
            &options,
            &mut out,
            Arc::new(|| {}),
            tokio::sync::watch::channel(false).1,
        )
        .await
        .unwrap();
        engine.shutdown(Duration::from_secs(10)).await.unwrap();
        assert_eq!((summary.lines, summary.failed), (4, 0));
    })
    .await
    .expect("test timed out");
}

/// Batch lines that ask for log-probabilities get them in their response bodies, shaped as
/// OpenAI's, one entry per generated token; the tokens are those of the same lines without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_lines_report_logprobs_when_asked() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let engine = engine().await;
        let lines = |asked: bool| {
            let (chat, completion) = if asked {
                (json!({"logprobs": true, "top_logprobs": 2}), json!({"logprobs": 3}))
            } else {
                (json!({}), json!({}))
            };
            let mut chat_body = json!({"messages": [{"role": "user", "content": "Hi?"}],
                                       "max_tokens": 4, "seed": 5, "temperature": 0.8});
            chat_body.as_object_mut().unwrap().extend(chat.as_object().unwrap().clone());
            let mut completion_body = json!({"prompt": "The sea", "max_tokens": 3, "seed": 6});
            completion_body.as_object_mut().unwrap().extend(completion.as_object().unwrap().clone());
            [
                json!({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat_body}),
                json!({"custom_id": "p", "method": "POST", "url": "/v1/completions", "body": completion_body}),
            ]
            .map(|l| l.to_string())
            .join("\n")
        };
        let mut bodies = Vec::new();
        for asked in [true, false] {
            let mut out = Vec::new();
            let summary = run_job(
                &engine.handle(),
                lines(asked).as_bytes(),
                &JobOptions::new(served(), 8),
                &mut out,
                Arc::new(|| {}),
                tokio::sync::watch::channel(false).1,
            )
            .await
            .unwrap();
            assert_eq!((summary.lines, summary.failed), (2, 0));
            let parsed: Vec<Value> = String::from_utf8(out)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).unwrap()["response"]["body"].clone())
                .collect();
            bodies.push(parsed);
        }
        engine.shutdown(Duration::from_secs(10)).await.unwrap();
        let (asked, plain) = (&bodies[0], &bodies[1]);
        let chat = &asked[0]["choices"][0];
        assert_eq!(chat["message"], plain[0]["choices"][0]["message"], "the same answer");
        let content = chat["logprobs"]["content"].as_array().expect("chat logprobs");
        assert_eq!(content.len() as u64, asked[0]["usage"]["completion_tokens"].as_u64().unwrap());
        for entry in content {
            let top = entry["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 2, "{entry}");
            assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
            assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
        }
        assert!(plain[0]["choices"][0]["logprobs"].is_null());
        let completion = &asked[1]["choices"][0];
        assert_eq!(completion["text"], plain[1]["choices"][0]["text"]);
        let logprobs = &completion["logprobs"];
        let generated = asked[1]["usage"]["completion_tokens"].as_u64().unwrap() as usize;
        assert!(generated > 0);
        assert_eq!(logprobs["tokens"].as_array().unwrap().len(), generated);
        assert_eq!(logprobs["token_logprobs"].as_array().unwrap().len(), generated);
        let alternatives = logprobs["top_logprobs"][0].as_object().unwrap().len();
        assert!((1..=3).contains(&alternatives), "texts of 3 alternatives: {alternatives}");
        assert_eq!(logprobs["text_offset"][0], 0);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_response_format_constrains_the_output() {
    tokio::time::timeout(Duration::from_secs(300), async {
        let engine = engine().await;
        let schema = json!({"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
                            "required": ["colour"], "additionalProperties": false});
        let body = json!({
            "messages": [{"role": "user", "content": "Pick a colour."}],
            "thinking": {"type": "disabled"},
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}},
            "max_tokens": 40, "seed": 3
        });
        let done = engine.generate(GenerateRequest::from_chat(body)).await.unwrap().collect().await.unwrap();
        assert_eq!(done.reason, FinishReason::Stop, "{:?}", done.text);
        let value: Value = serde_json::from_str(done.text.trim()).unwrap_or_else(|e| panic!("{e}: {:?}", done.text));
        let colour = value["colour"].as_str().unwrap();
        assert!(colour == "red" || colour == "green", "{value}");
        assert_eq!(value.as_object().unwrap().len(), 1);
        // Without the constraint the fake model's text is not JSON.
        let free = json!({"messages": [{"role": "user", "content": "Pick a colour."}],
                          "thinking": {"type": "disabled"}, "max_tokens": 12, "seed": 3});
        let done = engine.generate(GenerateRequest::from_chat(free)).await.unwrap().collect().await.unwrap();
        assert!(serde_json::from_str::<Value>(done.text.trim()).is_err(), "{:?}", done.text);
        // An invalid schema fails that request only.
        let bad = json!({"messages": [{"role": "user", "content": "x"}],
                         "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}});
        let err = engine.generate(GenerateRequest::from_chat(bad)).await.err().unwrap();
        assert_eq!(err.code(), "invalid_request", "{err}");
        engine.shutdown(Duration::from_secs(10)).await.unwrap();
    })
    .await
    .expect("test timed out");
}
