//! The fault-injecting backend (`gpu_pager_testkit`) itself, and the pager's error paths
//! it opens: armed and planned faults, unmap failures recorded in a drop, copy, pin and map
//! faults in a release or resume (nothing lost, a retry succeeds).

use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::backend::{Backend, BackendError, Direction, Mover, RawCopy};
use gpu_pager::{Buffer, Error, Pager, PagerConfig, Policy, State};
use gpu_pager_testkit::{FaultPlan, FaultPoint, FaultyBackend};

use crate::common::Rng;

const MIB: usize = 1 << 20;

/// A pager over a faulty host backend: 1 MiB chunks, 256 KiB hash chunks.
fn setup(skip_unchanged: bool) -> (Arc<HostBackend>, Arc<FaultyBackend>, Pager) {
    let host = Arc::new(HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: 64 << 10,
    }));
    let faulty = Arc::new(FaultyBackend::new(host.clone(), FaultPlan::none()));
    let pager = Pager::with_config(
        faulty.clone(),
        PagerConfig {
            chunk_bytes: MIB,
            skip_unchanged,
            tuning: gpu_pager::Tuning {
                discard_chunk_bytes: MIB,
                hash_chunk_bytes: 256 << 10,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    (host, faulty, pager)
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    Rng::seeded_from(seed).bytes(len)
}

fn read_all(pager: &Pager, b: &Buffer) -> Vec<u8> {
    let mut out = vec![0u8; b.len()];
    pager.read(b, 0, &mut out).expect("read");
    out
}

fn injected(e: &Error) -> bool {
    matches!(
        e,
        Error::Backend {
            error: BackendError::Injected { .. },
            ..
        }
    )
}

/// `weights`: Preserve, 4 MiB (4 chunks), 3 MiB of data in one buffer; `kv`: Discard,
/// 2 MiB.
fn weights(pager: &Pager, seed: u64) -> (Buffer, Vec<u8>) {
    pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    pager.region("kv", 2 * MIB, Policy::Discard).unwrap();
    let w = pager.alloc("weights", 3 * MIB).unwrap();
    let data = bytes(seed, w.len());
    pager.write(&w, 0, &data).unwrap();
    (w, data)
}

fn state(pager: &Pager, tag: &str) -> State {
    pager.info(tag).unwrap().state
}

#[test]
fn the_plan_is_deterministic_and_respects_its_rates() {
    let plan = FaultPlan {
        seed: 7,
        copy_per_mille: 100,
        map_per_mille: 0,
        pin_per_mille: 1000,
    };
    let seq = |p: FaultPlan| (0..2000).map(move |n| p.fails(FaultPoint::CopyToHost, n));
    assert!(seq(plan).eq(seq(plan)));
    let hits = seq(plan).filter(|&f| f).count();
    assert!((120..=280).contains(&hits), "{hits} of 2000 at 10%");
    assert!((0..2000).all(|n| !plan.fails(FaultPoint::Map, n)));
    assert!((0..2000).all(|n| plan.fails(FaultPoint::AllocPinned, n)));
    let other = FaultPlan { seed: 8, ..plan };
    assert!(!seq(plan).eq(seq(other)), "the seed matters");
}

#[test]
fn armed_faults_fire_once_map_nothing_and_count() {
    let (host, faulty, _pager) = setup(true);
    let r = faulty.reserve(2 * MIB).unwrap();
    faulty.fail_after(FaultPoint::Map, 1);
    // SAFETY: each span lies in the fresh reservation and is mapped at most once.
    let first = unsafe { faulty.map(&r, 0, &[MIB]) }.unwrap();
    // SAFETY: as above.
    let err = unsafe { faulty.map(&r, MIB, &[MIB]) }.unwrap_err();
    assert!(matches!(err, BackendError::Injected { op: "map" }));
    assert_eq!(host.used_bytes(), MIB, "a failed map maps nothing");
    // SAFETY: as above; the failed call mapped nothing.
    let again = unsafe { faulty.map(&r, MIB, &[MIB]) }.unwrap();
    assert_eq!(host.used_bytes(), 2 * MIB);
    drop((first, again));
    assert_eq!(faulty.injected().map, 1);
    assert_eq!(faulty.injected().total(), 1);

    // The plan: off means no faults and no progress through it.
    let always = FaultyBackend::new(
        host.clone(),
        FaultPlan {
            copy_per_mille: 1000,
            ..FaultPlan::none()
        },
    );
    let unit = RawCopy {
        direction: Direction::ToHost,
        host: 0,
        host_device: 0,
        device: 0,
        bytes: 1,
    };
    // SAFETY: the injected fault returns before any address is touched.
    let e = unsafe { always.copy_unit(&unit, Mover::CopyKernel) }.unwrap_err();
    assert!(matches!(e, BackendError::Injected { op: "copy_unit" }));
    always.set_enabled(false);
    assert_eq!(always.injected().copy_to_host, 1);
}

#[test]
fn unmap_failures_in_drop_are_kept_as_values_not_returned() {
    let (host, faulty, pager) = setup(true);
    pager.region("kv", 2 * MIB, Policy::Discard).unwrap();
    assert_eq!(host.used_bytes(), 2 * MIB);
    faulty.fail_next_unmap();
    faulty.fail_next_unmap();
    // The release itself succeeds: both chunks are unmapped, the failures are deferred.
    pager.release(&["kv"]).unwrap();
    assert_eq!(host.used_bytes(), 0);
    assert_eq!(faulty.injected_unmaps(), 2);
    let stats = pager.stats();
    assert_eq!(stats.deferred_errors.len(), 2);
    assert_eq!(stats.deferred_errors_total, 2);
    assert!(
        stats.deferred_errors[0].contains("injected fault in unmap"),
        "{:?}",
        stats.deferred_errors
    );
    // The next call is not failed by them; they stay until taken.
    pager.resume(&["kv"]).unwrap();
    assert_eq!(pager.stats().deferred_errors.len(), 2);
    let taken = pager.take_deferred_errors();
    assert_eq!(taken, stats.deferred_errors);
    assert!(pager.take_deferred_errors().is_empty());
    let stats = pager.stats();
    assert!(stats.deferred_errors.is_empty());
    assert_eq!(stats.deferred_errors_total, 2);
    // Dropping the pager drops the region's mappings: nothing armed, nothing recorded.
    drop(pager);
    assert_eq!(faulty.deferred_errors().total(), 2);
    assert_eq!(host.used_bytes(), 0);
}

#[test]
fn a_kv_cache_dropped_under_a_lease_records_why_it_kept_its_region() {
    use gpu_pager::kv::{KvCache, KvCacheConfig, KvDtype, KvLayout, KvOrder};
    let (_host, _faulty, pager) = setup(true);
    let pager = Arc::new(pager);
    let layout = KvLayout::new(1, 1, 64, 16, KvDtype::Bf16, KvOrder::Nhd).unwrap();
    let config = KvCacheConfig { chunk_bytes: MIB };
    let kv = KvCache::new(pager.clone(), "kv_cache", layout, 64, config).unwrap();
    let lease = pager.lease(&["kv_cache"]).unwrap();
    drop(kv);
    let errors = pager.take_deferred_errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("dropping the KV cache `kv_cache`"),
        "{errors:?}"
    );
    assert!(pager.tags().contains(&"kv_cache".to_owned()));
    drop(lease);
    pager.remove("kv_cache").unwrap();
    assert!(pager.take_deferred_errors().is_empty());
}

#[test]
fn release_copy_fault_leaves_the_region_resident_and_intact() {
    // The save copies two runs of changed hash chunks (or everything): fail the first
    // copy, then the second (after the first run already landed in the backup).
    for (skip_unchanged, pass) in [(true, 0), (true, 1), (false, 0)] {
        let (host, faulty, pager) = setup(skip_unchanged);
        let (w, data) = weights(&pager, 1);
        // A first cycle, so that the backup and its hashes exist; then change the
        // first and the last hash chunk of the buffer.
        pager.release(&["weights"]).unwrap();
        pager.resume(&["weights"]).unwrap();
        let mut data2 = data.clone();
        data2[..100].fill(0xA5);
        data2[3 * MIB - 100..].fill(0x5A);
        pager.write(&w, 0, &data2).unwrap();
        let used = host.used_bytes();

        faulty.fail_after(FaultPoint::CopyToHost, pass);
        let err = pager.release(&["kv", "weights"]).unwrap_err();
        assert!(injected(&err), "{err}");
        assert_eq!(state(&pager, "weights"), State::Resident);
        assert_eq!(state(&pager, "kv"), State::Resident);
        assert_eq!(host.used_bytes(), used, "nothing was unmapped");
        assert_eq!(read_all(&pager, &w), data2, "contents intact");

        // The retry releases, and a resume brings back the new contents.
        pager.release(&["kv", "weights"]).unwrap();
        assert_eq!(host.used_bytes(), 0);
        pager.resume(&["weights"]).unwrap();
        assert_eq!(
            read_all(&pager, &w),
            data2,
            "skip {skip_unchanged} pass {pass}"
        );
        assert_eq!(faulty.injected().copy_to_host, 1);
    }
}

#[test]
fn pin_fault_on_first_release_leaves_the_region_resident() {
    let (_host, faulty, pager) = setup(true);
    let (w, data) = weights(&pager, 3);
    faulty.fail_next(FaultPoint::AllocPinned);
    let err = pager.release(&["weights"]).unwrap_err();
    assert!(injected(&err), "{err}");
    assert_eq!(state(&pager, "weights"), State::Resident);
    assert_eq!(read_all(&pager, &w), data);
    pager.release(&["weights"]).unwrap();
    pager.resume(&["weights"]).unwrap();
    assert_eq!(read_all(&pager, &w), data);
}

#[test]
fn resume_map_fault_leaves_the_regions_released_and_a_retry_restores() {
    // Map calls of `resume(["kv", "weights"])`: kv (Discard, first), then weights in
    // groups of 1, 2, 1 chunks. Fail each in turn.
    for pass in 0..4 {
        let (host, faulty, pager) = setup(true);
        let (w, data) = weights(&pager, 4);
        pager.release(&["weights", "kv"]).unwrap();
        assert_eq!(host.used_bytes(), 0);
        faulty.fail_after(FaultPoint::Map, pass);
        let err = pager.resume(&["kv", "weights"]).unwrap_err();
        assert!(injected(&err), "map call {pass}: {err}");
        assert_eq!(state(&pager, "weights"), State::Released);
        assert_eq!(state(&pager, "kv"), State::Released);
        assert_eq!(
            host.used_bytes(),
            0,
            "everything this call mapped is unmapped"
        );
        assert!(matches!(pager.ptr(&w), Err(Error::NotResident { .. })));

        pager.resume(&["kv", "weights"]).unwrap();
        assert_eq!(
            read_all(&pager, &w),
            data,
            "bit-exact after the retry ({pass})"
        );
        assert_eq!(faulty.injected().map, 1);
    }
}

#[test]
fn resume_restore_copy_fault_leaves_the_region_released_and_a_retry_restores() {
    // Restore copies: chunk group 1 (1 MiB), group 2 (2 MiB); group 3 is past the data.
    for pass in 0..2 {
        let (host, faulty, pager) = setup(true);
        let (w, data) = weights(&pager, 5);
        pager.release(&["weights"]).unwrap();
        let used = host.used_bytes();
        faulty.fail_after(FaultPoint::CopyToDevice, pass);
        let err = pager.resume(&["weights"]).unwrap_err();
        assert!(injected(&err), "copy {pass}: {err}");
        assert_eq!(state(&pager, "weights"), State::Released);
        assert_eq!(
            host.used_bytes(),
            used,
            "the mapped groups are unmapped again"
        );

        pager.resume(&["weights"]).unwrap();
        assert_eq!(
            read_all(&pager, &w),
            data,
            "bit-exact after the retry ({pass})"
        );
        // And the next cycle still saves and restores correctly.
        pager.release(&["weights"]).unwrap();
        pager.resume(&["weights"]).unwrap();
        assert_eq!(read_all(&pager, &w), data);
        assert_eq!(faulty.injected().copy_to_device, 1);
    }
}

#[test]
fn a_map_made_ahead_that_fails_after_the_resume_failed_is_recorded_not_lost() {
    // Map calls of `resume(["weights"])`: groups of 1, 2, 1 chunks, the later ones made
    // ahead on a helper thread while the first group's copy fails. A helper's map call
    // that fails after that (the second or the third) cannot be returned as well.
    for pass in [1, 2] {
        let (host, faulty, pager) = setup(true);
        let (w, data) = weights(&pager, 6);
        pager.release(&["weights"]).unwrap();
        let used = host.used_bytes();
        faulty.fail_next(FaultPoint::CopyToDevice);
        faulty.fail_after(FaultPoint::Map, pass);
        let err = pager.resume(&["weights"]).unwrap_err();
        let copy_failed = matches!(
            &err,
            Error::Backend { error: BackendError::Injected { op }, .. } if op.starts_with("copy")
        );
        assert!(copy_failed, "the copy's error is returned ({pass}): {err}");
        assert_eq!(state(&pager, "weights"), State::Released);
        assert_eq!(
            host.used_bytes(),
            used,
            "only the first group was kept, then unmapped"
        );
        // The helper may or may not have made the failing call before it stopped; if it
        // did, the error is recorded, not lost.
        let absorbed = pager
            .take_deferred_errors()
            .iter()
            .filter(|e| e.starts_with(gpu_pager::ABSORBED_MAP_ERROR))
            .count() as u64;
        assert_eq!(absorbed, faulty.injected().map, "pass {pass}");
        if absorbed == 0 {
            // The armed map fault is still pending: the retry meets it.
            assert!(pager.resume(&["weights"]).is_err());
            assert_eq!(faulty.injected().map, 1);
        }
        pager.resume(&["weights"]).unwrap();
        assert_eq!(
            read_all(&pager, &w),
            data,
            "bit-exact after the retry ({pass})"
        );
    }
}

/// `w`: a growing `Preserve` region of 40 buffers of 64–576 KiB (their contents returned);
/// `kv`: a fixed `Discard` region of 2 MiB.
fn many_buffers(pager: &Pager) -> Vec<(Buffer, Vec<u8>)> {
    pager
        .region_with("w", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    pager.region("kv", 2 * MIB, Policy::Discard).unwrap();
    (0..40u64)
        .map(|i| {
            let b = pager
                .alloc("w", (64 << 10) * (1 + i as usize % 9) - 16)
                .unwrap();
            let data = bytes(100 + i, b.len());
            pager.write(&b, 0, &data).unwrap();
            (b, data)
        })
        .collect()
}

#[test]
fn a_copy_fault_after_buffers_were_unmapped_beside_the_copies_maps_and_restores_them() {
    // A release unmaps each buffer once its copies are done and the `Discard` region at
    // once, while later buffers still copy; a copy that fails after that must leave every
    // region resident with its contents: what was unmapped is mapped and restored again.
    for (skip_unchanged, pass) in [(false, 30), (true, 30), (false, 39)] {
        let (host, faulty, pager) = setup(skip_unchanged);
        let mut bufs = many_buffers(&pager);
        if skip_unchanged {
            // A first cycle, then every buffer changed, so that each one copies again.
            pager.release(&["kv", "w"]).unwrap();
            pager.resume(&["kv", "w"]).unwrap();
            for (i, (b, data)) in bufs.iter_mut().enumerate() {
                *data = bytes(200 + i as u64, b.len());
                pager.write(b, 0, data).unwrap();
            }
        }
        let used = host.used_bytes();
        let maps = faulty.calls(FaultPoint::Map);

        faulty.fail_after(FaultPoint::CopyToHost, pass);
        let err = pager.release(&["kv", "w"]).unwrap_err();
        assert!(injected(&err), "{err}");
        assert!(
            faulty.calls(FaultPoint::Map) > maps,
            "buffers were unmapped before the fault, and mapped again"
        );
        assert_eq!(state(&pager, "w"), State::Resident);
        assert_eq!(state(&pager, "kv"), State::Resident);
        assert_eq!(host.used_bytes(), used, "everything is mapped again");
        for (i, (b, data)) in bufs.iter().enumerate() {
            assert_eq!(&read_all(&pager, b), data, "buffer {i} (pass {pass})");
        }
        assert!(pager.take_deferred_errors().is_empty());

        // The retry releases everything; a resume brings back every buffer.
        pager.release(&["kv", "w"]).unwrap();
        assert_eq!(host.used_bytes(), 0);
        pager.resume(&["kv", "w"]).unwrap();
        for (i, (b, data)) in bufs.iter().enumerate() {
            assert_eq!(&read_all(&pager, b), data, "buffer {i} after the retry");
        }
    }
}

#[test]
fn a_release_that_unmaps_beside_its_copies_reports_every_byte_and_frees_it() {
    let (host, _faulty, pager) = setup(true);
    let bufs = many_buffers(&pager);
    let mapped = host.used_bytes();
    let report = pager.release(&["kv", "w"]).unwrap();
    assert_eq!(host.used_bytes(), 0);
    assert_eq!(
        report.regions.iter().map(|r| r.bytes).sum::<usize>(),
        mapped,
        "the report counts what was unmapped beside the copies: {report:?}"
    );
    pager.resume(&["kv", "w"]).unwrap();
    for (b, data) in &bufs {
        assert_eq!(&read_all(&pager, b), data);
    }
}

#[test]
fn when_mapping_back_fails_too_the_region_is_released_with_what_it_saved_and_says_so() {
    // A copy fails after buffers were unmapped beside the copies, and mapping them back
    // fails too (the device lost, or its memory taken meanwhile): the region is released,
    // the failure is recorded, and a resume brings back the buffers whose copies had
    // finished and been unmapped (the first ones).
    let (host, faulty, pager) = setup(false);
    let bufs = many_buffers(&pager);
    faulty.fail_after(FaultPoint::CopyToHost, 30);
    faulty.fail_next(FaultPoint::Map);
    let err = pager.release(&["w"]).unwrap_err();
    assert!(injected(&err), "{err}");
    assert_eq!(faulty.injected().map, 1, "mapping back was tried");
    assert_eq!(state(&pager, "w"), State::Released);
    let recorded = pager.take_deferred_errors();
    assert!(
        recorded
            .iter()
            .any(|e| e.contains("mapping back the memory it had unmapped")),
        "{recorded:?}"
    );
    assert_eq!(host.used_bytes(), 2 * MIB, "only `kv` is mapped");
    pager.resume(&["w"]).unwrap();
    for (i, (b, data)) in bufs.iter().enumerate().take(10) {
        assert_eq!(&read_all(&pager, b), data, "buffer {i}");
    }
}

/// Review item 3: a companion added while its tag's release copies (the release found none,
/// so it unmaps each buffer beside its copies) is not called by that release, which would
/// run it after the memory is gone; it runs from the next move on, and nothing is lost.
#[test]
fn a_companion_added_while_its_tag_releases_runs_from_the_next_move() {
    use gpu_pager::{Companion, CompanionError};
    use gpu_pager_testkit::HoldPoint;
    use std::sync::Mutex;
    use std::time::Duration;

    struct Late(Mutex<Vec<String>>);
    impl Companion for Late {
        fn name(&self) -> &str {
            "late"
        }
        fn before_release(&self, tag: &str) -> Result<(), CompanionError> {
            self.0.lock().unwrap().push(format!("release {tag}"));
            Ok(())
        }
        fn after_resume(&self, tag: &str) -> Result<(), CompanionError> {
            self.0.lock().unwrap().push(format!("resume {tag}"));
            Ok(())
        }
    }

    let (_host, faulty, pager) = setup(false);
    let (w, data) = weights(&pager, 3);
    let late = Arc::new(Late(Mutex::new(Vec::new())));
    let hold = faulty.hold_next(HoldPoint::CopyUnit);
    std::thread::scope(|s| {
        let releasing = s.spawn(|| pager.release(&["weights"]));
        assert!(
            hold.wait_entered(Duration::from_secs(30)),
            "the release's copy never started"
        );
        pager.add_companion("weights", late.clone()).unwrap();
        hold.open();
        releasing.join().unwrap().unwrap();
    });
    assert_eq!(state(&pager, "weights"), State::Released);
    assert!(
        late.0.lock().unwrap().is_empty(),
        "{:?}",
        late.0.lock().unwrap()
    );
    pager.resume(&["weights"]).unwrap();
    assert_eq!(read_all(&pager, &w), data);
    pager.release(&["weights"]).unwrap();
    pager.resume(&["weights"]).unwrap();
    assert_eq!(read_all(&pager, &w), data);
    assert_eq!(
        *late.0.lock().unwrap(),
        ["resume weights", "release weights", "resume weights"]
    );
}

/// Review item 1: a release whose copy fails after it unmapped a buffer, and whose mapping
/// back fails too, leaves the region released. Its resume brings back the buffer it had
/// unmapped (its copies had finished) with this cycle's bytes and every other buffer without
/// contents (a buffer whose copies finished but was still mapped included), never a previous
/// cycle's bytes; the recorded failure says exactly that.
#[test]
fn a_double_failure_restores_what_it_unmapped_and_says_so() {
    let (_host, faulty, pager) = crate::common::faulty_host_pager(
        64 * MIB,
        64 << 10,
        PagerConfig {
            chunk_bytes: MIB,
            tuning: gpu_pager::Tuning {
                copy_unit_bytes: 256 << 10,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    let growing = gpu_pager::RegionOptions {
        kind: gpu_pager::RegionKind::Growing,
        ..Default::default()
    };
    pager
        .region_with("w", 16 * MIB, Policy::Preserve, growing)
        .unwrap();
    let bufs: Vec<Buffer> = (0..4).map(|_| pager.alloc("w", MIB).unwrap()).collect();
    let old: Vec<Vec<u8>> = (0..4).map(|i| bytes(100 + i, MIB)).collect();
    for (b, data) in bufs.iter().zip(&old) {
        pager.write(b, 0, data).unwrap();
    }
    pager.release(&["w"]).unwrap();
    pager.resume(&["w"]).unwrap();
    let new: Vec<Vec<u8>> = (0..4).map(|i| bytes(200 + i, MIB)).collect();
    for (b, data) in bufs.iter().zip(&new) {
        // As an engine's kernels write: at the raw address, the pager unaware.
        let at = pager.ptr(b).unwrap() as usize as *mut u8;
        // SAFETY: on the host backend a resident buffer's address is host memory of its
        // length; nothing else touches it meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len()) };
    }
    // Buffers 0 and 1 (4 copy units each) and one unit of buffer 2 pass, the next copy
    // fails; by then buffer 0 was unmapped, and mapping it back fails too.
    faulty.fail_after(FaultPoint::CopyToHost, 9);
    faulty.fail_next(FaultPoint::Map);
    assert!(injected(&pager.release(&["w"]).unwrap_err()));
    assert_eq!(state(&pager, "w"), State::Released);
    let recorded = faulty.deferred_errors().take().join("\n");
    assert!(
        recorded.contains("restores the buffers it had unmapped after their copies finished"),
        "{recorded}"
    );
    pager.resume(&["w"]).unwrap();
    assert_eq!(read_all(&pager, &bufs[0]), new[0]);
    for (i, b) in bufs.iter().enumerate().skip(1) {
        let back = read_all(&pager, b);
        assert!(
            back != old[i],
            "buffer {i} came back with the previous cycle's bytes"
        );
        assert!(back != new[i], "buffer {i} was not saved, yet came back");
    }
}
