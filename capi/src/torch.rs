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
//! that device current: the CUDA backend binds its context only around what it does (a
//! growing region maps each segment as it is allocated and unmaps it as it is freed) and
//! restores the caller's after.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex, PoisonError};

use gpu_pager::backend::RawStream;
use gpu_pager::{Buffer, Error, Pager, Result};

use crate::boundary::{self, call, call_or, untagged};
use crate::types::gpu_pager_code;

/// Alignment of torch segments of at least this size.
const SEGMENT_ALIGN: usize = 2 << 20;

/// The segments handed to torch, by address (device addresses are unique across devices,
/// in one address space), with the device and the buffer handle each came from: a free
/// finds its segment in constant time whatever the count. A free looks its handle up here
/// rather than by address, so that a segment whose region was removed (and whose addresses
/// may belong to a new region by now) fails as `StaleBuffer` instead of freeing someone
/// else's buffer.
static SEGMENTS: LazyLock<Mutex<HashMap<u64, (usize, Buffer)>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn segments() -> std::sync::MutexGuard<'static, HashMap<u64, (usize, Buffer)>> {
    SEGMENTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Set in a child forked after the hooks or the drop-in were first used (by the fork
/// handler [`check_process`] registers then); a flag read per call, where asking for the
/// process id would be a system call on every `cudaFree`.
static FORKED: AtomicBool = AtomicBool::new(false);
static WATCHING: AtomicBool = AtomicBool::new(false);

extern "C" fn forked() {
    FORKED.store(true, Ordering::Release);
}

/// Fails in a child forked after the hooks or the drop-in were first used, before any of
/// their locks is taken: a lock a parent thread held at the fork is never released in the
/// child, and the parent's segments are not the child's. Every entry point that takes one
/// of their locks calls this first.
pub fn check_process() -> Result<()> {
    if !WATCHING.load(Ordering::Acquire)
        && WATCHING
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    {
        // SAFETY: registers a handler without arguments that only stores to an atomic
        // (async-signal-safe, as a handler in a fork child must be).
        unsafe { libc::pthread_atfork(None, None, Some(forked)) };
    }
    if !FORKED.load(Ordering::Acquire) {
        return Ok(());
    }
    Err(untagged(
        "this process is a fork of one that allocated through gpu-pager's allocator hooks: \
         its device memory cannot be used or freed here (CUDA forbids it too); start the \
         child with spawn rather than fork, or fork before the first allocation",
    ))
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
        let tag = if tag.is_null() {
            None
        } else {
            // SAFETY: `tag` is non-NULL, NUL-terminated and alive for this call (the contract).
            Some(unsafe { boundary::tag(tag, "tag") }?)
        };
        use_tag(d, tag)
    })
}

/// Sets (`None`: clears) the calling thread's current tag for device `d`, as
/// [`gpu_pager_use_tag`] does; for Rust callers such as the Python extension.
pub fn use_tag(d: usize, tag: Option<&str>) -> Result<()> {
    match tag {
        None => {
            CURRENT.with(|c| c.borrow_mut().remove(&d));
        }
        Some(tag) => {
            Pager::for_device(d)?.info(tag)?;
            CURRENT.with(|c| c.borrow_mut().insert(d, tag.to_owned()));
        }
    }
    Ok(())
}

/// The calling thread's current tag for `device` (set by [`gpu_pager_use_tag`]), for
/// Rust callers such as the Python extension.
pub fn current_tag(device: usize) -> Option<String> {
    CURRENT.with(|c| c.borrow().get(&device).cloned())
}

/// PyTorch's `malloc` hook: allocates `size` bytes for device `device` in this thread's
/// current tag (`gpu_pager_use_tag`) and returns the device address. `stream` (the stream
/// torch will use the memory on) is not needed: a growing region maps the buffer before
/// this returns. Returns NULL on failure, with the reason in `gpu_pager_last_error()`: no
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
                    untagged(format!(
                        "gpu_pager_torch_malloc({size} bytes, device {d}): this thread has no \
                         current tag for device {d}, and allocations are never placed in a \
                         region silently; call gpu_pager_use_tag({d}, \"<tag>\") on this \
                         thread first"
                    ))
                })?;
            alloc_segment(d, &tag, size).map(|p| p as usize as *mut c_void)
        },
    )
}

/// Allocates a segment of `size` bytes for device `d` in region `tag` and records it for
/// [`free_segment`]; returns its device address. Refused (nothing allocated) for 0 bytes
/// and while the region is released: the caller would write into unmapped memory at once.
pub fn alloc_segment(d: usize, tag: &str, size: usize) -> Result<u64> {
    if size == 0 {
        return Err(Error::InvalidSize {
            tag: tag.to_owned(),
            reason: "an allocation of 0 bytes; ask for at least one".to_owned(),
        });
    }
    check_process()?;
    let pager = Pager::for_device(d)?;
    // Whole segments (torch asks for multiples of 2 MiB from 2 MiB up) start on a 2 MiB
    // boundary, as cudaMalloc's do; smaller ones at the default alignment.
    let align = if size >= SEGMENT_ALIGN {
        SEGMENT_ALIGN
    } else {
        gpu_pager::DEFAULT_ALIGN
    };
    let buf = pager.alloc_aligned(tag, size, align)?;
    match pager.ptr(&buf) {
        Ok(p) => {
            segments().insert(p, (d, buf));
            Ok(p)
        }
        Err(e) => {
            let _ = pager.free(&buf);
            Err(e)
        }
    }
}

/// The device of the segment at `addr` from [`alloc_segment`], if one starts there.
pub fn segment_device(addr: u64) -> Result<Option<usize>> {
    check_process()?;
    Ok(segments().get(&addr).map(|(d, _)| *d))
}

/// Frees the segment of device `d` at `addr` from [`alloc_segment`] (after work enqueued
/// on `stream`, if given, that may use it, where the free unmaps; the pager waits for the
/// whole device anyway). `size`, if known, is checked against the segment's (a mismatch is
/// logged).
pub fn free_segment(d: usize, addr: u64, size: Option<usize>, stream: Option<usize>) -> Result<()> {
    check_process()?;
    let pager = Pager::for_device(d)?;
    let buf = {
        let mut segments = segments();
        match segments.remove(&addr) {
            Some((on, buf)) if on == d => buf,
            other => {
                if let Some(seg) = other {
                    segments.insert(addr, seg);
                }
                return Err(untagged(format!(
                    "freeing {addr:#x} on device {d}: not a segment the allocator returned \
                     for that device, or freed already; nothing was freed"
                )));
            }
        }
    };
    if let Some(size) = size.filter(|&n| n != buf.len()) {
        log::warn!(
            "gpu-pager: free of {addr:#x} ({size} bytes): the buffer in `{}` has {} bytes; \
             freeing it",
            buf.tag(),
            buf.len()
        );
    }
    if let Some(stream) = stream.filter(|_| free_may_unmap(&pager, &buf)) {
        // Work enqueued on `stream` may still use the memory: wait for it before the pager
        // unmaps anything.
        pager
            .backend()
            .fence(RawStream(stream))
            .and_then(|f| f.wait())
            .map_err(|e| Error::backend(buf.tag(), "waiting for the allocator's stream", e))?;
    }
    pager.free(&buf)
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
        free_segment(d, ptr as usize as u64, Some(size), Some(stream as usize))
    });
    if code != gpu_pager_code::GPU_PAGER_OK {
        // SAFETY: `gpu_pager_last_error` returns this thread's NUL-terminated message.
        let msg = unsafe { std::ffi::CStr::from_ptr(boundary::last_message()) };
        log::error!("gpu-pager: {}", msg.to_string_lossy());
    }
}

/// Whether freeing `buf` can unmap physical memory: in a growing region a free unmaps the
/// buffer (the pager also waits for the whole device first; waiting for the allocator's
/// stream here keeps that ordering explicit); in a fixed region it is bookkeeping.
fn free_may_unmap(pager: &Pager, buf: &Buffer) -> bool {
    pager
        .info(buf.tag())
        .is_ok_and(|i| i.kind == gpu_pager::RegionKind::Growing)
}
