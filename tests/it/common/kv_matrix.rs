//! The KV kernel matrix, shared by the host test (CI) and the GPU test: every kernel
//! through `KvKernels::kv` against `kv::reference` on fresh random data, outputs poisoned
//! first, whole buffers compared byte for byte.

use std::sync::Arc;

use gpu_pager::backend::Backend;
use gpu_pager::kv::{
    CacheView, DeviceSpan, Kv, KvCache, KvCacheConfig, KvDtype, KvError, KvLayout, KvOp, KvOrder,
    SeqId, reference,
};
use gpu_pager::{Buffer, Error, Pager, Policy};

use super::{Rng, assert_bytes_eq};

/// One shape of the matrix.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub dtype: KvDtype,
    pub order: KvOrder,
    pub head_dim: u32,
    pub block_size: u32,
    pub kv_heads: u32,
    pub layers: u32,
    pub blocks: u32,
}

/// {bf16, f16, f32} × {NHD, HND} × head_dim {64, 80, 96, 128} × block_size {16, 32}, plus
/// odd shapes that force narrow accesses (head_dim 5 in bf16 = 10-byte rows, 3 in f32).
pub fn full_matrix() -> Vec<Shape> {
    let mut v = Vec::new();
    for dtype in [KvDtype::Bf16, KvDtype::F16, KvDtype::F32] {
        for order in [KvOrder::Nhd, KvOrder::Hnd] {
            for head_dim in [64, 80, 96, 128] {
                for block_size in [16, 32] {
                    v.push(Shape {
                        dtype,
                        order,
                        head_dim,
                        block_size,
                        kv_heads: 1 + (head_dim / 16) % 4,
                        layers: 2,
                        blocks: 24,
                    });
                }
            }
            // Odd rows (2-byte accesses), 8-byte rows, and 16 heads × 128 (more vectors per
            // token than threads: the inner loop runs).
            v.push(Shape {
                dtype,
                order,
                head_dim: 128,
                block_size: 16,
                kv_heads: 16,
                layers: 1,
                blocks: 8,
            });
            for (head_dim, block_size) in [(5, 16), (3, 3), (1, 1), (4, 8)] {
                v.push(Shape {
                    dtype,
                    order,
                    head_dim,
                    block_size,
                    kv_heads: 3,
                    layers: 3,
                    blocks: 10,
                });
            }
        }
    }
    v
}

/// Device buffers of one run and their host mirrors.
struct Run<'p> {
    pager: &'p Pager,
    backend: Arc<dyn Backend>,
    rng: Rng,
}

impl Run<'_> {
    fn buffer(&mut self, tag: &str, len: usize, data: &[u8]) -> Buffer {
        let b = self.pager.alloc(tag, len).expect("alloc");
        self.pager.write(&b, 0, data).expect("write");
        b
    }

    fn read(&self, b: &Buffer) -> Vec<u8> {
        let mut out = vec![0u8; b.len()];
        self.pager.read(b, 0, &mut out).expect("read");
        out
    }

    fn span(&self, b: &Buffer, offset: usize) -> DeviceSpan {
        DeviceSpan {
            addr: self.pager.ptr(b).expect("ptr") + offset as u64,
            len: b.len() - offset,
        }
    }

    fn run(&self, op: &KvOp<'_>) {
        // SAFETY: every span of the ops built here lies in a live buffer of a resident
        // region (or a pinned buffer), and the calls are synchronous.
        unsafe { self.backend.kv_kernels().kv(op) }.unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }

    /// Distinct random values below `n`, `k` of them.
    fn distinct(&mut self, n: u64, k: usize) -> Vec<u64> {
        let mut all: Vec<u64> = (0..n).collect();
        for i in 0..k.min(all.len()) {
            let j = i + (self.rng.next_u64() % (all.len() - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }

    fn below(&mut self, n: u64) -> u64 {
        self.rng.next_u64() % n
    }
}

/// Runs every kernel on `shape` in regions `cache_tag` and `io_tag` of `pager` (both
/// resident, large enough) and compares with the reference.
pub fn check_shape(pager: &Pager, cache_tag: &str, io_tag: &str, shape: Shape, rng: Rng) {
    let layout = KvLayout::new(
        shape.layers,
        shape.kv_heads,
        shape.head_dim,
        shape.block_size,
        shape.dtype,
        shape.order,
    )
    .unwrap();
    let mut t = Run {
        pager,
        backend: pager.backend().clone(),
        rng,
    };
    let ctx = format!("{shape:?}");
    let bpb = layout.bytes_per_block() as usize;
    let cache_len = bpb * shape.blocks as usize;
    let mut mirror = t.rng.bytes(cache_len); // poison: random, never zeros
    let cache_buf = t.buffer(cache_tag, cache_len, &mirror);
    let view = CacheView {
        layout,
        base: pager.ptr(&cache_buf).unwrap(),
        blocks: shape.blocks,
    };
    let token = reference::token_bytes(&layout) as usize;
    let elem = layout.dtype().size() as usize;
    let slots_total = u64::from(shape.blocks) * u64::from(shape.block_size);

    // write: a padded token stride (one extra element: narrower accesses), some padding
    // slots, distinct slots otherwise; keys and values at a 2-byte offset half the time.
    for (extra, offset) in [(0usize, 0usize), (elem, 0), (16, 2)] {
        let tokens = 1 + t.below(slots_total.min(40)) as usize;
        let stride = token + extra;
        let need = (tokens - 1) * stride + token;
        let keys = t.rng.bytes(need + offset + 7);
        let values = t.rng.bytes(need + offset + 7);
        let kb = t.buffer(io_tag, keys.len(), &keys);
        let vb = t.buffer(io_tag, values.len(), &values);
        let mut slots: Vec<i64> = t
            .distinct(slots_total, tokens)
            .into_iter()
            .map(|s| s as i64)
            .collect();
        for s in slots.iter_mut() {
            if t.below(5) == 0 {
                *s = -1 - t.below(3) as i64;
            }
        }
        let layer = t.below(u64::from(shape.layers)) as u32;
        t.run(&KvOp::Write {
            cache: view,
            layer,
            keys: t.span(&kb, offset),
            values: t.span(&vb, offset),
            tokens,
            token_stride_bytes: stride,
            slot_mapping: &slots,
        });
        reference::write(
            &mut mirror,
            &layout,
            layer,
            &keys[offset..],
            &values[offset..],
            tokens,
            stride,
            &slots,
        )
        .unwrap();
        assert_bytes_eq(
            &format!("write {ctx} stride+{extra} offset {offset}"),
            &t.read(&cache_buf),
            &mirror,
        );
        pager.free(&kb).unwrap();
        pager.free(&vb).unwrap();
    }

    // copy_blocks: distinct destinations, sources outside them (fan-out allowed).
    let n = shape.blocks as usize;
    let picked = t.distinct(u64::from(shape.blocks), n);
    let (dsts, srcs) = picked.split_at(n / 2);
    let pairs: Vec<(u32, u32)> = dsts
        .iter()
        .map(|&d| (srcs[t.below(srcs.len() as u64) as usize] as u32, d as u32))
        .collect();
    t.run(&KvOp::CopyBlocks {
        cache: view,
        pairs: &pairs,
    });
    reference::copy_blocks(&mut mirror, &layout, &pairs).unwrap();
    assert_bytes_eq(&format!("copy_blocks {ctx}"), &t.read(&cache_buf), &mirror);

    // gather: a random table (repeats allowed), a partial last block, both K and V.
    for kv in [Kv::K, Kv::V] {
        let tokens = 1 + t.below(u64::from(shape.block_size) * 5) as usize;
        let table: Vec<u32> = (0..tokens.div_ceil(shape.block_size as usize) + 1)
            .map(|_| t.below(u64::from(shape.blocks)) as u32)
            .collect();
        // The output at an 8-byte offset for V: narrower accesses on the output side.
        let offset = if kv == Kv::V { 8 } else { 0 };
        let mut out = t.rng.bytes(tokens * token + 24);
        let ob = t.buffer(io_tag, out.len(), &out);
        let layer = t.below(u64::from(shape.layers)) as u32;
        t.run(&KvOp::Gather {
            cache: view,
            layer,
            kv,
            block_table: &table,
            tokens,
            out: t.span(&ob, offset),
        });
        reference::gather(
            &mirror,
            &layout,
            layer,
            kv,
            &table,
            tokens,
            &mut out[offset..],
        )
        .unwrap();
        assert_bytes_eq(&format!("gather {kv:?} {ctx}"), &t.read(&ob), &out);
        pager.free(&ob).unwrap();
    }

    // swap_out (repeats allowed) into poisoned pinned memory, then swap_in of distinct
    // blocks from fresh random host data.
    let count = 1 + t.below(u64::from(shape.blocks)) as usize;
    let blocks: Vec<u32> = (0..count)
        .map(|_| t.below(u64::from(shape.blocks)) as u32)
        .collect();
    let mut host = pager.backend().alloc_pinned(count * bpb + 40).unwrap();
    t.rng.fill(host.as_mut_slice());
    let mut want = host.as_slice().to_vec();
    let span = DeviceSpan {
        addr: host.device_ptr(),
        len: host.len(),
    };
    t.run(&KvOp::SwapOut {
        cache: view,
        blocks: &blocks,
        host: span,
    });
    reference::swap_out(&mirror, &layout, &blocks, &mut want).unwrap();
    assert_bytes_eq(&format!("swap_out {ctx}"), host.as_slice(), &want);

    let blocks: Vec<u32> = t
        .distinct(u64::from(shape.blocks), count)
        .into_iter()
        .map(|b| b as u32)
        .collect();
    t.rng.fill(host.as_mut_slice());
    t.run(&KvOp::SwapIn {
        cache: view,
        blocks: &blocks,
        host: span,
    });
    reference::swap_in(&mut mirror, &layout, &blocks, host.as_slice()).unwrap();
    assert_bytes_eq(&format!("swap_in {ctx}"), &t.read(&cache_buf), &mirror);

    pager.free(&cache_buf).unwrap();
}

/// More blocks than one grid's y dimension (65,535): the move kernel must stride.
pub fn check_many_blocks(pager: &Pager, cache_tag: &str, mut rng: Rng) {
    let layout = KvLayout::new(1, 1, 8, 1, KvDtype::F16, KvOrder::Nhd).unwrap(); // 32-byte blocks
    let blocks = 70_000u32;
    let bpb = layout.bytes_per_block() as usize;
    let mirror = rng.bytes(bpb * blocks as usize);
    let cache = pager.alloc(cache_tag, mirror.len()).unwrap();
    pager.write(&cache, 0, &mirror).unwrap();
    let view = CacheView {
        layout,
        base: pager.ptr(&cache).unwrap(),
        blocks,
    };
    let list: Vec<u32> = (0..blocks).rev().collect();
    let mut host = pager.backend().alloc_pinned(mirror.len()).unwrap();
    rng.fill(host.as_mut_slice());
    let op = KvOp::SwapOut {
        cache: view,
        blocks: &list,
        host: DeviceSpan {
            addr: host.device_ptr(),
            len: host.len(),
        },
    };
    // SAFETY: the cache buffer and the pinned buffer are live for the synchronous call.
    unsafe { pager.backend().kv_kernels().kv(&op) }.unwrap();
    let mut want = vec![0u8; mirror.len()];
    reference::swap_out(&mirror, &layout, &list, &mut want).unwrap();
    assert_bytes_eq("swap_out of 70,000 blocks", host.as_slice(), &want);
    pager.free(&cache).unwrap();
}

/// Regions for [`check_shape`]: `cache_tag` and `io_tag`, `Discard`, `bytes` each.
pub fn regions(pager: &Pager, cache_tag: &str, io_tag: &str, bytes: usize) {
    pager.region(cache_tag, bytes, Policy::Discard).unwrap();
    pager.region(io_tag, bytes, Policy::Discard).unwrap();
}

/// Tokens of one sequence as the cache must return them: per layer, K and V
/// `[tokens, kv_heads, head_dim]`.
type SeqData = Vec<[Vec<u8>; 2]>;

fn gather_all(cache: &KvCache, pager: &Pager, seq: SeqId, out: &Buffer, token: usize) -> SeqData {
    (0..cache.layout().layers())
        .map(|layer| {
            [Kv::K, Kv::V].map(|kv| {
                let n = cache.gather(layer, kv, seq, out).unwrap() as usize;
                let mut bytes = vec![0u8; n * token];
                pager.read(out, 0, &mut bytes).unwrap();
                bytes
            })
        })
        .collect()
}

/// Writes fresh random keys and values for tokens `range` of `seq` into every layer
/// (through `prepare_write`, so shared blocks are copied first) and records them in `data`.
fn write_tokens(
    cache: &KvCache,
    pager: &Pager,
    rng: &mut Rng,
    seq: SeqId,
    range: std::ops::Range<u64>,
    data: &mut SeqData,
    io: (&Buffer, &Buffer),
) {
    let token = reference::token_bytes(cache.layout()) as usize;
    let slots = cache.prepare_write(seq, range.clone()).unwrap();
    let n = slots.len();
    for (layer, planes) in data.iter_mut().enumerate() {
        let keys = rng.bytes(n * token);
        let values = rng.bytes(n * token);
        pager.write(io.0, 0, &keys).unwrap();
        pager.write(io.1, 0, &values).unwrap();
        cache
            .write(layer as u32, io.0, io.1, n, token, &slots)
            .unwrap();
        for (plane, new) in planes.iter_mut().zip([keys, values]) {
            let start = range.start as usize * token;
            plane.resize(plane.len().max(range.end as usize * token), 0);
            plane[start..start + n * token].copy_from_slice(&new);
        }
    }
}

fn free_now(pager: &Pager) -> usize {
    pager.backend().mem_info().unwrap().free
}

/// The KV cache end to end on `pager`'s backend: sequences, writes, gather, fork with
/// copy-on-write, swap out and in, trim giving memory back, release making every id stale,
/// lazy resume. `chunk` is the region's chunk size (the unit of backing).
pub fn cache_scenario(pager: Arc<Pager>, chunk: usize, mut rng: Rng) {
    let layout = KvLayout::new(4, 2, 64, 16, KvDtype::Bf16, KvOrder::Hnd).unwrap();
    let bpb = layout.bytes_per_block() as usize; // 32 KiB
    let per_chunk = chunk / bpb;
    let blocks = (16 * per_chunk) as u32;
    let token = reference::token_bytes(&layout) as usize;
    pager.region("kv_io", 4 << 20, Policy::Discard).unwrap();
    let kb = pager.alloc("kv_io", 1 << 20).unwrap();
    let vb = pager.alloc("kv_io", 1 << 20).unwrap();
    let out = pager.alloc("kv_io", 1 << 20).unwrap();
    let free_before = free_now(&pager);
    let cache = KvCache::new(
        pager.clone(),
        "kv_cache",
        layout,
        blocks,
        KvCacheConfig { chunk_bytes: chunk },
    )
    .unwrap();
    assert_eq!(cache.chunk_bytes(), chunk);
    assert_eq!(cache.stats().unwrap().mapped_bytes, 0, "created unbacked");
    let k0 = cache.k_ptr(0).unwrap();

    // Prefill: 300 tokens = 19 blocks, all in chunk 0.
    let a = cache.create_seq().unwrap();
    let new = cache.append_tokens(a, 300).unwrap();
    assert_eq!(new.len(), 19);
    assert_eq!(cache.stats().unwrap().mapped_bytes, chunk);
    assert!(
        free_now(&pager) + chunk <= free_before,
        "backing took device memory"
    );
    let mut a_data: SeqData = vec![[vec![], vec![]]; 4];
    write_tokens(&cache, &pager, &mut rng, a, 0..300, &mut a_data, (&kb, &vb));
    assert!(
        gather_all(&cache, &pager, a, &out, token) == a_data,
        "gather after prefill"
    );

    // Fork, grow the child, rewrite tokens 290..320 of it: block 18 is shared, so the child
    // gets a copy first; the parent must not change.
    let b = cache.fork(a).unwrap();
    cache.append_tokens(b, 20).unwrap();
    let mut b_data = a_data.clone();
    write_tokens(
        &cache,
        &pager,
        &mut rng,
        b,
        290..320,
        &mut b_data,
        (&kb, &vb),
    );
    assert!(
        gather_all(&cache, &pager, a, &out, token) == a_data,
        "parent changed by the child's write"
    );
    assert!(
        gather_all(&cache, &pager, b, &out, token) == b_data,
        "child after copy-on-write"
    );
    let (tb, _) = cache.block_table(b).unwrap();
    let (ta, _) = cache.block_table(a).unwrap();
    assert_eq!(tb[..18], ta[..18], "untouched blocks stay shared");
    assert_ne!(tb[18], ta[18], "the written shared block was copied");
    // Slots in a shared block are refused (they would write the parent's KV too).
    let shared_slot = i64::from(tb[0].index) * 16;
    let e = cache
        .write(0, &kb, &vb, 1, token, &[shared_slot])
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Kv {
                error: KvError::InvalidArgument { .. },
                ..
            }
        ),
        "{e}"
    );
    // A token range past the sequence is refused before anything is allocated.
    let e = cache.prepare_write(b, 0..(1 << 62)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Kv {
                error: KvError::OutOfRange { .. },
                ..
            }
        ),
        "{e}"
    );
    // One cache per region.
    let e = KvCache::new(
        pager.clone(),
        "kv_cache",
        layout,
        blocks,
        KvCacheConfig { chunk_bytes: chunk },
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");

    // A long sequence maps many chunks; freeing it and trimming gives them back.
    let c = cache.create_seq().unwrap();
    cache
        .append_tokens(c, (12 * per_chunk * 16) as u64)
        .unwrap();
    let mapped = cache.stats().unwrap().mapped_bytes;
    assert!(mapped >= 12 * chunk, "{mapped} bytes mapped");
    let free_full = free_now(&pager);
    cache.free_seq(c).unwrap();
    let trimmed = cache.trim().unwrap();
    assert_eq!(trimmed, mapped - chunk, "everything but chunk 0 trimmed");
    assert_eq!(cache.stats().unwrap().mapped_bytes, chunk);
    assert!(
        free_now(&pager) >= free_full + trimmed,
        "trim returned the memory"
    );
    assert!(
        gather_all(&cache, &pager, b, &out, token) == b_data,
        "trim kept live blocks"
    );

    // Preempt b: swap its blocks out, free it, bring it back into new blocks.
    let (tb, b_tokens) = cache.block_table(b).unwrap();
    let mut host = cache.alloc_host(tb.len() as u32).unwrap();
    cache.swap_out(&tb, &mut host).unwrap();
    cache.free_seq(b).unwrap();
    let d = cache.create_seq().unwrap();
    let td = cache.append_tokens(d, b_tokens).unwrap();
    cache.swap_in(&td, &host).unwrap();
    assert!(
        gather_all(&cache, &pager, d, &out, token) == b_data,
        "swap out, swap in"
    );
    assert!(
        matches!(cache.swap_in(&tb, &host), Err(Error::Kv { .. })),
        "swap into freed blocks is refused"
    );

    // Exhaustion changes nothing.
    let e = cache.append_tokens(a, u64::from(blocks) * 16).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Kv {
                error: KvError::KvExhausted { .. },
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(cache.block_table(a).unwrap().1, 300);

    // Release: memory back, every id stale, calls refused; resume maps nothing.
    let free_mapped = free_now(&pager);
    pager.release(&["kv_cache"]).unwrap();
    assert!(
        free_now(&pager) >= free_mapped + chunk,
        "release returned the memory"
    );
    assert!(matches!(cache.create_seq(), Err(Error::NotResident { .. })));
    assert!(matches!(
        cache.gather(0, Kv::K, a, &out),
        Err(Error::NotResident { .. })
    ));
    pager.resume(&["kv_cache"]).unwrap();
    assert_eq!(cache.stats().unwrap().mapped_bytes, 0, "resume maps lazily");
    let e = cache.gather(0, Kv::K, a, &out).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Kv {
                error: KvError::UnknownSeq { .. },
                ..
            }
        ),
        "{e}"
    );
    let e = cache.copy_blocks(&[(td[0], td[1])]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Kv {
                error: KvError::Stale { .. },
                ..
            }
        ),
        "{e}"
    );
    let e = cache.swap_out(&td, &mut host).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Kv {
                error: KvError::Stale { .. },
                ..
            }
        ),
        "{e}"
    );
    // A slot in a block that is no longer allocated.
    let e = cache
        .write(0, &kb, &vb, 1, token, &[i64::from(td[0].index) * 16])
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Kv {
                error: KvError::InvalidArgument { .. },
                ..
            }
        ),
        "{e}"
    );

    // Fresh start after the resume, at the same addresses.
    assert_eq!(cache.k_ptr(0).unwrap(), k0);
    let e2 = cache.create_seq().unwrap();
    cache.append_tokens(e2, 40).unwrap();
    assert_eq!(cache.stats().unwrap().mapped_bytes, chunk);
    let mut e_data: SeqData = vec![[vec![], vec![]]; 4];
    write_tokens(&cache, &pager, &mut rng, e2, 0..40, &mut e_data, (&kb, &vb));
    assert!(
        gather_all(&cache, &pager, e2, &out, token) == e_data,
        "after release and resume"
    );
    let s = cache.stats().unwrap();
    assert_eq!((s.pool.live, s.live_bytes), (3, 3 * bpb as u64));

    // The cache owns its region: removing it under the cache is refused, and the cache
    // keeps working; dropping the cache removes it.
    drop(host);
    let e = pager.remove("kv_cache").unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(
        gather_all(&cache, &pager, e2, &out, token) == e_data,
        "after the refused remove"
    );
    drop(cache);
    assert!(matches!(
        pager.info("kv_cache"),
        Err(Error::UnknownTag { .. })
    ));
}

/// `write_on` (enqueued on `stream`, slot mapping read from device memory) lands exactly
/// like `write`; a bad slot is refused on the host before anything is enqueued. `sync`
/// waits for `stream`.
pub fn write_on_scenario(
    pager: Arc<Pager>,
    stream: gpu_pager::backend::RawStream,
    sync: &dyn Fn(),
    mut rng: Rng,
) {
    let layout = KvLayout::new(3, 4, 128, 16, KvDtype::Bf16, KvOrder::Nhd).unwrap();
    let token = layout.token_bytes() as usize;
    let cache = KvCache::new(
        pager.clone(),
        "kv_on",
        layout,
        256,
        KvCacheConfig::default(),
    )
    .unwrap();
    pager.region("kv_on_io", 8 << 20, Policy::Discard).unwrap();
    let n = 200usize;
    let (keys, values) = (rng.bytes(n * token), rng.bytes(n * token));
    let kb = pager.alloc("kv_on_io", keys.len()).unwrap();
    let vb = pager.alloc("kv_on_io", values.len()).unwrap();
    let out = pager.alloc("kv_on_io", n * token).unwrap();
    let sb = pager.alloc("kv_on_io", n * 8).unwrap();
    pager.write(&kb, 0, &keys).unwrap();
    pager.write(&vb, 0, &values).unwrap();
    let s = cache.create_seq().unwrap();
    cache.append_tokens(s, n as u64).unwrap();
    let slots = cache.prepare_write(s, 0..n as u64).unwrap();
    let slot_bytes: Vec<u8> = slots.iter().flat_map(|x| x.to_le_bytes()).collect();
    pager.write(&sb, 0, &slot_bytes).unwrap();
    let span = |b: &Buffer| DeviceSpan {
        addr: pager.ptr(b).unwrap(),
        len: b.len(),
    };
    let dev_slots = pager.ptr(&sb).unwrap();
    for layer in [0u32, 2] {
        // SAFETY: the buffers are live pager buffers written synchronously above; the
        // device slot mapping holds `slots`; `sync` waits before anything is read.
        unsafe {
            cache.write_on(
                stream,
                layer,
                span(&kb),
                span(&vb),
                n,
                token,
                &slots,
                dev_slots,
            )
        }
        .unwrap();
    }
    sync();
    for layer in [0u32, 2] {
        for (kv, want) in [(Kv::K, &keys), (Kv::V, &values)] {
            cache.gather(layer, kv, s, &out).unwrap();
            let mut got = vec![0u8; want.len()];
            pager.read(&out, 0, &mut got).unwrap();
            assert_bytes_eq(&format!("write_on layer {layer} {kv:?}"), &got, want);
        }
    }
    let bad = [i64::from(layout.block_size()) * 200];
    // SAFETY: refused on the host before anything is enqueued.
    let e = unsafe { cache.write_on(stream, 0, span(&kb), span(&vb), 1, token, &bad, dev_slots) }
        .unwrap_err();
    assert!(matches!(e, Error::Kv { .. }), "{e}");
}
