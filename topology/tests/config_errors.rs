//! Bad topology text fails with an error that names the origin and the field.

use deepinfer_topology::{
    MemoryConfig, ModelDims, NodeConfig, PrefixCacheConfig, PrefixReplay, TopologyError,
};

const ORIGIN: &str = "configs/bad.toml";

fn error_of(text: &str) -> TopologyError {
    match NodeConfig::from_toml_str(text, ORIGIN) {
        Ok(config) => panic!("expected an error, got {config:?}"),
        Err(error) => error,
    }
}

/// Asserts the error blames `field` and its message names the origin and the field.
fn assert_blames(text: &str, field: &str, words: &str) {
    let error = error_of(text);
    let message = error.to_string();
    assert_eq!(error.field(), Some(field), "{message}");
    assert!(
        message.starts_with(&format!("{ORIGIN}: {field}")),
        "{message}"
    );
    assert!(message.contains(words), "{message} lacks {words:?}");
}

#[test]
fn dp_zero_is_rejected_with_the_field() {
    let error = error_of("[parallel]\ndp = 0\n");
    assert_eq!(
        error.to_string(),
        "configs/bad.toml: parallel.dp: must be >= 1, got 0"
    );
}

#[test]
fn unknown_key_is_rejected_with_its_section() {
    assert_blames("[parallel]\ndpp = 2\n", "parallel", "unknown field `dpp`");
    let top_level = error_of("[parallell]\ndp = 2\n").to_string();
    assert!(top_level.starts_with(ORIGIN), "{top_level}");
    assert!(
        top_level.contains("unknown field `parallell`"),
        "{top_level}"
    );
}

#[test]
fn wrong_type_names_the_key() {
    assert_blames(
        "[scheduler]\noverlap_depth = \"two\"\n",
        "scheduler.overlap_depth",
        "invalid",
    );
}

#[test]
fn syntax_error_names_the_file() {
    let message = error_of("[parallel\ndp = 1\n").to_string();
    assert!(message.starts_with(ORIGIN), "{message}");
    assert!(message.contains("not valid TOML"), "{message}");
}

#[test]
fn ep_must_divide_the_physical_experts() {
    assert_blames(
        "[model]\nrouted_experts = 384\n[parallel]\ndp = 5\nep = 5\n",
        "parallel.ep",
        "384 + eplb.redundant_experts 0 = 384",
    );
    assert_blames(
        "[model]\nrouted_experts = 384\n[parallel]\ndp = 64\n[eplb]\nredundant_experts = 1\n",
        "parallel.ep",
        "= 385",
    );
    // 384 + 64 = 448 = 7 x 64: fine.
    assert!(
        NodeConfig::from_toml_str(
            "[model]\nrouted_experts = 384\n[parallel]\ndp = 64\n[eplb]\nredundant_experts = 64\n",
            ORIGIN
        )
        .is_ok()
    );
}

#[test]
fn ep_is_also_checked_against_the_checkpoint_later() {
    let config = NodeConfig::from_toml_str("[parallel]\ndp = 5\n", ORIGIN).unwrap();
    let dims = ModelDims {
        routed_experts: 384,
        sliding_window_tokens: 128,
    };
    let error = config.check_model(&dims).unwrap_err();
    assert_eq!(error.field(), Some("parallel.ep"));
    let ok = NodeConfig::from_toml_str("[parallel]\ndp = 4\n", ORIGIN).unwrap();
    assert!(ok.check_model(&dims).is_ok());
    let stated = NodeConfig::from_toml_str("[model]\nrouted_experts = 256\n", ORIGIN).unwrap();
    assert_eq!(
        stated.check_model(&dims).unwrap_err().field(),
        Some("model.routed_experts")
    );
}

#[test]
fn non_loopback_metrics_address_is_rejected() {
    assert_blames(
        "[metrics]\nprometheus_listen = \"0.0.0.0:9400\"\n",
        "metrics.prometheus_listen",
        "not a loopback",
    );
    assert_blames(
        "[metrics]\nprometheus_listen = \"localhost\"\n",
        "metrics.prometheus_listen",
        "not an IP:port",
    );
    let ok = NodeConfig::from_toml_str("[metrics]\nprometheus_listen = \"[::1]:9400\"\n", ORIGIN);
    assert_eq!(
        ok.unwrap().metrics.prometheus_listen.map(|a| a.port()),
        Some(9400)
    );
}

#[test]
fn replay_keep_must_cover_window_plus_backtracking() {
    assert_blames(
        "[model]\nsliding_window_tokens = 128\n[replay]\ndecoder_keep_tokens = 133\n",
        "replay.decoder_keep_tokens",
        "128 + replay.max_backtracking 6 = 134",
    );
    let at_bound = "[model]\nsliding_window_tokens = 128\n[replay]\ndecoder_keep_tokens = 134\n";
    assert!(NodeConfig::from_toml_str(at_bound, ORIGIN).is_ok());
    let off = "[model]\nsliding_window_tokens = 128\n[replay]\ndecoder_keep_tokens = 0\n";
    assert_eq!(
        NodeConfig::from_toml_str(off, ORIGIN)
            .unwrap()
            .replay
            .decoder_keep_tokens,
        None
    );
}

#[test]
fn backtracking_must_cover_a_full_draft_rejection() {
    assert_blames(
        "[dspark]\nenabled = true\nmax_draft_tokens = 7\n",
        "replay.max_backtracking",
        "dspark.max_draft_tokens + 1 = 8",
    );
}

#[test]
fn cuda_ranks_must_match_the_gpus() {
    assert_blames(
        "[device]\nbackend = \"cuda\"\ngpus_per_node = 8\n[parallel]\ndp = 4\n",
        "parallel.dp",
        "multiple of device.nodes x device.gpus_per_node = 1 x 8 = 8",
    );
    assert_blames(
        "[device]\nbackend = \"cuda\"\ngpus_per_node = 2\n[parallel]\ndp = 4\nep = 2\n",
        "parallel.ep",
        "must equal parallel.dp = 4 with cuda (one EP rank per DP rank), got 2",
    );
    assert_blames(
        "[device]\nbackend = \"cpu\"\ngpus_per_node = 8\n",
        "device.gpus_per_node",
        "cuda",
    );
    assert_blames(
        "[device]\nbackend = \"tpu\"\n",
        "device.backend",
        "unknown backend \"tpu\", expected \"cpu\" or \"cuda\"",
    );
    assert_blames(
        "[device]\nbackend = \"cuda\"\narch = \"sm80\"\n",
        "device.arch",
        "sm80",
    );
}

#[test]
fn numerics_apply_to_cuda_only_and_default_to_fast() {
    use deepinfer_topology::{Arch, Backend, Numerics};
    let cuda = |numerics: &str| {
        NodeConfig::from_toml_str(
            &format!("[device]\nbackend = \"cuda\"\n{numerics}"),
            "numerics.toml",
        )
        .expect("valid")
        .device
        .backend
    };
    let with = |numerics| Backend::Cuda {
        arch: Arch::Sm90,
        numerics,
    };
    assert_eq!(cuda(""), with(Numerics::Fast));
    assert_eq!(cuda("numerics = \"fast\"\n"), with(Numerics::Fast));
    assert_eq!(cuda("numerics = \"exact\"\n"), with(Numerics::Exact));
    assert_blames(
        "[device]\nbackend = \"cuda\"\nnumerics = \"bf16\"\n",
        "device.numerics",
        "unknown numerics \"bf16\", expected \"fast\" or \"exact\"",
    );
    assert_blames(
        "[device]\nnumerics = \"exact\"\n",
        "device.numerics",
        "only applies with device.backend = \"cuda\"",
    );
}

#[test]
fn scheduler_bounds_are_enforced() {
    assert_blames(
        "[scheduler]\noverlap_depth = 0\n",
        "scheduler.overlap_depth",
        "1..=4, got 0",
    );
    assert_blames(
        "[scheduler]\nmax_batched_tokens = 64\nprefill_chunk_tokens = 128\nmax_running_requests = 8\n",
        "scheduler.prefill_chunk_tokens",
        "1..=64, got 128",
    );
}

#[test]
fn context_parallel_is_a_group_size_with_a_bounded_threshold() {
    // The old boolean form is refused, not read as a size.
    assert_blames(
        "[parallel]\ncontext_parallel = true\n",
        "parallel.context_parallel",
        "",
    );
    assert_blames(
        "[parallel]\ncontext_parallel = 0\n",
        "parallel.context_parallel",
        ">= 1, got 0",
    );
    // Where the KV exchange does not run yet: refused, never accepted and ignored.
    assert_blames(
        "[device]\nbackend = \"cuda\"\n[parallel]\ncontext_parallel = 2\n",
        "parallel.context_parallel",
        "CPU backend only",
    );
    assert_blames(
        "[scheduler]\nprefill_chunk_tokens = 64\n[parallel]\ncontext_parallel = 4\n\
         context_parallel_min_tokens = 7\n",
        "parallel.context_parallel_min_tokens",
        "8..=256, got 7",
    );
    // A threshold no step's token budget reaches would leave CP configured and never used.
    assert_blames(
        "[scheduler]\nmax_batched_tokens = 100\nmax_running_requests = 8\nprefill_chunk_tokens = 64\n\
         [parallel]\n\
         context_parallel = 2\ncontext_parallel_min_tokens = 120\n",
        "parallel.context_parallel_min_tokens",
        "4..=100, got 120",
    );
    assert_blames(
        "[parallel]\ncontext_parallel_min_tokens = 100\n",
        "parallel.context_parallel_min_tokens",
        "context parallelism is off",
    );
    let node = deepinfer_topology::NodeConfig::from_toml_str(
        "[scheduler]\nprefill_chunk_tokens = 64\n[parallel]\ncontext_parallel = 4\n",
        "cp",
    )
    .expect("a CPU CP topology");
    assert_eq!(
        node.parallel.context_parallel,
        Some(deepinfer_topology::ContextParallel {
            ranks: 4,
            min_tokens: 64
        })
    );
}

#[test]
fn model_source_forms_are_recognised() {
    use deepinfer_topology::ModelSource;
    let source = |s: &str| {
        NodeConfig::from_toml_str(&format!("[model]\nsource = {s:?}\n"), ORIGIN)
            .map(|c| c.model.source)
    };
    assert_eq!(source("demo").unwrap(), ModelSource::Demo);
    assert_eq!(
        source("./ckpt").unwrap(),
        ModelSource::LocalDir("./ckpt".into())
    );
    assert!(
        matches!(source("org/model").unwrap(), ModelSource::Hub { revision, .. } if revision == "main")
    );
    assert_eq!(
        source("not a model").unwrap_err().field(),
        Some("model.source")
    );
    assert_blames(
        "[model]\nsource = \"demo\"\nrevision = \"v1\"\n",
        "model.revision",
        "Hub id",
    );
}

#[test]
fn job_output_must_differ_from_input() {
    assert_blames(
        "[job]\ninput_path = \"a.jsonl\"\noutput_path = \"a.jsonl\"\n",
        "job.output_path",
        "differ",
    );
}

#[test]
fn environment_overrides_apply_and_are_validated() {
    let vars = [
        (
            "DEEPINFER__SCHEDULER__OVERLAP_DEPTH".to_owned(),
            "1".to_owned(),
        ),
        ("DEEPINFER_HF_MODEL_DIR".to_owned(), "/ignored".to_owned()),
    ];
    let config =
        NodeConfig::from_toml_str_with_env("[scheduler]\noverlap_depth = 2\n", ORIGIN, vars)
            .unwrap();
    assert_eq!(config.scheduler.overlap_depth, 1);
    assert!(!config.scheduler.is_async());
    assert!(
        config
            .origin
            .contains("DEEPINFER__SCHEDULER__OVERLAP_DEPTH")
    );
    let bad = [("DEEPINFER__PARALLEL__DP".to_owned(), "0".to_owned())];
    let error = NodeConfig::from_toml_str_with_env("", ORIGIN, bad).unwrap_err();
    assert_eq!(error.field(), Some("parallel.dp"));
}

#[test]
fn missing_file_names_the_path() {
    let error = NodeConfig::from_file("/nonexistent/topology.toml").unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("/nonexistent/topology.toml: cannot read")
    );
}

#[test]
fn lossy_values_are_rejected_not_coerced() {
    assert_blames("[parallel]\ndp = 1.5\n", "parallel.dp", "floating point");
    assert_blames("[parallel]\ndp = -1\n", "parallel.dp", "integer `-1`");
    assert_blames("[parallel]\ndp = 70000\n", "parallel.dp", "at most 16 bits");
    assert_blames("[parallel]\ndp = \"2\"\n", "parallel.dp", "string");
    assert_blames("[dspark]\nenabled = 1\n", "dspark.enabled", "true or false");
    assert_blames("[model]\nsource = 5\n", "model.source", "a string");
    let env = [(
        "DEEPINFER__DSPARK__MAX_DRAFT_TOKENS".to_owned(),
        "2.5".to_owned(),
    )];
    let error = NodeConfig::from_toml_str_with_env("", ORIGIN, env).unwrap_err();
    assert_eq!(error.field(), Some("dspark.max_draft_tokens"), "{error}");
}

#[test]
fn state_memory_budget_is_one_key_in_range() {
    assert_blames(
        "[memory]\nstate_memory_fraction = 1.5\n",
        "memory.state_memory_fraction",
        "must be in (0, 1], got 1.5",
    );
    assert_blames(
        "[memory]\nstate_memory_fraction = 0.0\n",
        "memory.state_memory_fraction",
        "got 0",
    );
    assert_blames(
        "[memory]\nstate_bytes_per_rank = 1000\nstate_memory_fraction = 0.5\n",
        "memory.state_memory_fraction",
        "not both",
    );
    assert_blames(
        "[memory]\nstate_bytes_per_rank = 0\n",
        "memory.state_bytes_per_rank",
        "must be >= 1",
    );
    let bytes = NodeConfig::from_toml_str("[memory]\nstate_bytes_per_rank = 4096\n", ORIGIN)
        .expect("valid");
    assert_eq!(bytes.memory, MemoryConfig::StateBytes(4096));
    let default = NodeConfig::from_toml_str("", ORIGIN).expect("valid");
    assert_eq!(default.memory, MemoryConfig::Fraction(0.9));
}

#[test]
fn prefix_cache_is_off_by_default_and_needs_bounded_replay() {
    let default = NodeConfig::from_toml_str("", ORIGIN)
        .expect("valid")
        .prefix_cache;
    assert_eq!(
        default,
        PrefixCacheConfig {
            bytes_per_rank: None,
            replay: PrefixReplay::Bounded
        }
    );
    let on = NodeConfig::from_toml_str(
        "[prefix_cache]\nbytes_per_rank = 4096\nreplay = \"exact\"\n",
        ORIGIN,
    )
    .expect("valid")
    .prefix_cache;
    assert_eq!(
        (on.bytes_per_rank, on.replay),
        (Some(4096), PrefixReplay::Exact)
    );
    let zero = NodeConfig::from_toml_str("[prefix_cache]\nbytes_per_rank = 0\n", ORIGIN);
    assert_eq!(zero.expect("valid").prefix_cache.bytes_per_rank, None);
    assert_blames(
        "[prefix_cache]\nbytes_per_rank = 4096\n[replay]\ndecoder_keep_tokens = 0\n",
        "prefix_cache.bytes_per_rank",
        "needs decoder bounded replay",
    );
    assert_blames(
        "[prefix_cache]\nreplay = \"halo\"\n",
        "prefix_cache.replay",
        "expected \"bounded\" or \"exact\"",
    );
    assert_blames(
        "[prefix_cache]\nbytes_per_rank = -1\n",
        "prefix_cache.bytes_per_rank",
        "integer `-1`",
    );
}

#[test]
fn server_section_defaults_and_errors_name_the_field() {
    let defaults = NodeConfig::from_toml_str("", ORIGIN).unwrap().server;
    assert_eq!(defaults.listen.to_string(), "127.0.0.1:8000");
    assert_eq!(
        (defaults.max_body_bytes, defaults.shutdown_timeout_seconds),
        (8 << 20, 30)
    );
    let set = NodeConfig::from_toml_str(
        "[server]\nlisten = \"[::1]:9000\"\nmax_body_bytes = 4096\nshutdown_timeout_seconds = 0\n",
        ORIGIN,
    )
    .unwrap()
    .server;
    assert_eq!(
        (
            set.listen.port(),
            set.max_body_bytes,
            set.shutdown_timeout_seconds
        ),
        (9000, 4096, 0)
    );
    assert_blames(
        "[server]\nlisten = \"localhost:8000\"\n",
        "server.listen",
        "not an IP:port",
    );
    assert_blames(
        "[server]\nmax_body_bytes = 10\n",
        "server.max_body_bytes",
        ">= 1024",
    );
}

/// A CUDA node of a deployment of one process per node needs its own node's GPUs only; one
/// process running every node (`--simulate`, no bootstrap) needs every node's; the shortage
/// names what this process needs.
#[test]
fn a_node_of_a_deployment_needs_its_own_gpus_only() {
    let two = "[device]\nbackend = \"cuda\"\nnodes = 2\ngpus_per_node = 4\n\
               [parallel]\ndp = 8\nep = 8\n";
    let all = NodeConfig::from_toml_str(two, ORIGIN).expect("one process runs both nodes");
    assert_eq!((all.gpu_count(), all.gpus_here()), (8, 8));
    assert!(all.can_run_here(4).is_err());
    let joined = format!("{two}[cluster]\nbootstrap = \"127.0.0.1:29500\"\nnode = 1\n");
    let node = NodeConfig::from_toml_str(&joined, ORIGIN).expect("node 1");
    assert_eq!((node.gpu_count(), node.gpus_here()), (8, 4));
    assert!(node.can_run_here(4).is_ok());
    let short = node.can_run_here(3).expect_err("3 of 4 GPUs").to_string();
    assert!(
        short.contains("needs 4 GPUs (1 node(s) x 4 GPUs per node), but only 3"),
        "{short}"
    );
}

/// `[cluster]`: a node of a deployment (`bootstrap` set) needs ranks that divide over the nodes
/// and a node index in range, and runs its share of the ranks; without `bootstrap` one process
/// runs every node (`--simulate`); timeouts in range; the defaults hold.
#[test]
fn cluster_keys_are_validated() {
    let two = "[device]\nnodes = 2\n[parallel]\ndp = 2\nep = 4\n";
    let all = NodeConfig::from_toml_str(two, ORIGIN).expect("one process runs both nodes");
    assert_eq!((all.dp_on_node(), all.ep_ranks_on_node()), (2, 0..4));
    let joined = format!("{two}[cluster]\nbootstrap = \"127.0.0.1:29500\"\n");
    let node = NodeConfig::from_toml_str(&format!("{joined}node = 1\n"), ORIGIN).expect("valid");
    assert_eq!(node.cluster.node, 1);
    assert_eq!(node.cluster.exchange_timeout.as_millis(), 30_000);
    assert_eq!(node.cluster.bootstrap_timeout.as_secs(), 600);
    assert_eq!(node.cluster.expert_listen.to_string(), "127.0.0.1:0");
    assert_eq!((node.dp_on_node(), node.ep_ranks_on_node()), (1, 2..4));
    assert_blames(
        &format!("{joined}node = 2\n"),
        "cluster.node",
        "below device.nodes = 2",
    );
    assert_blames(
        &format!("{joined}exchange_timeout_ms = 0\n"),
        "cluster.exchange_timeout_ms",
        "1..=3600000",
    );
    assert_blames(
        &format!("{two}[cluster]\nbootstrap = \"localhost\"\n"),
        "cluster.bootstrap",
        "not an IP:port",
    );
    assert_blames(
        "[device]\nnodes = 2\n[parallel]\ndp = 3\nep = 2\n[cluster]\nbootstrap = \"127.0.0.1:1\"\n",
        "parallel.dp",
        "do not divide over device.nodes = 2",
    );
    assert_blames(
        "[cluster]\nbootstrap = \"127.0.0.1:1\"\n",
        "cluster.bootstrap",
        "only applies with device.nodes > 1",
    );
}
