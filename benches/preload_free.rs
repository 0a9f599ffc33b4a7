//! criterion bench of the drop-in's `cudaFree` path (`gpu_pager_tms_cuda_free`, what the
//! preload library calls for every `cudaFree` of the process) on the host backend: a
//! pointer that is not routed (the runtime's, the common case) and a routed segment's
//! lookup, with 0 and with 5,000 routed segments live. The ratio of the two counts is the
//! figure: the lookup is by address, so it stays near 1.
//!
//!     cargo bench -p gpu-pager-benches --bench preload_free

use std::ffi::c_void;
use std::hint::black_box;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use gpu_pager_capi::gpu_pager_code;
use gpu_pager_tms::tms::{
    gpu_pager_tms_cuda_free, gpu_pager_tms_cuda_malloc, gpu_pager_tms_set_enabled,
    gpu_pager_tms_set_tag,
};

/// One free of a pointer that is not routed; returns whether it was routed.
fn free_unrouted() -> bool {
    let mut freed = false;
    // SAFETY: the out-pointer is valid.
    let code = unsafe { gpu_pager_tms_cuda_free(0x10 as *mut c_void, &mut freed) };
    assert_eq!(code, gpu_pager_code::GPU_PAGER_OK);
    freed
}

/// Median ns per call of `f` over 31 batches of 20,000.
fn median_ns(mut f: impl FnMut()) -> f64 {
    let mut runs: Vec<f64> = (0..31)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..20_000 {
                f();
            }
            t.elapsed().as_nanos() as f64 / 20_000.0
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

/// Routes `n` allocations of 4 KiB through the drop-in; returns their addresses.
fn route(n: usize) -> Vec<u64> {
    gpu_pager_tms_set_enabled(true);
    // SAFETY: a NUL-terminated literal.
    unsafe { gpu_pager_tms_set_tag(c"bench-free".as_ptr()) };
    let out = (0..n)
        .map(|_| {
            let (mut p, mut routed) = (null_mut::<c_void>(), false);
            // SAFETY: both out-pointers are valid.
            let code = unsafe { gpu_pager_tms_cuda_malloc(0, 4096, &mut p, &mut routed) };
            assert!(code == gpu_pager_code::GPU_PAGER_OK && routed);
            p as u64
        })
        .collect();
    gpu_pager_tms_set_enabled(false);
    out
}

fn bench(c: &mut Criterion) {
    let none = median_ns(|| {
        black_box(free_unrouted());
    });
    let live = route(5_000);
    let many = median_ns(|| {
        black_box(free_unrouted());
    });
    println!(
        "cudaFree of an unrouted pointer: {none:.3} ns with no segment, {many:.3} ns with \
         5,000 ({:.2}x)",
        many / none
    );
    c.bench_function("cuda_free unrouted, 5,000 segments live", |b| {
        b.iter(|| black_box(free_unrouted()))
    });
    c.bench_function("cuda_malloc + cuda_free routed, 5,000 segments live", |b| {
        b.iter(|| {
            let p = route(1)[0];
            let mut freed = false;
            // SAFETY: the out-pointer is valid.
            unsafe { gpu_pager_tms_cuda_free(p as *mut c_void, &mut freed) };
            assert!(freed);
        })
    });
    for p in live {
        let mut freed = false;
        // SAFETY: the out-pointer is valid.
        unsafe { gpu_pager_tms_cuda_free(p as *mut c_void, &mut freed) };
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    targets = bench
}
criterion_main!(benches);
