//! deepinfer-bench: shared helpers for the criterion benches and the device benchmark binary:
//! the step cost model (`cost`, which lives in the model crate so the simulated devices of
//! `deepinfer-node --simulate` use the same formulas), the real-width one-block V4.1 model
//! (`v41_block`) and the whole-step timing harness (`steps`).

pub use deepinfer_model::cost;
pub mod steps;
pub mod v41_block;

#[cfg(test)]
mod cost_tests;
