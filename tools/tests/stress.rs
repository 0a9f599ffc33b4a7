//! Short stress runs on the host backend (no GPU needed): random concurrent releases,
//! resumes, writes and leases with injected faults, every buffer checked, no leak.

#[path = "../../tests/it/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager_tools::stress::{self, StressConfig, StressSummary};

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
    assert_eq!(
        s.faults_recovered + s.faults_absorbed,
        s.faults_injected,
        "{s}"
    );
    assert!(
        s.ops.verifies > 0 && s.ops.readbacks > 0 && s.ops.kv_ops > 0,
        "{s}"
    );
    // Owners marked buffers overwritten, and releases skipped some of them.
    assert!(s.ops.marks > 0 && s.ops.marked_rewrites > 0, "{s}");
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

#[test]
fn the_stress_catches_corrupted_restores_and_leaks() {
    use common::broken::{Broken, Flaw};
    for flaw in [Flaw::FlipRestores, Flaw::LeakOnMap, Flaw::FlipKvWrites] {
        let host = HostBackend::new(HostConfig {
            capacity: 1 << 30,
            granularity: 2 << 20,
        });
        let backend = Arc::new(Broken::new(host, flaw));
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
            Flaw::FlipRestores | Flaw::FlipKvWrites => assert!(s.corruptions > 0, "{s}"),
            Flaw::LeakOnMap => assert!(s.leaked_bytes > 0, "{s}"),
        }
    }
}
