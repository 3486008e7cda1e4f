//! The offline job: run a JSONL batch through an engine and stream one output line per input
//! line to the output as each finishes, flushed, so an interrupted job keeps every finished
//! result.
//!
//! Owns the concurrency of the job (at most `max_concurrent` lines generating at once, so the
//! engine's admission bound is respected; an `Overloaded` answer is retried), the output order
//! (input order through a reorder buffer of at most `reorder_window` finished lines, or
//! completion order), the skipping of `custom_id`s already done (`--resume`) or repeated, and
//! the stop: once `stop` turns true no line is admitted, lines in flight get `drain` to finish
//! and are then aborted; every finished line is written. Formats are in `format.rs`; request
//! bodies are validated by `crate::openai`. Blank input lines are skipped.

pub mod format;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;

use crate::engine::EngineHandle;
use crate::engine::request::GenerateRequest;
use crate::engine::stream::Completion;
use crate::error::EngineError;
use crate::openai::{ApiError, ApiRequest, ServedModel, unix_now};
use format::{
    JobLine, decode_line, line_error_line, line_seed, parse_line, request_error_line, success_line,
};

/// Counts of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JobSummary {
    /// Non-blank input lines.
    pub lines: usize,
    pub succeeded: usize,
    pub failed: usize,
    /// Lines skipped because the output already had their `custom_id` (`--resume`).
    pub skipped: usize,
    /// Lines not done because the job was stopped.
    pub not_done: usize,
}

/// In which order output lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputOrder {
    /// Input order (a finished line waits in the reorder buffer for the lines before it).
    #[default]
    Input,
    /// As lines finish.
    Completion,
}

/// Job settings.
#[derive(Debug, Clone)]
pub struct JobOptions {
    /// The model served (responses report its name; `max_tokens` is checked against it).
    pub served: ServedModel,
    /// Lines generating at once (keep it at or below the admission capacity).
    pub max_concurrent: usize,
    pub order: OutputOrder,
    /// Input order: most finished lines held back waiting for an earlier line; admission pauses
    /// while the buffer is full.
    pub reorder_window: usize,
    /// `custom_id`s already in the output (`--resume`): these lines are skipped.
    pub done: HashSet<String>,
    /// After a stop, how long lines in flight may still finish before they are aborted.
    pub drain: Duration,
}

impl JobOptions {
    /// `max_concurrent` lines at once, input order with a reorder buffer of 1024 lines, nothing
    /// done yet, 30 s to drain after a stop.
    pub fn new(served: ServedModel, max_concurrent: usize) -> Self {
        JobOptions {
            served,
            max_concurrent,
            order: OutputOrder::Input,
            reorder_window: 1024,
            done: HashSet::new(),
            drain: Duration::from_secs(30),
        }
    }
}

/// Runs one choice, retrying while the engine is at its admission limit.
async fn run_choice(
    engine: &EngineHandle,
    request: GenerateRequest,
) -> Result<Completion, EngineError> {
    let mut backoff = Duration::from_millis(2);
    loop {
        match engine.generate(request.clone()).await {
            Ok(stream) => return stream.collect().await,
            Err(EngineError::Overloaded { .. }) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs every choice of a line and builds its output line; `(line, succeeded)`.
async fn run_line(
    engine: EngineHandle,
    index: usize,
    custom_id: String,
    request: ApiRequest,
    served: Arc<ServedModel>,
) -> (Value, bool) {
    let choices = request.choice_requests(Some(line_seed(&custom_id)));
    let runs = choices.into_iter().map(|choice| {
        let engine = engine.clone();
        async move { run_choice(&engine, choice).await }
    });
    let mut done = Vec::new();
    for result in join_all(runs).await {
        match result {
            Ok(completion) => done.push(completion),
            Err(error) => {
                let line = request_error_line(index, &custom_id, &ApiError::from_engine(&error));
                return (line, false);
            }
        }
    }
    match request.response(&served, &done, unix_now()).await {
        Ok(body) => {
            let request_id = done[0].id.to_string();
            (success_line(index, &custom_id, &request_id, body), true)
        }
        Err(error) => (request_error_line(index, &custom_id, &error), false),
    }
}

/// Awaits the futures concurrently (spawned, so the choices of a line generate together).
async fn join_all<F>(futures: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        match handle.await {
            Ok(value) => out.push(value),
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
    out
}

/// One line's output, waiting to be written.
struct Finished {
    line: Value,
    ok: bool,
}

/// The lines of `input` (1-based numbers) that are not blank.
fn numbered_lines(input: &[u8]) -> impl Iterator<Item = (usize, &[u8])> {
    input
        .split(|b| *b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .enumerate()
        .map(|(i, l)| (i + 1, l))
        .filter(|(_, l)| !l.iter().all(u8::is_ascii_whitespace))
}

/// Non-blank lines of `input` (the job's line count).
pub fn count_lines(input: &[u8]) -> usize {
    numbered_lines(input).count()
}

/// Where output lines go: in input order through the reorder buffer, or as they finish.
struct Writer<'a, W: Write> {
    output: &'a mut W,
    order: OutputOrder,
    /// Finished lines by sequence number, waiting for the lines before them.
    pending: BTreeMap<usize, Finished>,
    /// The next sequence number to write (input order).
    next: usize,
    /// Lines given a sequence number and not written yet.
    unwritten: usize,
    summary: JobSummary,
    on_line_done: Arc<dyn Fn() + Send + Sync>,
}

impl<W: Write> Writer<'_, W> {
    fn write(&mut self, finished: Finished) -> std::io::Result<()> {
        serde_json::to_writer(&mut *self.output, &finished.line)?;
        self.output.write_all(b"\n")?;
        self.output.flush()?;
        self.unwritten -= 1;
        if finished.ok {
            self.summary.succeeded += 1;
        } else {
            self.summary.failed += 1;
        }
        (self.on_line_done)();
        Ok(())
    }

    /// The output of line `seq`: written now, or held until the lines before it are written.
    fn accept(&mut self, seq: usize, finished: Finished) -> std::io::Result<()> {
        if self.order == OutputOrder::Completion {
            return self.write(finished);
        }
        self.pending.insert(seq, finished);
        while let Some(finished) = self.pending.remove(&self.next) {
            self.next += 1;
            self.write(finished)?;
        }
        Ok(())
    }

    /// After a stop: the held lines whose predecessors will never finish, in input order.
    fn flush_held(&mut self) -> std::io::Result<()> {
        while let Some((_, finished)) = self.pending.pop_first() {
            self.write(finished)?;
        }
        Ok(())
    }
}

/// Runs the lines of `input` and streams their output lines to `output`, each flushed as it is
/// written. `on_line_done` is called once per written line (for a progress bar). When `stop`
/// turns true, admission ends and the job winds down (see the module header);
/// `JobSummary::not_done` counts the lines that got no output line.
pub async fn run_job<W: Write>(
    engine: &EngineHandle,
    input: &[u8],
    options: &JobOptions,
    output: &mut W,
    on_line_done: Arc<dyn Fn() + Send + Sync>,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<JobSummary> {
    let served = Arc::new(options.served.clone());
    let max_running = options.max_concurrent.max(1);
    let max_unwritten = max_running + options.reorder_window;
    let mut writer = Writer {
        output,
        order: options.order,
        pending: BTreeMap::new(),
        next: 0,
        unwritten: 0,
        summary: JobSummary::default(),
        on_line_done,
    };
    let mut tasks = tokio::task::JoinSet::new();
    let mut first_line: HashMap<String, usize> = HashMap::new();
    let mut lines = numbered_lines(input);
    let mut seq = 0usize;
    let mut stopped = *stop.borrow();
    let mut stop_open = true;
    let mut deadline = None;
    loop {
        let room = tasks.len() < max_running && writer.unwritten < max_unwritten;
        if !stopped
            && room
            && let Some((number, bytes)) = lines.next()
        {
            writer.summary.lines += 1;
            let parsed = decode_line(bytes, number)
                .and_then(|text| parse_line(text, number, &options.served));
            let (custom_id, request) = match parsed {
                Ok(JobLine { custom_id, request }) => (custom_id, request),
                Err(error) => {
                    let line = line_error_line(number, &error);
                    writer.unwritten += 1;
                    writer.accept(seq, Finished { line, ok: false })?;
                    seq += 1;
                    continue;
                }
            };
            if options.done.contains(&custom_id) {
                writer.summary.skipped += 1;
                continue;
            }
            writer.unwritten += 1;
            let this = seq;
            seq += 1;
            if let Some(first) = first_line.get(&custom_id) {
                let error = format::LineError {
                    line: number,
                    custom_id: Some(custom_id.clone()),
                    message: format!("duplicate `custom_id` {custom_id:?} (first on line {first})"),
                };
                let line = line_error_line(number, &error);
                writer.accept(this, Finished { line, ok: false })?;
                continue;
            }
            first_line.insert(custom_id.clone(), number);
            match request {
                Ok(request) => {
                    let (engine, served) = (engine.clone(), served.clone());
                    tasks.spawn(async move {
                        let (line, ok) = run_line(engine, number, custom_id, request, served).await;
                        (this, Finished { line, ok })
                    });
                }
                Err(error) => {
                    let line = request_error_line(number, &custom_id, &error);
                    writer.accept(this, Finished { line, ok: false })?;
                }
            }
            continue;
        }
        if tasks.is_empty() {
            break;
        }
        let drain_over = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            joined = tasks.join_next() => match joined {
                Some(Ok((this, finished))) => writer.accept(this, finished)?,
                Some(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Some(Err(_)) | None => {}
            },
            changed = stop.changed(), if !stopped && stop_open => match changed {
                Ok(()) if *stop.borrow() => {
                    stopped = true;
                    deadline = Some(tokio::time::Instant::now() + options.drain);
                }
                Ok(()) => {}
                // No one can stop the job any more.
                Err(_) => stop_open = false,
            },
            () = drain_over => {
                // Aborting a line drops its event streams, which aborts its requests.
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
                break;
            }
        }
    }
    writer.flush_held()?;
    let mut summary = writer.summary;
    summary.lines += lines.count();
    summary.not_done = summary.lines - summary.succeeded - summary.failed - summary.skipped;
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
