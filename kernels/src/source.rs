//! The CUDA C sources, embedded at build time, and the headers NVRTC is given by name (so
//! `#include "common/numerics.cuh"` resolves without touching the file system).

use crate::id::SourceFile;

/// The entry of [`HEADERS`] for the header `name` under `cuda/`: its include name and its text.
macro_rules! header {
    ($name:literal) => {
        ($name, include_str!(concat!("../cuda/", $name)))
    };
}

/// Project headers, as (include name, text). All are passed to every compilation.
pub const HEADERS: [(&str, &str); 26] = [
    header!("common/params.h"),
    header!("common/compile_time.cuh"),
    header!("common/grid_dependency.cuh"),
    header!("common/key_rows.cuh"),
    header!("common/numerics.cuh"),
    header!("quant/act_quant.cuh"),
    header!("gemm/gemm_block_scaled.cuh"),
    header!("gemm/wgmma.cuh"),
    header!("gemm/gemm_fast.cuh"),
    header!("norm/rms_norm.cuh"),
    header!("rope/rope.cuh"),
    header!("rope/rope_qdq.cuh"),
    header!("common/reference_math.cuh"),
    header!("quant/qdq.cuh"),
    header!("linear/linear_sgemm.cuh"),
    header!("linear/linear_fast.cuh"),
    header!("attention/sparse_attention.cuh"),
    header!("attention/sparse_attention_fast.cuh"),
    header!("mhc/mhc.cuh"),
    header!("indexer/index_scores.cuh"),
    header!("indexer/index_scores_fast.cuh"),
    header!("sampling/sampling.cuh"),
    header!("moe/route.cuh"),
    header!("engram/engram.cuh"),
    header!("rows/rows.cuh"),
    header!("indexer/topk.cuh"),
];

/// The text of a translation unit.
pub fn text(file: SourceFile) -> &'static str {
    match file {
        SourceFile::ActQuant => include_str!("../cuda/quant/act_quant.cu"),
        SourceFile::GemmFp8 => include_str!("../cuda/gemm/gemm_fp8.cu"),
        SourceFile::GemmFast => include_str!("../cuda/gemm/gemm_fast.cu"),
        SourceFile::GemmFp4 => include_str!("../cuda/gemm/gemm_fp4.cu"),
        SourceFile::RmsNorm => include_str!("../cuda/norm/rms_norm.cu"),
        SourceFile::Rope => include_str!("../cuda/rope/rope.cu"),
        SourceFile::Qdq => include_str!("../cuda/quant/qdq.cu"),
        SourceFile::Linear => include_str!("../cuda/linear/linear_sgemm.cu"),
        SourceFile::Attention => include_str!("../cuda/attention/sparse_attention.cu"),
        SourceFile::Mhc => include_str!("../cuda/mhc/mhc.cu"),
        SourceFile::Indexer => include_str!("../cuda/indexer/index_scores.cu"),
        SourceFile::Sampling => include_str!("../cuda/sampling/sample_rows.cu"),
        SourceFile::Moe => include_str!("../cuda/moe/route.cu"),
        SourceFile::Engram => include_str!("../cuda/engram/engram.cu"),
        SourceFile::Rows => include_str!("../cuda/rows/rows.cu"),
        SourceFile::MoeRouted => include_str!("../cuda/moe/routed.cu"),
        SourceFile::TopK => include_str!("../cuda/indexer/topk.cu"),
        SourceFile::Movement => include_str!("../cuda/common/movement.cu"),
        SourceFile::V4 => include_str!("../cuda/v4/v4.cu"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bodies of the `__global__` functions (and kernel macros) of `text`: the text after
    /// each kernel's opening brace, with macro line continuations dropped.
    fn kernel_bodies(text: &str) -> Vec<String> {
        text.match_indices("__global__")
            .filter(|&(at, _)| !text[..at].ends_with("#define "))
            .map(|(at, _)| {
                let body = &text[at..][text[at..].find('{').expect("a kernel body") + 1..];
                body.lines()
                    .map(|line| line.trim().trim_end_matches('\\').trim())
                    .filter(|line| !line.is_empty())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .collect()
    }

    /// Every source file's and embedded header's (name, text).
    fn every_text() -> impl Iterator<Item = (&'static str, &'static str)> {
        SourceFile::ALL
            .iter()
            .map(|&file| (file.path(), text(file)))
            .chain(HEADERS.iter().copied())
    }

    /// A kernel that triggered its dependents early had their blocks resident while it ran,
    /// packed onto the multiprocessors it left free (`cuda/common/grid_dependency.cuh`): no
    /// source may trigger them; they launch as its blocks exit.
    #[test]
    fn no_kernel_triggers_its_dependents_early() {
        let triggers = |source: &str| {
            source
                .lines()
                .map(|line| line.split("//").next().unwrap_or(""))
                .any(|code| {
                    code.contains("griddepcontrol.launch_dependents")
                        || code.contains("cudaTriggerProgrammaticLaunchCompletion")
                })
        };
        for (path, source) in every_text() {
            assert!(!triggers(source), "{path} triggers its dependents early");
        }
        // The check catches a trigger, not a comment naming it.
        assert!(triggers(
            "asm volatile(\"griddepcontrol.launch_dependents;\");"
        ));
        assert!(!triggers("// griddepcontrol.launch_dependents"));
    }

    /// Kernels are launched as programmatic dependents of the stream's previous kernel
    /// (`runtime::Launch`), which is only sound if each one waits for that kernel before touching
    /// global memory: `grid_dependency_sync();` must be every kernel's first statement.
    #[test]
    fn every_kernel_starts_with_the_grid_dependency_sync() {
        let mut kernels = 0;
        for (name, text) in every_text() {
            for body in kernel_bodies(text) {
                kernels += 1;
                assert!(
                    body.starts_with("grid_dependency_sync();"),
                    "a kernel of {name} does not start with grid_dependency_sync(): {}",
                    &body[..body.len().min(120)]
                );
            }
        }
        // Every kernel and kernel macro of the sources (67 today): the scan finds them.
        assert!(kernels >= 60, "found only {kernels} kernels");
        // The check fails a kernel without it.
        let missing = "extern \"C\" __global__ void k(float* x) {\n    x[0] = 1.0f;\n}\n";
        assert!(!kernel_bodies(missing)[0].starts_with("grid_dependency_sync();"));
    }
}
