//! Property test: random alloc / free / write / release / resume / hold sequences over
//! several tags on the host backend, against a simple model of what each call must do.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Buffer, Error, Outcome, Pager, PagerConfig, Policy, State};
use proptest::prelude::*;

const KIB: usize = 1 << 10;
const TAGS: [(&str, Policy, usize); 3] = [
    ("weights", Policy::Preserve, 256 * KIB),
    ("kv_cache", Policy::Discard, 512 * KIB),
    ("graph", Policy::DiscardZeroed, 128 * KIB),
];
const CAPACITY: usize = 1024 * KIB;

#[derive(Debug, Clone)]
enum Op {
    Alloc { tag: usize, len: usize },
    Free { pick: usize },
    Write { pick: usize, seed: u8 },
    Release { mask: u8 },
    Resume { mask: u8 },
    Hold { kib: usize },
    Unhold,
    Lease { mask: u8 },
    Unlease,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3usize, 1..40_000usize).prop_map(|(tag, len)| Op::Alloc { tag, len }),
        1 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(pick, seed)| Op::Write { pick, seed }),
        2 => (1..8u8).prop_map(|mask| Op::Release { mask }),
        2 => (1..8u8).prop_map(|mask| Op::Resume { mask }),
        1 => (0..1024usize).prop_map(|kib| Op::Hold { kib }),
        1 => Just(Op::Unhold),
        1 => (1..8u8).prop_map(|mask| Op::Lease { mask }),
        1 => Just(Op::Unlease),
    ]
}

struct ModelBuf {
    buf: Buffer,
    /// Known contents (None: undefined, e.g. Discard after a cycle).
    data: Option<Vec<u8>>,
}

fn tags_of(mask: u8) -> Vec<&'static str> {
    (0..3)
        .filter(|i| mask & (1 << i) != 0)
        .map(|i| TAGS[i].0)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pager_matches_model(ops in proptest::collection::vec(op(), 1..60)) {
        let backend = Arc::new(HostBackend::new(HostConfig { capacity: CAPACITY, granularity: 64 * KIB }));
        let pager = Pager::with_config(backend.clone(), PagerConfig {
            chunk_bytes: 128 * KIB,
            discard_chunk_bytes: 128 * KIB,
            hash_chunk_bytes: 16 * KIB,
            ..PagerConfig::default()
        });
        let mut resident: BTreeMap<&str, bool> = BTreeMap::new();
        let mut leased: BTreeMap<&str, usize> = BTreeMap::new();
        let mut bases = BTreeMap::new();
        for (tag, policy, size) in TAGS {
            bases.insert(tag, pager.region(tag, size, policy).unwrap().base);
            resident.insert(tag, true);
            leased.insert(tag, 0);
        }
        let size_of = |t: &str| TAGS.iter().find(|x| x.0 == t).unwrap().2;
        let policy_of = |t: &str| TAGS.iter().find(|x| x.0 == t).unwrap().1;
        let mut bufs: Vec<ModelBuf> = Vec::new();
        let mut hold = None;
        let mut held = 0usize;
        let mut leases = Vec::new();

        for op in ops {
            match op {
                Op::Alloc { tag, len } => {
                    let (t, policy, _) = TAGS[tag];
                    if let Ok(buf) = pager.alloc(t, len) {
                        let data = match (resident[t], policy) {
                            (true, _) => {
                                // Give it known contents right away.
                                let d = vec![len as u8; len];
                                pager.write(&buf, 0, &d).unwrap();
                                Some(d)
                            }
                            (false, Policy::DiscardZeroed) => Some(vec![0; len]),
                            _ => None,
                        };
                        bufs.push(ModelBuf { buf, data });
                    }
                }
                Op::Free { pick } => {
                    if bufs.is_empty() { continue; }
                    let b = bufs.swap_remove(pick % bufs.len());
                    pager.free(&b.buf).unwrap();
                    let again = matches!(pager.free(&b.buf), Err(Error::StaleBuffer { .. }));
                    prop_assert!(again, "a second free must be StaleBuffer");
                }
                Op::Write { pick, seed } => {
                    if bufs.is_empty() { continue; }
                    let i = pick % bufs.len();
                    let t = bufs[i].buf.tag().to_owned();
                    let d = vec![seed; bufs[i].buf.len()];
                    match pager.write(&bufs[i].buf, 0, &d) {
                        Ok(()) => {
                            prop_assert!(resident[t.as_str()]);
                            bufs[i].data = Some(d);
                        }
                        Err(Error::NotResident { tag, .. }) => {
                            prop_assert!(!resident[t.as_str()]);
                            prop_assert_eq!(tag, t);
                        }
                        Err(e) => prop_assert!(false, "write: {}", e),
                    }
                }
                Op::Release { mask } => {
                    let tags = tags_of(mask);
                    let busy = tags.iter().any(|t| leased[t] > 0);
                    match pager.release(&tags) {
                        Ok(rep) => {
                            prop_assert!(!busy);
                            for t in &tags {
                                let want = if resident[t] { Outcome::Done } else { Outcome::AlreadyDone };
                                prop_assert_eq!(rep.region(t).unwrap().outcome, want);
                                resident.insert(t, false);
                            }
                            for b in &mut bufs {
                                if tags.contains(&b.buf.tag()) && policy_of(b.buf.tag()) != Policy::Preserve {
                                    b.data = if policy_of(b.buf.tag()) == Policy::DiscardZeroed {
                                        Some(vec![0; b.buf.len()])
                                    } else {
                                        None
                                    };
                                }
                            }
                        }
                        Err(Error::Busy { .. }) => prop_assert!(busy),
                        Err(e) => prop_assert!(false, "release: {}", e),
                    }
                }
                Op::Resume { mask } => {
                    let tags = tags_of(mask);
                    let need: usize = tags.iter().filter(|t| !resident[*t]).map(|t| size_of(t)).sum();
                    let used: usize = resident.iter().filter(|(_, r)| **r).map(|(t, _)| size_of(t)).sum();
                    let fits = used + held + need <= CAPACITY;
                    match pager.resume(&tags) {
                        Ok(_) => {
                            prop_assert!(fits);
                            for t in &tags { resident.insert(t, true); }
                        }
                        Err(Error::OutOfMemory { .. }) => prop_assert!(!fits),
                        Err(e) => prop_assert!(false, "resume: {}", e),
                    }
                }
                Op::Hold { kib } => {
                    hold = None;
                    held = 0;
                    if let Ok(h) = backend.hold(kib * KIB) {
                        hold = Some(h);
                        held = kib * KIB;
                    }
                }
                Op::Unhold => { hold = None; held = 0; }
                Op::Lease { mask } => {
                    let tags = tags_of(mask);
                    let all_resident = tags.iter().all(|t| resident[t]);
                    match pager.lease(&tags) {
                        Ok(l) => {
                            prop_assert!(all_resident);
                            for t in &tags { *leased.get_mut(t).unwrap() += 1; }
                            leases.push((tags, l));
                        }
                        Err(Error::NotResident { .. }) => prop_assert!(!all_resident),
                        Err(e) => prop_assert!(false, "lease: {}", e),
                    }
                }
                Op::Unlease => {
                    if let Some((tags, l)) = leases.pop() {
                        drop(l);
                        for t in &tags { *leased.get_mut(t).unwrap() -= 1; }
                    }
                }
            }
            // After every step: states, accounting, addresses and known contents agree.
            let used: usize = resident.iter().filter(|(_, r)| **r).map(|(t, _)| size_of(t)).sum();
            prop_assert_eq!(backend.used_bytes(), used + held);
            let stats = pager.stats();
            for (t, r) in &resident {
                let s = stats.region(t).unwrap();
                prop_assert_eq!(s.info.state, if *r { State::Resident } else { State::Released });
                prop_assert_eq!(s.info.base, bases[t]);
                prop_assert_eq!(s.leases, leased[t]);
            }
            for b in &bufs {
                if !resident[b.buf.tag()] { continue; }
                if let Some(d) = &b.data {
                    let mut got = vec![0u8; d.len()];
                    pager.read(&b.buf, 0, &mut got).unwrap();
                    prop_assert!(got == *d, "contents of a buffer in {}", b.buf.tag());
                }
            }
        }
        drop(hold);
    }
}
