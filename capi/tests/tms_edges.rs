//! The torch_memory_saver drop-in's edges from the second review (issue 37), through its C
//! surface on the host backend: tags map one to one onto regions (item 3), an explicit disk
//! directory wins over the environment (item 9), a falsy tag is every tag and the empty tag
//! is a tag (item 11), an over-long tag is refused up front (item 15).

use std::ffi::{CStr, CString, c_void};
use std::path::{Path, PathBuf};
use std::ptr::null_mut;

use gpu_pager::{Pager, Policy, State};
use gpu_pager_capi::*;
use gpu_pager_faults::spool;

/// The tests share the process's regions, and some pause all of them: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn last_error() -> String {
    // SAFETY: gpu_pager_last_error returns this thread's NUL-terminated message.
    unsafe { CStr::from_ptr(gpu_pager_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(code: gpu_pager_code) {
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK, "{}", last_error());
}

fn set_tag(tag: &CStr) -> gpu_pager_code {
    // SAFETY: a NUL-terminated string.
    unsafe { gpu_pager_tms_set_tag(tag.as_ptr()) }
}

fn current_tag() -> String {
    // SAFETY: this thread's NUL-terminated tag, read before its next set_tag.
    unsafe { CStr::from_ptr(gpu_pager_tms_tag()) }
        .to_string_lossy()
        .into_owned()
}

/// Allocates `size` bytes in this thread's route; returns the address.
fn alloc(size: usize) -> u64 {
    let (mut p, mut routed) = (null_mut::<c_void>(), false);
    // SAFETY: both out-pointers are valid.
    ok(unsafe { gpu_pager_tms_cuda_malloc(0, size, &mut p, &mut routed) });
    assert!(routed);
    p as u64
}

fn pause(tag: Option<&CStr>) -> gpu_pager_code {
    // SAFETY: NULL or a NUL-terminated string.
    unsafe { gpu_pager_tms_pause(tag.map_or(std::ptr::null(), CStr::as_ptr)) }
}

fn resume(tag: Option<&CStr>) -> gpu_pager_code {
    // SAFETY: NULL or a NUL-terminated string.
    unsafe { gpu_pager_tms_resume(tag.map_or(std::ptr::null(), CStr::as_ptr)) }
}

fn pager() -> std::sync::Arc<Pager> {
    Pager::for_device(0).unwrap()
}

fn write(p: u64, data: &[u8]) {
    let pager = pager();
    let (buf, off) = pager.buffer_containing(p).unwrap();
    pager.write(&buf, off, data).unwrap();
}

fn read(p: u64, len: usize) -> Vec<u8> {
    let pager = pager();
    let (buf, off) = pager.buffer_containing(p).unwrap();
    let mut out = vec![0; len];
    pager.read(&buf, off, &mut out).unwrap();
    out
}

/// The region and state of the allocation at `p`.
fn region_of(p: u64) -> (String, State) {
    let pager = pager();
    let (buf, _) = pager.buffer_containing(p).unwrap();
    let tag = buf.tag().to_owned();
    let state = pager.info(&tag).unwrap().state;
    (tag, state)
}

/// Which kind of backup this thread's allocations get: none, or pinned host memory.
fn keep(pinned: bool) {
    gpu_pager_tms_set_cpu_backup(pinned);
    gpu_pager_tms_set_disk_backup(false);
}

/// Runs `f` on a thread of its own (the drop-in's config is per thread), inside a region.
fn on_a_thread(f: impl FnOnce() + Send + 'static) {
    std::thread::spawn(move || {
        gpu_pager_tms_set_enabled(true);
        f();
        gpu_pager_tms_set_enabled(false);
    })
    .join()
    .unwrap();
}

/// Item 3: the user's tag `x#pinned` and tag `x` with a pinned backup are two regions, with
/// their own policies: pausing `x` leaves `x#pinned` resident, and `x`'s pinned contents
/// survive a pause and resume of everything.
#[test]
fn tags_map_one_to_one_onto_regions_whatever_they_hold() {
    let _one = serial();
    on_a_thread(|| {
        ok(set_tag(c"x"));
        keep(false);
        let plain = alloc(1 << 20);
        ok(set_tag(c"x#pinned"));
        let user = alloc(1 << 20);
        ok(set_tag(c"x"));
        keep(true);
        let pinned = alloc(1 << 20);
        write(pinned, &[7; 4096]);
        let names = [plain, user, pinned].map(|p| region_of(p).0);
        assert_eq!(names[0], "x");
        assert_eq!(names[1], "x#pinned");
        assert_ne!(names[2], names[1], "one region per (tag, kind): {names:?}");
        assert_eq!(
            pager().info(&names[2]).unwrap().policy,
            Policy::Preserve,
            "{names:?}"
        );
        ok(pause(Some(c"x")));
        assert_eq!(region_of(user).1, State::Resident, "another tag's");
        assert_eq!(region_of(pinned).1, State::Released);
        ok(pause(None));
        ok(resume(None));
        assert_eq!(read(pinned, 4096), vec![7; 4096], "restored");
        keep(false);
    });
}

/// Item 11: a falsy tag (NULL or empty) pauses and resumes every tag, and the empty tag is
/// a tag of its own for allocations, as in torch_memory_saver.
#[test]
fn a_falsy_tag_is_every_tag_and_the_empty_tag_is_a_tag() {
    let _one = serial();
    on_a_thread(|| {
        keep(true);
        ok(set_tag(c"named"));
        let named = alloc(1 << 20);
        ok(set_tag(c""));
        assert_eq!(current_tag(), "", "the empty tag is taken");
        let empty = alloc(1 << 20);
        write(empty, &[5; 4096]);
        let (region, _) = region_of(empty);
        assert_ne!(region, region_of(named).0);
        ok(pause(Some(c"named")));
        assert_eq!(region_of(empty).1, State::Resident, "not the named tag's");
        ok(pause(Some(c"")));
        assert_eq!(region_of(empty).1, State::Released, "every tag");
        assert_eq!(region_of(named).1, State::Released);
        ok(resume(Some(c"")));
        assert_eq!(region_of(named).1, State::Resident, "every tag");
        assert_eq!(read(empty, 4096), vec![5; 4096]);
        keep(false);
    });
}

/// Item 15: a tag longer than the drop-in takes is refused by set_tag, naming the limit,
/// and changes nothing; the longest one works with every kind of backup.
#[test]
fn an_over_long_tag_is_refused_up_front() {
    let _one = serial();
    on_a_thread(|| {
        ok(set_tag(c"before"));
        let long = CString::new("t".repeat(GPU_PAGER_TMS_TAG_MAX_BYTES + 26)).unwrap();
        assert_eq!(
            set_tag(&long),
            gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT
        );
        let e = last_error();
        assert!(
            e.contains(&format!("at most {GPU_PAGER_TMS_TAG_MAX_BYTES} bytes")),
            "{e}"
        );
        assert_eq!(current_tag(), "before");
        let longest = CString::new("u".repeat(GPU_PAGER_TMS_TAG_MAX_BYTES)).unwrap();
        ok(set_tag(&longest));
        for (cpu, host) in [(false, false), (true, false), (true, true)] {
            gpu_pager_tms_set_cpu_backup(cpu);
            let backend = if host { c"mmap" } else { c"pinned" };
            // SAFETY: a NUL-terminated literal.
            ok(unsafe { gpu_pager_tms_set_cpu_backend(backend.as_ptr()) });
            alloc(1 << 20);
        }
        // SAFETY: a NUL-terminated literal.
        ok(unsafe { gpu_pager_tms_set_cpu_backend(c"pinned".as_ptr()) });
        ok(pause(Some(&longest)));
        ok(resume(Some(&longest)));
        keep(false);
    });
}

/// Item 9: `set_disk_backup_dir` before the first allocation wins over
/// `GPU_PAGER_BACKUP_DIR` (run in a process of its own, whose pager starts with that
/// variable set).
#[test]
fn an_explicit_disk_directory_wins_over_the_environment() {
    const CHILD: &str = "GPU_PAGER_TMS_DIR_CHILD";
    let base = std::env::temp_dir().join(format!("gpu-pager-tms-dirs-{}", std::process::id()));
    let from_env = base.join("from-env");
    let Some(dirs) = std::env::var_os(CHILD) else {
        // Under the tests' emulator, if one is set.
        let out = gpu_pager_faults::driver_stub::command(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "an_explicit_disk_directory_wins_over_the_environment",
            ])
            .env(CHILD, &base)
            .env(gpu_pager::BACKUP_DIR_ENV, &from_env)
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && log.contains("1 passed"), "{log}");
        std::fs::remove_dir_all(&base).ok();
        return;
    };
    let (from_env, explicit): (PathBuf, PathBuf) = (
        Path::new(&dirs).join("from-env"),
        Path::new(&dirs).join("explicit"),
    );
    let dir = CString::new(explicit.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated string.
    ok(unsafe { gpu_pager_tms_set_disk_dir(dir.as_ptr()) });
    on_a_thread(move || {
        ok(set_tag(c"disk"));
        gpu_pager_tms_set_disk_backup(true);
        let p = alloc(1 << 20);
        write(p, &[3; 4096]);
        ok(pause(Some(c"disk")));
        assert!(
            spool::on_disk(&explicit) >= 1 << 20,
            "in the explicit directory"
        );
        assert_eq!(spool::on_disk(&from_env), 0, "not in the environment's");
        ok(resume(Some(c"disk")));
        assert_eq!(read(p, 4096), vec![3; 4096]);
        gpu_pager_tms_set_disk_backup(false);
    });
}
