//! An engine on the demo model (tiny V4.1 architecture, the real DeepSeek tokenizer, seeded
//! random weights) for test binaries that need real text.

#![allow(dead_code)]

use deepinfer_actors::openai::ServedModel;
use deepinfer_actors::{Engine, model_source};
use deepinfer_topology::NodeConfig;

/// Starts an engine on the demo model with the topology `toml` (`origin` names it in errors);
/// also the model as the front ends serve it. Keep the directory alive while the engine runs.
pub async fn start_demo_engine(
    toml: &str,
    origin: &str,
) -> (Engine, ServedModel, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().to_path_buf();
    let model = tokio::task::spawn_blocking(move || model_source::build_demo(&path))
        .await
        .expect("demo build task")
        .expect("the demo model builds");
    let node = NodeConfig::from_toml_str(toml, origin).expect("node config");
    let (config, served) = model.engine_config(node);
    (
        Engine::start(config).await.expect("engine starts"),
        served,
        dir,
    )
}
