//! The preload library (`preload/gpu_pager_preload.c`) against the wing's shared library,
//! `libgpu_pager_tms.so` (the core with the `gpu_pager_tms_*` functions), with a stand-in
//! CUDA runtime opened after the first call, and forked children while a thread is inside
//! the drop-in (see `tests/c/preload.c`). The wing's exports are checked against its header
//! and the product's.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use gpu_pager::registry::HOST_CAPACITY_ENV;
use gpu_pager_testkit::c_build::{self, built_library, workspace};

fn cc(source: &Path, name: &str, args: &[&OsStr]) -> PathBuf {
    c_build::cc(
        source,
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(name),
        args,
    )
}

fn wing_library() -> PathBuf {
    built_library("libgpu_pager_tms.so", "gpu-pager-tms")
}

#[test]
fn the_preload_library_finds_a_late_runtime_and_never_hangs_a_fork_child() {
    let c = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
    let shared = [OsStr::new("-shared"), "-fPIC".as_ref()];
    // As python/build.rs builds it for the wheel.
    let preload = cc(
        &workspace().join("preload/gpu_pager_preload.c"),
        "libgpu_pager_preload.so",
        &[
            &shared[..],
            &[
                "-O2".as_ref(),
                "-fvisibility=hidden".as_ref(),
                "-ldl".as_ref(),
                "-lpthread".as_ref(),
            ],
        ]
        .concat(),
    );
    let runtime_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake-cudart");
    std::fs::create_dir_all(&runtime_dir).expect("the scratch directory is writable");
    let runtime = cc(
        &c.join("fake_cudart.c"),
        "fake-cudart/libcudart.so.12",
        &shared,
    );
    let exe = cc(
        &c.join("preload.c"),
        "preload",
        &["-ldl".as_ref(), "-lpthread".as_ref()],
    );
    let mut cmd = gpu_pager_testkit::driver_stub::command(&exe);
    let out = cmd
        .args([&preload, &runtime])
        .env("GPU_PAGER_CORE", wing_library())
        .env(HOST_CAPACITY_ENV, "64M")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("the program runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.ends_with("ok\n"),
        "{}\n{stdout}\n{stderr}",
        out.status
    );
}

/// The wing's library exports the product's functions and the drop-in's, nothing else;
/// the product's header declares no `gpu_pager_tms_` function.
#[test]
fn the_wing_exports_its_header_and_the_product_declares_none_of_it() {
    let product = c_build::declared("gpu_pager.h");
    let wing = c_build::declared("gpu_pager_tms.h");
    assert!(
        product.iter().all(|f| !f.starts_with("gpu_pager_tms_")),
        "{product:?}"
    );
    assert!(
        wing.len() >= 19 && wing.iter().all(|f| f.starts_with("gpu_pager_tms_")),
        "{wing:?}"
    );
    let exported = c_build::exported(&wing_library());
    let mut both = [product, wing].concat();
    both.sort();
    assert_eq!(exported, both);
}
