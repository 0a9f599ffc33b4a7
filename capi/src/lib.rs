//! The C ABI of gpu-pager: every `gpu_pager_*` symbol, declared in `include/gpu_pager.h`
//! (generated from this crate by cbindgen; `tests/header.rs` fails when it is stale).
//!
//! This is an rlib that two shared objects link: `libgpu_pager.so` (the `cdylib` member, a
//! one-line re-export of this crate) and the Python extension module, which exports the same
//! C ABI. Each shared object holds its own copy of gpu-pager's statics, hence its own pager
//! per device ([`gpu_pager::registry`]): C code in a process that imports the Python package
//! must call the extension module's C ABI (its path is `gpu_pager.torch.library_path()`),
//! not load `libgpu_pager.so` beside it.
//!
//! The boundary, as in rustls-ffi:
//! - Every exported body runs in a panic guard: a panic becomes `GPU_PAGER_ERROR_PANIC`
//!   with its message, never an unwind into C.
//! - Every call returns a `gpu_pager_code` (the numbers of `gpu_pager::ErrorCode`;
//!   `GPU_PAGER_OK` is 0) and keeps the message (naming the tag and the fix) for
//!   `gpu_pager_last_error()`, per thread.
//! - NULL pointers, non-UTF-8 tags, unknown enum values and stale lease handles are
//!   `GPU_PAGER_ERROR_INVALID_ARGUMENT`; zero sizes `GPU_PAGER_ERROR_INVALID_SIZE`; unknown
//!   tags `GPU_PAGER_ERROR_UNKNOWN_TAG`.
//! - Pagers are named by device ordinal (there is no pager handle to go stale); buffers by
//!   their device address; leases by a number that is never reused.
//!
//! Device memory is read and written through the pager (`gpu_pager_write`,
//! `gpu_pager_read`), so touching a released region is `GPU_PAGER_ERROR_NOT_RESIDENT`,
//! not a fault.

mod api;
pub mod boundary;
mod companions;
mod logs;
mod torch;
mod types;

pub use api::*;
pub use companions::*;
pub use logs::*;
pub use torch::*;
pub use types::*;
