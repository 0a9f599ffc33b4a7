//! Short stress runs on the host backend (no GPU needed): random concurrent releases,
//! resumes, writes and leases with injected faults, every buffer checked, no leak.

use std::sync::Arc;
use std::time::Duration;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::stress::{self, StressConfig, StressSummary};

fn run(cfg: &StressConfig) -> StressSummary {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity: 1 << 30,
        granularity: 2 << 20,
    }));
    let summary = stress::run(backend.clone(), cfg, &|_| {}).expect("the stress starts");
    eprintln!("{summary}");
    assert_eq!(backend.used_bytes(), 0, "all device memory back");
    summary
}

#[test]
fn short_run_with_faults_is_clean_and_recovers_every_fault() {
    let cfg = StressConfig {
        duration: Duration::from_secs(3),
        threads: 3,
        seed: 0x5EED,
        faults: true,
        ..StressConfig::default()
    };
    let s = run(&cfg);
    assert!(s.ok(), "{s}");
    assert!(s.cycles > 0, "{s}");
    assert!(s.injected.total() > 0, "backend faults were injected: {s}");
    assert!(s.oom_faults > 0, "out-of-memory was injected: {s}");
    assert_eq!(s.faults_recovered, s.faults_injected, "{s}");
    assert!(
        s.ops.verifies > 0 && s.ops.readbacks > 0 && s.ops.kv_ops > 0,
        "{s}"
    );
}

#[test]
fn a_fixed_seed_runs_clean_twice() {
    let cfg = StressConfig {
        duration: Duration::from_millis(1500),
        threads: 2,
        seed: 42,
        ..StressConfig::default()
    };
    for _ in 0..2 {
        let s = run(&cfg);
        assert!(s.ok(), "{s}");
        assert_eq!(s.seed, 42);
    }
}

#[test]
fn without_faults_nothing_is_injected_and_other_pager_settings_hold() {
    let cfg = StressConfig {
        duration: Duration::from_millis(800),
        threads: 2,
        faults: false,
        skip_unchanged: false,
        verify_restore: true,
        ..StressConfig::default()
    };
    let s = run(&cfg);
    assert!(s.ok(), "{s}");
    assert_eq!(s.faults_injected, 0);
    assert_eq!(s.ops.hogs, 0);
}

#[test]
fn bad_configurations_are_errors() {
    let backend = Arc::new(HostBackend::new(HostConfig::default()));
    for cfg in [
        StressConfig {
            threads: 0,
            ..StressConfig::default()
        },
        StressConfig {
            verify_chunk_bytes: 100,
            ..StressConfig::default()
        },
        StressConfig {
            graph_bytes: 0,
            ..StressConfig::default()
        },
    ] {
        assert!(stress::run(backend.clone(), &cfg, &|_| {}).is_err());
    }
}

/// A backend that breaks the pager's contract on purpose, to show the stress notices.
mod broken {
    use gpu_pager::backend::host::HostBackend;
    use gpu_pager::backend::{
        Backend, BackendResult, DeviceInfo, Held, HostBuffer, Mapping, MemInfo, RawStream,
        Reservation,
    };
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Flaw {
        /// Every restore copy lands with one byte flipped.
        FlipRestores,
        /// Every 5th map also takes memory that is never given back.
        LeakOnMap,
    }

    #[derive(Debug)]
    pub struct Broken(pub HostBackend, pub Flaw, pub AtomicU64);

    impl Backend for Broken {
        fn info(&self) -> &DeviceInfo {
            self.0.info()
        }
        fn mem_info(&self) -> BackendResult<MemInfo> {
            self.0.mem_info()
        }
        fn reserve(&self, bytes: usize) -> BackendResult<Box<dyn Reservation>> {
            self.0.reserve(bytes)
        }
        unsafe fn map(&self, at: u64, sizes: &[usize]) -> BackendResult<Vec<Box<dyn Mapping>>> {
            if self.1 == Flaw::LeakOnMap && self.2.fetch_add(1, Ordering::SeqCst) % 5 == 4 {
                if let Ok(h) = self.0.hog(self.0.info().granularity) {
                    Box::leak(h);
                }
            }
            // SAFETY: forwarded from the caller.
            unsafe { self.0.map(at, sizes) }
        }
        fn synchronize(&self) -> BackendResult<()> {
            self.0.synchronize()
        }
        fn alloc_pinned(&self, bytes: usize) -> BackendResult<Box<dyn HostBuffer>> {
            self.0.alloc_pinned(bytes)
        }
        unsafe fn copy_to_device(&self, dst: u64, src: &[u8]) -> BackendResult<()> {
            // SAFETY: forwarded from the caller.
            unsafe { self.0.copy_to_device(dst, src) }
        }
        unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64) -> BackendResult<()> {
            // SAFETY: forwarded from the caller.
            unsafe { self.0.copy_to_host(dst, src) }
        }
        unsafe fn copy_to_device_async(
            &self,
            dst: u64,
            src: &[u8],
            stream: Option<RawStream>,
        ) -> BackendResult<()> {
            // SAFETY: forwarded from the caller.
            unsafe { self.0.copy_to_device_async(dst, src, stream) }?;
            if self.1 == Flaw::FlipRestores && !src.is_empty() {
                let mid = src.len() / 2;
                // SAFETY: `dst + mid` lies inside the range the caller guarantees mapped.
                unsafe { self.0.copy_to_device(dst + mid as u64, &[src[mid] ^ 0x10]) }?;
            }
            Ok(())
        }
        unsafe fn copy_to_host_async(&self, dst: &mut [u8], src: u64) -> BackendResult<()> {
            // SAFETY: forwarded from the caller.
            unsafe { self.0.copy_to_host_async(dst, src) }
        }
        fn wait_copies(&self) -> BackendResult<()> {
            self.0.wait_copies()
        }
        fn hog(&self, bytes: usize) -> BackendResult<Box<dyn Held>> {
            self.0.hog(bytes)
        }
        unsafe fn fill(&self, dst: u64, bytes: usize, pattern: u32) -> BackendResult<()> {
            // SAFETY: forwarded from the caller.
            unsafe { self.0.fill(dst, bytes, pattern) }
        }
        unsafe fn chunk_hash(
            &self,
            src: u64,
            bytes: usize,
            chunk: usize,
        ) -> BackendResult<Vec<u64>> {
            // SAFETY: forwarded from the caller.
            unsafe { self.0.chunk_hash(src, bytes, chunk) }
        }
    }
}

#[test]
fn the_stress_catches_corrupted_restores_and_leaks() {
    use broken::{Broken, Flaw};
    for flaw in [Flaw::FlipRestores, Flaw::LeakOnMap] {
        let host = HostBackend::new(HostConfig {
            capacity: 1 << 30,
            granularity: 2 << 20,
        });
        let backend = Arc::new(Broken(host, flaw, Default::default()));
        let cfg = StressConfig {
            duration: Duration::from_millis(1000),
            threads: 2,
            faults: false,
            ..StressConfig::default()
        };
        let s = stress::run(backend, &cfg, &|_| {}).expect("the stress starts");
        eprintln!("{flaw:?}: {s}");
        assert!(!s.ok(), "{flaw:?} went unnoticed: {s}");
        match flaw {
            Flaw::FlipRestores => assert!(s.corruptions > 0, "{s}"),
            Flaw::LeakOnMap => assert!(s.leaked_bytes > 0, "{s}"),
        }
    }
}
