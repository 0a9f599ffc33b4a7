//! Build script: compiles every `kernels/*.cu` into `$OUT_DIR/<stem>.fatbin` with nvcc
//! (sm_80 and sm_90 SASS plus compute_90 PTX) and mirrors `kernels/abi.h` into
//! `$OUT_DIR/abi.rs` with bindgen. `src/kernels/mod.rs` embeds both.
//!
//! Tools are looked up without root and without a system CUDA install:
//! - nvcc: `$NVCC`, then `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, then `nvcc` on `PATH`,
//!   then the project's own `.toolchain/lib/python3*/site-packages/nvidia/cu13/bin/nvcc`;
//! - libclang (for bindgen): `$LIBCLANG_PATH`, then the project's
//!   `.toolchain/lib/python3*/site-packages/clang/native/`, then the system default.
//!
//! `scripts/toolchain` installs both into `.toolchain/`.

use std::env;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The one command that installs every tool this build needs.
const INSTALL_HINT: &str = "run `scripts/toolchain` from the repository root (installs nvcc 13.0 and libclang \
     into .toolchain/, no root needed)";

/// Code generation: SASS for sm_80 (A100) and sm_90 (H100/H200), and compute_90 PTX that
/// newer GPUs JIT-compile.
const NVCC_ARCH_FLAGS: &[&str] = &[
    "-gencode",
    "arch=compute_80,code=sm_80",
    "-gencode",
    "arch=compute_90,code=[sm_90,compute_90]",
];

fn main() {
    let root =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels = root.join("kernels");
    let abi_h = kernels.join("abi.h");

    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", abi_h.display());
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "LIBCLANG_PATH",
        "NVCC_CCBIN",
        "CXX",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let sources = cuda_sources(&kernels);
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
    }

    let nvcc = find_nvcc(&root).unwrap_or_else(|| {
        panic!(
            "nvcc not found (looked at $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH and \
             .toolchain/lib/python3*/site-packages/nvidia/cu13/bin); {INSTALL_HINT}"
        )
    });
    if let Some(version) = nvcc_version(&nvcc) {
        println!("cargo:rustc-env=GP_NVCC_VERSION={version}");
    }
    compile_fatbins(&nvcc, &kernels, &sources, &out_dir);

    generate_abi(&root, &abi_h, &out_dir.join("abi.rs"));
}

/// Every `kernels/*.cu`, sorted so the build is deterministic.
fn cuda_sources(kernels: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(kernels)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", kernels.display()));
    let mut sources: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "cu"))
        .collect();
    sources.sort();
    sources
}

/// nvcc in the documented order, or `None`.
fn find_nvcc(root: &Path) -> Option<PathBuf> {
    if let Some(nvcc) = env::var_os("NVCC").filter(|v| !v.is_empty()) {
        // An explicit choice is taken as is (a bare name is resolved through PATH).
        return Some(PathBuf::from(nvcc));
    }
    ["CUDA_HOME", "CUDA_PATH"]
        .into_iter()
        .filter_map(|var| env::var_os(var).filter(|v| !v.is_empty()))
        .map(|home| PathBuf::from(home).join("bin").join("nvcc"))
        .find(|p| p.is_file())
        .or_else(|| {
            env::var_os("PATH").and_then(|path| {
                env::split_paths(&path)
                    .map(|dir| dir.join("nvcc"))
                    .find(|p| p.is_file())
            })
        })
        .or_else(|| toolchain_path(root, "nvidia/cu13/bin/nvcc").filter(|p| p.is_file()))
}

/// `<root>/.toolchain/lib/python3*/site-packages/<rel>` for the first python version folder
/// where it exists.
fn toolchain_path(root: &Path, rel: &str) -> Option<PathBuf> {
    let lib = root.join(".toolchain").join("lib");
    let mut pythons: Vec<PathBuf> = std::fs::read_dir(lib)
        .ok()?
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("python3"))
        .map(|entry| entry.path().join("site-packages").join(rel))
        .filter(|p| p.exists())
        .collect();
    pythons.sort();
    pythons.pop()
}

/// The line of `nvcc --version` that names the release, e.g.
/// "Cuda compilation tools, release 13.0, V13.0.88".
fn nvcc_version(nvcc: &Path) -> Option<String> {
    let out = Command::new(nvcc).arg("--version").output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|line| line.contains("release"))
        .map(|line| line.trim().to_owned())
}

/// The host C++ compiler that nvcc should preprocess with, as the `cc` crate picks it
/// (honouring `CXX` and its target-specific forms), unless `NVCC_CCBIN` already tells nvcc.
fn host_compiler() -> Option<PathBuf> {
    if env::var_os("NVCC_CCBIN").is_some() {
        return None;
    }
    cc::Build::new()
        .cpp(true)
        .cargo_metadata(false)
        .try_get_compiler()
        .ok()
        .map(|tool| tool.path().to_owned())
}

/// Runs nvcc on every source (all at once; each is a separate process) and panics with
/// nvcc's diagnostics if any fails.
fn compile_fatbins(nvcc: &Path, kernels: &Path, sources: &[PathBuf], out_dir: &Path) {
    let ccbin = host_compiler();
    let jobs: Vec<(PathBuf, std::io::Result<std::process::Child>)> = sources
        .iter()
        .map(|src| {
            let stem = src.file_stem().expect("a .cu file has a stem");
            let mut fatbin = OsString::from(stem);
            fatbin.push(".fatbin");
            let mut cmd = Command::new(nvcc);
            cmd.arg("-fatbin")
                .arg("-O3")
                .arg("-lineinfo")
                .args(NVCC_ARCH_FLAGS)
                .arg("-I")
                .arg(kernels);
            if let Some(ccbin) = &ccbin {
                cmd.arg("-ccbin").arg(ccbin);
            }
            cmd.arg(src)
                .arg("-o")
                .arg(out_dir.join(fatbin))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            (src.clone(), cmd.spawn())
        })
        .collect();

    for (src, child) in jobs {
        let output: Output = child
            .and_then(|c| c.wait_with_output())
            .unwrap_or_else(|e| panic!("cannot run {}: {e}; {INSTALL_HINT}", nvcc.display()));
        if !output.status.success() {
            panic!(
                "nvcc failed on {} ({}):\n{}{}",
                src.display(),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr),
            );
        }
        // Warnings reach the developer through `cargo build -vv`.
        let stderr = String::from_utf8_lossy(&output.stderr);
        for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
            println!("cargo:warning=nvcc: {line}");
        }
    }
}

/// Mirrors `abi.h` into Rust with bindgen (libclang found as documented above).
fn generate_abi(root: &Path, abi_h: &Path, out: &Path) {
    if env::var_os("LIBCLANG_PATH").is_none()
        && let Some(dir) = toolchain_path(root, "clang/native")
    {
        // SAFETY: build scripts run `main` on one thread and nothing else in this process
        // reads or writes the environment concurrently; clang-sys reads the variable
        // below, on this thread, when bindgen loads libclang.
        unsafe { env::set_var("LIBCLANG_PATH", dir) };
    }

    let builder = bindgen::Builder::default()
        .header(abi_h.to_string_lossy())
        .allowlist_type("Gp.*")
        .allowlist_var("GP_.*")
        .derive_default(true)
        .derive_copy(true)
        .derive_debug(true)
        .layout_tests(true)
        .parse_callbacks(Box::new(UnsignedHashConstants))
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));

    // bindgen panics ("Unable to find libclang") when libclang cannot be loaded; say how to
    // get it.
    let generated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || builder.generate())).unwrap_or_else(|_| {
        panic!("bindgen could not load libclang (looked at $LIBCLANG_PATH, .toolchain and the system); {INSTALL_HINT}")
    });
    let bindings =
        generated.unwrap_or_else(|e| panic!("bindgen failed on {}: {e}", abi_h.display()));
    bindings
        .write_to_file(out)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

/// bindgen types an integer macro above `i64::MAX` as `i64` (two's complement); the hash
/// constants are `...ULL` in C and must be `u64` in Rust.
#[derive(Debug)]
struct UnsignedHashConstants;

impl bindgen::callbacks::ParseCallbacks for UnsignedHashConstants {
    fn int_macro(&self, name: &str, _value: i64) -> Option<bindgen::callbacks::IntKind> {
        name.starts_with("GP_HASH_")
            .then_some(bindgen::callbacks::IntKind::U64)
    }
}
