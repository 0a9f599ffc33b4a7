//! The first release of a fixed `Preserve` region without `prepin`, on the host backend:
//! with `first_save_overlap` (the default) the backup is pinned and filled in one pass
//! (`Backend::alloc_pinned_from_device`) and hashed, so that the save after it copies
//! nothing; a region with marked bytes is pinned, then saved without them; a fault while pinning or
//! copying leaves the region resident and intact; with the switch off (or `skip_unchanged`
//! off) the first save goes through the pump as before, for a growing region too (whose
//! one-pass first release is tested in `host_first_save_growing.rs`). Runs in CI.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{Rng, assert_intact, entry, read};
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::backend::{Backend, BackendError};
use gpu_pager::{Buffer, Error, Pager, PagerConfig, Policy, State};
use gpu_pager_testkit::{FaultPlan, FaultPoint, FaultyBackend};

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;
const SIZE: usize = 8 * MIB;

fn host() -> Arc<HostBackend> {
    Arc::new(HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: 64 * KIB,
    }))
}

/// A pager with small hash chunks and units, `copy_gap_bytes` 0 (exactly the unmarked bytes
/// are saved) and `verify_restore` on (every resume checks what it restored).
fn pager(backend: Arc<dyn Backend>, skip_unchanged: bool) -> Pager {
    pager_with(backend, skip_unchanged, true)
}

/// [`pager`] with `first_save_overlap` as given.
fn pager_with(backend: Arc<dyn Backend>, skip_unchanged: bool, first_save_overlap: bool) -> Pager {
    Pager::with_config(
        backend,
        PagerConfig {
            chunk_bytes: 2 * MIB,
            verify_restore: true,
            skip_unchanged,
            tuning: gpu_pager::Tuning {
                hash_chunk_bytes: 256 * KIB,
                copy_unit_bytes: 64 * KIB,
                copy_gap_bytes: 0,
                first_save_overlap,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    )
}

/// `weights` (fixed, `SIZE` bytes, Preserve) with five buffers of odd sizes and random
/// contents, and a Discard `kv`.
fn weights(pager: &Pager, rng: &mut Rng) -> Vec<(Buffer, Vec<u8>)> {
    pager.region("weights", SIZE, Policy::Preserve).unwrap();
    pager.region("kv", 2 * MIB, Policy::Discard).unwrap();
    (0..5)
        .map(|i| {
            let b = pager.alloc("weights", 300_001 + i * 555_555).unwrap();
            let d = rng.bytes(b.len());
            pager.write(&b, 0, &d).unwrap();
            (b, d)
        })
        .collect()
}

fn live_bytes(bufs: &[(Buffer, Vec<u8>)]) -> usize {
    bufs.iter().map(|(b, _)| b.len()).sum()
}

#[test]
fn first_release_copies_while_pinning_and_the_save_copies_nothing() {
    let backend = host();
    let pager = pager(backend.clone(), true);
    assert!(pager.config().tuning.first_save_overlap, "on by default");
    let mut rng = Rng::seeded("first_release_copies_while_pinning");
    let bufs = weights(&pager, &mut rng);
    let ptrs: Vec<u64> = bufs.iter().map(|(b, _)| pager.ptr(b).unwrap()).collect();

    let rel = pager.release(&["weights", "kv"]).unwrap();
    let w = entry(&rel, "weights");
    // The whole region was copied while pinning; the pump moved nothing.
    assert_eq!(w.copied, SIZE, "{rel}");
    assert_eq!(rel.copies.total_bytes(), 0, "{rel}");
    assert_eq!(w.steps.copy, Duration::ZERO, "no pumped copy to charge");
    assert!(w.steps.pin > Duration::ZERO);
    assert_eq!(entry(&rel, "kv").copied, 0);
    assert_eq!(backend.used_bytes(), 0, "unmapped");
    let s = pager.region_stats("weights").unwrap();
    assert_eq!(s.backup_bytes, SIZE);
    assert_eq!(
        s.held_bytes,
        live_bytes(&bufs),
        "the save left the live bytes"
    );

    let res = pager.resume(&["weights", "kv"]).unwrap();
    assert_eq!(entry(&res, "weights").copied, live_bytes(&bufs));
    for (i, (b, _)) in bufs.iter().enumerate() {
        assert_eq!(pager.ptr(b).unwrap(), ptrs[i], "address unchanged");
    }
    assert_intact(&pager, &bufs, "after the first cycle");

    // Later releases: unchanged copies nothing; one changed buffer copies its chunks only.
    let rel = pager.release(&["weights"]).unwrap();
    assert_eq!(entry(&rel, "weights").copied, 0);
    assert_eq!(entry(&rel, "weights").steps.pin, Duration::ZERO);
    pager.resume(&["weights"]).unwrap();
    let mut bufs = bufs;
    let fresh = rng.bytes(1000);
    pager.write(&bufs[2].0, 5000, &fresh).unwrap();
    bufs[2].1[5000..6000].copy_from_slice(&fresh);
    let rel = pager.release(&["weights"]).unwrap();
    let copied = entry(&rel, "weights").copied;
    assert!(copied > 0 && copied <= 2 * 256 * KIB, "{copied}");
    assert_eq!(rel.copies.total_bytes(), copied);
    pager.resume(&["weights"]).unwrap();
    assert_intact(&pager, &bufs, "after a changed cycle");
    assert!(pager.take_deferred_errors().is_empty());
}

/// Marked bytes are never copied out, not even by the first release: a region with marks is
/// pinned, then saved through the pump (the one-pass first backup would copy them).
#[test]
fn a_first_release_with_marks_pins_then_saves_the_unmarked_bytes_only() {
    let pager = pager(host(), true);
    let mut rng = Rng::seeded("a_first_release_with_marks");
    let mut bufs = weights(&pager, &mut rng);
    pager.mark_overwritten(&bufs[1].0).unwrap();
    pager
        .set_overwritten(&bufs[3].0, 1001..200_003, true)
        .unwrap();
    let marked = bufs[1].0.len() + (200_003 - 1001);
    assert_eq!(pager.region_stats("weights").unwrap().marked_bytes, marked);

    let rel = pager.release(&["weights"]).unwrap();
    let held = live_bytes(&bufs) - marked;
    let copied = entry(&rel, "weights").copied;
    assert_eq!(rel.copies.total_bytes(), copied, "all through the pump");
    assert!(
        copied >= held && copied < SIZE - bufs[1].0.len(),
        "{copied}: the unmarked bytes (and short gaps), not the marked buffer"
    );
    assert_eq!(pager.region_stats("weights").unwrap().held_bytes, held);

    // The resume restores the unmarked bytes only, and verifies them.
    let res = pager.resume(&["weights"]).unwrap();
    assert_eq!(entry(&res, "weights").copied, held);
    for (i, (b, d)) in bufs.iter().enumerate() {
        let got = read(&pager, b);
        for (at, (g, w)) in got.iter().zip(d).enumerate() {
            let is_marked = i == 1 || (i == 3 && (1001..200_003).contains(&at));
            if !is_marked {
                assert_eq!(g, w, "buffer {i} byte {at}");
            }
        }
    }
    // The update writes the marked bytes; unmarked, the next cycle saves them.
    let fresh = rng.bytes(bufs[1].0.len());
    pager.write(&bufs[1].0, 0, &fresh).unwrap();
    bufs[1].1 = fresh;
    let fresh = rng.bytes(200_003 - 1001);
    pager.write(&bufs[3].0, 1001, &fresh).unwrap();
    bufs[3].1[1001..200_003].copy_from_slice(&fresh);
    pager.unmark_overwritten(&bufs[1].0).unwrap();
    pager.unmark_overwritten(&bufs[3].0).unwrap();
    let rel = pager.release(&["weights"]).unwrap();
    let copied = entry(&rel, "weights").copied;
    assert!(
        copied >= marked,
        "the once-marked bytes are saved: {copied}"
    );
    assert_eq!(
        pager.region_stats("weights").unwrap().held_bytes,
        live_bytes(&bufs)
    );
    pager.resume(&["weights"]).unwrap();
    assert_intact(&pager, &bufs, "unmarked again");
}

#[test]
fn a_fault_while_pinning_or_copying_leaves_the_region_resident_and_intact() {
    for point in [FaultPoint::AllocPinned, FaultPoint::CopyToHost] {
        let host = host();
        let faulty = Arc::new(FaultyBackend::new(host.clone(), FaultPlan::none()));
        let pager = pager(faulty.clone(), true);
        let mut rng = Rng::seeded("a_fault_while_pinning_or_copying");
        let bufs = weights(&pager, &mut rng);
        let used = host.used_bytes();
        faulty.fail_next(point);
        let err = pager.release(&["kv", "weights"]).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::Backend { tags, error: BackendError::Injected { .. }, .. } if *tags == ["weights"]
            ),
            "{point:?}: {err}"
        );
        for tag in ["weights", "kv"] {
            assert_eq!(pager.info(tag).unwrap().state, State::Resident, "{point:?}");
        }
        assert_eq!(host.used_bytes(), used, "{point:?}: nothing was unmapped");
        let s = pager.region_stats("weights").unwrap();
        assert_eq!(
            (s.backup_bytes, s.held_bytes),
            (0, 0),
            "{point:?}: nothing pinned"
        );
        assert_intact(&pager, &bufs, "after the fault");
        assert_eq!(faulty.injected().total(), 1);

        // The retry pins in one pass and restores bit-exact.
        let rel = pager.release(&["kv", "weights"]).unwrap();
        assert_eq!(entry(&rel, "weights").copied, SIZE, "{point:?}");
        assert_eq!(host.used_bytes(), 0);
        pager.resume(&["weights"]).unwrap();
        assert_intact(&pager, &bufs, "after the retry");
    }
}

#[test]
fn with_the_switch_off_the_first_save_goes_through_the_pump() {
    // The switch off (fixed and growing), and `skip_unchanged` off: the old path.
    for case in ["switch off", "skip_unchanged off", "growing"] {
        let skip = case != "skip_unchanged off";
        let pager = pager_with(host(), skip, !skip);
        assert_eq!(pager.config().tuning.first_save_overlap, !skip);
        let mut rng = Rng::seeded("with_the_switch_off");
        let tag = "weights";
        let bufs = if case == "growing" {
            pager
                .region_with(tag, 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
                .unwrap();
            (0..3)
                .map(|i| {
                    let b = pager.alloc(tag, 100_003 + i * 333_333).unwrap();
                    let d = rng.bytes(b.len());
                    pager.write(&b, 0, &d).unwrap();
                    (b, d)
                })
                .collect()
        } else {
            weights(&pager, &mut rng)
        };
        // A growing region saves each buffer's extent (rounded up to the granularity).
        let saved: usize = if case == "growing" {
            bufs.iter()
                .map(|(b, _)| b.len().next_multiple_of(64 * KIB))
                .sum()
        } else {
            live_bytes(&bufs)
        };
        let rel = pager.release(&[tag]).unwrap();
        let w = entry(&rel, tag);
        assert_eq!(w.copied, saved, "{case}: the live bytes only");
        assert_eq!(
            rel.copies.total_bytes(),
            w.copied,
            "{case}: all by the pump"
        );
        let res = pager.resume(&[tag]).unwrap();
        assert_eq!(entry(&res, tag).copied, saved, "{case}");
        assert_intact(&pager, &bufs, case);
        // The backup exists now: the next release copies only what changed (nothing).
        let rel = pager.release(&[tag]).unwrap();
        let expect = if case == "skip_unchanged off" {
            saved
        } else {
            0
        };
        assert_eq!(entry(&rel, tag).copied, expect, "{case}: second release");
        pager.resume(&[tag]).unwrap();
        assert_intact(&pager, &bufs, case);
    }
}
