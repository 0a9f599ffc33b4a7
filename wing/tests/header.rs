//! `include/gpu_pager_tms.h` is generated from this crate with the pinned cbindgen and checked
//! in; this test regenerates it and fails when the checked-in header is stale (rustls-ffi
//! does the same in CI). `GPU_PAGER_BLESS=1` writes the new header instead.

use std::path::Path;

#[test]
fn header_is_up_to_date() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = crate_dir.join("../include/gpu_pager_tms.h");
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("wing/cbindgen.toml parses");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header from wing/src")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    if std::env::var_os("GPU_PAGER_BLESS").is_some() {
        std::fs::write(&header, &generated).expect("include/gpu_pager_tms.h is writable");
        return;
    }
    let current = std::fs::read_to_string(&header).unwrap_or_default();
    assert!(
        current == generated,
        "include/gpu_pager_tms.h is stale (the C API in wing/src changed); regenerate it with\n\
         \n    GPU_PAGER_BLESS=1 cargo test -p gpu-pager-wing --test header\n\n\
         and commit it. First differing line: {:?}",
        current
            .lines()
            .zip(generated.lines())
            .find(|(a, b)| a != b)
            .map_or_else(
                || "(one header is a prefix of the other)".to_owned(),
                |(a, b)| format!("checked in {a:?}, generated {b:?}")
            )
    );
}
