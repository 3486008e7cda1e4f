//! deepinfer-actors: the runtime. A ractor supervisor tree (frontend, one scheduler and one rank
//! per DP attention rank, expert groups, EPLB, DSpark, replay), the `Engine` embedding API and the
//! metrics. The only async crate of the workspace.
pub mod comm;
pub mod dspark;
pub mod engine;
pub mod engram_vocab;
pub mod eplb;
pub mod error;
pub mod experts;
pub mod frontend;
pub mod gpu;
pub mod grammar;
pub mod hub;
pub mod job;
pub mod messages;
pub mod metrics;
pub mod model_source;
pub mod openai;
pub mod prefix_cache;
pub mod prometheus;
pub mod rank;
pub mod replay;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod shell;
pub mod sim;
pub mod supervisor;
pub mod tools;

pub use engine::request::{GenerateRequest, Prompt};
pub use engine::stream::{
    Completion, EventStream, GenerationEvent, ReportedLogprobs, ReportedToken,
};
pub use engine::{Engine, EngineConfig, EngineHandle, ModelFacts};
pub use error::{EngineError, ValidationError};
pub use messages::request::{FinishReason, Usage};
pub use sampling::SamplingParams;
