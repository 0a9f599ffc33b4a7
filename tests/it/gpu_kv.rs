//! The paged KV cache on a real GPU: every kernel against its reference over the issue's
//! matrix ({bf16, f16, f32} × {NHD, HND} × head_dim {64, 80, 96, 128} × block_size {16, 32},
//! plus odd shapes), more blocks than one grid dimension, and the KvCache end to end with
//! device memory really returned by trim and release.
//!
//! Every test is `#[ignore = "needs a CUDA GPU"]` and fails (never passes) without one.
//! Run on the H200 with `bash .gpu/on-device gpu-tests` after `scripts/gpu-pack` (see `scripts/gpu-check`), and
//! under the memory checker with `scripts/gpu-check tests gpu_kv`.

use crate::common;

use std::sync::Arc;

use common::kv_matrix;
use common::{Rng, gpu_lock};

use gpu_pager::Pager;
use gpu_pager::backend::cuda::CudaBackend;

fn gpu_pager() -> Pager {
    Pager::new(Arc::new(
        CudaBackend::new(0).expect("this test needs a CUDA GPU; none is usable"),
    ))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_kv_kernel_matrix() {
    let _lock = gpu_lock();
    let pager = gpu_pager();
    kv_matrix::regions(&pager, "cache", "io", 64 << 20);
    let mut rng = Rng::seeded("gpu_kv_kernel_matrix");
    let shapes = kv_matrix::full_matrix();
    assert!(shapes.len() >= 48);
    for shape in shapes {
        kv_matrix::check_shape(
            &pager,
            "cache",
            "io",
            shape,
            Rng::seeded_from(rng.next_u64()),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_kv_many_blocks() {
    let _lock = gpu_lock();
    let pager = gpu_pager();
    kv_matrix::regions(&pager, "cache", "io", 8 << 20);
    kv_matrix::check_many_blocks(&pager, "cache", Rng::seeded("gpu_kv_many_blocks"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_kv_cache_scenario() {
    let _lock = gpu_lock();
    let pager = Arc::new(gpu_pager());
    let chunk = pager.backend().info().granularity.max(2 << 20);
    kv_matrix::cache_scenario(pager, chunk, Rng::seeded("gpu_kv_cache_scenario"));
}

/// `write_on` on a stream of the engine's: enqueued, then the stream synchronised, contents
/// exact.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_kv_write_on_an_engine_stream() {
    let _lock = gpu_lock();
    let backend =
        Arc::new(CudaBackend::new(0).expect("this test needs a CUDA GPU; none is usable"));
    let stream = backend.context().new_stream().expect("a stream");
    let pager = Arc::new(Pager::new(backend.clone()));
    let raw = gpu_pager::backend::RawStream(stream.cu_stream() as usize);
    kv_matrix::write_on_scenario(
        pager,
        raw,
        &|| stream.synchronize().expect("stream sync"),
        Rng::seeded("gpu_kv_write_on_an_engine_stream"),
    );
}
