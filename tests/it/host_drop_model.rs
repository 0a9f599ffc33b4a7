//! Property test of the per-call keep/drop choice ([`gpu_pager::Pager::release_with`]):
//! random writes, releases that keep some tags and drop others, and resumes, over a fixed and
//! a growing `Preserve` region and a `Discard` one, against a model. A kept tag comes back
//! bit-exact; a dropped `Preserve` tag comes back zeroed, and backs up again at its next
//! kept release; a `Discard` tag's contents are undefined after any release.

use crate::common;
use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Buffer, Pager, PagerConfig, Policy, ReleaseOptions, State};
use proptest::prelude::*;

const KIB: usize = 1 << 10;
const TAGS: [(&str, Policy, usize); 3] = [
    ("weights", Policy::Preserve, 512 * KIB),
    ("growing", Policy::Preserve, 0),
    ("kv_cache", Policy::Discard, 256 * KIB),
];

#[derive(Debug, Clone)]
enum Op {
    Write { tag: usize, seed: u8 },
    Release { tags: u8, drop: u8 },
    Resume { tags: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3usize, any::<u8>()).prop_map(|(tag, seed)| Op::Write { tag, seed }),
        (1..8u8, 0..8u8).prop_map(|(tags, drop)| Op::Release { tags, drop }),
        (1..8u8).prop_map(|tags| Op::Resume { tags }),
    ]
}

fn names(mask: u8) -> Vec<&'static str> {
    (0..3)
        .filter(|i| mask & (1 << i) != 0)
        .map(|i| TAGS[i].0)
        .collect()
}

fn read(pager: &Pager, b: &Buffer) -> Vec<u8> {
    let mut out = vec![0; b.len()];
    pager.read(b, 0, &mut out).unwrap();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn kept_tags_come_back_bit_exact_and_dropped_ones_zeroed(ops in prop::collection::vec(op(), 1..40)) {
        let backend = Arc::new(HostBackend::new(HostConfig {
            capacity: 4096 * KIB,
            granularity: 64 * KIB,
        }));
        let pager = Pager::with_config(backend, PagerConfig {
            chunk_bytes: 128 * KIB,
tuning: gpu_pager::Tuning {
            hash_chunk_bytes: 32 * KIB,
..gpu_pager::Tuning::default()
},
..PagerConfig::default()
});
        let mut bufs = Vec::new();
        // What each buffer must hold; None: undefined (a Discard tag after a release).
        let mut want: Vec<Option<Vec<u8>>> = Vec::new();
        for (tag, policy, bytes) in TAGS {
            common::table_region(&pager, tag, bytes, policy, gpu_pager::RegionOptions::default()).unwrap();
            let b = pager.alloc(tag, 100 * KIB + 7).unwrap();
            let data = vec![0xAB; b.len()];
            pager.write(&b, 0, &data).unwrap();
            want.push(Some(data));
            bufs.push(b);
        }
        let resident = |pager: &Pager, i: usize| pager.info(TAGS[i].0).unwrap().state == State::Resident;
        for op in ops {
            match op {
                Op::Write { tag, seed } => {
                    if resident(&pager, tag) {
                        let data: Vec<u8> = (0..bufs[tag].len()).map(|k| (k as u8).wrapping_mul(seed | 1) ^ seed).collect();
                        pager.write(&bufs[tag], 0, &data).unwrap();
                        want[tag] = Some(data);
                    }
                }
                Op::Release { tags, drop } => {
                    let drop = drop & tags;
                    let options = ReleaseOptions { drop: names(drop).into_iter().map(String::from).collect() };
                    let was: Vec<bool> = (0..3).map(|i| resident(&pager, i)).collect();
                    pager.release_with(&names(tags), &options).unwrap();
                    for i in 0..3 {
                        if tags & (1 << i) == 0 || !was[i] {
                            continue;
                        }
                        if TAGS[i].1 == Policy::Discard {
                            want[i] = None;
                        } else if drop & (1 << i) != 0 {
                            want[i] = Some(vec![0; bufs[i].len()]);
                        }
                    }
                }
                Op::Resume { tags } => {
                    pager.resume(&names(tags)).unwrap();
                    for i in 0..3 {
                        if tags & (1 << i) != 0
                            && let Some(w) = &want[i]
                        {
                            prop_assert_eq!(&read(&pager, &bufs[i]), w, "{}", TAGS[i].0);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_dropped_tag_must_be_released_too() {
    let pager = Pager::new(Arc::new(HostBackend::new(HostConfig {
        capacity: 1024 * KIB,
        granularity: 64 * KIB,
    })));
    pager.region("w", 256 * KIB, Policy::Preserve).unwrap();
    pager.region("kv", 256 * KIB, Policy::Discard).unwrap();
    let options = ReleaseOptions {
        drop: vec!["kv".to_owned()],
    };
    let e = pager.release_with(&["w"], &options).unwrap_err();
    assert!(
        e.to_string()
            .contains("must also be one of the tags released"),
        "{e}"
    );
    assert_eq!(
        pager.info("w").unwrap().state,
        State::Resident,
        "nothing released"
    );
}
