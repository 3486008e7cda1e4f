//! Helpers shared by the actors crate's test binaries.

pub mod grammar_set;
