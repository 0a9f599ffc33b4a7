//! Shared by the GPU test files: a cross-process lock, seeded random data, comparisons.
#![allow(dead_code)]

pub mod broken;
pub mod kv_matrix;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{SystemTime, UNIX_EPOCH};

/// Serialises the GPU tests across threads and processes (nextest runs each test in its own
/// process): they measure free device memory and one of them exhausts it.
pub struct GpuLock(File);

pub fn gpu_lock() -> GpuLock {
    let path = std::env::temp_dir().join("gpu-pager-gpu-tests.lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .expect("open the GPU test lock file");
    // SAFETY: a plain flock on a descriptor we own; released when the file closes.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock {}", path.display());
    GpuLock(file)
}

/// splitmix64: small, fast, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn seeded(test: &str) -> Self {
        let seed = match std::env::var("GPU_PAGER_SEED") {
            Ok(s) => {
                let s = s.trim();
                let parsed = match s.strip_prefix("0x") {
                    Some(hex) => u64::from_str_radix(hex, 16),
                    None => s.parse(),
                };
                parsed.expect("GPU_PAGER_SEED must be a u64 (decimal or 0x-hex)")
            }
            Err(_) => {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .expect("clock after 1970");
                now.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32)
            }
        };
        eprintln!("{test}: seed {seed:#x} (replay with GPU_PAGER_SEED={seed:#x})");
        Rng(seed)
    }

    /// A generator from a fixed seed (e.g. one drawn from a seeded generator), silent.
    pub fn seeded_from(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        let (words, rest) = buf.as_chunks_mut::<8>();
        for w in words {
            *w = self.next_u64().to_le_bytes();
        }
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.fill(&mut v);
        v
    }
}

/// Compares byte buffers without dumping gigabytes on failure.
pub fn assert_bytes_eq(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if got == want {
        return;
    }
    let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    let count = got.iter().zip(want).filter(|(a, b)| a != b).count();
    let end = (first + 16).min(got.len());
    panic!(
        "{what}: {count} of {} bytes differ; first at {first}: got {:02x?}, want {:02x?}",
        got.len(),
        &got[first..end],
        &want[first..end]
    );
}

/// Divides the GPU tests' sizes (`GPU_PAGER_TEST_SCALE`, e.g. 16 under compute-sanitizer,
/// which slows kernels a lot).
pub fn scale() -> usize {
    std::env::var("GPU_PAGER_TEST_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&s: &usize| s > 0)
        .unwrap_or(1)
}

/// Device 0's CUDA backend; panics (the test fails) without a GPU.
pub fn gpu() -> std::sync::Arc<gpu_pager::backend::cuda::CudaBackend> {
    std::sync::Arc::new(
        gpu_pager::backend::cuda::CudaBackend::new(0)
            .expect("this test needs a CUDA GPU; none is usable"),
    )
}

/// Fails with the backend's deferred errors (failures recorded off the call path: an
/// unregister or unmap that failed in a drop) if there are any.
pub fn assert_no_deferred_errors(b: &gpu_pager::backend::cuda::CudaBackend) {
    use gpu_pager::backend::Backend;
    let errors = b.deferred_errors();
    assert_eq!(errors.total(), 0, "{:?}", errors.take());
}

/// Free device memory now.
pub fn free_bytes(b: &gpu_pager::backend::cuda::CudaBackend) -> usize {
    use gpu_pager::backend::Backend;
    b.mem_info().expect("cuMemGetInfo").free
}

/// The runs of `true` in `mask`, as ranges (what `Pager::overwritten` returns for a model's
/// per-byte marks).
pub fn runs_of(mask: &[bool]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(skip) = mask[at..].iter().position(|&m| m) {
        let start = at + skip;
        let len = mask[start..].iter().position(|&m| !m);
        at = len.map_or(mask.len(), |n| start + n);
        out.push(start..at);
    }
    out
}

/// All of buffer `b`'s bytes, read through the pager.
pub fn read(pager: &gpu_pager::Pager, b: &gpu_pager::Buffer) -> Vec<u8> {
    let mut out = vec![0u8; b.len()];
    pager.read(b, 0, &mut out).unwrap();
    out
}

/// Region `tag`'s entry of report `r`.
pub fn entry<'r>(r: &'r gpu_pager::Report, tag: &str) -> &'r gpu_pager::RegionReport {
    r.region(tag).unwrap()
}

/// Every buffer of `bufs` holds its bytes.
pub fn assert_intact(pager: &gpu_pager::Pager, bufs: &[(gpu_pager::Buffer, Vec<u8>)], what: &str) {
    for (i, (b, d)) in bufs.iter().enumerate() {
        assert!(read(pager, b) == *d, "{what}: buffer {i} differs");
    }
}

/// A pager config for small host tests: 8 MiB chunks, 1 MiB hash chunks, the rest default.
pub fn small_chunks() -> gpu_pager::PagerConfig {
    const MIB: usize = 1 << 20;
    gpu_pager::PagerConfig {
        chunk_bytes: 8 * MIB,
        tuning: gpu_pager::Tuning {
            hash_chunk_bytes: MIB,
            ..gpu_pager::Tuning::default()
        },
        ..gpu_pager::PagerConfig::default()
    }
}

/// A host backend of `capacity` bytes in granules of `granularity`, behind a
/// [`gpu_pager_testkit::FaultyBackend`] that plans no fault (to arm faults or count
/// calls), and a pager on it with `config`.
pub fn faulty_host_pager(
    capacity: usize,
    granularity: usize,
    config: gpu_pager::PagerConfig,
) -> (
    std::sync::Arc<gpu_pager::backend::host::HostBackend>,
    std::sync::Arc<gpu_pager_testkit::FaultyBackend>,
    gpu_pager::Pager,
) {
    use gpu_pager::backend::host::{HostBackend, HostConfig};
    use gpu_pager_testkit::{FaultPlan, FaultyBackend};
    use std::sync::Arc;
    let host = Arc::new(HostBackend::new(HostConfig {
        capacity,
        granularity,
    }));
    let faulty = Arc::new(FaultyBackend::new(host.clone(), FaultPlan::none()));
    let pager = gpu_pager::Pager::with_config(faulty.clone(), config);
    (host, faulty, pager)
}

/// A pager on a host backend of `capacity` bytes in 2 MiB granules, as on a GPU.
pub fn host_pager(capacity: usize) -> gpu_pager::Pager {
    use gpu_pager::backend::host::{HostBackend, HostConfig};
    gpu_pager::Pager::new(std::sync::Arc::new(HostBackend::new(HostConfig {
        capacity,
        granularity: 2 << 20,
    })))
}

/// A command that runs this test binary again, for tests that need a process of their own
/// (under the tests' emulator, if one is set: [`gpu_pager_testkit::driver_stub::command`]).
pub fn this_binary() -> std::process::Command {
    gpu_pager_testkit::driver_stub::command(
        std::env::current_exe().expect("the test knows its path"),
    )
}

/// Runs test `name` of module `module` (its `module_path!()`) alone in a child process of
/// this binary, with `env` added, and asserts that it passed there; returns `true` in the
/// parent (which then returns) and `false` in the child (which runs the test's body).
pub fn run_alone(module: &str, name: &str, env: &[(&str, &std::ffi::OsStr)]) -> bool {
    const CHILD: &str = "GPU_PAGER_TEST_ALONE";
    if std::env::var_os(CHILD).is_some() {
        return false;
    }
    let mut child = this_binary();
    child
        .args(["--exact", &test_path(module, name), "--test-threads", "1"])
        .env(CHILD, "1");
    for (k, v) in env {
        child.env(k, v);
    }
    let out = child.output().expect("the test binary runs");
    let log =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && log.contains("1 passed"),
        "{name} in its own process:\n{log}"
    );
    true
}

/// The name libtest gives test `name` of the module at `module` (its `module_path!()`): the
/// path inside the test binary, for running that one test alone in a child process.
pub fn test_path(module: &str, name: &str) -> String {
    let inside = module.split_once("::").map_or("", |(_, rest)| rest);
    if inside.is_empty() {
        name.to_owned()
    } else {
        format!("{inside}::{name}")
    }
}

/// Creates `tag` as the test tables write it: `bytes == 0` for a growing region, else a
/// fixed one of `bytes`.
pub fn table_region(
    pager: &gpu_pager::Pager,
    tag: &str,
    bytes: usize,
    policy: gpu_pager::Policy,
    options: gpu_pager::RegionOptions,
) -> gpu_pager::Result<gpu_pager::RegionInfo> {
    let kind = if bytes == 0 {
        gpu_pager::RegionKind::Growing
    } else {
        options.kind
    };
    pager.region_with(
        tag,
        bytes,
        policy,
        gpu_pager::RegionOptions { kind, ..options },
    )
}

/// The copy of all of `host` (pinned memory of a backend, from its start) to or from device
/// address `device`.
pub fn whole_copy(
    direction: gpu_pager::backend::Direction,
    host: &dyn gpu_pager::backend::HostBuffer,
    device: u64,
) -> gpu_pager::backend::RawCopy {
    gpu_pager::backend::RawCopy {
        direction,
        host: host.as_slice().as_ptr() as u64,
        host_device: host.device_ptr(),
        device,
        bytes: host.len(),
    }
}
