//! The first release of a growing `Preserve` region without `prepin`, on the host backend:
//! with `first_save_overlap` (the default) the missing backups, one per live buffer with
//! something to save, are pinned and filled in one batch
//! (`Backend::alloc_pinned_many_from_device`) and hashed, so that the save after it copies
//! nothing; backups already pinned keep the old path; marked buffers behave as before; a
//! fault in the batch leaves the region resident, intact and releasable. (With the switch
//! off, the old path: `host_first_save.rs`.) Runs in CI.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{Rng, assert_intact, entry, read};
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::backend::{Backend, BackendError, DeviceRange};
use gpu_pager::{Buffer, Error, Pager, PagerConfig, Policy, State};
use gpu_pager_testkit::{FaultPoint, FaultyBackend};

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;
const G: usize = 64 * KIB;
const HASH_CHUNK: usize = 256 * KIB;

fn setup() -> (Arc<HostBackend>, Arc<FaultyBackend>, Pager) {
    let (host, faulty, pager) = common::faulty_host_pager(
        256 * MIB,
        G,
        PagerConfig {
            chunk_bytes: 2 * MIB,
            verify_restore: true,
            tuning: gpu_pager::Tuning {
                hash_chunk_bytes: HASH_CHUNK,
                copy_unit_bytes: 64 * KIB,
                copy_gap_bytes: 0,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    assert!(pager.config().tuning.first_save_overlap, "on by default");
    (host, faulty, pager)
}

/// A buffer of `len` bytes in `tag`, filled with random bytes.
fn filled(pager: &Pager, rng: &mut Rng, tag: &str, len: usize) -> (Buffer, Vec<u8>) {
    let b = pager.alloc(tag, len).unwrap();
    let d = rng.bytes(len);
    pager.write(&b, 0, &d).unwrap();
    (b, d)
}

/// Buffers of odd sizes (1 byte, a granule and one, several chunks and more) in growing
/// region `tag`.
fn buffers(pager: &Pager, rng: &mut Rng, tag: &str) -> Vec<(Buffer, Vec<u8>)> {
    pager
        .region_with(tag, 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    [1, 4097, G + 1, 3 * MIB + 5, 300_001, 5 * MIB - 3, 17]
        .into_iter()
        .map(|len| filled(pager, rng, tag, len))
        .collect()
}

/// Bytes mapped (and saved) under buffers: each rounded up to the granularity.
fn extents<'a>(bufs: impl IntoIterator<Item = &'a (Buffer, Vec<u8>)>) -> usize {
    bufs.into_iter()
        .map(|(b, _)| b.len().next_multiple_of(G))
        .sum()
}

#[test]
fn the_first_release_copies_every_buffer_while_pinning_and_the_save_copies_nothing() {
    let (host, faulty, pager) = setup();
    let mut rng = Rng::seeded("growing_first_release_copies_while_pinning");
    let mut bufs = buffers(&pager, &mut rng, "g");
    pager.region("kv", 2 * MIB, Policy::Discard).unwrap();
    let ptrs: Vec<u64> = bufs.iter().map(|(b, _)| pager.ptr(b).unwrap()).collect();
    let all = extents(&bufs);

    let rel = pager.release(&["g", "kv"]).unwrap();
    let g = entry(&rel, "g");
    assert_eq!(faulty.pin_batches(), 1, "one batch for the growing region");
    assert_eq!(
        g.copied, all,
        "every extent copied once, while pinning: {rel}"
    );
    assert_eq!(rel.copies.total_bytes(), 0, "the pump moved nothing: {rel}");
    assert_eq!(g.steps.copy, Duration::ZERO, "no pumped copy to charge");
    assert!(g.steps.pin > Duration::ZERO);
    assert_eq!(entry(&rel, "kv").copied, 0);
    assert_eq!(host.used_bytes(), 0, "unmapped");
    let s = pager.region_stats("g").unwrap();
    assert_eq!((s.backup_bytes, s.held_bytes), (all, all));

    let res = pager.resume(&["g", "kv"]).unwrap();
    assert_eq!(entry(&res, "g").copied, all);
    for (i, (b, _)) in bufs.iter().enumerate() {
        assert_eq!(
            pager.ptr(b).unwrap(),
            ptrs[i],
            "address of buffer {i} unchanged"
        );
    }
    assert_intact(&pager, &bufs, "after the first cycle");

    // Later releases: unchanged copies nothing and pins nothing; a change copies its chunks.
    let rel = pager.release(&["g"]).unwrap();
    assert_eq!(entry(&rel, "g").copied, 0);
    assert_eq!(entry(&rel, "g").steps.pin, Duration::ZERO);
    assert_eq!(faulty.pin_batches(), 1);
    pager.resume(&["g"]).unwrap();
    let fresh = rng.bytes(1000);
    pager.write(&bufs[3].0, 2 * MIB + 5, &fresh).unwrap();
    bufs[3].1[2 * MIB + 5..2 * MIB + 1005].copy_from_slice(&fresh);
    let rel = pager.release(&["g"]).unwrap();
    let copied = entry(&rel, "g").copied;
    assert!(copied > 0 && copied <= HASH_CHUNK, "{copied}");
    assert_eq!(rel.copies.total_bytes(), copied);
    pager.resume(&["g"]).unwrap();
    assert_intact(&pager, &bufs, "after a changed cycle");

    // Two freed, three new, one old one changed: the new ones are pinned and filled in one
    // batch; the old ones keep their backups and go through the pump (the changed one only).
    for k in [5, 1] {
        let (b, _) = bufs.remove(k);
        pager.free(&b).unwrap();
    }
    // Now buffer 1 is the one of `G + 1` bytes: two granules, one hash chunk.
    let fresh = rng.bytes(bufs[1].0.len());
    pager.write(&bufs[1].0, 0, &fresh).unwrap();
    bufs[1].1 = fresh;
    let new: Vec<_> = [G, 7, 2 * MIB + 1]
        .into_iter()
        .map(|len| filled(&pager, &mut rng, "g", len))
        .collect();
    let new_bytes = extents(&new);
    bufs.extend(new);
    let rel = pager.release(&["g"]).unwrap();
    assert_eq!(faulty.pin_batches(), 2);
    assert_eq!(
        rel.copies.total_bytes(),
        2 * G,
        "the changed old buffer's extent"
    );
    assert_eq!(entry(&rel, "g").copied, new_bytes + 2 * G, "{rel}");
    let s = pager.region_stats("g").unwrap();
    assert_eq!(
        (s.backup_bytes, s.held_bytes),
        (extents(&bufs), extents(&bufs))
    );
    pager.resume(&["g"]).unwrap();
    assert_intact(&pager, &bufs, "after frees and allocs");
    assert_eq!(faulty.injected().total(), 0);
    assert!(pager.take_deferred_errors().is_empty());
}

#[test]
fn marked_buffers_behave_as_before() {
    let (_host, faulty, pager) = setup();
    let mut rng = Rng::seeded("growing_marked_buffers_behave_as_before");
    let mut bufs = buffers(&pager, &mut rng, "g");
    // Buffer 3 marked whole needs no backup; buffer 5, marked in its middle, is pinned in a
    // batch of its own and saved through the pump without its marked bytes (marked bytes
    // are never copied out); the others are pinned and filled in one pass.
    pager.mark_overwritten(&bufs[3].0).unwrap();
    let cut = 1001..2 * MIB + 3;
    pager
        .set_overwritten(&bufs[5].0, cut.clone(), true)
        .unwrap();
    let whole = bufs[3].0.len().next_multiple_of(G);
    let pinned = extents(&bufs) - whole;
    let fifth = bufs[5].0.len().next_multiple_of(G);

    let rel = pager.release(&["g"]).unwrap();
    assert_eq!(
        faulty.pin_batches(),
        2,
        "one pass for the unmarked, a batch for buffer 5"
    );
    assert_eq!(
        rel.copies.total_bytes(),
        fifth - cut.len(),
        "buffer 5's extent through the pump, without its marked bytes"
    );
    assert_eq!(
        entry(&rel, "g").copied,
        pinned - fifth + rel.copies.total_bytes(),
        "the unmarked buffers copied whole while pinning"
    );
    let s = pager.region_stats("g").unwrap();
    assert_eq!(
        s.backup_bytes, pinned,
        "no backup for the buffer marked whole"
    );
    assert_eq!(s.held_bytes, pinned - cut.len());

    let res = pager.resume(&["g"]).unwrap();
    assert_eq!(entry(&res, "g").copied, pinned - cut.len());
    for (i, (b, d)) in bufs.iter().enumerate() {
        if i == 3 {
            continue; // undefined contents
        }
        let got = read(&pager, b);
        for (at, (g, w)) in got.iter().zip(d).enumerate() {
            if !(i == 5 && cut.contains(&at)) {
                assert_eq!(g, w, "buffer {i} byte {at}");
            }
        }
    }
    // The update writes the marked bytes; unmarked, the next cycle saves them (pinning the
    // buffer marked whole then, in a batch of its own).
    let fresh = rng.bytes(bufs[3].0.len());
    pager.write(&bufs[3].0, 0, &fresh).unwrap();
    bufs[3].1 = fresh;
    let fresh = rng.bytes(cut.len());
    pager.write(&bufs[5].0, cut.start, &fresh).unwrap();
    bufs[5].1[cut.clone()].copy_from_slice(&fresh);
    pager.unmark_overwritten(&bufs[3].0).unwrap();
    pager.unmark_overwritten(&bufs[5].0).unwrap();
    let rel = pager.release(&["g"]).unwrap();
    assert_eq!(faulty.pin_batches(), 3);
    let copied = entry(&rel, "g").copied;
    assert!(
        copied >= whole + cut.len(),
        "the once-marked bytes are saved: {copied}"
    );
    let s = pager.region_stats("g").unwrap();
    assert_eq!(
        (s.backup_bytes, s.held_bytes),
        (extents(&bufs), extents(&bufs))
    );
    pager.resume(&["g"]).unwrap();
    assert_intact(&pager, &bufs, "unmarked again");
}

#[test]
fn a_fault_in_the_batch_leaves_the_region_resident_intact_and_releasable() {
    // Every position in the batch (first, middle, last buffer), pinning or copying.
    for (point, pass) in [
        (FaultPoint::AllocPinned, 0),
        (FaultPoint::AllocPinned, 3),
        (FaultPoint::CopyToHost, 0),
        (FaultPoint::CopyToHost, 6),
    ] {
        let what = format!("{point:?} after {pass}");
        let (host, faulty, pager) = setup();
        let mut rng = Rng::seeded("growing_a_fault_in_the_batch");
        let bufs = buffers(&pager, &mut rng, "g");
        pager.region("kv", 2 * MIB, Policy::Discard).unwrap();
        let used = host.used_bytes();
        faulty.fail_after(point, pass);
        let err = pager.release(&["kv", "g"]).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::Backend { tags, error: BackendError::Injected { .. }, .. } if *tags == ["g"]
            ),
            "{what}: {err}"
        );
        assert_eq!(faulty.injected().total(), 1, "{what}");
        assert_eq!(faulty.pin_batches(), 1, "{what}");
        for tag in ["g", "kv"] {
            assert_eq!(pager.info(tag).unwrap().state, State::Resident, "{what}");
        }
        assert_eq!(host.used_bytes(), used, "{what}: nothing was unmapped");
        let s = pager.region_stats("g").unwrap();
        assert_eq!(
            (s.backup_bytes, s.held_bytes),
            (0, 0),
            "{what}: nothing pinned"
        );
        assert_intact(&pager, &bufs, &what);

        // The retry pins and fills in one batch and cycles bit-exact.
        let rel = pager.release(&["kv", "g"]).unwrap();
        assert_eq!(entry(&rel, "g").copied, extents(&bufs), "{what}");
        assert_eq!(rel.copies.total_bytes(), 0, "{what}");
        assert_eq!(host.used_bytes(), 0, "{what}");
        pager.resume(&["g"]).unwrap();
        assert_intact(&pager, &bufs, &what);
        assert!(pager.take_deferred_errors().is_empty(), "{what}");
    }
}

/// The default `alloc_pinned_many_from_device` (the host backend's): one buffer per range,
/// each a copy of its device range; no ranges, no buffers; a size of 0 refused.
#[test]
fn the_default_batch_from_the_device_copies_each_range() {
    let host = Arc::new(HostBackend::new(HostConfig {
        capacity: 16 * MIB,
        granularity: G,
    }));
    let mut rng = Rng::seeded("the_default_batch_from_the_device_copies_each_range");
    let res = host.reserve(4 * MIB).unwrap();
    // SAFETY: a fresh reservation of this backend, nothing mapped in it yet.
    let maps = unsafe { host.map(&res, 0, &[4 * MIB]) }.unwrap();
    let base = res.base();
    let data = rng.bytes(4 * MIB);
    // SAFETY: the span is mapped above and nothing else uses it.
    unsafe { host.copy_to_device(base, &data) }.unwrap();
    let spans = [(0, 1), (1, 4097), (3 * MIB - 5, MIB + 5), (77, 3 * MIB)];
    let ranges: Vec<DeviceRange> = spans
        .iter()
        .map(|&(at, bytes)| DeviceRange {
            src: base + at as u64,
            bytes,
        })
        .collect();
    // SAFETY: every range lies inside the mapping above, which nothing writes meanwhile.
    let bufs = unsafe { host.alloc_pinned_many_from_device(&ranges) }.unwrap();
    assert_eq!(bufs.len(), spans.len());
    for (b, &(at, bytes)) in bufs.iter().zip(&spans) {
        assert_eq!(b.len(), bytes);
        assert!(b.as_slice() == &data[at..at + bytes], "range at {at}");
    }
    // SAFETY: no ranges.
    let none = unsafe { host.alloc_pinned_many_from_device(&[]) };
    assert!(none.unwrap().is_empty());
    let zero = [DeviceRange {
        src: base,
        bytes: 0,
    }];
    // SAFETY: an empty range reads nothing.
    let refused = unsafe { host.alloc_pinned_many_from_device(&zero) };
    assert!(matches!(refused, Err(BackendError::Invalid { .. })));
    drop(bufs);
    drop(maps);
}
