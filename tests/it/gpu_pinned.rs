//! Pinned host memory by registration (`CudaBackend::pin`, behind `alloc_pinned`; batches,
//! `CudaBackend::pin_many`, behind `alloc_pinned_many`) and fixed `Discard` regions in their
//! own chunk size (`Tuning::discard_chunk_bytes`), on a GPU.
//!
//! Every test is `#[ignore = "needs a CUDA GPU"]` and fails (never passes) without one.
//! Run on the H200 with `bash .gpu/on-device gpu-tests` after `scripts/gpu-pack` (see `scripts/gpu-check`).

use crate::common;

use std::time::{Duration, Instant};

use common::{Rng, assert_bytes_eq, assert_no_deferred_errors, free_bytes, gpu, gpu_lock, scale};

use gpu_pager::backend::cuda::{CudaBackend, CudaPinned, HUGE_PAGE_BYTES};
use gpu_pager::backend::{Backend, Direction, HostBuffer, Mover};
use gpu_pager::kv::{CacheView, DeviceSpan, KvDtype, KvLayout, KvOp, KvOrder, reference};
use gpu_pager::{Pager, PagerConfig, Policy};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Byte `i` of a region filled with the 32-bit `pattern` (see `Backend::fill`).
fn pattern_byte(pattern: u32, i: usize) -> u8 {
    pattern.to_le_bytes()[i % 4]
}

/// Fresh pinned buffers of odd sizes read as zeros and round-trip bit-exact through device
/// memory at an odd address; a `Preserve` region without `prepin` (its first release pins
/// through `alloc_pinned`), fixed and growing, restores bit-exact.
#[test]
#[ignore = "needs a CUDA GPU"]
fn registered_buffers_of_odd_sizes_round_trip_bit_exact() {
    let _lock = gpu_lock();
    let b = gpu();
    let pager = Pager::new(b.clone());
    let mut rng = Rng::seeded("registered_buffers_of_odd_sizes_round_trip_bit_exact");
    let largest = 96 * MIB / scale() + 13;
    pager
        .region("dev", largest + 2 * MIB, Policy::Discard)
        .unwrap();
    let dev = pager.alloc("dev", largest + 64).unwrap();
    let at = pager.ptr(&dev).unwrap() + 7;
    let poison = 0xDEAD_BEEFu32;
    for bytes in [1, 4097, 2 * MIB + 13, 40 * MIB / scale() + 4095, largest] {
        let mut src = b.alloc_pinned(bytes).expect("alloc_pinned");
        assert_eq!(src.len(), bytes);
        assert!(
            src.as_slice().iter().all(|&x| x == 0),
            "{bytes}: not zeroed"
        );
        rng.fill(src.as_mut_slice());
        pager.fill(&dev, poison).unwrap();
        // SAFETY: `at .. at + bytes` lies inside the live `dev` buffer.
        unsafe { b.copy_to_device(at, src.as_slice()) }.expect("copy_to_device");
        let mut back = b.alloc_pinned(bytes).expect("alloc_pinned");
        back.as_mut_slice().fill(0xA5);
        // SAFETY: as above.
        unsafe { b.copy_to_host(back.as_mut_slice(), at) }.expect("copy_to_host");
        assert_bytes_eq(&format!("{bytes} bytes"), back.as_slice(), src.as_slice());
        // Nothing past the end was written.
        let mut after = [0u8; 1];
        pager.read(&dev, 7 + bytes, &mut after).unwrap();
        assert_eq!(
            after[0],
            pattern_byte(poison, 7 + bytes),
            "{bytes}: overran"
        );
    }
    pager.remove("dev").unwrap();

    // A fixed Preserve region, no prepin: the first release pins the backup.
    let size = 64 * MIB / scale() + 3 * MIB;
    pager.region("w", size, Policy::Preserve).unwrap();
    let w = pager.alloc("w", size - 5).unwrap();
    let data = rng.bytes(w.len());
    pager.write(&w, 0, &data).unwrap();
    let r = pager.release(&["w"]).unwrap();
    assert!(r.copied() >= data.len());
    let stats = pager.stats();
    let backup = stats.region("w").map(|s| s.backup_bytes).unwrap_or(0);
    assert!(backup >= size, "backup of {backup} bytes for {size}");
    pager.resume(&["w"]).unwrap();
    let mut back = vec![0u8; w.len()];
    pager.read(&w, 0, &mut back).unwrap();
    assert_bytes_eq("fixed region", &back, &data);

    // A growing one: one backup per buffer, each pinned at the buffer's size.
    pager
        .region_with("g", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    let lens = [13, 3 * MIB + 1, 17 * MIB / scale() + 4095, 2 * MIB];
    let bufs: Vec<_> = lens.iter().map(|&n| pager.alloc("g", n).unwrap()).collect();
    let datas: Vec<Vec<u8>> = lens.iter().map(|&n| rng.bytes(n)).collect();
    for (buf, d) in bufs.iter().zip(&datas) {
        pager.write(buf, 0, d).unwrap();
    }
    pager.release(&["g"]).unwrap();
    let g = b.info().granularity;
    let want: usize = lens.iter().map(|n| n.next_multiple_of(g)).sum();
    let stats = pager.stats();
    let backup = stats.region("g").map(|s| s.backup_bytes).unwrap_or(0);
    assert_eq!(
        backup, want,
        "one backup per buffer, at the buffer's mapped size"
    );
    pager.resume(&["g"]).unwrap();
    for (buf, d) in bufs.iter().zip(&datas) {
        let mut back = vec![0u8; d.len()];
        pager.read(buf, 0, &mut back).unwrap();
        assert_bytes_eq(&format!("growing buffer of {}", d.len()), &back, d);
    }
    drop(pager);
    assert_no_deferred_errors(&b);
}

/// The device address of a registered buffer is the driver's (`cuMemHostGetDevicePointer`
/// at each registration's start), and the KV swap kernels read and write the buffer through
/// it (zero-copy) over its whole length: one registration, and 2 MiB pieces registered
/// serially and in parallel (a kernel's accesses may cross registrations; copies may not).
#[test]
#[ignore = "needs a CUDA GPU"]
fn kernels_use_registered_memory_through_its_device_pointer() {
    let _lock = gpu_lock();
    let b = gpu();
    let pager = Pager::new(b.clone());
    let mut rng = Rng::seeded("kernels_use_registered_memory_through_its_device_pointer");
    let layout = KvLayout::new(1, 8, 128, 16, KvDtype::Bf16, KvOrder::Nhd).unwrap(); // 64 KiB
    let bpb = layout.bytes_per_block() as usize;
    let blocks = (48 * MIB / scale() / bpb).max(64) as u32; // crosses several 2 MiB pieces
    let cache_bytes = blocks as usize * bpb;
    pager.region("cache", cache_bytes, Policy::Discard).unwrap();
    let cache = pager.alloc("cache", cache_bytes).unwrap();
    let view = CacheView {
        layout,
        base: pager.ptr(&cache).unwrap(),
        blocks,
    };
    b.context().bind_to_thread().expect("bind the context");
    for (what, piece) in [("one registration", 0), ("2 MiB pieces", 2 * MIB)] {
        // Pinned alone: an odd tail past the blocks; filled from the cache: the cache's bytes.
        let bytes = if piece == 0 {
            cache_bytes + 40
        } else {
            cache_bytes
        };
        let src = pager.ptr(&cache).unwrap();
        let mut host = if piece == 0 {
            b.pin(bytes).expect("pin")
        } else {
            // SAFETY: `src .. src + cache_bytes` is the live cache buffer, not written
            // meanwhile.
            unsafe { b.pin_from_device(bytes, piece, src) }.expect("pin_from_device")
        };
        let regs = host.registrations().to_vec();
        if piece == 0 {
            assert_eq!(regs.len(), 1, "{what}");
        } else {
            assert!(regs.len() >= 2, "{what}: {} registrations", regs.len());
        }
        assert_eq!(regs[0].start, 0);
        assert!(regs.last().is_some_and(|r| r.end >= bytes));
        let base = host.as_slice().as_ptr() as usize;
        for r in &regs {
            let mut d: cudarc::driver::sys::CUdeviceptr = 0;
            // SAFETY: `d` is a valid out-pointer; `base + r.start` starts a live registration.
            let rc = unsafe {
                cudarc::driver::sys::cuMemHostGetDevicePointer_v2(
                    &mut d,
                    (base + r.start) as *mut std::ffi::c_void,
                    0,
                )
            };
            assert_eq!(
                rc,
                cudarc::driver::sys::CUresult::CUDA_SUCCESS,
                "{what}: cuMemHostGetDevicePointer"
            );
            assert_eq!(d, host.device_ptr() + r.start as u64, "{what}");
        }
        eprintln!("{what}: host {base:#x}, device {:#x}", host.device_ptr());
        let span = DeviceSpan {
            addr: host.device_ptr(),
            len: host.len(),
        };

        // swap_in: the kernel reads every block of the pinned buffer, in a random order.
        rng.fill(host.as_mut_slice());
        pager.fill(&cache, 0x0BAD_F00D).unwrap();
        let mut mirror = vec![0u8; cache_bytes];
        pager.read(&cache, 0, &mut mirror).unwrap();
        let mut order: Vec<u32> = (0..blocks).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let op = KvOp::SwapIn {
            cache: view,
            blocks: &order,
            host: span,
        };
        // SAFETY: the cache buffer and the pinned buffer are live for the synchronous call.
        unsafe { b.kv_kernels().kv(&op) }.expect("swap_in");
        reference::swap_in(&mut mirror, &layout, &order, host.as_slice()).unwrap();
        let mut got = vec![0u8; cache_bytes];
        pager.read(&cache, 0, &mut got).unwrap();
        assert_bytes_eq(&format!("{what}: swap_in"), &got, &mirror);

        // swap_out: the kernel writes every block into the poisoned pinned buffer.
        host.as_mut_slice().fill(0xA5);
        let mut want = host.as_slice().to_vec();
        order.reverse();
        let op = KvOp::SwapOut {
            cache: view,
            blocks: &order,
            host: span,
        };
        // SAFETY: as above.
        unsafe { b.kv_kernels().kv(&op) }.expect("swap_out");
        reference::swap_out(&mirror, &layout, &order, &mut want).unwrap();
        assert_bytes_eq(&format!("{what}: swap_out"), host.as_slice(), &want);
    }
    drop(pager);
    assert_no_deferred_errors(&b);
}

/// `pin_from_device` fills fresh pinned memory with a device range, piece by piece as each
/// registers, bit-exact (odd size, one piece and many).
#[test]
#[ignore = "needs a CUDA GPU"]
fn pin_from_device_copies_bit_exact() {
    let _lock = gpu_lock();
    let b = gpu();
    let pager = Pager::new(b.clone());
    let mut rng = Rng::seeded("pin_from_device_copies_bit_exact");
    let bytes = 40 * MIB / scale() + 13;
    pager.region("src", bytes, Policy::Discard).unwrap();
    let src = pager.alloc("src", bytes).unwrap();
    let data = rng.bytes(bytes);
    pager.write(&src, 0, &data).unwrap();
    let at = pager.ptr(&src).unwrap();
    for piece in [0, 2 * MIB] {
        // SAFETY: `at .. at + bytes` is the live `src` buffer, not written meanwhile.
        let host = unsafe { b.pin_from_device(bytes, piece, at) }.expect("pin_from_device");
        assert_eq!(host.len(), bytes);
        let want_pieces = if piece == 0 { 1 } else { 2 };
        assert!(host.registrations().len() >= want_pieces);
        assert_bytes_eq(
            &format!("{} registrations", host.registrations().len()),
            host.as_slice(),
            &data,
        );
    }
    drop(pager);
    assert_no_deferred_errors(&b);
}

/// The pipelined `pin_from_device` (a helper touching piece k+1 while piece k registers and
/// piece k-1 copies) over odd sizes and piece sizes: no pieces, pieces smaller than the
/// buffer (a multiple of it and not), a piece size that is not a multiple of 2 MiB, a piece
/// larger than the buffer. Bit-exact against the device source (random, at an odd address),
/// the registrations back to back over the whole mapping, and `piece_bytes` as registered.
/// (Restores from such a buffer through the pump, cut at its pieces, are checked by
/// `first_release_without_prepin_pins_in_one_pass_and_restores_bit_exact`.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn pipelined_pin_from_device_odd_sizes_and_pieces_bit_exact() {
    let _lock = gpu_lock();
    let b = gpu();
    let pager = Pager::new(b.clone());
    let mut rng = Rng::seeded("pipelined_pin_from_device_odd_sizes_and_pieces_bit_exact");
    // At least the largest fixed size below, at any scale.
    let largest = (96 * MIB / scale()).max(10 * MIB) + 13;
    pager
        .region("src", largest + 2 * MIB, Policy::Discard)
        .unwrap();
    let src = pager.alloc("src", largest + 64).unwrap();
    let data = rng.bytes(largest);
    pager.write(&src, 7, &data).unwrap();
    let at = pager.ptr(&src).unwrap() + 7;
    let sizes = [
        1,
        4097,
        2 * MIB + 13,
        8 * MIB,
        40 * MIB / scale() + 4095,
        largest,
    ];
    // No pieces; pieces smaller than the buffer (a multiple of 2 MiB and not: 3 MiB is
    // rounded up to 4); a piece larger than any buffer.
    let piece_sizes = [0, 2 * MIB, 3 * MIB, 4 * MIB, 8 * MIB, usize::MAX / 2];
    for &bytes in &sizes {
        for &piece_bytes in &piece_sizes {
            let what = format!("{bytes} bytes, pieces of {piece_bytes}");
            // SAFETY: `at .. at + bytes` lies inside the live `src` buffer, not written
            // meanwhile.
            let host = unsafe { b.pin_from_device(bytes, piece_bytes, at) }.expect(&what);
            assert_eq!(host.len(), bytes, "{what}");
            assert_bytes_eq(&what, host.as_slice(), &data[..bytes]);
            let regs = host.registrations();
            assert_eq!(regs.first().map(|r| r.start), Some(0), "{what}");
            assert!(regs.last().is_some_and(|r| r.end >= bytes), "{what}");
            for w in regs.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{what}: back to back");
            }
            let piece = piece_bytes.checked_next_multiple_of(2 * MIB).unwrap_or(0);
            let mapped = regs.last().map_or(0, |r| r.end);
            let want = if piece == 0 || piece >= mapped {
                1
            } else {
                mapped.div_ceil(piece)
            };
            assert_eq!(regs.len(), want, "{what}: registrations");
            let reported = if want > 1 { piece } else { 0 };
            assert_eq!(host.piece_bytes(), reported, "{what}");
            assert!(regs[..regs.len() - 1].iter().all(|r| r.len() == piece));
        }
    }
    pager.remove("src").unwrap();
    drop(pager);
    assert_no_deferred_errors(&b);
}

/// A fixed `Preserve` region's first release without `prepin` (`first_save_overlap`, the
/// default): the backup is pinned and filled in one pass (`alloc_pinned_from_device`, here
/// in 6 MiB pieces, the last short) and the save copies nothing;
/// the resume (adaptive route: the copy engine and the copy kernel read the backup across its
/// registrations, cut at their ends), a `resume_on` a stream, and a cycle after a change are
/// bit-exact; a marked buffer is not restored. With the switch off, the same through the
/// pump.
#[test]
#[ignore = "needs a CUDA GPU"]
fn first_release_without_prepin_pins_in_one_pass_and_restores_bit_exact() {
    use gpu_pager::backend::RawStream;
    let _lock = gpu_lock();
    let b = gpu();
    // Many pieces at any scale: the pump's units and resume_on's copies are cut at their
    // ends (on both movers: the default route is adaptive).
    b.set_first_backup_piece_bytes(6 * MIB);
    let mut rng = Rng::seeded("first_release_without_prepin_pins_in_one_pass");
    let size = GIB / scale() + 3 * MIB;
    for overlap in [true, false] {
        let pager = Pager::with_config(
            b.clone(),
            PagerConfig {
                verify_restore: true,
                tuning: gpu_pager::Tuning {
                    copy_gap_bytes: 0, // save exactly the unmarked bytes
                    first_save_overlap: overlap,
                    ..gpu_pager::Tuning::default()
                },
                ..PagerConfig::default()
            },
        );
        let info = pager.region("w", size, Policy::Preserve).unwrap();
        let lens = [size / 3 + 13, 7 * MIB / scale() + 1, size / 2 - 4097];
        let mut bufs: Vec<_> = lens
            .iter()
            .map(|&n| {
                let buf = pager.alloc("w", n).unwrap();
                let d = rng.bytes(n);
                pager.write(&buf, 0, &d).unwrap();
                (buf, d)
            })
            .collect();
        let live: usize = lens.iter().sum();
        let unmarked = lens[0] + lens[2];
        let what = format!("first_save_overlap {overlap}");

        let r = pager.release(&["w"]).unwrap();
        eprintln!("{what}: {r}");
        let w = r.region("w").unwrap();
        if overlap {
            assert_eq!(
                w.copied, info.size,
                "{what}: the whole region while pinning"
            );
            assert_eq!(r.copies.total_bytes(), 0, "{what}: the save copied nothing");
        } else {
            assert!(w.copied >= live, "{what}");
            assert_eq!(r.copies.total_bytes(), w.copied, "{what}");
        }
        let r = pager.resume(&["w"]).unwrap();
        assert_eq!(r.region("w").unwrap().copied, live, "{what}");
        let check = |bufs: &[(gpu_pager::Buffer, Vec<u8>)], when: &str, skip: Option<usize>| {
            for (i, (buf, d)) in bufs.iter().enumerate() {
                if Some(i) == skip {
                    continue; // marked: undefined after a resume
                }
                let mut back = vec![0u8; d.len()];
                pager.read(buf, 0, &mut back).unwrap();
                assert_bytes_eq(&format!("{what}, {when}, buffer {i}"), &back, d);
            }
        };
        check(&bufs, "resumed", None);

        // A marked buffer is neither saved nor restored (a first release with marks would
        // not take the one-pass path: marked bytes are never copied out).
        pager.mark_overwritten(&bufs[1].0).unwrap();
        pager.release(&["w"]).unwrap();
        let stats = pager.region_stats("w").unwrap();
        assert_eq!(
            stats.held_bytes, unmarked,
            "{what}: the marked buffer dropped out"
        );
        let r = pager.resume(&["w"]).unwrap();
        assert_eq!(r.region("w").unwrap().copied, unmarked, "{what}");
        check(&bufs, "resumed with a mark", Some(1));

        // resume_on a stream: its copies are cut at the registrations too.
        // Unchanged but for the marked buffer, whose bytes came back undefined: the hash
        // chunks (32 MiB) sharing bytes with it hash differently, so their unmarked parts are
        // copied again; nothing else is.
        let r = pager.release(&["w"]).unwrap();
        let copied = r.region("w").unwrap().copied;
        assert!(copied <= 2 * 32 * MIB, "{what}: unchanged, {copied}");
        pager.resume_on(&["w"], RawStream(0)).unwrap();
        b.synchronize().unwrap();
        check(&bufs, "resume_on", Some(1));

        // A change, then a cycle: only the changed chunks are copied.
        let fresh = rng.bytes(3 * MIB);
        pager.write(&bufs[2].0, 5 * MIB / scale(), &fresh).unwrap();
        let at = 5 * MIB / scale();
        bufs[2].1[at..at + 3 * MIB].copy_from_slice(&fresh);
        let r = pager.release(&["w"]).unwrap();
        let copied = r.region("w").unwrap().copied;
        // At most the two 32 MiB hash chunks the change touches and the two next to the
        // marked buffer.
        assert!(copied > 0 && copied <= 4 * 32 * MIB, "{what}: {copied}");
        pager.resume(&["w"]).unwrap();
        check(&bufs, "after a change", Some(1));
        pager.remove("w").unwrap();
        assert!(pager.take_deferred_errors().is_empty(), "{what}");
    }
}

/// A `/proc/self/status` value in bytes (0 when the kernel does not report it).
fn status_bytes(key: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Pinning and dropping 100 times (and 10 times through `pin`) leaves the
/// process's resident, locked and pinned memory where it was, with no deferred error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pinning_100_times_returns_the_memory() {
    let _lock = gpu_lock();
    let b = gpu();
    let bytes = 64 * MIB / scale() + 13;
    drop(b.alloc_pinned(bytes).expect("warm-up"));
    let before = ["VmRSS", "VmLck", "VmPin"].map(status_bytes);
    for i in 0..100 {
        let mut p = b.alloc_pinned(bytes).expect("alloc_pinned");
        p.as_mut_slice()[i * 4099 % bytes] = 1;
        drop(p);
    }
    for _ in 0..10 {
        drop(b.pin(bytes).expect("pin"));
    }
    let after = ["VmRSS", "VmLck", "VmPin"].map(status_bytes);
    eprintln!("VmRSS, VmLck, VmPin before {before:?}, after {after:?}");
    // One leaked buffer at full scale would exceed the slack; 100 leaked at any scale would.
    let slack = (bytes / 2).max(8 * MIB);
    for (k, key) in ["VmRSS", "VmLck", "VmPin"].iter().enumerate() {
        assert!(
            after[k] <= before[k] + slack,
            "{key} grew from {} to {} bytes over 110 pin/unpin cycles of {bytes} bytes",
            before[k],
            after[k]
        );
    }
    assert_no_deferred_errors(&b);
}

/// Free device memory, waiting up to 5 s for it to reach `at_least` (memory unmapped a moment
/// ago is not always counted free at once).
fn free_at_least(b: &CudaBackend, at_least: usize) -> usize {
    let t = Instant::now();
    loop {
        let free = free_bytes(b);
        if free >= at_least || t.elapsed() > Duration::from_secs(5) {
            return free;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Fixed `Discard` and `DiscardZeroed` regions in `discard_chunk_bytes` chunks (several, and
/// one handle for the whole region): contents usable, zeroed where asked, addresses kept,
/// and the free device memory rises by the region's size on release.
#[test]
#[ignore = "needs a CUDA GPU"]
fn discard_regions_in_discard_chunks_map_and_give_memory_back() {
    let _lock = gpu_lock();
    let b = gpu();
    let g = b.info().granularity;
    let size = (4 * GIB / scale()).next_multiple_of(g) + g; // whole chunks and a short one
    let probe = 4 * MIB;
    for discard in [GIB / scale(), usize::MAX] {
        let pager = Pager::with_config(
            b.clone(),
            PagerConfig {
                tuning: gpu_pager::Tuning {
                    discard_chunk_bytes: discard,
                    ..gpu_pager::Tuning::default()
                },
                ..PagerConfig::default()
            },
        );
        let chunk = pager.config().tuning.discard_chunk_bytes.min(size);
        for policy in [Policy::Discard, Policy::DiscardZeroed] {
            let what = format!("{policy:?}, {chunk}-byte chunks");
            let info = pager.region("kv", size, policy).unwrap();
            assert_eq!(info.chunk_bytes, chunk, "{what}");
            let buf = pager.alloc("kv", size).unwrap();
            let check_ends = |pattern: Option<u32>, when: &str| {
                for offset in [0, size - probe] {
                    let mut got = vec![0xA5u8; probe];
                    pager.read(&buf, offset, &mut got).unwrap();
                    let ok = got
                        .iter()
                        .enumerate()
                        .all(|(i, &x)| x == pattern.map_or(0, |p| pattern_byte(p, offset + i)));
                    assert!(ok, "{what}, {when}: wrong bytes at offset {offset}");
                }
            };
            if policy == Policy::DiscardZeroed {
                check_ends(None, "created");
            }
            pager.fill(&buf, 0x1357_9BDF).unwrap();
            check_ends(Some(0x1357_9BDF), "filled");

            b.synchronize().unwrap();
            let before = free_bytes(&b);
            pager.release(&["kv"]).unwrap();
            let released = free_at_least(&b, before + size);
            assert!(
                released >= before + size,
                "{what}: releasing {size} bytes freed only {}",
                released.saturating_sub(before)
            );

            pager.resume(&["kv"]).unwrap();
            assert_eq!(pager.info("kv").unwrap().base, info.base, "{what}");
            let resumed = free_bytes(&b);
            assert!(
                resumed + size <= released + 64 * MIB,
                "{what}: resuming {size} bytes took only {}",
                released.saturating_sub(resumed)
            );
            if policy == Policy::DiscardZeroed {
                check_ends(None, "resumed");
            }
            pager.fill(&buf, 0x2468_ACE0).unwrap();
            check_ends(Some(0x2468_ACE0), "filled after resume");
            pager.remove("kv").unwrap();
        }
    }
    assert_no_deferred_errors(&b);
}

/// The device address `cuMemHostGetDevicePointer` gives for host address `at` (the start of
/// a live registration).
fn driver_device_ptr(at: *const u8) -> u64 {
    let mut d: cudarc::driver::sys::CUdeviceptr = 0;
    // SAFETY: `d` is a valid out-pointer; `at` starts a live registration (the caller's).
    let rc = unsafe {
        cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut d, at as *mut std::ffi::c_void, 0)
    };
    assert_eq!(
        rc,
        cudarc::driver::sys::CUresult::CUDA_SUCCESS,
        "cuMemHostGetDevicePointer"
    );
    d
}

/// Checks the layout of a batch (`pin_many`, `pin_many_from_device`) of `sizes`: each buffer
/// has its size, one registration over its own slice rounded up to [`HUGE_PAGE_BYTES`] (at
/// such an address), and the
/// driver's device address. Returns each slice as (host address, bytes).
fn batch_spans(bufs: &[CudaPinned], sizes: &[usize], what: &str) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    for (k, p) in bufs.iter().enumerate() {
        let w = format!("{what}, buffer {k}");
        let span = sizes[k].next_multiple_of(HUGE_PAGE_BYTES);
        assert_eq!(p.len(), sizes[k], "{w}");
        assert_eq!(p.registrations(), std::slice::from_ref(&(0..span)), "{w}");
        let host = p.as_slice().as_ptr();
        assert_eq!(host as usize % HUGE_PAGE_BYTES, 0, "{w}: aligned");
        assert_eq!(p.device_ptr(), driver_device_ptr(host), "{w}");
        spans.push((host as usize, span));
    }
    spans
}

/// No two of `spans` (host address, bytes) overlap.
fn assert_disjoint(mut spans: Vec<(usize, usize)>, what: &str) {
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "{what}: slices overlap: {w:?}");
    }
}

/// Copies `bytes` between pinned `host` (from its start) and device address `at` with
/// `mover` (one unit of the pump) and waits.
fn copy_unit(b: &CudaBackend, direction: Direction, host: &dyn HostBuffer, at: u64, mover: Mover) {
    let copy = common::whole_copy(direction, host, at);
    // SAFETY: `at .. at + len` lies inside a live device buffer and the host range is a live
    // pinned buffer of `b`; neither is touched by anyone else until the fence passes.
    let fence = unsafe { b.copy_unit(&copy, mover) }.expect("copy_unit");
    fence.wait().expect("wait for the copy");
}

/// A batch of buffers of odd sizes (`pin_many`, and `alloc_pinned_many` through the trait):
/// each reads as zeros, lies on its own huge-page-aligned slice with one registration whose
/// device address is the driver's, the slices are disjoint; each round-trips bit-exact through
/// device memory at an odd address with `copy_to_device`/`copy_to_host` and with both movers of
/// the pump (the copy kernel through the buffer's device address), touching neither its
/// neighbours nor device bytes past its end.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_batches_of_odd_sizes_are_disjoint_and_copy_bit_exact() {
    let _lock = gpu_lock();
    let b = gpu();
    let pager = Pager::new(b.clone());
    let mut rng = Rng::seeded("pinned_batches_of_odd_sizes_are_disjoint_and_copy_bit_exact");
    let sizes = [
        1,
        4097,
        2 * MIB,
        2 * MIB + 13,
        17 * MIB / scale() + 4095,
        3,
        40 * MIB / scale() + 1,
    ];
    let largest = sizes.iter().copied().max().unwrap_or(1);
    pager
        .region("dev", largest + 2 * MIB, Policy::Discard)
        .unwrap();
    let dev = pager.alloc("dev", largest + 64).unwrap();
    let at = pager.ptr(&dev).unwrap() + 7;
    let poison = 0xDEAD_BEEFu32;

    // `driver_device_ptr` calls the driver directly: it needs the context current here.
    b.context().bind_to_thread().expect("bind the context");
    let mut src: Vec<CudaPinned> = b.pin_many(&sizes).expect("pin_many");
    let mut back: Vec<Box<dyn HostBuffer>> =
        b.alloc_pinned_many(&sizes).expect("alloc_pinned_many");
    assert_eq!((src.len(), back.len()), (sizes.len(), sizes.len()));
    assert!(b.pin_many(&[]).unwrap().is_empty());
    let mut spans = batch_spans(&src, &sizes, "pin_many");
    for (k, p) in src.iter().enumerate() {
        assert!(
            p.as_slice().iter().all(|&x| x == 0),
            "buffer {k}: not zeroed"
        );
    }
    for (k, q) in back.iter().enumerate() {
        assert_eq!(q.len(), sizes[k]);
        assert!(q.as_slice().iter().all(|&x| x == 0), "back {k}: not zeroed");
        let host = q.as_slice().as_ptr();
        assert_eq!(q.device_ptr(), driver_device_ptr(host), "back {k}");
        spans.push((host as usize, sizes[k].next_multiple_of(HUGE_PAGE_BYTES)));
    }
    assert_disjoint(spans, "pin_many and alloc_pinned_many");

    let datas: Vec<Vec<u8>> = sizes.iter().map(|&n| rng.bytes(n)).collect();
    for (p, d) in src.iter_mut().zip(&datas) {
        p.as_mut_slice().copy_from_slice(d);
    }
    let check_device = |k: usize, what: &str| {
        let mut got = vec![0u8; sizes[k] + 1];
        pager.read(&dev, 7, &mut got).unwrap();
        assert_bytes_eq(what, &got[..sizes[k]], &datas[k]);
        assert_eq!(
            got[sizes[k]],
            pattern_byte(poison, 7 + sizes[k]),
            "{what}: overran"
        );
    };
    for k in 0..sizes.len() {
        // copy_to_device / copy_to_host (the copy engine, synchronous).
        let what = format!("buffer {k} of {} bytes, copy_to_*", sizes[k]);
        pager.fill(&dev, poison).unwrap();
        // SAFETY: `at .. at + sizes[k]` lies inside the live `dev` buffer.
        unsafe { b.copy_to_device(at, src[k].as_slice()) }.expect("copy_to_device");
        check_device(k, &what);
        back[k].as_mut_slice().fill(0xA5);
        // SAFETY: as above.
        unsafe { b.copy_to_host(back[k].as_mut_slice(), at) }.expect("copy_to_host");
        assert_bytes_eq(&what, back[k].as_slice(), &datas[k]);
        // Both movers of the pump, the copy kernel through the device addresses.
        for mover in Mover::ALL {
            let what = format!("buffer {k} of {} bytes, {mover}", sizes[k]);
            pager.fill(&dev, poison).unwrap();
            copy_unit(&b, Direction::ToDevice, &src[k], at, mover);
            check_device(k, &what);
            back[k].as_mut_slice().fill(0xA5);
            copy_unit(&b, Direction::ToHost, back[k].as_ref(), at, mover);
            assert_bytes_eq(&what, back[k].as_slice(), &datas[k]);
        }
    }
    // No copy strayed into a neighbour.
    for k in 0..sizes.len() {
        assert_bytes_eq(
            &format!("source {k} at the end"),
            src[k].as_slice(),
            &datas[k],
        );
        assert_bytes_eq(
            &format!("back {k} at the end"),
            back[k].as_slice(),
            &datas[k],
        );
    }
    // Dropping some buffers of a batch leaves the others' registrations and contents whole.
    let mut survivors: Vec<(usize, CudaPinned)> = src.into_iter().enumerate().collect();
    survivors.retain(|(k, _)| ![5, 0, 2].contains(k));
    for (k, p) in &survivors {
        let what = format!("buffer {k}, after others of its batch were dropped");
        assert_bytes_eq(&what, p.as_slice(), &datas[*k]);
        for mover in Mover::ALL {
            pager.fill(&dev, poison).unwrap();
            copy_unit(&b, Direction::ToDevice, p, at, mover);
            check_device(*k, &what);
        }
    }
    drop((survivors, back));
    drop(pager);
    assert_no_deferred_errors(&b);
}

/// 50 batches (and 10 through `pin_many`) pinned and dropped one buffer at a
/// time, in a shuffled order, leave the process's resident, locked and pinned memory where
/// it was, with no deferred error; and a dropped buffer's pages go back at once
/// (`MADV_DONTNEED`), while the rest of its batch lives.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_batches_dropped_one_by_one_return_the_memory() {
    let _lock = gpu_lock();
    let b = gpu();
    let mut rng = Rng::seeded("pinned_batches_dropped_one_by_one_return_the_memory");
    let big = (64 * MIB / scale()).max(16 * MIB) + 5;
    let sizes = [3 * MIB + 1, big, 1, 5 * MIB / scale() + 4097, 2 * MIB, 7];
    drop(b.alloc_pinned_many(&sizes).expect("warm-up"));
    let before = ["VmRSS", "VmLck", "VmPin"].map(status_bytes);

    // One buffer's pages go back while its batch lives.
    let mut bufs = b.alloc_pinned_many(&sizes).expect("alloc_pinned_many");
    let held = status_bytes("VmRSS");
    drop(bufs.remove(1));
    let dropped = status_bytes("VmRSS");
    eprintln!("VmRSS with the batch {held}, after dropping {big} bytes of it {dropped}");
    assert!(
        dropped + big / 2 <= held,
        "dropping a {big}-byte buffer of a live batch gave back only {} bytes",
        held.saturating_sub(dropped)
    );
    drop(bufs);

    for cycle in 0..50 {
        let mut bufs = b.alloc_pinned_many(&sizes).expect("alloc_pinned_many");
        for (k, p) in bufs.iter_mut().enumerate() {
            let n = p.len();
            p.as_mut_slice()[(cycle * 4099 + k) % n] = 1;
        }
        while !bufs.is_empty() {
            let k = rng.next_u64() as usize % bufs.len();
            drop(bufs.swap_remove(k));
        }
    }
    for _ in 0..10 {
        let mut bufs = b.pin_many(&sizes).expect("pin_many");
        while !bufs.is_empty() {
            let k = rng.next_u64() as usize % bufs.len();
            drop(bufs.swap_remove(k));
        }
    }
    let after = ["VmRSS", "VmLck", "VmPin"].map(status_bytes);
    eprintln!("VmRSS, VmLck, VmPin before {before:?}, after {after:?}");
    // One leaked batch would exceed the slack; 50 leaked slices at any scale would.
    let slack = (big / 2).max(8 * MIB);
    for (k, key) in ["VmRSS", "VmLck", "VmPin"].iter().enumerate() {
        assert!(
            after[k] <= before[k] + slack,
            "{key} grew from {} to {} bytes over 60 batches of {sizes:?} bytes",
            before[k],
            after[k]
        );
    }
    assert_no_deferred_errors(&b);
}

/// A batch of odd sizes pinned and filled from the device in one pipeline
/// (`pin_many_from_device`, and `alloc_pinned_many_from_device` through the trait in 6 MiB
/// parts): grouped into no parts, 6 MiB parts (several buffers each, a larger buffer
/// alone), 2 MiB parts (every buffer alone) and 3 MiB parts (rounded up to 4). Every buffer
/// is bit-exact against its device source (random, at odd addresses) and has one
/// registration over its own huge-page-aligned slice whose device address is the driver's;
/// the slices are disjoint; the buffers are dropped one by one in a scrambled order, the
/// others staying bit-exact; no ranges give no buffers, a range of 0 bytes is refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pin_many_from_device_odd_sizes_and_parts_bit_exact() {
    use gpu_pager::backend::{BackendError, DeviceRange};
    let _lock = gpu_lock();
    let b = gpu();
    let pager = Pager::new(b.clone());
    let mut rng = Rng::seeded("pin_many_from_device_odd_sizes_and_parts_bit_exact");
    let sizes = [
        1,
        4097,
        3 * MIB + 5,
        2 * MIB,
        2 * MIB + 1,
        9 * MIB + 13,
        1,
        40 * MIB / scale() + 4095,
        5,
        5 * MIB - 3,
    ];
    // Sources back to back, 3 bytes apart, from an odd address.
    let mut offsets = Vec::new();
    let mut end = 7;
    for &n in &sizes {
        offsets.push(end);
        end += n + 3;
    }
    pager.region("src", end + 2 * MIB, Policy::Discard).unwrap();
    let src = pager.alloc("src", end).unwrap();
    let data = rng.bytes(end);
    pager.write(&src, 0, &data).unwrap();
    let base = pager.ptr(&src).unwrap();
    let ranges: Vec<DeviceRange> = sizes
        .iter()
        .zip(&offsets)
        .map(|(&bytes, &at)| DeviceRange {
            src: base + at as u64,
            bytes,
        })
        .collect();
    let want = |k: usize| &data[offsets[k]..offsets[k] + sizes[k]];
    let part_sizes = [0, 6 * MIB, 2 * MIB, 3 * MIB];
    // `driver_device_ptr` calls the driver directly: it needs the context current here.
    b.context().bind_to_thread().expect("bind the context");
    for &part_bytes in &part_sizes {
        let what = format!("parts of {part_bytes}");
        // SAFETY: every range lies inside the live `src` buffer, not written meanwhile.
        let mut bufs = unsafe { b.pin_many_from_device(&ranges, part_bytes) }.expect(&what);
        assert_eq!(bufs.len(), sizes.len(), "{what}");
        let spans = batch_spans(&bufs, &sizes, &what);
        for (k, p) in bufs.iter().enumerate() {
            let w = format!("{what}, buffer {k}");
            assert_eq!(p.piece_bytes(), 0, "{w}: one piece");
            assert_bytes_eq(&w, p.as_slice(), want(k));
        }
        assert_disjoint(spans, &what);
        // Dropped one by one, scrambled: the others keep their contents.
        let mut ids: Vec<usize> = (0..bufs.len()).collect();
        while !bufs.is_empty() {
            let i = rng.next_u64() as usize % bufs.len();
            drop(bufs.swap_remove(i));
            ids.swap_remove(i);
            for (p, &k) in bufs.iter().zip(&ids) {
                assert_bytes_eq(&format!("{what}, buffer {k} kept"), p.as_slice(), want(k));
            }
        }
    }

    // Through the trait, in the first backups' part size.
    b.set_first_backup_piece_bytes(6 * MIB);
    // SAFETY: as above.
    let bufs = unsafe { b.alloc_pinned_many_from_device(&ranges) }.expect("through the trait");
    assert_eq!(bufs.len(), sizes.len());
    for (k, p) in bufs.iter().enumerate() {
        assert_eq!(p.len(), sizes[k]);
        assert_bytes_eq(&format!("trait, buffer {k}"), p.as_slice(), want(k));
    }
    drop(bufs);
    // SAFETY: no ranges.
    let none = unsafe { b.pin_many_from_device(&[], 0) };
    assert!(none.expect("no ranges").is_empty());
    let zero = [
        ranges[0],
        DeviceRange {
            src: base,
            bytes: 0,
        },
    ];
    // SAFETY: the first range is as above; the second reads nothing.
    let refused = unsafe { b.pin_many_from_device(&zero, 0) };
    assert!(matches!(refused, Err(BackendError::Invalid { .. })));
    pager.remove("src").unwrap();
    drop(pager);
    assert_no_deferred_errors(&b);
}
