//! The driver floor: a driver older than CUDA 12.0 gets an error that names the version
//! found and the one needed, and one at or above it goes on. The driver is a stand-in
//! ([`driver_stub`]) that `LD_LIBRARY_PATH` puts before any real
//! one; each case runs in a child process, since the driver library is loaded once per
//! process.

use crate::common;

use gpu_pager::ErrorCode;
use gpu_pager_testkit::driver_stub;

const CHILD: &str = "GPU_PAGER_DRIVER_FLOOR_TEST";

/// Runs test `name` alone in a child whose driver reports `version`; panics unless it passed.
fn with_driver(version: &str, name: &str) {
    let dir = driver_stub::build();
    let out = common::this_binary()
        .args(["--exact", &common::test_path(module_path!(), name)])
        .args(["--test-threads", "1", "--nocapture"])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", &dir)
        .env(driver_stub::VERSION_ENV, version)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let log =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && log.contains("1 passed"), "{log}");
}

#[test]
fn a_driver_below_the_floor_is_an_error_naming_both_versions() {
    if std::env::var_os(CHILD).is_none() {
        return with_driver(
            "11080",
            "a_driver_below_the_floor_is_an_error_naming_both_versions",
        );
    }
    let err = match gpu_pager::registry::open_backend(0) {
        Ok((_, why)) => panic!("opened a backend on a CUDA 11.8 driver (host fallback: {why:?})"),
        Err(e) => e,
    };
    assert_eq!(err.code(), ErrorCode::Backend);
    let msg = err.to_string();
    for part in [
        "CUDA 11.8",
        "11080",
        "CUDA 12.0 or newer",
        "update the NVIDIA driver",
    ] {
        assert!(msg.contains(part), "{part:?} not in: {msg}");
    }
    // Every pager of the process says the same (the registry behind the C and Python layers).
    let err = gpu_pager::Pager::for_device(0).expect_err("no pager on CUDA 11.8");
    assert!(err.to_string().contains("CUDA 11.8"), "{err}");
}

#[test]
fn a_driver_at_or_above_the_floor_passes_the_check() {
    if std::env::var_os(CHILD).is_none() {
        for version in ["12000", "13000"] {
            with_driver(version, "a_driver_at_or_above_the_floor_passes_the_check");
        }
        return;
    }
    // The stand-in has no device: past the check, cuInit says so and device 0 falls back to
    // the host backend with that reason.
    let (_, why) = gpu_pager::backend::auto(0).expect("host fallback");
    let why = why.expect("the stand-in has no GPU");
    assert!(why.contains("CUDA_ERROR_NO_DEVICE"), "{why}");
}

#[test]
fn a_link_stub_driver_falls_back_to_the_host() {
    if std::env::var_os(CHILD).is_none() {
        return with_driver("stub", "a_link_stub_driver_falls_back_to_the_host");
    }
    // A CUDA toolkit's link stub (CUDA_ERROR_STUB_LIBRARY) is no driver: the host backend,
    // with the reason, as when libcuda.so is missing.
    let (_, why) = gpu_pager::backend::auto(0).expect("host fallback, not an error");
    let why = why.expect("a stub is no GPU");
    assert!(why.contains("link stub"), "{why}");
}
