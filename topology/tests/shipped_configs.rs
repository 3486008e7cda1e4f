//! Every shipped `configs/*.toml` parses and validates; the template equals the defaults and
//! mentions every key; a few values of each shipped file are pinned.

use std::path::{Path, PathBuf};

use deepinfer_topology::raw::RawNodeConfig;
use deepinfer_topology::{Arch, Backend, ModelSource, NodeConfig, Numerics};

fn configs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

fn shipped_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(configs_dir())
        .expect("configs/ is readable")
        .map(|entry| entry.expect("configs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    files.sort();
    files
}

fn load(name: &str) -> NodeConfig {
    NodeConfig::from_file(configs_dir().join(name)).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn every_shipped_config_parses_and_validates() {
    let files = shipped_files();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for expected in [
        "config-template.toml",
        "h200x1.toml",
        "h200x2.toml",
        "h200x8.toml",
        "local.toml",
        "sm100x64.toml",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "missing {expected}: {names:?}"
        );
    }
    for file in files {
        if let Err(error) = NodeConfig::from_file(&file) {
            panic!("{error}");
        }
    }
}

#[test]
fn template_equals_the_defaults() {
    let template = load("config-template.toml");
    let empty = NodeConfig::from_toml_str("", "empty").expect("an empty file is valid");
    assert_eq!(
        NodeConfig {
            origin: String::new(),
            ..template
        },
        NodeConfig {
            origin: String::new(),
            ..empty.clone()
        }
    );
    assert_eq!(
        empty.model.source,
        ModelSource::Hub {
            repo_id: "deepseek-ai/DeepSeek-V4.1-Flash-1017".into(),
            revision: "main".into()
        }
    );
    assert_eq!(empty.scheduler.overlap_depth, 2);
    assert_eq!(empty.replay.decoder_keep_tokens, Some(140));
    assert_eq!(empty.replay.max_backtracking, 6);
    assert_eq!(empty.dspark.max_draft_tokens, 5);
}

#[test]
fn template_mentions_every_key() {
    let text = std::fs::read_to_string(configs_dir().join("config-template.toml")).unwrap();
    let shape = serde_json::to_value(RawNodeConfig::default()).unwrap();
    let sections = shape.as_object().unwrap();
    assert_eq!(sections.len(), 14);
    for (section, keys) in sections {
        assert!(
            text.contains(&format!("[{section}]")),
            "template lacks [{section}]"
        );
        for key in keys.as_object().unwrap().keys() {
            let set = format!("\n{key} = ");
            let commented = format!("\n# {key} = ");
            assert!(
                text.contains(&set) || text.contains(&commented),
                "template lacks {section}.{key}"
            );
        }
    }
}

#[test]
fn local_is_the_embedded_cpu_demo_default() {
    let local = load("local.toml");
    let embedded = NodeConfig::embedded_default().unwrap();
    assert_eq!(local.model, embedded.model);
    assert_eq!(local.scheduler, embedded.scheduler);
    assert_eq!(embedded.model.source, ModelSource::Demo);
    assert_eq!(embedded.device.backend, Backend::Cpu);
    assert_eq!((embedded.parallel.dp, embedded.parallel.ep), (1, 1));
    assert_eq!(embedded.scheduler.max_batched_tokens, 512);
    assert!(embedded.can_run_here(0).is_ok());
}

#[test]
fn h200_files_use_one_rank_per_gpu() {
    let one = load("h200x1.toml");
    assert_eq!(
        one.device.backend,
        Backend::Cuda {
            arch: Arch::Sm90,
            numerics: Numerics::Fast
        }
    );
    assert_eq!(one.gpu_count(), 1);
    let two = load("h200x2.toml");
    assert_eq!((two.parallel.dp, two.parallel.ep), (2, 2));
    // cuda: context parallelism waits for the device Comm's KV exchange.
    assert_eq!(two.parallel.context_parallel, None);
    assert!(two.can_run_here(2).is_ok());
    assert!(two.can_run_here(1).is_err());
}

#[test]
fn sm100x64_is_deepinfer_decode_benchmark() {
    let big = load("sm100x64.toml");
    assert_eq!(
        big.device.backend,
        Backend::Cuda {
            arch: Arch::Sm100,
            numerics: Numerics::Fast
        }
    );
    assert_eq!((big.device.nodes, big.device.gpus_per_node), (8, 8));
    assert_eq!((big.parallel.dp, big.parallel.ep), (64, 64));
    assert_eq!(big.physical_experts(384), 448);
    assert!(big.dspark.enabled);
    assert_eq!(big.dp_ranks().count(), 64);
    assert_eq!(
        big.ep_ranks().last().map(|r| r.to_string()).as_deref(),
        Some("ep63")
    );
    let error = big.can_run_here(8).unwrap_err().to_string();
    assert!(error.contains("sm100x64.toml"), "{error}");
    assert!(error.contains("needs 64 GPUs"), "{error}");
    assert!(error.contains("only 8 are available"), "{error}");
    assert!(big.can_run_here(64).is_ok());
}
