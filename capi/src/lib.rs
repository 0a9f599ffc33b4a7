//! The C ABI of gpu-pager: every `gpu_pager_*` symbol, declared in `include/gpu_pager.h`
//! (generated from this crate by cbindgen; `tests/header.rs` fails when it is stale).
//!
//! This is an rlib on purpose: the shared library (`libgpu_pager.so`, the `cdylib` member,
//! a one-line re-export of this crate) and the Python extension both link it, so a process
//! that loads both still holds one copy of gpu-pager's statics, hence one pager per device
//! ([`gpu_pager::registry`]).
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
mod boundary;
mod tms;
mod torch;
mod types;

pub use api::*;
pub use tms::*;
pub use torch::*;
pub use types::*;
