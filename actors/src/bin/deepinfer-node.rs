//! `deepinfer-node`: runs an offline job (OpenAI Batch JSONL) on the topology's model, or a
//! built-in sample batch when no input is given; `serve` serves the OpenAI API over HTTP; with
//! `--simulate`, the topology's control plane on simulated devices; `logits`, `eplb-plan` and
//! `memory-plan` are operator tools. The logic lives in
//! `deepinfer_actors::{job, server, sim, tools}`; this file parses arguments and prints.

use std::collections::HashSet;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use deepinfer_actors::job::{JobOptions, OutputOrder, count_lines, run_job, sample_batch};
use deepinfer_actors::openai::ServedModel;
use deepinfer_actors::server::{ServeOptions, Server};
use deepinfer_actors::sim::{self, Kernels, SimSettings};
use deepinfer_actors::tools::{eplb_plan, logits, memory_plan};
use deepinfer_actors::{Engine, EngineConfig, gpu, model_source, prometheus};
use deepinfer_topology::eplb::PlacementShape;
use deepinfer_topology::{ModelSource, NodeConfig, parse_listen_address};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Offline inference for DeepSeek-V4.1-Flash and the V4-Flash family: runs an OpenAI Batch
/// JSONL job (a sample batch when no input is given) on the topology's model and streams one
/// result line per input line; `serve` answers the same requests over HTTP; `logits`,
/// `eplb-plan` and `memory-plan` are operator tools.
#[derive(Parser, Debug)]
#[command(
    name = "deepinfer-node",
    version,
    args_conflicts_with_subcommands = true
)]
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
    /// Output JSONL (one line per input line, each written and flushed as it finishes).
    /// Default: the topology's `[job] output_path`, else stdout.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Keep the output file and skip the input lines whose `custom_id` it already holds
    /// (continue an interrupted job).
    #[arg(long)]
    resume: bool,
    /// Output line order: `input` (a bounded reorder buffer holds lines that finish early) or
    /// `completion` (as lines finish).
    #[arg(long, value_enum, default_value_t = Order::Input)]
    order: Order,
    /// After SIGINT/SIGTERM, seconds the requests in flight may still finish before they are
    /// aborted.
    #[arg(long, default_value_t = 30, value_name = "SECS")]
    drain_secs: u64,
    /// After the job, keep serving the Prometheus metrics this long (final values can be
    /// scraped; SIGINT/SIGTERM ends it early). Needs `[metrics] prometheus_listen`.
    #[arg(long, default_value_t = 0, value_name = "SECS")]
    metrics_linger: u64,
    #[command(flatten)]
    simulation: SimArgs,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    Input,
    Completion,
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
    /// Speed of the simulated kernels: this engine's fast kernels as measured (on an H100, their
    /// fractions of the peaks), or at the roofline.
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
    /// Serves the OpenAI API over HTTP (chat/completions and completions with SSE streaming,
    /// models, health, readiness, metrics) until SIGTERM or SIGINT.
    Serve(ServeArgs),
    /// Writes the fp32 logits at every input position (tensor `logits`, [tokens, vocab]) when
    /// the tokens are fed through the per-sequence state in the given chunk sizes.
    Logits(LogitsArgs),
    /// Plans an expert placement with DeepSeek's EPLB and prints
    /// `{"phy2log", "log2phy", "logcnt"}` as JSON.
    EplbPlan(EplbPlanArgs),
    /// Prints how the model's sequence states fit the topology (no GPU needed): bytes per token
    /// by layer kind, weights per GPU, each DP rank's state budget, the longest context and the
    /// sequences of given lengths that fit at once.
    MemoryPlan(MemoryPlanArgs),
}

#[derive(Args, Debug)]
struct MemoryPlanArgs {
    /// Topology file.
    #[arg(long)]
    topology: PathBuf,
    /// The checkpoint's config.json; default: the one in the topology's local checkpoint
    /// directory.
    #[arg(long)]
    model_config: Option<PathBuf>,
    /// Context lengths (tokens, comma-separated) to count concurrent sequences for.
    #[arg(long, default_value = "8192,32768,131072")]
    contexts: String,
    /// Memory of one GPU (GiB); default: 140 with sm90 (H200), 179 with sm100 (B200).
    #[arg(long)]
    gpu_memory_gib: Option<f64>,
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
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    let result = match cli.tool {
        Some(Tool::Serve(args)) => block_on(run_serve(args)),
        Some(Tool::Logits(args)) => run_logits(args),
        Some(Tool::EplbPlan(args)) => run_eplb_plan(args),
        Some(Tool::MemoryPlan(args)) => run_memory_plan(args),
        None => block_on(run(cli.job)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`deepinfer-node eplb-plan ... | head`) ends the output quietly.
        Err(error) if is_broken_pipe(&error) => ExitCode::SUCCESS,
        Err(error) => {
            // One line: what failed and where.
            eprintln!("error: {error:#}");
            match error.downcast_ref::<Interrupted>() {
                Some(interrupted) => ExitCode::from(interrupted.exit_code),
                None => ExitCode::FAILURE,
            }
        }
    }
}

fn block_on(work: impl Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(work)
}

fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn run_memory_plan(args: MemoryPlanArgs) -> anyhow::Result<()> {
    let node = NodeConfig::from_file(&args.topology)?;
    let cfg = match (&args.model_config, &node.model.source) {
        (Some(path), _) => deepinfer_model::config::ModelConfig::from_file(path)?,
        (None, ModelSource::LocalDir(dir)) => {
            deepinfer_model::config::ModelConfig::from_file(&dir.join("config.json"))?
        }
        (None, source) => anyhow::bail!(
            "{}: the model is {source:?}; give its config.json with --model-config \
             (tests/data/*.config.json hold the released ones)",
            node.origin
        ),
    };
    let contexts = args
        .contexts
        .split(',')
        .map(|t| {
            t.trim()
                .parse::<usize>()
                .with_context(|| format!("--contexts: {t:?} is not a token count"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let gpu_memory = args
        .gpu_memory_gib
        .map(|gib| (gib * (1u64 << 30) as f64) as u64);
    let dp = usize::from(node.parallel.dp);
    let plan = memory_plan::plan(&node, &cfg, gpu_memory, &contexts, || {
        use deepinfer_actors::rank::memory::{HostMemory, StateMemory};
        deepinfer_actors::scheduler::pool::rank_budgets(
            node.memory,
            &vec![StateMemory::Host; dp],
            &HostMemory,
        )
        .map_err(|e| e.to_string())
        .map(|budgets| budgets.first().map_or(0, |budget| budget.bytes))
    })
    .map_err(anyhow::Error::msg)?;
    print!("{plan}");
    Ok(())
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
    writeln!(std::io::stdout().lock(), "{plan}")?;
    Ok(())
}

/// Where the job's lines go, checked and opened before the model loads.
enum Sink {
    File(PathBuf, std::io::BufWriter<std::fs::File>),
    Stdout,
    /// The sample batch, printed human-readable at the end.
    Sample(Vec<u8>),
}

/// The `custom_id`s of an existing output file (`--resume`); a last line cut off by a kill is
/// dropped from the file.
fn done_ids(path: &std::path::Path) -> anyhow::Result<HashSet<String>> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashSet::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let complete = text.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    if complete < text.len() {
        let file = std::fs::OpenOptions::new().write(true).open(path)?;
        file.set_len(complete as u64)
            .with_context(|| format!("truncating the cut-off last line of {}", path.display()))?;
    }
    let mut ids = HashSet::new();
    for (i, line) in text[..complete].split(|b| *b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_slice(line).with_context(|| {
            format!("{} line {} is not a job output line", path.display(), i + 1)
        })?;
        if let Some(id) = value["custom_id"].as_str() {
            ids.insert(id.to_string());
        }
    }
    Ok(ids)
}

/// Opens the output: never the input, in a directory that exists and is writable.
fn open_output(
    path: &std::path::Path,
    input: Option<&std::path::Path>,
    resume: bool,
) -> anyhow::Result<std::fs::File> {
    if let Some(input) = input {
        let same = match (std::fs::canonicalize(path), std::fs::canonicalize(input)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if same {
            anyhow::bail!(
                "--output {} is the input file; it would be overwritten",
                path.display()
            );
        }
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(resume)
        .write(true)
        .truncate(!resume)
        .open(path)
        .with_context(|| format!("cannot write the output {}", path.display()))
}

/// Turns true on the first SIGINT or SIGTERM; the signal's exit code is kept in `signal`.
fn stop_on_signals(signal: Arc<std::sync::atomic::AtomicU8>) -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        #[cfg(unix)]
        let terminate = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut term) => {
                    term.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let terminate = std::future::pending::<()>();
        let code = tokio::select! {
            _ = tokio::signal::ctrl_c() => 130,
            () = terminate => 143,
        };
        signal.store(code, std::sync::atomic::Ordering::SeqCst);
        let _ = tx.send(true);
    });
    rx
}

/// The job stopped by a signal before every line was done.
#[derive(Debug)]
struct Interrupted {
    exit_code: u8,
    not_done: usize,
    lines: usize,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let signal = if self.exit_code == 130 {
            "SIGINT"
        } else {
            "SIGTERM"
        };
        write!(
            f,
            "interrupted by {signal}: {} of {} lines were not done (finished lines are in the \
             output; rerun with --resume to complete it)",
            self.not_done, self.lines
        )
    }
}

impl std::error::Error for Interrupted {}

/// The topology (the file, or the embedded default), with its `DEEPINFER__` overrides.
fn load_node(topology: Option<&PathBuf>) -> anyhow::Result<NodeConfig> {
    Ok(match topology {
        Some(path) => NodeConfig::from_file_with_env(path)?,
        None => NodeConfig::embedded_default_with_env()?,
    })
}

/// Resolves the topology's model (downloading it when needed) into an engine configuration
/// and the model it serves (the name, context and thinking default both front ends report).
async fn engine_config(node: NodeConfig) -> anyhow::Result<(EngineConfig, ServedModel)> {
    let resolve_node = node.clone();
    let model = tokio::task::spawn_blocking(move || model_source::resolve(&resolve_node)).await??;
    if let Some(notice) = &model.notice {
        eprintln!("{notice}");
    }
    Ok(model.engine_config(node))
}

async fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let node = load_node(args.topology.as_ref())?;
    // The GPUs a CUDA topology needs, counted for real (none without a driver or `cuda`).
    gpu::check_node(&node)?;
    let metrics = prometheus::install()?;
    let _exporter = match node.metrics.prometheus_listen {
        Some(addr) => Some(prometheus::serve(metrics.clone(), addr).await?),
        None => None,
    };
    let server_config = node.server;
    let (config, served) = engine_config(node).await?;
    let engine = Engine::start(config).await?;
    let name = served.name.clone();
    let options = ServeOptions {
        listen: args.listen.unwrap_or(server_config.listen),
        max_body_bytes: server_config.max_body_bytes as usize,
        shutdown_timeout: Duration::from_secs(u64::from(server_config.shutdown_timeout_seconds)),
        served,
    };
    let server = Server::bind(&engine, options, Some(metrics)).await?;
    eprintln!(
        "serving {name} on http://{}/v1 (SIGTERM or Ctrl-C stops)",
        server.local_addr()?
    );
    let mut stop = stop_on_signals(Arc::default());
    let signalled = async move {
        let _ = stop.wait_for(|stopped| *stopped).await;
    };
    let report = server.run(engine, signalled).await?;
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
    if cli.simulation.simulate {
        return run_simulation(node, &cli.simulation).await;
    }
    if cli.metrics_linger > 0 && node.metrics.prometheus_listen.is_none() {
        anyhow::bail!(
            "--metrics-linger needs a metrics endpoint: set [metrics] prometheus_listen in the \
             topology (or DEEPINFER__METRICS__PROMETHEUS_LISTEN)"
        );
    }
    // Input and output are checked before anything slow (GPUs, model).
    let input_path = cli.input.or_else(|| node.job.input_path.clone());
    let output_path = cli.output.or_else(|| node.job.output_path.clone());
    let input = match &input_path {
        Some(path) => std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
        None => sample_batch().into_bytes(),
    };
    if cli.resume && output_path.is_none() {
        anyhow::bail!("--resume needs an output file (--output or [job] output_path)");
    }
    let done = match (&output_path, cli.resume) {
        (Some(path), true) => done_ids(path)?,
        _ => HashSet::new(),
    };
    let mut sink = match &output_path {
        Some(path) => Sink::File(
            path.clone(),
            std::io::BufWriter::new(open_output(path, input_path.as_deref(), cli.resume)?),
        ),
        None if input_path.is_some() => Sink::Stdout,
        None => Sink::Sample(Vec::new()),
    };
    // The GPUs a CUDA topology needs, counted for real (none without a driver or `cuda`).
    gpu::check_node(&node)?;
    let metrics = match node.metrics.prometheus_listen {
        Some(addr) => Some(prometheus::serve(prometheus::install()?, addr).await?),
        None => None,
    };
    let max_concurrent = node.scheduler.admission_queue_capacity as usize;
    let (config, served) = engine_config(node).await?;
    let options = JobOptions {
        order: match cli.order {
            Order::Input => OutputOrder::Input,
            Order::Completion => OutputOrder::Completion,
        },
        done,
        drain: Duration::from_secs(cli.drain_secs),
        ..JobOptions::new(served, max_concurrent)
    };
    let engine = Engine::start(config).await?;

    let lines = count_lines(&input) as u64;
    let progress = ProgressBar::with_draw_target(Some(lines), ProgressDrawTarget::stderr());
    if !std::io::stderr().is_terminal() {
        progress.set_draw_target(ProgressDrawTarget::hidden());
    }
    progress.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} requests {elapsed_precise} eta {eta}",
    )?);
    let tick = progress.clone();
    let on_done: Arc<dyn Fn() + Send + Sync> = Arc::new(move || tick.inc(1));
    let signal = Arc::new(std::sync::atomic::AtomicU8::new(0));
    let stop = stop_on_signals(signal.clone());

    let handle = engine.handle();
    let summary = match &mut sink {
        Sink::File(path, file) => run_job(&handle, &input, &options, file, on_done, stop.clone())
            .await
            .with_context(|| format!("writing {}", path.display()))?,
        Sink::Stdout => {
            let mut stdout = std::io::stdout().lock();
            run_job(
                &handle,
                &input,
                &options,
                &mut stdout,
                on_done,
                stop.clone(),
            )
            .await?
        }
        Sink::Sample(buffer) => {
            run_job(&handle, &input, &options, buffer, on_done, stop.clone()).await?
        }
    };
    progress.finish_and_clear();
    engine.shutdown(Duration::from_secs(30)).await?;
    if let Sink::Sample(buffer) = &sink {
        print_sample(buffer)?;
    }
    let skipped = if summary.skipped > 0 {
        format!(", {} already done", summary.skipped)
    } else {
        String::new()
    };
    eprintln!(
        "{} requests: {} succeeded, {} failed{skipped}",
        summary.lines, summary.succeeded, summary.failed
    );
    let stopped = *stop.borrow();
    if let (Some(server), false) = (&metrics, stopped) {
        linger(server, Duration::from_secs(cli.metrics_linger), stop).await;
    }
    if summary.not_done > 0 {
        return Err(Interrupted {
            exit_code: signal.load(std::sync::atomic::Ordering::SeqCst).max(1),
            not_done: summary.not_done,
            lines: summary.lines,
        }
        .into());
    }
    Ok(())
}

/// Keeps the metrics endpoint up for `time` after the job, or until a signal.
async fn linger(
    server: &prometheus::MetricsServer,
    time: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    if time.is_zero() {
        return;
    }
    eprintln!(
        "serving the final metrics on http://{}/metrics for {} s (SIGINT/SIGTERM ends it)",
        server.addr,
        time.as_secs()
    );
    let _ = tokio::time::timeout(time, stop.wait_for(|stopped| *stopped)).await;
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
