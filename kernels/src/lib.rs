//! deepinfer-kernels: CUDA C sources (embedded with `include_str!`, compiled by NVRTC for the
//! device's arch at start and cached on disk) and their typed launchers. It knows no model and no
//! runtime. Without the `cuda` feature it is empty.
//!
//! Layout: [`KernelId`] names every kernel and the source file that defines it ([`id`]);
//! [`source`] embeds the sources; [`compile`] runs NVRTC and owns the CUBIN cache; [`runtime`]
//! opens the device (refusing cleanly when no driver is present) and loads every kernel, and copies
//! large uploads through page-locked memory ([`staging`]) and times launches on request
//! ([`kernel_timer`]); [`ops`] holds one typed launcher per operation, which checks shapes before
//! it launches.

#[cfg(feature = "cuda")]
pub mod compile;
#[cfg(feature = "cuda")]
mod error;
#[cfg(feature = "cuda")]
pub mod id;
#[cfg(feature = "cuda")]
pub mod kernel_timer;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
pub mod params;
pub mod poison;
#[cfg(feature = "cuda")]
pub mod runtime;
#[cfg(feature = "cuda")]
pub mod source;
#[cfg(feature = "cuda")]
pub mod staging;

#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
pub use error::KernelError;
#[cfg(feature = "cuda")]
pub use id::{Arch, KernelId, SourceFile};
#[cfg(feature = "cuda")]
pub use runtime::KernelRuntime;
