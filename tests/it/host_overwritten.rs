//! Update-aware release on the host backend: bytes marked "overwritten by the next update"
//! are neither saved nor restored; everything else comes back bit-exact. Runs in CI.

use crate::common;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use common::{Rng, read};
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Buffer, Error, Pager, PagerConfig, Policy, RegionOptions};

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;

/// A pager with `copy_gap` (0: copy exactly the unmarked bytes) and `verify_restore` on, so
/// every resume also checks what it restored against the backup.
fn setup(copy_gap: usize, granularity: usize) -> (Arc<HostBackend>, Pager) {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity: 256 * MIB,
        granularity,
    }));
    let pager = Pager::with_config(
        backend.clone(),
        PagerConfig {
            chunk_bytes: 4 * MIB,
            verify_restore: true,
            tuning: gpu_pager::Tuning {
                hash_chunk_bytes: 256 * KIB,
                copy_gap_bytes: copy_gap,
                // The first release saves exactly the unmarked bytes through the pump, as every
                // later one does (tests/host_first_save.rs covers the one-pass first backup).
                first_save_overlap: false,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    (backend, pager)
}

fn cycle(pager: &Pager, tag: &str) -> (usize, usize) {
    let rel = pager.release(&[tag]).unwrap();
    let res = pager.resume(&[tag]).unwrap();
    (
        rel.region(tag).unwrap().copied,
        res.region(tag).unwrap().copied,
    )
}

/// `n` buffers of `len` bytes (a multiple of 256: no alignment gaps between them), filled
/// with random bytes.
fn buffers(
    pager: &Pager,
    rng: &mut Rng,
    tag: &str,
    n: usize,
    len: usize,
) -> Vec<(Buffer, Vec<u8>)> {
    (0..n)
        .map(|_| {
            let b = pager.alloc(tag, len).unwrap();
            let d = rng.bytes(len);
            pager.write(&b, 0, &d).unwrap();
            (b, d)
        })
        .collect()
}

/// The marked buffer is writable after a resume and reads back what was written.
fn assert_writable(pager: &Pager, b: &Buffer, rng: &mut Rng) -> Vec<u8> {
    let d = rng.bytes(b.len());
    pager.write(b, 0, &d).unwrap();
    assert_eq!(
        read(pager, b),
        d,
        "a marked buffer is writable after resume"
    );
    d
}

#[test]
fn marked_buffers_are_neither_saved_nor_restored_and_the_rest_is_bit_exact() {
    let (_backend, pager) = setup(0, 64 * KIB);
    let mut rng = Rng::seeded("marked_buffers");
    pager.region("weights", 16 * MIB, Policy::Preserve).unwrap();
    let mut bufs = buffers(&pager, &mut rng, "weights", 6, 2 * MIB);
    let ptrs: Vec<u64> = bufs.iter().map(|(b, _)| pager.ptr(b).unwrap()).collect();
    for (b, _) in bufs.iter().skip(1).step_by(2) {
        pager.mark_overwritten(b).unwrap();
        assert_eq!(pager.overwritten(b).unwrap(), vec![0..2 * MIB]);
    }
    let s = pager.region_stats("weights").unwrap();
    assert_eq!(s.marked_bytes, 6 * MIB);

    for round in 0..3 {
        let (saved, restored) = cycle(&pager, "weights");
        assert_eq!(saved, if round == 0 { 6 * MIB } else { 0 }, "round {round}");
        assert_eq!(restored, 6 * MIB, "only the unmarked half comes back");
        let s = pager.region_stats("weights").unwrap();
        assert_eq!(s.held_bytes, 6 * MIB);
        for (i, (b, d)) in bufs.iter_mut().enumerate() {
            assert_eq!(pager.ptr(b).unwrap(), ptrs[i], "address unchanged");
            if i % 2 == 0 {
                assert!(read(&pager, b) == *d, "unmarked buffer {i} bit-exact");
            } else {
                *d = assert_writable(&pager, b, &mut rng);
            }
        }
    }
    // The marks persist until cleared; cleared, the next cycle saves and restores them.
    for (b, _) in bufs.iter().skip(1).step_by(2) {
        assert_eq!(pager.overwritten(b).unwrap().len(), 1);
        pager.unmark_overwritten(b).unwrap();
        assert!(pager.overwritten(b).unwrap().is_empty());
    }
    let (saved, restored) = cycle(&pager, "weights");
    assert_eq!((saved, restored), (6 * MIB, 12 * MIB));
    for (i, (b, d)) in bufs.iter().enumerate() {
        assert!(read(&pager, b) == *d, "buffer {i} bit-exact once unmarked");
    }
}

#[test]
fn all_marked_release_hashes_and_copies_nothing_and_pins_nothing() {
    let (backend, pager) = setup(0, 64 * KIB);
    let mut rng = Rng::seeded("all_marked");
    pager.region("weights", 8 * MIB, Policy::Preserve).unwrap();
    let bufs = buffers(&pager, &mut rng, "weights", 4, MIB + 512);
    for (b, _) in &bufs {
        pager.mark_overwritten(b).unwrap();
    }
    let rel = pager.release(&["weights"]).unwrap();
    let r = rel.region("weights").unwrap();
    assert_eq!(
        (r.copied, r.steps.hash, r.steps.copy),
        (0, Duration::ZERO, Duration::ZERO)
    );
    assert_eq!(r.steps.pin, Duration::ZERO);
    assert_eq!(backend.used_bytes(), 0, "unmapped");
    assert_eq!(
        pager.stats().backup_bytes(),
        0,
        "nothing to save: nothing pinned"
    );
    let res = pager.resume(&["weights"]).unwrap();
    assert_eq!(res.region("weights").unwrap().copied, 0);
    for (b, _) in &bufs {
        assert_writable(&pager, b, &mut rng);
    }
    // Nothing held: the backup may go even while released.
    pager.release(&["weights"]).unwrap();
    assert_eq!(pager.free_backup("weights").unwrap(), 0);
}

#[test]
fn sub_range_marks_inside_one_buffer() {
    let (_backend, pager) = setup(0, 64 * KIB);
    let mut rng = Rng::seeded("sub_range_marks");
    pager.region("weights", 8 * MIB, Policy::Preserve).unwrap();
    let mut bufs = buffers(&pager, &mut rng, "weights", 3, 2 * MIB);
    let (b, _) = &bufs[1];
    // Three tensors inside one segment: two marked, odd offsets and lengths.
    let marked: [Range<usize>; 2] = [1001..300_017, 1_000_003..2 * MIB - 77];
    for m in &marked {
        pager.set_overwritten(b, m.clone(), true).unwrap();
    }
    assert_eq!(pager.overwritten(b).unwrap(), marked.to_vec());
    let marked_bytes: usize = marked.iter().map(Range::len).sum();
    assert_eq!(
        pager.region_stats("weights").unwrap().marked_bytes,
        marked_bytes
    );
    // Marking a marked range again, or an overlapping one, merges.
    pager.set_overwritten(b, 2000..3000, true).unwrap();
    assert_eq!(pager.overwritten(b).unwrap(), marked.to_vec());

    let (saved, restored) = cycle(&pager, "weights");
    assert_eq!(saved, 6 * MIB - marked_bytes);
    assert_eq!(restored, saved);
    for (i, (buf, d)) in bufs.iter().enumerate() {
        let got = read(&pager, buf);
        for (at, (g, w)) in got.iter().zip(d).enumerate() {
            let is_marked = i == 1 && marked.iter().any(|m| m.contains(&at));
            if !is_marked {
                assert_eq!(g, w, "buffer {i} byte {at}");
            }
        }
    }
    // Writing the marked ranges (the update) and unmarking one: bit-exact again.
    let (b, d) = &mut bufs[1];
    for m in &marked {
        let fresh = rng.bytes(m.len());
        pager.write(b, m.start, &fresh).unwrap();
        d[m.clone()].copy_from_slice(&fresh);
    }
    pager.set_overwritten(b, marked[0].clone(), false).unwrap();
    assert_eq!(pager.overwritten(b).unwrap(), vec![marked[1].clone()]);
    // Unmarking part of a mark splits it.
    pager.set_overwritten(b, MIB..MIB + 10, false).unwrap();
    let split = vec![marked[1].start..MIB, MIB + 10..marked[1].end];
    assert_eq!(pager.overwritten(b).unwrap(), split);
    let (saved, _) = cycle(&pager, "weights");
    let still: usize = split.iter().map(Range::len).sum();
    // Buffer 1's hash chunks (256 KiB, aligned with it) all changed or had holes, but the
    // third (512..768 KiB), which held no mark and was not written: the rest is copied.
    assert_eq!(saved, 2 * MIB - still - 256 * KIB);
    let got = read(&pager, b);
    for (at, (g, w)) in got.iter().zip(d.iter()).enumerate() {
        if !split.iter().any(|m| m.contains(&at)) {
            assert_eq!(g, w, "byte {at} of the unmarked parts");
        }
    }
}

#[test]
fn a_freed_buffers_marks_go_and_a_new_buffer_there_is_unmarked() {
    let (_backend, pager) = setup(0, 64 * KIB);
    let mut rng = Rng::seeded("freed_marks");
    pager.region("weights", 8 * MIB, Policy::Preserve).unwrap();
    let bufs = buffers(&pager, &mut rng, "weights", 2, MIB);
    let (a, _) = &bufs[0];
    pager.mark_overwritten(a).unwrap();
    pager.free(a).unwrap();
    assert_eq!(pager.region_stats("weights").unwrap().marked_bytes, 0);
    assert!(matches!(
        pager.overwritten(a),
        Err(Error::StaleBuffer { .. })
    ));
    assert!(matches!(
        pager.mark_overwritten(a),
        Err(Error::StaleBuffer { .. })
    ));
    let again = pager.alloc("weights", MIB).unwrap();
    assert_eq!(
        again.offset(),
        a.offset(),
        "first fit takes the same offset"
    );
    assert!(pager.overwritten(&again).unwrap().is_empty());
    let d = rng.bytes(MIB);
    pager.write(&again, 0, &d).unwrap();
    let (saved, _) = cycle(&pager, "weights");
    assert_eq!(saved, 2 * MIB, "the new buffer is saved");
    assert!(read(&pager, &again) == d);
    assert!(read(&pager, &bufs[1].0) == bufs[1].1);
}

/// Skip-unchanged and marks: a hash chunk that held marked bytes at the last save has holes
/// in the backup. Unmarked again, its bytes must be saved even when the device holds exactly
/// what it held (a GPU's reused physical memory often does): the hash alone would say
/// "unchanged" and a resume would restore the holes' stale or missing bytes.
#[test]
fn unmarking_saves_again_even_when_the_hash_is_unchanged() {
    let (_backend, pager) = setup(0, 64 * KIB);
    let mut rng = Rng::seeded("unmark_hash");
    pager.region("weights", 8 * MIB, Policy::Preserve).unwrap();
    let bufs = buffers(&pager, &mut rng, "weights", 3, MIB);
    let (b, d) = &bufs[1];
    // A small mark inside one hash chunk: the chunk is hashed (it holds wanted bytes) and
    // saved with a hole.
    pager.set_overwritten(b, 1000..2000, true).unwrap();
    let (saved, _) = cycle(&pager, "weights");
    assert_eq!(saved, 3 * MIB - 1000);
    // The device holds the marked bytes' old values again, as reused memory may.
    pager.write(b, 0, d).unwrap();
    pager.unmark_overwritten(b).unwrap();
    // Release without changes: the unchanged chunks are skipped, the one with the hole is
    // not, although its hash matches.
    let rel = pager.release(&["weights"]).unwrap();
    assert_eq!(
        rel.region("weights").unwrap().copied,
        256 * KIB,
        "the chunk with the hole"
    );
    pager.resume(&["weights"]).unwrap();
    for (i, (buf, want)) in bufs.iter().enumerate() {
        assert!(read(&pager, buf) == *want, "buffer {i} bit-exact");
    }
    // And once more, with nothing changed at all: nothing to copy.
    let (saved, restored) = cycle(&pager, "weights");
    assert_eq!((saved, restored), (0, 3 * MIB));
    for (i, (buf, want)) in bufs.iter().enumerate() {
        assert!(read(&pager, buf) == *want, "buffer {i} bit-exact");
    }
    // Marked, released, resumed with new contents written, unmarked: the new ones come back.
    pager.mark_overwritten(b).unwrap();
    cycle(&pager, "weights");
    let fresh = rng.bytes(MIB);
    pager.write(b, 0, &fresh).unwrap();
    pager.unmark_overwritten(b).unwrap();
    let (saved, _) = cycle(&pager, "weights");
    assert_eq!(saved, MIB);
    assert!(read(&pager, b) == fresh);
}

#[test]
fn a_mark_set_while_released_takes_effect_at_the_next_release() {
    let (_backend, pager) = setup(0, 64 * KIB);
    let mut rng = Rng::seeded("mark_while_released");
    pager.region("weights", 8 * MIB, Policy::Preserve).unwrap();
    let bufs = buffers(&pager, &mut rng, "weights", 2, MIB);
    pager.release(&["weights"]).unwrap();
    pager.mark_overwritten(&bufs[0].0).unwrap();
    let res = pager.resume(&["weights"]).unwrap();
    assert_eq!(res.region("weights").unwrap().copied, 2 * MIB);
    for (b, d) in &bufs {
        assert!(
            read(&pager, b) == *d,
            "the resume restores what the release saved"
        );
    }
    let (saved, restored) = cycle(&pager, "weights");
    assert_eq!(
        (saved, restored),
        (0, MIB),
        "unchanged chunks skipped; the marked one not saved"
    );
    assert!(read(&pager, &bufs[1].0) == bufs[1].1);
}

#[test]
fn small_marked_gaps_are_copied_along_by_default() {
    let (_backend, pager) = setup(
        gpu_pager::PagerConfig::default().tuning.copy_gap_bytes,
        64 * KIB,
    );
    let mut rng = Rng::seeded("small_gaps");
    pager.region("weights", 16 * MIB, Policy::Preserve).unwrap();
    let bufs = buffers(&pager, &mut rng, "weights", 3, 2 * MIB);
    // A small marked tensor in the middle of a segment, and a marked buffer between two
    // unmarked ones, longer than the gap: the first is copied along, the second is not.
    pager
        .set_overwritten(&bufs[0].0, 1000..65_000, true)
        .unwrap();
    pager.mark_overwritten(&bufs[1].0).unwrap();
    let (saved, restored) = cycle(&pager, "weights");
    assert_eq!((saved, restored), (4 * MIB, 4 * MIB));
    assert!(
        read(&pager, &bufs[0].0) == bufs[0].1,
        "copied along, so restored too"
    );
    assert!(read(&pager, &bufs[2].0) == bufs[2].1);
}

#[test]
fn growing_regions_pin_no_backup_for_a_buffer_marked_whole() {
    let g = 2 * MIB;
    let (backend, pager) = setup(0, g);
    let mut rng = Rng::seeded("growing_marks");
    pager
        .region_with(
            "weights",
            0,
            Policy::Preserve,
            gpu_pager::RegionOptions::GROWING,
        )
        .unwrap();
    // Odd sizes: the padding up to the granularity is mapped and, unmarked, saved.
    let lens = [3 * MIB + 5, 5 * MIB - 3, MIB + 1];
    let mut bufs: Vec<(Buffer, Vec<u8>)> = lens
        .iter()
        .map(|&len| {
            let b = pager.alloc("weights", len).unwrap();
            let d = rng.bytes(len);
            pager.write(&b, 0, &d).unwrap();
            (b, d)
        })
        .collect();
    let extent = |len: usize| len.div_ceil(g) * g;
    pager.mark_overwritten(&bufs[1].0).unwrap();
    assert_eq!(
        pager.region_stats("weights").unwrap().marked_bytes,
        extent(lens[1]),
        "a whole mark covers the padding"
    );
    assert_eq!(pager.overwritten(&bufs[1].0).unwrap(), vec![0..lens[1]]);
    let half = lens[2] / 2;
    pager.set_overwritten(&bufs[2].0, 0..half, true).unwrap();
    let mapped: usize = lens.iter().map(|&l| extent(l)).sum();
    for round in 0..3 {
        let rel = pager.release(&["weights"]).unwrap();
        assert_eq!(backend.used_bytes(), 0);
        let saved = extent(lens[0]) + extent(lens[2]) - half;
        let copied = rel.region("weights").unwrap().copied;
        assert_eq!(copied, if round == 0 { saved } else { 0 }, "round {round}");
        let s = pager.region_stats("weights").unwrap();
        assert_eq!(
            s.backup_bytes,
            extent(lens[0]) + extent(lens[2]),
            "none for the marked one"
        );
        assert_eq!(s.held_bytes, saved);
        let res = pager.resume(&["weights"]).unwrap();
        assert_eq!(res.region("weights").unwrap().bytes, mapped);
        assert!(read(&pager, &bufs[0].0) == bufs[0].1);
        bufs[1].1 = assert_writable(&pager, &bufs[1].0, &mut rng);
        let got = read(&pager, &bufs[2].0);
        assert!(
            got[half..] == bufs[2].1[half..],
            "the unmarked half bit-exact"
        );
    }
    // Unmarked, the buffer gets a backup at the next release and comes back bit-exact.
    pager.unmark_overwritten(&bufs[1].0).unwrap();
    pager
        .set_overwritten(&bufs[2].0, 0..lens[2], false)
        .unwrap();
    let d2 = rng.bytes(lens[2]);
    pager.write(&bufs[2].0, 0, &d2).unwrap();
    bufs[2].1 = d2;
    cycle(&pager, "weights");
    assert_eq!(pager.region_stats("weights").unwrap().backup_bytes, mapped);
    for (i, (b, d)) in bufs.iter().enumerate() {
        assert!(read(&pager, b) == *d, "buffer {i} bit-exact once unmarked");
    }
}

#[test]
fn marks_on_discard_regions_are_accepted_and_change_nothing() {
    let (_backend, pager) = setup(0, 64 * KIB);
    pager.region("kv", 4 * MIB, Policy::Discard).unwrap();
    pager
        .region("graph", 4 * MIB, Policy::DiscardZeroed)
        .unwrap();
    let kv = pager.alloc("kv", MIB).unwrap();
    let graph = pager.alloc("graph", MIB).unwrap();
    pager.mark_overwritten(&kv).unwrap();
    pager.set_overwritten(&graph, 10..20, true).unwrap();
    pager.fill(&graph, 0x0101_0101).unwrap();
    let (saved, restored) = cycle(&pager, "graph");
    assert_eq!((saved, restored), (0, 0));
    assert!(
        read(&pager, &graph).iter().all(|&x| x == 0),
        "still zero-filled"
    );
    cycle(&pager, "kv");
    assert_eq!(pager.overwritten(&kv).unwrap(), vec![0..MIB]);
}

#[test]
fn bad_marks_are_typed_errors() {
    let (_backend, pager) = setup(0, 64 * KIB);
    pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    let b = pager.alloc("weights", 1000).unwrap();
    for range in [0..1001, 999..2000, 1001..1001] {
        match pager.set_overwritten(&b, range.clone(), true) {
            Err(Error::OutOfRange {
                tag, what, size, ..
            }) => {
                assert_eq!((tag.as_str(), what, size), ("weights", "buffer", 1000));
            }
            other => panic!("{range:?}: expected OutOfRange, got {other:?}"),
        }
    }
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 10..5;
    assert!(matches!(
        pager.set_overwritten(&b, backwards, true),
        Err(Error::InvalidArgument { .. })
    ));
    pager.set_overwritten(&b, 1000..1000, true).unwrap();
    assert!(
        pager.overwritten(&b).unwrap().is_empty(),
        "an empty range marks nothing"
    );
    pager.mark_overwritten(&b).unwrap();
    pager.release(&["weights"]).unwrap();
    pager.remove("weights").unwrap();
    let e = pager.mark_overwritten(&b).unwrap_err();
    assert!(matches!(e, Error::StaleBuffer { .. }), "{e:?}");
    assert!(e.to_string().contains("weights"), "{e}");
    // A buffer of an earlier region under the same tag is stale in the new one.
    pager.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    let e = pager.unmark_overwritten(&b).unwrap_err();
    assert!(matches!(e, Error::StaleBuffer { .. }), "{e:?}");
    assert!(e.to_string().contains("free each buffer once") || e.to_string().contains("weights"));
}

#[test]
fn prepinned_regions_keep_their_backup_when_everything_is_marked() {
    let (_backend, pager) = setup(0, 64 * KIB);
    let opts = RegionOptions {
        prepin: true,
        ..RegionOptions::default()
    };
    pager
        .region_with("weights", 4 * MIB, Policy::Preserve, opts)
        .unwrap();
    let b = pager.alloc("weights", MIB).unwrap();
    pager.mark_overwritten(&b).unwrap();
    let (saved, restored) = cycle(&pager, "weights");
    assert_eq!((saved, restored), (0, 0));
    let s = pager.region_stats("weights").unwrap();
    assert_eq!((s.backup_bytes, s.held_bytes), (4 * MIB, 0));
}
