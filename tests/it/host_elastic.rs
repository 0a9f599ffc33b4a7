//! Elastic regions on the host backend: chunks mapped only where backed, trimmed back to the
//! device, lazy across release/resume, all-or-nothing out-of-memory, `NotBacked` instead of
//! a fault, and a property test against a model of the mapped chunks. Runs in CI.

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;

use gpu_pager::backend::Backend;
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Error, Outcome, Pager, PagerConfig, Policy, RegionOptions, State};
use gpu_pager_testkit::Hog;
use proptest::prelude::*;

const KIB: usize = 1 << 10;
/// Host granularity and the chunk size of the elastic regions below.
const G: usize = 64 * KIB;
const CHUNK: usize = 128 * KIB;

fn setup(capacity: usize) -> (Arc<HostBackend>, Pager) {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity,
        granularity: G,
    }));
    let pager = Pager::with_config(
        backend.clone(),
        PagerConfig {
            chunk_bytes: 1 << 20,
            ..PagerConfig::default()
        },
    );
    (backend, pager)
}

fn elastic(chunk: usize) -> RegionOptions {
    RegionOptions {
        kind: gpu_pager::RegionKind::Elastic,
        chunk_bytes: Some(chunk),
        ..Default::default()
    }
}

fn free(backend: &HostBackend) -> usize {
    backend.mem_info().unwrap().free
}

fn resident(pager: &Pager, tag: &str) -> usize {
    pager.stats().region(tag).unwrap().resident_bytes
}

#[test]
fn an_elastic_region_is_created_with_nothing_mapped() {
    let (backend, pager) = setup(16 << 20);
    let info = pager
        .region_with("kv", 1 << 20, Policy::Discard, elastic(CHUNK))
        .unwrap();
    assert!((info.kind == gpu_pager::RegionKind::Elastic));
    assert_eq!(info.state, State::Resident);
    assert_eq!(info.chunk_bytes, CHUNK);
    assert_eq!(backend.used_bytes(), 0);
    let s = pager.stats();
    let s = s.region("kv").unwrap();
    assert_eq!((s.resident_bytes, s.released_bytes), (0, 1 << 20));
    assert!(!pager.is_backed("kv", 0..1).unwrap());
    assert!(pager.is_backed("kv", 0..0).unwrap());
    assert_eq!(pager.releases("kv").unwrap(), 0);
    // Non-elastic regions say so and are mapped whole.
    let fixed = pager.region("w", 1 << 20, Policy::Discard).unwrap();
    assert_eq!(fixed.kind, gpu_pager::RegionKind::Fixed);
    assert_eq!(backend.used_bytes(), 1 << 20);
}

#[test]
fn chunk_bytes_is_rounded_like_the_pagers() {
    let (_, pager) = setup(16 << 20);
    let chunk = |tag, bytes, c| {
        pager
            .region_with(tag, bytes, Policy::Discard, elastic(c))
            .unwrap()
            .chunk_bytes
    };
    assert_eq!(chunk("a", 1 << 20, 100 * KIB), 128 * KIB); // granularity, then power of two
    assert_eq!(chunk("b", 1 << 20, 1), G);
    assert_eq!(chunk("c", 1 << 20, 0), G);
    assert_eq!(chunk("d", 3 * G, 1 << 20), 3 * G); // at most the region
    // Non-elastic regions take it too.
    let opts = RegionOptions {
        chunk_bytes: Some(200 * KIB),
        ..Default::default()
    };
    let info = pager
        .region_with("e", 1 << 20, Policy::Discard, opts)
        .unwrap();
    assert_eq!(info.chunk_bytes, 256 * KIB);
}

#[test]
fn back_maps_whole_chunks_and_trim_gives_them_back() {
    let (backend, pager) = setup(16 << 20);
    let size = 1 << 20; // 8 chunks
    pager
        .region_with("kv", size, Policy::Discard, elastic(CHUNK))
        .unwrap();
    let free0 = free(&backend);

    // 100 KiB..200 KiB touches chunks 0 and 1.
    assert_eq!(pager.back("kv", 100 * KIB..200 * KIB).unwrap(), 2 * CHUNK);
    assert_eq!(free(&backend), free0 - 2 * CHUNK);
    assert_eq!(resident(&pager, "kv"), 2 * CHUNK);
    assert!(pager.is_backed("kv", 0..2 * CHUNK).unwrap());
    assert!(!pager.is_backed("kv", 0..2 * CHUNK + 1).unwrap());
    // Backed already: nothing new. Empty: nothing.
    assert_eq!(pager.back("kv", 0..CHUNK).unwrap(), 0);
    assert_eq!(pager.back("kv", 5 * CHUNK..5 * CHUNK).unwrap(), 0);
    // A range over a hole maps only the hole.
    pager.back("kv", 3 * CHUNK..4 * CHUNK).unwrap();
    assert_eq!(pager.back("kv", 0..5 * CHUNK).unwrap(), 2 * CHUNK);
    assert_eq!(resident(&pager, "kv"), 5 * CHUNK);

    // Backed memory is usable through the pager.
    let buf = pager.alloc("kv", 4 * CHUNK).unwrap();
    assert!(buf.offset() + buf.len() <= 5 * CHUNK);
    let data: Vec<u8> = (0..buf.len()).map(|i| (i * 7) as u8).collect();
    pager.write(&buf, 0, &data).unwrap();
    let mut got = vec![0u8; buf.len()];
    pager.read(&buf, 0, &mut got).unwrap();
    assert_eq!(got, data);

    // Keep a byte in chunk 2 and a range over chunks 4..6 (chunk 5 is not mapped).
    let keep = [2 * CHUNK + 5..2 * CHUNK + 6, 4 * CHUNK + 1..5 * CHUNK + 1];
    assert_eq!(pager.trim("kv", &keep).unwrap(), 3 * CHUNK);
    assert_eq!(free(&backend), free0 - 2 * CHUNK);
    assert_eq!(resident(&pager, "kv"), 2 * CHUNK);
    assert!(pager.is_backed("kv", 2 * CHUNK..3 * CHUNK).unwrap());
    assert!(pager.is_backed("kv", 4 * CHUNK..5 * CHUNK).unwrap());
    assert!(!pager.is_backed("kv", 0..CHUNK).unwrap());
    assert!(!pager.is_backed("kv", 5 * CHUNK..6 * CHUNK).unwrap());
    // Empty and out-of-region keep ranges keep nothing.
    assert_eq!(
        pager.trim("kv", &[3..3, size..2 * size]).unwrap(),
        2 * CHUNK
    );
    assert_eq!(free(&backend), free0);
    assert_eq!(pager.trim("kv", &[]).unwrap(), 0);
}

#[test]
fn release_and_resume_are_lazy_and_counted() {
    let (backend, pager) = setup(16 << 20);
    pager
        .region_with("kv", 1 << 20, Policy::DiscardZeroed, elastic(CHUNK))
        .unwrap();
    pager.back("kv", 0..3 * CHUNK).unwrap();

    let rel = pager.release(&["kv"]).unwrap();
    assert_eq!(rel.region("kv").unwrap().bytes, 3 * CHUNK);
    assert_eq!(backend.used_bytes(), 0);
    assert_eq!(pager.releases("kv").unwrap(), 1);
    assert_eq!(pager.info("kv").unwrap().state, State::Released);
    assert!(!pager.is_backed("kv", 0..0).unwrap());
    assert_eq!(pager.trim("kv", &[]).unwrap(), 0);
    assert!(matches!(
        pager.back("kv", 0..1),
        Err(Error::NotResident { ref tag, .. }) if tag == "kv"
    ));
    // Releasing a released region changes nothing and is not counted.
    let again = pager.release(&["kv"]).unwrap();
    assert_eq!(again.region("kv").unwrap().outcome, Outcome::AlreadyDone);
    assert_eq!(pager.releases("kv").unwrap(), 1);

    let res = pager.resume(&["kv"]).unwrap();
    assert_eq!(res.region("kv").unwrap().outcome, Outcome::Done);
    assert_eq!(res.region("kv").unwrap().bytes, 0);
    assert_eq!(pager.info("kv").unwrap().state, State::Resident);
    assert_eq!(backend.used_bytes(), 0);
    assert_eq!(pager.releases("kv").unwrap(), 1);

    // DiscardZeroed: newly backed chunks read zero, also after a trim and a re-back.
    let buf = pager.alloc("kv", CHUNK).unwrap();
    pager
        .back("kv", buf.offset()..buf.offset() + buf.len())
        .unwrap();
    pager.fill(&buf, 0xFFFF_FFFF).unwrap();
    pager.trim("kv", &[]).unwrap();
    pager
        .back("kv", buf.offset()..buf.offset() + buf.len())
        .unwrap();
    let mut got = vec![1u8; buf.len()];
    pager.read(&buf, 0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0));

    pager.release(&["kv"]).unwrap();
    assert_eq!(pager.releases("kv").unwrap(), 2);
    assert_eq!(pager.releases("w").unwrap_err().tag(), Some("w"));
}

#[test]
fn out_of_memory_on_back_maps_nothing_new_and_a_later_back_succeeds() {
    let (backend, pager) = setup(8 * CHUNK);
    pager
        .region_with("kv", 8 * CHUNK, Policy::Discard, elastic(CHUNK))
        .unwrap();
    pager.back("kv", 0..1).unwrap();
    pager.back("kv", 2 * CHUNK..2 * CHUNK + 1).unwrap();
    // The trainer holds 3 chunks: 3 are free. Backing everything needs chunk 1 (fits)
    // and chunks 3..8 (do not): the first run is undone too.
    let trainer = Hog::take(backend.as_ref(), 3 * CHUNK).unwrap();
    let err = pager.back("kv", 0..8 * CHUNK).unwrap_err();
    eprintln!("{err}");
    match &err {
        Error::OutOfMemory {
            tag,
            during,
            requested,
            free,
        } => {
            assert_eq!(tag, "kv");
            assert_eq!(*during, "back");
            assert_eq!(*requested, 5 * CHUNK);
            assert_eq!(*free, 3 * CHUNK);
        }
        e => panic!("expected OutOfMemory, got {e:?}"),
    }
    assert!(err.to_string().contains("nothing new was mapped"), "{err}");
    assert_eq!(resident(&pager, "kv"), 2 * CHUNK);
    assert_eq!(backend.used_bytes(), 5 * CHUNK);
    assert!(!pager.is_backed("kv", CHUNK..2 * CHUNK).unwrap());
    // What fits still works while the trainer holds its memory.
    assert_eq!(pager.back("kv", CHUNK..2 * CHUNK).unwrap(), CHUNK);
    drop(trainer);
    assert_eq!(pager.back("kv", 0..8 * CHUNK).unwrap(), 5 * CHUNK);
    assert!(pager.is_backed("kv", 0..8 * CHUNK).unwrap());
}

#[test]
fn unbacked_access_is_not_backed_never_a_fault() {
    let (_, pager) = setup(16 << 20);
    pager
        .region_with("kv", 1 << 20, Policy::Discard, elastic(CHUNK))
        .unwrap();
    // Spans chunks 0 and 1; only chunk 0 backed.
    let buf = pager.alloc("kv", CHUNK + 4096).unwrap();
    assert_eq!(buf.offset(), 0);
    let not_backed = |r: Result<(), Error>, offset: usize, len: usize| match r {
        Err(Error::NotBacked {
            tag,
            offset: o,
            len: l,
        }) => {
            assert_eq!((tag.as_str(), o, l), ("kv", offset, len));
        }
        r => panic!("expected NotBacked at {offset}+{len}, got {r:?}"),
    };
    let mut out = vec![0u8; 16];
    not_backed(pager.write(&buf, 0, &[1; 16]), 0, 16);
    not_backed(pager.read(&buf, 0, &mut out), 0, 16);
    not_backed(pager.ptr(&buf).map(drop), 0, buf.len());
    not_backed(pager.fill(&buf, 7), 0, buf.len());
    not_backed(pager.hash(&buf, 4096).map(drop), 0, buf.len());
    let err = pager.write(&buf, 0, &[1; 16]).unwrap_err();
    assert_eq!(err.tag(), Some("kv"));
    assert!(
        err.to_string()
            .contains("back the bytes 0..16 of `kv` first"),
        "{err}"
    );

    pager.back("kv", 0..CHUNK).unwrap();
    pager.write(&buf, 0, &[1; 16]).unwrap();
    pager.read(&buf, CHUNK - 16, &mut out).unwrap();
    not_backed(pager.read(&buf, CHUNK - 8, &mut out), CHUNK - 8, 16);
    not_backed(pager.ptr(&buf).map(drop), 0, buf.len());
    pager.back("kv", 0..buf.len()).unwrap();
    pager.ptr(&buf).unwrap();
    pager.fill(&buf, 7).unwrap();
    pager.hash(&buf, 4096).unwrap();
    // A trim takes it away again, even under a lease.
    let _lease = pager.lease(&["kv"]).unwrap();
    assert_eq!(
        pager.trim("kv", std::slice::from_ref(&(0..1))).unwrap(),
        CHUNK
    );
    pager.read(&buf, 0, &mut out).unwrap();
    not_backed(pager.read(&buf, CHUNK, &mut out), CHUNK, 16);
}

#[test]
fn misuse_is_refused_with_a_typed_error() {
    let (backend, pager) = setup(16 << 20);
    // Preserve cannot be elastic; nothing is created.
    let err = pager
        .region_with("w", 1 << 20, Policy::Preserve, elastic(CHUNK))
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { ref tag, .. } if tag.as_deref() == Some("w")),
        "{err:?}"
    );
    assert!(err.to_string().contains("cannot be elastic"), "{err}");
    assert!(pager.tags().is_empty());

    // Trim needs an elastic region; back and is_backed work on any.
    pager.region("fixed", 1 << 20, Policy::Discard).unwrap();
    let err = pager.trim("fixed", &[]).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { ref tag, .. } if tag.as_deref() == Some("fixed")),
        "{err:?}"
    );
    assert!(err.to_string().contains("only elastic regions"), "{err}");
    assert_eq!(pager.back("fixed", 0..1 << 20).unwrap(), 0);
    assert!(pager.is_backed("fixed", 0..1 << 20).unwrap());
    pager.release(&["fixed"]).unwrap();
    assert!(!pager.is_backed("fixed", 0..1).unwrap());
    assert_eq!(pager.releases("fixed").unwrap(), 1);
    pager.resume(&["fixed"]).unwrap();
    assert_eq!(backend.used_bytes(), 1 << 20);

    // Ranges outside the region.
    pager
        .region_with("kv", 1 << 20, Policy::Discard, elastic(CHUNK))
        .unwrap();
    for range in [0..(1 << 20) + 1, (1 << 20) + 1..(1 << 20) + 1] {
        assert!(matches!(
            pager.back("kv", range.clone()),
            Err(Error::OutOfRange { what: "region", .. })
        ));
        assert!(matches!(
            pager.is_backed("kv", range),
            Err(Error::OutOfRange { what: "region", .. })
        ));
    }
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 10..5;
    assert!(matches!(
        pager.back("kv", reversed),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        pager.back("nope", 0..1),
        Err(Error::UnknownTag { .. })
    ));
    // Same tag, elastic differs: a conflict; same options: the region.
    assert!(matches!(
        pager.region("kv", 1 << 20, Policy::Discard),
        Err(Error::TagConflict { .. })
    ));
    assert!(
        pager
            .region_with("kv", 1 << 20, Policy::Discard, elastic(CHUNK))
            .is_ok()
    );
}

// ---- property test -------------------------------------------------------------------

/// 17 granules of 64 KiB in 128 KiB chunks: 9 chunks, the last one half size.
const SIZE: usize = 17 * G;
const CHUNKS: usize = SIZE.div_ceil(CHUNK);
/// Less than the region: backing everything runs out of memory.
const CAPACITY: usize = 6 * CHUNK;

#[derive(Debug, Clone)]
enum Op {
    Back(Range<usize>),
    Trim(Vec<Range<usize>>),
    Release,
    Resume,
}

fn range() -> impl Strategy<Value = Range<usize>> {
    (0..=SIZE, 0..=SIZE / 2).prop_map(|(start, len)| start..(start + len).min(SIZE))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => range().prop_map(Op::Back),
        2 => proptest::collection::vec(range(), 0..3).prop_map(Op::Trim),
        1 => Just(Op::Release),
        1 => Just(Op::Resume),
    ]
}

fn chunk_len(i: usize) -> usize {
    ((i + 1) * CHUNK).min(SIZE) - i * CHUNK
}

fn touching(r: &Range<usize>) -> Range<usize> {
    if r.is_empty() {
        0..0
    } else {
        r.start / CHUNK..r.end.div_ceil(CHUNK)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn elastic_region_matches_model(
        ops in proptest::collection::vec(op(), 1..40),
        probes in proptest::collection::vec(range(), 4),
    ) {
        let (backend, pager) = setup(CAPACITY);
        pager.region_with("kv", SIZE, Policy::Discard, elastic(CHUNK)).unwrap();
        let mut mapped: BTreeSet<usize> = BTreeSet::new();
        let mut is_resident = true;
        let mut releases = 0u64;
        let bytes = |set: &BTreeSet<usize>| set.iter().map(|&i| chunk_len(i)).sum::<usize>();

        for op in ops {
            match op {
                Op::Back(r) => {
                    let new: BTreeSet<usize> =
                        touching(&r).filter(|i| !mapped.contains(i)).collect();
                    let got = pager.back("kv", r.clone());
                    if !is_resident {
                        prop_assert!(matches!(got, Err(Error::NotResident { .. })), "{:?}", got);
                    } else if bytes(&mapped) + bytes(&new) > CAPACITY {
                        prop_assert!(matches!(got, Err(Error::OutOfMemory { .. })), "{:?}", got);
                    } else {
                        prop_assert_eq!(got.unwrap(), bytes(&new));
                        mapped.extend(new);
                    }
                }
                Op::Trim(keep) => {
                    let gone: BTreeSet<usize> = mapped
                        .iter()
                        .copied()
                        .filter(|&i| {
                            let c = i * CHUNK..i * CHUNK + chunk_len(i);
                            !keep.iter().any(|k| !k.is_empty() && k.start < c.end && c.start < k.end)
                        })
                        .collect();
                    prop_assert_eq!(pager.trim("kv", &keep).unwrap(), bytes(&gone));
                    mapped.retain(|i| !gone.contains(i));
                }
                Op::Release => {
                    let rep = pager.release(&["kv"]).unwrap();
                    let r = rep.region("kv").unwrap();
                    if is_resident {
                        prop_assert_eq!(r.outcome, Outcome::Done);
                        prop_assert_eq!(r.bytes, bytes(&mapped));
                        releases += 1;
                    } else {
                        prop_assert_eq!(r.outcome, Outcome::AlreadyDone);
                    }
                    mapped.clear();
                    is_resident = false;
                }
                Op::Resume => {
                    let rep = pager.resume(&["kv"]).unwrap();
                    prop_assert_eq!(rep.region("kv").unwrap().bytes, 0);
                    is_resident = true;
                }
            }
            // After every step: accounting, state and backing agree with the model.
            prop_assert_eq!(resident(&pager, "kv"), bytes(&mapped));
            prop_assert_eq!(backend.used_bytes(), bytes(&mapped));
            prop_assert_eq!(pager.releases("kv").unwrap(), releases);
            let state = pager.info("kv").unwrap().state;
            prop_assert_eq!(state, if is_resident { State::Resident } else { State::Released });
            for i in 0..CHUNKS {
                let c = i * CHUNK..i * CHUNK + chunk_len(i);
                prop_assert_eq!(pager.is_backed("kv", c).unwrap(), is_resident && mapped.contains(&i));
            }
            for p in &probes {
                let want = is_resident && touching(p).all(|i| mapped.contains(&i));
                prop_assert_eq!(pager.is_backed("kv", p.clone()).unwrap(), want, "probe {:?}", p);
            }
        }
    }
}
