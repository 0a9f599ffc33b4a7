//! File backups that nothing can leak, take or confuse (issue 37's disk items), on the host
//! backend: a killed process leaves nothing on disk, names planted in the directory change
//! nothing, a low descriptor limit still backs up hundreds of buffers, the directory is
//! absolute and never empty, a fork child's exit leaves the parent's backups alone, and each
//! file error says whether anything was lost and what to do.

use crate::common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use common::read;
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{BackupFiles, Error, Medium, Pager, PagerConfig, Policy, RegionOptions, State};
use gpu_pager_testkit::spool;

const MIB: usize = 1 << 20;

fn pager() -> Pager {
    common::host_pager(256 * MIB)
}

/// A fresh directory for one test's backups.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpu-pager-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn file_backed(kind: gpu_pager::RegionKind) -> RegionOptions {
    RegionOptions {
        medium: Medium::File,
        kind,
        ..RegionOptions::default()
    }
}

/// Region `w` of `pager`: growing, `Preserve`, backed up in `files` in `dir`.
fn file_region(pager: &Pager, dir: &Path, files: BackupFiles) {
    pager.set_backup_files(dir, files).unwrap();
    pager
        .region_with(
            "w",
            0,
            Policy::Preserve,
            file_backed(gpu_pager::RegionKind::Growing),
        )
        .unwrap();
}

/// A pager with region `w` of `n` buffers of `len` bytes (buffer `i` filled with `i + 1`)
/// backed up in unnamed files in `dir`.
fn filled(dir: &Path, n: usize, len: usize) -> (Pager, Vec<gpu_pager::Buffer>) {
    filled_as(dir, n, len, BackupFiles::Unnamed)
}

/// [`filled`], with the backups named as `files` says.
fn filled_as(
    dir: &Path,
    n: usize,
    len: usize,
    files: BackupFiles,
) -> (Pager, Vec<gpu_pager::Buffer>) {
    // A small granularity: each buffer of a growing region takes whole granules.
    let backend = std::sync::Arc::new(HostBackend::new(HostConfig {
        capacity: 256 * MIB,
        granularity: 64 << 10,
    }));
    let pager = Pager::with_config(backend, common::small_chunks());
    file_region(&pager, dir, files);
    let bufs = (0..n)
        .map(|i| {
            let b = pager.alloc("w", len).unwrap();
            pager.write(&b, 0, &vec![(i + 1) as u8; len]).unwrap();
            b
        })
        .collect();
    (pager, bufs)
}

/// Lets this process (running one test alone) open at most `n` descriptors.
fn limit_descriptors(n: libc::rlim_t) {
    let limit = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: a plain system call with a valid rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
}

fn assert_intact(pager: &Pager, bufs: &[gpu_pager::Buffer]) {
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(read(pager, b), vec![(i + 1) as u8; b.len()], "buffer {i}");
    }
}

/// Item 1: a process killed with SIGKILL while its backups are on disk leaves nothing in
/// the directory (they had no name to leave behind).
#[test]
fn a_killed_process_leaves_no_backup_file() {
    const CHILD: &str = "GPU_PAGER_KILLED_CHILD";
    if let Some(dir) = std::env::var_os(CHILD) {
        let (pager, _bufs) = filled(Path::new(&dir), 20, 2 * MIB);
        pager.release(&["w"]).unwrap();
        assert!(spool::on_disk(Path::new(&dir)) >= 40 * MIB as u64);
        let me = std::process::id() as libc::pid_t;
        // SAFETY: ends this child process at once, as a crash or the OOM killer would.
        unsafe { libc::kill(me, libc::SIGKILL) };
        unreachable!("SIGKILL ends the process");
    }
    let dir = scratch("killed");
    let out = common::this_binary()
        .args([
            "--exact",
            &common::test_path(module_path!(), "a_killed_process_leaves_no_backup_file"),
        ])
        .env(CHILD, &dir)
        .output()
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGKILL),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        spool::names(&dir),
        Vec::<String>::new(),
        "nothing left behind"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Item 2: files another user plants in the directory under the names backups and the
/// directory check used to take (this process's pid) neither stop backups nor get touched.
#[test]
fn planted_names_neither_block_backups_nor_get_touched() {
    let dir = scratch("planted");
    let pid = std::process::id();
    let mut planted = Vec::new();
    for owner in 0..64 {
        planted.push(dir.join(format!(".gpu-pager-probe-{pid}-{owner}")));
        for n in 0..4 {
            planted.push(dir.join(format!("gpu-pager-{pid}-{owner}-{n}.backup")));
        }
    }
    for p in &planted {
        std::fs::write(p, b"not yours").unwrap();
    }
    std::os::unix::fs::symlink("/dev/null", dir.join(".gpu-pager-link")).unwrap();
    let (pager, bufs) = filled(&dir, 4, MIB);
    for _ in 0..3 {
        pager.release(&["w"]).unwrap();
        pager.resume(&["w"]).unwrap();
    }
    assert_intact(&pager, &bufs);
    for p in &planted {
        assert_eq!(std::fs::read(p).unwrap(), b"not yours", "{}", p.display());
    }
    assert_eq!(spool::names(&dir).len(), planted.len() + 1, "nothing added");
    drop(pager);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Item 6: with a limit of 64 open descriptors, 300 buffers still back up and come back
/// (the backups share the pager's one file).
#[test]
fn hundreds_of_buffers_back_up_under_a_low_descriptor_limit() {
    if common::run_alone(
        module_path!(),
        "hundreds_of_buffers_back_up_under_a_low_descriptor_limit",
        &[],
    ) {
        return;
    }
    let dir = scratch("descriptors");
    let (pager, bufs) = filled(&dir, 300, 64 << 10);
    limit_descriptors(64);
    for _ in 0..2 {
        pager.release(&["w"]).unwrap();
        pager.resume(&["w"]).unwrap();
    }
    assert_intact(&pager, &bufs);
    assert_eq!(spool::spooled(&dir).len(), 1, "one file for every backup");
    drop(pager);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The named layout (the torch_memory_saver drop-in's): one file per backup, mode 0600, in
/// the directory while released, next to the process's one owner file; 300 backups under a
/// limit of 64 descriptors (a backup's file is open only while its bytes move); the files
/// go with their backups.
#[test]
fn named_backups_show_one_file_each_and_hold_no_descriptor() {
    if common::run_alone(
        module_path!(),
        "named_backups_show_one_file_each_and_hold_no_descriptor",
        &[],
    ) {
        return;
    }
    let dir = scratch("named");
    let (pager, bufs) = filled_as(&dir, 300, 64 << 10, BackupFiles::Named);
    assert_eq!(pager.backup_files(), BackupFiles::Named);
    limit_descriptors(64);
    for _ in 0..2 {
        pager.release(&["w"]).unwrap();
        let named = spool::named(&dir);
        assert_eq!(named.len(), 300);
        assert_eq!(spool::owners(&dir).len(), 1, "{:?}", spool::names(&dir));
        assert!(spool::on_disk(&dir) >= 300 * (64 << 10));
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::symlink_metadata(dir.join(&named[0])).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        pager.resume(&["w"]).unwrap();
    }
    assert_intact(&pager, &bufs);
    assert!(spool::spooled(&dir).is_empty(), "no unnamed file");
    pager.remove("w").unwrap();
    assert_eq!(spool::named(&dir), Vec::<String>::new(), "gone with them");
    drop(pager);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Named backups of a process that exits go with it, owner file included; those of a
/// killed process stay until the next process takes an id in the directory, which removes
/// them and nothing else: a live owner's files (its owner file locked) and other files stay.
#[test]
fn named_files_go_at_exit_and_a_killed_owners_at_the_next_start() {
    const CHILD: &str = "GPU_PAGER_NAMED_CHILD";
    const DIR: &str = "GPU_PAGER_NAMED_DIR";
    let test = "named_files_go_at_exit_and_a_killed_owners_at_the_next_start";
    if let (Some(how), Some(dir)) = (std::env::var_os(CHILD), std::env::var_os(DIR)) {
        let (pager, bufs) = filled_as(Path::new(&dir), 5, MIB, BackupFiles::Named);
        pager.release(&["w"]).unwrap();
        assert_eq!(spool::named(Path::new(&dir)).len(), 5);
        if how == "kill" {
            let me = std::process::id() as libc::pid_t;
            // SAFETY: ends this child process at once, as a crash or the OOM killer would.
            unsafe { libc::kill(me, libc::SIGKILL) };
        }
        // The process exits with its backups alive: the exit handler removes the files.
        std::mem::forget((pager, bufs));
        return;
    }
    let dir = scratch("named-exit");
    let run = |how: &str| {
        common::this_binary()
            .args(["--exact", &common::test_path(module_path!(), test)])
            .env(CHILD, how)
            .env(DIR, &dir)
            .output()
            .unwrap()
    };
    let out = run("exit");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        spool::names(&dir),
        Vec::<String>::new(),
        "nothing after an exit"
    );
    let out = run("kill");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGKILL));
    assert_eq!(
        spool::named(&dir).len(),
        5,
        "a killed process cannot clean up"
    );
    assert_eq!(spool::owners(&dir).len(), 1);
    // A live owner (holding its owner file's lock) and someone's own file.
    let live = "ab".repeat(16);
    let owner = std::fs::File::create(dir.join(format!("gpu-pager-{live}.owner"))).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on an open descriptor.
    assert_eq!(unsafe { libc::flock(owner.as_raw_fd(), libc::LOCK_EX) }, 0);
    let kept = [
        format!("gpu-pager-{live}-0.backup"),
        format!("gpu-pager-{live}.owner"),
        "notes.txt".to_owned(),
    ];
    std::fs::write(dir.join(&kept[0]), b"live").unwrap();
    std::fs::write(dir.join(&kept[2]), b"mine").unwrap();
    let pager = pager();
    pager.set_backup_files(&dir, BackupFiles::Named).unwrap();
    let mut left = spool::names(&dir);
    let ours = spool::owners(&dir)
        .into_iter()
        .find(|n| !n.contains(&live))
        .expect("this process's owner file");
    left.retain(|n| *n != ours);
    assert_eq!(left, kept, "the killed owner's files went, nothing else");
    drop(owner);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Item 7: an empty directory is refused and changes nothing; a relative one (set, or from
/// the environment) is made absolute at once, so a later `chdir` does not move the backups.
#[test]
fn the_directory_is_absolute_and_never_empty() {
    const REL: &str = "gpu-pager-relative-backups";
    let base = scratch("relative");
    if common::run_alone(
        module_path!(),
        "the_directory_is_absolute_and_never_empty",
        &[(gpu_pager::BACKUP_DIR_ENV, OsStr::new(REL))],
    ) {
        std::fs::remove_dir_all(&base).unwrap();
        return;
    }
    std::env::set_current_dir(&base).unwrap();
    let pager = pager();
    assert_eq!(
        pager.backup_dir(),
        Some(base.join(REL)),
        "from the environment"
    );
    let e = pager.set_backup_dir("").unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("empty"), "{e}");
    assert_eq!(pager.backup_dir(), Some(base.join(REL)), "unchanged");
    pager.set_backup_dir("set-later").unwrap();
    let dir = base.join("set-later");
    assert_eq!(pager.backup_dir(), Some(dir.clone()));
    pager
        .region_with(
            "w",
            4 * MIB,
            Policy::Preserve,
            file_backed(gpu_pager::RegionKind::Fixed),
        )
        .unwrap();
    let b = pager.alloc("w", MIB).unwrap();
    pager.write(&b, 0, &vec![9; MIB]).unwrap();
    std::env::set_current_dir("/").unwrap();
    pager.release(&["w"]).unwrap();
    assert!(
        spool::on_disk(&dir) >= MIB as u64,
        "in the directory that was set: {:?}",
        spool::spooled(&dir)
    );
    pager.resume(&["w"]).unwrap();
    assert_eq!(read(&pager, &b), vec![9; MIB]);
}

/// Item 8: a fork child that exits normally (running exit handlers) leaves the parent's
/// backups on disk and intact.
#[test]
fn a_fork_childs_exit_leaves_the_parents_backups() {
    if common::run_alone(
        module_path!(),
        "a_fork_childs_exit_leaves_the_parents_backups",
        &[],
    ) {
        return;
    }
    for files in [BackupFiles::Unnamed, BackupFiles::Named] {
        let dir = scratch("fork-exit");
        let (pager, bufs) = filled_as(&dir, 3, MIB, files);
        pager.release(&["w"]).unwrap();
        let held = (spool::on_disk(&dir), spool::names(&dir));
        assert!(held.0 >= 3 * MIB as u64);
        // SAFETY: the child only calls exit(0), which runs the process's exit handlers.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: ends the child through the C library's exit, handlers included.
            unsafe { libc::exit(0) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(
            (spool::on_disk(&dir), spool::names(&dir)),
            held,
            "{files:?}: the parent's files and disk use are still there"
        );
        pager.resume(&["w"]).unwrap();
        assert_intact(&pager, &bufs);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Item 5: a backup that cannot be read back says its contents are lost and that retrying
/// cannot help (not "nothing was lost — free disk space"); `read_backup` reports the
/// failure instead of "no copy"; removing the region gets out of it.
#[test]
fn a_damaged_backup_says_its_contents_are_lost() {
    let dir = scratch("damaged");
    let (pager, bufs) = filled(&dir, 2, MIB);
    pager.release(&["w"]).unwrap();
    // Truncate the unnamed file behind the pager's back, as a damaged disk would.
    let fd = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .find(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|t| t.to_string_lossy().ends_with(" (deleted)") && t.starts_with(&dir))
        })
        .expect("the pager's backup file is open");
    std::fs::OpenOptions::new()
        .write(true)
        .open(fd.path())
        .unwrap()
        .set_len(0)
        .unwrap();
    for _ in 0..2 {
        let text = pager.resume(&["w"]).unwrap_err().to_string();
        assert!(
            text.contains("contents are lost") && text.contains("retry fails"),
            "{text}"
        );
        assert!(!text.contains("nothing was lost"), "{text}");
        assert_eq!(pager.info("w").unwrap().state, State::Released);
    }
    let mut out = vec![0u8; 16];
    let e = pager.read_backup(&bufs[0], 0, &mut out).unwrap_err();
    assert!(matches!(e, Error::Backend { .. }), "not 'no copy': {e}");
    assert!(e.to_string().contains("contents are lost"), "{e}");
    pager.remove("w").unwrap();
    assert_eq!(spool::on_disk(&dir), 0);
    drop(pager);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Item 5: too many open files and a directory that cannot hold files each get their own
/// advice, not "free disk space".
#[test]
fn descriptor_limits_and_bad_directories_get_their_own_advice() {
    if common::run_alone(
        module_path!(),
        "descriptor_limits_and_bad_directories_get_their_own_advice",
        &[],
    ) {
        return;
    }
    let pager = pager();
    let e = pager
        .set_backup_dir("/proc/gpu-pager-not-writable")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cannot hold files") && !e.contains("disk space"),
        "{e}"
    );
    let dir = scratch("emfile");
    limit_descriptors(64);
    // Every descriptor the limit allows taken.
    let taken: Vec<std::fs::File> = std::iter::from_fn(|| std::fs::File::open("/dev/null").ok())
        .take(64)
        .collect();
    let e = pager.set_backup_dir(&dir).unwrap_err().to_string();
    assert!(
        e.contains("too many open files") && e.contains("ulimit") && !e.contains("disk space"),
        "{e}"
    );
    drop(taken);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The clamp: a staging chunk beyond the largest is the largest, not an overflow.
#[test]
fn the_file_chunk_is_clamped() {
    let backend = std::sync::Arc::new(HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: 2 * MIB,
    }));
    let pager = Pager::with_config(
        backend,
        PagerConfig {
            tuning: gpu_pager::Tuning {
                file_chunk_bytes: usize::MAX,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    assert_eq!(
        pager.config().tuning.file_chunk_bytes,
        gpu_pager::MAX_FILE_CHUNK_BYTES
    );
}

/// The node's host budget counts all the pinned memory the pager hands out, not only
/// backups in host memory: the KV cache's swap space and the file medium's staging buffer
/// too. Over the budget, each is out of memory naming the budget, and nothing is lost; a
/// share comes back when its holder is dropped. In a process of its own, with a ledger of
/// its own.
#[test]
fn swap_space_and_file_staging_count_against_the_host_budget() {
    const CHILD: &str = "GPU_PAGER_BUDGET_CHILD";
    if let Some(dir) = std::env::var_os(CHILD) {
        let dir = Path::new(&dir);
        let backend = std::sync::Arc::new(HostBackend::new(HostConfig {
            capacity: 256 * MIB,
            granularity: 2 * MIB,
        }));
        let mut config = common::small_chunks();
        config.host_budget_bytes = 6 * MIB;
        config.tuning.file_chunk_bytes = 2 * MIB; // a staging buffer of 4 MiB
        let pager = std::sync::Arc::new(Pager::with_config(backend, config));
        let over_budget = |e: &gpu_pager::Error| {
            e.code() == gpu_pager::ErrorCode::OutOfMemory && e.to_string().contains("budget")
        };
        // 2 MiB per block: 32 layers, K and V, 16 tokens of 8 heads of 128 bf16 values.
        let layout = gpu_pager::kv::KvLayout::new(
            32,
            8,
            128,
            16,
            gpu_pager::kv::KvDtype::Bf16,
            gpu_pager::kv::KvOrder::Nhd,
        )
        .unwrap();
        let cache = gpu_pager::kv::KvCache::new(
            pager.clone(),
            "kv",
            layout,
            4,
            gpu_pager::kv::KvCacheConfig::default(),
        )
        .unwrap();
        let swap = cache.alloc_host(2).unwrap(); // 4 MiB of the 6
        let e = cache.alloc_host(2).map(|_| ()).unwrap_err();
        assert!(over_budget(&e), "{e}");

        file_region(&pager, dir, BackupFiles::Unnamed);
        let b = pager.alloc("w", 2 * MIB).unwrap();
        pager.write(&b, 0, &vec![7u8; 2 * MIB]).unwrap();
        let e = pager.release(&["w"]).unwrap_err();
        assert!(over_budget(&e), "{e}");
        assert_eq!(read(&pager, &b), vec![7u8; 2 * MIB]);

        drop(swap);
        pager.release(&["w"]).unwrap();
        pager.resume(&["w"]).unwrap();
        assert_eq!(read(&pager, &b), vec![7u8; 2 * MIB]);
        let e = cache.alloc_host(2).map(|_| ()).unwrap_err();
        assert!(
            over_budget(&e),
            "the staging buffer holds 4 MiB of the 6: {e}"
        );
        cache.alloc_host(1).unwrap();
        return;
    }
    let dir = scratch("budget");
    let out = common::this_binary()
        .args([
            "--exact",
            &common::test_path(
                module_path!(),
                "swap_space_and_file_staging_count_against_the_host_budget",
            ),
        ])
        .env(CHILD, &dir)
        .env("GPU_PAGER_LEDGER_DIR", dir.join("ledger"))
        .env_remove("GPU_PAGER_HOST_BUDGET")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pager with `config` on a host backend (64 KiB granules), its backups in `files` in a
/// fresh directory for `test`, and fixed region `w` of 4 MiB backed up in a file, holding
/// one 1 MiB buffer filled with `fill`.
fn one_file_buffer(
    test: &str,
    config: PagerConfig,
    files: BackupFiles,
    fill: u8,
) -> (PathBuf, Pager, gpu_pager::Buffer) {
    let dir = scratch(test);
    let backend = std::sync::Arc::new(HostBackend::new(HostConfig {
        capacity: 256 * MIB,
        granularity: 64 << 10,
    }));
    let pager = Pager::with_config(backend, config);
    pager.set_backup_files(&dir, files).unwrap();
    pager
        .region_with(
            "w",
            4 * MIB,
            Policy::Preserve,
            file_backed(gpu_pager::RegionKind::Fixed),
        )
        .unwrap();
    let b = pager.alloc("w", MIB).unwrap();
    pager.write(&b, 0, &vec![fill; MIB]).unwrap();
    (dir, pager, b)
}

/// Review item 8: `prepin` pins host memory only. With the setting on, a file-backed region
/// creates no backup file at its creation (a full disk would fail the model's load), only at
/// its first release; asked for explicitly on a file backup, `prepin` is refused naming why.
#[test]
fn prepin_pins_memory_only_and_creates_no_backup_file() {
    let config = PagerConfig {
        prepin: true,
        ..common::small_chunks()
    };
    let (dir, pager, b) = one_file_buffer("prepin-file", config, BackupFiles::Named, 9);
    assert!(spool::named(&dir).is_empty(), "{:?}", spool::named(&dir));
    assert_eq!(pager.stats().regions[0].backup_bytes, 0);
    pager.release(&["w"]).unwrap();
    assert_eq!(spool::named(&dir).len(), 1);
    pager.resume(&["w"]).unwrap();
    let mut back = vec![0u8; MIB];
    pager.read(&b, 0, &mut back).unwrap();
    assert_eq!(back, vec![9u8; MIB]);

    let asked = RegionOptions {
        prepin: true,
        ..file_backed(gpu_pager::RegionKind::Fixed)
    };
    let e = pager
        .region_with("x", 4 * MIB, Policy::Preserve, asked)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("no host memory to pin"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Review item 6: a file backup's staging buffer refused by the host budget is advised as
/// what it is, not told to back the region up to a file (it is one); nothing is lost.
#[test]
fn a_file_backup_s_staging_over_the_budget_is_not_told_to_use_a_file() {
    let config = PagerConfig {
        host_budget_bytes: MIB,
        ..common::small_chunks()
    };
    let (dir, pager, b) = one_file_buffer("staging-budget", config, BackupFiles::Unnamed, 3);
    let e = pager.release(&["w"]).unwrap_err();
    let msg = e.to_string();
    assert_eq!(e.code(), gpu_pager::ErrorCode::OutOfMemory, "{msg}");
    assert!(msg.contains("staging buffer"), "{msg}");
    assert!(!msg.contains("back this region up to a file"), "{msg}");
    assert_eq!(pager.info("w").unwrap().state, State::Resident);
    let mut back = vec![0u8; MIB];
    pager.read(&b, 0, &mut back).unwrap();
    assert_eq!(back, vec![3u8; MIB]);
    let _ = std::fs::remove_dir_all(&dir);
}
