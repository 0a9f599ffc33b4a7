//! Growing regions on a real GPU: 300 odd-sized buffers cycled bit-exact, memory really
//! returned on release and on free, OOM on alloc and on resume rolled back against a real
//! allocation, backups pinned in batches as buffers come and go, a first release that pins
//! and copies them in one pass.
//!
//! Every test is `#[ignore = "needs a CUDA GPU"]` and fails (never passes) without one.

use crate::common;

use common::{Rng, assert_bytes_eq, free_bytes, gpu, gpu_lock, scale};
use gpu_pager::backend::Backend;

use gpu_pager::{Buffer, Error, Pager, Policy, State};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

fn hash(pager: &Pager, b: &Buffer) -> u64 {
    pager
        .hash(b, b.len().next_multiple_of(16))
        .expect("chunk_hash")[0]
}

/// 300 odd-sized buffers (a few KiB to ~50 MiB) in a growing Preserve region, three
/// cycles: contents bit-exact, addresses unchanged, free device memory rises by the mapped
/// bytes on release and falls back on resume; a free returns its buffer's memory.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_growing_preserve_region_of_300_buffers() {
    let _lock = gpu_lock();
    let backend = gpu();
    let g = backend.info().granularity;
    let pager = Pager::new(backend.clone());
    let info = pager
        .region_with(
            "weights",
            0,
            Policy::Preserve,
            gpu_pager::RegionOptions::GROWING,
        )
        .unwrap();
    assert!((info.kind == gpu_pager::RegionKind::Growing));
    let mut rng = Rng::seeded("gpu_growing_preserve_region_of_300_buffers");
    let start_free = free_bytes(&backend);
    let mut bufs = Vec::new();
    let mut mapped = 0;
    for i in 0..300 {
        let len = 1 + rng.next_u64() as usize % (48 * MIB / scale()) + i * 4099;
        let b = pager.alloc("weights", len).unwrap();
        mapped += len.next_multiple_of(g);
        pager.fill(&b, rng.next_u64() as u32).unwrap();
        bufs.push(b);
    }
    // Random bytes from the host in every 17th buffer (read back whole), hashes for all.
    let random: Vec<(usize, Vec<u8>)> = (0..300)
        .step_by(17)
        .map(|i| (i, rng.bytes(bufs[i].len())))
        .collect();
    for (i, d) in &random {
        pager.write(&bufs[*i], 0, d).unwrap();
    }
    assert_eq!(
        pager.region_stats("weights").unwrap().resident_bytes,
        mapped
    );
    let used = start_free - free_bytes(&backend);
    assert!(
        used >= mapped && used < mapped + 512 * MIB,
        "mapped {mapped}, device use grew by {used}"
    );
    let want: Vec<u64> = bufs.iter().map(|b| hash(&pager, b)).collect();
    let ptrs: Vec<u64> = bufs.iter().map(|b| pager.ptr(b).unwrap()).collect();
    for cycle in 0..3 {
        let before = free_bytes(&backend);
        let rep = pager.release(&["weights"]).unwrap();
        assert_eq!(rep.bytes(), mapped);
        let after = free_bytes(&backend);
        assert!(
            after >= before + mapped - 64 * MIB,
            "cycle {cycle}: free memory rose by {} of {mapped} released",
            after.saturating_sub(before)
        );
        assert!(matches!(
            pager.ptr(&bufs[0]),
            Err(Error::NotResident { .. })
        ));
        pager.resume(&["weights"]).unwrap();
        for (k, b) in bufs.iter().enumerate() {
            assert_eq!(pager.ptr(b).unwrap(), ptrs[k], "address of buffer {k}");
            assert_eq!(hash(&pager, b), want[k], "cycle {cycle}: buffer {k}");
        }
        for (i, d) in &random {
            let mut got = vec![0u8; d.len()];
            pager.read(&bufs[*i], 0, &mut got).unwrap();
            assert_bytes_eq(&format!("cycle {cycle}: buffer {i}"), &got, d);
        }
    }
    let last = bufs.pop().unwrap();
    let before = free_bytes(&backend);
    pager.free(&last).unwrap();
    let back = last.len().next_multiple_of(g);
    assert!(
        free_bytes(&backend) + 2 * MIB >= before + back,
        "a free returns the buffer's memory"
    );
}

/// OOM on alloc maps nothing new; OOM on resume leaves the region released with its
/// backup; both succeed once the real allocation standing in for the trainer is gone.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_growing_oom_on_alloc_and_resume_rolls_back() {
    let _lock = gpu_lock();
    let backend = gpu();
    let pager = Pager::new(backend.clone());
    pager
        .region_with(
            "weights",
            0,
            Policy::Preserve,
            gpu_pager::RegionOptions::GROWING,
        )
        .unwrap();
    pager
        .region_with(
            "kv_cache",
            0,
            Policy::Discard,
            gpu_pager::RegionOptions::GROWING,
        )
        .unwrap();
    let w = pager.alloc("weights", 2 * GIB / scale() + 12345).unwrap();
    let mut rng = Rng::seeded("gpu_growing_oom");
    let data = rng.bytes(32 * MIB + 5);
    pager.fill(&w, 0xABCD_1234).unwrap();
    pager.write(&w, 77, &data).unwrap();
    let want = hash(&pager, &w);
    let kv = pager.alloc("kv_cache", 6 * GIB / scale()).unwrap();

    // A real allocation takes all but 1 GiB: a 3 GiB alloc must fail and map nothing.
    let ctx = backend.context();
    ctx.bind_to_thread().unwrap();
    let hog_bytes = free_bytes(&backend) - GIB;
    // SAFETY: a plain device allocation, freed below.
    let hog = unsafe { cudarc::driver::result::malloc_sync(hog_bytes) }.unwrap();
    let before = free_bytes(&backend);
    let e = pager.alloc("kv_cache", 3 * GIB).unwrap_err();
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
    assert!(
        free_bytes(&backend) + 4 * MIB >= before,
        "the failed alloc leaked"
    );
    assert_eq!(pager.region_stats("kv_cache").unwrap().buffers, 1);
    // SAFETY: freed once.
    unsafe { cudarc::driver::result::free_sync(hog) }.unwrap();

    pager.release(&["weights", "kv_cache"]).unwrap();
    // Room for the weights and half of the KV cache: stage 1 fits, both do not.
    let hog_bytes = free_bytes(&backend) - (2 * GIB / scale() + 3 * GIB / scale() + 64 * MIB);
    // SAFETY: a plain device allocation, freed below.
    let hog = unsafe { cudarc::driver::result::malloc_sync(hog_bytes) }.unwrap();
    let before = free_bytes(&backend);
    let e = pager.resume(&["weights", "kv_cache"]).unwrap_err();
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
    assert!(
        free_bytes(&backend) + 4 * MIB >= before,
        "the failed resume leaked"
    );
    assert_eq!(pager.info("weights").unwrap().state, State::Released);
    pager.resume(&["weights"]).unwrap(); // stage 1 fits
    assert_eq!(hash(&pager, &w), want);
    // SAFETY: freed once.
    unsafe { cudarc::driver::result::free_sync(hog) }.unwrap();
    pager.resume(&["kv_cache"]).unwrap();
    assert!(pager.ptr(&kv).is_ok());
    let mut got = vec![0u8; data.len()];
    pager.read(&w, 77, &mut got).unwrap();
    assert_bytes_eq("weights after the retry", &got, &data);
}

/// A growing Preserve region of odd buffers whose backups are pinned in batches (one mapping,
/// one registration per buffer; with `first_save_overlap`, the default, filled as they are
/// pinned: `alloc_pinned_many_from_device`): cycles bit-exact while buffers are freed (their backups, slices of a live batch, dropped) and
/// allocated (pinned in a second batch) between cycles, and after the backups are freed
/// and pinned again in one batch; no deferred error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_growing_backups_pinned_in_batches_cycle_bit_exact() {
    let _lock = gpu_lock();
    let backend = gpu();
    let g = backend.info().granularity;
    let pager = Pager::new(backend.clone());
    pager
        .region_with("w", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    let mut rng = Rng::seeded("gpu_growing_backups_pinned_in_batches_cycle_bit_exact");
    let mut bufs: Vec<(Buffer, Vec<u8>)> = Vec::new();
    let add = |pager: &Pager, rng: &mut Rng, bufs: &mut Vec<(Buffer, Vec<u8>)>, n: usize| {
        for i in 0..n {
            let len = 1 + rng.next_u64() as usize % (6 * MIB / scale()) + i * 4099;
            let b = pager.alloc("w", len).unwrap();
            let data = rng.bytes(len);
            pager.write(&b, 0, &data).unwrap();
            bufs.push((b, data));
        }
    };
    let check = |pager: &Pager, bufs: &[(Buffer, Vec<u8>)], when: &str| {
        for (k, (b, d)) in bufs.iter().enumerate() {
            let mut got = vec![0u8; d.len()];
            pager.read(b, 0, &mut got).unwrap();
            assert_bytes_eq(&format!("{when}: buffer {k}"), &got, d);
        }
    };
    let backups = |pager: &Pager| pager.region_stats("w").unwrap().backup_bytes;
    let extents = |bufs: &[(Buffer, Vec<u8>)]| -> usize {
        bufs.iter().map(|(b, _)| b.len().next_multiple_of(g)).sum()
    };
    add(&pager, &mut rng, &mut bufs, 40);

    let rep = pager.release(&["w"]).unwrap();
    eprintln!("first release: {:?}", rep.region("w").map(|r| r.steps));
    assert_eq!(backups(&pager), extents(&bufs), "one backup per buffer");
    pager.resume(&["w"]).unwrap();
    check(&pager, &bufs, "first cycle");

    for cycle in 0..2 {
        // Free every third buffer (its backup, a slice of a live batch, goes), add new ones
        // (pinned in a new batch at the next release), update a few.
        let mut k = 0;
        bufs.retain(|(b, _)| {
            k += 1;
            if k % 3 == 0 {
                pager.free(b).unwrap();
            }
            k % 3 != 0
        });
        add(&pager, &mut rng, &mut bufs, 7);
        for (b, d) in bufs.iter_mut().step_by(5) {
            rng.fill(d);
            pager.write(b, 0, d).unwrap();
        }
        pager.release(&["w"]).unwrap();
        assert_eq!(backups(&pager), extents(&bufs), "cycle {cycle}");
        pager.resume(&["w"]).unwrap();
        check(&pager, &bufs, &format!("cycle {cycle}"));
    }

    // Nothing new: nothing pinned.
    let rep = pager.release(&["w"]).unwrap();
    assert_eq!(
        rep.region("w").map(|r| r.steps.pin),
        Some(std::time::Duration::ZERO)
    );
    pager.resume(&["w"]).unwrap();
    check(&pager, &bufs, "without pinning");

    // Backups freed: the next release pins them all again, in one batch.
    pager.free_backup("w").unwrap();
    assert_eq!(backups(&pager), 0);
    pager.release(&["w"]).unwrap();
    assert_eq!(backups(&pager), extents(&bufs));
    pager.resume(&["w"]).unwrap();
    check(&pager, &bufs, "after free_backup");
    drop(pager);
    assert_eq!(
        backend.deferred_errors().total(),
        0,
        "{:?}",
        backend.deferred_errors().take()
    );
}

/// A growing Preserve region's first release without `prepin` on the GPU, with
/// `first_save_overlap` (the default) and without: with it, the missing backups are pinned
/// and filled in one batch (`alloc_pinned_many_from_device`, here in 6 MiB parts, so that
/// parts hold several buffers and a larger buffer is a part of its own), the report counts
/// every extent once and the pump moves nothing; without it, the pump copies everything.
/// Either way: the resume (verified) and a `resume_on` a stream are bit-exact at unchanged
/// addresses, an unchanged release copies nothing, new buffers are pinned and filled in a
/// second batch while a changed old one goes through the pump, and after `free_backup` the
/// whole region again in one batch; no deferred error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_growing_first_release_pins_and_copies_in_one_pass_bit_exact() {
    use gpu_pager::PagerConfig;
    use gpu_pager::backend::RawStream;
    let _lock = gpu_lock();
    let backend = gpu();
    backend.set_first_backup_piece_bytes(6 * MIB);
    let g = backend.info().granularity;
    let mut rng = Rng::seeded("gpu_growing_first_release_pins_and_copies_in_one_pass");
    for overlap in [true, false] {
        let what = format!("first_save_overlap {overlap}");
        let pager = Pager::with_config(
            backend.clone(),
            PagerConfig {
                verify_restore: true,
                tuning: gpu_pager::Tuning {
                    first_save_overlap: overlap,
                    ..gpu_pager::Tuning::default()
                },
                ..PagerConfig::default()
            },
        );
        pager
            .region_with("w", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
            .unwrap();
        let add = |rng: &mut Rng, bufs: &mut Vec<(Buffer, Vec<u8>)>, lens: &[usize]| {
            for &len in lens {
                let b = pager.alloc("w", len).unwrap();
                let data = rng.bytes(len);
                pager.write(&b, 0, &data).unwrap();
                bufs.push((b, data));
            }
        };
        let check = |bufs: &[(Buffer, Vec<u8>)], when: &str| {
            for (k, (b, d)) in bufs.iter().enumerate() {
                let mut got = vec![0u8; d.len()];
                pager.read(b, 0, &mut got).unwrap();
                assert_bytes_eq(&format!("{what}, {when}: buffer {k}"), &got, d);
            }
        };
        let extents = |bufs: &[(Buffer, Vec<u8>)]| -> usize {
            bufs.iter().map(|(b, _)| b.len().next_multiple_of(g)).sum()
        };
        let mut bufs = Vec::new();
        let mut lens = vec![1, 4097, 3 * MIB + 5, 13 * MIB + 1, 2 * MIB, 5];
        lens.extend((0..24).map(|i| 1 + rng.next_u64() as usize % (5 * MIB / scale()) + i));
        lens.push(40 * MIB / scale() + 4095);
        add(&mut rng, &mut bufs, &lens);
        let ptrs: Vec<u64> = bufs.iter().map(|(b, _)| pager.ptr(b).unwrap()).collect();
        let all = extents(&bufs);

        let r = pager.release(&["w"]).unwrap();
        eprintln!("{what}: {r}");
        let w = r.region("w").unwrap();
        assert_eq!(w.copied, all, "{what}: every extent once");
        let pumped = if overlap { 0 } else { all };
        assert_eq!(r.copies.total_bytes(), pumped, "{what}");
        let s = pager.region_stats("w").unwrap();
        assert_eq!((s.backup_bytes, s.held_bytes), (all, all), "{what}");
        let r = pager.resume(&["w"]).unwrap();
        assert_eq!(r.region("w").unwrap().copied, all, "{what}");
        for (k, (b, _)) in bufs.iter().enumerate() {
            assert_eq!(pager.ptr(b).unwrap(), ptrs[k], "{what}: buffer {k} moved");
        }
        check(&bufs, "resumed");

        // Unchanged: nothing copied; then a resume on a stream.
        let r = pager.release(&["w"]).unwrap();
        assert_eq!(r.region("w").unwrap().copied, 0, "{what}: unchanged");
        pager.resume_on(&["w"], RawStream(0)).unwrap();
        backend.synchronize().unwrap();
        check(&bufs, "resume_on");

        // Three new buffers (a second batch), one old one changed (through the pump).
        let fresh = rng.bytes(bufs[3].1.len());
        pager.write(&bufs[3].0, 0, &fresh).unwrap();
        bufs[3].1 = fresh;
        let old = bufs.len();
        add(&mut rng, &mut bufs, &[7, 7 * MIB + 3, g]);
        let new = extents(&bufs[old..]);
        let r = pager.release(&["w"]).unwrap();
        let copied = r.region("w").unwrap().copied;
        assert!(copied >= new + bufs[3].1.len(), "{what}: {copied}");
        if overlap {
            assert_eq!(
                r.copies.total_bytes(),
                copied - new,
                "{what}: old ones pumped"
            );
        } else {
            assert_eq!(r.copies.total_bytes(), copied, "{what}");
        }
        pager.resume(&["w"]).unwrap();
        check(&bufs, "after new buffers");

        // Backups freed: all of them again, in one batch with the switch on.
        pager.free_backup("w").unwrap();
        let r = pager.release(&["w"]).unwrap();
        assert_eq!(r.region("w").unwrap().copied, extents(&bufs), "{what}");
        if overlap {
            assert_eq!(r.copies.total_bytes(), 0, "{what}: after free_backup");
        }
        pager.resume(&["w"]).unwrap();
        check(&bufs, "after free_backup");
        pager.remove("w").unwrap();
        assert!(pager.take_deferred_errors().is_empty(), "{what}");
    }
    assert_eq!(backend.deferred_errors().total(), 0);
}
