//! The weight types the [`Backend`] ops name, as plain data: a V4 projection in its stored format
//! ([`Linear`]) and the SwiGLU experts of an MoE layer ([`ExpertWeights`] of [`ExpertLinear`]).

use super::{Backend, DenseWeight, Tensor};
use crate::weights::{Fp4Weight, Fp8Weight};

/// A projection `[out, inp]` in its stored format, applied in fp32.
#[derive(Debug, Clone)]
pub enum Linear {
    /// BF16/F32 weights widened to f32, row-major.
    Dense {
        out: usize,
        inp: usize,
        values: Vec<f32>,
    },
    /// FP8 E4M3 with square UE8M0 tiles.
    Fp8(Fp8Weight),
    /// Packed FP4 E2M1 with 1×32 UE8M0 scales.
    Fp4(Fp4Weight),
}

impl Linear {
    /// `x [rows, inp] · Wᵀ` → `[rows, out]` in fp32 where `x` is ([`Backend::linear`]: the
    /// weight dequantised exactly, or a `fast` backend's tensor cores).
    pub fn apply(&self, backend: &dyn Backend, x: &Tensor) -> Tensor {
        backend.linear(x, self)
    }

    /// The weight as a plain [`DenseWeight`] when it is stored dense.
    pub fn dense(&self) -> Option<DenseWeight<'_>> {
        match self {
            Linear::Dense { out, inp, values } => Some(DenseWeight {
                values,
                out: *out,
                inp: *inp,
            }),
            Linear::Fp8(_) | Linear::Fp4(_) => None,
        }
    }
}

/// An expert projection: FP4 (V4.1 routed experts), FP8 (V4.1 shared expert, or routed when
/// `expert_dtype` says so) — both with FP8-quantised activations — or a V4 projection in any
/// stored format applied in exact fp32 (`Exact`).
#[derive(Debug, Clone)]
pub enum ExpertLinear {
    Fp4(Fp4Weight),
    Fp8(Fp8Weight),
    Exact(Linear),
}

/// One SwiGLU expert (`w1` gate, `w3` up, `w2` down).
#[derive(Debug, Clone)]
pub struct ExpertWeights<W> {
    pub w1: W,
    pub w2: W,
    pub w3: W,
}
