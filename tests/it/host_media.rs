//! Backup media on the host backend: pinned (kept), host memory given back after each
//! resume, and files; the choices they refuse; a full disk that loses nothing.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{Rng, read};
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Error, Medium, Pager, PagerConfig, Policy, RegionOptions, ResumeOptions, State};
use gpu_pager_testkit::spool;

const MIB: usize = 1 << 20;
const G: usize = 2 * MIB;

fn pager_with(config: PagerConfig) -> Pager {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity: 256 * MIB,
        granularity: G,
    }));
    Pager::with_config(backend, config)
}

fn pager() -> Pager {
    pager_with(common::small_chunks())
}

/// A fresh directory for one test's backup files.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpu-pager-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Names in `dir`, and this process's unnamed backup files there.
fn files_in(dir: &Path) -> (Vec<String>, Vec<spool::Spooled>) {
    (spool::names(dir), spool::spooled(dir))
}

fn with_medium(medium: Medium) -> RegionOptions {
    RegionOptions {
        medium,
        ..RegionOptions::default()
    }
}

#[test]
fn every_medium_restores_fixed_and_growing_regions_bit_exact() {
    let dir = scratch("media-cycle");
    for medium in [Medium::Pinned, Medium::Host, Medium::File] {
        for bytes in [0, 24 * MIB] {
            let pager = pager_with(PagerConfig {
                tuning: gpu_pager::Tuning {
                    file_chunk_bytes: 1 << 20, // several chunks per buffer
                    ..common::small_chunks().tuning
                },
                ..common::small_chunks()
            });
            pager.set_backup_dir(&dir).unwrap();
            let info =
                common::table_region(&pager, "w", bytes, Policy::Preserve, with_medium(medium))
                    .unwrap();
            assert_eq!(info.medium, medium);
            let mut rng = Rng::seeded("media_cycle");
            let bufs: Vec<_> = [3 * MIB + 5, 100, 5 * MIB]
                .into_iter()
                .map(|len| {
                    let b = pager.alloc("w", len).unwrap();
                    let data = rng.bytes(len);
                    pager.write(&b, 0, &data).unwrap();
                    (b, data)
                })
                .collect();
            for cycle in 0..3 {
                let what = format!("{medium:?}, {bytes} bytes, cycle {cycle}");
                pager.release(&["w"]).unwrap();
                let held = pager.region_stats("w").unwrap();
                assert!(held.backup_bytes > 0, "{what}: a backup while released");
                if medium == Medium::File {
                    let (names, files) = files_in(&dir);
                    assert!(names.is_empty(), "{what}: no names: {names:?}");
                    assert_eq!(files.len(), 1, "{what}: one file per pager: {files:?}");
                    assert!(
                        files[0].on_disk >= held.backup_bytes as u64,
                        "{what}: {files:?} holds the backups ({} bytes)",
                        held.backup_bytes
                    );
                }
                pager.resume(&["w"]).unwrap();
                for (b, data) in &bufs {
                    assert_eq!(&read(&pager, b), data, "{what}");
                }
                let after = pager.region_stats("w").unwrap();
                if medium == Medium::Host {
                    assert_eq!(after.backup_bytes, 0, "{what}: host memory given back");
                } else {
                    assert_eq!(after.backup_bytes, held.backup_bytes, "{what}: kept");
                }
            }
            pager.remove("w").unwrap();
            assert_eq!(
                spool::on_disk(&dir),
                0,
                "the disk space goes with the region"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_file_backup_skips_unchanged_chunks_and_follows_freed_buffers() {
    let dir = scratch("media-skip");
    let pager = pager();
    pager.set_backup_dir(&dir).unwrap();
    pager
        .region_with(
            "w",
            0,
            Policy::Preserve,
            RegionOptions {
                kind: gpu_pager::RegionKind::Growing,
                ..with_medium(Medium::File)
            },
        )
        .unwrap();
    let a = pager.alloc("w", 4 * MIB).unwrap();
    let b = pager.alloc("w", 2 * MIB).unwrap();
    pager.write(&a, 0, &vec![1; 4 * MIB]).unwrap();
    pager.write(&b, 0, &vec![2; 2 * MIB]).unwrap();
    let first = pager.release(&["w"]).unwrap();
    assert_eq!(first.regions[0].copied, 6 * MIB);
    pager.resume(&["w"]).unwrap();
    let again = pager.release(&["w"]).unwrap();
    assert_eq!(again.regions[0].copied, 0, "unchanged: nothing written");
    pager.resume(&["w"]).unwrap();
    assert!((6 * MIB as u64..7 * MIB as u64).contains(&spool::on_disk(&dir)));
    pager.free(&b).unwrap();
    assert!(
        (4 * MIB as u64..5 * MIB as u64).contains(&spool::on_disk(&dir)),
        "the freed buffer's disk space is given back: {:?}",
        spool::spooled(&dir)
    );
    // A buffer freed while released gives its space back too, and the rest comes back.
    pager.release(&["w"]).unwrap();
    pager.free(&a).unwrap();
    assert_eq!(spool::on_disk(&dir), 0);
    pager.resume(&["w"]).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_resume_can_keep_host_backups_and_the_next_gives_them_back() {
    let pager = pager();
    pager
        .region_with("w", 8 * MIB, Policy::Preserve, with_medium(Medium::Host))
        .unwrap();
    let b = pager.alloc("w", 4096).unwrap();
    pager.write(&b, 0, &[9; 4096]).unwrap();
    pager.release(&["w"]).unwrap();
    let ptr = pager
        .backup_ptr(&b, 0, 4096)
        .unwrap()
        .expect("held in host memory");
    let keep = ResumeOptions {
        keep_host_backups: true,
    };
    pager.resume_with(&["w"], keep).unwrap();
    assert_eq!(
        pager.backup_ptr(&b, 0, 4096).unwrap(),
        Some(ptr),
        "kept in place"
    );
    // SAFETY: the backup is kept (asserted above) and nothing writes it meanwhile.
    let held = unsafe { std::slice::from_raw_parts(ptr as *const u8, 4096) };
    assert_eq!(held, &[9; 4096]);
    let again = pager.release(&["w"]).unwrap();
    assert_eq!(
        again.regions[0].copied, 0,
        "kept backup: an unchanged release copies nothing"
    );
    pager.resume(&["w"]).unwrap();
    assert_eq!(pager.backup_ptr(&b, 0, 4096).unwrap(), None);
    assert_eq!(pager.region_stats("w").unwrap().backup_bytes, 0);
    assert_eq!(read(&pager, &b), vec![9; 4096]);
}

#[test]
fn backup_ptr_points_at_exactly_the_saved_bytes() {
    let pager = pager();
    pager.region("w", 8 * MIB, Policy::Preserve).unwrap();
    pager.region("kv", 8 * MIB, Policy::Discard).unwrap();
    let w = pager.alloc("w", 1000).unwrap();
    let kv = pager.alloc("kv", 1000).unwrap();
    assert_eq!(
        pager.backup_ptr(&w, 0, 1000).unwrap(),
        None,
        "nothing saved yet"
    );
    let data: Vec<u8> = (0..1000).map(|i| i as u8).collect();
    pager.write(&w, 0, &data).unwrap();
    pager.release(&["w", "kv"]).unwrap();
    let p = pager.backup_ptr(&w, 10, 990).unwrap().expect("saved");
    // SAFETY: the region is released; its backup holds these bytes until the next release.
    let held = unsafe { std::slice::from_raw_parts(p as *const u8, 990) };
    assert_eq!(held, &data[10..]);
    assert_eq!(
        pager.backup_ptr(&kv, 0, 1000).unwrap(),
        None,
        "Discard keeps nothing"
    );
    assert!(matches!(
        pager.backup_ptr(&w, 10, 991),
        Err(Error::OutOfRange { .. })
    ));
}

#[test]
fn media_refuse_what_they_cannot_do() {
    let pager = pager();
    let e = pager
        .region_with("kv", 8 * MIB, Policy::Discard, with_medium(Medium::Host))
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("preserve regions"), "{e}");
    let prepin_host = RegionOptions {
        prepin: true,
        medium: Medium::Host,
        ..RegionOptions::default()
    };
    let e = pager
        .region_with("w", 8 * MIB, Policy::Preserve, prepin_host)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    pager
        .region_with("w", 8 * MIB, Policy::Preserve, with_medium(Medium::Pinned))
        .unwrap();
    let e = pager
        .region_with("w", 8 * MIB, Policy::Preserve, with_medium(Medium::File))
        .unwrap_err();
    match &e {
        Error::TagConflict { differs, .. } => assert_eq!(differs, "backup medium"),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("file backup"), "{e}");
    let e = pager
        .set_backup_dir("/proc/gpu-pager-not-writable")
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(
        e.to_string().contains("/proc/gpu-pager-not-writable"),
        "{e}"
    );
}

#[test]
fn a_file_backup_without_a_directory_fails_the_release_and_loses_nothing() {
    if std::env::var_os(gpu_pager::BACKUP_DIR_ENV).is_some() {
        eprintln!("skipped: {} is set", gpu_pager::BACKUP_DIR_ENV);
        return;
    }
    let pager = pager();
    pager
        .region_with("w", 8 * MIB, Policy::Preserve, with_medium(Medium::File))
        .unwrap();
    let b = pager.alloc("w", 4096).unwrap();
    pager.write(&b, 0, &[5; 4096]).unwrap();
    let e = pager.release(&["w"]).unwrap_err();
    assert!(e.to_string().contains("set_backup_dir"), "{e}");
    assert_eq!(pager.info("w").unwrap().state, State::Resident);
    assert_eq!(read(&pager, &b), vec![5; 4096]);
}

/// Run in a child process whose file size limit stands in for a full disk: the release
/// fails, the region stays resident with its contents, and no file is left behind.
#[test]
fn a_full_disk_fails_the_release_and_loses_nothing() {
    const CHILD: &str = "GPU_PAGER_FULL_DISK_CHILD";
    if let Some(dir) = std::env::var_os(CHILD) {
        let dir = PathBuf::from(dir);
        let pager = pager();
        pager.set_backup_dir(&dir).unwrap();
        pager
            .region_with("w", 16 * MIB, Policy::Preserve, with_medium(Medium::File))
            .unwrap();
        let b = pager.alloc("w", 8 * MIB).unwrap();
        pager.write(&b, 0, &vec![3; 8 * MIB]).unwrap();
        // The host backend's memory is memfds, which the limit would fail too: set it now.
        let limit = libc::rlimit {
            rlim_cur: 1 << 20,
            rlim_max: 1 << 20,
        };
        // SAFETY: a plain system call; this child process runs this test alone.
        unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
        // SAFETY: as above; `limit` is a valid rlimit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &limit) }, 0);
        let e = pager.release(&["w"]).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("nothing was lost") && text.contains("disk"),
            "{text}"
        );
        assert_eq!(pager.info("w").unwrap().state, State::Resident);
        assert_eq!(read(&pager, &b), vec![3; 8 * MIB]);
        assert_eq!(files_in(&dir).0, Vec::<String>::new());
        assert_eq!(
            spool::on_disk(&dir),
            0,
            "the backup's extent was given back"
        );
        return;
    }
    let dir = scratch("media-full");
    let mut child = common::this_binary();
    child
        .args([
            "--exact",
            &common::test_path(
                module_path!(),
                "a_full_disk_fails_the_release_and_loses_nothing",
            ),
        ])
        .env(CHILD, &dir);
    let out = child.output().unwrap();
    let log =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{log}");
    assert!(log.contains("1 passed"), "the child ran the test:\n{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_buffer_of_one_pager_is_stale_in_another() {
    let (p1, p2) = (pager(), pager());
    p1.region("w", 8 * MIB, Policy::Preserve).unwrap();
    p2.region("w", 8 * MIB, Policy::Preserve).unwrap();
    let a = p1.alloc("w", 4096).unwrap();
    let b = p2.alloc("w", 4096).unwrap();
    assert_eq!((a.tag(), a.offset()), (b.tag(), b.offset()));
    p2.write(&b, 0, &[2; 4096]).unwrap();
    assert!(matches!(
        p2.write(&a, 0, &[1; 4096]),
        Err(Error::StaleBuffer { .. })
    ));
    assert!(matches!(p2.free(&a), Err(Error::StaleBuffer { .. })));
    assert_eq!(read(&p2, &b), vec![2; 4096], "p2's buffer untouched");
}
