//! A stand-in for the NVIDIA driver library, for the tests of the driver floor: builds
//! `tests/driver_stub/libcuda.c` with the system C compiler (`$CC`, else `cc`) into a fresh
//! folder. Put that folder on `LD_LIBRARY_PATH` of a child process, with
//! [`VERSION_ENV`] set: the child's gpu-pager then finds a driver of that version and no
//! device.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable the stand-in reads for its `cuDriverGetVersion` answer (e.g.
/// `11080` for CUDA 11.8).
pub const VERSION_ENV: &str = "GPU_PAGER_STUB_DRIVER_VERSION";

/// Builds the stand-in as `libcuda.so` in a new folder under the temporary directory and
/// returns the folder. Panics (a test helper) when the C compiler fails.
pub fn build() -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "gpu-pager-driver-stub-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("the temporary directory is writable");
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/driver_stub/libcuda.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let out = Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}` (set CC): {e}"));
    assert!(
        out.status.success(),
        "{cc} failed on {}: {}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

/// A command that runs the program `exe`: directly, or under the emulator command that the
/// environment variable `GPU_PAGER_TEST_RUNNER` names (`scripts/test-aarch64` runs the tests
/// with qemu-user, which does not follow `exec`, so the tests' own child processes need it).
pub fn command(exe: impl AsRef<std::ffi::OsStr>) -> Command {
    let runner = std::env::var("GPU_PAGER_TEST_RUNNER").unwrap_or_default();
    let mut words = runner.split_whitespace();
    let Some(emulator) = words.next() else {
        return Command::new(exe);
    };
    let mut cmd = Command::new(emulator);
    cmd.args(words).arg(exe);
    cmd
}
