//! The C entry points PyTorch's `CUDAPluggableAllocator` calls, exported by the extension
//! module itself so that `gpu_pager.torch` can hand torch the module's own path
//! (`gpu_pager._native.__file__`): one shared object, one pager per device.
//!
//! TODO: use the capi crate. Branch `capi` adds `gpu-pager-capi` with these three symbols;
//! once it is merged this file goes, and the module links that crate's rlib instead
//! (`use gpu_pager_capi as _;` keeps its `#[no_mangle]` functions in the cdylib).
//!
//! - `gpu_pager_use_tag(device, tag)`: the region that new segments on `device` come from,
//!   for the calling thread (torch calls `malloc` on the thread that allocates); `NULL`
//!   clears it. Returns 0, or an `ErrorCode` number.
//! - `gpu_pager_torch_malloc(size, device, stream)`: a buffer of `size` bytes in that
//!   region (2 MiB aligned once `size` is at least 2 MiB; torch asks for whole segments,
//!   multiples of 2 MiB), or `NULL` (torch raises `torch.OutOfMemoryError`).
//! - `gpu_pager_torch_free(ptr, size, device, stream)`: frees it, whether the region is
//!   resident or released.
//!
//! Neither takes the GIL (torch calls them from any thread, with its allocator's lock held)
//! and nothing panics across: a caught panic is a `NULL` or an error number.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, PoisonError};

use gpu_pager::{Buffer, ErrorCode};

use crate::registry;

thread_local! {
    /// Per device: the tag of the region torch's segments come from, for this thread.
    static TAGS: RefCell<BTreeMap<usize, String>> = const { RefCell::new(BTreeMap::new()) };
    /// The message of this thread's last failed call, for `gpu_pager.torch.last_error()`.
    static LAST_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Live segments by address: their device and buffer.
static SEGMENTS: Mutex<Option<HashMap<u64, (usize, Buffer)>>> = Mutex::new(None);

const SEGMENT_ALIGN: usize = 2 << 20;

fn fail(message: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = Some(message));
}

/// The message of the calling thread's last failed torch hook, if any.
pub(crate) fn last_error() -> Option<String> {
    LAST_ERROR.with(|e| e.borrow().clone())
}

/// Sets (or, with `tag == NULL`, clears) the calling thread's tag for new segments on
/// `device`. Returns 0, or `InvalidArgument`'s number for a negative device or a tag that
/// is not UTF-8.
///
/// # Safety
/// `tag` is `NULL` or a NUL-terminated string that stays valid for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_use_tag(device: c_int, tag: *const c_char) -> c_int {
    let Ok(device) = usize::try_from(device) else {
        fail(format!("gpu_pager_use_tag: device {device} is negative"));
        return ErrorCode::InvalidArgument.number() as c_int;
    };
    let tag = if tag.is_null() {
        None
    } else {
        // SAFETY: the caller passes a NUL-terminated string valid for the call.
        match unsafe { CStr::from_ptr(tag) }.to_str() {
            Ok(t) => Some(t.to_owned()),
            Err(_) => {
                fail("gpu_pager_use_tag: the tag is not UTF-8".to_owned());
                return ErrorCode::InvalidArgument.number() as c_int;
            }
        }
    };
    let set = catch_unwind(move || {
        TAGS.with(|tags| {
            let mut tags = tags.borrow_mut();
            match tag {
                Some(t) => tags.insert(device, t),
                None => tags.remove(&device),
            }
        })
    });
    match set {
        Ok(_) => 0,
        Err(_) => ErrorCode::Panic.number() as c_int,
    }
}

/// The calling thread's tag for `device`, if set.
pub(crate) fn current_tag(device: usize) -> Option<String> {
    TAGS.with(|tags| tags.borrow().get(&device).cloned())
}

fn malloc(size: usize, device: c_int) -> Result<u64, String> {
    let device = usize::try_from(device).map_err(|_| format!("device {device} is negative"))?;
    let tag = current_tag(device).ok_or_else(|| {
        format!(
            "no tag is set for device {device} on this thread: allocate inside \
             gpu_pager.torch.region(tag) (gpu_pager_use_tag)"
        )
    })?;
    let pager = registry::for_device(device).map_err(|e| e.to_string())?;
    let align = if size >= SEGMENT_ALIGN {
        SEGMENT_ALIGN
    } else {
        gpu_pager::DEFAULT_ALIGN
    };
    let buf = pager
        .alloc_aligned(&tag, size, align)
        .map_err(|e| e.to_string())?;
    let ptr = match pager.ptr(&buf) {
        Ok(p) => p,
        Err(e) => {
            let _ = pager.free(&buf);
            return Err(e.to_string());
        }
    };
    let mut segments = SEGMENTS.lock().unwrap_or_else(PoisonError::into_inner);
    segments
        .get_or_insert_with(HashMap::new)
        .insert(ptr, (device, buf));
    Ok(ptr)
}

/// torch's `alloc` hook: `size` bytes for `device` from the calling thread's tag (see the
/// module docs); `NULL` on failure, with the reason kept for `last_error`.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_torch_malloc(
    size: usize,
    device: c_int,
    _stream: *mut c_void,
) -> *mut c_void {
    match catch_unwind(|| malloc(size, device)) {
        Ok(Ok(ptr)) => ptr as usize as *mut c_void,
        Ok(Err(why)) => {
            fail(format!("gpu_pager_torch_malloc({size}, {device}): {why}"));
            std::ptr::null_mut()
        }
        Err(_) => {
            fail(format!("gpu_pager_torch_malloc({size}, {device}) panicked"));
            std::ptr::null_mut()
        }
    }
}

fn free(ptr: u64) -> Result<(), String> {
    let entry = SEGMENTS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_mut()
        .and_then(|s| s.remove(&ptr));
    let (device, buf) = entry.ok_or_else(|| format!("{ptr:#x} is not a gpu_pager segment"))?;
    let pager = registry::for_device(device).map_err(|e| e.to_string())?;
    pager.free(&buf).map_err(|e| e.to_string())
}

/// torch's `free` hook: frees a segment from [`gpu_pager_torch_malloc`]. An unknown pointer
/// is ignored (and reported by `last_error`).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_torch_free(
    ptr: *mut c_void,
    _size: usize,
    _device: c_int,
    _stream: *mut c_void,
) {
    let addr = ptr as usize as u64;
    match catch_unwind(AssertUnwindSafe(|| free(addr))) {
        Ok(Ok(())) => {}
        Ok(Err(why)) => fail(format!("gpu_pager_torch_free({addr:#x}): {why}")),
        Err(_) => fail(format!("gpu_pager_torch_free({addr:#x}) panicked")),
    }
}

/// Live torch segments of `device`: how many, and their bytes.
pub(crate) fn segments(device: usize) -> (usize, usize) {
    let segments = SEGMENTS.lock().unwrap_or_else(PoisonError::into_inner);
    segments.as_ref().map_or((0, 0), |s| {
        s.values()
            .filter(|(d, _)| *d == device)
            .fold((0, 0), |(n, bytes), (_, b)| (n + 1, bytes + b.len()))
    })
}
