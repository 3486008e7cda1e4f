//! deepinfer-kernels: CUDA C sources (embedded with `include_str!`, compiled by NVRTC for the
//! device's arch at start and cached on disk) and their typed launchers. It knows no model and no
//! runtime. Without the `cuda` feature it is empty.
//!
//! Layout: [`KernelId`] names every kernel and the source file that defines it ([`id`]);
//! [`source`] embeds the sources; [`compile`] runs NVRTC and owns the CUBIN cache; [`runtime`]
//! opens the device (refusing cleanly when no driver is present) and loads every kernel, and copies
//! large uploads through page-locked memory ([`staging`]) and times launches on request
//! ([`kernel_timer`]), and captures launch sequences as CUDA graphs ([`graph`]); [`ops`] holds one typed launcher per operation, which checks shapes before
//! it launches.

/// Declares its items only with the `cuda` feature.
macro_rules! with_cuda {
    ($($item:item)*) => {
        $(#[cfg(feature = "cuda")] $item)*
    };
}

with_cuda! {
    pub mod compile;
    mod error;
    pub mod graph;
    pub mod id;
    pub mod kernel_timer;
    pub mod ops;
    pub mod params;
    pub mod runtime;
    pub mod source;
    pub mod staging;

    pub use cudarc;
    pub use error::KernelError;
    pub use id::{Arch, KernelId, SourceFile};
    pub use runtime::KernelRuntime;
}

pub mod poison;
