//! DSpark speculative decoding: the confidence-scheduled choice of verification lengths.
pub mod schedule;
