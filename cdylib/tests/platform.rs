//! What the shipped library asks of the platform, checked without a GPU:
//! - every driver entry point it can resolve is in CUDA 12.0's `cuda.h`, the driver floor's
//!   API (so no call can meet a missing symbol on a driver at or above the floor);
//! - every kernel fatbin holds SASS for each GPU architecture gpu-pager lists and PTX for
//!   the lowest, as `cuobjdump` reads it.
//!
//! Both tools come from PyPI into `.toolchain/` (`scripts/toolchain`): CUDA 12.0's headers
//! (nvidia-cuda-runtime-cu12 12.0) and cuobjdump.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpu_pager::kernels::KernelModule;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cdylib/ has a parent")
        .to_path_buf()
}

/// `.toolchain/lib/python3*/site-packages/<rel>`, or a failure that says how to get it.
fn toolchain_file(rel: &str) -> PathBuf {
    let lib = workspace().join(".toolchain/lib");
    std::fs::read_dir(&lib)
        .ok()
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages").join(rel))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{rel} not found under {}; run scripts/toolchain",
                lib.display()
            )
        })
}

/// `libgpu_pager.so` as cargo built it for this test (see tests/c.rs).
fn shared_library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its path");
    let deps = exe.parent().expect("the test lies in deps/");
    [
        Some(deps.join("libgpu_pager.so")),
        deps.parent().map(|d| d.join("libgpu_pager.so")),
    ]
    .into_iter()
    .flatten()
    .find(|p| p.is_file())
    .expect("cargo test builds libgpu_pager.so first")
}

/// The driver entry points the library can resolve. cudarc loads each one by name through
/// its wrapper in `cudarc::driver::sys`, which keeps the loaded pointer in a static `_S`;
/// the mangled names of those wrappers and statics (`...6driver3sys11cuMemCreate2_S...`)
/// name every entry point linked in.
fn resolvable_entry_points(library: &Path, module: &str) -> BTreeSet<String> {
    let nm = Command::new("nm")
        .arg(library)
        .output()
        .expect("nm (binutils) runs");
    assert!(nm.status.success(), "nm failed on {}", library.display());
    let text = String::from_utf8_lossy(&nm.stdout);
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices(module) {
        let rest = &text[at + module.len()..];
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        let Ok(len) = digits.parse::<usize>() else {
            continue;
        };
        let name = rest[digits.len()..].get(..len).unwrap_or_default();
        if name.len() > 2
            && name.starts_with("cu")
            && name[2..].starts_with(|c: char| c.is_ascii_uppercase())
        {
            names.insert(name.to_owned());
        }
    }
    names
}

#[test]
fn every_driver_entry_point_is_in_the_floor_api() {
    let header_path = toolchain_file("nvidia/cuda_runtime/include/cuda.h");
    let header = std::fs::read_to_string(&header_path).expect("cuda.h reads");
    assert!(
        header.contains("#define CUDA_VERSION 12000"),
        "{} is not CUDA 12.0's cuda.h",
        header_path.display()
    );
    // Every identifier of the header (declared functions, and the versioned names its
    // #defines map them to, e.g. cuMemcpyHtoDAsync -> cuMemcpyHtoDAsync_v2).
    let declared: BTreeSet<&str> = header
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("cu"))
        .collect();
    let used = resolvable_entry_points(&shared_library(), "6driver3sys");
    for expected in [
        "cuDriverGetVersion",
        "cuMemCreate",
        "cuMemMap",
        "cuLaunchKernel",
    ] {
        assert!(
            used.contains(expected),
            "{expected} not found among {used:?}"
        );
    }
    let missing: Vec<&String> = used
        .iter()
        .filter(|n| !declared.contains(n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "entry points newer than CUDA 12.0 (look them up at run time with a fallback): {missing:?}"
    );
    // The library never loads NVRTC (the kernels are compiled at build time).
    let nvrtc = resolvable_entry_points(&shared_library(), "5nvrtc3sys");
    assert!(nvrtc.is_empty(), "{nvrtc:?}");
}

/// SASS for these GPU architectures, PTX for the first (build.rs's lists).
const SASS: [&str; 6] = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"];

/// The PTX ISA that NVRTC 12.9 writes; its JIT needs a CUDA 12.9 driver, which every GPU
/// newer than sm_120 (the only ones that use the PTX) needs anyway.
const PTX_ISA: &str = ".version 8.8";

#[test]
fn every_fatbin_holds_sass_for_each_listed_gpu_and_ptx_for_later_ones() {
    let cuobjdump = toolchain_file("nvidia/cu13/bin/cuobjdump");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    for module in KernelModule::ALL {
        let path = dir.join(format!("{}.fatbin", module.name()));
        std::fs::write(&path, module.fatbin()).expect("the target tmpdir is writable");
        let run = |args: &[&str]| {
            let out = Command::new(&cuobjdump)
                .args(args)
                .arg(&path)
                .output()
                .expect("cuobjdump runs");
            assert!(
                out.status.success(),
                "cuobjdump {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let listed = run(&["--list-elf", "--list-ptx"]);
        let elf: Vec<&str> = listed
            .lines()
            .filter(|l| l.starts_with("ELF file"))
            .filter_map(|l| l.rsplit('.').nth(1))
            .collect();
        let ptx: Vec<&str> = listed
            .lines()
            .filter(|l| l.starts_with("PTX file"))
            .filter_map(|l| l.rsplit('.').nth(1))
            .collect();
        assert_eq!(elf, SASS, "{}: {listed}", module.name());
        assert_eq!(ptx, ["sm_80"], "{}: {listed}", module.name());
        let text = run(&["--dump-ptx"]);
        let versions: BTreeSet<&str> = text.lines().filter(|l| l.starts_with(".version")).collect();
        assert_eq!(versions, BTreeSet::from([PTX_ISA]), "{}", module.name());
    }
}
