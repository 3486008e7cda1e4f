//! What the model families share above the backend: the pieces V4 and V4.1 both run, so that
//! `v4/` and `v41/` hold only what differs: the loaded model ([`loaded`]), its side of expert
//! parallelism ([`expert_hook`]), the run context ([`ctx`]), the attention queries and
//! grouped output projection ([`attention`]), the shape of a step ([`step`]), the per-position
//! rings ([`ring`]), the mHC mixes ([`mhc`]), the MoE ([`moe`]), the drafters' Markov heads ([`markov`]), the prefix-cache blocks ([`prefix`]), the RoPE/YaRN
//! tables ([`rope`]) and the blocks' weight layout ([`weights`]).

pub(crate) mod attention;
pub(crate) mod ctx;
pub(crate) mod expert_hook;
pub(crate) mod loaded;
pub(crate) mod markov;
pub(crate) mod mhc;
pub(crate) mod moe;
pub(crate) mod prefix;
pub(crate) mod ring;
pub(crate) mod rope;
pub(crate) mod step;
pub(crate) mod weights;
