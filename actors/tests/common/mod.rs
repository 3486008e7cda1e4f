//! Helpers shared by the actors crate's test binaries.

pub mod demo_engine;
pub mod grammar_set;
