//! criterion bench of the paged KV cache kernels on the GPU, each figure a ratio to a limit
//! measured in the same run:
//!
//! * write / gather / copy_blocks bandwidth (bytes moved once) against a device-to-device
//!   `cuMemcpyDtoDAsync` of the same number of bytes (target ≥ 0.8 at ≥ 64 MiB);
//! * swap_out / swap_in of 4,096 scattered blocks of 16 KiB in one launch against one
//!   `cuMemcpyAsync` per block on the same stream (target ≥ 3× faster);
//! * swap_out / swap_in of 1,024 blocks of 256 KiB against the pinned link: one
//!   `cuMemcpyAsync` of the same bytes, contiguous (target ≥ 0.9).
//!
//! Every time is the median over batches of back-to-back launches timed with CUDA events.
//! Prints the ratio table first, then lets criterion time each kernel. Without a GPU it
//! says so and measures nothing (the host backend has no kernels to measure).
//!
//!     cargo bench -p gpu-pager-benches --bench kv_kernels

use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use cudarc::driver::{CudaStream, sys};

use gpu_pager::backend::HostBuffer;
use gpu_pager::backend::cuda::{CudaBackend, RowsKernel};
use gpu_pager::kernels::kv::{TokenMajor, move_params, rows_params};
use gpu_pager::kv::{Kv, KvDtype, KvLayout, KvOrder};
use gpu_pager::{Buffer, Pager, Policy};

const MIB: usize = 1 << 20;

/// splitmix64, for the block permutations.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// `k` distinct values below `n`, in random order.
    fn distinct(&mut self, n: u32, k: usize) -> Vec<u32> {
        let mut all: Vec<u32> = (0..n).collect();
        for i in 0..k {
            let j = i + (self.next() % (all.len() - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

/// Milliseconds per call of `f`, timed with events around batches of back-to-back calls;
/// the median of the batches.
fn median_ms(stream: &CudaStream, mut f: impl FnMut()) -> f64 {
    let batch = 10;
    for _ in 0..3 {
        f();
    }
    let mut times: Vec<f64> = (0..9).map(|_| batch_ms(stream, batch, &mut f)).collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn batch_ms(stream: &CudaStream, n: u64, f: &mut impl FnMut()) -> f64 {
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags).expect("cuEventRecord");
    for _ in 0..n {
        f();
    }
    let end = stream.record_event(flags).expect("cuEventRecord");
    end.synchronize().expect("cuEventSynchronize");
    f64::from(start.elapsed_ms(&end).expect("cuEventElapsedTime")) / n as f64
}

/// One measured kernel and its limit.
struct Case {
    name: &'static str,
    bytes: usize,
    kernel: Box<dyn FnMut()>,
    limit_name: &'static str,
    limit: Box<dyn FnMut()>,
    /// The ratio (kernel GB/s over limit GB/s) the issue asks for: a bandwidth fraction for
    /// the copy-bound cases, a speed-up over the per-block copies for the small swaps.
    target: f64,
}

struct Setup {
    backend: Arc<CudaBackend>,
    pager: Pager,
    stream: Arc<CudaStream>,
    rng: Rng,
    /// Pinned buffers the cases point into; kept alive for the whole bench.
    pinned: Vec<Box<dyn HostBuffer>>,
}

impl Setup {
    fn buffer(&self, tag: &str, bytes: usize) -> (Buffer, u64) {
        let b = self.pager.alloc(tag, bytes).expect("alloc");
        self.pager.fill(&b, 0x9E37_79B9).expect("fill");
        let p = self.pager.ptr(&b).expect("ptr");
        (b, p)
    }
    fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> u64 {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let (b, p) = self.buffer("io", bytes.len());
        self.pager.write(&b, 0, bytes).expect("write");
        p
    }
    fn pinned(&mut self, bytes: usize) -> u64 {
        let mut h = self.backend_pinned(bytes);
        h.as_mut_slice().fill(0xA5);
        let p = h.device_ptr();
        self.pinned.push(h);
        p
    }
    fn backend_pinned(&self, bytes: usize) -> Box<dyn HostBuffer> {
        use gpu_pager::backend::Backend;
        self.backend.alloc_pinned(bytes).expect("cuMemHostAlloc")
    }
}

fn d2d(stream: Arc<CudaStream>, dst: u64, src: u64, bytes: usize) -> Box<dyn FnMut()> {
    Box::new(move || {
        // SAFETY: both ranges are live buffers of resident regions for the whole bench.
        let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuMemcpyDtoDAsync");
    })
}

/// One copy per block (`to_host`: device → host), on `stream`.
fn per_block(
    stream: Arc<CudaStream>,
    cache: u64,
    host: u64,
    blocks: Vec<u32>,
    bpb: u64,
    to_host: bool,
) -> Box<dyn FnMut()> {
    Box::new(move || {
        for (i, &b) in blocks.iter().enumerate() {
            let dev = cache + u64::from(b) * bpb;
            let h = (host + i as u64 * bpb) as *mut std::ffi::c_void;
            // `dev` is a block of the resident cache, `h` a block of a live pinned buffer;
            // both stay alive for the whole bench.
            let cu = stream.cu_stream();
            let r = if to_host {
                // SAFETY: as just said.
                unsafe { sys::cuMemcpyDtoHAsync_v2(h, dev, bpb as usize, cu) }
            } else {
                // SAFETY: as just said.
                unsafe { sys::cuMemcpyHtoDAsync_v2(dev, h, bpb as usize, cu) }
            };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuMemcpyAsync");
        }
    })
}

/// One contiguous copy of `bytes` between pinned memory and the device.
fn link(
    stream: Arc<CudaStream>,
    dev: u64,
    host: u64,
    bytes: usize,
    to_host: bool,
) -> Box<dyn FnMut()> {
    per_block(stream, dev, host, vec![0], bytes as u64, to_host)
}

fn cases(s: &mut Setup) -> Vec<Case> {
    let mut out = Vec::new();
    let stream = s.stream.clone();
    let backend = s.backend.clone();
    let cache = s
        .pager
        .ptr(&s.pager.alloc("cache", 2048 * MIB).expect("cache"))
        .expect("ptr");

    // A Llama-8B-like cache: 32 layers, 8 KV heads × 128, bf16, 16 tokens a block, NHD:
    // 2 KiB a token per layer and plane, 2 MiB a block, 1,024 blocks.
    let big = KvLayout::new(32, 8, 128, 16, KvDtype::Bf16, KvOrder::Nhd).expect("layout");
    let token = big.token_bytes() as usize;
    let blocks = 1024u32;

    // write: 16,384 tokens (K and V: 64 MiB) into a random permutation of the blocks.
    let tokens = 16_384usize;
    let perm = s.rng.distinct(blocks, tokens / 16);
    let slots: Vec<i64> = (0..tokens)
        .map(|t| i64::from(perm[t / 16]) * 16 + (t % 16) as i64)
        .collect();
    let slots_dev = s.upload(&slots);
    let (_, keys) = s.buffer("io", tokens * token);
    let (_, values) = s.buffer("io", tokens * token);
    let io = TokenMajor {
        first: keys,
        second: Some(values),
        token_stride: token as u64,
    };
    let p = rows_params(&big, cache, &[Kv::K, Kv::V], 7, io, slots_dev, tokens).expect("params");
    let (b, st) = (backend.clone(), stream.clone());
    // Destination of the limits' copies and of the gather (256 MiB: the largest case).
    let (_, scratch) = s.buffer("io", 256 * MIB);
    out.push(Case {
        name: "write 16k tokens (K+V, 64 MiB)",
        bytes: 2 * tokens * token,
        kernel: Box::new(move || {
            // SAFETY: every address in `p` is live, resident memory for the whole bench.
            unsafe { b.kv_rows_on(&st, RowsKernel::Write, &p) }.expect("launch")
        }),
        limit_name: "D2D copy",
        limit: d2d(stream.clone(), scratch, keys, 2 * tokens * token),
        target: 0.8,
    });

    // gather: 32,768 tokens of one layer's K (64 MiB) through a random table.
    let tokens = 32_768usize;
    let table: Vec<u32> = (0..tokens / 16)
        .map(|_| (s.rng.next() % u64::from(blocks)) as u32)
        .collect();
    let table_dev = s.upload(&table);
    let io = TokenMajor {
        first: scratch,
        second: None,
        token_stride: token as u64,
    };
    let p = rows_params(&big, cache, &[Kv::K], 3, io, table_dev, tokens).expect("params");
    let (b, st) = (backend.clone(), stream.clone());
    out.push(Case {
        name: "gather 32k tokens (K, 64 MiB)",
        bytes: tokens * token,
        kernel: Box::new(move || {
            // SAFETY: every address in `p` is live, resident memory for the whole bench.
            unsafe { b.kv_rows_on(&st, RowsKernel::Gather, &p) }.expect("launch")
        }),
        limit_name: "D2D copy",
        limit: d2d(stream.clone(), scratch, keys, tokens * token),
        target: 0.8,
    });

    // copy_blocks: 64 pairs of 2 MiB blocks (128 MiB), scattered.
    let picked = s.rng.distinct(blocks, 128);
    let ids: Vec<u32> = picked.clone();
    let ids_dev = s.upload(&ids);
    let bpb = big.bytes_per_block();
    let p = move_params(cache, cache, ids_dev, ids_dev + 64 * 4, bpb, 64).expect("params");
    let (b, st) = (backend.clone(), stream.clone());
    out.push(Case {
        name: "copy_blocks 64 × 2 MiB (128 MiB)",
        bytes: 64 * bpb as usize,
        // SAFETY: as above.
        kernel: Box::new(move || unsafe { b.kv_move_on(&st, &p) }.expect("launch")),
        limit_name: "D2D copy",
        limit: d2d(
            stream.clone(),
            scratch,
            cache + 512 * bpb,
            64 * bpb as usize,
        ),
        target: 0.8,
    });

    // Swaps of 4,096 scattered 16 KiB blocks (64 MiB) vs one cuMemcpyAsync per block.
    for (bpb, count, per_copy) in [(16u64 << 10, 4096usize, true), (256 << 10, 1024, false)] {
        let in_cache = (2048 * MIB as u64 / bpb) as u32;
        let list = s.rng.distinct(in_cache, count);
        let list_dev = s.upload(&list);
        let bytes = count * bpb as usize;
        let host = s.pinned(bytes);
        for to_host in [true, false] {
            let p = if to_host {
                move_params(cache, host, list_dev, 0, bpb, count)
            } else {
                move_params(host, cache, 0, list_dev, bpb, count)
            }
            .expect("params");
            let (b, st) = (backend.clone(), stream.clone());
            let kernel: Box<dyn FnMut()> =
                // SAFETY: as above; `host` is a pinned buffer kept in `s.pinned`.
                Box::new(move || unsafe { b.kv_move_on(&st, &p) }.expect("launch"));
            let (name, limit_name, limit, target): (&'static str, &'static str, _, _) =
                match (per_copy, to_host) {
                    (true, true) => (
                        "swap_out 4096 × 16 KiB",
                        "cuMemcpyAsync per block",
                        per_block(stream.clone(), cache, host, list.clone(), bpb, true),
                        3.0,
                    ),
                    (true, false) => (
                        "swap_in 4096 × 16 KiB",
                        "cuMemcpyAsync per block",
                        per_block(stream.clone(), cache, host, list.clone(), bpb, false),
                        3.0,
                    ),
                    (false, true) => (
                        "swap_out 1024 × 256 KiB",
                        "pinned link D2H",
                        link(stream.clone(), scratch, host, bytes, true),
                        0.9,
                    ),
                    (false, false) => (
                        "swap_in 1024 × 256 KiB",
                        "pinned link H2D",
                        link(stream.clone(), scratch, host, bytes, false),
                        0.9,
                    ),
                };
            out.push(Case {
                name,
                bytes,
                kernel,
                limit_name,
                limit,
                target,
            });
        }
    }
    out
}

/// What a checked `KvCache` call costs around its kernel, for a decode step: one token for
/// each of 64 sequences written into one layer, 200 calls back to back. `write` checks,
/// uploads the slots and waits; `write_on` checks and enqueues on the engine's stream (slot
/// mapping already on the device); the bare launch (`kv_rows_on`) is the floor. Wall time
/// per call, the stream synchronised once at the end.
fn call_overhead(backend: &Arc<CudaBackend>, stream: &Arc<CudaStream>) -> String {
    use gpu_pager::kv::{DeviceSpan, KvCache, KvCacheConfig};
    use std::time::Instant;
    let pager = Arc::new(Pager::new(backend.clone()));
    let layout = KvLayout::new(32, 8, 128, 16, KvDtype::Bf16, KvOrder::Nhd).expect("layout");
    let token = layout.token_bytes() as usize;
    let kv = KvCache::new(
        pager.clone(),
        "overhead_kv",
        layout,
        256,
        KvCacheConfig::default(),
    )
    .expect("cache");
    pager
        .region("overhead_io", 4 * MIB, Policy::Discard)
        .expect("io");
    let seqs: Vec<_> = (0..64).map(|_| kv.create_seq().expect("seq")).collect();
    for &s in &seqs {
        kv.append_tokens(s, 1).expect("append");
    }
    let slots: Vec<i64> = seqs
        .iter()
        .flat_map(|&s| kv.prepare_write(s, 0..1).expect("slots"))
        .collect();
    let buf = |n| pager.alloc("overhead_io", n).expect("alloc");
    let (kb, vb, sb) = (buf(64 * token), buf(64 * token), buf(64 * 8));
    let bytes: Vec<u8> = slots.iter().flat_map(|x| x.to_le_bytes()).collect();
    pager.write(&sb, 0, &bytes).expect("slots to the device");
    let span = |b: &Buffer| DeviceSpan {
        addr: pager.ptr(b).expect("ptr"),
        len: b.len(),
    };
    let (ks, vs, dev_slots) = (span(&kb), span(&vb), pager.ptr(&sb).expect("ptr"));
    let raw = gpu_pager::backend::RawStream(stream.cu_stream() as usize);
    let params = rows_params(
        &layout,
        kv.view().base,
        &[Kv::K, Kv::V],
        5,
        TokenMajor {
            first: ks.addr,
            second: Some(vs.addr),
            token_stride: token as u64,
        },
        dev_slots,
        64,
    )
    .expect("params");
    let calls = 200;
    let time = |f: &mut dyn FnMut()| {
        for _ in 0..10 {
            f();
        }
        stream.synchronize().expect("sync");
        let t = Instant::now();
        for _ in 0..calls {
            f();
        }
        stream.synchronize().expect("sync");
        t.elapsed().as_secs_f64() * 1e6 / calls as f64
    };
    let checked = time(&mut || kv.write(5, &kb, &vb, 64, token, &slots).expect("write"));
    let enqueued = time(&mut || {
        // SAFETY: the spans are live buffers; the device slot mapping holds `slots`; the
        // stream is synchronised before anything is read.
        unsafe { kv.write_on(raw, 5, ks, vs, 64, token, &slots, dev_slots) }.expect("write_on")
    });
    let bare = time(&mut || {
        // SAFETY: as above; `params` was built from the same checked call.
        unsafe { backend.kv_rows_on(stream, RowsKernel::Write, &params) }.expect("launch")
    });
    format!(
        "| decode write, 64 tokens × 1 layer | µs per call |\n|---|---|\n\
         | KvCache::write (checked, uploads slots, waits) | {checked:.1} |\n\
         | KvCache::write_on (checked, enqueued on the engine's stream) | {enqueued:.1} |\n\
         | CudaBackend::kv_rows_on (bare launch, no checks) | {bare:.1} |\n"
    )
}

fn kv_kernels(c: &mut Criterion) {
    let backend = match CudaBackend::new(0) {
        Ok(b) => Arc::new(b),
        Err(e) => {
            eprintln!("kv_kernels: no CUDA GPU ({e}); these are GPU kernels, nothing to measure");
            return;
        }
    };
    backend.preload_kernels().expect("loading the kernels");
    let pager = Pager::new(backend.clone());
    pager
        .region("cache", 2048 * MIB, Policy::Discard)
        .expect("cache region");
    pager
        .region("io", 1024 * MIB, Policy::Discard)
        .expect("io region");
    let stream = backend.context().new_stream().expect("stream");
    let mut setup = Setup {
        backend,
        pager,
        stream: stream.clone(),
        rng: Rng(0x5EED_0FC0_FFEE),
        pinned: Vec::new(),
    };
    let mut cases = cases(&mut setup);

    let gbs = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
    let mut table = String::from(
        "| kernel | bytes | kernel GB/s | limit | limit GB/s | ratio | target | met |\n|---|---|---|---|---|---|---|---|\n",
    );
    for case in &mut cases {
        let k = median_ms(&stream, &mut case.kernel);
        let l = median_ms(&stream, &mut case.limit);
        let (kg, lg) = (gbs(case.bytes, k), gbs(case.bytes, l));
        // Bandwidth ratio (≥ target) for the copy-bound cases; for the per-block loop the
        // same number reads as "× faster".
        let ratio = kg / lg;
        table += &format!(
            "| {} | {} MiB | {kg:.1} | {} | {lg:.1} | {ratio:.3} | ≥ {} | {} |\n",
            case.name,
            case.bytes / MIB,
            case.limit_name,
            case.target,
            if ratio >= case.target { "yes" } else { "no" }
        );
    }
    println!("\n{table}");
    println!("{}", call_overhead(&setup.backend, &stream));

    let mut g = c.benchmark_group("kv_kernels");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for case in &mut cases {
        g.bench_function(case.name, |b| {
            b.iter_custom(|iters| {
                Duration::from_secs_f64(
                    batch_ms(&stream, iters, &mut case.kernel) * iters as f64 / 1e3,
                )
            })
        });
    }
    g.finish();
}

criterion_group!(benches, kv_kernels);
criterion_main!(benches);
