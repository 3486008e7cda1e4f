//! deepinfer-bench: shared helpers for the criterion benches and the device benchmark binary.
