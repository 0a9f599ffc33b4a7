//! `Pager::configure`: a device's settings, chosen before its pager exists. Its own test
//! binary, so that no other test creates device 0's pager first.

use gpu_pager::{CopyRoute, ErrorCode, Pager, PagerConfig};

#[test]
fn settings_apply_to_the_pager_created_after_them_and_stay() {
    let config = PagerConfig {
        chunk_bytes: 3 << 20,
        skip_unchanged: false,
        verify_restore: true,
        save_route: CopyRoute::Fastest,
        restore_route: CopyRoute::Engine,
        resident_warning_bytes: 1 << 30,
        ..PagerConfig::default()
    };
    // SAFETY: this binary's one test, before anything reads the environment.
    unsafe { std::env::set_var(gpu_pager::POISON_DISCARDS_ENV, "1") };
    // SAFETY: as above.
    unsafe { std::env::set_var(gpu_pager::RECLAIM_SCRUBBED_ENV, " No ") };
    // SAFETY: as above.
    unsafe { std::env::set_var(gpu_pager::PREPIN_ENV, "yes") };
    // A chunk of 0 bytes means nothing: refused, naming the setting (review item 15).
    let zero = PagerConfig {
        chunk_bytes: 0,
        ..PagerConfig::default()
    };
    let e = Pager::configure(0, zero).unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    assert!(e.to_string().contains("chunk_bytes = 0"), "{e}");
    // Before first use, a later call replaces an earlier one.
    Pager::configure(0, PagerConfig::default()).unwrap();
    Pager::configure(0, config).unwrap();
    let pager = Pager::for_device(0).unwrap();
    let got = pager.config();
    assert_eq!(got.chunk_bytes, 4 << 20, "rounded up to a power of two");
    assert!(!got.skip_unchanged && got.verify_restore);
    assert_eq!(got.resident_warning_bytes, 1 << 30);
    assert!(
        got.poison_discards,
        "{} turns it on",
        gpu_pager::POISON_DISCARDS_ENV
    );
    assert!(got.prepin, "{} turns it on", gpu_pager::PREPIN_ENV);
    assert!(
        !got.tuning.reclaim_scrubbed,
        "{} turns it off",
        gpu_pager::RECLAIM_SCRUBBED_ENV
    );
    assert_eq!(
        (got.save_route, got.restore_route),
        (CopyRoute::Fastest, CopyRoute::Engine)
    );
    // The same settings again are accepted (also as the pager rounded them) ...
    Pager::configure(0, config).unwrap();
    Pager::configure(0, got).unwrap();
    // ... other settings are refused once the pager exists, and change nothing.
    let e = Pager::configure(0, PagerConfig::default()).unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    let msg = e.to_string();
    assert!(
        msg.contains("device 0") && msg.contains("before its first use"),
        "{msg}"
    );
    assert_eq!(Pager::for_device(0).unwrap().config(), got);
}
