//! The copy kernel and the copy pump on a real GPU: `gp_copy` against its Rust reference
//! (host→device, device→host, device→device; odd sizes, co-aligned and misaligned ends,
//! guard bytes around the destination untouched), every route restoring and saving
//! bit-exact (fixed and growing regions, odd buffer sizes, units small enough for many per
//! move), and a release and a resume of two tags from two threads at once.
//!
//! Every test is `#[ignore = "needs a CUDA GPU"]` and fails (never passes) without one.

use crate::common;

use std::sync::Arc;

use common::{Rng, assert_bytes_eq, gpu, gpu_lock, scale};
use gpu_pager::backend::cuda::CudaBackend;
use gpu_pager::backend::{Backend, BackendError, HostBuffer, Mover, RawStream};
use gpu_pager::kernels::reference;
use gpu_pager::{Buffer, CopyRoute, Pager, PagerConfig, Policy, Report};

const MIB: usize = 1 << 20;
/// Bytes poisoned on each side of a destination, checked untouched afterwards.
const GUARD: usize = 64;
const POISON: u8 = 0xA5;

/// Where the bytes of one side of a kernel copy live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Host,
    Device,
}

/// Device memory to copy from and into: one mapping of `bytes`.
struct DeviceArea {
    base: u64,
    _mapping: Vec<Box<dyn gpu_pager::backend::Mapping>>,
    _range: Arc<dyn gpu_pager::backend::Reservation>,
}

fn device_area(b: &CudaBackend, bytes: usize) -> DeviceArea {
    let g = b.info().granularity;
    let bytes = bytes.next_multiple_of(g);
    let range = b.reserve(bytes).expect("reserve");
    // SAFETY: the whole fresh reservation, mapped once.
    let mapping = unsafe { b.map(&range, 0, &[bytes]) }.expect("map");
    DeviceArea {
        base: range.base(),
        _mapping: mapping,
        _range: range,
    }
}

/// `len` bytes at `at` of `side`.
fn read(
    b: &CudaBackend,
    side: Side,
    host: &dyn HostBuffer,
    area: u64,
    at: usize,
    len: usize,
) -> Vec<u8> {
    match side {
        Side::Host => host.as_slice()[at..at + len].to_vec(),
        Side::Device => {
            let mut out = vec![0u8; len];
            // SAFETY: inside the mapped area (the caller sizes it).
            unsafe { b.copy_to_host(&mut out, area + at as u64) }.expect("read back");
            out
        }
    }
}

/// Writes `data` at `at` of `side`.
fn write(
    b: &CudaBackend,
    side: Side,
    host: &mut dyn HostBuffer,
    area: u64,
    at: usize,
    data: &[u8],
) {
    match side {
        Side::Host => host.as_mut_slice()[at..at + data.len()].copy_from_slice(data),
        Side::Device => {
            // SAFETY: inside the mapped area (the caller sizes it).
            unsafe { b.copy_to_device(area + at as u64, data) }.expect("upload");
        }
    }
}

/// `gp_copy` against `reference::copy` on fresh random data: every direction, sizes from 1
/// byte to 16 MiB (odd ones included), source and destination offsets co-aligned (16-byte
/// words after a head) and not (8-, 4-, 2- and 1-byte words), the destination poisoned
/// first with guard bytes on both sides that must stay poisoned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn copy_kernel_matches_the_reference() {
    let _lock = gpu_lock();
    let b = gpu();
    let mut rng = Rng::seeded("copy_kernel_matches_the_reference");
    let big = (16 * MIB / scale()).max(64 * 1024) + 3;
    let sizes = [1, 15, 16, 17, 255, 4099, 65_543, 3 * MIB / scale() + 5, big];
    // (source offset, destination offset) within 16-byte-aligned areas.
    let offsets = [
        (0, 0),
        (3, 3),
        (GUARD + 16, GUARD + 32),
        (0, 8),
        (8, 0),
        (4, 12),
        (2, 6),
        (1, 0),
        (5, 2),
        (7, 13),
    ];
    let span = big + 4 * GUARD + 64;
    let mut host_src = b.alloc_pinned(span).expect("pin");
    let mut host_dst = b.alloc_pinned(span).expect("pin");
    let dev_src = device_area(&b, span);
    let dev_dst = device_area(&b, span);
    let stream = b.kernel_stream().clone();
    for (src_side, dst_side) in [
        (Side::Host, Side::Device),
        (Side::Device, Side::Host),
        (Side::Device, Side::Device),
    ] {
        for &len in &sizes {
            for &(src_off, dst_off) in &offsets {
                let what =
                    format!("{src_side:?}→{dst_side:?}, {len} bytes, offsets {src_off}/{dst_off}");
                // Guard bytes before and after the destination.
                let dst_at = GUARD + dst_off;
                let window = dst_at - GUARD..dst_at + len + GUARD;
                let data = rng.bytes(len);
                write(
                    &b,
                    src_side,
                    host_src.as_mut(),
                    dev_src.base,
                    src_off,
                    &data,
                );
                let poison = vec![POISON; window.len()];
                write(
                    &b,
                    dst_side,
                    host_dst.as_mut(),
                    dev_dst.base,
                    window.start,
                    &poison,
                );
                let addr = |side: Side, host: &dyn HostBuffer, area: u64, at: usize| match side {
                    Side::Host => host.device_ptr() + at as u64,
                    Side::Device => area + at as u64,
                };
                let src = addr(src_side, host_src.as_ref(), dev_src.base, src_off);
                let dst = addr(dst_side, host_dst.as_ref(), dev_dst.base, dst_at);
                // SAFETY: both ranges lie inside the mapped areas or the live pinned buffers,
                // which nothing else touches until the stream is synchronized below.
                unsafe { b.copy_kernel_on(&stream, dst, src, len) }.expect("launch");
                stream.synchronize().expect("synchronize");
                let got = read(
                    &b,
                    dst_side,
                    host_dst.as_ref(),
                    dev_dst.base,
                    window.start,
                    window.len(),
                );
                let mut want = poison;
                reference::copy(&mut want[GUARD..GUARD + len], &data);
                assert_bytes_eq(&what, &got, &want);
            }
        }
    }
    // Overlapping and wrapping ranges are refused before anything runs.
    for (dst, src, len) in [
        (dev_dst.base, dev_dst.base + 1, 16),
        (dev_dst.base + 8, dev_dst.base, 16),
        (u64::MAX - 4, dev_src.base, 16),
    ] {
        // SAFETY: refused before any launch (asserted).
        let e = unsafe { b.copy_kernel_on(&stream, dst, src, len) }.unwrap_err();
        assert!(matches!(e, BackendError::Invalid { op: "copy", .. }), "{e}");
    }
}

fn pager(b: &Arc<CudaBackend>) -> Pager {
    pager_on_route(
        b,
        PagerConfig::default().restore_route,
        PagerConfig::default().save_route,
    )
}

/// [`pager`] restoring on `restore` and saving on `save`.
fn pager_on_route(b: &Arc<CudaBackend>, restore: CopyRoute, save: CopyRoute) -> Pager {
    Pager::with_config(
        b.clone(),
        PagerConfig {
            restore_route: restore,
            save_route: save,
            chunk_bytes: 64 * MIB,
            tuning: gpu_pager::Tuning {
                copy_unit_bytes: 4 * MIB / scale(),
                // First saves through the pump too: its figures are what these tests check.
                first_save_overlap: false,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    )
}

/// Writes fresh random bytes into every buffer and returns them.
fn fill_random(pager: &Pager, bufs: &[Buffer], rng: &mut Rng) -> Vec<Vec<u8>> {
    bufs.iter()
        .map(|b| {
            let d = rng.bytes(b.len());
            pager.write(b, 0, &d).expect("write");
            d
        })
        .collect()
}

fn check(pager: &Pager, bufs: &[Buffer], want: &[Vec<u8>], what: &str) {
    for (i, (b, w)) in bufs.iter().zip(want).enumerate() {
        let mut got = vec![0u8; b.len()];
        pager.read(b, 0, &mut got).expect("read");
        assert_bytes_eq(&format!("{what}, buffer {i}"), &got, w);
    }
}

/// Overwrites the memory a release just gave back (a region of `bytes`, filled, removed),
/// so that a resume cannot find the old contents in the physical pages it maps.
fn trash(pager: &Pager, bytes: usize) {
    pager
        .region("trash", bytes, Policy::Discard)
        .expect("trash region");
    let t = pager.alloc("trash", bytes).expect("trash buffer");
    pager.fill(&t, 0xDEAD_BEEF).expect("fill");
    pager.remove("trash").expect("remove");
}

fn check_route(report: &Report, route: CopyRoute, what: &str) {
    let c = &report.copies;
    assert_eq!(c.total_bytes(), report.copied(), "{what}: {c:?}");
    for m in Mover::ALL {
        if !route.allows(m) {
            assert_eq!(c.bytes_by(m), 0, "{what}: {m} moved bytes");
        }
    }
    // One-mover routes; `Fastest` may use both (it times each first).
    if matches!(route, CopyRoute::Engine | CopyRoute::Kernel) && report.copied() > 0 {
        let only = Mover::ALL.into_iter().find(|&m| route.allows(m)).unwrap();
        assert_eq!(c.bytes_by(only), report.copied(), "{what}");
    }
}

/// Every route (and both movers of `resume_on`) restores and saves bit-exact: a fixed region
/// and a growing one with odd-sized buffers, units of 4 MiB (many per move), the freed memory
/// overwritten between release and resume; the report's per-mover bytes follow the route.
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_route_restores_and_saves_bit_exact() {
    let _lock = gpu_lock();
    let b = gpu();
    let mut rng = Rng::seeded("every_route_restores_and_saves_bit_exact");
    let size = 256 * MIB / scale();
    let mut fixed: Vec<Buffer> = Vec::new();
    for route in CopyRoute::ALL {
        let pager = pager_on_route(&b, route, route);
        pager.region("weights", size, Policy::Preserve).unwrap();
        pager
            .region_with(
                "grow",
                0,
                Policy::Preserve,
                gpu_pager::RegionOptions::GROWING,
            )
            .unwrap();
        fixed = (0..9)
            .map(|i| pager.alloc("weights", size / 10 - 4099 * i - 1).unwrap())
            .collect();
        let grown: Vec<Buffer> = (0..7)
            .map(|i| pager.alloc("grow", size / 10 + 8191 * i + 3).unwrap())
            .collect();
        for cycle in 0..2 {
            let what = format!("{route}, cycle {cycle}");
            // New contents every cycle, in every other buffer: the release copies the
            // changed hash chunks.
            let mut want_fixed = fill_random(&pager, &fixed, &mut rng);
            let mut want_grown = fill_random(&pager, &grown, &mut rng);
            if cycle == 1 {
                for k in (0..fixed.len()).step_by(2) {
                    want_fixed[k] = rng.bytes(fixed[k].len());
                    pager.write(&fixed[k], 0, &want_fixed[k]).unwrap();
                }
                for k in (1..grown.len()).step_by(2) {
                    want_grown[k] = rng.bytes(grown[k].len());
                    pager.write(&grown[k], 0, &want_grown[k]).unwrap();
                }
            }
            let r = pager.release(&["weights", "grow"]).unwrap();
            check_route(&r, route, &format!("{what}: release"));
            trash(&pager, 2 * size);
            let r = pager.resume(&["weights", "grow"]).unwrap();
            check_route(&r, route, &format!("{what}: resume"));
            check(&pager, &fixed, &want_fixed, &what);
            check(&pager, &grown, &want_grown, &what);
        }
    }
    // resume_on with either mover on a stream of the caller's.
    let pager = pager(&b);
    pager.region("weights", size, Policy::Preserve).unwrap();
    let fixed: Vec<Buffer> = fixed
        .iter()
        .map(|f| pager.alloc("weights", f.len()).unwrap())
        .collect();
    let stream = b.kernel_stream().clone();
    let want = fill_random(&pager, &fixed, &mut rng);
    for mover in Mover::ALL {
        let pager_on = Pager::with_config(
            b.clone(),
            PagerConfig {
                tuning: gpu_pager::Tuning {
                    stream_mover: mover,
                    copy_unit_bytes: 4 * MIB / scale(),
                    ..gpu_pager::Tuning::default()
                },
                ..PagerConfig::default()
            },
        );
        pager_on.region("on", size, Policy::Preserve).unwrap();
        let bufs: Vec<Buffer> = fixed
            .iter()
            .map(|f| pager_on.alloc("on", f.len()).unwrap())
            .collect();
        for (d, w) in bufs.iter().zip(&want) {
            pager_on.write(d, 0, w).unwrap();
        }
        pager_on.release(&["on"]).unwrap();
        trash(&pager, size);
        pager_on
            .resume_on(&["on"], RawStream(stream.cu_stream() as usize))
            .unwrap();
        stream.synchronize().expect("synchronize");
        check(
            &pager_on,
            &bufs,
            &want,
            &format!("resume_on by the {mover}"),
        );
    }
}

/// Thread A releases tag `x` (changed contents) while thread B resumes tag `y`, and the
/// other way round, many times: contents stay bit-exact.
#[test]
#[ignore = "needs a CUDA GPU"]
fn concurrent_release_and_resume_of_two_tags_stay_bit_exact() {
    let _lock = gpu_lock();
    let b = gpu();
    let pager = Arc::new(pager(&b));
    let size = 256 * MIB / scale();
    let mut threads = Vec::new();
    for (t, tag) in ["x", "y"].into_iter().enumerate() {
        pager.region(tag, size, Policy::Preserve).unwrap();
        let bufs: Vec<Buffer> = (0..5)
            .map(|i| pager.alloc(tag, size / 6 + 4097 * i + 1).unwrap())
            .collect();
        let pager = pager.clone();
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng::seeded(&format!("concurrent_release_and_resume ({tag})"));
            if t == 1 {
                // Out of phase: y starts released, so x releases while y resumes.
                fill_random(&pager, &bufs, &mut rng);
                pager.release(&[tag]).unwrap();
            }
            for round in 0..12 {
                if t == 1 {
                    pager.resume(&[tag]).unwrap();
                }
                let want = fill_random(&pager, &bufs, &mut rng);
                pager.release(&[tag]).unwrap();
                pager.resume(&[tag]).unwrap();
                check(&pager, &bufs, &want, &format!("{tag}, round {round}"));
                if t == 1 {
                    pager.release(&[tag]).unwrap();
                }
            }
        }));
    }
    for t in threads {
        t.join().expect("a thread failed");
    }
}
