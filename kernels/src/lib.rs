//! deepinfer-kernels: CUDA C sources (embedded with `include_str!`, compiled by NVRTC for the
//! device's arch at start and cached on disk) and their typed launchers. It knows no model and no
//! runtime. Without the `cuda` feature it is empty.
