//! Pinning the backups of a growing region in one batch (`Backend::alloc_pinned_many`) on the
//! host backend: one call per first release, all or nothing under an injected pinning
//! fault, contents bit-exact across cycles, buffers added and freed between them.

use crate::common;

use std::sync::Arc;

use common::{Rng, read};
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::backend::{Backend, BackendError};
use gpu_pager::{Buffer, Error, Pager, Policy, State};
use gpu_pager_testkit::{FaultPlan, FaultPoint, FaultyBackend};

const MIB: usize = 1 << 20;
const G: usize = 2 * MIB;

fn setup() -> (Arc<FaultyBackend>, Pager) {
    let (_, faulty, pager) = common::faulty_host_pager(1 << 30, G, common::small_chunks());
    (faulty, pager)
}

fn backup_bytes(pager: &Pager, tag: &str) -> usize {
    pager.region_stats(tag).unwrap().backup_bytes
}

fn check_all(pager: &Pager, bufs: &[(Buffer, Vec<u8>)], when: &str) {
    for (k, (b, data)) in bufs.iter().enumerate() {
        assert!(read(pager, b) == *data, "{when}: buffer {k} differs");
    }
}

/// Mapped (and backed-up) bytes of buffers of `lens`.
fn extents(lens: impl IntoIterator<Item = usize>) -> usize {
    lens.into_iter().map(|n| n.next_multiple_of(G)).sum()
}

#[test]
fn a_growing_regions_first_release_pins_its_backups_in_one_batch() {
    let (faulty, pager) = setup();
    let mut rng = Rng::seeded("a_growing_regions_first_release_pins_its_backups_in_one_batch");
    pager
        .region_with("g", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    pager.region("fixed", 6 * MIB, Policy::Preserve).unwrap();
    let f = pager.alloc("fixed", 5 * MIB + 3).unwrap();
    let f_data = rng.bytes(f.len());
    pager.write(&f, 0, &f_data).unwrap();
    let mut bufs = Vec::new();
    for i in 0..23 {
        let len = 1 + rng.next_u64() as usize % (5 * MIB) + i;
        let b = pager.alloc("g", len).unwrap();
        let data = rng.bytes(len);
        pager.write(&b, 0, &data).unwrap();
        bufs.push((b, data));
    }
    // A buffer marked overwritten whole needs no backup, and is not in the batch.
    let marked = pager.alloc("g", 3 * MIB).unwrap();
    pager
        .set_overwritten(&marked, 0..marked.len(), true)
        .unwrap();

    let rep = pager.release(&["g", "fixed"]).unwrap();
    assert_eq!(faulty.pin_batches(), 1, "one batch for the growing region");
    assert_eq!(backup_bytes(&pager, "fixed"), 6 * MIB);
    let want = extents(bufs.iter().map(|(b, _)| b.len()));
    assert_eq!(backup_bytes(&pager, "g"), want, "one backup per buffer");
    let pin = rep.region("g").unwrap().steps.pin;
    assert!(
        pin > std::time::Duration::ZERO,
        "the report carries the pinning"
    );
    pager.resume(&["g", "fixed"]).unwrap();
    check_all(&pager, &bufs, "first cycle");
    assert_eq!(read(&pager, &f), f_data);

    // Pinned backups are kept: the next release pins nothing.
    let rep = pager.release(&["g"]).unwrap();
    assert_eq!(faulty.pin_batches(), 1);
    assert_eq!(
        rep.region("g").unwrap().steps.pin,
        std::time::Duration::ZERO
    );
    pager.resume(&["g"]).unwrap();
    check_all(&pager, &bufs, "second cycle");

    // Two freed, three new: the next release pins the three new ones, in one batch.
    for _ in 0..2 {
        let (b, _) = bufs.swap_remove(rng.next_u64() as usize % bufs.len());
        pager.free(&b).unwrap();
    }
    for len in [G + 1, 7, 3 * MIB] {
        let b = pager.alloc("g", len).unwrap();
        let data = rng.bytes(len);
        pager.write(&b, 0, &data).unwrap();
        bufs.push((b, data));
    }
    pager.release(&["g"]).unwrap();
    assert_eq!(faulty.pin_batches(), 2);
    assert_eq!(
        backup_bytes(&pager, "g"),
        extents(bufs.iter().map(|(b, _)| b.len()))
    );
    pager.resume(&["g"]).unwrap();
    check_all(&pager, &bufs, "after frees and allocs");
    assert_eq!(faulty.injected().total(), 0);
}

#[test]
fn an_injected_pinning_fault_pins_none_of_the_batch() {
    let (faulty, pager) = setup();
    let mut rng = Rng::seeded("an_injected_pinning_fault_pins_none_of_the_batch");
    pager
        .region_with("g", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    let mut bufs = Vec::new();
    for i in 0..9 {
        let len = 1 + rng.next_u64() as usize % (3 * MIB) + i;
        let b = pager.alloc("g", len).unwrap();
        let data = rng.bytes(len);
        pager.write(&b, 0, &data).unwrap();
        bufs.push((b, data));
    }
    // Every position in the batch: the first buffer, one in the middle, the last.
    for (attempt, pass) in [0, 4, 8].into_iter().enumerate() {
        faulty.fail_after(FaultPoint::AllocPinned, pass);
        let e = pager.release(&["g"]).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::Backend {
                    error: BackendError::Injected { .. },
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(faulty.injected().alloc_pinned, attempt as u64 + 1);
        assert_eq!(faulty.pin_batches(), attempt as u64 + 1);
        assert_eq!(pager.info("g").unwrap().state, State::Resident);
        assert_eq!(
            backup_bytes(&pager, "g"),
            0,
            "nothing of the batch stays pinned"
        );
        check_all(&pager, &bufs, "after the failed release");
    }
    // The fault is spent: the same release now succeeds and cycles bit-exact.
    pager.release(&["g"]).unwrap();
    assert_eq!(faulty.pin_batches(), 4);
    assert_eq!(
        backup_bytes(&pager, "g"),
        extents(bufs.iter().map(|(b, _)| b.len()))
    );
    pager.resume(&["g"]).unwrap();
    check_all(&pager, &bufs, "after the retry");
}

/// The default `alloc_pinned_many` (the host backend's): one buffer per size, zeroed,
/// disjoint and independent; a bad size fails the whole batch.
#[test]
fn the_default_batch_gives_one_zeroed_buffer_per_size() {
    let host = HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: G,
    });
    assert!(host.alloc_pinned_many(&[]).unwrap().is_empty());
    let sizes = [1, 4097, 3, MIB + 5];
    let mut bufs = host.alloc_pinned_many(&sizes).unwrap();
    assert_eq!(bufs.iter().map(|b| b.len()).collect::<Vec<_>>(), sizes);
    for (k, b) in bufs.iter_mut().enumerate() {
        assert!(
            b.as_slice().iter().all(|&x| x == 0),
            "buffer {k} not zeroed"
        );
        b.as_mut_slice().fill(k as u8 + 1);
    }
    // Dropping one leaves the others whole.
    bufs.remove(1);
    for (b, k) in bufs.iter().zip([1u8, 3, 4]) {
        assert!(b.as_slice().iter().all(|&x| x == k));
    }
    assert!(matches!(
        host.alloc_pinned_many(&[5, 0, 7]),
        Err(BackendError::Invalid { .. })
    ));

    // Through the fault injector: one decision per buffer, the batch fails whole.
    let faulty = FaultyBackend::new(Arc::new(host), FaultPlan::none());
    faulty.fail_after(FaultPoint::AllocPinned, 2);
    assert!(matches!(
        faulty.alloc_pinned_many(&[1, 2, 3, 4]),
        Err(BackendError::Injected { .. })
    ));
    assert_eq!(faulty.injected().alloc_pinned, 1);
    assert_eq!(faulty.alloc_pinned_many(&[1, 2, 3, 4]).unwrap().len(), 4);
    assert_eq!(faulty.pin_batches(), 2);
}
