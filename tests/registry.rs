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
