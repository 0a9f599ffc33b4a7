//! `libgpu_pager.so`: gpu-pager's C ABI as a shared library (`include/gpu_pager.h`). Every
//! symbol comes from the `gpu-pager-capi` rlib, which the Python extension links too.

pub use gpu_pager_capi::*;
