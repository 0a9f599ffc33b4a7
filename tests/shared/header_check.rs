//! The check both C headers' tests run (capi's `include/gpu_pager.h`, the torch_memory_saver
//! model's `include/gpu_pager_tms.h`): each is generated from its crate with the pinned
//! cbindgen and checked in; the check regenerates it and fails when the checked-in header
//! is stale (rustls-ffi does the same in CI). `GPU_PAGER_BLESS=1` writes the new header
//! instead. Included by path from each crate's `tests/header.rs`.

use std::path::Path;

/// Regenerates `include/<name>` from the crate at `crate_dir` and compares.
pub fn check(crate_dir: &Path, name: &str) {
    let header = crate_dir.join("../include").join(name);
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("the crate's cbindgen.toml parses");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header from the crate's src")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    if std::env::var_os("GPU_PAGER_BLESS").is_some() {
        std::fs::write(&header, &generated).expect("the header is writable");
        return;
    }
    let current = std::fs::read_to_string(&header).unwrap_or_default();
    let package = crate_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("?");
    assert!(
        current == generated,
        "include/{name} is stale (the C API in {package}/src changed); regenerate it with\n\
         \n    GPU_PAGER_BLESS=1 cargo test --test header\n\n\
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
