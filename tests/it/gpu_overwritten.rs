//! Update-aware release on a real GPU: buffers marked "overwritten by the next update" are
//! neither saved nor restored, in fixed and in growing `Preserve` regions; everything else
//! comes back bit-exact at the same addresses, and the memory really goes back on release.
//!
//! Every test is `#[ignore = "needs a CUDA GPU"]` and fails (never passes) without one.

use crate::common;

use std::time::Duration;

use common::{Rng, assert_bytes_eq, free_bytes, gpu, gpu_lock, scale};
use gpu_pager::backend::Backend;
use gpu_pager::kernels::reference;
use gpu_pager::{Buffer, Pager, PagerConfig, Policy};

const MIB: usize = 1 << 20;

fn whole_hash(pager: &Pager, b: &Buffer) -> u64 {
    pager
        .hash(b, b.len().next_multiple_of(16))
        .expect("chunk_hash")[0]
}

/// A `weights` Preserve region (growing, or fixed and just large enough) holding one buffer
/// per length in `lens`.
fn weights_of(pager: &Pager, lens: &[usize], growing: bool) -> Vec<Buffer> {
    let bytes = if growing {
        0
    } else {
        lens.iter().map(|l| l.next_multiple_of(256)).sum::<usize>()
    };
    common::table_region(
        pager,
        "weights",
        bytes,
        Policy::Preserve,
        Default::default(),
    )
    .unwrap();
    lens.iter()
        .map(|&l| pager.alloc("weights", l).unwrap())
        .collect()
}

fn read_at(pager: &Pager, b: &Buffer, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    pager.read(b, offset, &mut out).unwrap();
    out
}

/// How one of the 300 buffers is marked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    None,
    Whole,
    /// The middle third (a tensor inside a torch segment).
    Middle,
}

/// 300 odd-sized buffers (1 byte to ~32 MiB) in a fixed or a growing Preserve region, half
/// of them marked whole and a few with their middle third marked; three cycles, each with
/// an "update" that overwrites every marked byte after the resume. The unmarked bytes stay
/// bit-exact and keep their addresses, the marked ones are writable, the first release
/// copies exactly the unmarked bytes (the copy gap is 0), free device memory rises by the
/// mapped bytes on release; unmarked again, everything cycles bit-exact.
fn half_marked(growing: bool) {
    let _lock = gpu_lock();
    let backend = gpu();
    let g = backend.info().granularity;
    let pager = Pager::with_config(
        backend.clone(),
        PagerConfig {
            tuning: gpu_pager::Tuning {
                copy_gap_bytes: 0,
                // The first release saves exactly the unmarked bytes through the pump
                // (gpu_pinned.rs covers the one-pass first backup with a marked buffer).
                first_save_overlap: false,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    let name = if growing { "growing" } else { "fixed" };
    let mut rng = Rng::seeded(&format!("gpu_half_marked_{name}"));
    let lens: Vec<usize> = (0..300)
        .map(|i| 1 + rng.next_u64() as usize % (32 * MIB / scale()) + i * 4099)
        .collect();
    let bufs = weights_of(&pager, &lens, growing);
    let mapped = pager.region_stats("weights").unwrap().resident_bytes;
    let marks: Vec<Mark> = (0..300)
        .map(|i| match (i % 2, i % 17) {
            (1, _) => Mark::Whole,
            (0, 0) if lens[i] >= 3 => Mark::Middle,
            _ => Mark::None,
        })
        .collect();
    let third = |i: usize| lens[i] / 3..2 * lens[i] / 3;
    // Random bytes from the host in every 17th buffer (read back), fills in the rest.
    let mut random: Vec<Option<Vec<u8>>> = vec![None; 300];
    for (i, b) in bufs.iter().enumerate() {
        pager.fill(b, rng.next_u64() as u32).unwrap();
        if i % 17 == 0 {
            let d = rng.bytes(lens[i]);
            pager.write(b, 0, &d).unwrap();
            random[i] = Some(d);
        }
    }
    // Bytes the release saves; those of them in buffers that also hold marked bytes.
    let (mut saved, mut mixed) = (0, 0);
    for (i, b) in bufs.iter().enumerate() {
        let padded = if growing {
            lens[i].next_multiple_of(g)
        } else {
            lens[i]
        };
        match marks[i] {
            Mark::Whole => pager.mark_overwritten(b).unwrap(),
            Mark::Middle => {
                pager.set_overwritten(b, third(i), true).unwrap();
                saved += padded - third(i).len();
                mixed += padded - third(i).len();
            }
            Mark::None => saved += padded,
        }
    }
    let mut want: Vec<u64> = bufs.iter().map(|b| whole_hash(&pager, b)).collect();
    let ptrs: Vec<u64> = bufs.iter().map(|b| pager.ptr(b).unwrap()).collect();

    for cycle in 0..3 {
        let before = free_bytes(&backend);
        let rel = pager.release(&["weights"]).unwrap();
        let after = free_bytes(&backend);
        eprintln!("{name} cycle {cycle}: {rel}");
        let r = rel.region("weights").unwrap();
        assert_eq!(r.bytes, mapped);
        assert!(
            after >= before + mapped - 64 * MIB,
            "{name} cycle {cycle}: free memory rose by {} of {mapped} released",
            after.saturating_sub(before)
        );
        if cycle == 0 {
            assert_eq!(
                r.copied, saved,
                "{name}: the first release copies the unmarked bytes"
            );
        } else if growing {
            // Per-buffer backups: the update changed the hash chunks of the buffers marked
            // in part only; the unmarked buffers are skipped.
            assert!(
                r.copied <= mixed,
                "{name} cycle {cycle}: copied {} > {mixed}",
                r.copied
            );
        } else {
            // Hash chunks shared with updated marked bytes count as changed.
            assert!(
                r.copied <= saved,
                "{name} cycle {cycle}: copied {}",
                r.copied
            );
        }
        assert_eq!(pager.region_stats("weights").unwrap().held_bytes, saved);
        let res = pager.resume(&["weights"]).unwrap();
        assert_eq!(
            res.region("weights").unwrap().copied,
            saved,
            "only what was saved"
        );
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(
                pager.ptr(b).unwrap(),
                ptrs[i],
                "{name}: address of buffer {i}"
            );
            match (marks[i], &random[i]) {
                (Mark::None, _) => {
                    assert_eq!(
                        whole_hash(&pager, b),
                        want[i],
                        "{name} cycle {cycle}: buffer {i}"
                    )
                }
                (Mark::Middle, Some(d)) => {
                    let t = third(i);
                    let head = read_at(&pager, b, 0, t.start);
                    assert_bytes_eq(
                        &format!("{name} cycle {cycle}: head of {i}"),
                        &head,
                        &d[..t.start],
                    );
                    let tail = read_at(&pager, b, t.end, lens[i] - t.end);
                    assert_bytes_eq(
                        &format!("{name} cycle {cycle}: tail of {i}"),
                        &tail,
                        &d[t.end..],
                    );
                }
                _ => {}
            }
        }
        // The update: overwrite every marked byte, and check that it took.
        for (i, b) in bufs.iter().enumerate() {
            match marks[i] {
                Mark::Whole => {
                    random[i] = None;
                    let pattern = rng.next_u64() as u32;
                    pager.fill(b, pattern).unwrap();
                    let mut expect = vec![0u8; lens[i]];
                    reference::fill(&mut expect, pattern);
                    let n = lens[i].min(4096);
                    assert_bytes_eq(
                        &format!("{name}: updated {i} head"),
                        &read_at(&pager, b, 0, n),
                        &expect[..n],
                    );
                    let tail = lens[i] - n;
                    assert_bytes_eq(
                        &format!("{name}: updated {i} tail"),
                        &read_at(&pager, b, tail, n),
                        &expect[tail..],
                    );
                }
                Mark::Middle => {
                    let t = third(i);
                    let fresh = rng.bytes(t.len());
                    pager.write(b, t.start, &fresh).unwrap();
                    assert_bytes_eq(
                        &format!("{name}: updated middle of {i}"),
                        &read_at(&pager, b, t.start, t.len()),
                        &fresh,
                    );
                    if let Some(d) = &mut random[i] {
                        d[t].copy_from_slice(&fresh);
                    }
                }
                Mark::None => {}
            }
        }
    }
    // Unmarked again: the next cycle saves everything and restores it bit-exact, the
    // former holes included.
    for b in &bufs {
        pager.unmark_overwritten(b).unwrap();
    }
    want = bufs.iter().map(|b| whole_hash(&pager, b)).collect();
    pager.release(&["weights"]).unwrap();
    pager.resume(&["weights"]).unwrap();
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(
            whole_hash(&pager, b),
            want[i],
            "{name}: buffer {i} once unmarked"
        );
        if let Some(d) = &random[i] {
            assert_bytes_eq(
                &format!("{name}: buffer {i} once unmarked"),
                &read_at(&pager, b, 0, lens[i]),
                d,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_half_marked_fixed_region() {
    half_marked(false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_half_marked_growing_region() {
    half_marked(true);
}

/// Every buffer marked: release and resume copy and hash nothing; a growing region pins no
/// backup; the memory still goes back and comes back, writable, at the same addresses.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_all_marked_moves_no_bytes() {
    let _lock = gpu_lock();
    let backend = gpu();
    for growing in [false, true] {
        let pager = Pager::new(backend.clone());
        let lens: Vec<usize> = (0..64)
            .map(|i| (16 * MIB / scale()) + i * 4099 + 1)
            .collect();
        let bufs = weights_of(&pager, &lens, growing);
        let ptrs: Vec<u64> = bufs.iter().map(|b| pager.ptr(b).unwrap()).collect();
        for b in &bufs {
            pager.fill(b, 0x5A5A_0101).unwrap();
            pager.mark_overwritten(b).unwrap();
        }
        let mapped = pager.region_stats("weights").unwrap().resident_bytes;
        for cycle in 0..2 {
            let before = free_bytes(&backend);
            let rel = pager.release(&["weights"]).unwrap();
            let r = rel.region("weights").unwrap();
            eprintln!("all marked, growing {growing}, cycle {cycle}: {rel}");
            assert_eq!(
                (r.copied, r.steps.hash, r.steps.copy),
                (0, Duration::ZERO, Duration::ZERO)
            );
            assert!(
                free_bytes(&backend) >= before + mapped - 64 * MIB,
                "memory goes back"
            );
            assert_eq!(pager.stats().backup_bytes(), 0, "nothing pinned");
            let res = pager.resume(&["weights"]).unwrap();
            assert_eq!(res.region("weights").unwrap().copied, 0);
            for (i, b) in bufs.iter().enumerate() {
                assert_eq!(pager.ptr(b).unwrap(), ptrs[i]);
                let pattern = 0x0102_0304 + i as u32;
                pager.fill(b, pattern).unwrap();
                let mut expect = vec![0u8; 256];
                reference::fill(&mut expect, pattern);
                assert_bytes_eq(
                    "writable after resume",
                    &read_at(&pager, b, 0, 256),
                    &expect,
                );
            }
        }
    }
}
