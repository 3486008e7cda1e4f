//! deepinfer-tests: shared harness for the cross-crate integration and golden tests.
