//! `include/gpu_pager_tms.h` is generated from this crate with the pinned cbindgen and checked in;
//! this test regenerates it and fails when the checked-in header is stale
//! (`GPU_PAGER_BLESS=1` writes the new header instead).

#[path = "../../tests/shared/header_check.rs"]
mod header_check;

#[test]
fn header_is_up_to_date() {
    header_check::check(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")),
        "gpu_pager_tms.h",
    );
}
