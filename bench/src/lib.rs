//! deepinfer-bench: shared helpers for the criterion benches and the device benchmark binary:
//! the step cost model (`cost`), the real-width one-block V4.1 model (`v41_block`) and the
//! whole-step timing harness (`steps`).

pub mod cost;
pub mod steps;
pub mod v41_block;
