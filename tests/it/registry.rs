//! The per-device registry: one pager per device and process, from any thread.

use std::sync::Arc;

use gpu_pager::backend::BackendKind;
use gpu_pager::{ErrorCode, Pager, Policy};

#[test]
fn one_pager_per_device_from_any_thread() {
    let pagers: Vec<Arc<Pager>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| s.spawn(|| Pager::for_device(0).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for p in &pagers {
        assert!(Arc::ptr_eq(p, &pagers[0]));
    }
    let p = Pager::for_device(0).unwrap();
    assert!(Arc::ptr_eq(&p, &pagers[0]));
    // What one thread creates, another sees.
    p.region("registry-test", 4 << 20, Policy::Discard).unwrap();
    let seen = std::thread::spawn(|| Pager::for_device(0).unwrap().info("registry-test"))
        .join()
        .unwrap()
        .unwrap();
    assert_eq!(seen.size, 4 << 20);
    p.remove("registry-test").unwrap();
}

#[test]
fn without_a_gpu_device_0_is_host_and_others_are_errors() {
    let p = Pager::for_device(0).unwrap();
    match p.backend_kind() {
        BackendKind::Host => {
            assert!(gpu_pager::registry::host_fallback().is_some());
            let e = Pager::for_device(1).unwrap_err();
            assert_eq!(e.code(), ErrorCode::Backend);
            let msg = e.to_string();
            assert!(
                msg.contains("device 1") && msg.contains("device 0"),
                "{msg}"
            );
            // Failures are not cached: the call tries again (and fails the same way).
            assert!(Pager::for_device(1).is_err());
        }
        BackendKind::Cuda => {
            assert!(gpu_pager::registry::host_fallback().is_none());
        }
    }
}

/// Each device's pager has its own backend and regions, and a call on one device leaves
/// the caller's current context alone. Needs a GPU; with only one it checks device 0 and
/// says that the two-device half was skipped (no second GPU to test on).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_each_device_has_its_own_pager() {
    let p0 = Pager::for_device(0).unwrap();
    assert_eq!(
        p0.backend_kind(),
        BackendKind::Cuda,
        "this test needs a CUDA GPU"
    );
    p0.region("per-device", 64 << 20, Policy::Preserve).unwrap();
    let b = p0.alloc("per-device", 4096).unwrap();
    p0.write(&b, 0, &[3u8; 4096]).unwrap();
    match Pager::for_device(1) {
        Ok(p1) => {
            assert!(!Arc::ptr_eq(&p0, &p1));
            assert!(
                p1.info("per-device").is_err(),
                "device 1 has its own regions"
            );
            p1.region("per-device", 64 << 20, Policy::Discard).unwrap();
            p1.release(&["per-device"]).unwrap();
            let mut back = [0u8; 4096];
            p0.read(&b, 0, &mut back).unwrap();
            assert_eq!(
                back, [3u8; 4096],
                "device 0 untouched by device 1's release"
            );
            p1.remove("per-device").unwrap();
        }
        Err(e) => eprintln!("skipped the two-device half: no second GPU ({e})"),
    }
    p0.remove("per-device").unwrap();
}
