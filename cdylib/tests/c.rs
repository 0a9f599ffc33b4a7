//! The C tests: C programs compiled with the system C compiler (`$CC`, else `cc`) against
//! `include/gpu_pager.h` and the `libgpu_pager.so` that cargo built for this package, then
//! run. On the GPU when there is one, else on the host backend (CI).
//!
//! Cargo builds a package's library before its integration tests, also when the library is
//! only a cdylib: the `.so` lies next to this test's `deps/` directory.

use std::path::{Path, PathBuf};

use gpu_pager_testkit::c_build::{self, built_library, workspace};

fn shared_library() -> PathBuf {
    built_library("libgpu_pager.so", "gpu-pager-cdylib")
}

fn cc(source: &Path, name: &str, args: &[&std::ffi::OsStr]) -> PathBuf {
    c_build::cc(
        source,
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(name),
        args,
    )
}

/// Compiles `source` into an executable linked against libgpu_pager.so.
fn compile(source: &Path, name: &str) -> PathBuf {
    let lib = shared_library();
    let lib_dir = lib.parent().expect("the library lies in a directory");
    let rpath = format!("-Wl,-rpath,{}", lib_dir.display());
    let strict = ["-std=c11".as_ref(), "-pedantic".as_ref()];
    cc(
        source,
        name,
        &[&strict[..], &[lib.as_os_str(), rpath.as_ref()]].concat(),
    )
}

/// Runs a compiled program; returns its stdout. Fails the test on a non-zero exit.
fn run(exe: &Path, env: &[(&str, &str)]) -> String {
    let mut cmd = gpu_pager_testkit::driver_stub::command(exe);
    cmd.env_remove(HOST_CAPACITY_ENV);
    // cargo puts target/<profile> on LD_LIBRARY_PATH, which outranks the program's runpath:
    // a libgpu_pager.so left there by an older `cargo build` would be loaded instead of the
    // one this test built.
    cmd.env_remove("LD_LIBRARY_PATH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "{} failed ({}):\n{stdout}\n{stderr}",
        exe.display(),
        out.status
    );
    stdout
}

use gpu_pager::registry::HOST_CAPACITY_ENV;

#[test]
fn wakeup_and_error_paths_from_c() {
    let exe = compile(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/wakeup.c"),
        "wakeup",
    );
    // 64 MiB of host "device memory": enough for the stages, small enough to run out.
    let out = run(&exe, &[(HOST_CAPACITY_ENV, "64M")]);
    assert!(out.trim_end().ends_with("ok"), "{out}");
}

/// A driver below the floor (the stand-in driver on `LD_LIBRARY_PATH`, run on its own since
/// `run` clears that variable): an error code and a message naming both versions.
#[test]
fn a_driver_below_the_floor_is_an_error_from_c() {
    let exe = compile(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/old_driver.c"),
        "old_driver",
    );
    let stub = gpu_pager_testkit::driver_stub::build();
    let out = gpu_pager_testkit::driver_stub::command(&exe)
        .env("LD_LIBRARY_PATH", &stub)
        .env(gpu_pager_testkit::driver_stub::VERSION_ENV, "11080")
        .output()
        .expect("the program runs");
    std::fs::remove_dir_all(&stub).ok();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.ends_with("ok\n"), "{stdout}");
}

/// The README's "## C" example, compiled and run as it stands there.
#[test]
fn readme_c_example() {
    let readme = std::fs::read_to_string(workspace().join("README.md")).expect("README.md");
    let section = readme
        .split("\n## C\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README.md has a \"## C\" section");
    let code = section
        .split("```c\n")
        .nth(1)
        .and_then(|s| s.split("\n```").next())
        .expect("the \"## C\" section has a ```c block");
    let source = Path::new(env!("CARGO_TARGET_TMPDIR")).join("readme_example.c");
    std::fs::write(&source, code).expect("the target tmpdir is writable");
    let exe = compile(&source, "readme_example");
    let out = run(&exe, &[]);
    assert!(out.contains("is released"), "{out}");
}

/// Every function the header declares is a dynamic symbol of the library, and the library
/// exports nothing else (Rust exports an rlib's `#[no_mangle]` functions from a cdylib).
#[test]
fn the_library_exports_exactly_the_header_functions() {
    let declared = c_build::declared("gpu_pager.h");
    assert!(declared.len() > 20, "{declared:?}");
    let exported = c_build::exported(&shared_library());
    assert_eq!(exported, declared);
}
