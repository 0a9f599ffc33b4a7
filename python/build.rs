//! Builds the preload library (`preload/gpu_pager_preload.c`, plain C: it must load into
//! any process, Python or not) into the package directory, `gpu_pager/`, so that maturin
//! puts it in the wheel beside the extension module it loads.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let source = manifest.join("../preload/gpu_pager_preload.c");
    // The drop-in's header (and the product's it includes), for the types of the core
    // functions the library looks up.
    let include = manifest.join("../include");
    let out = manifest.join("gpu_pager/libgpu_pager_preload.so");
    println!("cargo:rerun-if-changed={}", source.display());
    for header in ["gpu_pager.h", "gpu_pager_tms.h"] {
        println!("cargo:rerun-if-changed={}", include.join(header).display());
    }
    // Quiet: under zig (the manylinux wheels) cc's compiler probe warns about the glibc
    // suffix of the target, which zig cc takes as it should.
    let compiler = cc::Build::new().cargo_warnings(false).get_compiler();
    let status = compiler
        .to_command()
        .args([
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fvisibility=hidden",
        ])
        .arg("-I")
        .arg(&include)
        .arg("-o")
        .arg(&out)
        .arg(&source)
        .args(["-ldl", "-lpthread"])
        .status()
        .expect("the C compiler runs");
    assert!(status.success(), "compiling {} failed", source.display());

    // The library lies in the source tree (maturin packs the package folder), where builds
    // for every target write it: watch it, so that a build finding it gone writes it again
    // (scripts/wheels removes it around each build for another architecture), and date it
    // back to its source's time, so that writing it here does not make the next build stale.
    println!("cargo:rerun-if-changed={}", out.display());
    let source_time = std::fs::metadata(&source)
        .and_then(|m| m.modified())
        .expect("the source has a modification time");
    std::fs::File::options()
        .write(true)
        .open(&out)
        .and_then(|f| f.set_modified(source_time))
        .expect("the library just built can be dated");
}
