//! Build script: compiles every `kernels/*.cu` with NVRTC from a CUDA 12 toolkit into SASS
//! for each GPU architecture in [`SASS`] plus PTX for [`PTX`], packs them with nvFatbin into
//! `$OUT_DIR/<stem>.fatbin`, and mirrors `kernels/abi.h` into `$OUT_DIR/abi.rs` with
//! bindgen. `src/kernels/mod.rs` embeds both.
//!
//! Why CUDA 12 and these libraries: images from a CUDA 12 toolkit load on every driver from
//! CUDA 12.0 (r525) on, CUDA 13 drivers included, and NVRTC and nvFatbin are the CUDA 12
//! compilers on PyPI (its nvcc package holds only ptxas). The kernels need no other part of
//! CUDA, and no host compiler.
//!
//! Tools are looked up without root and without a system CUDA install:
//! - `libnvrtc.so.12` and `libnvfatbin.so.12` (12.8 or newer, for sm_100 and sm_120): in
//!   `$CUDA_HOME/lib64` or `$CUDA_PATH/lib64`, then under `nvidia/cuda_nvrtc/lib` and
//!   `nvidia/nvfatbin/lib` of the Python environment the build runs in (`$PYO3_PYTHON`,
//!   which maturin sets, else `python3`: `pip install ./python` brings them as build
//!   requirements), then of the project's `.toolchain/`;
//! - libclang (for bindgen): `$LIBCLANG_PATH`, then `clang/native/` in those same Python
//!   environments, then the system default.
//!
//! `scripts/toolchain` installs every one of them into `.toolchain/`.

#[path = "build/cuda12.rs"]
mod cuda12;

use cuda12::{Cuda12, Target};
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// How to get every tool this build needs.
const INSTALL_HINT: &str = "run `scripts/toolchain` from the repository root (installs NVRTC and nvFatbin \
     12.9 and libclang into .toolchain/, no root needed), or build with `pip install ./python`, which \
     brings them itself";

/// SASS for these architectures: A100 (80), A10/A40/RTX 30 (86), L40S/L4/RTX 40 (89),
/// H100/H200/GH200 (90), B200/GB200 (100; B300 runs it too), RTX 50/RTX PRO (120). A GPU runs
/// the SASS of its own major version with the highest minor not above its own.
const SASS: [u32; 6] = [80, 86, 89, 90, 100, 120];
/// PTX for this virtual architecture, which the driver JIT-compiles on GPUs newer than every
/// SASS above (the lowest, so that any later GPU can take it).
const PTX: u32 = 80;
/// NVRTC's oldest 12.x that knows every architecture in [`SASS`].
const NVRTC_MIN_MINOR: i32 = 8;

fn main() {
    let root =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels = root.join("kernels");
    let abi_h = kernels.join("abi.h");

    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", abi_h.display());
    println!("cargo:rerun-if-changed=build/cuda12.rs");
    for var in ["CUDA_HOME", "CUDA_PATH", "LIBCLANG_PATH", "PYO3_PYTHON"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let sources = cuda_sources(&kernels);
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
    }

    let site_dirs = python_site_dirs(&root);
    let cuda = load_cuda12(&site_dirs);
    compile_fatbins(&cuda, &kernels, &sources, &out_dir);

    generate_abi(&site_dirs, &abi_h, &out_dir.join("abi.rs"));
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

/// The `site-packages` folders to look in for the PyPI tools: the build's own Python
/// environment first (`sys.path` of `$PYO3_PYTHON`, else `python3`; under pip's isolated
/// build that includes the build requirements), then `.toolchain/lib/python3*/site-packages`.
fn python_site_dirs(root: &Path) -> Vec<PathBuf> {
    let python = env::var_os("PYO3_PYTHON")
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "python3".into());
    let mut dirs: Vec<PathBuf> = Command::new(&python)
        .args([
            "-c",
            "import sys; print('\\n'.join(p for p in sys.path if p))",
        ])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(PathBuf::from)
                .filter(|p| p.join("nvidia").is_dir() || p.join("clang").is_dir())
                .collect()
        })
        .unwrap_or_default();
    if let Ok(entries) = std::fs::read_dir(root.join(".toolchain").join("lib")) {
        let mut toolchain: Vec<PathBuf> = entries
            .filter_map(|entry| entry.ok())
            .filter(|entry| entry.file_name().to_string_lossy().starts_with("python3"))
            .map(|entry| entry.path().join("site-packages"))
            .filter(|p| p.is_dir())
            .collect();
        toolchain.sort();
        dirs.extend(toolchain.into_iter().rev());
    }
    dirs
}

/// The first existing `<dir>/<rel>` of the CUDA homes' `lib64` (for `lib64` files) or of the
/// site-packages folders.
fn find_cuda_lib(site_dirs: &[PathBuf], wheel_dir: &str, file: &str) -> Option<PathBuf> {
    ["CUDA_HOME", "CUDA_PATH"]
        .into_iter()
        .filter_map(|var| env::var_os(var).filter(|v| !v.is_empty()))
        .map(|home| PathBuf::from(home).join("lib64").join(file))
        .chain(
            site_dirs
                .iter()
                .map(|d| d.join("nvidia").join(wheel_dir).join("lib").join(file)),
        )
        .find(|p| p.is_file())
}

/// Ends the build with one error line that says what to do: a missing toolchain is the
/// user's to fix, not a bug, so no panic and no backtrace.
fn fail(message: String) -> ! {
    println!("cargo::error={message}");
    std::process::exit(1)
}

/// Loads NVRTC and nvFatbin 12.x (x ≥ [`NVRTC_MIN_MINOR`]), or fails saying how to get them.
fn load_cuda12(site_dirs: &[PathBuf]) -> Cuda12 {
    let find = |wheel_dir, file| {
        find_cuda_lib(site_dirs, wheel_dir, file).unwrap_or_else(|| {
            fail(format!(
                "{file} not found (looked in $CUDA_HOME/lib64, $CUDA_PATH/lib64 and \
                 nvidia/{wheel_dir}/lib of the Python environment and of .toolchain/); \
                 {INSTALL_HINT}"
            ))
        })
    };
    let nvrtc = find("cuda_nvrtc", "libnvrtc.so.12");
    let fatbin = find("nvfatbin", "libnvfatbin.so.12");
    println!("cargo:rerun-if-changed={}", nvrtc.display());
    let cuda =
        Cuda12::load(&nvrtc, &fatbin).unwrap_or_else(|e| fail(format!("{e}; {INSTALL_HINT}")));
    let (major, minor) = cuda.version();
    if major != 12 || minor < NVRTC_MIN_MINOR {
        fail(format!(
            "{} is NVRTC {major}.{minor}; the kernels need NVRTC 12.{NVRTC_MIN_MINOR} or a later \
             12.x (the oldest that compiles for sm_100 and sm_120); {INSTALL_HINT}",
            nvrtc.display()
        ));
    }
    cuda
}

/// Compiles every source for every target (one thread each: NVRTC programs are
/// independent) and writes one fatbin per source; panics with NVRTC's log if one fails.
fn compile_fatbins(cuda: &Cuda12, kernels: &Path, sources: &[PathBuf], out_dir: &Path) {
    let include = format!("--include-path={}", kernels.display());
    let options = [include, "-lineinfo".to_owned()];
    let targets: Vec<Target> = SASS
        .iter()
        .map(|&n| Target::Sass(n))
        .chain([Target::Ptx(PTX)])
        .collect();
    std::thread::scope(|scope| {
        let jobs: Vec<_> = sources
            .iter()
            .map(|src| {
                let stem = src
                    .file_stem()
                    .expect("a .cu file has a stem")
                    .to_string_lossy()
                    .into_owned();
                let text = std::fs::read_to_string(src)
                    .unwrap_or_else(|e| panic!("cannot read {}: {e}", src.display()));
                let name = src.file_name().map(|n| n.to_string_lossy().into_owned());
                let name = name.unwrap_or_default();
                let images: Vec<_> = targets
                    .iter()
                    .map(|&t| {
                        let (text, name, options) = (text.clone(), name.clone(), &options);
                        scope.spawn(move || cuda.compile(&text, &name, t, options))
                    })
                    .collect();
                (stem, images)
            })
            .collect();
        for (stem, images) in jobs {
            let images: Vec<_> = images
                .into_iter()
                .map(|j| {
                    j.join()
                        .expect("an NVRTC thread panicked")
                        .unwrap_or_else(|e| panic!("{e}"))
                })
                .collect();
            let fatbin = cuda
                .fatbin(&stem, &images)
                .unwrap_or_else(|e| panic!("packing {stem}.fatbin: {e}"));
            let path = out_dir.join(format!("{stem}.fatbin"));
            std::fs::write(&path, fatbin)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        }
    });
}

/// Mirrors `abi.h` into Rust with bindgen (libclang found as documented above).
fn generate_abi(site_dirs: &[PathBuf], abi_h: &Path, out: &Path) {
    if env::var_os("LIBCLANG_PATH").is_none()
        && let Some(dir) = site_dirs
            .iter()
            .map(|d| d.join("clang").join("native"))
            .find(|d| d.is_dir())
    {
        // SAFETY: build scripts run `main` on one thread (the NVRTC threads have ended) and
        // nothing else in this process reads or writes the environment concurrently;
        // clang-sys reads the variable below, on this thread, when bindgen loads libclang.
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
        fail(format!("bindgen could not load libclang (looked at $LIBCLANG_PATH, .toolchain and the system); {INSTALL_HINT}"))
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
