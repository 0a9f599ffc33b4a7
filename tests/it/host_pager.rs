//! The pager on the host backend: the multi-stage wake-up, misuse, out-of-memory rollback,
//! leases, idempotence, bad input and concurrency. Runs in CI (no GPU needed).

use crate::common;

use std::sync::Arc;

use gpu_pager::backend::Backend;
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Error, Outcome, Pager, PagerConfig, Policy, RegionOptions, State};
use gpu_pager_testkit::Hog;

const MIB: usize = 1 << 20;

fn setup(capacity: usize) -> (Arc<HostBackend>, Pager) {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity,
        granularity: 64 << 10,
    }));
    let pager = Pager::with_config(
        backend.clone(),
        PagerConfig {
            chunk_bytes: 2 * MIB,
            verify_restore: true,
            tuning: gpu_pager::Tuning {
                discard_chunk_bytes: 2 * MIB,
                hash_chunk_bytes: 256 << 10,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    (backend, pager)
}

/// Deterministic bytes that differ per buffer and per generation.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn read_all(pager: &Pager, buf: &gpu_pager::Buffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.len()];
    pager.read(buf, 0, &mut out).unwrap();
    out
}

#[test]
fn seed_scenario_multi_stage_wake_up() {
    let (backend, pager) = setup(256 * MIB);
    let w = pager.region("weights", 20 * MIB, Policy::Preserve).unwrap();
    let kv = pager.region("kv_cache", 40 * MIB, Policy::Discard).unwrap();
    assert_eq!(backend.used_bytes(), 60 * MIB);

    // Weights in many odd-sized buffers.
    let bufs: Vec<_> = (0..37)
        .map(|i| pager.alloc("weights", 1000 + i * 4099).unwrap())
        .collect();
    let ptrs: Vec<u64> = bufs.iter().map(|b| pager.ptr(b).unwrap()).collect();
    for (i, b) in bufs.iter().enumerate() {
        pager.write(b, 0, &pattern(i as u64, b.len())).unwrap();
    }
    let kv_buf = pager.alloc("kv_cache", 8 * MIB).unwrap();
    pager.fill(&kv_buf, 0xABCD_EF01).unwrap();

    for cycle in 0..3u64 {
        let rel = pager.release(&["kv_cache", "weights"]).unwrap();
        assert_eq!(rel.bytes(), 60 * MIB);
        assert!(rel.region("weights").unwrap().copied > 0);
        assert_eq!(rel.region("kv_cache").unwrap().copied, 0);
        assert_eq!(backend.used_bytes(), 0, "memory goes back on release");
        let stats = pager.stats();
        assert_eq!(stats.resident_bytes(), 0);
        assert_eq!(stats.released_bytes(), 60 * MIB);
        assert_eq!(stats.backup_bytes(), 20 * MIB);

        // Stage 1: weights only.
        pager.resume(&["weights"]).unwrap();
        assert_eq!(backend.used_bytes(), 20 * MIB);
        for (i, b) in bufs.iter().enumerate() {
            let want = pattern(i as u64 + 100 * cycle, b.len());
            assert_eq!(read_all(&pager, b), want, "buffer {i} after cycle {cycle}");
            assert_eq!(
                pager.ptr(b).unwrap(),
                ptrs[i],
                "address of buffer {i} changed"
            );
        }
        assert!(matches!(
            pager.ptr(&kv_buf),
            Err(Error::NotResident { ref tag, .. }) if tag == "kv_cache"
        ));
        // Update the weights in place.
        for (i, b) in bufs.iter().enumerate() {
            pager
                .write(b, 0, &pattern(i as u64 + 100 * (cycle + 1), b.len()))
                .unwrap();
        }
        // Stage 2.
        pager.resume(&["kv_cache"]).unwrap();
        assert_eq!(backend.used_bytes(), 60 * MIB);
        assert_eq!(pager.info("weights").unwrap().base, w.base);
        assert_eq!(pager.info("kv_cache").unwrap().base, kv.base);
        // Discard memory comes back usable.
        pager.fill(&kv_buf, cycle as u32).unwrap();
    }
    let s = pager.stats();
    let ws = s.region("weights").unwrap();
    assert_eq!(ws.info.state, State::Resident);
    assert_eq!(ws.buffers, 37);
    assert!(ws.last_release.is_some() && ws.last_resume.is_some());
}

#[test]
fn discard_zeroed_comes_back_zero() {
    let (_b, pager) = setup(64 * MIB);
    pager.region("kv", 4 * MIB, Policy::DiscardZeroed).unwrap();
    let b = pager.alloc("kv", MIB).unwrap();
    assert!(read_all(&pager, &b).iter().all(|&x| x == 0));
    pager.fill(&b, 0x5555_5555).unwrap();
    pager.release(&["kv"]).unwrap();
    pager.resume(&["kv"]).unwrap();
    assert!(read_all(&pager, &b).iter().all(|&x| x == 0));
}

#[test]
fn misuse_before_resume_is_an_error_not_a_crash() {
    let (_b, pager) = setup(64 * MIB);
    pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    let w = pager.alloc("weights", 4096).unwrap();
    pager.write(&w, 0, &[1; 4096]).unwrap();
    pager.release(&["weights"]).unwrap();

    // The skipped-stage bug: updating weights that were never resumed.
    let err = pager.write(&w, 0, &[2; 4096]).unwrap_err();
    assert!(
        matches!(err, Error::NotResident { ref tag, op } if tag == "weights" && op == "a write")
    );
    assert!(err.to_string().contains("resume `weights` first"));
    let mut out = [0u8; 16];
    assert!(matches!(
        pager.read(&w, 0, &mut out),
        Err(Error::NotResident { .. })
    ));
    assert!(matches!(pager.fill(&w, 0), Err(Error::NotResident { .. })));
    assert!(matches!(
        pager.hash(&w, 1024),
        Err(Error::NotResident { .. })
    ));
    assert!(matches!(pager.ptr(&w), Err(Error::NotResident { .. })));
    assert!(matches!(
        pager.lease(&["weights"]),
        Err(Error::NotResident { .. })
    ));

    // The failed write changed nothing.
    pager.resume(&["weights"]).unwrap();
    assert_eq!(read_all(&pager, &w), vec![1; 4096]);
}

#[test]
fn oom_during_resume_rolls_back_and_a_retry_succeeds() {
    let (backend, pager) = setup(64 * MIB);
    pager.region("weights", 16 * MIB, Policy::Preserve).unwrap();
    pager.region("kv_cache", 32 * MIB, Policy::Discard).unwrap();
    let w = pager.alloc("weights", 16 * MIB).unwrap();
    let data = pattern(7, w.len());
    pager.write(&w, 0, &data).unwrap();
    pager.release(&["weights", "kv_cache"]).unwrap();

    // The trainer holds 40 of 64 MiB: weights (16) fit, weights + kv (48) do not.
    let trainer = Hog::take(backend.as_ref(), 40 * MIB).unwrap();
    let err = pager.resume(&["weights", "kv_cache"]).unwrap_err();
    match &err {
        Error::OutOfMemory {
            tag,
            during,
            requested,
            free,
        } => {
            assert_eq!(tag, "kv_cache");
            assert_eq!(*during, "resume");
            // kv_cache keeps no contents: the message promises only what holds for it.
            let text = err.to_string();
            assert!(
                text.contains("nothing was lost") && text.contains("stays released"),
                "{err}"
            );
            assert!(!text.contains("contents backed up"), "{err}");
            assert_eq!(*requested, 32 * MIB);
            // Free memory when the failure happened (regions map in tag order, so
            // kv_cache first): 64 - 40 held.
            assert_eq!(*free, 24 * MIB);
            assert!(free < requested);
        }
        e => panic!("expected OutOfMemory, got {e:?}"),
    }
    // All or nothing: the weights mapped in that call were unmapped again.
    assert_eq!(backend.used_bytes(), 40 * MIB);
    assert_eq!(pager.info("weights").unwrap().state, State::Released);
    assert_eq!(pager.stats().backup_bytes(), 16 * MIB);

    // A stage that fits works while the trainer still holds its memory.
    pager.resume(&["weights"]).unwrap();
    assert_eq!(read_all(&pager, &w), data);
    assert!(matches!(
        pager.resume(&["kv_cache"]),
        Err(Error::OutOfMemory { .. })
    ));
    drop(trainer);
    let rep = pager.resume(&["weights", "kv_cache"]).unwrap();
    assert_eq!(rep.region("weights").unwrap().outcome, Outcome::AlreadyDone);
    assert_eq!(rep.region("kv_cache").unwrap().outcome, Outcome::Done);
    assert_eq!(read_all(&pager, &w), data);
}

/// The trainer stand-in takes capacity (rounded up to the granularity), fails with
/// `OutOfMemory` past what is free, and gives it back when dropped.
#[test]
fn a_hog_takes_capacity_and_gives_it_back() {
    let backend = HostBackend::new(HostConfig {
        capacity: 8 * MIB,
        granularity: 2 * MIB,
    });
    let hog = Hog::take(&backend, 3 * MIB).unwrap();
    assert_eq!((hog.len(), hog.ptr()), (4 * MIB, None));
    assert_eq!(backend.used_bytes(), 4 * MIB);
    assert!(matches!(
        Hog::take(&backend, 5 * MIB),
        Err(gpu_pager::backend::BackendError::OutOfMemory { .. })
    ));
    assert!(Hog::take(&backend, 0).unwrap().is_empty());
    drop(hog);
    assert_eq!(backend.used_bytes(), 0);
}

#[test]
fn oom_on_the_first_region_of_a_resume_keeps_the_backup() {
    let (backend, pager) = setup(32 * MIB);
    pager.region("weights", 16 * MIB, Policy::Preserve).unwrap();
    let w = pager.alloc("weights", 3 * MIB + 5).unwrap();
    let data = pattern(3, w.len());
    pager.write(&w, 0, &data).unwrap();
    pager.release(&["weights"]).unwrap();
    let hog = Hog::take(backend.as_ref(), 20 * MIB).unwrap();
    for _ in 0..3 {
        assert!(matches!(
            pager.resume(&["weights"]),
            Err(Error::OutOfMemory { .. })
        ));
        assert_eq!(backend.used_bytes(), 20 * MIB);
    }
    drop(hog);
    pager.resume(&["weights"]).unwrap();
    assert_eq!(read_all(&pager, &w), data);
}

#[test]
fn leases_keep_tags_resident() {
    let (_b, pager) = setup(64 * MIB);
    pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    pager.region("kv_cache", 4 * MIB, Policy::Discard).unwrap();
    let lease = pager.lease(&["weights"]).unwrap();
    assert_eq!(lease.tags(), vec!["weights".to_owned()]);
    let err = pager.release(&["kv_cache", "weights"]).unwrap_err();
    assert!(matches!(err, Error::Busy { ref tag, leases: 1 } if tag == "weights"));
    // All or nothing: kv_cache was not released either.
    assert_eq!(pager.info("kv_cache").unwrap().state, State::Resident);
    let second = pager.lease(&["weights", "kv_cache", "weights"]).unwrap();
    assert_eq!(pager.stats().region("weights").unwrap().leases, 2);
    drop(lease);
    assert!(matches!(
        pager.release(&["weights"]),
        Err(Error::Busy { leases: 1, .. })
    ));
    drop(second);
    pager.release(&["weights", "kv_cache"]).unwrap();
    assert!(matches!(
        pager.remove("nope"),
        Err(Error::UnknownTag { .. })
    ));
}

#[test]
fn release_and_resume_are_idempotent() {
    let (backend, pager) = setup(64 * MIB);
    pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    let w = pager.alloc("weights", 100).unwrap();
    pager.write(&w, 0, &[9; 100]).unwrap();
    let r1 = pager.release(&["weights"]).unwrap();
    let r2 = pager.release(&["weights", "weights"]).unwrap();
    assert_eq!(r1.region("weights").unwrap().outcome, Outcome::Done);
    assert_eq!(r2.regions.len(), 1);
    assert_eq!(r2.region("weights").unwrap().outcome, Outcome::AlreadyDone);
    assert_eq!(r2.bytes(), 0);
    pager.resume(&["weights"]).unwrap();
    let r4 = pager.resume(&["weights"]).unwrap();
    assert_eq!(r4.region("weights").unwrap().outcome, Outcome::AlreadyDone);
    assert_eq!(backend.used_bytes(), 4 * MIB);
    assert_eq!(read_all(&pager, &w), vec![9; 100]);
    // The second release of a region already released keeps its backup as it was.
    pager.release(&["weights"]).unwrap();
    pager.release(&["weights"]).unwrap();
    pager.resume(&["weights"]).unwrap();
    assert_eq!(read_all(&pager, &w), vec![9; 100]);
}

#[test]
fn bad_input_is_a_typed_error() {
    let (_b, pager) = setup(64 * MIB);
    // A growing region of 0 bytes reserves the default range.
    let grows = pager.region_with(
        "grows",
        0,
        Policy::Preserve,
        gpu_pager::RegionOptions::GROWING,
    );
    assert_eq!(grows.unwrap().kind, gpu_pager::RegionKind::Growing);
    assert!(matches!(
        pager.region("huge", usize::MAX, Policy::Preserve),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        pager.region("", 10, Policy::Preserve),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        pager.region("big", 1 << 40, Policy::Discard),
        Err(Error::InvalidSize { .. })
    ));
    pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    // Same tag, same policy and size: the same region.
    let again = pager
        .region("weights", 4 * MIB - 1, Policy::Preserve)
        .unwrap();
    assert_eq!(again.size, 4 * MIB);
    assert!(matches!(
        pager.region("weights", 4 * MIB, Policy::Discard),
        Err(Error::TagConflict { .. })
    ));
    assert!(matches!(
        pager.region("weights", 8 * MIB, Policy::Preserve),
        Err(Error::TagConflict { .. })
    ));
    assert!(matches!(
        pager.release(&["weights", "nope"]),
        Err(Error::UnknownTag { ref tag, nearest: None }) if tag == "nope"
    ));
    assert_eq!(pager.info("weights").unwrap().state, State::Resident);
    assert!(matches!(
        pager.resume(&["nope"]),
        Err(Error::UnknownTag { .. })
    ));
    assert!(matches!(
        pager.alloc("nope", 1),
        Err(Error::UnknownTag { .. })
    ));
    assert!(matches!(
        pager.alloc("weights", 0),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        pager.alloc_aligned("weights", 8, 3),
        Err(Error::InvalidArgument { .. })
    ));
    let g = pager.backend().info().granularity;
    let above = pager.alloc_aligned("weights", 8, 2 * g).unwrap_err();
    let said = above.to_string();
    assert!(matches!(above, Error::InvalidArgument { .. }), "{said}");
    assert!(
        said.contains(&format!("granularity ({g} bytes)")) && !said.contains("  "),
        "{said}"
    );
    assert!(matches!(
        pager.alloc("weights", 4 * MIB + 1),
        Err(Error::RegionFull { .. })
    ));
    let b = pager.alloc("weights", 1000).unwrap();
    assert!(matches!(
        pager.write(&b, 990, &[0; 11]),
        Err(Error::OutOfRange { what: "buffer", .. })
    ));
    assert!(matches!(
        pager.write(&b, usize::MAX, &[0; 2]),
        Err(Error::OutOfRange { .. })
    ));
    let mut out = [0u8; 1001];
    assert!(matches!(
        pager.read(&b, 0, &mut out),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        pager.hash(&b, 15),
        Err(Error::InvalidArgument { .. })
    ));
    pager.free(&b).unwrap();
    assert!(matches!(pager.free(&b), Err(Error::StaleBuffer { .. })));
    assert!(matches!(pager.ptr(&b), Err(Error::StaleBuffer { .. })));
    assert!(matches!(
        pager.write(&b, 0, &[1]),
        Err(Error::StaleBuffer { .. })
    ));
}

#[test]
fn remove_and_backup_freeing() {
    let (backend, pager) = setup(64 * MIB);
    pager
        .region_with(
            "weights",
            4 * MIB,
            Policy::Preserve,
            RegionOptions {
                prepin: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        pager.stats().backup_bytes(),
        4 * MIB,
        "prepinned at creation"
    );
    let rep = pager.release(&["weights"]).unwrap();
    assert_eq!(
        rep.region("weights").unwrap().steps.pin,
        std::time::Duration::ZERO
    );
    let b = pager.alloc("weights", 64).unwrap();
    pager.free(&b).unwrap();
    pager.release(&["weights"]).unwrap();
    // With the buffer freed nothing needed saving, so the backup may go.
    assert_eq!(pager.free_backup("weights").unwrap(), 4 * MIB);
    pager.resume(&["weights"]).unwrap();
    let b = pager.alloc("weights", 64).unwrap();
    pager.write(&b, 0, &[1; 64]).unwrap();
    pager.release(&["weights"]).unwrap();
    assert!(matches!(
        pager.free_backup("weights"),
        Err(Error::BackupInUse { .. })
    ));
    pager.remove("weights").unwrap();
    assert_eq!(backend.used_bytes(), 0);
    assert!(pager.tags().is_empty());
    assert!(matches!(pager.ptr(&b), Err(Error::StaleBuffer { .. })));
}

#[test]
fn pager_is_send_and_sync_and_tags_move_concurrently() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Pager>();
    assert_send_sync::<gpu_pager::Lease>();

    let (backend, pager) = setup(512 * MIB);
    let pager = Arc::new(pager);
    let tags: Vec<String> = (0..4).map(|i| format!("t{i}")).collect();
    for t in &tags {
        pager.region(t, 8 * MIB, Policy::Preserve).unwrap();
    }
    // Runs `f` with `tag` held resident, resuming it first if another thread released it.
    fn resident<T>(pager: &Pager, tag: &str, f: impl FnOnce() -> T) -> T {
        loop {
            pager.resume(&[tag]).unwrap();
            if let Ok(_lease) = pager.lease(&[tag]) {
                return f();
            }
        }
    }
    std::thread::scope(|s| {
        for (i, t) in tags.iter().enumerate() {
            let pager = pager.clone();
            s.spawn(move || {
                let b = pager.alloc(t, 3 * MIB).unwrap();
                for c in 0..20u64 {
                    let d = pattern(i as u64 * 1000 + c, b.len());
                    resident(&pager, t, || pager.write(&b, 0, &d).unwrap());
                    pager.release(&[t]).unwrap();
                    pager.resume(&[t]).unwrap();
                    assert_eq!(resident(&pager, t, || read_all(&pager, &b)), d);
                }
            });
        }
        // Another thread moves all tags together meanwhile; a lease makes it back off.
        let pager = pager.clone();
        let all: Vec<&str> = tags.iter().map(|s| s.as_str()).collect();
        s.spawn(move || {
            for _ in 0..10 {
                match pager.release(&all) {
                    Ok(_) | Err(Error::Busy { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
                pager.resume(&all).unwrap();
            }
        });
    });
    assert_eq!(backend.used_bytes(), 32 * MIB);
    assert!(backend.mem_info().unwrap().free >= 480 * MIB);
}

#[test]
fn release_copies_only_changed_chunks() {
    let (_b, pager) = setup(64 * MIB);
    pager.region("weights", 8 * MIB, Policy::Preserve).unwrap();
    let bufs: Vec<_> = (0..8)
        .map(|_| pager.alloc("weights", MIB - 512).unwrap())
        .collect();
    for (i, b) in bufs.iter().enumerate() {
        pager.write(b, 0, &pattern(i as u64, b.len())).unwrap();
    }
    let first = pager.release(&["weights"]).unwrap();
    let all = first.copied();
    assert!(all > 7 * MIB);
    pager.resume(&["weights"]).unwrap();

    // Nothing changed since the restore: nothing to copy.
    let unchanged = pager.release(&["weights"]).unwrap();
    assert_eq!(unchanged.copied(), 0);
    pager.resume(&["weights"]).unwrap();

    // One buffer changed: only the hash chunks (256 KiB here) it touches are copied.
    pager.write(&bufs[3], 1000, &[0xEE; 300_000]).unwrap();
    let partial = pager.release(&["weights"]).unwrap();
    assert!(
        partial.copied() > 0 && partial.copied() <= 3 * (256 << 10),
        "{}",
        partial.copied()
    );
    pager.resume(&["weights"]).unwrap();
    for (i, b) in bufs.iter().enumerate() {
        let mut want = pattern(i as u64, b.len());
        if i == 3 {
            want[1000..301_000].fill(0xEE);
        }
        assert_eq!(read_all(&pager, b), want, "buffer {i}");
    }
}

#[test]
fn resume_on_a_stream_restores_contents() {
    let (_b, pager) = setup(64 * MIB);
    pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    let w = pager.alloc("weights", 3 * MIB).unwrap();
    let data = pattern(11, w.len());
    pager.write(&w, 0, &data).unwrap();
    pager.release(&["weights"]).unwrap();
    let rep = pager
        .resume_on(&["weights"], gpu_pager::backend::RawStream(0))
        .unwrap();
    assert_eq!(rep.copied(), 3 * MIB);
    assert_eq!(read_all(&pager, &w), data);
}

/// A backend whose restores flip one byte: `verify_restore` must catch it, undo the resume
/// and keep the backup, so that a resume without the fault succeeds.
#[test]
fn verify_restore_catches_a_corrupted_restore() {
    use common::broken::{Broken, Flaw};
    use std::sync::atomic::Ordering;

    let host = HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: 64 << 10,
    });
    let backend = Arc::new(Broken::new(host, Flaw::FlipRestores));
    backend.active.store(false, Ordering::SeqCst);
    for skip_unchanged in [true, false] {
        let pager = Pager::with_config(
            backend.clone(),
            PagerConfig {
                chunk_bytes: MIB,
                verify_restore: true,
                skip_unchanged,
                tuning: gpu_pager::Tuning {
                    discard_chunk_bytes: MIB,
                    ..gpu_pager::Tuning::default()
                },
                ..PagerConfig::default()
            },
        );
        pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
        let w = pager.alloc("weights", 3 * MIB).unwrap();
        let data = pattern(5, w.len());
        pager.write(&w, 0, &data).unwrap();
        pager.release(&["weights"]).unwrap();
        backend.active.store(true, Ordering::SeqCst);
        let err = pager.resume(&["weights"]).unwrap_err();
        assert!(
            matches!(err, Error::Corrupted { ref tag, .. } if tag == "weights"),
            "{err}"
        );
        assert_eq!(pager.info("weights").unwrap().state, State::Released);
        backend.active.store(false, Ordering::SeqCst);
        pager.resume(&["weights"]).unwrap();
        assert_eq!(read_all(&pager, &w), data);
    }
}

#[test]
fn resume_and_lease_leaves_no_gap() {
    let (_b, pager) = setup(64 * MIB);
    pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    pager.release(&["weights"]).unwrap();
    let (rep, lease) = pager.resume_and_lease(&["weights"]).unwrap();
    assert_eq!(rep.region("weights").unwrap().outcome, Outcome::Done);
    assert!(matches!(
        pager.release(&["weights"]),
        Err(Error::Busy { leases: 1, .. })
    ));
    drop(lease);
    pager.release(&["weights"]).unwrap();
    assert!(matches!(
        pager.resume_and_lease(&["nope"]),
        Err(Error::UnknownTag { .. })
    ));
}
