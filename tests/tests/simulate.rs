//! `deepinfer-node --simulate`: the real actor tree of a topology on simulated devices. The report
//! of a run keeps its invariants (every request and token accounted for, no rank empty while
//! another queues, DSpark's counters ordered), and the EPLB lowers a skewed routing's imbalance.

use std::path::PathBuf;

use deepinfer_actors::sim::report::SimReport;
use deepinfer_actors::sim::trace::{self, TraceShape};
use deepinfer_actors::sim::{self, SimSettings};
use deepinfer_topology::NodeConfig;

fn sm100x64() -> NodeConfig {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/sm100x64.toml");
    NodeConfig::from_file(&path).expect("configs/sm100x64.toml parses")
}

/// Conservation of requests and tokens, and the report's own consistency.
fn check_accounting(report: &SimReport, trace: &[trace::TraceRequest]) {
    assert_eq!(report.submitted, trace.len(), "{report}");
    assert_eq!(report.completed, trace.len(), "{report}");
    assert_eq!(report.failed, 0, "{report}");
    let prompt: u64 = trace.iter().map(|r| u64::from(r.prompt_tokens)).sum();
    let output: u64 = trace.iter().map(|r| u64::from(r.output_tokens)).sum();
    assert_eq!(report.prompt_tokens, prompt);
    assert_eq!(report.expected_output_tokens, output);
    assert_eq!(report.output_tokens, output, "every asked token delivered");
    assert_eq!(
        report.timed_output_tokens, output,
        "the devices timed every delivered token"
    );
    assert_eq!(report.untimed, 0);
    assert_eq!(report.ttft.count, trace.len());
    assert!(report.ttft.p50 > 0.0 && report.ttft.p50 <= report.ttft.max);
    assert!(report.itl.p50 > 0.0, "{report}");
    assert!(report.span_s > 0.0 && report.steps > 0);
    let per_gpu = output as f64 / report.span_s / report.gpus as f64;
    assert!((report.output_tok_s_per_gpu() - per_gpu).abs() < 1e-6 * per_gpu);
    assert_eq!(report.utilisation.len(), report.gpus);
    assert!(
        report.utilisation.iter().all(|&u| u > 0.0 && u <= 1.0),
        "{:?}",
        report.utilisation
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sm100x64_default_trace_keeps_the_report_invariants() {
    let node = sm100x64();
    let model = sim::model_config(&node).expect("the shipped V4.1-Flash config");
    assert_eq!(model.n_routed_experts, 384);
    let trace = sim::default_trace(&node);
    let report = sim::simulate(node, model, SimSettings::new(trace.clone()))
        .await
        .expect("simulates");
    println!("{report}");
    assert_eq!(report.gpus, 64);
    assert_eq!(report.device, "B200");
    check_accounting(&report, &trace);
    assert!(report.queues.samples > 0);
    assert_eq!(report.queues.idle_while_queued, 0, "{report}");
    let d = report.dspark;
    assert!(d.verify_entries > 0 && d.accepted > 0, "{report}");
    assert!(
        d.accepted <= d.verified && d.verified <= d.proposed,
        "{d:?}"
    );
    let eplb = report
        .eplb
        .as_ref()
        .expect("sm100x64 runs expert parallelism");
    assert!(
        eplb.measured_before > 1.5,
        "a 0.6 Zipf routing is skewed: {eplb:?}"
    );
    assert!(eplb.planned_after < eplb.measured_before - 0.5, "{eplb:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_rebalances_lower_the_modelled_imbalance_under_queueing() {
    // One node of 8 sm100 GPUs, 4 running requests per rank, the EPLB every 8 steps.
    let node = NodeConfig::from_toml_str(
        "[model]\nsource = \"deepseek-ai/DeepSeek-V4.1-Flash-1017\"\n\
         [device]\nbackend = \"cuda\"\narch = \"sm100\"\nnodes = 1\ngpus_per_node = 8\n\
         [parallel]\ndp = 8\nep = 8\n\
         [scheduler]\nmax_batched_tokens = 512\nmax_running_requests = 4\nprefill_chunk_tokens = 256\n\
         [eplb]\nenabled = true\nwindow_steps = 4\nrebalance_interval_steps = 8\nredundant_experts = 16\n",
        "simulate test",
    )
    .expect("topology");
    let model = sim::model_config(&node).expect("config");
    let trace = trace::generate(&TraceShape {
        requests: 96,
        rate_per_s: f64::INFINITY,
        prompt_tokens: (32, 96),
        output_tokens: (24, 24),
        prefixes: 0,
        seed: 5,
    });
    let settings = SimSettings {
        routing_skew: 1.0,
        ..SimSettings::new(trace.clone())
    };
    let report = sim::simulate(node, model, settings)
        .await
        .expect("simulates");
    println!("{report}");
    check_accounting(&report, &trace);
    assert_eq!(report.queues.idle_while_queued, 0, "{report}");
    let eplb = report.eplb.as_ref().expect("EPLB on");
    assert!(eplb.automatic_rebalances >= 1, "{eplb:?}");
    let (first, last) = (eplb.epochs[0], eplb.epochs[eplb.epochs.len() - 1]);
    assert_eq!(first.0, 0);
    assert!(last.0 > 0, "steps ran on a rebalanced placement: {eplb:?}");
    assert!(
        last.2 < first.2 - 0.5,
        "rebalancing lowers the modelled imbalance: {eplb:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_simulation_inputs_are_refused_naming_what() {
    let node = sm100x64();
    let model = sim::model_config(&node).expect("config");
    let trace = sim::default_trace(&node);
    let settings = SimSettings {
        accept_rate: 1.5,
        ..SimSettings::new(trace)
    };
    let error = sim::simulate(node, model, settings)
        .await
        .unwrap_err()
        .to_string();
    assert!(error.starts_with("--accept-rate"), "{error}");
    let cpu = NodeConfig::from_toml_str(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n",
        "cpu",
    )
    .expect("topology");
    let error = sim::model_config(&cpu).unwrap_err().to_string();
    assert!(error.starts_with("model.source"), "{error}");
}
