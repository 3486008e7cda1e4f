//! The offline job: run a JSONL batch through an engine and write one output line per input
//! line, in input order.
//!
//! Owns the concurrency of the job (at most `max_concurrent` requests admitted at once, so the
//! engine's admission bound is respected; an `Overloaded` answer is retried) and the ordering of
//! the output. Formats are in `format.rs`. Blank input lines are skipped; every other line yields
//! exactly one output line: a response, or an error naming the line.

pub mod format;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::engine::EngineHandle;
use crate::error::EngineError;
use format::{JobLine, engine_error_line, line_error_line, parse_line, success_line, unix_now};

/// Counts of a finished job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JobSummary {
    pub lines: usize,
    pub succeeded: usize,
    pub failed: usize,
}

/// Job settings.
#[derive(Debug, Clone)]
pub struct JobOptions {
    /// The model name reported when a line names none.
    pub model_name: String,
    /// Requests admitted at once (keep it at or below the admission capacity).
    pub max_concurrent: usize,
}

async fn run_one(
    engine: EngineHandle,
    job: JobLine,
) -> Result<crate::engine::stream::Completion, EngineError> {
    let mut backoff = Duration::from_millis(2);
    loop {
        match engine.generate(job.request.clone()).await {
            Ok(stream) => return stream.collect().await,
            Err(EngineError::Overloaded { .. }) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs every line of `input` and writes the output lines to `output` in input order.
/// `on_line_done` is called once per finished line (for a progress bar).
pub async fn run_job<W: Write>(
    engine: &EngineHandle,
    input: &str,
    options: &JobOptions,
    output: &mut W,
    on_line_done: Arc<dyn Fn() + Send + Sync>,
) -> std::io::Result<JobSummary> {
    let permits = Arc::new(Semaphore::new(options.max_concurrent.max(1)));
    let mut tasks = Vec::new();
    for (index, text) in input
        .lines()
        .enumerate()
        .filter(|(_, t)| !t.trim().is_empty())
    {
        let line = index + 1;
        let parsed = parse_line(text, line, &options.model_name);
        let engine = engine.clone();
        let permits = permits.clone();
        let done = on_line_done.clone();
        tasks.push(tokio::spawn(async move {
            let out = match parsed {
                Err(error) => (line_error_line(line, &error), false),
                Ok(job) => {
                    let result = match permits.acquire_owned().await {
                        Ok(_permit) => run_one(engine, job.clone()).await,
                        Err(_) => Err(EngineError::ShuttingDown),
                    };
                    match result {
                        Ok(completion) => (success_line(line, &job, &completion, unix_now()), true),
                        Err(error) => (engine_error_line(line, &job.custom_id, &error), false),
                    }
                }
            };
            done();
            out
        }));
    }
    let mut summary = JobSummary::default();
    for task in tasks {
        let (value, ok) = task.await.map_err(std::io::Error::other)?;
        summary.lines += 1;
        if ok {
            summary.succeeded += 1;
        } else {
            summary.failed += 1;
        }
        serde_json::to_writer(&mut *output, &value)?;
        output.write_all(b"\n")?;
    }
    output.flush()?;
    Ok(summary)
}

/// The built-in sample batch (run when no input file is given).
pub fn sample_batch() -> String {
    let lines = [
        serde_json::json!({"custom_id": "sample-chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 24, "seed": 1}}),
        serde_json::json!({"custom_id": "sample-chat-system", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "What is an actor system?"}], "max_tokens": 24, "seed": 2}}),
        serde_json::json!({"custom_id": "sample-completion", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "The three primary colours are", "max_tokens": 16, "temperature": 0.0}}),
        serde_json::json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8, "seed": 7}),
    ];
    lines.iter().map(|l| format!("{l}\n")).collect()
}
