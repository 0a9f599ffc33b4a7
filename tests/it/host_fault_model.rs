//! Property test: update-aware release through the copy pump with injected faults. A fixed
//! and a growing `Preserve` region (hashes on, so a release skips unchanged chunks) go
//! through random alloc / free / write / mark / release / resume sequences while copies,
//! maps and pinning fail at random points, first backups pinned and filled in one pass or
//! not (`first_save_overlap`, switched at random), backed up in pinned memory, in host memory
//! given back after each resume, or in a file (chosen at random). A failed release must leave everything resident
//! and intact (unless mapping back what it had unmapped beside its copies failed too: that
//! region is released), a failed resume everything released with its backup intact, and every byte
//! that was not marked at the last release must read back bit-exact after every step.

use crate::common;
use std::collections::BTreeMap;
use std::sync::Arc;

use gpu_pager::backend::Backend;
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Buffer, CopyRoute, Medium, Pager, PagerConfig, Policy};
use gpu_pager_testkit::{FaultPlan, FaultPoint, FaultyBackend};
use proptest::prelude::*;

const KIB: usize = 1 << 10;
const G: usize = 64 * KIB;
/// (tag, bytes): a fixed region, and a growing one (0 bytes).
const TAGS: [(&str, usize); 2] = [("fixed", 512 * KIB), ("grow", 0)];

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        tag: usize,
        len: usize,
    },
    Free {
        pick: usize,
    },
    Write {
        pick: usize,
        seed: u8,
        a: usize,
        b: usize,
    },
    Mark {
        pick: usize,
        a: usize,
        b: usize,
        on: bool,
    },
    Release {
        mask: u8,
    },
    Resume {
        mask: u8,
    },
    /// The `after + 1`-th next call at `point` fails.
    Fault {
        point: usize,
        after: u64,
    },
    FreeBackup {
        tag: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, 1..200_000usize).prop_map(|(tag, len)| Op::Alloc { tag, len }),
        1 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        3 => (any::<usize>(), 0..3u8, any::<usize>(), any::<usize>())
            .prop_map(|(pick, seed, a, b)| Op::Write { pick, seed, a, b }),
        3 => (any::<usize>(), any::<usize>(), any::<usize>(), any::<bool>())
            .prop_map(|(pick, a, b, on)| Op::Mark { pick, a, b, on }),
        3 => (1..4u8).prop_map(|mask| Op::Release { mask }),
        3 => (1..4u8).prop_map(|mask| Op::Resume { mask }),
        3 => (0..4usize, 0..6u64).prop_map(|(point, after)| Op::Fault { point, after }),
        1 => (0..2usize).prop_map(|tag| Op::FreeBackup { tag }),
    ]
}

struct ModelBuf {
    tag: &'static str,
    buf: Buffer,
    data: Vec<u8>,
    known: Vec<bool>,
    marked: Vec<bool>,
    /// Marks as of the last successful release of its region.
    marked_at_release: Vec<bool>,
}

fn tags_of(mask: u8) -> Vec<&'static str> {
    (0..2)
        .filter(|i| mask & (1 << i) != 0)
        .map(|i| TAGS[i].0)
        .collect()
}

fn pattern(seed: u8, at: usize, len: usize) -> Vec<u8> {
    (at..at + len)
        .map(|i| (i as u8).wrapping_mul(37) ^ seed.wrapping_mul(101) ^ ((i >> 8) as u8))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn faults_never_lose_unmarked_bytes(
        ops in proptest::collection::vec(op(), 1..50),
        gap in prop_oneof![Just(0usize), Just(1usize << 20), 0..8192usize],
        route in prop_oneof![
            Just(CopyRoute::Engine),
            Just(CopyRoute::Kernel),
            Just(CopyRoute::Fastest)
        ],
        // First backups pinned and filled in one pass, or pinned and then saved through
        // the pump.
        first_save_overlap in any::<bool>(),
        // Every backup medium: pinned memory, host memory given back after each resume, a
        // file (through the staging buffer).
        medium in prop_oneof![Just(Medium::Pinned), Just(Medium::Host), Just(Medium::File)],
    ) {
        check(ops, gap, route, first_save_overlap, medium)?;
    }
}

/// Writes through the wrapped backend (faults are for the pager's moves only).
fn put(
    host: &HostBackend,
    pager: &Pager,
    buf: &Buffer,
    at: usize,
    data: &[u8],
) -> gpu_pager::Result<()> {
    let p = pager.ptr(buf)?;
    // SAFETY: inside a live buffer of a resident region; nothing else runs meanwhile.
    unsafe { host.copy_to_device(p + at as u64, data) }.unwrap();
    Ok(())
}

/// Reads a whole buffer through the wrapped backend.
fn get(host: &HostBackend, pager: &Pager, buf: &Buffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.len()];
    let p = pager.ptr(buf).unwrap();
    // SAFETY: as in `put`.
    unsafe { host.copy_to_host(&mut out, p) }.unwrap();
    out
}

fn check(
    ops: Vec<Op>,
    gap: usize,
    route: CopyRoute,
    first_save_overlap: bool,
    medium: Medium,
) -> Result<(), TestCaseError> {
    let host = Arc::new(HostBackend::new(HostConfig {
        capacity: 4 << 20,
        granularity: G,
    }));
    let faulty = Arc::new(FaultyBackend::new(host.clone(), FaultPlan::none()));
    let pager = Pager::with_config(
        faulty.clone(),
        PagerConfig {
            chunk_bytes: 128 * KIB,
            skip_unchanged: true,
            restore_route: route,
            save_route: route,
            tuning: gpu_pager::Tuning {
                discard_chunk_bytes: 128 * KIB,
                hash_chunk_bytes: 16 * KIB,
                copy_gap_bytes: gap,
                copy_unit_bytes: 4096,
                first_save_overlap,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    );
    let files = (medium == Medium::File).then(|| {
        let dir =
            std::env::temp_dir().join(format!("gpu-pager-fault-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    });
    if let Some(dir) = &files {
        pager
            .set_backup_files(dir, gpu_pager::BackupFiles::Unnamed)
            .unwrap();
    }
    for (tag, bytes) in TAGS {
        common::table_region(
            &pager,
            tag,
            bytes,
            Policy::Preserve,
            gpu_pager::RegionOptions {
                medium,
                ..Default::default()
            },
        )
        .unwrap();
    }
    let mut resident: BTreeMap<&str, bool> = TAGS.iter().map(|t| (t.0, true)).collect();
    let mut bufs: Vec<ModelBuf> = Vec::new();

    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::Alloc { tag, len } => {
                let t = TAGS[tag].0;
                if let Ok(buf) = pager.alloc(t, len) {
                    let mut m = ModelBuf {
                        tag: t,
                        data: vec![0; len],
                        known: vec![false; len],
                        marked: vec![false; len],
                        marked_at_release: vec![false; len],
                        buf,
                    };
                    if resident[t] {
                        m.data = pattern(7, step, len);
                        put(&host, &pager, &m.buf, 0, &m.data).unwrap();
                        m.known = vec![true; len];
                    }
                    bufs.push(m);
                }
            }
            Op::Free { pick } => {
                if !bufs.is_empty() {
                    let m = bufs.swap_remove(pick % bufs.len());
                    pager.free(&m.buf).unwrap();
                }
            }
            Op::Write { pick, seed, a, b } => {
                if bufs.is_empty() {
                    continue;
                }
                let n = bufs.len();
                let m = &mut bufs[pick % n];
                let len = m.data.len();
                let (a, b) = (a % len, b % (len + 1));
                let (a, b) = (a.min(b), a.max(b));
                let data = pattern(seed, a, b - a);
                let r = put(&host, &pager, &m.buf, a, &data);
                if resident[m.tag] {
                    r.unwrap();
                    m.data[a..b].copy_from_slice(&data);
                    m.known[a..b].fill(true);
                } else {
                    prop_assert!(r.is_err());
                }
            }
            Op::Mark { pick, a, b, on } => {
                if bufs.is_empty() {
                    continue;
                }
                let n = bufs.len();
                let m = &mut bufs[pick % n];
                let len = m.data.len();
                let (a, b) = (a % len, b % (len + 1));
                let (a, b) = (a.min(b), a.max(b));
                pager.set_overwritten(&m.buf, a..b, on).unwrap();
                m.marked[a..b].fill(on);
            }
            Op::Release { mask } => {
                let tags = tags_of(mask);
                let back_faults = |f: gpu_pager_testkit::FaultCounts| f.map + f.copy_to_device;
                let before = back_faults(faulty.injected());
                if pager.release(&tags).is_ok() {
                    for m in bufs.iter_mut().filter(|m| tags.contains(&m.tag)) {
                        if resident[m.tag] {
                            m.marked_at_release = m.marked.clone();
                        }
                    }
                    for t in &tags {
                        resident.insert(t, false);
                    }
                } else {
                    // A release maps and copies to the device only to map back what it
                    // unmapped beside its copies before it failed; where that fails too, the
                    // region is left released with what it saved (the model forgets its
                    // bytes).
                    let mapping_back_failed = back_faults(faulty.injected()) > before;
                    for t in &tags {
                        let now = pager.info(t).unwrap().state == gpu_pager::State::Resident;
                        if mapping_back_failed && resident[t] && !now {
                            resident.insert(t, false);
                            for m in bufs.iter_mut().filter(|m| m.tag == *t) {
                                m.known.fill(false);
                            }
                            continue;
                        }
                        prop_assert_eq!(now, resident[t]);
                    }
                }
            }
            Op::Resume { mask } => {
                let tags = tags_of(mask);
                if pager.resume(&tags).is_ok() {
                    for m in bufs.iter_mut().filter(|m| tags.contains(&m.tag)) {
                        if !resident[m.tag] {
                            for i in 0..m.known.len() {
                                if m.marked_at_release[i] {
                                    m.known[i] = false;
                                }
                            }
                        }
                    }
                    for t in &tags {
                        resident.insert(t, true);
                    }
                } else {
                    for t in &tags {
                        prop_assert_eq!(
                            pager.info(t).unwrap().state == gpu_pager::State::Resident,
                            resident[t]
                        );
                    }
                }
            }
            Op::Fault { point, after } => {
                faulty.fail_after(FaultPoint::ALL[point], after);
            }
            Op::FreeBackup { tag } => {
                let _ = pager.free_backup(TAGS[tag].0);
            }
        }
        for m in &bufs {
            if !resident[m.tag] {
                continue;
            }
            let got = get(&host, &pager, &m.buf);
            for i in 0..got.len() {
                if m.known[i] {
                    prop_assert_eq!(
                        got[i],
                        m.data[i],
                        "step {} tag {} byte {} of {}",
                        step,
                        m.tag,
                        i,
                        got.len()
                    );
                }
            }
        }
    }
    Ok(())
}

/// The fault injector forwards every backend method it does not fault: the audit through it
/// still names the processes on the device (it answered none while the trait had defaults).
#[test]
fn the_faulty_backend_forwards_the_process_list() {
    let host = Arc::new(HostBackend::new(HostConfig {
        capacity: 8 << 20,
        granularity: 64 << 10,
    }));
    let faulty = FaultyBackend::new(host.clone(), FaultPlan::none());
    assert_eq!(faulty.processes(), host.processes());
    assert!(faulty.processes().is_some());
}
