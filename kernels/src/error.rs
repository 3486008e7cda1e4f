//! `KernelError`: every way opening the device, compiling a kernel or launching one can fail.

use std::path::PathBuf;

use crate::id::Arch;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// `libcuda` could not be loaded: this machine has no NVIDIA driver (or it is not on the
    /// loader path).
    #[error(
        "no CUDA driver: libcuda could not be loaded (searched the system loader path and LD_LIBRARY_PATH for {tried})"
    )]
    NoDriver { tried: String },
    /// `libnvrtc` (and its `libnvrtc-builtins`) could not be loaded, so kernels cannot be compiled.
    #[error(
        "no NVRTC: libnvrtc could not be loaded (searched for {tried}); put the CUDA 13 lib directory on LD_LIBRARY_PATH"
    )]
    NoNvrtc { tried: String },
    /// A CUDA library panicked while it was being loaded (cudarc's dynamic loading panics on a
    /// missing symbol); the panic was caught.
    #[error("CUDA library failure during {during}: {message}")]
    LibraryPanicked {
        during: &'static str,
        message: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error during {during}: {source}")]
    Driver {
        during: String,
        source: cudarc::driver::DriverError,
    },
    /// An NVRTC call (other than the compilation itself) failed.
    #[error("NVRTC error during {during} of {source_name}: {message}")]
    Nvrtc {
        during: &'static str,
        source_name: String,
        message: String,
    },
    /// NVRTC rejected a source (an embedded file's path, or a generated source's name); `log` is
    /// its compiler log.
    #[error("NVRTC could not compile {source_name} for {arch}:\n{log}")]
    Compile {
        source_name: String,
        arch: Arch,
        log: String,
    },
    /// `cuda_bf16.h` was not found in any CUDA include directory.
    #[error(
        "no CUDA include directory with cuda_bf16.h and cuda_fp8.h; tried {tried:?} (set CUDA_HOME)"
    )]
    NoIncludePath { tried: Vec<PathBuf> },
    /// The device's compute capability has no kernel variant.
    #[error(
        "unsupported GPU: compute capability {major}.{minor} (kernels target sm_90a and sm_100a)"
    )]
    UnsupportedArch { major: i32, minor: i32 },
    /// A kernel was asked for that the runtime did not load (a registry bug, never bad input).
    #[error("kernel {symbol} is not loaded in this runtime")]
    NotLoaded { symbol: &'static str },
    /// A stream capture could not be made ([`crate::graph`]).
    #[error("stream capture failed: {message}")]
    Capture { message: &'static str },
    /// A launcher was given buffers or dimensions that do not fit together.
    #[error("bad arguments to {op}: {message}")]
    Shape { op: &'static str, message: String },
}

impl KernelError {
    /// Wraps a driver error with what was being done.
    pub(crate) fn driver(
        during: impl Into<String>,
    ) -> impl FnOnce(cudarc::driver::DriverError) -> KernelError {
        let during = during.into();
        move |source| KernelError::Driver { during, source }
    }
}
