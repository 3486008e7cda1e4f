//! `deepinfer-node`: runs an offline job (OpenAI Batch JSONL) on the topology's model, or a
//! built-in sample batch when no input is given; with `--simulate`, the topology's control plane
//! on simulated devices; `logits` and `eplb-plan` are operator tools.
//! The logic lives in `deepinfer_actors::{job, sim, tools}`; this file parses arguments and prints.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use deepinfer_actors::job::{JobOptions, run_job, sample_batch};
use deepinfer_actors::sim::{self, Kernels, SimSettings};
use deepinfer_actors::tools::{eplb_plan, logits};
use deepinfer_actors::{Engine, EngineConfig, gpu, model_source, prometheus};
use deepinfer_topology::NodeConfig;
use deepinfer_topology::eplb::PlacementShape;
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
    #[command(flatten)]
    simulation: SimArgs,
}

/// `--simulate`: the topology's actors on simulated GPUs (virtual time, no GPU, no weights).
#[derive(Args, Debug)]
struct SimArgs {
    /// Run the topology's control plane against simulated devices and print a report.
    #[arg(long)]
    simulate: bool,
    /// Trace JSONL (`arrival_s`, `prompt_tokens`, `output_tokens`, optional `prefix_id` per
    /// line). Default: 4 requests per DP rank over about a virtual second.
    #[arg(long, requires = "simulate")]
    trace: Option<PathBuf>,
    /// Zipf exponent of the routed experts' popularity (0 = uniform).
    #[arg(long, requires = "simulate", default_value_t = 0.6)]
    routing_skew: f64,
    /// Probability that a DSpark draft continues the chain, given its predecessors did.
    #[arg(long, requires = "simulate", default_value_t = 0.7)]
    accept_rate: f64,
    /// Speed of the simulated kernels: as measured on the H200, or at the roofline.
    #[arg(long, requires = "simulate", value_enum, default_value_t = SimKernels::Measured)]
    kernels: SimKernels,
    /// Seed of the routing shuffle and the drafts' acceptance.
    #[arg(long, requires = "simulate", default_value_t = 0)]
    seed: u64,
    /// GPUs per NVLink domain (default: `[device] gpus_per_node`; 64 for an NVL72-style rack).
    #[arg(long, requires = "simulate")]
    scale_up_gpus: Option<usize>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum SimKernels {
    Measured,
    Roofline,
}

#[derive(Subcommand, Debug)]
enum Tool {
    /// Writes the fp32 logits at every input position (tensor `logits`, [tokens, vocab]) when
    /// the tokens are fed through the per-sequence state in the given chunk sizes.
    Logits(LogitsArgs),
    /// Plans an expert placement with DeepSeek's EPLB and prints
    /// `{"phy2log", "log2phy", "logcnt"}` as JSON.
    EplbPlan(EplbPlanArgs),
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
        Some(Tool::Logits(args)) => run_logits(args),
        Some(Tool::EplbPlan(args)) => run_eplb_plan(args),
        None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|runtime| runtime.block_on(run(cli.job))),
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

async fn run(cli: JobArgs) -> anyhow::Result<()> {
    let node = match &cli.topology {
        Some(path) => NodeConfig::from_file_with_env(path)?,
        None => NodeConfig::embedded_default()?,
    };
    if cli.simulation.simulate {
        return run_simulation(node, &cli.simulation).await;
    }
    // The GPUs a CUDA topology needs, counted for real (none without a driver or `cuda`).
    gpu::check_node(&node)?;
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

/// `--simulate`: no GPU is counted and no weight loaded; the report goes to stdout.
async fn run_simulation(node: NodeConfig, args: &SimArgs) -> anyhow::Result<()> {
    let model = sim::model_config(&node)?;
    let trace = match &args.trace {
        Some(path) => sim::trace::read_trace(path)?,
        None => sim::default_trace(&node),
    };
    let settings = SimSettings {
        routing_skew: args.routing_skew,
        accept_rate: args.accept_rate,
        kernels: match args.kernels {
            SimKernels::Measured => Kernels::Measured,
            SimKernels::Roofline => Kernels::Roofline,
        },
        seed: args.seed,
        scale_up_gpus: args.scale_up_gpus,
        ..SimSettings::new(trace)
    };
    let report = sim::simulate(node, model, settings).await?;
    println!("{report}");
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
