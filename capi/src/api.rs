//! The `gpu_pager_*` functions. Every body runs inside the panic guard
//! ([`crate::boundary::call`]); each returns `GPU_PAGER_OK` or an error code and keeps the
//! message for `gpu_pager_last_error()`.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use gpu_pager::backend::RawStream;
use gpu_pager::{
    Error, Lease, Pager, PagerConfig, RegionOptions, ReleaseOptions, Result, ResumeOptions,
};

use crate::boundary::{self, call, call_or, invalid, pager, required, untagged, write_out};
use crate::types::{
    GPU_PAGER_RESUME_KEEP_HOST_BACKUPS, gpu_pager_audit_totals, gpu_pager_code, gpu_pager_config,
    gpu_pager_copy_route, gpu_pager_device_info, gpu_pager_medium, gpu_pager_policy,
    gpu_pager_region_kind, gpu_pager_report, gpu_pager_stats,
};

/// The live buffer containing `ptr` in `pager`, and `ptr`'s offset in it.
pub(crate) fn buffer_containing(
    pager: &Pager,
    device: usize,
    ptr: u64,
) -> Result<(gpu_pager::Buffer, usize)> {
    pager.buffer_containing(ptr).ok_or_else(|| {
        untagged(format!(
            "{ptr:#x} is not inside a live buffer of device {device}'s pager (freed \
                 already, from another device, or not from gpu_pager_alloc or \
                 gpu_pager_torch_malloc); pass an address these returned, before freeing it"
        ))
    })
}

/// The version of the library, e.g. `"0.1.0"` (a static string).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The message of this thread's last failed call: what went wrong, naming the tag, and
/// what to do about it. `""` when no call failed since the thread started or since
/// `gpu_pager_clear_error()`. Kept until the next failure or clear on this thread
/// (successful calls leave it); the pointer is valid until then. Never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_last_error() -> *const c_char {
    boundary::last_message()
}

/// The message of this thread's last failed call (as [`gpu_pager_last_error`]), or `None`
/// when there is none; for Rust callers such as the Python extension.
pub fn last_error() -> Option<String> {
    // SAFETY: the pointer is this thread's NUL-terminated message, alive for this read.
    let msg = unsafe { CStr::from_ptr(boundary::last_message()) };
    (!msg.is_empty()).then(|| msg.to_string_lossy().into_owned())
}

/// The code of this thread's last failed call (`GPU_PAGER_OK` if none), as the failing call
/// returned it; for calls that return a pointer or nothing (`gpu_pager_torch_malloc`,
/// `gpu_pager_torch_free`).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_last_error_code() -> gpu_pager_code {
    boundary::last_code()
}

/// Forgets this thread's last error.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_clear_error() {
    boundary::clear_last();
}

/// The name of a code, e.g. `"NotResident"` for `GPU_PAGER_ERROR_NOT_RESIDENT`, `"Ok"` for
/// `GPU_PAGER_OK`, `"Unknown"` for a number that is no code (a static string).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_code_name(code: u32) -> *const c_char {
    static NAMES: OnceLock<BTreeMap<u32, CString>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        let mut m: BTreeMap<u32, CString> = gpu_pager::ErrorCode::ALL
            .into_iter()
            .filter_map(|c| Some((c.number(), CString::new(c.to_string()).ok()?)))
            .collect();
        m.insert(0, c"Ok".to_owned());
        m
    });
    names.get(&code).map_or(c"Unknown".as_ptr(), |n| n.as_ptr())
}

/// Opens device `device`'s pager (once per process; later calls return the same one) and
/// describes it into `*out`. Without a GPU, device 0 runs on the host backend
/// (`GPU_PAGER_BACKEND_HOST`; its capacity is `GPU_PAGER_HOST_CAPACITY` bytes if set, else
/// half the machine's memory, at most 32 GiB) and other devices fail with `GPU_PAGER_ERROR_BACKEND`. Every other call opens
/// the pager the same way on first use.
///
/// # Safety
/// `out` is NULL (an error) or valid for a write of a `gpu_pager_device_info`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_device(
    device: c_int,
    out: *mut gpu_pager_device_info,
) -> gpu_pager_code {
    call("gpu_pager_device", || {
        required(out, "out")?;
        let pager = pager(device)?;
        let backend = pager.backend();
        let info = backend.info();
        let mem = backend
            .mem_info()
            .map_err(|e| Error::backend_of(&[], "querying device memory", e))?;
        let value = gpu_pager_device_info {
            kind: gpu_pager_device_info::kind_of(info.kind),
            granularity: info.granularity as u64,
            total_bytes: mem.total as u64,
            free_bytes: mem.free as u64,
        };
        // SAFETY: `out` is non-NULL (checked) and valid for a write (the contract).
        unsafe { write_out(out, value) };
        Ok(())
    })
}

/// `gpu_pager_config`'s defaults: what a device's pager has unless `gpu_pager_configure`
/// chose otherwise.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_config_default() -> gpu_pager_config {
    PagerConfig::default().into()
}

/// Chooses device `device`'s settings before its first use (before any other call on the
/// device opens its pager). Until then a later call replaces them; once the pager exists,
/// the same settings are accepted and others fail with `GPU_PAGER_ERROR_INVALID_ARGUMENT`,
/// changing nothing. An unknown route fails the same way.
///
/// `config->size` must be what `gpu_pager_config_default()` set (`sizeof(gpu_pager_config)`
/// of the caller's header).
///
/// # Safety
/// `config` is NULL (an error) or valid for a read of `config->size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_configure(
    device: c_int,
    config: *const gpu_pager_config,
) -> gpu_pager_code {
    call("gpu_pager_configure", || {
        if config.is_null() {
            return Err(untagged(
                "config is NULL; pass the settings, starting from gpu_pager_config_default()"
                    .to_owned(),
            ));
        }
        // SAFETY: non-NULL (checked) and valid for a read of the caller's
        // gpu_pager_config, whose first field (offset 0) is its size (the contract).
        let size = unsafe { config.cast::<u64>().read() };
        let n = config_size(size, "config")?;
        let mut raw = std::mem::MaybeUninit::new(gpu_pager_config::from(PagerConfig::default()));
        // SAFETY: the caller's struct holds `n` bytes (its own size, checked to be at most
        // ours), and `raw` is a distinct local of at least `n` bytes, read as bytes only.
        unsafe {
            std::ptr::copy_nonoverlapping(config.cast::<u8>(), raw.as_mut_ptr().cast::<u8>(), n)
        };
        // A C `bool` may hold any byte; Rust's must be 0 or 1, so each is checked as a byte
        // before the struct is read as Rust's.
        for (offset, field) in [
            (
                std::mem::offset_of!(gpu_pager_config, skip_unchanged),
                "skip_unchanged",
            ),
            (
                std::mem::offset_of!(gpu_pager_config, verify_restore),
                "verify_restore",
            ),
            (
                std::mem::offset_of!(gpu_pager_config, poison_discards),
                "poison_discards",
            ),
        ] {
            // SAFETY: `offset` is a field's offset inside `raw`, so in bounds.
            let at = unsafe { raw.as_ptr().cast::<u8>().add(offset) };
            // SAFETY: that field's byte is initialized (the defaults, then the caller's
            // bytes); read as a plain byte.
            let byte = unsafe { at.read() };
            if byte > 1 {
                return Err(untagged(format!(
                    "config.{field} holds the byte {byte}, not a bool: set it to true or false"
                )));
            }
        }
        // SAFETY: every field is initialized and each bool holds 0 or 1 (checked above).
        let c = unsafe { raw.assume_init() };
        let route = |n: u32, field: &str| {
            gpu_pager_copy_route::from_number(n).ok_or_else(|| {
                untagged(format!(
                    "config.{field} = {n} is not a gpu_pager_copy_route; use \
                     GPU_PAGER_ROUTE_ENGINE, GPU_PAGER_ROUTE_KERNEL or GPU_PAGER_ROUTE_FASTEST"
                ))
            })
        };
        let chunk_bytes = usize::try_from(c.chunk_bytes).map_err(|_| {
            untagged(format!(
                "config.chunk_bytes = {} does not fit this machine's address space",
                c.chunk_bytes
            ))
        })?;
        Pager::configure(
            boundary::device(device)?,
            PagerConfig {
                chunk_bytes,
                skip_unchanged: c.skip_unchanged,
                verify_restore: c.verify_restore,
                save_route: route(c.save_route, "save_route")?,
                restore_route: route(c.restore_route, "restore_route")?,
                poison_discards: c.poison_discards,
                // A count past this machine's address space can never be reached: never.
                resident_warning_bytes: usize::try_from(c.resident_warning_bytes)
                    .unwrap_or(usize::MAX),
                ..PagerConfig::default()
            },
        )
    })
}

/// Chooses device `device`'s settings by name, as `gpu_pager_configure` does: `settings` is
/// `name=value` pairs separated by commas or spaces, e.g. `"chunk_bytes=64M,
/// skip_unchanged=false, save_route=kernel"`, the names as `gpu_pager_config`'s fields and
/// every setting added after it; sizes take `K`/`M`/`G`/`T` suffixes, switches
/// `true`/`false`, routes `engine`/`kernel`/`fastest`. Settings left out keep their
/// defaults. An unknown name or a bad value fails with `GPU_PAGER_ERROR_INVALID_ARGUMENT`
/// naming it, changing nothing.
///
/// # Safety
/// `settings` is NULL (an error) or a NUL-terminated string alive for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_configure_text(
    device: c_int,
    settings: *const c_char,
) -> gpu_pager_code {
    call("gpu_pager_configure_text", || {
        // SAFETY: NULL or NUL-terminated and alive for the call (the contract).
        let text = unsafe { boundary::text(settings, "settings") }?;
        Pager::configure(boundary::device(device)?, PagerConfig::parse(text)?)
    })
}

/// Opens device `device`'s pager and writes its settings into `*out`, sizes as the pager
/// rounded them: as many fields as `out->size` holds (initialize `*out` with
/// `gpu_pager_config_default()` first).
///
/// # Safety
/// `out` is NULL (an error) or valid for a read of its size and a write of `out->size`
/// bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_get_config(
    device: c_int,
    out: *mut gpu_pager_config,
) -> gpu_pager_code {
    call("gpu_pager_get_config", || {
        required(out, "out")?;
        // SAFETY: non-NULL (checked) and valid for a read of its size field, at offset 0
        // (the contract: initialized with gpu_pager_config_default()).
        let size = unsafe { out.cast::<u64>().read() };
        let n = config_size(size, "out")?;
        let mut value = gpu_pager_config::from(pager(device)?.config());
        value.size = size;
        // SAFETY: the caller's struct holds `n` bytes (its size, at most ours); plain data.
        unsafe {
            std::ptr::copy_nonoverlapping(
                std::ptr::from_ref(&value).cast::<u8>(),
                out.cast::<u8>(),
                n,
            )
        };
        Ok(())
    })
}

/// The bytes of a caller's `gpu_pager_config` of `size` (its `size` field) that this
/// library reads or writes: an error unless it is a size some version of the header had.
fn config_size(size: u64, what: &str) -> Result<usize> {
    let ours = std::mem::size_of::<gpu_pager_config>();
    match usize::try_from(size) {
        Ok(n) if (FIRST_CONFIG_SIZE..=ours).contains(&n) => Ok(n),
        _ if size > ours as u64 => Err(untagged(format!(
            "{what}.size = {size} is larger than this library's gpu_pager_config ({ours} \
             bytes): the program was built with a newer gpu_pager.h than the library it \
             runs with; update the library"
        ))),
        _ => Err(untagged(format!(
            "{what}.size = {size} is not a gpu_pager_config's size: start from \
             gpu_pager_config_default() (it sets size)"
        ))),
    }
}

/// The size of the first `gpu_pager_config` that had a size field (its fields up to
/// `resident_warning_bytes`): a caller's struct is at least this large.
const FIRST_CONFIG_SIZE: usize = 40;

/// Creates region `tag` of `bytes` (rounded up to the granularity) on device `device`,
/// resident, at a device address that never changes while it exists; stores that address
/// in `*base_out` unless `base_out` is NULL. `policy` is a `gpu_pager_policy`, `kind` a
/// `gpu_pager_region_kind`: `GPU_PAGER_FIXED` maps all `bytes`, `GPU_PAGER_GROWING` maps
/// memory only under live buffers (each `gpu_pager_alloc` / `gpu_pager_torch_malloc` maps
/// its buffer, each free unmaps it). `prepin` pins a `GPU_PAGER_PRESERVE` region's host
/// backup now, so that the first release does not pay for pinning. Creating an existing
/// tag again with the same kind, size and policy returns it; otherwise
/// `GPU_PAGER_ERROR_TAG_CONFLICT`. The backup is pinned host memory kept across cycles
/// (`gpu_pager_region_medium` chooses).
///
/// # Safety
/// `tag` is NULL (an error) or a NUL-terminated string; `base_out` is NULL or valid for a
/// write of a `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_region(
    device: c_int,
    tag: *const c_char,
    policy: u32,
    kind: u32,
    bytes: usize,
    prepin: bool,
    base_out: *mut u64,
) -> gpu_pager_code {
    // SAFETY: as this function's contract.
    unsafe {
        gpu_pager_region_medium(
            device,
            tag,
            policy,
            kind,
            bytes,
            prepin,
            gpu_pager_medium::GPU_PAGER_MEDIUM_PINNED as u32,
            base_out,
        )
    }
}

/// `gpu_pager_region` with the backup medium of a `GPU_PAGER_PRESERVE` region: `medium` is a
/// `gpu_pager_medium`. Other policies take `GPU_PAGER_MEDIUM_PINNED` (they have no backup).
/// A `GPU_PAGER_MEDIUM_FILE` region needs a backup directory by its first release
/// (`gpu_pager_set_backup_dir`).
///
/// # Safety
/// As `gpu_pager_region`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_region_medium(
    device: c_int,
    tag: *const c_char,
    policy: u32,
    kind: u32,
    bytes: usize,
    prepin: bool,
    medium: u32,
    base_out: *mut u64,
) -> gpu_pager_code {
    call("gpu_pager_region", || {
        // SAFETY: `tag` is NULL or NUL-terminated and alive for this call (the contract).
        let tag = unsafe { boundary::tag(tag, "tag") }?;
        let policy = enum_arg(
            tag,
            ("policy", policy),
            gpu_pager_policy::from_number(policy),
            (
                "gpu_pager_policy",
                "GPU_PAGER_PRESERVE, GPU_PAGER_DISCARD or GPU_PAGER_DISCARD_ZEROED",
            ),
        )?;
        let medium = enum_arg(
            tag,
            ("medium", medium),
            gpu_pager_medium::from_number(medium),
            (
                "gpu_pager_medium",
                "GPU_PAGER_MEDIUM_PINNED, GPU_PAGER_MEDIUM_HOST or GPU_PAGER_MEDIUM_FILE",
            ),
        )?;
        let kind = enum_arg(
            tag,
            ("kind", kind),
            gpu_pager_region_kind::from_number(kind),
            (
                "gpu_pager_region_kind",
                "GPU_PAGER_FIXED or GPU_PAGER_GROWING",
            ),
        )?;
        let options = RegionOptions {
            prepin,
            medium,
            kind,
            ..RegionOptions::default()
        };
        let info = pager(device)?.region_with(tag, bytes, policy, options)?;
        // SAFETY: `base_out` is NULL or valid for a write (the contract).
        unsafe { write_out(base_out, info.base) };
        Ok(())
    })
}

/// A C enum argument `(name, number)` as its Rust `value`, or an `InvalidArgument` that
/// names the C enum `(ctype, its values)` to pass instead.
fn enum_arg<T>(tag: &str, arg: (&str, u32), value: Option<T>, c: (&str, &str)) -> Result<T> {
    value.ok_or_else(|| {
        let ((name, n), (ctype, values)) = (arg, c);
        invalid(tag, format!("{name} {n} is not a {ctype}; pass {values}"))
    })
}

/// Makes `dir` (created if missing) the directory where device `device`'s new
/// `GPU_PAGER_MEDIUM_FILE` backups go, after checking that a file can be written there. A
/// pager starts with the directory in the environment variable `GPU_PAGER_BACKUP_DIR`.
/// Put it on a real disk, not tmpfs.
///
/// # Safety
/// `dir` is NULL (an error) or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_set_backup_dir(
    device: c_int,
    dir: *const c_char,
) -> gpu_pager_code {
    call("gpu_pager_set_backup_dir", || {
        // SAFETY: `dir` is NULL or NUL-terminated and alive for this call (the contract).
        let dir = unsafe { boundary::path(dir, "dir") }?;
        pager(device)?.set_backup_dir(dir)
    })
}

/// Removes region `tag` of device `device`: unmaps it and frees its backup and its address
/// range; its buffers become stale. `GPU_PAGER_ERROR_BUSY` while leased.
///
/// # Safety
/// `tag` is NULL (an error) or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_remove(device: c_int, tag: *const c_char) -> gpu_pager_code {
    call("gpu_pager_remove", || {
        // SAFETY: `tag` is NULL or NUL-terminated and alive for this call (the contract).
        let tag = unsafe { boundary::tag(tag, "tag") }?;
        pager(device)?.remove(tag)
    })
}

/// Allocates `bytes` in region `tag` of device `device` (256-byte aligned) and stores the
/// buffer's device address in `*ptr_out`. Works while the region is released too (the
/// address is stable; it is backed by memory once the region is resumed).
///
/// # Safety
/// `tag` is NULL (an error) or a NUL-terminated string; `ptr_out` is NULL (an error) or
/// valid for a write of a `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_alloc(
    device: c_int,
    tag: *const c_char,
    bytes: usize,
    ptr_out: *mut u64,
) -> gpu_pager_code {
    call("gpu_pager_alloc", || {
        // SAFETY: `tag` is NULL or NUL-terminated and alive for this call (the contract).
        let tag = unsafe { boundary::tag(tag, "tag") }?;
        required(ptr_out, "ptr_out")?;
        let pager = pager(device)?;
        let buf = pager.alloc(tag, bytes)?;
        // The buffer's own address: a region removed and made again by another thread in
        // between makes it stale instead of naming memory of the new region.
        let addr = pager.address(&buf)?;
        // SAFETY: `ptr_out` is non-NULL (checked) and valid for a write (the contract).
        unsafe { write_out(ptr_out, addr) };
        Ok(())
    })
}

/// Frees the buffer that starts at `ptr` on device `device`. An address that is not the
/// start of a live buffer (freed already, inside a buffer) is
/// `GPU_PAGER_ERROR_INVALID_ARGUMENT` and frees nothing. Buffers are named by their address,
/// and addresses are reused: once a buffer is freed (or its region removed), a later
/// allocation may get the same address, and a call with the old address then acts on the new
/// buffer. Free each buffer once, and forget the addresses of a removed region.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_free(device: c_int, ptr: u64) -> gpu_pager_code {
    call("gpu_pager_free", || {
        let d = boundary::device(device)?;
        let pager = pager(device)?;
        match buffer_containing(&pager, d, ptr)? {
            (buf, 0) => pager.free(&buf),
            (buf, offset) => Err(invalid(
                buf.tag(),
                format!(
                    "{ptr:#x} is {offset} bytes inside a buffer; free the address \
                     gpu_pager_alloc returned ({:#x})",
                    ptr - offset as u64
                ),
            )),
        }
    })
}

/// Copies `bytes` from host memory `src` to device address `dst` of device `device`,
/// through the pager: `dst .. dst + bytes` must lie in one live buffer, and the region must
/// be resident (`GPU_PAGER_ERROR_NOT_RESIDENT` otherwise, naming the tag; nothing faults).
/// Waits for the copy. Zero bytes copy nothing after the same checks of `dst` (as
/// `memcpy`, and as the Rust and Python calls do).
///
/// # Safety
/// `src` is readable for `bytes` bytes; NULL is an error unless `bytes` is 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_write(
    device: c_int,
    dst: u64,
    src: *const c_void,
    bytes: usize,
) -> gpu_pager_code {
    call("gpu_pager_write", || {
        if src.is_null() && bytes > 0 {
            return Err(untagged("src is NULL; pass the host bytes to copy"));
        }
        let d = boundary::device(device)?;
        let pager = pager(device)?;
        let (buf, offset) = buffer_containing(&pager, d, dst)?;
        // The range first: no slice is formed for a length beyond the buffer.
        within(&buf, offset, bytes)?;
        if bytes == 0 {
            return pager.write(&buf, offset, &[]);
        }
        // SAFETY: `src` is non-NULL (checked) and readable for `bytes` (the contract), a
        // length that fits in the buffer (checked), so in memory.
        let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), bytes) };
        pager.write(&buf, offset, data)
    })
}

/// Copies `bytes` from device address `src` of device `device` to host memory `dst`,
/// checked as `gpu_pager_write` is. Waits for the copy.
///
/// # Safety
/// `dst` is writable for `bytes` bytes; NULL is an error unless `bytes` is 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_read(
    device: c_int,
    src: u64,
    dst: *mut c_void,
    bytes: usize,
) -> gpu_pager_code {
    call("gpu_pager_read", || {
        if dst.is_null() && bytes > 0 {
            return Err(untagged("dst is NULL; pass where to copy the bytes"));
        }
        let d = boundary::device(device)?;
        let pager = pager(device)?;
        let (buf, offset) = buffer_containing(&pager, d, src)?;
        within(&buf, offset, bytes)?;
        if bytes == 0 {
            return pager.read(&buf, offset, &mut []);
        }
        // SAFETY: `dst` is non-NULL (checked) and writable for `bytes` (the contract), a
        // length that fits in the buffer (checked); the caller does not touch it meanwhile.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), bytes) };
        pager.read(&buf, offset, out)
    })
}

/// Marks (`on`) or unmarks the device bytes `ptr .. ptr + len` of device `device` as
/// **overwritten by the next update**: the caller promises to write every marked byte after
/// the next resume before reading it (a weight update that overwrites the parameters). The
/// range must lie inside one live buffer (from `gpu_pager_alloc` or
/// `gpu_pager_torch_malloc`, e.g. one tensor inside a torch segment); it may start anywhere
/// in it. Works whether the region is resident or released.
///
/// A release of a `GPU_PAGER_PRESERVE` region then neither hashes nor copies the marked
/// bytes, and the resume after it restores only what that release saved: marked bytes come
/// back mapped and writable at the same addresses with undefined contents (old values or
/// anything else), every unmarked byte bit-exact. A run of marked bytes shorter than 1 MiB
/// between two saved spans may be copied along (one copy costs less than two). Marks stay
/// across cycles until cleared with `on == false` or the buffer is freed (a new buffer starts
/// unmarked); clearing makes the next release save those bytes again. A mark set while the
/// region is released takes effect at the next release. Marks on `GPU_PAGER_DISCARD` and
/// `GPU_PAGER_DISCARD_ZEROED` regions are accepted and change nothing.
///
/// Errors: `GPU_PAGER_ERROR_INVALID_SIZE` for `len == 0`; `GPU_PAGER_ERROR_INVALID_ARGUMENT`
/// when `ptr` is not inside a live buffer of this device; `GPU_PAGER_ERROR_OUT_OF_RANGE`
/// when the range runs past the end of that buffer (nothing is marked).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_set_overwritten(
    device: c_int,
    ptr: u64,
    len: usize,
    on: bool,
) -> gpu_pager_code {
    call("gpu_pager_set_overwritten", || {
        let d = boundary::device(device)?;
        let pager = pager(device)?;
        let (buf, offset) = buffer_containing(&pager, d, ptr)?;
        if len == 0 {
            return Err(Error::InvalidSize {
                tag: buf.tag().to_owned(),
                reason: "gpu_pager_set_overwritten of 0 bytes; pass the length of the range \
                         to mark (a tensor's bytes)"
                    .to_owned(),
            });
        }
        let end = offset.checked_add(len).ok_or_else(|| Error::OutOfRange {
            tag: buf.tag().to_owned(),
            what: "buffer",
            offset,
            len,
            size: buf.len(),
        })?;
        pager.set_overwritten(&buf, offset..end, on)
    })
}

/// `OutOfRange` unless `bytes` from `offset` lie inside `buf`.
fn within(buf: &gpu_pager::Buffer, offset: usize, bytes: usize) -> Result<()> {
    if offset.checked_add(bytes).is_none_or(|end| end > buf.len()) {
        return Err(Error::OutOfRange {
            tag: buf.tag().to_owned(),
            what: "buffer",
            offset,
            len: bytes,
            size: buf.len(),
        });
    }
    Ok(())
}

/// Gives the physical memory of the `n_tags` regions `tags` of device `device` back to the
/// device: waits for outstanding device work, copies `GPU_PAGER_PRESERVE` regions to their
/// pinned host backups, unmapping each buffer as soon as its own copies are done. All or
/// nothing for what it saves: after a failed copy every region is resident again, its
/// saved contents restored; a region whose contents it does not keep (a
/// `GPU_PAGER_DISCARD` region, or one dropped) comes back as its resume would bring it,
/// its old contents gone. Regions already released are counted in `regions_already`.
/// Fills `*report` unless it is NULL.
///
/// # Safety
/// `tags` is NULL (an error unless `n_tags` is 0) or points to `n_tags` pointers, each
/// NULL (an error) or a NUL-terminated string; `report` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_release(
    device: c_int,
    tags: *const *const c_char,
    n_tags: usize,
    report: *mut gpu_pager_report,
) -> gpu_pager_code {
    call("gpu_pager_release", || {
        // SAFETY: as this function's contract.
        let tags = unsafe { boundary::tags(tags, n_tags) }?;
        let r = pager(device)?.release(&tags)?;
        // SAFETY: `report` is NULL or valid for a write (the contract).
        unsafe { write_out(report, gpu_pager_report::from(&r)) };
        Ok(())
    })
}

/// `gpu_pager_release` that drops, for this cycle, the contents of the `n_drop` regions
/// `drop` (each also one of `tags`) instead of backing them up: they come back zeroed at the
/// next resume (a `GPU_PAGER_DISCARD` region: uninitialised). On failure, as
/// `gpu_pager_release`.
///
/// # Safety
/// As `gpu_pager_release`, for `tags` and for `drop`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_release_dropping(
    device: c_int,
    tags: *const *const c_char,
    n_tags: usize,
    drop: *const *const c_char,
    n_drop: usize,
    report: *mut gpu_pager_report,
) -> gpu_pager_code {
    call("gpu_pager_release_dropping", || {
        // SAFETY: as this function's contract.
        let tags = unsafe { boundary::tags(tags, n_tags) }?;
        // SAFETY: as this function's contract.
        let drop = unsafe { boundary::tags(drop, n_drop) }?;
        let options = ReleaseOptions {
            drop: drop.into_iter().map(str::to_owned).collect(),
        };
        let r = pager(device)?.release_with(&tags, &options)?;
        // SAFETY: `report` is NULL or valid for a write (the contract).
        unsafe { write_out(report, gpu_pager_report::from(&r)) };
        Ok(())
    })
}

/// Maps physical memory back under the `n_tags` regions `tags` of device `device`, at the
/// same addresses, and restores `GPU_PAGER_PRESERVE` contents; returns when they are in
/// place. All or nothing: on `GPU_PAGER_ERROR_OUT_OF_MEMORY` (a trainer still holds the
/// memory) every region stays released with its backup and a later resume succeeds. Fills
/// `*report` unless it is NULL.
///
/// # Safety
/// As `gpu_pager_release`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_resume(
    device: c_int,
    tags: *const *const c_char,
    n_tags: usize,
    report: *mut gpu_pager_report,
) -> gpu_pager_code {
    call("gpu_pager_resume", || {
        // SAFETY: as this function's contract.
        let tags = unsafe { boundary::tags(tags, n_tags) }?;
        let r = pager(device)?.resume(&tags)?;
        // SAFETY: `report` is NULL or valid for a write (the contract).
        unsafe { write_out(report, gpu_pager_report::from(&r)) };
        Ok(())
    })
}

/// `gpu_pager_resume` with `flags`: `GPU_PAGER_RESUME_KEEP_HOST_BACKUPS` keeps the host
/// memory of `GPU_PAGER_MEDIUM_HOST` backups after restoring them. Unknown flag bits are
/// `GPU_PAGER_ERROR_INVALID_ARGUMENT`.
///
/// # Safety
/// As `gpu_pager_release`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_resume_with(
    device: c_int,
    tags: *const *const c_char,
    n_tags: usize,
    flags: u32,
    report: *mut gpu_pager_report,
) -> gpu_pager_code {
    call("gpu_pager_resume_with", || {
        if flags & !GPU_PAGER_RESUME_KEEP_HOST_BACKUPS != 0 {
            return Err(untagged(format!(
                "flags {flags:#x} has unknown bits; pass 0 or GPU_PAGER_RESUME_KEEP_HOST_BACKUPS"
            )));
        }
        // SAFETY: as this function's contract.
        let tags = unsafe { boundary::tags(tags, n_tags) }?;
        let options = ResumeOptions {
            keep_host_backups: flags & GPU_PAGER_RESUME_KEEP_HOST_BACKUPS != 0,
        };
        let r = pager(device)?.resume_with(&tags, options)?;
        // SAFETY: `report` is NULL or valid for a write (the contract).
        unsafe { write_out(report, gpu_pager_report::from(&r)) };
        Ok(())
    })
}

/// `gpu_pager_resume`, but the restore copies are enqueued on the caller's CUDA `stream`
/// (a `cudaStream_t`/`CUstream` of device `device`'s primary context; NULL is the legacy
/// default stream) and the call returns once mapping is done: kernels enqueued next on
/// `stream` see the restored contents. Pager reads and writes wait for the restore. On the
/// host backend the copies are synchronous.
///
/// # Safety
/// As `gpu_pager_release`; `stream` is NULL or a live stream of that device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_resume_on(
    device: c_int,
    tags: *const *const c_char,
    n_tags: usize,
    stream: *mut c_void,
    report: *mut gpu_pager_report,
) -> gpu_pager_code {
    call("gpu_pager_resume_on", || {
        // SAFETY: as this function's contract.
        let tags = unsafe { boundary::tags(tags, n_tags) }?;
        let r = pager(device)?.resume_on(&tags, RawStream(stream as usize))?;
        // SAFETY: `report` is NULL or valid for a write (the contract).
        unsafe { write_out(report, gpu_pager_report::from(&r)) };
        Ok(())
    })
}

/// Leases: id → lease, for handles that C can hold and that go stale visibly.
static LEASES: Mutex<BTreeMap<u64, Lease>> = Mutex::new(BTreeMap::new());
static NEXT_LEASE: AtomicU64 = AtomicU64::new(1);

/// Keeps the `n_tags` regions `tags` of device `device` resident until
/// `gpu_pager_unlease(*lease_out)`: releasing one fails with `GPU_PAGER_ERROR_BUSY`
/// meanwhile. `GPU_PAGER_ERROR_NOT_RESIDENT` if one is released now. Lease handles are
/// never 0 and never reused.
///
/// # Safety
/// As `gpu_pager_release`; `lease_out` is NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_lease(
    device: c_int,
    tags: *const *const c_char,
    n_tags: usize,
    lease_out: *mut u64,
) -> gpu_pager_code {
    call("gpu_pager_lease", || {
        required(lease_out, "lease_out")?;
        // SAFETY: as this function's contract.
        let tags = unsafe { boundary::tags(tags, n_tags) }?;
        let lease = pager(device)?.lease(&tags)?;
        let id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
        LEASES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, lease);
        // SAFETY: `lease_out` is non-NULL (checked) and valid for a write (the contract).
        unsafe { write_out(lease_out, id) };
        Ok(())
    })
}

/// Ends a lease from `gpu_pager_lease`. A handle that is not live (0, ended already,
/// never handed out) is `GPU_PAGER_ERROR_INVALID_ARGUMENT` and changes nothing.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_unlease(lease: u64) -> gpu_pager_code {
    call("gpu_pager_unlease", || {
        let taken = LEASES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&lease);
        // Dropped here, outside the table's lock: that gives the regions back.
        match taken {
            Some(l) => {
                drop(l);
                Ok(())
            }
            None => Err(untagged(format!(
                "lease {lease} is not live (ended already, or not from gpu_pager_lease); \
                     end each lease once"
            ))),
        }
    })
}

/// Fills `*out` with device `device`'s statistics over all its regions.
///
/// # Safety
/// `out` is NULL (an error) or valid for a write of a `gpu_pager_stats`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_get_stats(
    device: c_int,
    out: *mut gpu_pager_stats,
) -> gpu_pager_code {
    call("gpu_pager_get_stats", || {
        required(out, "out")?;
        let s = pager(device)?.stats();
        // SAFETY: `out` is non-NULL (checked) and valid for a write (the contract).
        unsafe { write_out(out, gpu_pager_stats::from(&s)) };
        Ok(())
    })
}

thread_local! {
    /// The text `gpu_pager_take_deferred_errors` last returned on this thread.
    static DEFERRED: std::cell::RefCell<CString> = std::cell::RefCell::new(CString::default());
    /// The table `gpu_pager_audit` last returned on this thread.
    static AUDIT: std::cell::RefCell<CString> = std::cell::RefCell::new(CString::default());
}

/// Keeps `text` in `slot` (this thread's) and returns it as a C string valid until the
/// slot's next use on this thread (NUL bytes become spaces).
fn keep_text(
    slot: &'static std::thread::LocalKey<std::cell::RefCell<CString>>,
    text: String,
) -> *const c_char {
    let text = CString::new(text.replace('\0', " ")).unwrap_or_default();
    slot.try_with(|d| {
        *d.borrow_mut() = text;
        d.borrow().as_ptr()
    })
    .unwrap_or(std::ptr::null())
}

/// Where device `device`'s memory is now: fills `*out` (unless NULL) with the totals and
/// returns the whole audit as a table (one line per region: tag, state, policy, mapped,
/// reserved and backup bytes; then the device's use and what lies outside every region).
/// The text stays valid until this thread's next call of this function. NULL on failure
/// (`gpu_pager_last_error` says why).
///
/// # Safety
/// `out` is NULL or valid for a write of a `gpu_pager_audit_totals`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_audit(
    device: c_int,
    out: *mut gpu_pager_audit_totals,
) -> *const c_char {
    call_or("gpu_pager_audit", std::ptr::null(), || {
        let a = pager(device)?.audit()?;
        let totals = gpu_pager_audit_totals {
            device_total_bytes: a.device_total_bytes as u64,
            device_free_bytes: a.device_free_bytes as u64,
            mapped_bytes: a.mapped_bytes() as u64,
            outside_bytes: a.outside_bytes() as u64,
            regions: a.regions.len() as u64,
            this_process_bytes: a.this_process_bytes().map_or(u64::MAX, |b| b as u64),
            other_processes_bytes: a.other_processes_bytes().map_or(u64::MAX, |b| b as u64),
        };
        // SAFETY: NULL (skipped) or valid for a write (the contract).
        unsafe { write_out(out, totals) };
        Ok(keep_text(&AUDIT, a.to_string()))
    })
}

/// Takes device `device`'s failures that no call could return (a driver or OS call in a
/// cleanup; `gpu_pager_stats.deferred_errors` counts them), oldest first, one per line;
/// `""` when there are none. The text stays valid until this thread's next call of this
/// function. NULL on failure (`gpu_pager_last_error` says why).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_take_deferred_errors(device: c_int) -> *const c_char {
    call_or("gpu_pager_take_deferred_errors", std::ptr::null(), || {
        let text = pager(device)?.take_deferred_errors().join("\n");
        Ok(keep_text(&DEFERRED, text))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_config_size_stays_the_first_fields_size() {
        let first = std::mem::offset_of!(gpu_pager_config, resident_warning_bytes)
            + std::mem::size_of::<u64>();
        assert_eq!(
            FIRST_CONFIG_SIZE, first,
            "fields are only ever added at the end"
        );
        assert!(std::mem::size_of::<gpu_pager_config>() >= FIRST_CONFIG_SIZE);
        assert_eq!(std::mem::offset_of!(gpu_pager_config, size), 0);
    }

    #[test]
    fn a_config_of_an_unknown_size_is_refused_in_words() {
        let mut c = gpu_pager_config_default();
        for (size, words) in [
            (0, "start from gpu_pager_config_default()"),
            (39, "start from gpu_pager_config_default()"),
            (4096, "built with a newer gpu_pager.h"),
        ] {
            c.size = size;
            // SAFETY: a valid config (its size field is what is tested).
            let code = unsafe { gpu_pager_configure(0, &c) };
            assert_eq!(code, gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT);
            // SAFETY: this thread's NUL-terminated message.
            let msg = unsafe { std::ffi::CStr::from_ptr(gpu_pager_last_error()) };
            assert!(msg.to_string_lossy().contains(words), "{size}: {msg:?}");
        }
    }

    #[test]
    fn every_code_has_its_name() {
        for c in gpu_pager::ErrorCode::ALL {
            // SAFETY: gpu_pager_code_name returns a static NUL-terminated string.
            let name = unsafe { std::ffi::CStr::from_ptr(gpu_pager_code_name(c.number())) };
            assert_eq!(name.to_str().unwrap(), c.to_string());
        }
    }
}
