//! The torch_memory_saver drop-in's C surface on the host backend: per-thread routing, tag
//! families over every kind of backup, pause and resume of a tag or of everything, the
//! CPU backup pointer's visibility and retention, and the preload library's cudaMalloc and
//! cudaFree paths.

use std::ffi::{CStr, CString, c_void};
use std::path::{Path, PathBuf};
use std::ptr::null_mut;

use gpu_pager::{Medium, Pager, Policy, State};
use gpu_pager_capi::*;
use gpu_pager_testkit::spool;
use gpu_pager_tms::tms::*;

/// The tests share the process's regions, and one pauses all of them: one at a time.
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

fn current_tag() -> &'static CStr {
    // SAFETY: gpu_pager_tms_tag returns this thread's NUL-terminated tag, alive until the
    // thread's next set_tag (the tests read it before that).
    unsafe { CStr::from_ptr(gpu_pager_tms_tag()) }
}

fn current_backend() -> &'static CStr {
    // SAFETY: gpu_pager_tms_cpu_backend returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(gpu_pager_tms_cpu_backend()) }
}

/// A routed allocation through the preload path: (address, routed).
fn cuda_malloc(size: usize) -> (u64, bool) {
    let (mut p, mut routed) = (null_mut::<c_void>(), false);
    // SAFETY: both out-pointers are valid.
    ok(unsafe { gpu_pager_tms_cuda_malloc(0, size, &mut p, &mut routed) });
    (p as u64, routed)
}

fn cuda_free(p: u64) -> bool {
    let mut freed = false;
    // SAFETY: the out-pointer is valid.
    ok(unsafe { gpu_pager_tms_cuda_free(p as *mut c_void, &mut freed) });
    freed
}

fn set_tag(tag: &CStr) {
    // SAFETY: a NUL-terminated literal.
    ok(unsafe { gpu_pager_tms_set_tag(tag.as_ptr()) });
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

fn pause(tag: Option<&CStr>) -> gpu_pager_code {
    // SAFETY: NULL or a NUL-terminated literal.
    unsafe { gpu_pager_tms_pause(tag.map_or(std::ptr::null(), CStr::as_ptr)) }
}

fn resume(tag: Option<&CStr>) -> gpu_pager_code {
    // SAFETY: NULL or a NUL-terminated literal.
    unsafe { gpu_pager_tms_resume(tag.map_or(std::ptr::null(), CStr::as_ptr)) }
}

fn backup_ptr(p: u64, len: usize) -> *mut u8 {
    gpu_pager_tms_backup_pointer(p, len as u64)
}

#[test]
fn a_thread_outside_a_region_is_not_routed() {
    let _one = serial();
    std::thread::spawn(|| {
        if std::env::var_os("TMS_INIT_ENABLE").is_some() {
            return;
        }
        assert!(!gpu_pager_tms_enabled());
        assert_eq!(current_tag(), c"default");
        assert_eq!(current_backend(), c"pinned");
        assert_eq!(
            cuda_malloc(1 << 20),
            (0, false),
            "not routed: the runtime's"
        );
        assert!(!cuda_free(0x1234), "not ours: the runtime's");
        let p = gpu_pager_tms_torch_malloc(1 << 20, 0, null_mut());
        assert!(p.is_null());
        assert!(last_error().contains("region()"), "{}", last_error());
    })
    .join()
    .unwrap();
}

#[test]
fn one_tag_with_every_kind_of_backup_pauses_and_resumes_as_one() {
    let _one = serial();
    std::thread::spawn(|| {
        let dir = std::env::temp_dir().join(format!("gpu-pager-tms-{}", std::process::id()));
        let d = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated string.
        ok(unsafe { gpu_pager_tms_set_disk_dir(d.as_ptr()) });
        gpu_pager_tms_set_enabled(true);
        set_tag(c"family");
        let mut made = Vec::new();
        for (cpu, backend, disk, keeps) in [
            (true, c"pinned", false, true),
            (false, c"pinned", false, false),
            (true, c"mmap", false, true),
            (false, c"pinned", true, true),
        ] {
            gpu_pager_tms_set_cpu_backup(cpu);
            // SAFETY: a NUL-terminated literal.
            ok(unsafe { gpu_pager_tms_set_cpu_backend(backend.as_ptr()) });
            gpu_pager_tms_set_disk_backup(disk);
            let (p, routed) = cuda_malloc(3 << 20);
            assert!(routed);
            let data: Vec<u8> = (0..4096)
                .map(|i| (i % 251) as u8 ^ made.len() as u8)
                .collect();
            write(p, &data);
            made.push((p, data, keeps));
        }
        let pager = pager();
        let names = ["family", "family#discard", "family#host", "family#file"];
        let media = [Medium::Pinned, Medium::Pinned, Medium::Host, Medium::File];
        for (name, medium) in names.iter().zip(media) {
            let info = pager.info(name).unwrap();
            assert!((info.kind == gpu_pager::RegionKind::Growing), "{name}");
            assert_eq!(info.medium, medium, "{name}");
        }
        assert_eq!(
            pager.info("family#discard").unwrap().policy,
            Policy::Discard
        );
        // A tag that was never used moves nothing.
        ok(pause(Some(c"no-such-tag")));
        ok(pause(Some(c"family")));
        for name in names {
            assert_eq!(pager.info(name).unwrap().state, State::Released, "{name}");
        }
        ok(pause(Some(c"family")));
        // The disk backup is a named file of its own, as torch_memory_saver's are, next to
        // this process's owner file.
        assert_eq!(spool::named(&dir).len(), 1, "{:?}", spool::names(&dir));
        assert_eq!(spool::owners(&dir).len(), 1, "{:?}", spool::names(&dir));
        assert!(spool::on_disk(&dir) >= 3 << 20);
        // While paused, the CPU backups show, the others do not.
        for (i, (p, data, keeps)) in made.iter().enumerate() {
            let q = backup_ptr(*p, data.len());
            let cpu = keeps & (i != 3);
            assert_eq!(!q.is_null(), cpu, "allocation {i}");
            if cpu {
                // SAFETY: a paused region's backup holds these bytes until its next pause.
                let held = unsafe { std::slice::from_raw_parts(q, data.len()) };
                assert_eq!(held, &data[..], "allocation {i}");
            }
        }
        ok(resume(Some(c"family")));
        for (i, (p, data, keeps)) in made.iter().enumerate() {
            if *keeps {
                assert_eq!(&read(*p, data.len()), data, "allocation {i}");
            }
            assert!(backup_ptr(*p, data.len()).is_null(), "not retained: {i}");
        }
        assert_eq!(pager.region_stats("family#host").unwrap().backup_bytes, 0);
        for (p, _, _) in &made {
            assert!(cuda_free(*p));
        }
        assert_eq!(spool::on_disk(&dir), 0, "disk space given back");
        assert!(
            spool::named(&dir).is_empty(),
            "the backup's file went with it"
        );
        gpu_pager_tms_set_enabled(false);
        gpu_pager_tms_set_disk_backup(false);
    })
    .join()
    .unwrap();
}

#[test]
fn a_retained_backup_stays_at_one_address_until_a_resume_without_retain() {
    let _one = serial();
    std::thread::spawn(|| {
        gpu_pager_tms_set_enabled(true);
        set_tag(c"retained");
        gpu_pager_tms_set_cpu_backup(true);
        // SAFETY: a NUL-terminated literal.
        ok(unsafe { gpu_pager_tms_set_cpu_backend(c"mmap".as_ptr()) });
        let (p, _) = cuda_malloc(1 << 20);
        write(p, &[7; 4096]);
        ok(pause(Some(c"retained")));
        let first = backup_ptr(p, 4096);
        assert!(!first.is_null());
        gpu_pager_tms_set_retain(true);
        ok(resume(Some(c"retained")));
        assert_eq!(backup_ptr(p, 4096), first, "retained in place");
        gpu_pager_tms_set_retain(false);
        assert_eq!(
            backup_ptr(p, 4096),
            first,
            "still there until the next resume"
        );
        write(p, &[8; 4096]);
        ok(pause(Some(c"retained")));
        assert_eq!(backup_ptr(p, 4096), first, "the same memory, refreshed");
        // SAFETY: paused: the backup holds the bytes.
        let held = unsafe { std::slice::from_raw_parts(first, 4096) };
        assert_eq!(held, &[8; 4096]);
        ok(resume(Some(c"retained")));
        assert!(backup_ptr(p, 4096).is_null());
        assert_eq!(read(p, 4096), vec![8; 4096]);
        assert!(cuda_free(p));
        gpu_pager_tms_set_enabled(false);
    })
    .join()
    .unwrap();
}

#[test]
fn a_free_while_paused_and_a_pause_of_everything() {
    let _one = serial();
    std::thread::spawn(|| {
        gpu_pager_tms_set_enabled(true);
        set_tag(c"everything");
        gpu_pager_tms_set_cpu_backup(false);
        gpu_pager_tms_set_disk_backup(false);
        let (a, _) = cuda_malloc(6912);
        let (b, _) = cuda_malloc(6912);
        ok(pause(None));
        assert_eq!(pager().info("everything").unwrap().state, State::Released);
        assert!(cuda_free(a), "freed while paused");
        // A new allocation in a paused tag is refused, not handed out unmapped.
        let mut p = null_mut::<c_void>();
        let mut routed = false;
        // SAFETY: valid out-pointers.
        let code = unsafe { gpu_pager_tms_cuda_malloc(0, 4096, &mut p, &mut routed) };
        assert_eq!(
            code,
            gpu_pager_code::GPU_PAGER_ERROR_NOT_RESIDENT,
            "{}",
            last_error()
        );
        assert!(p.is_null());
        ok(resume(None));
        write(b, &[1; 100]);
        assert_eq!(read(b, 100), vec![1; 100]);
        assert!(cuda_free(b));
        assert!(!cuda_free(b), "a second free is not ours any more");
        gpu_pager_tms_set_enabled(false);
    })
    .join()
    .unwrap();
}

#[test]
fn bad_settings_are_refused_and_change_nothing() {
    let _one = serial();
    std::thread::spawn(|| {
        // SAFETY: a NUL-terminated literal.
        let code = unsafe { gpu_pager_tms_set_cpu_backend(c"disk".as_ptr()) };
        assert_eq!(code, gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT);
        assert!(
            last_error().contains("'pinned' or 'mmap'"),
            "{}",
            last_error()
        );
        assert_eq!(current_backend(), c"pinned");
        // SAFETY: NULL is allowed (an error).
        let code = unsafe { gpu_pager_tms_set_tag(std::ptr::null()) };
        assert_eq!(code, gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT);
        assert_eq!(current_tag(), c"default");
        // SAFETY: a NUL-terminated literal.
        let code = unsafe { gpu_pager_tms_set_disk_dir(c"/proc/gpu-pager-nowhere".as_ptr()) };
        assert_eq!(code, gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT);
        assert!(
            last_error().contains("/proc/gpu-pager-nowhere"),
            "{}",
            last_error()
        );
    })
    .join()
    .unwrap();
}

#[test]
fn a_resume_out_of_memory_loses_nothing_and_a_retry_succeeds() {
    let _one = serial();
    std::thread::spawn(|| {
        gpu_pager_tms_set_enabled(true);
        set_tag(c"oom");
        gpu_pager_tms_set_cpu_backup(true);
        // SAFETY: a NUL-terminated literal.
        ok(unsafe { gpu_pager_tms_set_cpu_backend(c"pinned".as_ptr()) });
        gpu_pager_tms_set_disk_backup(false);
        let (p, _) = cuda_malloc(4 << 20);
        write(p, &[6; 4096]);
        ok(pause(Some(c"oom")));
        // Another user (the trainer) takes every byte left.
        let pager = pager();
        let free = pager.backend().mem_info().unwrap().free;
        let g = pager.backend().info().granularity;
        pager
            .region("oom-filler", free / g * g, Policy::Discard)
            .unwrap();
        let code = resume(Some(c"oom"));
        assert_eq!(
            code,
            gpu_pager_code::GPU_PAGER_ERROR_OUT_OF_MEMORY,
            "{}",
            last_error()
        );
        assert!(
            last_error().contains("nothing was lost"),
            "{}",
            last_error()
        );
        assert_eq!(pager.info("oom").unwrap().state, State::Released);
        pager.remove("oom-filler").unwrap();
        ok(resume(Some(c"oom")));
        assert_eq!(read(p, 4096), vec![6; 4096]);
        assert!(cuda_free(p));
        gpu_pager_tms_set_enabled(false);
    })
    .join()
    .unwrap();
}

/// A free from a thread-exit destructor (torch frees cached blocks there) may reach the
/// drop-in after the thread's own locals are gone: it answers from defaults instead of
/// panicking across the C boundary (an abort of the process).
#[test]
fn calls_from_a_thread_exit_destructor_do_not_abort() {
    struct AtExit;
    impl Drop for AtExit {
        fn drop(&mut self) {
            assert!(!gpu_pager_tms_enabled());
            gpu_pager_tms_set_enabled(true);
            // SAFETY: the returned string is static or this thread's, read at once.
            let tag = unsafe { CStr::from_ptr(gpu_pager_tms_tag()) };
            assert_eq!(tag.to_bytes(), b"default");
            gpu_pager_clear_error();
            // SAFETY: as above.
            let _ = unsafe { CStr::from_ptr(gpu_pager_last_error()) };
        }
    }
    thread_local! {
        static AT_EXIT: AtExit = const { AtExit };
    }
    std::thread::spawn(|| {
        // Destructors run in the reverse order of first use: the drop-in's locals (used
        // after this one) are gone when AtExit's runs.
        AT_EXIT.with(|_| ());
        gpu_pager_tms_set_enabled(false);
        gpu_pager_clear_error();
    })
    .join()
    .unwrap();
}

// The second review's edges (issue 37): tags map one to one onto regions (item 3), an
// explicit disk directory wins over the environment (item 9), a falsy tag is every tag and
// the empty tag is a tag (item 11), an over-long tag is refused up front (item 15).

/// `gpu_pager_tms_set_tag`'s code (for tags that may be refused).
fn try_set_tag(tag: &CStr) -> gpu_pager_code {
    // SAFETY: a NUL-terminated string.
    unsafe { gpu_pager_tms_set_tag(tag.as_ptr()) }
}

/// Allocates `size` bytes in this thread's route; returns the address.
fn alloc(size: usize) -> u64 {
    let (mut p, mut routed) = (null_mut::<c_void>(), false);
    // SAFETY: both out-pointers are valid.
    ok(unsafe { gpu_pager_tms_cuda_malloc(0, size, &mut p, &mut routed) });
    assert!(routed);
    p as u64
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
        ok(try_set_tag(c"x"));
        keep(false);
        let plain = alloc(1 << 20);
        ok(try_set_tag(c"x#pinned"));
        let user = alloc(1 << 20);
        ok(try_set_tag(c"x"));
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
        ok(try_set_tag(c"named"));
        let named = alloc(1 << 20);
        ok(try_set_tag(c""));
        assert_eq!(current_tag(), c"", "the empty tag is taken");
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
        ok(try_set_tag(c"before"));
        let long = CString::new("t".repeat(GPU_PAGER_TMS_TAG_MAX_BYTES + 26)).unwrap();
        assert_eq!(
            try_set_tag(&long),
            gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT
        );
        let e = last_error();
        assert!(
            e.contains(&format!("at most {GPU_PAGER_TMS_TAG_MAX_BYTES} bytes")),
            "{e}"
        );
        assert_eq!(current_tag(), c"before");
        let longest = CString::new("u".repeat(GPU_PAGER_TMS_TAG_MAX_BYTES)).unwrap();
        ok(try_set_tag(&longest));
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
        in_a_child(
            "an_explicit_disk_directory_wins_over_the_environment",
            &[(CHILD, base.clone()), (gpu_pager::BACKUP_DIR_ENV, from_env)],
        );
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
        ok(try_set_tag(c"disk"));
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

/// `TMS_DISK_BACKUP_DIR` wins over `GPU_PAGER_BACKUP_DIR` too, as documented: the drop-in's
/// disk backups are named files there, not unnamed ones in the pager's directory (run in a
/// process of its own, whose pager starts with both variables set).
#[test]
fn tms_disk_backup_dir_wins_over_the_pager_s_variable() {
    const CHILD: &str = "GPU_PAGER_TMS_ENV_DIR_CHILD";
    let base = std::env::temp_dir().join(format!("gpu-pager-tms-env-dirs-{}", std::process::id()));
    let Some(dirs) = std::env::var_os(CHILD) else {
        in_a_child(
            "tms_disk_backup_dir_wins_over_the_pager_s_variable",
            &[
                (CHILD, base.clone()),
                (gpu_pager::BACKUP_DIR_ENV, base.join("pager")),
                ("TMS_DISK_BACKUP_DIR", base.join("tms")),
            ],
        );
        std::fs::remove_dir_all(&base).ok();
        return;
    };
    let (pager_dir, tms_dir) = (Path::new(&dirs).join("pager"), Path::new(&dirs).join("tms"));
    on_a_thread(move || {
        ok(try_set_tag(c"disk"));
        gpu_pager_tms_set_disk_backup(true);
        let p = alloc(1 << 20);
        write(p, &[5; 4096]);
        ok(pause(Some(c"disk")));
        assert!(
            spool::on_disk(&tms_dir) >= 1 << 20,
            "in TMS_DISK_BACKUP_DIR"
        );
        assert!(
            std::fs::read_dir(&tms_dir).unwrap().count() >= 1,
            "as named files"
        );
        assert_eq!(spool::on_disk(&pager_dir), 0, "not in GPU_PAGER_BACKUP_DIR");
        ok(resume(Some(c"disk")));
        assert_eq!(read(p, 4096), vec![5; 4096]);
        gpu_pager_tms_set_disk_backup(false);
    });
}

/// Runs test `name` of this binary alone in a child process with `env` set (under the
/// tests' emulator, if one is set); panics unless it passed.
fn in_a_child(name: &str, env: &[(&str, PathBuf)]) {
    let mut cmd = gpu_pager_testkit::driver_stub::command(std::env::current_exe().unwrap());
    cmd.args(["--exact", name]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let log =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && log.contains("1 passed"), "{log}");
}
