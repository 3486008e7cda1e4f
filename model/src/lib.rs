//! deepinfer-model: the DeepSeek model math, synchronous and side-effect free. It owns
//! `config.json` parsing, checkpoint loading (sharded safetensors, FP8/FP4 formats, Engram
//! tables), the per-sequence state, sampling math and the CPU reference backend. No tokio, no
//! ractor, no metrics.
