//! What the model families share above the backend: the pieces V4 and V4.1 both run, so that
//! `v4/` and `v41/` hold only what differs. So far: the RoPE/YaRN tables ([`rope`]).

pub(crate) mod rope;
