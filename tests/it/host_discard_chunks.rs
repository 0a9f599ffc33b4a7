//! `Tuning::discard_chunk_bytes`: fixed `Discard` and `DiscardZeroed` regions map in
//! their own chunk size, everything else keeps `chunk_bytes`, and `RegionOptions::chunk_bytes`
//! overrides both. Handles are counted exactly: every mapping dropped on release consumes one
//! armed unmap fault of the fault-injecting backend.

use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{DEFAULT_CHUNK_BYTES, Pager, PagerConfig, Policy, RegionOptions};
use gpu_pager_testkit::{FaultPlan, FaultyBackend};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn setup(discard_chunk_bytes: usize) -> (Arc<HostBackend>, Arc<FaultyBackend>, Pager) {
    let host = Arc::new(HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: 64 * KIB,
    }));
    let faulty = Arc::new(FaultyBackend::new(host.clone(), FaultPlan::none()));
    let pager = Pager::with_config(
        faulty.clone(),
        PagerConfig {
            chunk_bytes: MIB,
            tuning: gpu_pager::Tuning {
                discard_chunk_bytes,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    (host, faulty, pager)
}

/// Releases `tag` and returns how many physical handles it unmapped.
fn handles_released(pager: &Pager, faulty: &FaultyBackend, tag: &str) -> u64 {
    let before = faulty.injected_unmaps();
    for _ in 0..1000 {
        faulty.fail_next_unmap();
    }
    pager.release(&[tag]).expect("release");
    let n = faulty.injected_unmaps() - before;
    // The faults left armed keep counting later drops (only differences are read); the
    // recorded messages are dropped.
    pager.take_deferred_errors();
    n
}

#[test]
fn defaults_are_powers_of_two_and_discard_is_the_larger() {
    let c = PagerConfig::default();
    assert_eq!(c.chunk_bytes, DEFAULT_CHUNK_BYTES);
    assert!(c.chunk_bytes.is_power_of_two() && c.tuning.discard_chunk_bytes.is_power_of_two());
    assert!(c.tuning.discard_chunk_bytes >= c.chunk_bytes);
}

#[test]
fn the_setting_is_rounded_like_chunk_bytes() {
    let (_, _, pager) = setup(3 * MIB);
    assert_eq!(pager.config().tuning.discard_chunk_bytes, 4 * MIB);
    let (_, _, pager) = setup(1);
    assert_eq!(pager.config().tuning.discard_chunk_bytes, 64 * KIB);
}

#[test]
fn discard_regions_map_in_discard_chunks_everything_else_in_chunk_bytes() {
    let (host, faulty, pager) = setup(4 * MIB);
    let size = 10 * MIB + 64 * KIB; // 2 whole chunks and a short one
    let cases: [(&str, Policy, RegionOptions, usize, u64); 6] = [
        ("kv", Policy::Discard, RegionOptions::default(), 4 * MIB, 3),
        (
            "kvz",
            Policy::DiscardZeroed,
            RegionOptions::default(),
            4 * MIB,
            3,
        ),
        ("w", Policy::Preserve, RegionOptions::default(), MIB, 11),
        (
            "kv_2m",
            Policy::Discard,
            RegionOptions {
                chunk_bytes: Some(2 * MIB),
                ..Default::default()
            },
            2 * MIB,
            6,
        ),
        (
            "w_2m",
            Policy::Preserve,
            RegionOptions {
                chunk_bytes: Some(2 * MIB),
                ..Default::default()
            },
            2 * MIB,
            6,
        ),
        (
            "kv_elastic",
            Policy::Discard,
            RegionOptions {
                kind: gpu_pager::RegionKind::Elastic,
                ..Default::default()
            },
            MIB,
            0,
        ),
    ];
    for (tag, policy, options, chunk, handles) in cases {
        let info = pager.region_with(tag, size, policy, options).expect(tag);
        assert_eq!(info.chunk_bytes, chunk, "{tag}");
        assert_eq!(handles_released(&pager, &faulty, tag), handles, "{tag}");
        assert_eq!(host.used_bytes(), 0, "{tag}: everything given back");
        pager.remove(tag).expect("remove");
    }
    // An elastic Discard region backs and trims in `chunk_bytes`, not in discard chunks.
    pager
        .region_with(
            "kv_elastic",
            size,
            Policy::Discard,
            RegionOptions {
                kind: gpu_pager::RegionKind::Elastic,
                ..Default::default()
            },
        )
        .expect("elastic");
    pager.back("kv_elastic", 0..1).expect("back");
    assert_eq!(host.used_bytes(), MIB);
    // A growing Discard region (torch's KV segments) maps each buffer in pieces of at most
    // the discard chunk: a 3 MiB buffer is one 4 MiB-chunk piece, not three 1 MiB ones.
    let grow = pager
        .region_with(
            "kv_grow",
            0,
            Policy::Discard,
            gpu_pager::RegionOptions::GROWING,
        )
        .expect("growing");
    assert_eq!(grow.chunk_bytes, 4 * MIB);
    pager.alloc("kv_grow", 3 * MIB).expect("alloc");
    assert_eq!(handles_released(&pager, &faulty, "kv_grow"), 1);
    // A growing Preserve region keeps `chunk_bytes` (its restore overlaps piece by piece).
    let grow_w = pager
        .region_with(
            "w_grow",
            0,
            Policy::Preserve,
            gpu_pager::RegionOptions::GROWING,
        )
        .expect("growing preserve");
    assert_eq!(grow_w.chunk_bytes, MIB);
}

#[test]
fn one_handle_per_region_when_the_setting_is_unbounded() {
    let (host, faulty, pager) = setup(usize::MAX);
    let size = 10 * MIB + 64 * KIB;
    let info = pager.region("kv", size, Policy::DiscardZeroed).expect("kv");
    assert_eq!(info.chunk_bytes, size);
    let buf = pager.alloc("kv", size).expect("alloc");
    let mut back = vec![1u8; size];
    pager.read(&buf, 0, &mut back).expect("read");
    assert!(
        back.iter().all(|&b| b == 0),
        "DiscardZeroed comes back zeroed"
    );
    pager.write(&buf, 7, &[9u8; 1000]).expect("write");
    assert_eq!(handles_released(&pager, &faulty, "kv"), 1);
    assert_eq!(host.used_bytes(), 0);
    pager.resume(&["kv"]).expect("resume");
    assert_eq!(host.used_bytes(), size);
    assert_eq!(pager.info("kv").expect("info").base, info.base);
    pager.read(&buf, 0, &mut back).expect("read");
    assert!(back.iter().all(|&b| b == 0), "zeroed again after resume");
}
