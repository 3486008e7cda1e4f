//! The actor protocols: one message enum per actor, separate from the actors themselves, so an
//! actor depends on its peers' protocols and not on their implementations (aesthetics.md §3.4).
//! Messages are owned data; large variants are boxed; step-scoped messages carry a `StepId`.

pub mod dspark;
pub mod eplb;
pub mod experts;
pub mod frontend;
pub mod rank;
pub mod replay;
pub mod request;
pub mod scheduler;
pub mod supervisor;
