//! `Error::code()` is the one table of stable error numbers for the C and Python layers.

use gpu_pager::ErrorCode;

#[test]
fn codes_are_unique_stable_and_round_trip() {
    let mut seen = std::collections::BTreeSet::new();
    for c in ErrorCode::ALL {
        assert!(seen.insert(c.number()), "{c} reuses {}", c.number());
        assert_ne!(c.number(), 0, "0 is success in the C ABI");
        assert_eq!(ErrorCode::from_number(c.number()), Some(c));
        let name = c.to_string();
        assert!(name.chars().all(|ch| ch.is_ascii_alphanumeric()), "{name}");
    }
    assert_eq!(ErrorCode::from_number(0), None);
    assert_eq!(ErrorCode::from_number(12345), None);
    // The published numbers never change.
    assert_eq!(ErrorCode::NotResident.number(), 1);
    assert_eq!(ErrorCode::OutOfMemory.number(), 5);
    assert_eq!(ErrorCode::Backend.number(), 15);
    assert_eq!(ErrorCode::Internal.number(), 16);
    assert_eq!(ErrorCode::Panic.number(), 99);
    // Nor do the names (the C enumerators and Python classes are made from them).
    assert_eq!(ErrorCode::NotResident.to_string(), "NotResident");
    assert_eq!(ErrorCode::OutOfMemory.to_string(), "OutOfMemory");
}

/// An error that concerns no region has no tag (no placeholder string); a driver step that
/// served several regions names each; an invariant failure is `Internal`, not the caller's
/// `InvalidArgument`, whether the core or a backend found it.
#[test]
fn errors_name_their_regions_or_none() {
    use gpu_pager::backend::BackendError;
    use gpu_pager::backend::host::{HostBackend, HostConfig};
    use gpu_pager::{Error, Pager};
    let pager = Pager::new(std::sync::Arc::new(HostBackend::new(HostConfig {
        capacity: 64 << 20,
        granularity: 2 << 20,
    })));
    let e = pager.set_backup_dir("/proc/self/no/such/dir").unwrap_err();
    assert_eq!((e.tag(), e.tags()), (None, vec![]), "{e:?}");
    assert!(!e.to_string().contains('*'), "{e}");
    let io = || BackendError::Injected { op: "copy" };
    let e = Error::backend_of(&["kv_cache", "weights"], "restoring contents", io());
    assert_eq!(e.tags(), ["kv_cache", "weights"]);
    assert_eq!(e.tag(), Some("kv_cache"));
    assert!(e.to_string().contains("on `kv_cache`, `weights`"), "{e}");
    let e = Error::backend_of(&[], "opening the device", io());
    assert_eq!(
        e.to_string(),
        "opening the device failed: injected fault in copy"
    );
    let bug = BackendError::Internal {
        op: "save",
        reason: "no backup buffer".to_owned(),
    };
    assert_eq!(
        Error::backend("w", "saving", bug).code(),
        ErrorCode::Internal
    );
    let e = Error::Internal {
        tag: Some("w".to_owned()),
        reason: "x".to_owned(),
    };
    assert_eq!(e.code(), ErrorCode::Internal);
    assert!(e.to_string().contains("bug"), "{e}");
}

#[test]
fn each_error_has_its_code() {
    use gpu_pager::backend::host::{HostBackend, HostConfig};
    use gpu_pager::{Error, Pager, Policy};
    let pager = Pager::new(std::sync::Arc::new(HostBackend::new(HostConfig {
        capacity: 64 << 20,
        granularity: 2 << 20,
    })));
    let e = pager.info("nope").unwrap_err();
    assert_eq!(e.code(), ErrorCode::UnknownTag);
    pager.region("w", 4 << 20, Policy::Preserve).unwrap();
    let b = pager.alloc("w", 64).unwrap();
    pager.release(&["w"]).unwrap();
    let e = pager.ptr(&b).unwrap_err();
    assert!(matches!(e, Error::NotResident { .. }));
    assert_eq!(e.code(), ErrorCode::NotResident);
    let e = pager.region("w", 8 << 20, Policy::Discard).unwrap_err();
    assert_eq!(e.code(), ErrorCode::TagConflict);
}
