//! Property test of growing regions (created with 0 bytes) on the host backend: random
//! allocs, frees, writes, releases, resumes (some under memory pressure), trims and holds,
//! against a model. After every step the mapped bytes are exactly the granules under live
//! buffers (none while released), device memory in use is exactly that plus what is held,
//! and every `Preserve` buffer reads back bit-exact, but for the bytes marked overwritten at
//! the last release (undefined after the resume, yet mapped and writable).

use crate::common;

use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Buffer, Error, Pager, PagerConfig, Policy};
use gpu_pager_testkit::Hog;
use proptest::prelude::*;

const KIB: usize = 1 << 10;
const G: usize = 64 * KIB;
const CAPACITY: usize = 2048 * KIB;
const TAGS: [(&str, Policy); 3] = [
    ("weights", Policy::Preserve),
    ("kv_cache", Policy::Discard),
    ("graph", Policy::DiscardZeroed),
];

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
    },
    Release {
        tag: usize,
    },
    Resume {
        tag: usize,
    },
    Hold {
        kib: usize,
    },
    Unhold,
    Trim {
        tag: usize,
    },
    /// Marks (`on`) or unmarks bytes `a % len .. b % (len + 1)` (ordered) of a buffer.
    Mark {
        pick: usize,
        a: usize,
        b: usize,
        on: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 1..300_000usize).prop_map(|(tag, len)| Op::Alloc { tag, len }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        // Few distinct seeds: rewriting what a buffer held before a cycle (as reused device
        // memory may hold it) must not fool the skip-unchanged hashes.
        3 => (any::<usize>(), prop_oneof![0..3u8, any::<u8>()])
            .prop_map(|(pick, seed)| Op::Write { pick, seed }),
        2 => (0..3usize).prop_map(|tag| Op::Release { tag }),
        2 => (0..3usize).prop_map(|tag| Op::Resume { tag }),
        1 => (0..2048usize).prop_map(|kib| Op::Hold { kib }),
        1 => Just(Op::Unhold),
        1 => (0..3usize).prop_map(|tag| Op::Trim { tag }),
        3 => (any::<usize>(), any::<usize>(), any::<usize>(), any::<bool>())
            .prop_map(|(pick, a, b, on)| Op::Mark { pick, a, b, on }),
    ]
}

struct ModelBuf {
    buf: Buffer,
    tag: usize,
    /// Contents, where `known`.
    data: Vec<u8>,
    /// Which bytes are known (false: undefined, e.g. Discard after a cycle, or marked
    /// overwritten at the last release).
    known: Vec<bool>,
    /// Which bytes are marked overwritten now.
    marked: Vec<bool>,
    addr: u64,
}

impl ModelBuf {
    fn set(&mut self, data: Option<Vec<u8>>) {
        let len = self.buf.len();
        self.known = vec![data.is_some(); len];
        self.data = data.unwrap_or_else(|| vec![0; len]);
    }

    /// Marked bytes as the region counts them: a mark reaching the buffer's end covers its
    /// padding up to the granularity too.
    fn marked_bytes(&self) -> usize {
        let len = self.buf.len();
        let pad = if self.marked[len - 1] {
            granules(len) - len
        } else {
            0
        };
        self.marked.iter().filter(|m| **m).count() + pad
    }
}

fn granules(len: usize) -> usize {
    len.div_ceil(G) * G
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn growing_regions_match_the_model(
        ops in proptest::collection::vec(op(), 1..70),
        copy_gap in prop_oneof![Just(0usize), Just(1usize << 20), 0..8192usize],
    ) {
        let backend = Arc::new(HostBackend::new(HostConfig { capacity: CAPACITY, granularity: G }));
        let pager = Pager::with_config(backend.clone(), PagerConfig {
            chunk_bytes: 128 * KIB,
            verify_restore: true,
tuning: gpu_pager::Tuning {
            hash_chunk_bytes: 16 * KIB,
            copy_gap_bytes: copy_gap,
..gpu_pager::Tuning::default()
},
..PagerConfig::default()
});
        for (tag, policy) in TAGS {
            let info = pager.region_with(tag, 0, policy, gpu_pager::RegionOptions::GROWING).unwrap();
            prop_assert!((info.kind == gpu_pager::RegionKind::Growing) && !(info.kind == gpu_pager::RegionKind::Elastic));
        }
        let mut resident = [true; 3];
        let mut bufs: Vec<ModelBuf> = Vec::new();
        let mut hold = None;
        let mut held = 0usize;

        for op in ops {
            match op {
                Op::Alloc { tag, len } => {
                    let (t, _) = TAGS[tag];
                    let before = backend.used_bytes();
                    match pager.alloc(t, len) {
                        Ok(buf) => {
                            prop_assert_eq!(buf.offset() % G, 0);
                            let data = if resident[tag] {
                                prop_assert_eq!(backend.used_bytes(), before + granules(len));
                                let d = vec![1 + (len % 3) as u8; len];
                                pager.write(&buf, 0, &d).unwrap();
                                Some(d)
                            } else {
                                prop_assert_eq!(backend.used_bytes(), before);
                                None
                            };
                            let addr = if resident[tag] { pager.ptr(&buf).unwrap() } else { 0 };
                            prop_assert!(pager.overwritten(&buf).unwrap().is_empty(), "a new buffer is unmarked");
                            let mut b = ModelBuf { buf, tag, data: Vec::new(), known: Vec::new(), marked: vec![false; len], addr };
                            b.set(data);
                            bufs.push(b);
                        }
                        Err(Error::OutOfMemory { during, .. }) => {
                            prop_assert!(resident[tag]);
                            prop_assert_eq!(during, "alloc");
                            prop_assert_eq!(backend.used_bytes(), before, "a failed alloc maps nothing");
                        }
                        Err(e) => prop_assert!(false, "alloc: {e}"),
                    }
                }
                Op::Free { pick } => {
                    if bufs.is_empty() { continue; }
                    let b = bufs.swap_remove(pick % bufs.len());
                    let before = backend.used_bytes();
                    pager.free(&b.buf).unwrap();
                    let back = if resident[b.tag] { granules(b.buf.len()) } else { 0 };
                    prop_assert_eq!(backend.used_bytes(), before - back, "free gives the memory back");
                    let again = matches!(pager.free(&b.buf), Err(Error::StaleBuffer { .. }));
                    prop_assert!(again, "a second free is StaleBuffer");
                }
                Op::Write { pick, seed } => {
                    if bufs.is_empty() { continue; }
                    let i = pick % bufs.len();
                    let d = vec![seed; bufs[i].buf.len()];
                    match pager.write(&bufs[i].buf, 0, &d) {
                        Ok(()) => {
                            prop_assert!(resident[bufs[i].tag]);
                            bufs[i].set(Some(d));
                        }
                        Err(Error::NotResident { .. }) => prop_assert!(!resident[bufs[i].tag]),
                        Err(e) => prop_assert!(false, "write: {e}"),
                    }
                }
                Op::Release { tag } => {
                    pager.release(&[TAGS[tag].0]).unwrap();
                    if resident[tag] {
                        for b in bufs.iter_mut().filter(|b| b.tag == tag) {
                            if TAGS[tag].1 == Policy::Preserve {
                                // Bytes marked now are undefined after the resume.
                                for (k, m) in b.known.iter_mut().zip(&b.marked) {
                                    *k &= !*m;
                                }
                            } else {
                                b.set(None);
                            }
                        }
                    }
                    resident[tag] = false;
                }
                Op::Resume { tag } => {
                    let before = backend.used_bytes();
                    match pager.resume(&[TAGS[tag].0]) {
                        Ok(_) => {
                            if !resident[tag] {
                                for b in bufs.iter_mut().filter(|b| b.tag == tag) {
                                    if TAGS[tag].1 == Policy::DiscardZeroed {
                                        b.set(Some(vec![0; b.buf.len()]));
                                    }
                                    if b.addr == 0 {
                                        b.addr = pager.ptr(&b.buf).unwrap();
                                    }
                                }
                            }
                            resident[tag] = true;
                        }
                        Err(Error::OutOfMemory { during, .. }) => {
                            prop_assert_eq!(during, "resume");
                            prop_assert!(!resident[tag]);
                            prop_assert_eq!(backend.used_bytes(), before, "a failed resume maps nothing");
                        }
                        Err(e) => prop_assert!(false, "resume: {e}"),
                    }
                }
                Op::Hold { kib } => {
                    hold = None;
                    held = 0;
                    if let Ok(h) = Hog::take(backend.as_ref(), kib * KIB) {
                        held = h.len();
                        hold = Some(h);
                    }
                }
                Op::Unhold => {
                    hold = None;
                    held = 0;
                }
                Op::Trim { tag } => {
                    prop_assert_eq!(pager.trim(TAGS[tag].0, &[]).unwrap(), 0, "nothing to trim");
                }
                Op::Mark { pick, a, b, on } => {
                    if bufs.is_empty() { continue; }
                    let i = pick % bufs.len();
                    let len = bufs[i].buf.len();
                    let (a, b) = (a % len, b % (len + 1));
                    let range = a.min(b)..a.max(b);
                    pager.set_overwritten(&bufs[i].buf, range.clone(), on).unwrap();
                    bufs[i].marked[range].fill(on);
                }
            }

            // Mapped memory is exactly the granules under live buffers of resident regions.
            let mut want_total = 0;
            for (i, (t, _)) in TAGS.iter().enumerate() {
                let want: usize = if resident[i] {
                    bufs.iter().filter(|b| b.tag == i).map(|b| granules(b.buf.len())).sum()
                } else {
                    0
                };
                want_total += want;
                let s = pager.region_stats(t).unwrap();
                prop_assert_eq!(s.resident_bytes, want, "{} mapped", t);
                let marked: usize = bufs.iter().filter(|b| b.tag == i).map(ModelBuf::marked_bytes).sum();
                prop_assert_eq!(s.marked_bytes, marked, "{} marked", t);
            }
            prop_assert_eq!(backend.used_bytes(), want_total + held);
            // Contents and addresses.
            for b in &bufs {
                prop_assert_eq!(pager.overwritten(&b.buf).unwrap(), common::runs_of(&b.marked));
                if !resident[b.tag] { continue; }
                prop_assert_eq!(pager.ptr(&b.buf).unwrap(), b.addr, "address unchanged");
                let mut got = vec![0u8; b.buf.len()];
                pager.read(&b.buf, 0, &mut got).unwrap();
                if got != b.data {
                    let differs = got.iter().zip(&b.data).zip(&b.known).position(|((g, d), k)| *k && g != d);
                    prop_assert!(differs.is_none(), "{} buffer at {} differs at byte {:?}", TAGS[b.tag].0, b.buf.offset(), differs);
                }
            }
        }
        drop(hold);
        drop(pager);
        prop_assert_eq!(backend.used_bytes(), 0, "everything given back");
    }
}
