//! The KV kernels through `KvKernels::kv` on the host backend (CI): the same matrix the GPU
//! test runs (tests/gpu_kv.rs), against the reference, plus the checks every launcher makes.

use crate::common;

use std::sync::Arc;

use common::Rng;
use common::kv_matrix;

use gpu_pager::Pager;
use gpu_pager::backend::BackendError;
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::kv::{CacheView, DeviceSpan, KvDtype, KvLayout, KvOp, KvOrder};

fn host_pager() -> Pager {
    Pager::new(Arc::new(HostBackend::new(HostConfig::default())))
}

#[test]
fn kv_kernel_matrix_on_the_host_backend() {
    let pager = host_pager();
    kv_matrix::regions(&pager, "cache", "io", 16 << 20);
    let mut rng = Rng::seeded("kv_kernel_matrix_on_the_host_backend");
    for shape in kv_matrix::full_matrix() {
        let seed = Rng::seeded_from(rng.next_u64());
        kv_matrix::check_shape(&pager, "cache", "io", shape, seed);
    }
}

#[test]
fn kv_many_blocks_on_the_host_backend() {
    let pager = host_pager();
    kv_matrix::regions(&pager, "cache", "io", 8 << 20);
    kv_matrix::check_many_blocks(
        &pager,
        "cache",
        Rng::seeded("kv_many_blocks_on_the_host_backend"),
    );
}

/// Bad calls are refused before anything moves, with the reason.
#[test]
fn kv_calls_are_checked_first() {
    let pager = host_pager();
    kv_matrix::regions(&pager, "cache", "io", 4 << 20);
    let layout = KvLayout::new(2, 2, 8, 4, KvDtype::Bf16, KvOrder::Hnd).unwrap();
    let bpb = layout.bytes_per_block() as usize;
    let cache = pager.alloc("cache", 8 * bpb).unwrap();
    let pattern = vec![0x5Au8; 8 * bpb];
    pager.write(&cache, 0, &pattern).unwrap();
    let view = CacheView {
        layout,
        base: pager.ptr(&cache).unwrap(),
        blocks: 8,
    };
    let host = pager.backend().alloc_pinned(2 * bpb).unwrap();
    let span = DeviceSpan {
        addr: host.device_ptr(),
        len: host.len(),
    };
    let bad: Vec<(KvOp<'_>, &str)> = vec![
        (
            KvOp::SwapIn {
                cache: view,
                blocks: &[8],
                host: span,
            },
            "out of range",
        ),
        (
            KvOp::SwapIn {
                cache: view,
                blocks: &[1, 1],
                host: span,
            },
            "listed twice",
        ),
        (
            KvOp::SwapIn {
                cache: view,
                blocks: &[0, 1, 2],
                host: span,
            },
            "host buffer",
        ),
        (
            KvOp::CopyBlocks {
                cache: view,
                pairs: &[(0, 1), (1, 2)],
            },
            "also a source",
        ),
        (
            KvOp::Write {
                cache: view,
                layer: 0,
                keys: DeviceSpan {
                    addr: view.base + 64,
                    len: 64,
                },
                values: span,
                tokens: 1,
                token_stride_bytes: 32,
                slot_mapping: &[0],
            },
            "overlaps the cache",
        ),
        (
            KvOp::Write {
                cache: view,
                layer: 0,
                keys: span,
                values: span,
                tokens: 1,
                token_stride_bytes: 32,
                slot_mapping: &[32],
            },
            "slot 32 is out of range",
        ),
        (
            KvOp::Gather {
                cache: view,
                layer: 2,
                kv: gpu_pager::kv::Kv::K,
                block_table: &[0],
                tokens: 1,
                out: span,
            },
            "layer 2",
        ),
        (
            KvOp::SwapOut {
                cache: view,
                blocks: &[0],
                host: DeviceSpan {
                    addr: span.addr + 1,
                    len: span.len - 1,
                },
            },
            "the host address",
        ),
    ];
    for (op, what) in bad {
        // SAFETY: every span is live memory; the calls are refused before they touch it.
        let e = unsafe { pager.backend().kv_kernels().kv(&op) }.unwrap_err();
        assert!(matches!(e, BackendError::Invalid { .. }), "{op:?}: {e}");
        assert!(e.to_string().contains(what), "{op:?}: {e} lacks {what:?}");
    }
    let mut after = vec![0u8; pattern.len()];
    pager.read(&cache, 0, &mut after).unwrap();
    assert_eq!(after, pattern, "a refused call wrote to the cache");
}

#[test]
fn kv_cache_scenario_on_the_host_backend() {
    let pager = Arc::new(host_pager());
    let chunk = pager.backend().info().granularity.max(2 << 20);
    kv_matrix::cache_scenario(
        pager,
        chunk,
        Rng::seeded("kv_cache_scenario_on_the_host_backend"),
    );
}

/// A KvCache owns its region: a second cache on the tag is refused, dropping the cache
/// removes the region (memory back), and the tag can then host a new cache.
#[test]
fn kv_cache_owns_its_region() {
    use gpu_pager::kv::{KvCache, KvCacheConfig};
    let pager = Arc::new(host_pager());
    let layout = KvLayout::new(2, 2, 64, 16, KvDtype::F16, KvOrder::Nhd).unwrap();
    let cfg = KvCacheConfig::default();
    let a = KvCache::new(pager.clone(), "kv", layout, 512, cfg).unwrap();
    let s = a.create_seq().unwrap();
    a.append_tokens(s, 100).unwrap();
    let free = pager.backend().mem_info().unwrap().free;
    assert!(matches!(
        KvCache::new(pager.clone(), "kv", layout, 512, cfg),
        Err(gpu_pager::Error::InvalidArgument { .. })
    ));
    drop(a);
    assert!(pager.info("kv").is_err(), "the region went with the cache");
    assert!(
        pager.backend().mem_info().unwrap().free > free,
        "its memory came back"
    );
    let b = KvCache::new(pager.clone(), "kv", layout, 512, cfg).unwrap();
    assert_eq!(b.stats().unwrap().pool.live, 0);
}

/// `write_raw` from raw device spans (an engine's tensors) lands like `write`, and a span
/// inside the cache is refused.
#[test]
fn kv_write_raw_from_device_spans() {
    use gpu_pager::kv::{Kv, KvCache, KvCacheConfig};
    let pager = Arc::new(host_pager());
    let layout = KvLayout::new(1, 2, 8, 4, KvDtype::F32, KvOrder::Hnd).unwrap();
    let token = layout.token_bytes() as usize;
    let cache = KvCache::new(pager.clone(), "kv", layout, 64, KvCacheConfig::default()).unwrap();
    pager
        .region("io", 1 << 20, gpu_pager::Policy::Discard)
        .unwrap();
    let mut rng = Rng::seeded("kv_write_raw_from_device_spans");
    let (keys, values) = (rng.bytes(10 * token), rng.bytes(10 * token));
    let kb = pager.alloc("io", keys.len()).unwrap();
    let vb = pager.alloc("io", values.len()).unwrap();
    let out = pager.alloc("io", 10 * token).unwrap();
    pager.write(&kb, 0, &keys).unwrap();
    pager.write(&vb, 0, &values).unwrap();
    let s = cache.create_seq().unwrap();
    cache.append_tokens(s, 10).unwrap();
    let slots = cache.prepare_write(s, 0..10).unwrap();
    let span = |b: &gpu_pager::Buffer| DeviceSpan {
        addr: pager.ptr(b).unwrap(),
        len: b.len(),
    };
    // SAFETY: both spans are live pager buffers, written synchronously above.
    unsafe { cache.write_raw(0, span(&kb), span(&vb), 10, token, &slots) }.unwrap();
    for (kv, want) in [(Kv::K, &keys), (Kv::V, &values)] {
        cache.gather(0, kv, s, &out).unwrap();
        let mut got = vec![0u8; want.len()];
        pager.read(&out, 0, &mut got).unwrap();
        assert_eq!(&got, want, "{kv:?}");
    }
    let inside = DeviceSpan {
        addr: cache.k_ptr(0).unwrap(),
        len: 10 * token,
    };
    // SAFETY: refused by the checks before anything is read.
    let e = unsafe { cache.write_raw(0, inside, span(&vb), 10, token, &slots) }.unwrap_err();
    assert!(e.to_string().contains("overlaps the cache"), "{e}");
}

#[test]
fn kv_write_on_on_the_host_backend() {
    let pager = Arc::new(host_pager());
    kv_matrix::write_on_scenario(
        pager,
        gpu_pager::backend::RawStream(0),
        &|| {},
        Rng::seeded("kv_write_on_on_the_host_backend"),
    );
}
