//! Growing regions (created with 0 bytes) on the host backend: memory follows the buffers,
//! release and resume move exactly the buffers, failures roll back.

use crate::common;

use std::sync::Arc;

use common::{Rng, read};
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Buffer, Error, Pager, Policy, RegionOptions, State};
use gpu_pager_testkit::Hog;

const MIB: usize = 1 << 20;
const G: usize = 2 * MIB;

fn setup(capacity: usize) -> (Arc<HostBackend>, Pager) {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity,
        granularity: G,
    }));
    let pager = Pager::with_config(backend.clone(), common::small_chunks());
    (backend, pager)
}

#[test]
fn a_growing_preserve_region_of_300_buffers_cycles_bit_exact() {
    let (backend, pager) = setup(1 << 30);
    let info = pager
        .region_with(
            "weights",
            0,
            Policy::Preserve,
            gpu_pager::RegionOptions::GROWING,
        )
        .unwrap();
    assert!(
        (info.kind == gpu_pager::RegionKind::Growing) && info.size >= 4 << 30,
        "reserves 4x the device: {info:?}"
    );
    assert_eq!(backend.used_bytes(), 0, "nothing mapped before a buffer");
    let mut rng = Rng::seeded("growing_300");
    let mut bufs = Vec::new();
    let mut mapped = 0;
    for i in 0..300 {
        // Odd sizes from a few bytes to ~2.5 MiB, as torch's segments and small tensors.
        let len = 1 + (rng.next_u64() as usize % (5 * MIB / 2)) + i;
        let b = pager.alloc("weights", len).unwrap();
        mapped += len.div_ceil(G) * G;
        let data = rng.bytes(len);
        pager.write(&b, 0, &data).unwrap();
        bufs.push((b, data));
    }
    assert_eq!(
        backend.used_bytes(),
        mapped,
        "mapped = granules under live buffers"
    );
    let s = pager.region_stats("weights").unwrap();
    assert_eq!((s.resident_bytes, s.buffers), (mapped, 300));
    let addrs: Vec<u64> = bufs.iter().map(|(b, _)| pager.ptr(b).unwrap()).collect();

    for cycle in 0..3 {
        let rep = pager.release(&["weights"]).unwrap();
        assert_eq!(
            rep.bytes(),
            mapped,
            "cycle {cycle}: the release unmapped the buffers"
        );
        assert_eq!(
            backend.used_bytes(),
            0,
            "cycle {cycle}: all memory returned"
        );
        assert_eq!(
            pager.stats().backup_bytes(),
            mapped,
            "the backup grew with the buffers"
        );
        assert!(matches!(
            pager.write(&bufs[0].0, 0, &[1]),
            Err(Error::NotResident { .. })
        ));
        let rep = pager.resume(&["weights"]).unwrap();
        assert_eq!(rep.bytes(), mapped);
        assert_eq!(backend.used_bytes(), mapped);
        for (k, (b, data)) in bufs.iter().enumerate() {
            assert_eq!(pager.ptr(b).unwrap(), addrs[k], "address unchanged");
            assert!(
                read(&pager, b) == *data,
                "cycle {cycle}: buffer {k} differs"
            );
        }
        // Update a few, as a weight update would.
        for (b, data) in bufs.iter_mut().step_by(7) {
            rng.fill(data);
            pager.write(b, 0, data).unwrap();
        }
    }
    // Frees give memory back at once; the backup of a freed buffer goes with it.
    let (b, _) = bufs.pop().unwrap();
    let len = b.len().div_ceil(G) * G;
    pager.free(&b).unwrap();
    assert_eq!(backend.used_bytes(), mapped - len);
    pager.release(&["weights"]).unwrap();
    assert_eq!(pager.stats().backup_bytes(), mapped - len);
}

#[test]
fn a_small_tensor_maps_only_its_granules() {
    let (backend, pager) = setup(1 << 30);
    pager
        .region_with("w", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    let b = pager.alloc("w", 10 * MIB + 1).unwrap();
    assert_eq!(backend.used_bytes(), 12 * MIB, "not a whole 512 MiB chunk");
    pager.free(&b).unwrap();
    assert_eq!(backend.used_bytes(), 0);
}

#[test]
fn prepin_pins_each_buffers_backup_as_it_is_allocated() {
    let (_backend, pager) = setup(1 << 30);
    let prepin = RegionOptions {
        prepin: true,
        ..RegionOptions::GROWING
    };
    pager.region_with("w", 0, Policy::Preserve, prepin).unwrap();
    assert_eq!(pager.stats().backup_bytes(), 0);
    let a = pager.alloc("w", 3 * MIB).unwrap();
    assert_eq!(pager.stats().backup_bytes(), 4 * MIB);
    pager.alloc("w", MIB).unwrap();
    assert_eq!(pager.stats().backup_bytes(), 6 * MIB);
    let rep = pager.release(&["w"]).unwrap();
    assert_eq!(
        rep.region("w").unwrap().steps.pin,
        std::time::Duration::ZERO
    );
    pager.resume(&["w"]).unwrap();
    pager.free(&a).unwrap();
    assert_eq!(pager.stats().backup_bytes(), 2 * MIB);
}

#[test]
fn out_of_memory_on_alloc_and_on_resume_rolls_back() {
    let (backend, pager) = setup(64 * MIB);
    pager
        .region_with("w", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    pager
        .region_with("kv", 0, Policy::Discard, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    let w = pager.alloc("w", 20 * MIB).unwrap();
    pager.write(&w, 0, &vec![5u8; 20 * MIB]).unwrap();
    let kv = pager.alloc("kv", 30 * MIB).unwrap();
    // Only 14 MiB left: an alloc of 16 MiB fails and maps nothing.
    let e = pager.alloc("kv", 16 * MIB).unwrap_err();
    assert!(
        matches!(
            e,
            Error::OutOfMemory {
                during: "alloc",
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(backend.used_bytes(), 50 * MIB);
    assert_eq!(
        pager.region_stats("kv").unwrap().buffers,
        1,
        "no buffer left behind"
    );

    pager.release(&["w", "kv"]).unwrap();
    assert_eq!(backend.used_bytes(), 0);
    let trainer = Hog::take(backend.as_ref(), 40 * MIB).unwrap();
    let e = pager.resume(&["kv", "w"]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::OutOfMemory {
                during: "resume",
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        backend.used_bytes(),
        40 * MIB,
        "the failed resume mapped nothing"
    );
    assert_eq!(pager.info("w").unwrap().state, State::Released);
    pager.resume(&["w"]).unwrap(); // stage 1 fits
    drop(trainer);
    pager.resume(&["kv"]).unwrap();
    assert_eq!(read(&pager, &w), vec![5u8; 20 * MIB], "nothing was lost");
    assert!(pager.ptr(&kv).is_ok());
}

#[test]
fn buffers_allocated_while_released_are_mapped_on_resume() {
    let (backend, pager) = setup(64 * MIB);
    pager
        .region_with(
            "g",
            0,
            Policy::DiscardZeroed,
            gpu_pager::RegionOptions::GROWING,
        )
        .unwrap();
    pager.release(&["g"]).unwrap();
    let b = pager.alloc("g", 3 * MIB).unwrap();
    assert_eq!(backend.used_bytes(), 0);
    assert!(matches!(pager.ptr(&b), Err(Error::NotResident { .. })));
    pager.resume(&["g"]).unwrap();
    assert_eq!(backend.used_bytes(), 4 * MIB);
    assert_eq!(
        read(&pager, &b),
        vec![0u8; 3 * MIB],
        "DiscardZeroed comes back zeroed"
    );
}

#[test]
fn growing_regions_refuse_what_does_not_apply_and_report_conflicts() {
    let (_backend, pager) = setup(64 * MIB);
    let info = pager
        .region_with("w", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    assert_eq!(
        pager
            .region_with("w", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
            .unwrap(),
        info,
        "asked again: the same"
    );
    let e = pager.region("w", 8 * MIB, Policy::Preserve).unwrap_err();
    assert!(
        matches!(&e, Error::TagConflict { differs, .. } if differs.contains("growing")),
        "{e:?}"
    );
    let e = pager.back("w", 0..MIB).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let s = pager.stats().to_string();
    assert!(s.contains("w"), "{s}");
}

/// A growing region's resume maps buffers that lie back to back in groups of doubling size
/// (one `map` call, so one access change, per group, not per buffer), and a freed buffer's
/// hole splits the groups; every buffer comes back bit-exact at its address with its own
/// mapping (freeing one afterwards gives back exactly its granules).
#[test]
fn a_growing_region_resumes_back_to_back_buffers_in_few_map_calls() {
    // Overlapped (groups mapped ahead), then mapped whole with one call.
    for (overlap, most) in [(true, 12), (false, 1)] {
        back_to_back(overlap, most);
    }
}

fn back_to_back(overlap: bool, most: u64) {
    use gpu_pager_testkit::FaultPoint;
    let config = gpu_pager::PagerConfig {
        tuning: gpu_pager::Tuning {
            overlap_restore: overlap,
            ..common::small_chunks().tuning
        },
        ..common::small_chunks()
    };
    let (host, faulty, pager) = common::faulty_host_pager(1 << 30, G, config);
    pager
        .region_with("w", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    let mut rng = Rng::seeded("back_to_back");
    let mut bufs = Vec::new();
    for i in 0..200 {
        let len = 1 + (rng.next_u64() as usize % (3 * MIB)) + i;
        let b = pager.alloc("w", len).unwrap();
        let data = rng.bytes(len);
        pager.write(&b, 0, &data).unwrap();
        bufs.push((b, data));
    }
    let addrs: Vec<u64> = bufs.iter().map(|(b, _)| pager.ptr(b).unwrap()).collect();
    let back_to_back = bufs.windows(2).all(|w| {
        let end = pager.ptr(&w[0].0).unwrap() + (w[0].0.len().div_ceil(G) * G) as u64;
        end == pager.ptr(&w[1].0).unwrap()
    });
    assert!(back_to_back, "the buffers lie back to back");
    let check = |bufs: &[(Buffer, Vec<u8>)], when: &str| {
        for (k, (b, data)) in bufs.iter().enumerate() {
            assert_eq!(pager.ptr(b).unwrap(), addrs[k], "{when}: buffer {k} moved");
            assert!(read(&pager, b) == *data, "{when}: buffer {k} differs");
        }
    };
    pager.release(&["w"]).unwrap();
    let before = faulty.calls(FaultPoint::Map);
    pager.resume(&["w"]).unwrap();
    let calls = faulty.calls(FaultPoint::Map) - before;
    assert!(
        (1..=most).contains(&calls),
        "overlap {overlap}: 200 buffers in {calls} map calls"
    );
    check(&bufs, "after the resume");
    if overlap {
        return;
    }
    // A hole in the middle: two runs.
    let (hole, _) = bufs.remove(100);
    let used = host.used_bytes();
    let hole_bytes = hole.len().div_ceil(G) * G;
    pager.free(&hole).unwrap();
    assert_eq!(
        host.used_bytes(),
        used - hole_bytes,
        "the free gave back its granules"
    );
    let mut addrs = addrs;
    addrs.remove(100);
    pager.release(&["w"]).unwrap();
    let before = faulty.calls(FaultPoint::Map);
    pager.resume(&["w"]).unwrap();
    assert_eq!(
        faulty.calls(FaultPoint::Map) - before,
        2,
        "one call per run"
    );
    for (k, (b, data)) in bufs.iter().enumerate() {
        assert_eq!(pager.ptr(b).unwrap(), addrs[k], "buffer {k} moved");
        assert!(read(&pager, b) == *data, "buffer {k} differs");
    }
    // Each buffer kept its own mapping: freeing one gives back exactly its granules.
    let (b, _) = bufs.remove(7);
    let used = host.used_bytes();
    let bytes = b.len().div_ceil(G) * G;
    pager.free(&b).unwrap();
    assert_eq!(host.used_bytes(), used - bytes);
}

/// The `prepin` setting pins a preserve region's backup ahead (a growing region's as each
/// buffer is allocated, a fixed one's at creation), so the first release pins nothing;
/// regions that cannot take the option (discard, a host-medium backup) are created as
/// without it. Off, the first release pins.
#[test]
fn the_prepin_setting_pins_backups_ahead_where_a_region_can_take_it() {
    for on in [true, false] {
        let backend = Arc::new(HostBackend::new(HostConfig {
            capacity: 1 << 30,
            granularity: G,
        }));
        let config = gpu_pager::PagerConfig {
            prepin: on,
            ..common::small_chunks()
        };
        let pager = Pager::with_config(backend, config);
        pager
            .region_with("w", 0, Policy::Preserve, RegionOptions::GROWING)
            .unwrap();
        pager.region("fixed", 4 * MIB, Policy::Preserve).unwrap();
        pager
            .region_with("kv", 0, Policy::Discard, RegionOptions::GROWING)
            .unwrap();
        let host_medium = RegionOptions {
            medium: gpu_pager::Medium::Host,
            ..RegionOptions::GROWING
        };
        pager
            .region_with("h", 0, Policy::Preserve, host_medium)
            .unwrap();
        let b = pager.alloc("w", 3 * MIB + 5).unwrap();
        let data = Rng::seeded("prepin_setting").bytes(3 * MIB + 5);
        pager.write(&b, 0, &data).unwrap();
        let ahead = |tag: &str| pager.region_stats(tag).unwrap().backup_bytes;
        if on {
            assert!(
                ahead("w") >= 3 * MIB + 5,
                "the buffer's backup pinned at its allocation"
            );
            assert!(
                ahead("fixed") >= 4 * MIB,
                "the fixed region's backup pinned at creation"
            );
        } else {
            assert_eq!(
                (ahead("w"), ahead("fixed")),
                (0, 0),
                "nothing pinned before a release"
            );
        }
        let report = pager.release(&["w", "fixed"]).unwrap();
        // (The fixed region, never written, has nothing to save either way.)
        let w = &report.regions[1];
        assert_eq!(w.tag, "w");
        assert_eq!(w.steps.pin.is_zero(), on, "{:?}", w.steps);
        pager.resume(&["w", "fixed"]).unwrap();
        assert_eq!(read(&pager, &b), data);
    }
}
