//! `deepinfer-node`: runs an offline job (OpenAI Batch JSONL) on the topology's model, or a
//! built-in sample batch when no input is given. The job logic lives in `deepinfer_actors::job`.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use deepinfer_actors::job::{JobOptions, run_job, sample_batch};
use deepinfer_actors::{Engine, EngineConfig, model_source, prometheus};
use deepinfer_topology::NodeConfig;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Offline inference for DeepSeek-V4.1-Flash.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Topology file; default: the embedded configs/local.toml (CPU, built-in demo model).
    #[arg(long)]
    topology: Option<PathBuf>,
    /// OpenAI Batch JSONL input (`/v1/chat/completions` or `/v1/completions` lines, or plain
    /// `{"prompt": ...}` lines). Default: the topology's `[job] input_path`, else a sample batch.
    #[arg(long)]
    input: Option<PathBuf>,
    /// Output JSONL (one line per input line). Default: the topology's `[job] output_path`,
    /// else stdout.
    #[arg(long)]
    output: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let node = match &cli.topology {
        Some(path) => NodeConfig::from_file_with_env(path)?,
        None => NodeConfig::embedded_default()?,
    };
    node.can_run_here(0)
        .with_context(|| format!("topology {}", node.origin))?;
    let _metrics = match node.metrics.prometheus_listen {
        Some(addr) => Some(prometheus::serve(prometheus::install()?, addr).await?),
        None => None,
    };
    let resolve_node = node.clone();
    let model = tokio::task::spawn_blocking(move || model_source::resolve(&resolve_node)).await??;
    if let Some(notice) = &model.notice {
        eprintln!("{notice}");
    }
    let input_path = cli.input.or_else(|| node.job.input_path.clone());
    let output_path = cli.output.or_else(|| node.job.output_path.clone());
    let input = match &input_path {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        None => sample_batch(),
    };
    let options = JobOptions {
        model_name: model.name.clone(),
        max_concurrent: node.scheduler.admission_queue_capacity as usize,
    };
    let config = EngineConfig {
        node,
        executor: model.factory,
        model: model.facts,
        tokenizer: Some(model.tokenizer),
    };
    let engine = Engine::start(config).await?;

    let lines = input.lines().filter(|l| !l.trim().is_empty()).count() as u64;
    let progress = ProgressBar::with_draw_target(Some(lines), ProgressDrawTarget::stderr());
    if !std::io::stderr().is_terminal() {
        progress.set_draw_target(ProgressDrawTarget::hidden());
    }
    progress.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} requests {elapsed_precise} eta {eta}",
    )?);
    let tick = progress.clone();
    let on_done: Arc<dyn Fn() + Send + Sync> = Arc::new(move || tick.inc(1));

    let mut buffer = Vec::new();
    let summary = run_job(&engine.handle(), &input, &options, &mut buffer, on_done).await?;
    progress.finish_and_clear();
    engine.shutdown(Duration::from_secs(30)).await?;

    match &output_path {
        Some(path) => {
            std::fs::write(path, &buffer).with_context(|| format!("writing {}", path.display()))?
        }
        None if input_path.is_some() => std::io::stdout().write_all(&buffer)?,
        None => print_sample(&buffer)?,
    }
    eprintln!(
        "{} requests: {} succeeded, {} failed",
        summary.lines, summary.succeeded, summary.failed
    );
    Ok(())
}

/// The sample batch, human-readable: each request's id and generated text.
fn print_sample(output: &[u8]) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    for line in output.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let value: serde_json::Value = serde_json::from_slice(line)?;
        let id = value["custom_id"].as_str().unwrap_or("?");
        let choice = &value["response"]["body"]["choices"][0];
        let text = choice["message"]["content"]
            .as_str()
            .or_else(|| choice["text"].as_str());
        match text {
            Some(text) => writeln!(stdout, "[{id}] {text:?}")?,
            None => writeln!(stdout, "[{id}] error: {}", value["error"]["message"])?,
        }
    }
    Ok(())
}
