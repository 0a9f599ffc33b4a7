//! The PyTorch hooks' current tag is per thread (and per device): a thread that did not set
//! one gets NULL and a clear last error, never memory in another thread's region.

use std::ffi::CStr;

use gpu_pager_capi::*;

fn last_error() -> String {
    // SAFETY: gpu_pager_last_error returns this thread's NUL-terminated message.
    unsafe { CStr::from_ptr(gpu_pager_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn the_current_tag_is_per_thread() {
    // SAFETY: NUL-terminated literals; NULL base_out is allowed.
    let code = unsafe {
        gpu_pager_region(
            0,
            c"torch_threads".as_ptr(),
            gpu_pager_policy::GPU_PAGER_DISCARD as u32,
            gpu_pager_region_kind::GPU_PAGER_FIXED as u32,
            4 << 20,
            false,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    // SAFETY: a NUL-terminated literal.
    let code = unsafe { gpu_pager_use_tag(0, c"torch_threads".as_ptr()) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
    let p = gpu_pager_torch_malloc(1 << 20, 0, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());

    std::thread::spawn(|| {
        let q = gpu_pager_torch_malloc(1 << 20, 0, std::ptr::null_mut());
        assert!(q.is_null());
        assert_eq!(
            gpu_pager_last_error_code(),
            gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("gpu_pager_use_tag(0,"),
            "{}",
            last_error()
        );
    })
    .join()
    .unwrap();

    // Another thread frees what this one allocated: the address is enough.
    let addr = p as usize;
    std::thread::spawn(move || {
        gpu_pager_clear_error();
        gpu_pager_torch_free(addr as *mut _, 1 << 20, 0, std::ptr::null_mut());
        assert_eq!(gpu_pager_last_error_code(), gpu_pager_code::GPU_PAGER_OK);
    })
    .join()
    .unwrap();
    // SAFETY: NULL is allowed (it clears the tag).
    let code = unsafe { gpu_pager_use_tag(0, std::ptr::null()) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK);
    assert!(gpu_pager_torch_malloc(64, 0, std::ptr::null_mut()).is_null());
    // SAFETY: a NUL-terminated literal.
    let code = unsafe { gpu_pager_remove(0, c"torch_threads".as_ptr()) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
}
