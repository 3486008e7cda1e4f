//! `deepinfer-node`: runs an offline job (OpenAI Batch JSONL) on the topology's model, or a
//! built-in sample batch when no input is given; `serve` serves the OpenAI API over HTTP;
//! `logits` and `eplb-plan` are operator tools. The logic lives in
//! `deepinfer_actors::{job, server, tools}`; this file parses arguments and prints.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use deepinfer_actors::job::{JobOptions, run_job, sample_batch};
use deepinfer_actors::server::{ServeOptions, Server};
use deepinfer_actors::tools::{eplb_plan, logits};
use deepinfer_actors::{Engine, EngineConfig, gpu, model_source, prometheus};
use deepinfer_topology::eplb::PlacementShape;
use deepinfer_topology::{NodeConfig, parse_listen_address};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Offline inference for DeepSeek-V4.1-Flash.
#[derive(Parser, Debug)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    tool: Option<Tool>,
    #[command(flatten)]
    job: JobArgs,
}

/// The offline job (the default when no tool is named).
#[derive(Args, Debug)]
struct JobArgs {
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

#[derive(Subcommand, Debug)]
enum Tool {
    /// Serves the OpenAI API over HTTP (chat/completions and completions with SSE streaming,
    /// models, health, readiness, metrics) until SIGTERM or SIGINT.
    Serve(ServeArgs),
    /// Writes the fp32 logits at every input position (tensor `logits`, [tokens, vocab]) when
    /// the tokens are fed through the per-sequence state in the given chunk sizes.
    Logits(LogitsArgs),
    /// Plans an expert placement with DeepSeek's EPLB and prints
    /// `{"phy2log", "log2phy", "logcnt"}` as JSON.
    EplbPlan(EplbPlanArgs),
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Topology file; default: the embedded configs/local.toml (CPU, built-in demo model).
    #[arg(long)]
    topology: Option<PathBuf>,
    /// IP:port to listen on; default: the topology's `[server] listen` (127.0.0.1:8000).
    #[arg(long, value_parser = parse_listen_address)]
    listen: Option<std::net::SocketAddr>,
}

#[derive(Args, Debug)]
struct LogitsArgs {
    /// Checkpoint directory (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids.
    #[arg(long)]
    tokens: String,
    /// Comma-separated chunk sizes summing to the number of tokens (default: one chunk).
    #[arg(long)]
    chunks: Option<String>,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Output safetensors file.
    #[arg(long)]
    out: PathBuf,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda,
}

#[derive(Args, Debug)]
struct EplbPlanArgs {
    /// JSON file `[[layer loads...], ...]`: one row of per-expert loads per MoE layer.
    #[arg(long)]
    load: PathBuf,
    /// Physical expert slots per layer (logical experts + redundant ones).
    #[arg(long)]
    replicas: usize,
    /// Expert groups.
    #[arg(long)]
    groups: usize,
    /// Nodes.
    #[arg(long)]
    nodes: usize,
    /// GPUs (EP ranks) in all.
    #[arg(long)]
    gpus: usize,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.tool {
        Some(Tool::Serve(args)) => block_on(run_serve(args)),
        Some(Tool::Logits(args)) => run_logits(args),
        Some(Tool::EplbPlan(args)) => run_eplb_plan(args),
        None => block_on(run(cli.job)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One line: what failed and where.
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn block_on(work: impl Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(work)
}

fn run_logits(args: LogitsArgs) -> anyhow::Result<()> {
    let request = logits::LogitsRequest {
        model_dir: args.model,
        tokens: logits::parse_token_list(&args.tokens)?,
        chunks: match &args.chunks {
            Some(text) => logits::parse_chunk_list(text)?,
            None => Vec::new(),
        },
        out: args.out,
    };
    let device = match args.device {
        Device::Cpu => logits::LogitsDevice::Cpu,
        Device::Cuda => logits::LogitsDevice::Cuda,
    };
    let [rows, vocab] = logits::run_on(&request, device)?;
    eprintln!(
        "wrote logits [{rows}, {vocab}] to {}",
        request.out.display()
    );
    Ok(())
}

fn run_eplb_plan(args: EplbPlanArgs) -> anyhow::Result<()> {
    let shape = PlacementShape {
        num_replicas: args.replicas,
        num_groups: args.groups,
        num_nodes: args.nodes,
        num_gpus: args.gpus,
    };
    let plan = eplb_plan::run(&args.load, shape).map_err(anyhow::Error::msg)?;
    println!("{plan}");
    Ok(())
}

/// The topology (the file, or the embedded default).
fn load_node(topology: Option<&PathBuf>) -> anyhow::Result<NodeConfig> {
    let node = match topology {
        Some(path) => NodeConfig::from_file_with_env(path)?,
        None => NodeConfig::embedded_default()?,
    };
    // The GPUs a CUDA topology needs, counted for real (none without a driver or `cuda`).
    gpu::check_node(&node)?;
    Ok(node)
}

/// Resolves the topology's model (downloading it when needed) into an engine configuration
/// and the model's name.
async fn engine_config(node: NodeConfig) -> anyhow::Result<(EngineConfig, String)> {
    let resolve_node = node.clone();
    let model = tokio::task::spawn_blocking(move || model_source::resolve(&resolve_node)).await??;
    if let Some(notice) = &model.notice {
        eprintln!("{notice}");
    }
    let config = EngineConfig {
        node,
        executor: model.factory,
        model: model.facts,
        tokenizer: Some(model.tokenizer),
    };
    Ok((config, model.name))
}

/// Resolves when the process receives SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

async fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let node = load_node(args.topology.as_ref())?;
    let metrics = prometheus::install()?;
    let _exporter = match node.metrics.prometheus_listen {
        Some(addr) => Some(prometheus::serve(metrics.clone(), addr).await?),
        None => None,
    };
    let server_config = node.server;
    let (config, model_name) = engine_config(node).await?;
    let engine = Engine::start(config).await?;
    let options = ServeOptions {
        listen: args.listen.unwrap_or(server_config.listen),
        max_body_bytes: server_config.max_body_bytes as usize,
        shutdown_timeout: Duration::from_secs(u64::from(server_config.shutdown_timeout_seconds)),
        model_name: model_name.clone(),
    };
    let server = Server::bind(&engine, options, Some(metrics)).await?;
    eprintln!(
        "serving {model_name} on http://{}/v1 (SIGTERM or Ctrl-C stops)",
        server.local_addr()?
    );
    let report = server.run(engine, shutdown_signal()).await?;
    eprintln!(
        "stopped: {}",
        if report.drained {
            "every in-flight request finished"
        } else {
            "requests still running at the grace period's end were aborted"
        }
    );
    Ok(())
}

async fn run(cli: JobArgs) -> anyhow::Result<()> {
    let node = load_node(cli.topology.as_ref())?;
    let _metrics = match node.metrics.prometheus_listen {
        Some(addr) => Some(prometheus::serve(prometheus::install()?, addr).await?),
        None => None,
    };
    let input_path = cli.input.or_else(|| node.job.input_path.clone());
    let output_path = cli.output.or_else(|| node.job.output_path.clone());
    let input = match &input_path {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        None => sample_batch(),
    };
    let max_concurrent = node.scheduler.admission_queue_capacity as usize;
    let (config, model_name) = engine_config(node).await?;
    let options = JobOptions {
        model_name,
        max_concurrent,
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
