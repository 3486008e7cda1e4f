//! The operator tools of `deepinfer-node` besides the offline job: `logits` (the golden-test and
//! debugging entry point, ARCHITECTURE.md §5), `eplb-plan` (offline expert placement) and
//! `memory-plan` (how the sequence states fit a topology).
//! Synchronous library functions; the binary only parses arguments and prints.

pub mod eplb_plan;
pub mod logits;
pub mod memory_plan;
