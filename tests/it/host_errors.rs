//! What a new user trips over: every mistake is a typed error whose message says what is
//! wrong, with the numbers, and what to do.

use crate::common;

use std::error::Error as _;
use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::kv::{KvCache, KvCacheConfig, KvDtype, KvLayout, KvOrder};
use gpu_pager::{Error, Pager, Policy, RegionOptions};

const MIB: usize = 1 << 20;

use common::host_pager as pager;

#[test]
fn an_unknown_tag_suggests_the_nearest_one() {
    let p = pager(64 * MIB);
    p.region("kv_cache", 4 * MIB, Policy::Discard).unwrap();
    p.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    let e = p.resume(&["kvcache"]).unwrap_err();
    assert!(
        matches!(&e, Error::UnknownTag { tag, nearest: Some(n) } if tag == "kvcache" && n == "kv_cache"),
        "{e:?}"
    );
    assert!(e.to_string().contains("did you mean `kv_cache`?"), "{e}");
    let e = p.info("optimizer").unwrap_err();
    assert!(
        matches!(e, Error::UnknownTag { nearest: None, .. }),
        "{e:?}"
    );
}

#[test]
fn a_tag_conflict_names_what_differs() {
    let p = pager(256 * MIB);
    let elastic = RegionOptions {
        kind: gpu_pager::RegionKind::Elastic,
        ..Default::default()
    };
    p.region_with("kv_cache", 64 * MIB, Policy::Discard, elastic)
        .unwrap();
    let e = p.region("kv_cache", 64 * MIB, Policy::Discard).unwrap_err();
    match &e {
        Error::TagConflict { differs, .. } => {
            assert_eq!(differs, "kind (fixed, elastic or growing)")
        }
        e => panic!("{e:?}"),
    }
    assert!(e.to_string().contains("elastic"), "{e}");
    let e = p
        .region("kv_cache", 32 * MIB, Policy::Preserve)
        .unwrap_err();
    assert!(
        matches!(&e, Error::TagConflict { differs, .. } if differs == "policy and kind (fixed, elastic or growing) and size"),
        "{e:?}"
    );
}

#[test]
fn sizes_beyond_the_device_are_invalid_sizes_with_the_bound() {
    let p = pager(64 * MIB);
    for bytes in [1usize << 50, usize::MAX, 65 * MIB] {
        let e = p.region("huge", bytes, Policy::Discard).unwrap_err();
        assert!(matches!(e, Error::InvalidSize { .. }), "{bytes}: {e:?}");
        let msg = e.to_string();
        assert!(msg.contains(&(64 * MIB).to_string()), "{msg}");
        assert!(!msg.contains("18446744073707454463"), "a real bound: {msg}");
    }
    // Elastic regions only reserve: up to four times the device.
    let elastic = RegionOptions {
        kind: gpu_pager::RegionKind::Elastic,
        ..Default::default()
    };
    p.region_with("kv", 256 * MIB, Policy::Discard, elastic)
        .unwrap();
    let e = p
        .region_with("kv2", 257 * MIB, Policy::Discard, elastic)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidSize { .. }), "{e:?}");
    assert!(p.info("huge").is_err(), "nothing was created");
}

/// Review item 12: a size's fix-it names only what every binding can do (growing, not the
/// elastic kind that only Rust has), a 0-byte region is not told to ask for fewer bytes, and
/// sizes read as users read them.
#[test]
fn size_errors_advise_what_every_binding_can_do_in_sizes_users_read() {
    let p = pager(64 * MIB);
    let msg = p
        .region("huge", 65 * MIB, Policy::Discard)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("create it growing"), "{msg}");
    assert!(!msg.contains("elastic to"), "{msg}");
    assert!(
        msg.contains("(65.0 MiB)") && msg.contains("(64.0 MiB)"),
        "{msg}"
    );
    assert!(msg.contains("ask for fewer bytes"), "{msg}");
    let msg = p
        .region("empty", 0, Policy::Discard)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("at least 1 byte"), "{msg}");
    assert!(!msg.contains("fewer"), "{msg}");
}

#[test]
fn out_of_memory_at_creation_speaks_of_creation() {
    let p = pager(64 * MIB);
    p.region("a", 40 * MIB, Policy::Discard).unwrap();
    let e = p.region("b", 40 * MIB, Policy::Discard).unwrap_err();
    match &e {
        Error::OutOfMemory {
            during, requested, ..
        } => {
            assert_eq!(*during, "region creation");
            assert_eq!(*requested, 40 * MIB);
        }
        e => panic!("{e:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("was not created"), "{msg}");
    assert!(!msg.contains("resume"), "{msg}");
    assert!(p.info("b").is_err());
}

#[test]
fn prepin_is_only_for_preserve() {
    let p = pager(64 * MIB);
    let prepin = RegionOptions {
        prepin: true,
        ..Default::default()
    };
    for policy in [Policy::Discard, Policy::DiscardZeroed] {
        let e = p.region_with("kv", 4 * MIB, policy, prepin).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
        assert!(e.to_string().contains("preserve"), "{e}");
    }
    p.region_with("w", 4 * MIB, Policy::Preserve, prepin)
        .unwrap();
    assert_eq!(p.stats().backup_bytes(), 4 * MIB);
}

#[test]
fn a_bad_hash_chunk_is_the_callers_mistake() {
    let p = pager(64 * MIB);
    p.region("w", 4 * MIB, Policy::Preserve).unwrap();
    let b = p.alloc("w", 4096).unwrap();
    for chunk in [0, 17, 24] {
        let e = p.hash(&b, chunk).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{chunk}: {e:?}");
    }
    assert_eq!(p.hash(&b, 1024).unwrap().len(), 4);
}

#[test]
fn a_kv_caches_region_cannot_be_removed_under_it() {
    let p = Arc::new(pager(256 * MIB));
    let layout = KvLayout::new(2, 4, 64, 16, KvDtype::Bf16, KvOrder::Nhd).unwrap();
    let kv = KvCache::new(p.clone(), "kv_cache", layout, 256, KvCacheConfig::default()).unwrap();
    let e = p.remove("kv_cache").unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert!(e.to_string().contains("drop the KvCache"), "{e}");
    assert!(kv.k_ptr(0).is_ok(), "the cache still works");
    drop(kv);
    assert!(
        p.info("kv_cache").is_err(),
        "dropping the cache removed its region"
    );
}

#[test]
fn kv_layout_errors_convert_with_question_mark() {
    fn layout() -> Result<KvLayout, Error> {
        Ok(KvLayout::new(0, 4, 64, 16, KvDtype::Bf16, KvOrder::Nhd)?)
    }
    let e = layout().unwrap_err();
    assert!(
        matches!(e, Error::Kv { ref tag, .. } if tag.is_none()),
        "{e:?}"
    );
}

#[test]
fn messages_are_complete_and_chains_print_each_cause_once() {
    let p = pager(64 * MIB);
    p.region("w", 4 * MIB, Policy::Preserve).unwrap();
    let b = p.alloc("w", 64).unwrap();
    p.release(&["w"]).unwrap();
    let e = p.read(&b, 0, &mut [0u8; 8]).unwrap_err();
    assert!(e.source().is_none());
    let layout_err = KvLayout::new(0, 4, 64, 16, KvDtype::Bf16, KvOrder::Nhd).unwrap_err();
    let e = Error::from(layout_err.clone());
    assert!(
        e.source().is_none(),
        "the KV error is in the message, not again as a source"
    );
    assert!(e.to_string().contains(&layout_err.to_string()));
}

#[test]
fn stats_display_is_a_short_table() {
    let p = pager(64 * MIB);
    p.region("weights", 4 * MIB, Policy::Preserve).unwrap();
    p.region("kv_cache", 8 * MIB, Policy::Discard).unwrap();
    p.alloc("weights", 1000).unwrap();
    p.release(&["kv_cache"]).unwrap();
    let s = p.stats().to_string();
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines.len(), 3, "{s}");
    assert!(
        lines[0].starts_with("2 regions: 4.0 MiB resident, 8.0 MiB released"),
        "{s}"
    );
    assert!(
        lines[1].contains("kv_cache") && lines[1].contains("released"),
        "{s}"
    );
    assert!(
        lines[2].contains("weights") && lines[2].contains("1 buffers"),
        "{s}"
    );
}

/// Extreme settings are rounded to something usable, never a panic: the largest sizes for
/// every byte setting, then a full cycle of a Preserve region round-trips bit-exact.
#[test]
fn extreme_settings_are_rounded_not_a_panic() {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: 2 * MIB,
    }));
    let p = Pager::with_config(
        backend,
        gpu_pager::PagerConfig {
            chunk_bytes: usize::MAX,
            verify_restore: true,
            tuning: gpu_pager::Tuning {
                discard_chunk_bytes: usize::MAX,
                hash_chunk_bytes: usize::MAX,
                copy_unit_bytes: usize::MAX,
                copy_depth: usize::MAX,
                copy_gap_bytes: usize::MAX,
                ..gpu_pager::Tuning::default()
            },
            ..gpu_pager::PagerConfig::default()
        },
    );
    let c = p.config();
    assert_eq!(c.tuning.hash_chunk_bytes % 16, 0);
    assert!(c.tuning.hash_chunk_bytes >= 16);
    p.region("weights", 8 * MIB, Policy::Preserve).unwrap();
    let b = p.alloc("weights", 3 * MIB + 5).unwrap();
    let data: Vec<u8> = (0..b.len()).map(|i| (i % 251) as u8).collect();
    p.write(&b, 0, &data).unwrap();
    for _ in 0..2 {
        p.release(&["weights"]).unwrap();
        p.resume(&["weights"]).unwrap();
        let mut got = vec![0; b.len()];
        p.read(&b, 0, &mut got).unwrap();
        assert!(got == data, "contents changed across a cycle");
    }
}

/// A host backup that cannot be allocated is an out-of-memory error (host memory), not an
/// abort of the process, and nothing moves: the region stays resident with its contents.
/// The region is larger than the machine's memory and swap, which Linux's default
/// overcommit heuristic refuses in one allocation.
#[test]
fn a_host_backup_that_cannot_be_allocated_is_an_error_not_an_abort() {
    let mode = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
    if mode.trim() != "0" {
        eprintln!("skipped: this needs Linux's default overcommit heuristic (mode 0)");
        return;
    }
    let page = 4096usize;
    let phys = {
        // SAFETY: sysconf has no memory-safety preconditions.
        let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
        usize::try_from(pages).unwrap() * page
    };
    let g = 1usize << 30;
    let bytes = (4 * phys).next_multiple_of(g);
    let pager = gpu_pager::Pager::new(Arc::new(HostBackend::new(HostConfig {
        capacity: bytes,
        granularity: 2 << 20,
    })));
    pager
        .region("huge", bytes, gpu_pager::Policy::Preserve)
        .unwrap();
    let b = pager.alloc("huge", page).unwrap();
    pager.write(&b, 0, &[9; 4096]).unwrap();
    let e = pager.release(&["huge"]).unwrap_err();
    assert_eq!(e.code(), gpu_pager::ErrorCode::OutOfMemory, "{e}");
    assert!(e.to_string().contains("host memory"), "{e}");
    assert_eq!(
        pager.info("huge").unwrap().state,
        gpu_pager::State::Resident
    );
    let mut back = [0u8; 4096];
    pager.read(&b, 0, &mut back).unwrap();
    assert_eq!(back, [9; 4096]);
}

/// Tags are short names (review item 6): a long one is refused at creation, and an unknown
/// long one gets no "did you mean" (whose cost grows with both lengths), so that one bad
/// call cannot stall the others.
#[test]
fn tags_have_a_bounded_length_and_a_bounded_suggestion() {
    let pager = Pager::new(Arc::new(HostBackend::new(HostConfig {
        capacity: 64 << 20,
        granularity: 2 << 20,
    })));
    let long = "w".repeat(gpu_pager::MAX_TAG_BYTES + 1);
    let e = pager.region(&long, 2 << 20, Policy::Discard).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(
        e.to_string()
            .contains(&gpu_pager::MAX_TAG_BYTES.to_string()),
        "{e}"
    );
    let longest = "w".repeat(gpu_pager::MAX_TAG_BYTES);
    pager.region(&longest, 2 << 20, Policy::Discard).unwrap();
    pager.region("weights", 2 << 20, Policy::Discard).unwrap();
    match pager.info(&"w".repeat(1_000_000)).unwrap_err() {
        Error::UnknownTag { nearest, .. } => assert_eq!(nearest, None),
        other => panic!("{other}"),
    }
    match pager.info("weight").unwrap_err() {
        Error::UnknownTag { nearest, .. } => assert_eq!(nearest.as_deref(), Some("weights")),
        other => panic!("{other}"),
    }
}

/// Review item 1, the KV side: swap space that cannot be allocated is an out-of-memory
/// error, not an abort (more bytes than any address space holds).
#[test]
fn kv_swap_space_that_cannot_be_allocated_is_an_error_not_an_abort() {
    let pager = Arc::new(pager(64 * MIB));
    let layout = KvLayout::new(32, 8, 128, 16, KvDtype::Bf16, KvOrder::Nhd).unwrap();
    let cache = KvCache::new(pager, "kv", layout, 4, KvCacheConfig::default()).unwrap();
    let e = cache.alloc_host(u32::MAX).map(|_| ()).unwrap_err();
    assert_eq!(e.code(), gpu_pager::ErrorCode::OutOfMemory, "{e}");
    assert!(e.to_string().contains("host memory"), "{e}");
}
