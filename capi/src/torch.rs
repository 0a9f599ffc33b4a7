//! PyTorch's allocator hooks: the two symbols `torch.cuda.memory.CUDAPluggableAllocator`
//! loads, and the per-thread tag they allocate in.
//!
//! ```python
//! alloc = torch.cuda.memory.CUDAPluggableAllocator(
//!     path_to_libgpu_pager, "gpu_pager_torch_malloc", "gpu_pager_torch_free")
//! pool = torch.cuda.MemPool(alloc.allocator())
//! # gpu_pager_use_tag(device, "weights") on this thread, then:
//! with torch.cuda.use_mem_pool(pool): ...
//! ```
//!
//! Torch calls these on its own threads, with whatever device it has current. They leave
//! that device current: nothing here binds a context (buffer bookkeeping is host-only for
//! today's fixed-size regions), and the CUDA backend restores the caller's context around
//! what it binds.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Mutex, PoisonError};

use gpu_pager::backend::RawStream;
use gpu_pager::{Buffer, Error, Pager, Result};

use crate::boundary::{self, call, call_or, invalid};
use crate::types::gpu_pager_code;

/// Alignment of torch segments of at least this size.
const SEGMENT_ALIGN: usize = 2 << 20;

/// The segments handed to torch, by (device, address), with the buffer handle each came
/// from. A free looks its handle up here rather than by address, so that a segment whose
/// region was removed (and whose addresses may belong to a new region by now) fails as
/// `StaleBuffer` instead of freeing someone else's buffer.
static SEGMENTS: Mutex<BTreeMap<(usize, u64), Buffer>> = Mutex::new(BTreeMap::new());

fn segments() -> std::sync::MutexGuard<'static, BTreeMap<(usize, u64), Buffer>> {
    SEGMENTS.lock().unwrap_or_else(PoisonError::into_inner)
}

thread_local! {
    /// This thread's current tag per device, for `gpu_pager_torch_malloc`.
    static CURRENT: RefCell<BTreeMap<usize, String>> = const { RefCell::new(BTreeMap::new()) };
}

/// Sets the region that `gpu_pager_torch_malloc` allocates in on this thread for device
/// `device` (thread-local: other threads are not affected); `tag == NULL` clears it, after
/// which torch allocations on this thread fail rather than land anywhere else. The region
/// must exist (`GPU_PAGER_ERROR_UNKNOWN_TAG` otherwise).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_use_tag(device: c_int, tag: *const c_char) -> gpu_pager_code {
    call("gpu_pager_use_tag", || {
        let d = boundary::device(device)?;
        if tag.is_null() {
            CURRENT.with(|c| c.borrow_mut().remove(&d));
            return Ok(());
        }
        // SAFETY: `tag` is non-NULL, NUL-terminated and alive for this call (the contract).
        let tag = unsafe { boundary::tag(tag, "tag") }?;
        boundary::pager(device)?.info(tag)?;
        CURRENT.with(|c| c.borrow_mut().insert(d, tag.to_owned()));
        Ok(())
    })
}

/// The calling thread's current tag for `device` (set by [`gpu_pager_use_tag`]), for
/// Rust callers such as the Python extension.
pub fn current_tag(device: usize) -> Option<String> {
    CURRENT.with(|c| c.borrow().get(&device).cloned())
}

/// PyTorch's `malloc` hook: allocates `size` bytes for device `device` in this thread's
/// current tag (`gpu_pager_use_tag`) and returns the device address. `stream` is the
/// stream torch will use the memory on; today's fixed-size regions map nothing here, so it
/// is not used. Returns NULL on failure, with the reason in `gpu_pager_last_error()`: no
/// tag set (nothing is ever placed in a region silently), the region released or full,
/// `size == 0`.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_torch_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let _ = stream;
    call_or(
        "gpu_pager_torch_malloc",
        std::ptr::null_mut(),
        || -> Result<*mut c_void> {
            let d = boundary::device(device)?;
            let tag = CURRENT
                .with(|c| c.borrow().get(&d).cloned())
                .ok_or_else(|| {
                    invalid(
                        "*",
                        format!(
                            "gpu_pager_torch_malloc({size} bytes, device {d}): this thread has no \
                         current tag for device {d}, and allocations are never placed in a \
                         region silently; call gpu_pager_use_tag({d}, \"<tag>\") on this \
                         thread first"
                        ),
                    )
                })?;
            if size == 0 {
                return Err(Error::InvalidSize {
                    tag,
                    reason: "gpu_pager_torch_malloc of 0 bytes; torch asks for at least one"
                        .to_owned(),
                });
            }
            let pager = boundary::pager(device)?;
            // Whole segments (torch asks for multiples of 2 MiB from 2 MiB up) start on a
            // 2 MiB boundary, as cudaMalloc's do; smaller ones at the default alignment.
            let align = if size >= SEGMENT_ALIGN {
                SEGMENT_ALIGN
            } else {
                gpu_pager::DEFAULT_ALIGN
            };
            let buf = pager.alloc_aligned(&tag, size, align)?;
            // A released region: torch would write into unmapped memory at once, so refuse
            // (NotResident) instead of handing out the address.
            match pager.ptr(&buf) {
                Ok(p) => {
                    segments().insert((d, p), buf);
                    Ok(p as usize as *mut c_void)
                }
                Err(e) => {
                    let _ = pager.free(&buf);
                    Err(e)
                }
            }
        },
    )
}

/// PyTorch's `free` hook: frees the buffer at `ptr` (from `gpu_pager_torch_malloc`) on
/// device `device`. Torch passes the `size` it asked for; a mismatch is logged. Failures
/// free nothing and are kept for `gpu_pager_last_error()` and logged, since the hook
/// returns nothing: an address `gpu_pager_torch_malloc` did not return (or a second free),
/// and `GPU_PAGER_ERROR_STALE_BUFFER` for a segment whose region was removed meanwhile
/// (its addresses may belong to a new region by now; nothing of it is touched).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_torch_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) {
    let code = call("gpu_pager_torch_free", || {
        let d = boundary::device(device)?;
        let pager = boundary::pager(device)?;
        let addr = ptr as usize as u64;
        let buf = segments().remove(&(d, addr)).ok_or_else(|| {
            invalid(
                "*",
                format!(
                    "gpu_pager_torch_free({addr:#x}, device {d}): not a segment \
                     gpu_pager_torch_malloc returned, or freed already; nothing was freed"
                ),
            )
        })?;
        if buf.len() != size {
            log::warn!(
                "gpu-pager: gpu_pager_torch_free({addr:#x}, {size} bytes): the buffer in `{}` \
                 has {} bytes; freeing it",
                buf.tag(),
                buf.len()
            );
        }
        if free_may_unmap(&pager, &buf) {
            // Work torch enqueued on `stream` may still use the memory: wait for it before
            // the pager unmaps anything.
            pager
                .backend()
                .fence(RawStream(stream as usize))
                .and_then(|f| f.wait())
                .map_err(|e| Error::backend(buf.tag(), "waiting for torch's stream", e))?;
        }
        pager.free(&buf)
    });
    if code != gpu_pager_code::GPU_PAGER_OK {
        // SAFETY: `gpu_pager_last_error` returns this thread's NUL-terminated message.
        let msg = unsafe { std::ffi::CStr::from_ptr(boundary::last_message()) };
        log::error!("gpu-pager: {}", msg.to_string_lossy());
    }
}

/// Whether freeing `buf` can unmap physical memory. Never today: fixed-size regions stay
/// mapped while resident, and a free is bookkeeping. Growing regions will unmap chunks no
/// live buffer covers; return true for them then, so that `gpu_pager_torch_free` waits for
/// torch's stream first.
fn free_may_unmap(pager: &Pager, buf: &Buffer) -> bool {
    // A free in a growing region unmaps the buffer (the pager also waits for the whole
    // device first; waiting for torch's stream here keeps that ordering explicit).
    pager.info(buf.tag()).is_ok_and(|i| i.growing)
}
