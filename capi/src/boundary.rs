//! What every exported function goes through: the panic guard, the per-thread last error,
//! and the checks that turn C arguments (pointers, strings, ordinals) into Rust values or
//! error values. Public for the drop-in wing (`gpu-pager-tms`), whose C functions follow
//! the same conventions and share the per-thread last error with this crate's.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use gpu_pager::{Error, ErrorCode, Pager, Result};

use crate::types::gpu_pager_code;

thread_local! {
    /// The last failure on this thread: its code and message (what `gpu_pager_last_error`
    /// returns). Kept until the next failure or `gpu_pager_clear_error`.
    static LAST: RefCell<(gpu_pager_code, CString)> =
        RefCell::new((gpu_pager_code::GPU_PAGER_OK, CString::default()));
}

/// Records a failure as this thread's last error.
pub fn set_last(code: gpu_pager_code, message: String) {
    let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // A call from a thread-exit destructor may find the thread's locals gone: the message
    // is then lost, but no panic reaches C.
    let _ = LAST.try_with(|l| *l.borrow_mut() = (code, message));
}

/// The last error's code.
pub fn last_code() -> gpu_pager_code {
    LAST.try_with(|l| l.borrow().0)
        .unwrap_or(gpu_pager_code::GPU_PAGER_OK)
}

/// The last error's message, valid until this thread's next failure or clear (the
/// `CString`'s heap buffer does not move while it is stored).
pub fn last_message() -> *const c_char {
    LAST.try_with(|l| l.borrow().1.as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// Clears this thread's last error.
pub fn clear_last() {
    let _ = LAST.try_with(|l| *l.borrow_mut() = (gpu_pager_code::GPU_PAGER_OK, CString::default()));
}

/// Runs an exported function's body: a returned error or a panic becomes this thread's last
/// error and its code; success is `GPU_PAGER_OK`. No panic unwinds into C.
pub fn call(name: &'static str, f: impl FnOnce() -> Result<()>) -> gpu_pager_code {
    match guarded(name, f) {
        Ok(()) => gpu_pager_code::GPU_PAGER_OK,
        Err(code) => code,
    }
}

/// [`call`] for a function that returns a value (a pointer): `fallback` on failure.
pub fn call_or<T>(name: &'static str, fallback: T, f: impl FnOnce() -> Result<T>) -> T {
    guarded(name, f).unwrap_or(fallback)
}

fn guarded<T>(name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T, gpu_pager_code> {
    // AssertUnwindSafe: after a panic the pager's locks recover from poisoning (region
    // state changes only after each fallible step), and the caller only sees a code.
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            let code = gpu_pager_code::from(e.code());
            set_last(code, e.to_string());
            Err(code)
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            let code = gpu_pager_code::from(ErrorCode::Panic);
            set_last(
                code,
                format!(
                    "{name} panicked inside gpu-pager: {what}; this is a bug, please report it \
                     with this message (the call did not complete)"
                ),
            );
            Err(code)
        }
    }
}

/// An [`Error::InvalidArgument`] for a C argument about region `tag`.
pub fn invalid(tag: &str, reason: impl Into<String>) -> Error {
    Error::invalid(Some(tag), reason)
}

/// An [`Error::InvalidArgument`] for a C argument that concerns no region.
pub fn untagged(reason: impl Into<String>) -> Error {
    Error::invalid(None, reason)
}

/// A device ordinal from C.
pub fn device(device: c_int) -> Result<usize> {
    usize::try_from(device).map_err(|_| {
        untagged(format!(
            "device {device} is not a device ordinal; pass 0 for the first GPU"
        ))
    })
}

/// The process's pager for a device ordinal from C.
pub fn pager(ordinal: c_int) -> Result<Arc<Pager>> {
    Pager::for_device(device(ordinal)?)
}

/// A tag from C: non-NULL, NUL-terminated, UTF-8.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays alive and unchanged for
/// `'a` (the duration of the exported call).
pub unsafe fn tag<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(untagged(format!(
            "{what} is NULL; pass a NUL-terminated UTF-8 tag"
        )));
    }
    // SAFETY: non-NULL and, by this function's contract, NUL-terminated and alive for 'a.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|_| {
        invalid(
            &s.to_string_lossy(),
            format!("{what} is not UTF-8; tags are UTF-8 names"),
        )
    })
}

/// Text from C other than a tag (settings): non-NULL, NUL-terminated, UTF-8.
///
/// # Safety
/// As for [`tag`].
pub unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(untagged(format!(
            "{what} is NULL; pass a NUL-terminated UTF-8 string"
        )));
    }
    // SAFETY: non-NULL and, by this function's contract, NUL-terminated and alive for 'a.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|_| untagged(format!("{what} is not UTF-8")))
}

/// A filesystem path from C: non-NULL and NUL-terminated, of any bytes (Linux paths need
/// not be UTF-8).
///
/// # Safety
/// As for [`tag`].
pub unsafe fn path<'a>(p: *const c_char, what: &str) -> Result<&'a std::path::Path> {
    if p.is_null() {
        return Err(untagged(format!(
            "{what} is NULL; pass a NUL-terminated path"
        )));
    }
    // SAFETY: non-NULL and, by this function's contract, NUL-terminated and alive for 'a.
    let s = unsafe { CStr::from_ptr(p) };
    Ok(std::path::Path::new(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(s.to_bytes()),
    ))
}

/// A list of tags from C (`n` pointers at `tags`).
///
/// # Safety
/// `tags` is NULL or points to `n` readable pointers, each NULL or as for [`tag`].
pub unsafe fn tags<'a>(tags: *const *const c_char, n: usize) -> Result<Vec<&'a str>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if tags.is_null() {
        return Err(untagged(format!(
            "the tag list is NULL but its count is {n}; pass an array of {n} tags"
        )));
    }
    if n > isize::MAX as usize / std::mem::size_of::<*const c_char>() {
        return Err(untagged(format!(
            "{n} tags are more than any array holds; pass the list's length"
        )));
    }
    // SAFETY: non-NULL and, by this function's contract, `n` readable pointers.
    let list = unsafe { std::slice::from_raw_parts(tags, n) };
    list.iter()
        .enumerate()
        // SAFETY: each entry is NULL or a live NUL-terminated string (the contract).
        .map(|(i, &p)| unsafe { tag(p, &format!("tags[{i}]")) })
        .collect()
}

/// Writes `value` through an out-pointer from C.
///
/// # Safety
/// `out` is NULL or valid for a write of a `T`.
pub unsafe fn write_out<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-NULL and valid for a write of `T` (the contract); `write` does not read
        // (or drop) what the caller's memory held.
        unsafe { out.write(value) };
    }
}

/// Fails when a required out-pointer is NULL (checked before the call does anything).
pub fn required<T>(out: *mut T, what: &str) -> Result<()> {
    if out.is_null() {
        return Err(untagged(format!(
            "{what} is NULL; pass where to store the result"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn message() -> String {
        // SAFETY: `last_message` points to this thread's stored NUL-terminated message.
        unsafe { CStr::from_ptr(last_message()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_the_panic_code_and_a_message() {
        let code = call("gpu_pager_test", || panic!("boom {}", 42));
        assert_eq!(code, gpu_pager_code::GPU_PAGER_ERROR_PANIC);
        assert_eq!(last_code(), code);
        let m = message();
        assert!(
            m.contains("gpu_pager_test panicked") && m.contains("boom 42"),
            "{m}"
        );
        let p: *mut u8 = call_or("gpu_pager_test", std::ptr::null_mut(), || panic!("static"));
        assert!(p.is_null());
        assert!(message().contains("static"));
    }

    #[test]
    fn errors_are_per_thread_and_kept_until_the_next_failure() {
        clear_last();
        let code = call("t", || Err(invalid("weights", "because")));
        assert_eq!(code, gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT);
        assert_eq!(call("t", || Ok(())), gpu_pager_code::GPU_PAGER_OK);
        assert!(message().contains("`weights`: because"), "{}", message());
        std::thread::spawn(|| {
            assert_eq!(last_code(), gpu_pager_code::GPU_PAGER_OK);
            assert_eq!(message(), "");
            call("t", || Err(invalid("other", "x")));
        })
        .join()
        .unwrap();
        assert!(message().contains("weights"));
        clear_last();
        assert_eq!(message(), "");
    }

    #[test]
    fn interior_nul_in_a_message_is_escaped() {
        set_last(gpu_pager_code::GPU_PAGER_ERROR_BACKEND, "a\0b".to_owned());
        assert_eq!(message(), "a\\0b");
    }
}
