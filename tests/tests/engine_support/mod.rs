//! Shared by the engine-level tests: submit token prompts and collect every output.

use std::time::Duration;

use deepinfer_actors::{Engine, GenerateRequest};

/// Submits every prompt (`max_tokens` each, EOS ignored, `temperature` with seed `seed`; 0 =
/// greedy) and returns the outputs in order, each within `timeout`.
pub async fn generate_all(
    engine: &Engine,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    (temperature, seed): (f32, u64),
    timeout: Duration,
) -> Vec<Vec<u32>> {
    let mut streams = Vec::new();
    for prompt in prompts {
        let request = GenerateRequest::from_tokens(prompt.clone())
            .max_tokens(max_tokens)
            .ignore_eos(true)
            .temperature(temperature)
            .seed(seed);
        streams.push(engine.generate(request).await.expect("admitted"));
    }
    let mut outputs = Vec::new();
    for stream in streams {
        let done = tokio::time::timeout(timeout, stream.collect())
            .await
            .expect("finishes in time")
            .expect("completes");
        outputs.push(done.tokens);
    }
    outputs
}
