//! The operator tools of `deepinfer-node` besides the offline job: `logits` (the golden-test and
//! debugging entry point, ARCHITECTURE.md §5) and `eplb-plan` (offline expert placement).
//! Synchronous library functions; the binary only parses arguments and prints.

pub mod eplb_plan;
pub mod logits;
