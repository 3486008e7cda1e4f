//! Expert weights for the CUDA backend's table-shape tests (`moe.rs`, `v4.rs`): zero-valued
//! projections of each format and the experts built from them.

use crate::backend::weights::{ExpertLinear, ExpertWeights, Linear};
use crate::weights::{Fp4Weight, Fp8Weight};

/// A dense (f32) exact projection `[out, inp]` of zeros.
pub(super) fn dense(out: usize, inp: usize) -> ExpertLinear {
    ExpertLinear::Exact(Linear::Dense {
        out,
        inp,
        values: vec![0.0; out * inp],
    })
}

/// An exact (V4) FP4 projection `[out, inp]` of zero codes at scale 1.
pub(super) fn fp4(out: usize, inp: usize) -> ExpertLinear {
    ExpertLinear::Exact(Linear::Fp4(Fp4Weight {
        out,
        inp,
        packed: vec![0; out * inp / 2],
        scales: vec![127; out * inp / 32],
    }))
}

/// An FP8 weight `[out, inp]` of zero codes at scale 1, in 32×32 tiles.
pub(super) fn fp8(out: usize, inp: usize) -> Fp8Weight {
    Fp8Weight {
        out,
        inp,
        block: 32,
        data: vec![0; out * inp],
        scales: vec![127; out.div_ceil(32) * inp.div_ceil(32)],
    }
}

/// The expert of projections `w1`, `w3` and `w2`.
pub(super) fn expert(
    w1: ExpertLinear,
    w3: ExpertLinear,
    w2: ExpertLinear,
) -> ExpertWeights<ExpertLinear> {
    ExpertWeights { w1, w2, w3 }
}

/// The expert of `dim → inter → dim` whose three projections `project(out, inp)` builds.
pub(super) fn uniform(
    project: impl Fn(usize, usize) -> ExpertLinear,
    dim: usize,
    inter: usize,
) -> ExpertWeights<ExpertLinear> {
    expert(
        project(inter, dim),
        project(inter, dim),
        project(dim, inter),
    )
}
