//! Structured outputs through the whole engine: chat requests with a `response_format` on the demo
//! model (tiny V4.1 architecture, the real 129,280-token DeepSeek vocabulary, seeded random
//! weights, loaded through the real loader), seeded at temperature 1. Every constraint of
//! tests/data/grammar/ must produce an output that validates (jsonschema / regex / re-parse), and a
//! request's tokens must not depend on what else is in its batch. A recording executor also checks
//! the rank's order of work: each step's masks are requested before its forward and applied to
//! that forward's logits.
//!
//! Time: about 75 s on 2 shared cores in a debug build (15 s of it building the demo checkpoint
//! and the grammar engine); the demo's CPU LM head dominates. JSON-schema requests ask for compact
//! JSON (see [`compact_json`]); every output ends well inside `MAX_TOKENS`.
//!
//! The v41-tiny fixture model (tests/fixtures/v41/v41-tiny) cannot run this test: its 512-token
//! stub vocabulary has no tokenizer, so no token bytes exist to build a grammar engine from.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::grammar_set::{Case, EOS, Generation, VOCAB, check_output, engine, test_set};
use deepinfer_actors::grammar::{Constraint, ConstraintStart, MaskWorkers, TokenId};
use deepinfer_actors::messages::rank::{NewSeq, SeqGrammar, SeqInput, SeqWork, StepMode, StepPlan};
use deepinfer_actors::rank::executor::{ExecError, ExecStep, RankExecutor, sample_on_host};
use deepinfer_actors::rank::worker::RankWorker;
use deepinfer_actors::{Completion, Engine, FinishReason, GenerateRequest, SamplingParams};
use deepinfer_model::EntryOutput;
use deepinfer_topology::{DpRank, RequestId, StepId};
use serde_json::{Value, json};

/// The generation cap of every request.
const MAX_TOKENS: usize = 300;

// ---------------------------------------------------------------------------------------------
// The engine on the demo model.

/// Starts an engine on the demo model with two DP ranks (one per CI core). Keep the directory
/// alive while it runs.
async fn start_demo_engine() -> (Engine, tempfile::TempDir) {
    let (engine, _served, dir) = common::demo_engine::start_demo_engine(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = 2\nep = 1\n\
         [scheduler]\nmax_batched_tokens = 4096\nmax_running_requests = 64\n\
         prefill_chunk_tokens = 512\noverlap_depth = 2\nadmission_queue_capacity = 128\n\
         [sampling]\nmax_tokens = 16\n",
        "grammar engine test",
    )
    .await;
    (engine, dir)
}

/// The chat request of one case: a short non-thinking prompt, the case's response format,
/// temperature 1 and a seed.
fn chat_request(case: &Case, seed: u64) -> GenerateRequest {
    let response_format = match &case.constraint {
        Constraint::JsonSchema(schema) => {
            let schema = compact_json(schema);
            json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        }
        Constraint::Regex(regex) => json!({"type": "regex", "regex": regex}),
        Constraint::Lark(grammar) => json!({"type": "grammar", "grammar": grammar}),
        Constraint::Ebnf(grammar) => {
            json!({"type": "grammar", "grammar": grammar, "syntax": "ebnf"})
        }
        Constraint::JsonObject => json!({"type": "json_object"}),
        Constraint::ToolCalls(_) => panic!("{}: tool calls come from `tools`", case.name),
    };
    GenerateRequest::from_chat(json!({
        "messages": [{"role": "user", "content": "Answer."}],
        "thinking": {"type": "disabled"},
        "response_format": response_format,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": seed,
        "max_tokens": MAX_TOKENS,
    }))
}

/// The schema asking for JSON without free whitespace (llguidance's `x-guidance` option, which a
/// request may set). With random weights nearly every JSON boundary would otherwise spend the
/// engine's whole whitespace allowance (40 characters), several times the tokens of the content,
/// on a CPU head that costs ~0.1 s per token in debug builds; the default whitespace rule is
/// covered by grammar_constraints.rs.
fn compact_json(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        object
            .entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false}));
    }
    schema
}

/// A chat request with a required tool call: the random-weight model answers with a DSML block
/// whose calls name the tool and give every parameter (strict) in order, each with a value of its
/// schema. (deepseek-recipe's strict normalisation keeps string enums but drops integer ones, so
/// the bounded values here are a string enum and a boolean.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_model_tool_calls_follow_the_tools() {
    let started = Instant::now();
    let (engine, _dir) = start_demo_engine().await;
    let parameters = json!({
        "type": "object",
        "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "hourly": {"type": "boolean"}
        },
        "required": ["unit", "hourly"],
        "additionalProperties": false
    });
    let request = GenerateRequest::from_chat(json!({
        "messages": [{"role": "user", "content": "Weather?"}],
        "thinking": {"type": "disabled"},
        "tools": [{"type": "function", "function": {"name": "forecast", "strict": true,
                   "parameters": parameters}}],
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": MAX_TOKENS,
    }));
    let done = run_together(&engine, vec![request]).await.remove(0);
    assert_eq!(done.reason, FinishReason::Stop, "{:?}", done.text);
    let d = "｜DSML｜";
    let call = regex::Regex::new(&format!(
        "^<{d} invoke name=\"forecast\">\n\
         <{d} parameter name=\"unit\" string=\"true\">(celsius|fahrenheit)</{d} parameter>\n\
         <{d} parameter name=\"hourly\" string=\"false\">(true|false)</{d} parameter>\n</{d} invoke>$"
    ))
    .expect("regex");
    let body = done
        .text
        .strip_suffix(&format!("\n</{d} calls>"))
        .unwrap_or_else(|| panic!("the block is not closed: {:?}", done.text));
    for invocation in body.split('\n').collect::<Vec<_>>().chunks(4) {
        let invocation = invocation.join("\n");
        assert!(
            call.is_match(&invocation),
            "{invocation:?} in {:?}",
            done.text
        );
    }
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("shutdown");
    eprintln!(
        "required tool call on the demo model ({} tokens, {:?}): {:?}",
        done.tokens.len(),
        started.elapsed(),
        done.text
    );
}

/// Submits every request at once (one batch composition) and collects the completions in order.
async fn run_together(engine: &Engine, requests: Vec<GenerateRequest>) -> Vec<Completion> {
    let mut streams = Vec::with_capacity(requests.len());
    for request in requests {
        streams.push(engine.generate(request).await.expect("request admitted"));
    }
    let mut completions = Vec::with_capacity(streams.len());
    for stream in streams {
        let done = tokio::time::timeout(Duration::from_secs(300), stream.collect())
            .await
            .expect("the request finishes")
            .expect("the request succeeds");
        completions.push(done);
    }
    completions
}

/// The answer as the checks see it: the tokens and the EOS that ended them (the engine leaves the
/// stop token out of its output).
fn generation_of(done: &Completion) -> Generation {
    let ended_with_eos = done.reason == FinishReason::Stop;
    let mut tokens = done.tokens.clone();
    if ended_with_eos {
        tokens.push(EOS);
    }
    Generation {
        tokens,
        ended_with_eos,
    }
}

fn case_seed(index: usize) -> u64 {
    1_000 + index as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_model_constrained_generations_validate_and_ignore_the_batch() {
    let started = Instant::now();
    let cases = test_set();
    assert!(cases.len() >= 30, "{} constraints", cases.len());
    let (engine, _dir) = start_demo_engine().await;
    let startup = started.elapsed();

    let requests = cases
        .iter()
        .enumerate()
        .map(|(i, case)| chat_request(case, case_seed(i)))
        .collect();
    let together = run_together(&engine, requests).await;
    let mut failures = Vec::new();
    let mut longest = 0;
    let mut total_tokens = 0;
    for (case, done) in cases.iter().zip(&together) {
        let grammar = engine_grammar(case);
        let generation = generation_of(done);
        longest = longest.max(done.tokens.len());
        total_tokens += done.tokens.len();
        if let Err(why) = check_output(case, &grammar, &generation) {
            failures.push(format!("{}: {why}", case.name));
        }
    }
    let batch_time = started.elapsed() - startup;
    assert!(failures.is_empty(), "failures:\n{}", failures.join("\n"));

    // The same requests alone (one in flight at a time) give the same tokens: a JSON enum, a JSON
    // string pattern, a regex and an EBNF grammar.
    let alone_indices = [1usize, 13, cases.len() / 2, cases.len() - 1];
    for &i in &alone_indices {
        let alone = run_together(&engine, vec![chat_request(&cases[i], case_seed(i))]).await;
        assert_eq!(
            alone[0].tokens,
            together[i].tokens,
            "{}: alone vs in a batch of {}",
            cases[i].name,
            cases.len()
        );
    }
    // Another seed changes the output (the comparison above is not vacuous).
    let uuid = cases
        .iter()
        .position(|c| c.name == "regex/uuid")
        .expect("the set has regex/uuid");
    let reseeded = run_together(&engine, vec![chat_request(&cases[uuid], 7)]).await;
    assert_ne!(reseeded[0].tokens, together[uuid].tokens);
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("shutdown");
    eprintln!(
        "{} constraints: {total_tokens} tokens (longest {longest}, cap {MAX_TOKENS}); \
         startup {startup:?}, batch {batch_time:?}, total {:?}",
        cases.len(),
        started.elapsed()
    );
}

fn engine_grammar(case: &Case) -> deepinfer_actors::grammar::CompiledGrammar {
    engine()
        .compile(&case.constraint)
        .unwrap_or_else(|e| panic!("{}: {e}", case.name))
}

// ---------------------------------------------------------------------------------------------
// The rank's order of work, observed by the executor.

/// Logits that strongly favour one token; records, at each forward, how many mask jobs the
/// rank's mask workers had finished.
struct RecordingExecutor {
    workers: Arc<MaskWorkers>,
    favoured: TokenId,
    lengths: HashMap<RequestId, usize>,
    forwards: u64,
    masks_done_at_forward: Arc<Mutex<Vec<u64>>>,
}

impl RankExecutor for RecordingExecutor {
    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError> {
        self.lengths.insert(id, 0);
        Ok(())
    }

    fn free_sequence(&mut self, id: RequestId) {
        self.lengths.remove(&id);
    }

    fn rollback(&mut self, id: RequestId, len: usize) -> Result<(), ExecError> {
        let held = self
            .lengths
            .get_mut(&id)
            .ok_or(ExecError::UnknownSequence(id))?;
        *held = len.min(*held);
        Ok(())
    }

    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError> {
        self.lengths
            .get(&id)
            .copied()
            .ok_or(ExecError::UnknownSequence(id))
    }

    fn live_sequences(&self) -> usize {
        self.lengths.len()
    }

    fn execute(
        &mut self,
        ExecStep { batch, sampling }: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        self.forwards += 1;
        // Every step of the test samples one constrained token, so by now the mask of this step
        // is done if (and only if) it was requested before the forward. Wait for it without
        // depending on how fast the worker is; a mask that is never requested shows up as a
        // short count after the deadline.
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.workers.completed_jobs() < self.forwards && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.masks_done_at_forward
            .lock()
            .expect("record")
            .push(self.workers.completed_jobs());
        let mut rows = Vec::with_capacity(batch.len());
        let mut held = Vec::with_capacity(batch.len());
        for entry in batch {
            let len = self
                .lengths
                .get_mut(&entry.id)
                .ok_or(ExecError::UnknownSequence(entry.id))?;
            held.push(*len);
            *len += entry.tokens.len();
            let mut row = vec![0.0f32; VOCAB];
            row[self.favoured as usize] = 40.0;
            rows.push(row);
        }
        sample_on_host(batch, sampling, &held, rows, VOCAB)
    }
}

#[test]
fn masks_are_requested_before_the_forward_and_applied_to_its_logits() {
    let env = engine().token_env();
    let favoured = env.tokenize_text("x")[0];
    let workers = Arc::new(MaskWorkers::new(1).expect("mask workers"));
    let record = Arc::new(Mutex::new(Vec::new()));
    let executor = RecordingExecutor {
        workers: Arc::clone(&workers),
        favoured,
        lengths: HashMap::new(),
        forwards: 0,
        masks_done_at_forward: Arc::clone(&record),
    };
    let mut rank = RankWorker::with_mask_workers(DpRank(0), Box::new(executor), workers);
    let sampling = SamplingParams {
        temperature: 1.0,
        seed: 5,
        ..SamplingParams::default()
    };
    // Unmasked, the favoured token wins at temperature 1 (the mask below is what removes it).
    assert_eq!(
        deepinfer_actors::sampling::sample(
            &{
                let mut row = vec![0.0f32; VOCAB];
                row[favoured as usize] = 40.0;
                row
            },
            &sampling,
            3
        ),
        Some(favoured)
    );
    let grammar = engine()
        .compile(&Constraint::Regex("[0-9]{3}".to_string()))
        .expect("compiles");
    let id = RequestId(1);
    let prompt = env.tokenize_text("Digits:");
    let mut tokens = Vec::new();
    // At most 3 digits and EOS: the loop ends at EOS well before the bound.
    for step in 0..8u64 {
        let first = step == 0;
        let plan = StepPlan {
            step: StepId(step),
            mode: StepMode::Mixed,
            new_seqs: if first {
                vec![NewSeq {
                    id,
                    sampling,
                    grammar: Some(Box::new(SeqGrammar {
                        matcher: engine().matcher(&grammar, ConstraintStart::Answer),
                        end_token: EOS,
                    })),
                    decoder_from: None,
                    speculative: false,
                    logprobs: None,
                    prefix: None,
                }]
            } else {
                Vec::new()
            },
            work: vec![SeqWork {
                id,
                input: if first {
                    SeqInput::Prefill {
                        tokens: prompt.clone(),
                        last: true,
                    }
                } else {
                    SeqInput::Decode
                },
            }],
            cache_ops: Vec::new(),
            finished: Vec::new(),
        };
        let output = rank.run_plan(&plan).expect("step runs");
        assert_eq!(output.sampled.len(), 1);
        tokens.push(output.sampled[0].1);
        if output.sampled[0].1 == EOS {
            break;
        }
    }
    assert_eq!(tokens.last(), Some(&EOS), "{tokens:?}");
    let steps = tokens.len() as u64;
    assert!(steps >= 2, "{tokens:?}");
    assert_eq!(
        *record.lock().expect("record"),
        (1..=steps).collect::<Vec<u64>>(),
        "mask jobs finished at each forward"
    );
    let text = String::from_utf8(env.decode(&tokens[..tokens.len() - 1])).expect("UTF-8");
    assert!(
        text.len() == 3 && text.bytes().all(|b| b.is_ascii_digit()),
        "{text:?}"
    );
    assert!(!tokens.contains(&favoured));
}
