//! deepinfer-model: the DeepSeek model math, synchronous and side-effect free. It owns
//! `config.json` parsing, checkpoint loading (sharded safetensors, FP8/FP4 formats, Engram
//! tables), the per-sequence state, sampling math and the CPU reference backend. No tokio, no
//! ractor, no metrics.

pub mod error;
pub mod expert_dispatch;
pub mod expert_exchange;
pub mod memory_plan;
pub mod quant;
pub mod sampling;
pub mod state_bytes;
pub mod weights;

pub mod any_model;
pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod cost;
pub mod engram;
mod layers;
pub mod v4;
pub mod v41;

pub use layers::loaded::Loaded;
pub use layers::step::StepOptions;
pub use v41::{
    DraftProposal, EntryOutput, ForwardTrace, Injection, LogitsRow, LogitsWanted, Model,
    PrefixBlock, SequenceState, StepEntry,
};
