//! Embedding deepinfer in a Rust application: start an engine on the caller's tokio runtime,
//! stream one generation, shut down. Runs on the embedded default (CPU backend, built-in demo
//! model with random weights): `cargo run --example embed -p deepinfer-actors`.

use std::time::Duration;

use deepinfer_actors::{Engine, EngineConfig, GenerateRequest, GenerationEvent, model_source};
use deepinfer_topology::NodeConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // configs/local.toml: CPU reference backend, the demo model, one DP rank.
    let node = NodeConfig::embedded_default()?;
    // Loading a checkpoint is blocking work: keep it off the async workers.
    let model = tokio::task::spawn_blocking({
        let node = node.clone();
        move || model_source::resolve(&node)
    })
    .await??;
    let engine = Engine::start(EngineConfig {
        node,
        executor: model.factory,
        model: model.facts,
        tokenizer: Some(model.tokenizer),
    })
    .await?;

    let request = GenerateRequest::from_text("The capital of France is")
        .max_tokens(16)
        .temperature(0.7)
        .seed(7);
    let mut events = engine.generate(request).await?;
    while let Some(event) = events.next().await {
        match event {
            GenerationEvent::Token { text, .. } => print!("{text}"),
            GenerationEvent::Finished { reason, usage, .. } => {
                println!("\n[{reason:?}, {usage:?}]")
            }
            GenerationEvent::Error(error) => return Err(error.into()),
        }
    }
    engine.shutdown(Duration::from_secs(30)).await?;
    Ok(())
}
