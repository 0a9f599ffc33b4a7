//! Companions from C: a pair of callbacks and a user pointer that move with a tag
//! (`gpu_pager::Companion`).
#![allow(non_camel_case_types)]

use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::Arc;

use gpu_pager::{Companion, CompanionError};

use crate::boundary::{self, call, pager, required, write_out};
use crate::types::gpu_pager_code;

/// A companion's callback: called with the tag (a NUL-terminated string valid for the
/// call) and the `user` pointer given to `gpu_pager_add_companion`; returns 0 on success,
/// anything else on failure (the release or resume is then undone and fails with
/// `GPU_PAGER_ERROR_COMPANION`, whose message gives the number).
pub type gpu_pager_companion_fn =
    Option<unsafe extern "C" fn(tag: *const c_char, user: *mut c_void) -> c_int>;

/// The callbacks of one `gpu_pager_add_companion`.
struct CCompanion {
    name: String,
    before_release: gpu_pager_companion_fn,
    after_resume: gpu_pager_companion_fn,
    user: *mut c_void,
}

// SAFETY: `gpu_pager_add_companion`'s contract: the callbacks may be called from any thread
// with `user`, until the companion is removed.
unsafe impl Send for CCompanion {}
// SAFETY: as above; the pager never calls one companion from two threads at once for the
// same region, and the contract covers calls for different regions.
unsafe impl Sync for CCompanion {}

impl CCompanion {
    fn run(&self, f: gpu_pager_companion_fn, tag: &str) -> Result<(), CompanionError> {
        let Some(f) = f else { return Ok(()) };
        let tag = CString::new(tag)?;
        // SAFETY: the function and `user` come from `gpu_pager_add_companion`, whose contract
        // keeps them callable until removal; `tag` is NUL-terminated and lives for the call.
        match unsafe { f(tag.as_ptr(), self.user) } {
            0 => Ok(()),
            rc => Err(format!("the callback returned {rc}").into()),
        }
    }
}

impl Companion for CCompanion {
    fn name(&self) -> &str {
        &self.name
    }
    fn before_release(&self, tag: &str) -> Result<(), CompanionError> {
        self.run(self.before_release, tag)
    }
    fn after_resume(&self, tag: &str) -> Result<(), CompanionError> {
        self.run(self.after_resume, tag)
    }
}

/// Registers a companion of region `tag` on device `device` (the region need not exist
/// yet): each release of `tag` calls `before_release(tag, user)` after the contents are
/// saved and before the memory is unmapped; each resume calls `after_resume(tag, user)`
/// after the memory is mapped and restored. Either callback may be NULL (nothing to do). A
/// callback that returns non-zero undoes the move: the companions that ran are undone
/// (each by its other callback, newest first), every region stays as before the call, and
/// the call fails with `GPU_PAGER_ERROR_COMPANION` naming `name`. A tag's companions run
/// in registration order on resume and in reverse on release. Stores the companion's
/// identity in `*id_out` for `gpu_pager_remove_companion`.
///
/// The callbacks run inside the release or resume, on the thread that called it, with the
/// region locked: they must not release, resume or remove that region, nor add or remove
/// companions.
///
/// # Safety
/// `tag` and `name` are NULL (an error) or NUL-terminated strings; each non-NULL callback
/// stays callable, with `user`, from any thread until the companion is removed; `id_out` is
/// NULL (an error) or valid for a write of a `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_add_companion(
    device: c_int,
    tag: *const c_char,
    name: *const c_char,
    before_release: gpu_pager_companion_fn,
    after_resume: gpu_pager_companion_fn,
    user: *mut c_void,
    id_out: *mut u64,
) -> gpu_pager_code {
    call("gpu_pager_add_companion", || {
        // SAFETY: NULL or NUL-terminated and alive for this call (the contract).
        let tag = unsafe { boundary::tag(tag, "tag") }?;
        // SAFETY: as above.
        let name = unsafe { boundary::tag(name, "name") }?;
        required(id_out, "id_out")?;
        let companion = Arc::new(CCompanion {
            name: name.to_owned(),
            before_release,
            after_resume,
            user,
        });
        let id = pager(device)?.add_companion(tag, companion)?;
        // SAFETY: `id_out` is non-NULL (checked) and valid for a write (the contract).
        unsafe { write_out(id_out, id) };
        Ok(())
    })
}

/// Unregisters companion `id` (from `gpu_pager_add_companion` on the same device): its
/// callbacks are not called again once this returns (a release or resume running them now
/// finishes first), so `user` may be freed then. `GPU_PAGER_ERROR_INVALID_ARGUMENT` if
/// there is no such companion.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_remove_companion(device: c_int, id: u64) -> gpu_pager_code {
    call("gpu_pager_remove_companion", || {
        pager(device)?.remove_companion(id)
    })
}
