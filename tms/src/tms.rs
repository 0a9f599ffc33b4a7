//! The C surface of the torch_memory_saver drop-in (`gpu_pager_tms_*`): what
//! torch_memory_saver 0.0.10 keeps per thread and per process, on gpu-pager's regions.
//!
//! torch_memory_saver routes allocations by a per-thread config: whether the thread is in a
//! region ("interesting region"), its tag, and how the contents survive a pause (CPU backup
//! in pinned or "mmap" memory, disk backup, or none). Each thread starts from the
//! environment (`TMS_INIT_ENABLE`, `TMS_INIT_ENABLE_CPU_BACKUP`,
//! `TMS_INIT_CPU_BACKUP_BACKEND`, `TMS_INIT_ENABLE_DISK_BACKUP`): with `TMS_INIT_ENABLE=1`
//! every allocation of the process from its start is pausable (whole-process mode).
//!
//! Here a (tag, kind of backup) pair is a growing region of the device's pager:
//! - no backup: `Policy::Discard`; pinned: `Policy::Preserve` with `Medium::Pinned`;
//!   mmap: `Medium::Host` (host memory given back after each resume unless retained);
//!   disk: `Medium::File`;
//! - the first kind used with a tag gets the tag as its region name, later kinds
//!   `tag#discard`, `tag#pinned`, `tag#host` or `tag#file`; pausing or resuming a tag
//!   moves all of them, on every device; no tag moves every region made here.
//!
//! Allocations reach it two ways, both sharing the segment table of the torch hooks:
//! PyTorch's pluggable allocator ([`gpu_pager_tms_torch_malloc`] with
//! `gpu_pager_torch_free`), and the preload library's `cudaMalloc`/`cudaFree`
//! ([`gpu_pager_tms_cuda_malloc`], [`gpu_pager_tms_cuda_free`]), which pass everything not
//! routed here to the CUDA runtime.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};

use gpu_pager::{
    BackupFiles, Error, Medium, Pager, Policy, RegionOptions, Result, ResumeOptions, State,
};

use gpu_pager_capi::boundary::{self, call, call_or, invalid, untagged, write_out};
use gpu_pager_capi::{alloc_segment, check_process, free_segment, gpu_pager_code, segment_device};

/// How a routed allocation's contents survive a pause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Keep {
    /// Not at all (no backup).
    Discard,
    /// Pinned host memory, kept across cycles.
    Pinned,
    /// Host memory given back after each resume (torch_memory_saver's "mmap").
    Host,
    /// A file (torch_memory_saver's disk backup).
    File,
}

impl Keep {
    fn policy(self) -> (Policy, Medium) {
        match self {
            Keep::Discard => (Policy::Discard, Medium::Pinned),
            Keep::Pinned => (Policy::Preserve, Medium::Pinned),
            Keep::Host => (Policy::Preserve, Medium::Host),
            Keep::File => (Policy::Preserve, Medium::File),
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Keep::Discard => "discard",
            Keep::Pinned => "pinned",
            Keep::Host => "host",
            Keep::File => "file",
        }
    }
}

/// A thread's torch_memory_saver config.
#[derive(Debug, Clone)]
struct Route {
    enabled: bool,
    tag: CString,
    cpu_backup: bool,
    /// The CPU backup backend is "mmap" (else "pinned").
    host: bool,
    disk: bool,
}

impl Route {
    /// A new thread's config, from the environment as torch_memory_saver reads it.
    fn from_env() -> Route {
        Route {
            enabled: env_flag("TMS_INIT_ENABLE"),
            tag: c"default".to_owned(),
            cpu_backup: env_flag("TMS_INIT_ENABLE_CPU_BACKUP"),
            host: std::env::var("TMS_INIT_CPU_BACKUP_BACKEND").is_ok_and(|v| v == "mmap"),
            disk: env_flag("TMS_INIT_ENABLE_DISK_BACKUP"),
        }
    }

    fn keep(&self) -> Keep {
        match (self.disk, self.cpu_backup, self.host) {
            (true, _, _) => Keep::File,
            (false, true, true) => Keep::Host,
            (false, true, false) => Keep::Pinned,
            (false, false, _) => Keep::Discard,
        }
    }
}

/// torch_memory_saver's reading of a boolean variable: `1`, `true`, `yes` (any case of
/// the last two as it spells them) are true; anything else, or unset, false.
fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| matches!(v.as_str(), "1" | "true" | "TRUE" | "yes" | "YES"))
}

thread_local! {
    static ROUTE: RefCell<Route> = RefCell::new(Route::from_env());
}

/// Whether a resume keeps the CPU backups (torch_memory_saver's `retain_cpu_backup`,
/// initially `TMS_RETAIN_CPU_BACKUP`).
static RETAIN: LazyLock<AtomicBool> =
    LazyLock::new(|| AtomicBool::new(env_flag("TMS_RETAIN_CPU_BACKUP")));

/// Bytes of device memory a routed allocation must leave free (torch_memory_saver's
/// `memory_margin_bytes`; 0: none).
static MARGIN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A region made here.
#[derive(Debug)]
struct Made {
    /// The torch_memory_saver tag it holds.
    tag: String,
    /// Whether torch_memory_saver would say it has a CPU backup now: since its last pause,
    /// and after a resume that retained it.
    exposed: bool,
}

/// Region names by (tag, kind of backup), the same on every device.
static NAMES: Mutex<BTreeMap<(String, Keep), String>> = Mutex::new(BTreeMap::new());
/// The regions made here, by (device, name).
static MADE: Mutex<BTreeMap<(usize, String), Made>> = Mutex::new(BTreeMap::new());
/// The directory of disk backups (`set_disk_backup_dir`, else `TMS_DISK_BACKUP_DIR`, else
/// `/tmp`, as torch_memory_saver).
static DISK_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The region name of (`tag`, `keep`), chosen on first use and the same from then on, one
/// to one whatever characters tags hold: the tag itself for the first kind of backup used
/// with it, else `tag#<kind>` (`#discard`, `#pinned`, `#host`, `#file`), followed by `#2`,
/// `#3`, ... while that name belongs to another pair (the user's tag `x#pinned` and the
/// pinned kind of tag `x`, say). The empty tag always takes a suffix.
fn name_for(tag: &str, keep: Keep) -> String {
    let mut names = locked(&NAMES);
    if let Some(n) = names.get(&(tag.to_owned(), keep)) {
        return n.clone();
    }
    let taken = |n: &String| n.is_empty() || names.values().any(|m| m == n);
    let plain = std::iter::once(tag.to_owned());
    let suffixed = (1u64..).map(|k| match k {
        1 => format!("{tag}#{}", keep.suffix()),
        k => format!("{tag}#{}#{k}", keep.suffix()),
    });
    let first = !names.keys().any(|(t, _)| t == tag);
    let name = plain
        .filter(|_| first)
        .chain(suffixed)
        .find(|n| !taken(n))
        .unwrap_or_default();
    names.insert((tag.to_owned(), keep), name.clone());
    name
}

/// The region of `route` on device `d`, created (growing) on first use.
fn region_for(d: usize, route: &Route) -> Result<String> {
    let tag = route.tag.to_str().map_err(|_| {
        invalid(
            &route.tag.to_string_lossy(),
            "the tag is not UTF-8; tags are UTF-8 names",
        )
    })?;
    let keep = route.keep();
    let name = name_for(tag, keep);
    let pager = Pager::for_device(d)?;
    // Made here and still there (a region removed behind the façade's back is made again).
    if locked(&MADE).contains_key(&(d, name.clone())) && pager.info(&name).is_ok() {
        return Ok(name);
    }
    if keep == Keep::File {
        // The drop-in's own setting wins over the pager's GPU_PAGER_BACKUP_DIR; its files
        // are named, one per backup, as torch_memory_saver's are.
        let explicit = explicit_disk_dir();
        let named = pager.backup_files() == BackupFiles::Named;
        match (explicit, pager.backup_dir()) {
            (Some(dir), Some(now)) if dir == now && named => {}
            (Some(dir), _) => pager.set_backup_files(dir, BackupFiles::Named)?,
            (None, None) => pager.set_backup_files(disk_dir(), BackupFiles::Named)?,
            (None, Some(_)) => {}
        }
    }
    let (policy, medium) = keep.policy();
    let options = RegionOptions {
        medium,
        ..RegionOptions::GROWING
    };
    pager.region_with(&name, 0, policy, options)?;
    locked(&MADE).insert(
        (d, name.clone()),
        Made {
            tag: tag.to_owned(),
            exposed: false,
        },
    );
    Ok(name)
}

fn disk_dir() -> PathBuf {
    explicit_disk_dir().unwrap_or_else(|| PathBuf::from("/tmp"))
}

/// The directory the drop-in was told to use: `set_disk_backup_dir`, else
/// `TMS_DISK_BACKUP_DIR` (both win over the pager's `GPU_PAGER_BACKUP_DIR`).
fn explicit_disk_dir() -> Option<PathBuf> {
    locked(&DISK_DIR).clone().or_else(|| {
        std::env::var_os("TMS_DISK_BACKUP_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
    })
}

/// Allocates `size` bytes on device `d` as this thread's config says, or `None` when the
/// thread is not in a region.
fn routed_alloc(d: usize, size: usize) -> Result<Option<u64>> {
    check_process()?;
    let Some(route) = with_route(|r| r.clone()).filter(|r| r.enabled) else {
        return Ok(None);
    };
    let name = region_for(d, &route)?;
    let margin = MARGIN.load(Ordering::Relaxed) as usize;
    if margin > 0 {
        let pager = Pager::for_device(d)?;
        let free = pager
            .backend()
            .mem_info()
            .map_err(|e| Error::backend(&name, "querying free device memory", e))?
            .free;
        if free < size.saturating_add(margin) {
            return Err(Error::OutOfMemory {
                tag: name,
                during: "an allocation within the memory margin",
                requested: size.saturating_add(margin),
                free,
            });
        }
    }
    alloc_segment(d, &name, size).map(Some)
}

/// The regions made here whose tag is `tag` (all for `None`), by device.
fn family(tag: Option<&str>) -> BTreeMap<usize, Vec<String>> {
    let mut out: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for ((d, name), m) in locked(&MADE).iter() {
        if tag.is_none_or(|t| t == m.tag) {
            out.entry(*d).or_default().push(name.clone());
        }
    }
    out
}

/// Moves the regions of `tag` (every region made here for `None`) on every device: a pause
/// (`release`) or a resume. A device that fails does not stop the others; the first
/// failure is returned.
fn move_family(tag: Option<&str>, release: bool) -> Result<()> {
    check_process()?;
    let retain = RETAIN.load(Ordering::Relaxed);
    let mut first = None;
    for (d, mut names) in family(tag) {
        let pager = match Pager::for_device(d) {
            Ok(p) => p,
            Err(e) => {
                first.get_or_insert(e);
                continue;
            }
        };
        // Regions removed since (through the pager itself) are forgotten.
        let live = pager.tags();
        names.retain(|n| {
            let there = live.contains(n);
            if !there {
                locked(&MADE).remove(&(d, n.clone()));
            }
            there
        });
        let tags: Vec<&str> = names.iter().map(String::as_str).collect();
        let moved = if release {
            pager.release(&tags)
        } else {
            let options = ResumeOptions {
                keep_host_backups: retain,
            };
            pager.resume_with(&tags, options)
        };
        match moved {
            Ok(_) => {
                let mut made = locked(&MADE);
                for n in &names {
                    if let Some(m) = made.get_mut(&(d, n.clone())) {
                        m.exposed = release || retain;
                    }
                }
            }
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    first.map_or(Ok(()), Err)
}

/// Runs `f` on this thread's route; `None` once the thread's locals are gone (a call from a
/// thread-exit destructor), so that no panic reaches C.
fn with_route<T>(f: impl FnOnce(&mut Route) -> T) -> Option<T> {
    ROUTE
        .try_with(|r| r.try_borrow_mut().ok().map(|mut r| f(&mut r)))
        .ok()
        .flatten()
}

/// Enters (`true`) or leaves this thread's region: while in one, allocations are routed
/// to gpu-pager (torch_memory_saver's `tms_set_interesting_region`).
pub fn set_enabled(on: bool) {
    with_route(|r| r.enabled = on);
}

/// Whether this thread is in a region (torch_memory_saver's `tms_get_interesting_region`).
pub fn enabled() -> bool {
    with_route(|r| r.enabled).unwrap_or(false)
}

/// The longest tag `gpu_pager_tms_set_tag` (and [`set_tag`]) takes, in bytes: region names
/// are the tag and a suffix of at most 32 bytes, within gpu-pager's 256.
pub const GPU_PAGER_TMS_TAG_MAX_BYTES: usize = 224;
const _: () = assert!(GPU_PAGER_TMS_TAG_MAX_BYTES + 32 == gpu_pager::MAX_TAG_BYTES);

/// Sets this thread's tag: any UTF-8 string of at most [`GPU_PAGER_TMS_TAG_MAX_BYTES`] bytes without a
/// NUL, the empty one included (its allocations are paused by a pause of every tag, as
/// torch_memory_saver's). A longer one is `InvalidArgument` and changes nothing.
pub fn set_tag(tag: &str) -> Result<()> {
    if tag.len() > GPU_PAGER_TMS_TAG_MAX_BYTES {
        return Err(untagged(format!(
            "a tag of {} bytes (starting {:?}); the drop-in's tags hold at most \
             {GPU_PAGER_TMS_TAG_MAX_BYTES} bytes (its region names add a suffix to the tag): pass a shorter \
             tag",
            tag.len(),
            tag.chars().take(16).collect::<String>()
        )));
    }
    let tag = CString::new(tag).map_err(|_| invalid(tag, "the tag holds a NUL byte"))?;
    with_route(|r| r.tag = tag);
    Ok(())
}

/// This thread's tag (initially `default`).
pub fn tag() -> String {
    with_route(|r| r.tag.to_string_lossy().into_owned()).unwrap_or_else(|| "default".to_owned())
}

/// Whether this thread's allocations keep a CPU backup across a pause.
pub fn set_cpu_backup(on: bool) {
    with_route(|r| r.cpu_backup = on);
}

/// See [`set_cpu_backup`].
pub fn cpu_backup() -> bool {
    with_route(|r| r.cpu_backup).unwrap_or(false)
}

/// Sets this thread's CPU backup backend: `"pinned"` (pinned host memory kept across
/// cycles) or `"mmap"` (host memory given back after each resume). Anything else is
/// `InvalidArgument` and changes nothing.
pub fn set_cpu_backend(backend: &str) -> Result<()> {
    let host = match backend {
        "pinned" => false,
        "mmap" => true,
        other => {
            return Err(untagged(format!(
                "cpu_backup_backend must be 'pinned' or 'mmap', not {other:?}"
            )));
        }
    };
    with_route(|r| r.host = host);
    Ok(())
}

/// This thread's CPU backup backend, `"pinned"` or `"mmap"`.
pub fn cpu_backend() -> &'static CStr {
    if with_route(|r| r.host).unwrap_or(false) {
        c"mmap"
    } else {
        c"pinned"
    }
}

/// Whether this thread's allocations keep a disk backup across a pause (it takes
/// precedence over a CPU backup).
pub fn set_disk_backup(on: bool) {
    with_route(|r| r.disk = on);
}

/// See [`set_disk_backup`].
pub fn disk_backup() -> bool {
    with_route(|r| r.disk).unwrap_or(false)
}

/// Sets the directory of disk backups for every device (created if missing, and checked by
/// writing a file there), before or after the first allocation; it wins over
/// `GPU_PAGER_BACKUP_DIR` and `TMS_DISK_BACKUP_DIR`. Backups made before stay where they
/// are. An empty path is `InvalidArgument` and changes nothing.
pub fn set_disk_dir(dir: &Path) -> Result<()> {
    check_process()?;
    if dir.as_os_str().is_empty() {
        return Err(untagged(
            "the disk backup directory is empty; pass a directory on a real disk",
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| {
        untagged(format!(
            "the disk backup directory {} cannot be created: {e}; pass a writable directory \
             on a real disk",
            dir.display()
        ))
    })?;
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
    for (_, p) in gpu_pager::registry::pagers() {
        p.set_backup_files(&dir, BackupFiles::Named)?;
    }
    *locked(&DISK_DIR) = Some(dir);
    Ok(())
}

/// Routed allocations that would leave fewer than `bytes` of the device free fail as out of
/// memory instead (torch_memory_saver's `memory_margin_bytes`); 0 turns the margin off.
pub fn set_margin(bytes: u64) {
    MARGIN.store(bytes, Ordering::Relaxed);
}

/// Whether resumes keep the CPU backups (torch_memory_saver's `retain_cpu_backup`,
/// process-wide; initially `TMS_RETAIN_CPU_BACKUP`).
pub fn set_retain(on: bool) {
    RETAIN.store(on, Ordering::Relaxed);
}

/// See [`set_retain`].
pub fn retain() -> bool {
    RETAIN.load(Ordering::Relaxed)
}

/// Pauses the regions of `tag` (`None` or empty: every region made here) on every device:
/// waits for device work, backs up what keeps a backup, gives the memory back. Idempotent.
pub fn pause(tag: Option<&str>) -> Result<()> {
    move_family(tag.filter(|t| !t.is_empty()), true)
}

/// Resumes the regions of `tag` (`None` or empty: every region made here) on every device,
/// restoring what has a backup; CPU backups are then given back unless retained.
/// Idempotent. Out of memory loses nothing: a later resume succeeds.
pub fn resume(tag: Option<&str>) -> Result<()> {
    move_family(tag.filter(|t| !t.is_empty()), false)
}

/// The host address of the CPU backup of the `size` device bytes at `ptr`, while their
/// region is paused (or resumed with its backup retained); `None` otherwise (no backup, a
/// disk backup, not a routed allocation). The memory stays gpu-pager's: the next pause
/// overwrites it and a resume that does not retain it may give it back.
pub fn backup_pointer(ptr: u64, size: usize) -> Result<Option<u64>> {
    check_process()?;
    for (d, pager) in gpu_pager::registry::pagers() {
        let Some((buf, offset)) = pager.buffer_containing(ptr) else {
            continue;
        };
        let exposed = locked(&MADE)
            .get(&(d, buf.tag().to_owned()))
            .map(|m| m.exposed);
        let resident = pager.info(buf.tag())?.state == State::Resident;
        if resident && exposed != Some(true) {
            return Ok(None);
        }
        if offset.checked_add(size).is_none_or(|end| end > buf.len()) {
            return Ok(None);
        }
        return pager.backup_ptr(&buf, offset, size);
    }
    Ok(None)
}

// The C functions of the drop-in (include/gpu_pager_tms.h), for its preload library; each
// is the Rust function above behind the C ABI's boundary.

/// Enters (`true`) or leaves this thread's region: while in one, its allocations are
/// routed to gpu-pager.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_set_enabled(on: bool) {
    set_enabled(on);
}

/// Whether this thread is in a region.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_enabled() -> bool {
    enabled()
}

/// Sets this thread's tag (any UTF-8 string, the empty one included). NULL, a string that is not UTF-8 and one of
/// more than [`GPU_PAGER_TMS_TAG_MAX_BYTES`] bytes are `GPU_PAGER_ERROR_INVALID_ARGUMENT`
/// and change nothing.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_tms_set_tag(tag: *const c_char) -> gpu_pager_code {
    call("gpu_pager_tms_set_tag", || {
        // SAFETY: NULL or NUL-terminated and alive for this call (the contract).
        set_tag(unsafe { boundary::tag(tag, "tag") }?)
    })
}

/// This thread's tag (initially `default`); valid until the thread's next
/// `gpu_pager_tms_set_tag`. Never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_tag() -> *const c_char {
    // The CString's heap buffer stays where it is until the route's tag is replaced.
    with_route(|r| r.tag.as_ptr()).unwrap_or(c"default".as_ptr())
}

/// Whether this thread's allocations keep a CPU backup across a pause.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_set_cpu_backup(on: bool) {
    set_cpu_backup(on);
}

/// Whether this thread's allocations keep a CPU backup across a pause.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_cpu_backup() -> bool {
    cpu_backup()
}

/// Sets this thread's CPU backup backend: `"pinned"` (kept across cycles) or `"mmap"`
/// (given back after each resume); anything else is `GPU_PAGER_ERROR_INVALID_ARGUMENT` and changes nothing.
///
/// # Safety
/// `backend` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_tms_set_cpu_backend(backend: *const c_char) -> gpu_pager_code {
    call("gpu_pager_tms_set_cpu_backend", || {
        // SAFETY: NULL or NUL-terminated and alive for this call (the contract).
        set_cpu_backend(unsafe { boundary::tag(backend, "backend") }?)
    })
}

/// This thread's CPU backup backend, `"pinned"` or `"mmap"` (a static string).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_cpu_backend() -> *const c_char {
    cpu_backend().as_ptr()
}

/// Whether this thread's allocations keep a disk backup across a pause (it takes
/// precedence over a CPU backup).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_set_disk_backup(on: bool) {
    set_disk_backup(on);
}

/// Whether this thread's allocations keep a disk backup across a pause.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_disk_backup() -> bool {
    disk_backup()
}

/// Sets the directory of disk backups for every device (created if missing), before or
/// after the first allocation; it wins over `GPU_PAGER_BACKUP_DIR` and
/// `TMS_DISK_BACKUP_DIR`. An empty path is `GPU_PAGER_ERROR_INVALID_ARGUMENT`.
///
/// # Safety
/// `dir` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_tms_set_disk_dir(dir: *const c_char) -> gpu_pager_code {
    call("gpu_pager_tms_set_disk_dir", || {
        // SAFETY: NULL or NUL-terminated and alive for this call (the contract).
        set_disk_dir(unsafe { boundary::path(dir, "dir") }?)
    })
}

/// Routed allocations that would leave fewer than `bytes` of the device free fail as out of
/// memory instead; 0 turns the margin off.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_set_margin(bytes: u64) {
    set_margin(bytes);
}

/// Whether resumes keep the CPU backups (process-wide; initially `TMS_RETAIN_CPU_BACKUP`).
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_set_retain(on: bool) {
    set_retain(on);
}

/// Whether resumes keep the CPU backups.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_retain() -> bool {
    retain()
}

/// Pauses the regions of `tag` (NULL or empty: every region made here) on every device:
/// waits for device work, backs up what keeps a backup, gives the memory back. Idempotent.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_tms_pause(tag: *const c_char) -> gpu_pager_code {
    call("gpu_pager_tms_pause", || {
        // SAFETY: as this function's contract.
        pause(unsafe { optional_tag(tag) }?)
    })
}

/// Resumes the regions of `tag` (NULL or empty: every region made here) on every device,
/// restoring what has a backup; CPU backups are then given back unless retained.
/// Idempotent. Out of memory is `GPU_PAGER_ERROR_OUT_OF_MEMORY` and loses nothing.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_tms_resume(tag: *const c_char) -> gpu_pager_code {
    call("gpu_pager_tms_resume", || {
        // SAFETY: as this function's contract.
        resume(unsafe { optional_tag(tag) }?)
    })
}

/// The tag a pause or resume names: NULL is every tag.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string alive for `'a`.
unsafe fn optional_tag<'a>(tag: *const c_char) -> Result<Option<&'a str>> {
    if tag.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL, NUL-terminated and alive for 'a (the contract).
    unsafe { boundary::tag(tag, "tag") }.map(Some)
}

/// The host address of the CPU backup of the `size` device bytes at `ptr`, while their
/// region is paused (or resumed with its backup retained); NULL otherwise. The memory
/// stays gpu-pager's: the next pause overwrites it.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_backup_pointer(ptr: u64, size: u64) -> *mut u8 {
    call_or("gpu_pager_tms_backup_pointer", std::ptr::null_mut(), || {
        let size = usize::try_from(size).map_err(|_| untagged("size does not fit in memory"))?;
        Ok(backup_pointer(ptr, size)?.map_or(std::ptr::null_mut(), |p| p as usize as *mut u8))
    })
}

/// The preload library's `cudaMalloc`: when this thread is in a region, allocates `size`
/// bytes on device `device` there, stores the address in `*ptr_out` and sets `*routed`;
/// otherwise sets `*routed` to false (the caller passes the call to the CUDA runtime). On
/// failure (`GPU_PAGER_ERROR_OUT_OF_MEMORY`, the tag's region paused) nothing is allocated.
///
/// # Safety
/// `ptr_out` and `routed` are NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_tms_cuda_malloc(
    device: c_int,
    size: usize,
    ptr_out: *mut *mut c_void,
    routed: *mut bool,
) -> gpu_pager_code {
    call("gpu_pager_tms_cuda_malloc", || {
        boundary::required(ptr_out, "ptr_out")?;
        boundary::required(routed, "routed")?;
        let d = boundary::device(device)?;
        let got = routed_alloc(d, size)?;
        if let Some(p) = got {
            // SAFETY: non-NULL (checked) and valid for a write (the contract).
            unsafe { write_out(ptr_out, p as usize as *mut c_void) };
        }
        // SAFETY: non-NULL (checked) and valid for a write (the contract).
        unsafe { write_out(routed, got.is_some()) };
        Ok(())
    })
}

/// The preload library's `cudaFree`: frees `ptr` if it is a routed allocation (waiting for
/// the device first, as `cudaFree` does) and sets `*freed`; otherwise sets `*freed` to
/// false (the caller passes the call to the CUDA runtime).
///
/// # Safety
/// `freed` is NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_tms_cuda_free(
    ptr: *mut c_void,
    freed: *mut bool,
) -> gpu_pager_code {
    call("gpu_pager_tms_cuda_free", || {
        boundary::required(freed, "freed")?;
        let addr = ptr as usize as u64;
        let device = segment_device(addr)?;
        if let Some(d) = device {
            free_segment(d, addr, None, None)?;
        }
        // SAFETY: non-NULL (checked) and valid for a write (the contract).
        unsafe { write_out(freed, device.is_some()) };
        Ok(())
    })
}

/// PyTorch's `malloc` hook for the drop-in's "torch" hook mode: allocates `size` bytes for
/// device `device` as this thread's config says. NULL when the thread is not in a region
/// (allocations are never routed silently) or on failure, with the reason in
/// `gpu_pager_last_error()`. Free with `gpu_pager_torch_free`.
#[unsafe(no_mangle)]
pub extern "C" fn gpu_pager_tms_torch_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let _ = stream;
    call_or("gpu_pager_tms_torch_malloc", std::ptr::null_mut(), || {
        let d = boundary::device(device)?;
        match routed_alloc(d, size)? {
            Some(p) => Ok(p as usize as *mut c_void),
            None => Err(Error::InvalidArgument {
                tag: None,
                reason: format!(
                    "an allocation of {size} bytes on device {d} outside every region; torch \
                     routes allocations here only inside torch_memory_saver.region()"
                ),
            }),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_of_backup_map_to_policies_and_media() {
        let mut r = Route {
            enabled: true,
            tag: c"t".to_owned(),
            cpu_backup: false,
            host: true,
            disk: false,
        };
        assert_eq!(r.keep(), Keep::Discard);
        r.cpu_backup = true;
        assert_eq!(r.keep(), Keep::Host);
        r.host = false;
        assert_eq!(r.keep(), Keep::Pinned);
        r.disk = true;
        assert_eq!(r.keep(), Keep::File);
        assert_eq!(Keep::Host.policy(), (Policy::Preserve, Medium::Host));
        assert_eq!(Keep::Discard.policy().0, Policy::Discard);
    }
}
