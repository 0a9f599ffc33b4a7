//! The C ABI's arguments: a length is checked against the buffer before any slice is
//! formed, `gpu_pager_alloc` hands out the address of the buffer it made, a copy of zero
//! bytes is checked and copies nothing (as in the other bindings), and a backup directory
//! may be any bytes.

use std::ffi::{CStr, c_char};

use gpu_pager_capi::*;

fn last_error() -> String {
    // SAFETY: gpu_pager_last_error returns this thread's NUL-terminated message.
    unsafe { CStr::from_ptr(gpu_pager_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn region(tag: &CStr) -> u64 {
    let mut base = 0u64;
    // SAFETY: a NUL-terminated literal and a valid out-pointer.
    let code = unsafe {
        gpu_pager_region(
            0,
            tag.as_ptr(),
            gpu_pager_policy::GPU_PAGER_DISCARD as u32,
            gpu_pager_region_kind::GPU_PAGER_FIXED as u32,
            4 << 20,
            false,
            &mut base,
        )
    };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    base
}

#[test]
fn a_length_beyond_the_buffer_is_out_of_range_before_anything_is_touched() {
    region(c"review-range");
    let mut p = 0u64;
    // SAFETY: a NUL-terminated literal and a valid out-pointer.
    let code = unsafe { gpu_pager_alloc(0, c"review-range".as_ptr(), 4096, &mut p) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    let mut byte = 0u8;
    let huge = isize::MAX as usize + 1;
    // SAFETY: the length is refused before the pointer is read (what is tested).
    let code = unsafe { gpu_pager_write(0, p, (&raw const byte).cast(), huge) };
    assert_eq!(
        code,
        gpu_pager_code::GPU_PAGER_ERROR_OUT_OF_RANGE,
        "{}",
        last_error()
    );
    // SAFETY: as above; nothing is written.
    let code = unsafe { gpu_pager_read(0, p, (&raw mut byte).cast(), huge) };
    assert_eq!(
        code,
        gpu_pager_code::GPU_PAGER_ERROR_OUT_OF_RANGE,
        "{}",
        last_error()
    );
    // SAFETY: one valid byte; 4097 bytes from the start reach past the buffer.
    let code = unsafe { gpu_pager_write(0, p, (&raw const byte).cast(), 4097) };
    assert_eq!(
        code,
        gpu_pager_code::GPU_PAGER_ERROR_OUT_OF_RANGE,
        "{}",
        last_error()
    );
    let tags: [*const c_char; 1] = [c"review-range".as_ptr()];
    // SAFETY: a count larger than any array is refused before the list is read.
    let code = unsafe { gpu_pager_release(0, tags.as_ptr(), usize::MAX, std::ptr::null_mut()) };
    assert_eq!(
        code,
        gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT,
        "{}",
        last_error()
    );
}

#[test]
fn alloc_returns_its_own_buffer_s_address() {
    let base = region(c"review-alloc");
    let mut p = 0u64;
    // SAFETY: a NUL-terminated literal and a valid out-pointer.
    let code = unsafe { gpu_pager_alloc(0, c"review-alloc".as_ptr(), 4096, &mut p) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    assert!(p >= base && p < base + (4 << 20));
}

/// An address names the buffer there now; a second free of
/// it before it is reused is an error that frees nothing.
#[test]
fn an_address_names_the_buffer_there_now() {
    region(c"review-free");
    let alloc = || {
        let mut p = 0u64;
        // SAFETY: a NUL-terminated literal and a valid out-pointer.
        let code = unsafe { gpu_pager_alloc(0, c"review-free".as_ptr(), 4096, &mut p) };
        assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
        p
    };
    let p = alloc();
    assert_eq!(gpu_pager_free(0, p), gpu_pager_code::GPU_PAGER_OK);
    assert_eq!(
        gpu_pager_free(0, p),
        gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT
    );
    assert!(
        last_error().contains("not inside a live buffer"),
        "{}",
        last_error()
    );
    let q = alloc();
    assert_eq!(q, p, "the address is handed out again");
    assert_eq!(
        gpu_pager_free(0, p),
        gpu_pager_code::GPU_PAGER_OK,
        "and names the new buffer"
    );
}

/// A copy of zero bytes copies nothing after the same checks of the address,
/// as in Rust and Python (it was refused here alone).
#[test]
fn zero_byte_copies_check_the_address_and_copy_nothing() {
    region(c"review-zero");
    let mut p = 0u64;
    // SAFETY: a NUL-terminated literal and a valid out-pointer.
    let code = unsafe { gpu_pager_alloc(0, c"review-zero".as_ptr(), 4096, &mut p) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    // SAFETY: zero bytes: the NULL pointers are never read or written.
    let code = unsafe { gpu_pager_write(0, p, std::ptr::null(), 0) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    // SAFETY: as above.
    let code = unsafe { gpu_pager_read(0, p, std::ptr::null_mut(), 0) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    // SAFETY: as above; the region holds no buffer past the first one.
    let code = unsafe { gpu_pager_write(0, p + (1 << 20), std::ptr::null(), 0) };
    assert_eq!(
        code,
        gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT,
        "{}",
        last_error()
    );
    let byte = 0u8;
    // SAFETY: one valid byte, but a NULL source for a copy of one byte is refused first.
    let code = unsafe { gpu_pager_write(0, p, std::ptr::null(), 1) };
    assert_eq!(
        code,
        gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT,
        "{}",
        last_error()
    );
    // SAFETY: one valid byte.
    let code = unsafe { gpu_pager_write(0, p, (&raw const byte).cast(), 1) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
}

/// Failures no call could return reach C: counted in the stats, taken as text, and logged to
/// the C callback.
#[test]
fn deferred_errors_reach_c_through_the_stats_the_take_and_the_log() {
    use std::ffi::c_void;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static LOGGED: AtomicUsize = AtomicUsize::new(0);
    unsafe extern "C" fn on_log(level: u32, _: *const c_char, m: *const c_char, _: *mut c_void) {
        // SAFETY: the logger passes a NUL-terminated message valid for the call.
        let text = unsafe { CStr::from_ptr(m) }.to_string_lossy();
        if level == 1 && text.contains("a cleanup failed") {
            LOGGED.fetch_add(1, Ordering::Relaxed);
        }
    }
    // SAFETY: `on_log` is safe from any thread; no user pointer.
    let code = unsafe { gpu_pager_set_log_callback(Some(on_log), std::ptr::null_mut(), 2) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    let pager = gpu_pager::Pager::for_device(0).unwrap();
    // SAFETY: a valid out-pointer.
    let stats = |out: &mut gpu_pager_stats| unsafe { gpu_pager_get_stats(0, out) };
    // SAFETY: all-zero bytes are a valid `gpu_pager_stats` (plain integers).
    let mut before: gpu_pager_stats = unsafe { std::mem::zeroed() };
    assert_eq!(stats(&mut before), gpu_pager_code::GPU_PAGER_OK);
    pager.backend().deferred_errors().record("a cleanup failed");
    let mut after = before;
    assert_eq!(stats(&mut after), gpu_pager_code::GPU_PAGER_OK);
    assert_eq!(after.deferred_errors, before.deferred_errors + 1);
    assert_eq!(
        after.deferred_errors_total,
        before.deferred_errors_total + 1
    );
    let text = gpu_pager_take_deferred_errors(0);
    assert!(!text.is_null(), "{}", last_error());
    // SAFETY: non-NULL, NUL-terminated, valid until this thread's next take.
    let text = unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned();
    assert!(
        text.lines().any(|l| l.contains("a cleanup failed")),
        "{text}"
    );
    assert!(stats(&mut after) == gpu_pager_code::GPU_PAGER_OK && after.deferred_errors == 0);
    assert_eq!(LOGGED.load(Ordering::Relaxed), 1);
    // SAFETY: a NULL callback.
    unsafe { gpu_pager_set_log_callback(None, std::ptr::null_mut(), 0) };
}

/// Linux paths need not be UTF-8: a backup directory of any bytes is taken (it was refused
/// with a message about tags).
#[test]
fn a_backup_directory_that_is_not_utf8_is_taken() {
    let mut raw = std::env::temp_dir()
        .join(format!("gpu-pager-dir-{}-", std::process::id()))
        .into_os_string()
        .into_encoded_bytes();
    raw.push(0xff);
    let path = std::path::PathBuf::from(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&raw),
    );
    raw.push(0);
    // SAFETY: a NUL-terminated byte string.
    let code = unsafe { gpu_pager_set_backup_dir(0, raw.as_ptr().cast::<c_char>()) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    assert!(path.is_dir(), "the directory was made");
    std::fs::remove_dir_all(&path).unwrap();
}
