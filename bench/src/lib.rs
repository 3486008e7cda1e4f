//! deepinfer-bench: shared helpers for the criterion benches and the device benchmark binary:
//! the step cost model (`cost`, which lives in the model crate so the simulated devices of
//! `deepinfer-node --simulate` use the same formulas), the real-width one-block V4.1 and V4
//! models (`block`) and the whole-step timing harness (`steps`).

pub use deepinfer_model::cost;
pub mod block;
pub mod steps;

#[cfg(test)]
mod cost_tests;
