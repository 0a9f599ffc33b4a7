//! Release and resume through the copy pump on the host backend, with units small enough
//! that every move is many units: each route is bit-exact, a copy failure in the middle of
//! a move loses nothing, and moves of different tags from two threads stay bit-exact.

use crate::common;
use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::backend::{Backend, BackendError, Mover, RawStream};
use gpu_pager::{Buffer, CopyRoute, Error, Pager, PagerConfig, Policy, Report, State};
use gpu_pager_testkit::{FaultPlan, FaultPoint, FaultyBackend};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// The pump's unit in these tests: a 3 MiB buffer is 48 units.
const UNIT: usize = 64 * KIB;

fn host(capacity: usize) -> Arc<HostBackend> {
    Arc::new(HostBackend::new(HostConfig {
        capacity,
        granularity: 64 * KIB,
    }))
}

fn pager(backend: Arc<dyn Backend>, route: CopyRoute) -> Pager {
    Pager::with_config(
        backend,
        PagerConfig {
            chunk_bytes: MIB,
            restore_route: route,
            save_route: route,
            tuning: gpu_pager::Tuning {
                hash_chunk_bytes: 256 * KIB,
                copy_unit_bytes: UNIT,
                // First saves through the pump too: its figures are what these tests check.
                first_save_overlap: false,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    )
}

/// Deterministic bytes that differ per seed.
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

fn read_all(pager: &Pager, b: &Buffer) -> Vec<u8> {
    let mut out = vec![0u8; b.len()];
    pager.read(b, 0, &mut out).expect("read");
    out
}

/// Writes generation `generation` into every buffer and returns what each holds.
fn write_all(pager: &Pager, bufs: &[Buffer], generation: u64) -> Vec<Vec<u8>> {
    bufs.iter()
        .enumerate()
        .map(|(i, b)| {
            let data = pattern(generation * 1000 + i as u64, b.len());
            pager.write(b, 0, &data).expect("write");
            data
        })
        .collect()
}

fn check_all(pager: &Pager, bufs: &[Buffer], want: &[Vec<u8>], what: &str) {
    for (i, (b, w)) in bufs.iter().zip(want).enumerate() {
        assert!(read_all(pager, b) == *w, "{what}: buffer {i} differs");
    }
}

/// The pump's figures agree with the route and with the bytes the report says it copied.
fn check_copies(report: &Report, route: CopyRoute, what: &str) {
    let c = &report.copies;
    assert_eq!(c.total_bytes(), report.copied(), "{what}: {c:?}");
    for m in Mover::ALL {
        if !route.allows(m) {
            assert_eq!(c.bytes_by(m), 0, "{what}: {m} moved bytes on route {route}");
        }
    }
}

#[test]
fn multi_unit_moves_are_bit_exact_on_every_route() {
    for route in CopyRoute::ALL {
        let backend = host(256 * MIB);
        let pager = pager(backend.clone(), route);
        pager.region("weights", 6 * MIB, Policy::Preserve).unwrap();
        pager
            .region_with(
                "grow",
                0,
                Policy::Preserve,
                gpu_pager::RegionOptions::GROWING,
            )
            .unwrap();
        // Odd sizes: units end inside buffers and buffers inside units.
        let fixed: Vec<Buffer> = (0..7)
            .map(|i| pager.alloc("weights", 100_003 + i * 77_777).unwrap())
            .collect();
        let grown: Vec<Buffer> = (0..5)
            .map(|i| pager.alloc("grow", 200_001 + i * 130_013).unwrap())
            .collect();
        let mut want_fixed = write_all(&pager, &fixed, 1);
        let mut want_grown = write_all(&pager, &grown, 2);
        for cycle in 0..3u64 {
            let what = format!("{route} cycle {cycle}");
            let r = pager.release(&["weights", "grow"]).unwrap();
            assert!(r.copied() > 0 || cycle > 0, "{what}");
            check_copies(&r, route, &format!("{what}: release"));
            assert_eq!(backend.used_bytes(), 0);
            let r = pager.resume(&["grow", "weights"]).unwrap();
            assert!(r.copied() >= want_fixed.iter().map(Vec::len).sum::<usize>());
            check_copies(&r, route, &format!("{what}: resume"));
            check_all(&pager, &fixed, &want_fixed, &what);
            check_all(&pager, &grown, &want_grown, &what);
            // Change some buffers: the next release copies the changed hash chunks only.
            want_fixed[cycle as usize] = pattern(50 + cycle, fixed[cycle as usize].len());
            pager
                .write(&fixed[cycle as usize], 0, &want_fixed[cycle as usize])
                .unwrap();
            want_grown[cycle as usize] = pattern(60 + cycle, grown[cycle as usize].len());
            pager
                .write(&grown[cycle as usize], 0, &want_grown[cycle as usize])
                .unwrap();
        }
        // resume_on enqueues on the caller's stream (the host backend copies at once).
        pager.release(&["weights"]).unwrap();
        let r = pager.resume_on(&["weights"], RawStream(0)).unwrap();
        assert_eq!(r.copies.total_bytes(), 0, "resume_on does not pump");
        check_all(&pager, &fixed, &want_fixed, "resume_on");
    }
}

#[test]
fn the_stream_mover_of_resume_on_is_configurable() {
    for mover in Mover::ALL {
        let backend = host(64 * MIB);
        let pager = Pager::with_config(
            backend,
            PagerConfig {
                chunk_bytes: MIB,
                tuning: gpu_pager::Tuning {
                    stream_mover: mover,
                    ..gpu_pager::Tuning::default()
                },
                ..PagerConfig::default()
            },
        );
        pager.region("w", 4 * MIB, Policy::Preserve).unwrap();
        let b = pager.alloc("w", 3 * MIB + 5).unwrap();
        let data = pattern(7, b.len());
        pager.write(&b, 0, &data).unwrap();
        pager.release(&["w"]).unwrap();
        pager.resume_on(&["w"], RawStream(0)).unwrap();
        assert!(read_all(&pager, &b) == data, "{mover}");
        assert_eq!(pager.config().tuning.stream_mover, mover);
    }
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

#[test]
fn a_copy_failure_in_the_middle_of_a_multi_unit_restore_loses_nothing() {
    for route in CopyRoute::ALL {
        for growing in [false, true] {
            let host = host(64 * MIB);
            let faulty = Arc::new(FaultyBackend::new(host.clone(), FaultPlan::none()));
            let pager = pager(faulty.clone(), route);
            let size = if growing { 0 } else { 8 * MIB };
            common::table_region(
                &pager,
                "weights",
                size,
                Policy::Preserve,
                Default::default(),
            )
            .unwrap();
            let bufs: Vec<Buffer> = (0..3)
                .map(|i| pager.alloc("weights", MIB + 4099 * i).unwrap())
                .collect();
            let want = write_all(&pager, &bufs, 3);
            pager.release(&["weights"]).unwrap();
            let what = format!("{route}, growing {growing}");
            // 3 MiB of contents are about 48 units: fail the 20th.
            faulty.fail_after(FaultPoint::CopyToDevice, 19);
            let err = pager.resume(&["weights"]).unwrap_err();
            assert!(injected(&err), "{what}: {err}");
            assert_eq!(faulty.injected().copy_to_device, 1);
            assert_eq!(pager.info("weights").unwrap().state, State::Released);
            assert_eq!(host.used_bytes(), 0, "{what}: the mapped part is unmapped");
            assert!(matches!(
                pager.ptr(&bufs[0]),
                Err(Error::NotResident { .. })
            ));
            // The backup is intact: a later resume restores everything.
            let r = pager.resume(&["weights"]).unwrap();
            assert!(r.copies.units.iter().sum::<usize>() >= 40, "{what}: {r}");
            check_all(&pager, &bufs, &want, &what);
        }
    }
}

#[test]
fn a_copy_failure_in_the_middle_of_a_multi_unit_save_leaves_everything_resident() {
    for route in CopyRoute::ALL {
        for skip_unchanged in [true, false] {
            let host = host(64 * MIB);
            let faulty = Arc::new(FaultyBackend::new(host.clone(), FaultPlan::none()));
            let pager = Pager::with_config(
                faulty.clone(),
                PagerConfig {
                    skip_unchanged,
                    ..pager(faulty.clone(), route).config()
                },
            );
            pager.region("weights", 8 * MIB, Policy::Preserve).unwrap();
            pager.region("kv", 2 * MIB, Policy::Discard).unwrap();
            let bufs: Vec<Buffer> = (0..3)
                .map(|i| pager.alloc("weights", MIB + 999 * i).unwrap())
                .collect();
            write_all(&pager, &bufs, 4);
            // A first cycle, so that the backup exists; then change everything.
            pager.release(&["weights"]).unwrap();
            pager.resume(&["weights"]).unwrap();
            let want = write_all(&pager, &bufs, 5);
            let used = host.used_bytes();
            let what = format!("{route}, skip {skip_unchanged}");
            faulty.fail_after(FaultPoint::CopyToHost, 20);
            let err = pager.release(&["kv", "weights"]).unwrap_err();
            assert!(injected(&err), "{what}: {err}");
            assert_eq!(pager.info("weights").unwrap().state, State::Resident);
            assert_eq!(pager.info("kv").unwrap().state, State::Resident);
            assert_eq!(host.used_bytes(), used, "{what}: nothing was unmapped");
            check_all(&pager, &bufs, &want, &what);
            // The retry copies everything again (the failed save left a partial backup)
            // and a resume brings back the new contents.
            let r = pager.release(&["kv", "weights"]).unwrap();
            assert!(r.copied() >= 3 * MIB, "{what}: {r}");
            pager.resume(&["weights"]).unwrap();
            check_all(&pager, &bufs, &want, &what);
        }
    }
}

#[test]
fn releases_and_resumes_of_two_tags_from_two_threads_stay_bit_exact() {
    for route in [CopyRoute::Engine, CopyRoute::Fastest] {
        two_threads(route);
    }
}

fn two_threads(route: CopyRoute) {
    let backend = host(128 * MIB);
    let pager = Arc::new(pager(backend, route));
    let mut threads = Vec::new();
    for (t, tag) in ["x", "y"].into_iter().enumerate() {
        pager.region(tag, 4 * MIB, Policy::Preserve).unwrap();
        let bufs: Vec<Buffer> = (0..4)
            .map(|i| pager.alloc(tag, 700_001 + 3 * i).unwrap())
            .collect();
        let pager = pager.clone();
        threads.push(std::thread::spawn(move || {
            for round in 0..40u64 {
                let want = write_all(&pager, &bufs, 100 * t as u64 + round);
                pager.release(&[tag]).unwrap();
                assert_eq!(pager.info(tag).unwrap().state, State::Released);
                pager.resume(&[tag]).unwrap();
                check_all(&pager, &bufs, &want, &format!("{tag} round {round}"));
                // An unchanged release and resume, too.
                pager.release(&[tag]).unwrap();
                pager.resume(&[tag]).unwrap();
                check_all(&pager, &bufs, &want, &format!("{tag} round {round}, again"));
            }
        }));
    }
    for t in threads {
        t.join().expect("a thread failed");
    }
}

#[test]
fn the_copy_units_are_configurable_and_moves_stay_bit_exact() {
    for (unit, depth) in [(3 * KIB, 0), (128 * KIB, 4), (8 * MIB, 1)] {
        let base = pager(host(MIB), CopyRoute::Fastest).config();
        let pager = Pager::with_config(
            host(64 * MIB),
            PagerConfig {
                tuning: gpu_pager::Tuning {
                    copy_unit_bytes: unit,
                    copy_depth: depth,
                    ..base.tuning
                },
                ..base
            },
        );
        pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
        let bufs: Vec<Buffer> = (0..3)
            .map(|i| pager.alloc("weights", 300_007 + i * 91_001).unwrap())
            .collect();
        let want = write_all(&pager, &bufs, 7);
        let c = pager.config();
        // Normalized as at creation: 4 KiB multiples, at least one unit queued.
        assert_eq!(c.tuning.copy_unit_bytes, unit.next_multiple_of(4 * KIB));
        assert_eq!(c.tuning.copy_depth, depth.max(1));
        let what = format!("units of {unit} × {depth}");
        let r = pager.release(&["weights"]).unwrap();
        assert!(r.copied() > 0 || unit != 3 * KIB, "{what}");
        let r = pager.resume(&["weights"]).unwrap();
        // Each restored span is cut into units of the new size: at least the bytes over
        // the unit, at most one partial unit more per span (one span per buffer at most).
        let units: usize = r.copies.units.iter().sum();
        let u = c.tuning.copy_unit_bytes;
        assert!(
            r.copied().div_ceil(u) <= units && units <= r.copied() / u + bufs.len(),
            "{what}: {units} units for {} bytes",
            r.copied()
        );
        check_all(&pager, &bufs, &want, &what);
    }
}

/// A fixed region's restore goes to the pump a mapping group at a time, so its units are
/// whole units even when the region's chunks are smaller than a unit (here 64 KiB chunks,
/// 256 KiB units: 4 MiB in 16 units and change, not 64 chunk-sized ones).
#[test]
fn a_fixed_regions_restore_is_cut_into_whole_units_whatever_its_chunk_size() {
    let backend = host(64 * MIB);
    let pager = Pager::with_config(
        backend,
        PagerConfig {
            chunk_bytes: 64 * KIB,
            tuning: gpu_pager::Tuning {
                hash_chunk_bytes: 256 * KIB,
                copy_unit_bytes: 256 * KIB,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    pager.region("w", 4 * MIB, Policy::Preserve).unwrap();
    let b = pager.alloc("w", 4 * MIB).unwrap();
    let data = pattern(7, 4 * MIB);
    pager.write(&b, 0, &data).unwrap();
    pager.release(&["w"]).unwrap();
    let r = pager.resume(&["w"]).unwrap();
    let units: usize = r.copies.units.iter().sum();
    assert_eq!(r.copied(), 4 * MIB);
    // Groups of 1, 2, 4, … chunks: each group's first unit may be short.
    assert!(units <= 16 + 7, "{units} units for 16 units' worth");
    assert!(read_all(&pager, &b) == data);
}
