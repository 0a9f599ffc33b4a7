//! Buffers and errors at their edges: a growing region's buffer has one length, the host
//! backend keeps no descriptor per mapped chunk, an address is handed out only for a live
//! buffer, a removed region's buffer is stale, a growing region is not called elastic,
//! reversed ranges are named as such, and `Debug` of an error carries its message.

use crate::common;

use gpu_pager::{Error, Pager, Policy, RegionOptions};

const MIB: usize = 1 << 20;

fn pager() -> Pager {
    common::host_pager(1024 * MIB)
}

#[test]
fn a_growing_region_s_buffer_has_the_length_it_was_asked_for() {
    let pager = pager();
    pager
        .region_with("g", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    let b = pager.alloc("g", 100).unwrap();
    let p = pager.ptr(&b).unwrap();
    let (found, offset) = pager.buffer_containing(p).unwrap();
    assert_eq!((found.len(), offset), (100, 0));
    assert_eq!(found, b, "one buffer, one handle");
    assert_eq!(
        pager.buffer_containing(p + 99).map(|(f, o)| (f.len(), o)),
        Some((100, 99))
    );
    assert!(
        pager.buffer_containing(p + 100).is_none(),
        "the padding is no buffer's"
    );
    assert!(matches!(
        pager.write(&found, 100, &[1]),
        Err(Error::OutOfRange { .. })
    ));
}

/// In a child process with at most 64 open descriptors: 300 buffers of a growing region.
#[test]
fn many_mapped_chunks_need_no_descriptor_each() {
    const CHILD: &str = "GPU_PAGER_NOFILE_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let limit = libc::rlimit {
            rlim_cur: 64,
            rlim_max: 64,
        };
        // SAFETY: a plain system call with a valid rlimit; this child runs this test alone.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
        let pager = pager();
        pager
            .region_with("g", 0, Policy::Discard, gpu_pager::RegionOptions::GROWING)
            .unwrap();
        let bufs: Vec<_> = (0..300).map(|_| pager.alloc("g", 4096).unwrap()).collect();
        pager.release(&["g"]).unwrap();
        pager.resume(&["g"]).unwrap();
        for b in &bufs {
            pager.write(b, 0, &[1; 16]).unwrap();
        }
        return;
    }
    let out = common::this_binary()
        .args([
            "--exact",
            &common::test_path(module_path!(), "many_mapped_chunks_need_no_descriptor_each"),
            "--test-threads",
            "1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let log =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && log.contains("1 passed"), "{log}");
}

#[test]
fn an_address_is_only_handed_out_for_a_live_buffer() {
    let pager = pager();
    pager.region("w", 8 * MIB, Policy::Discard).unwrap();
    let b = pager.alloc("w", 4096).unwrap();
    let first = pager.address(&b).unwrap();
    assert_eq!(first, pager.ptr(&b).unwrap());
    pager.release(&["w"]).unwrap();
    assert_eq!(
        pager.address(&b).unwrap(),
        first,
        "released: the address still stands"
    );
    pager.resume(&["w"]).unwrap();
    // The region removed and made again under the same tag: the old buffer has no address
    // there (its offset would name memory of the new region).
    pager.remove("w").unwrap();
    pager.region("w", 8 * MIB, Policy::Discard).unwrap();
    assert!(matches!(pager.address(&b), Err(Error::StaleBuffer { .. })));
}

/// A buffer of a removed region is stale (as the docs say), not an unknown
/// tag to create.
#[test]
fn a_buffer_of_a_removed_region_is_stale() {
    let pager = pager();
    pager.region("gone", 8 * MIB, Policy::Preserve).unwrap();
    let b = pager.alloc("gone", 4096).unwrap();
    pager.remove("gone").unwrap();
    for e in [
        pager.write(&b, 0, &[1]).unwrap_err(),
        pager.free(&b).unwrap_err(),
        pager.address(&b).unwrap_err(),
        pager.set_overwritten(&b, 0..1, true).unwrap_err(),
    ] {
        assert!(matches!(e, Error::StaleBuffer { .. }), "{e}");
    }
}

/// A growing region is not an elastic region (which a Preserve region may
/// not be), in its info or in the stats' words; a fixed region of 0 bytes is refused with
/// the kind that grows named.
#[test]
fn a_growing_region_is_not_reported_elastic() {
    let pager = pager();
    let info = pager
        .region_with("g", 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)
        .unwrap();
    assert_eq!(info.kind, gpu_pager::RegionKind::Growing, "{info:?}");
    let shown = pager.stats().to_string();
    assert!(shown.contains("growing Preserve"), "{shown}");
    assert!(!shown.contains("elastic"), "{shown}");
    let kv = pager
        .region_with(
            "kv",
            8 * MIB,
            Policy::Discard,
            RegionOptions {
                kind: gpu_pager::RegionKind::Elastic,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(kv.kind, gpu_pager::RegionKind::Elastic, "{kv:?}");
    let e = pager.region("zero", 0, Policy::Preserve).unwrap_err();
    assert!(matches!(e, Error::InvalidSize { .. }), "{e}");
    assert!(e.to_string().contains("create it growing"), "{e}");
}

/// A reversed range is an invalid argument that says so, not "0 bytes at
/// offset 10".
#[test]
fn a_reversed_range_is_named_reversed() {
    let pager = pager();
    pager.region("w", 8 * MIB, Policy::Preserve).unwrap();
    let b = pager.alloc("w", 4096).unwrap();
    #[allow(clippy::reversed_empty_ranges)]
    let e = pager.set_overwritten(&b, 10..5, true).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert!(e.to_string().contains("10..5 is reversed"), "{e}");
}

/// `fn main() -> Result<(), Error>` prints `Debug`; it carries the message
/// (the tag and the fix), not only the fields.
#[test]
fn debug_of_an_error_carries_its_message() {
    let pager = pager();
    pager.region("weights", 8 * MIB, Policy::Preserve).unwrap();
    let b = pager.alloc("weights", 4096).unwrap();
    pager.release(&["weights"]).unwrap();
    let e = pager.write(&b, 0, &[1]).unwrap_err();
    let debug = format!("{e:?}");
    assert!(debug.starts_with("NotResident: "), "{debug}");
    assert!(debug.ends_with(&e.to_string()), "{debug}");
    assert!(debug.contains("resume `weights` first"), "{debug}");
}

/// The conflict's words agree in number ("they differ in policy", not "the
/// policy differ").
#[test]
fn a_tag_conflict_says_what_differs_in_plain_words() {
    let pager = pager();
    pager.region("w", 8 * MIB, Policy::Preserve).unwrap();
    let e = pager.region("w", 16 * MIB, Policy::Discard).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("as a fixed Preserve region")
            && text.contains("they differ in policy and size;"),
        "{text}"
    );
}
