//! GPU-only tests of the CUDA backend: VMM mapping and copies, out-of-memory without leaks,
//! the fill and chunk-hash kernels against their Rust references, and the capturable
//! launchers replayed from a CUDA graph (also across an unmap/remap at the same address).
//!
//! Every test is `#[ignore = "needs a CUDA GPU"]` and fails (never passes silently) when no
//! GPU is present. Random data comes from a seeded PRNG; the seed is printed, and
//! `GPU_PAGER_SEED=<seed>` replays a run.

use crate::common;

use common::{Rng, assert_bytes_eq, gpu_lock};
use cudarc::driver::sys;
use gpu_pager::backend::cuda::CudaBackend;
use gpu_pager::backend::{Backend, BackendError, Mapping, Reservation};
use gpu_pager::kernels::reference;
use gpu_pager_testkit::Hog;
use std::sync::Arc;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// Slack for free-memory comparisons: the driver and other processes allocate too.
const SLACK: usize = 64 * MIB;
/// Poison written into outputs before a kernel runs.
const POISON: u32 = 0xA5C3_5A3C;

fn backend() -> CudaBackend {
    CudaBackend::new(0).expect("CUDA device 0 (this test needs a CUDA GPU)")
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Device memory for a test: a reservation and the chunks mapped into it (each of which
/// holds the reservation, so the range is freed after the last is unmapped).
struct DeviceBuf {
    _mappings: Vec<Box<dyn Mapping>>,
    reservation: Arc<dyn Reservation>,
}

impl DeviceBuf {
    /// At least `bytes`, mapped as chunks of at most `chunk` (both rounded to the
    /// granularity).
    fn new(b: &CudaBackend, bytes: usize, chunk: usize) -> Self {
        let g = b.info().granularity;
        let total = round_up(bytes.max(1), g);
        let chunk = round_up(chunk.max(1), g);
        let reservation = b.reserve(total).expect("reserve");
        let sizes = split(total, chunk);
        // SAFETY: the range is the whole fresh reservation, mapped nowhere yet.
        let mappings = unsafe { b.map(&reservation, 0, &sizes) }.expect("map");
        DeviceBuf {
            _mappings: mappings,
            reservation,
        }
    }

    fn ptr(&self) -> u64 {
        self.reservation.base()
    }

    fn len(&self) -> usize {
        self.reservation.len()
    }
}

/// `total` cut into pieces of `chunk` (the last one shorter).
fn split(total: usize, chunk: usize) -> Vec<usize> {
    let mut sizes = Vec::new();
    let mut left = total;
    while left > 0 {
        let s = left.min(chunk);
        sizes.push(s);
        left -= s;
    }
    sizes
}

fn upload(b: &CudaBackend, dst: u64, data: &[u8]) {
    // SAFETY: every caller passes a range inside a live DeviceBuf.
    unsafe { b.copy_to_device(dst, data) }.expect("copy_to_device");
}

fn download(b: &CudaBackend, src: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0x5Au8; len];
    // SAFETY: every caller passes a range inside a live DeviceBuf.
    unsafe { b.copy_to_host(&mut out, src) }.expect("copy_to_host");
    out
}

fn download_u64(b: &CudaBackend, src: u64, n: usize) -> Vec<u64> {
    download(b, src, n * 8)
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn map_copy_round_trip_and_unmap_frees_memory() {
    let _lock = gpu_lock();
    let b = backend();
    let mut rng = Rng::seeded("map_copy_round_trip_and_unmap_frees_memory");
    let info = b.info().clone();
    eprintln!("{info:?}");
    let g = info.granularity;
    assert!(g > 0 && g.is_power_of_two(), "granularity {g}");
    assert_eq!(info.kind, gpu_pager::backend::BackendKind::Cuda);
    assert!(info.compute_capability.is_some());
    assert!(b.kernels_loaded(), "every kernel module loaded at creation");

    // Granularity-sized chunks and bigger ones, mapped one granule into the reservation.
    let sizes = [g, g, 3 * g, round_up(64 * MIB, g), g, round_up(GIB, g)];
    let total: usize = sizes.iter().sum();
    let reservation = b.reserve(total + 2 * g).expect("reserve");
    let at = reservation.base() + g as u64;

    let free_before = b.mem_info().expect("mem_info").free;
    // SAFETY: `at .. at + total` lies inside the fresh reservation.
    let mappings = unsafe { b.map(&reservation, g, &sizes) }.expect("map");
    let free_mapped = b.mem_info().expect("mem_info").free;
    eprintln!("free: {free_before} before, {free_mapped} mapped ({total} bytes)");
    assert!(
        free_mapped + total <= free_before + SLACK,
        "mapping {total} bytes took only {} bytes of free memory",
        free_before.saturating_sub(free_mapped)
    );

    assert_eq!(mappings.len(), sizes.len());
    let mut expect_ptr = at;
    for (m, &s) in mappings.iter().zip(&sizes) {
        assert_eq!(m.ptr(), expect_ptr);
        assert_eq!(m.len(), s);
        expect_ptr += s as u64;
    }

    // Pageable round trip over the whole span (crossing every chunk boundary).
    let data = rng.bytes(total);
    upload(&b, at, &data);
    assert_bytes_eq("whole span", &download(&b, at, total), &data);
    // Each mapping on its own.
    for m in &mappings {
        let off = (m.ptr() - at) as usize;
        assert_bytes_eq(
            "one mapping",
            &download(&b, m.ptr(), m.len()),
            &data[off..off + m.len()],
        );
    }

    // Pinned round trip at odd offsets and lengths.
    let mut pinned = b.alloc_pinned(64 * MIB + 13).expect("alloc_pinned");
    assert_eq!(pinned.len(), 64 * MIB + 13);
    assert!(pinned.as_slice().iter().all(|&x| x == 0));
    rng.fill(pinned.as_mut_slice());
    let dst = at + (3 * g) as u64 - 7; // straddles a chunk boundary
    // SAFETY: inside the mapped span.
    unsafe { b.copy_to_device(dst, pinned.as_slice()) }.expect("copy_to_device (pinned)");
    let mut back = b.alloc_pinned(pinned.len()).expect("alloc_pinned");
    // SAFETY: inside the mapped span.
    unsafe { b.copy_to_host(back.as_mut_slice(), dst) }.expect("copy_to_host (pinned)");
    assert_bytes_eq("pinned", back.as_slice(), pinned.as_slice());
    drop(back);
    drop(pinned);

    b.synchronize().expect("synchronize");
    drop(mappings);
    let free_after = b.mem_info().expect("mem_info").free;
    eprintln!("free after unmap: {free_after}");
    assert!(
        free_after + SLACK >= free_mapped + total,
        "unmapping {total} bytes freed only {} bytes",
        free_after.saturating_sub(free_mapped)
    );

    // The addresses are reusable: map fresh memory at the same place.
    // SAFETY: the range was unmapped just above and lies in the reservation.
    let again =
        unsafe { b.map(&reservation, g, &[g, 2 * g]) }.expect("map again at the same address");
    let small = rng.bytes(3 * g);
    upload(&b, at, &small);
    assert_bytes_eq("remapped", &download(&b, at, 3 * g), &small);
    drop(again);
    drop(reservation);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn unmap_runs_unmaps_each_run_once_and_the_drops_give_the_memory_back() {
    let _lock = gpu_lock();
    let b = backend();
    let g = b.info().granularity;
    let first = [g, 4 * g, round_up(64 * MIB, g)];
    let second = [round_up(256 * MIB, g)];
    let (n1, n2) = (first.iter().sum::<usize>(), second[0]);
    let reservation = b.reserve(n1 + g + n2).expect("reserve");
    let free_before = b.mem_info().expect("mem_info").free;
    // SAFETY: two spans of the fresh reservation, a granule apart.
    let mut maps = unsafe { b.map(&reservation, 0, &first) }.expect("map");
    // SAFETY: as above.
    maps.extend(unsafe { b.map(&reservation, n1 + g, &second) }.expect("map"));
    upload(&b, reservation.base(), &vec![7; n1]);
    b.synchronize().expect("synchronize");
    // SAFETY: the mappings are this backend's; the device is idle.
    unsafe { b.unmap_runs(&mut maps) };
    drop(maps);
    // A drop that unmapped its range a second time would have failed and been recorded.
    assert_eq!(b.deferred_errors().take(), Vec::<String>::new());
    let free_after = b.mem_info().expect("mem_info").free;
    assert!(
        free_after + SLACK >= free_before,
        "{} bytes not given back",
        free_before - free_after
    );
    // Both runs are address space again: the whole range maps at once.
    // SAFETY: nothing is mapped in the reservation any more.
    let again = unsafe { b.map(&reservation, 0, &[n1 + g + n2]) }.expect("map again");
    let data = vec![9; 3 * g];
    upload(&b, reservation.base() + n1 as u64 - g as u64, &data);
    assert_bytes_eq(
        "remapped",
        &download(&b, reservation.base() + n1 as u64 - g as u64, 3 * g),
        &data,
    );
    drop(again);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn invalid_arguments_are_errors() {
    let _lock = gpu_lock();
    let b = backend();
    let g = b.info().granularity;
    assert!(matches!(b.reserve(0), Err(BackendError::Invalid { .. })));
    assert!(matches!(
        b.reserve(g + 1),
        Err(BackendError::Invalid { .. })
    ));
    assert!(matches!(
        b.alloc_pinned(0),
        Err(BackendError::Invalid { .. })
    ));
    let r = b.reserve(4 * g).expect("reserve");
    // Each call below is rejected before touching the range (checked by the asserts): no
    // sizes, a zero or unaligned size, an unaligned offset, spans past the reservation.
    for (offset, sizes) in [
        (0, &[][..]),
        (0, &[0][..]),
        (0, &[g + 1][..]),
        (1, &[g][..]),
        (4 * g, &[g][..]),
        (0, &[5 * g][..]),
        (3 * g, &[g, g][..]),
        (0, &[usize::MAX - g + 1, g][..]),
    ] {
        // SAFETY: rejected before any access (asserted).
        let got = unsafe { b.map(&r, offset, sizes) };
        assert!(
            matches!(got, Err(BackendError::Invalid { .. })),
            "{offset} {sizes:?}"
        );
    }
    // SAFETY: fresh reserved memory.
    let m = unsafe { b.map(&r, 0, &[g]) }.expect("map");
    // chunk_hash argument checks; the last asks for more chunks than one launch covers (the
    // host backend rejects the same).
    for (at, bytes, chunk) in [
        (r.base() + 8, 64, 16),
        (r.base(), 64, 24),
        (r.base(), 64, 0),
        (r.base(), 0, 16),
        (r.base(), (gpu_pager::kernels::MAX_HASH_CHUNKS + 1) * 16, 16),
    ] {
        // SAFETY: rejected before any device access (asserted).
        let got = unsafe { b.chunk_hash(at, bytes, chunk) };
        assert!(
            matches!(got, Err(BackendError::Invalid { .. })),
            "{bytes} {chunk}"
        );
    }
    drop(m);
    drop(r);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn map_beyond_free_memory_is_out_of_memory_and_leaks_nothing() {
    let _lock = gpu_lock();
    let b = backend();
    let g = b.info().granularity;
    let free_before = b.mem_info().expect("mem_info").free;
    let request = round_up(free_before + GIB, g);
    let sizes = split(request, round_up(GIB, g));
    let reservation = b
        .reserve(request)
        .expect("reserve more than the free memory");
    // SAFETY: the range is the whole fresh reservation.
    let result = unsafe { b.map(&reservation, 0, &sizes) };
    match result {
        Err(BackendError::OutOfMemory { requested }) => assert_eq!(requested, request),
        Err(e) => panic!("expected OutOfMemory, got {e}"),
        Ok(m) => panic!(
            "mapping {request} bytes with {free_before} free succeeded ({} mappings)",
            m.len()
        ),
    }
    let free_after = b.mem_info().expect("mem_info").free;
    eprintln!("free: {free_before} before, {free_after} after the failed map of {request}");
    assert!(
        free_after + SLACK >= free_before,
        "the failed map leaked {} bytes",
        free_before - free_after
    );
    // Everything was unmapped: the start of the range maps again.
    // SAFETY: the failed call left the reservation unmapped.
    let m = unsafe { b.map(&reservation, 0, &[g]) }.expect("map after the failure");
    let data = vec![0x77u8; g];
    upload(&b, reservation.base(), &data);
    assert_bytes_eq("after OOM", &download(&b, reservation.base(), g), &data);
    drop(m);
    drop(reservation);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fill_matches_reference() {
    let _lock = gpu_lock();
    let b = backend();
    let mut rng = Rng::seeded("fill_matches_reference");
    let big = 3 * GIB + 48;
    let buf = DeviceBuf::new(&b, big + 4 * KIB, 512 * MIB);
    let guard = 64;

    let sizes = [
        1,
        2,
        3,
        4,
        5,
        15,
        16,
        17,
        31,
        33,
        4093,
        4096,
        MIB + 5,
        64 * MIB + 7,
    ];
    for &len in &sizes {
        for off in [0usize, 1, 3, 7, 16, 512 * MIB - 5] {
            let pattern = match rng.next_u64() % 4 {
                0 => 0,
                _ => rng.next_u64() as u32,
            };
            // [guard][filled range][guard], starting `off` bytes into the buffer.
            let start = off.saturating_sub(guard);
            let span = (off - start) + len + guard;
            let base = buf.ptr() + start as u64;
            let data = rng.bytes(span);
            upload(&b, base, &data);
            // SAFETY: inside the mapped buffer.
            unsafe { b.fill(buf.ptr() + off as u64, len, pattern) }.expect("fill");
            let mut want = data.clone();
            reference::fill(&mut want[off - start..off - start + len], pattern);
            assert_bytes_eq(
                &format!("fill len {len} at +{off} pattern {pattern:#x}"),
                &download(&b, base, span),
                &want,
            );
        }
    }

    // The multi-GiB range, unaligned, with guards on both sides.
    let off = 3;
    let len = big - 2 * guard;
    let data_head = rng.bytes(guard);
    let data_tail = rng.bytes(guard);
    upload(&b, buf.ptr() + (off - 3) as u64, &data_head[..3]);
    upload(&b, buf.ptr() + (off + len) as u64, &data_tail);
    let pattern = rng.next_u64() as u32 | 1;
    // SAFETY: inside the mapped buffer.
    unsafe { b.fill(buf.ptr() + off as u64, len, pattern) }.expect("fill (big)");
    let got = download(&b, buf.ptr(), off + len + guard);
    let mut want = vec![0u8; off + len + guard];
    want[..3].copy_from_slice(&data_head[..3]);
    reference::fill(&mut want[off..off + len], pattern);
    want[off + len..].copy_from_slice(&data_tail);
    assert_bytes_eq(&format!("fill {len} bytes at +{off}"), &got, &want);

    // Zero-length fill is a no-op.
    // SAFETY: nothing is written.
    unsafe { b.fill(buf.ptr(), 0, 0xFFFF_FFFF) }.expect("fill 0 bytes");
    assert_eq!(download(&b, buf.ptr(), 3), data_head[..3].to_vec());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunk_hash_matches_reference() {
    let _lock = gpu_lock();
    let b = backend();
    let mut rng = Rng::seeded("chunk_hash_matches_reference");
    let big = 3 * GIB + 48;
    let buf = DeviceBuf::new(&b, big + 64, 512 * MIB);
    let out = DeviceBuf::new(&b, MIB, MIB);
    let data = rng.bytes(big + 64);
    upload(&b, buf.ptr(), &data);

    let cases: &[(usize, usize, usize)] = &[
        // (offset, bytes, chunk_bytes); offsets are 16-byte aligned as the kernel requires.
        (0, 1, 16),
        (0, 15, 16),
        (16, 16, 16),
        (48, 17, 16),
        (0, 1000 * 16 + 7, 16),
        (32, 65535 * 16, 16),
        (0, 4096, 4096),
        (16, 5 * 4096 + 13, 4096),
        (0, 3 * (MIB + 16) + 5, MIB + 16),
        (4096, 40 * MIB + 1, MIB + 16),
        (0, 64 * MIB, 64 * MIB),
        (64, 2 * 64 * MIB + 24, 64 * MIB),
        (0, big, 64 * MIB),
        (16, big, MIB + 16),
        (0, big, big), // one chunk of more than 2^32 bytes
    ];
    for &(off, bytes, chunk) in cases {
        let what = format!("chunk_hash of {bytes} bytes at +{off} in chunks of {chunk}");
        let want = reference::chunk_hash(&data[off..off + bytes], chunk);
        // SAFETY: inside the mapped buffer.
        let got = unsafe { b.chunk_hash(buf.ptr() + off as u64, bytes, chunk) }
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(got.len(), bytes.div_ceil(chunk), "{what}: count");
        assert!(got == want, "{what}: differs from the reference");

        // The capturable form, into a poisoned output buffer.
        let n = want.len();
        if n * 8 <= out.len() {
            // SAFETY: inside the mapped output buffer.
            unsafe { b.fill(out.ptr(), out.len(), POISON) }.expect("poison");
            // SAFETY: source and output lie in distinct mapped buffers.
            unsafe {
                b.chunk_hash_on(
                    b.kernel_stream(),
                    buf.ptr() + off as u64,
                    bytes,
                    chunk,
                    out.ptr(),
                )
            }
            .unwrap_or_else(|e| panic!("{what} (chunk_hash_on): {e}"));
            b.kernel_stream().synchronize().expect("synchronize");
            let got = download_u64(&b, out.ptr(), n + 1);
            assert!(got[..n] == want[..], "{what} (chunk_hash_on): differs");
            assert_eq!(
                got[n],
                u64::from(POISON) | (u64::from(POISON) << 32),
                "{what} (chunk_hash_on): wrote past the last hash"
            );
        }
    }

    // One flipped bit changes exactly its chunk's hash.
    let chunk = MIB + 16;
    let bytes = 16 * chunk + 3;
    // SAFETY: inside the mapped buffer.
    let before = unsafe { b.chunk_hash(buf.ptr(), bytes, chunk) }.expect("chunk_hash");
    let pos = 5 * chunk + 1234;
    upload(&b, buf.ptr() + pos as u64, &[data[pos] ^ 0x10]);
    // SAFETY: inside the mapped buffer.
    let after = unsafe { b.chunk_hash(buf.ptr(), bytes, chunk) }.expect("chunk_hash");
    for (i, (x, y)) in before.iter().zip(&after).enumerate() {
        assert_eq!(x == y, i != 5, "chunk {i} after flipping a bit in chunk 5");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn captured_graph_replays_across_remap() {
    let _lock = gpu_lock();
    let b = backend();
    let mut rng = Rng::seeded("captured_graph_replays_across_remap");
    let g = b.info().granularity;
    b.preload_kernels().expect("preload_kernels");
    let stream = b.context().new_stream().expect("new_stream");

    let bytes = 8 * MIB + 48;
    let chunk = MIB + 16;
    let n = bytes.div_ceil(chunk);
    let span = round_up(bytes, g);
    let src_res = b.reserve(span).expect("reserve");
    let src = src_res.base();
    // SAFETY: the fresh reservation.
    let mut src_map = unsafe { b.map(&src_res, 0, &split(span, g)) }.expect("map");
    let out = DeviceBuf::new(&b, g, g);
    let fill_at = out.ptr() + 4096 + 3;
    let fill_len = 1000;
    let fill_pattern = 0x0102_0304;

    // Capture: poisoned output, nothing runs during capture.
    // SAFETY: inside the mapped buffer.
    unsafe { b.fill(out.ptr(), out.len(), POISON) }.expect("poison");
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin_capture");
    // SAFETY: source and output are mapped now and at every replay below.
    let captured = unsafe { b.chunk_hash_on(&stream, src, bytes, chunk, out.ptr()) }
        // SAFETY: the filled range is mapped now and at every replay below.
        .and_then(|()| unsafe { b.fill_on(&stream, fill_at, fill_len, fill_pattern) });
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    captured.expect("enqueue into the capture");
    let graph = ended.expect("end_capture").expect("a graph was captured");
    let poison64 = u64::from(POISON) | (u64::from(POISON) << 32);
    assert!(
        download_u64(&b, out.ptr(), n)
            .iter()
            .all(|&h| h == poison64),
        "capturing must not run the work"
    );

    let check = |what: &str, data: &[u8]| {
        // SAFETY: inside the mapped buffer.
        unsafe { b.fill(out.ptr(), out.len(), POISON) }.expect("poison");
        graph.launch().expect("graph launch");
        stream.synchronize().expect("synchronize");
        let got = download_u64(&b, out.ptr(), n + 1);
        let want = reference::chunk_hash(data, chunk);
        assert!(
            got[..n] == want[..],
            "{what}: hashes differ from the reference"
        );
        assert_eq!(got[n], poison64, "{what}: wrote past the last hash");
        let filled = download(&b, fill_at - 1, fill_len + 2);
        let mut want_fill = vec![0u8; fill_len + 2];
        let poison_bytes = POISON.to_le_bytes();
        // Byte j of the output buffer holds poison byte j % 4.
        let first = (fill_at - 1 - out.ptr()) as usize;
        for (i, x) in want_fill.iter_mut().enumerate() {
            *x = poison_bytes[(first + i) % 4];
        }
        reference::fill(&mut want_fill[1..=fill_len], fill_pattern);
        assert_bytes_eq(&format!("{what}: fill"), &filled, &want_fill);
    };

    let data1 = rng.bytes(bytes);
    upload(&b, src, &data1);
    check("first replay", &data1);
    let data2 = rng.bytes(bytes);
    upload(&b, src, &data2);
    check("replay after new data", &data2);

    // Release and resume at the same address: the graph still replays correctly.
    b.synchronize().expect("synchronize");
    src_map.clear();
    // SAFETY: unmapped just above; inside the reservation.
    src_map = unsafe { b.map(&src_res, 0, &[span]) }.expect("remap as one chunk");
    let data3 = rng.bytes(bytes);
    upload(&b, src, &data3);
    check("replay after unmap and remap", &data3);

    drop(graph);
    drop(stream);
    drop(src_map);
    drop(src_res);
}

/// The calling thread's current CUDA context (NULL when none).
fn current_context() -> sys::CUcontext {
    let mut current: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `current` is a valid out-pointer.
    unsafe { sys::cuCtxGetCurrent(&mut current) }
        .result()
        .expect("cuCtxGetCurrent");
    current
}

/// Makes `ctx` (a live context, or NULL) current on the calling thread.
fn set_current_context(ctx: sys::CUcontext) {
    // SAFETY: the callers pass a context they keep alive, or NULL.
    unsafe { sys::cuCtxSetCurrent(ctx) }
        .result()
        .expect("cuCtxSetCurrent");
}

/// The scoped context: a thread bound to another context (a non-primary one on device 0,
/// then none at all, then ours) calls into the backend and the pager, and finds its own
/// context current after every call, the drops included: mapping, copies, fill, hashes,
/// fences, pinned memory, release, resume, `resume_on`, KV kernels, removing regions,
/// dropping the pager and the backend, and `CudaBackend::new` itself.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_callers_context_is_current_again_after_every_call() {
    use gpu_pager::backend::{Direction, Mover, RawStream};
    use gpu_pager::kv::{DeviceSpan, Kv, KvCache, KvCacheConfig, KvDtype, KvLayout, KvOrder};
    use gpu_pager::{Pager, PagerConfig, Policy};

    let _lock = gpu_lock();
    std::thread::spawn(|| {
        // A context of the caller's own: cuCtxCreate makes it current on this thread.
        let other = cudarc::driver::CudaContext::new_non_primary(0, 0)
            .expect("a non-primary context on CUDA device 0 (this test needs a CUDA GPU)");
        let foreign = other.cu_ctx();
        set_current_context(foreign);
        let b = Arc::new(backend());
        assert_eq!(
            current_context(),
            foreign,
            "CudaBackend::new left the thread's context changed"
        );
        let ours = b.context().cu_ctx();
        assert!(!ours.is_null() && ours != foreign);
        let g = b.info().granularity;
        let stream = RawStream(b.kernel_stream().cu_stream() as usize);

        for (name, callers) in [
            ("a non-primary context", foreign),
            ("no context", std::ptr::null_mut()),
            ("the backend's own context", ours),
        ] {
            set_current_context(callers);
            assert_eq!(current_context(), callers);
            let check = |what: &str| {
                assert_eq!(
                    current_context(),
                    callers,
                    "{what} left the thread's context changed (the thread had {name})"
                );
            };
            let mut rng = Rng::seeded("the_callers_context_is_current_again_after_every_call");

            // The backend directly.
            b.mem_info().expect("mem_info");
            check("mem_info");
            b.preload_kernels().expect("preload_kernels");
            check("preload_kernels");
            let r = b.reserve(4 * g).expect("reserve");
            check("reserve");
            // SAFETY: the first two granules of the fresh reservation, mapped once.
            let m = unsafe { b.map(&r, 0, &[g, g]) }.expect("map");
            check("map");
            let data = rng.bytes(2 * g);
            // SAFETY: inside the mapped span.
            unsafe { b.copy_to_device(r.base(), &data) }.expect("copy_to_device");
            check("copy_to_device");
            let mut back = vec![0u8; 2 * g];
            // SAFETY: inside the mapped span.
            unsafe { b.copy_to_host(&mut back, r.base()) }.expect("copy_to_host");
            check("copy_to_host");
            assert_bytes_eq("round trip", &back, &data);
            let mut pinned = b.alloc_pinned(2 * g).expect("alloc_pinned");
            check("alloc_pinned");
            for mover in Mover::ALL {
                // Poison the side each copy writes first, so that a copy that does nothing
                // fails the round trip.
                pinned.as_mut_slice().copy_from_slice(&data);
                // SAFETY: inside the mapped span.
                unsafe { b.fill(r.base(), 2 * g, 0) }.expect("poison");
                let unit = common::whole_copy(Direction::ToDevice, pinned.as_ref(), r.base());
                // SAFETY: inside the mapped span; `pinned` is this backend's and lives, and
                // is not written, until the fence below has passed.
                let fence = unsafe { b.copy_unit(&unit, mover) }.expect("copy unit up");
                check("copy_unit");
                fence.wait().expect("fence wait");
                assert!(fence.is_done().expect("fence query"));
                check("fence query");
                pinned.as_mut_slice().fill(0);
                let back_unit = common::whole_copy(Direction::ToHost, pinned.as_ref(), r.base());
                // SAFETY: as above; nothing touches `pinned` until the wait below.
                unsafe { b.copy_on(&back_unit, mover, stream) }.expect("copy on a stream");
                check("copy_on");
                b.fence(stream).expect("fence").wait().expect("fence wait");
                assert_bytes_eq(&format!("{mover} round trip"), pinned.as_slice(), &data);
            }
            drop(pinned);
            // SAFETY: inside the mapped span.
            let hashes = unsafe { b.chunk_hash(r.base(), 2 * g, 64 * KIB) }.expect("chunk_hash");
            check("chunk_hash");
            assert_eq!(hashes, reference::chunk_hash(&data, 64 * KIB));
            // SAFETY: inside the mapped span.
            unsafe { b.fill(r.base(), 2 * g, 0x0102_0304) }.expect("fill");
            check("fill");
            // SAFETY: inside the mapped span; the stream is the backend's.
            unsafe { b.fill_on(b.kernel_stream(), r.base(), g, 0) }.expect("fill_on");
            check("fill_on");
            let fence = b.fence(stream).expect("fence");
            check("fence");
            fence.wait().expect("fence wait");
            check("fence wait");
            drop(fence);
            check("dropping a fence");
            b.synchronize().expect("synchronize");
            check("synchronize");
            let pinned = b.alloc_pinned(4096).expect("alloc_pinned");
            check("alloc_pinned");
            drop(pinned);
            check("dropping pinned memory");
            let hog = Hog::take(b.as_ref(), g).expect("hog");
            check("hog");
            drop(hog);
            check("dropping a hog");
            drop(m);
            check("dropping mappings (unmap, release)");
            drop(r);
            check("dropping a reservation");

            // The pager over it.
            let config = PagerConfig {
                chunk_bytes: g,
                tuning: gpu_pager::Tuning {
                    discard_chunk_bytes: g,
                    ..gpu_pager::Tuning::default()
                },
                ..PagerConfig::default()
            };
            let pager = Arc::new(Pager::with_config(b.clone(), config));
            pager
                .region("w", 4 * g, Policy::Preserve)
                .expect("Preserve region");
            check("creating a region (reserve, map)");
            pager
                .region("z", 2 * g, Policy::DiscardZeroed)
                .expect("DiscardZeroed region");
            check("creating a zeroed region (map, fill)");
            let w = pager.alloc("w", 3 * g).expect("alloc");
            let data = rng.bytes(3 * g);
            pager.write(&w, 0, &data).expect("write");
            check("pager write");
            let mut back = vec![0u8; 3 * g];
            pager.read(&w, 0, &mut back).expect("read");
            check("pager read");
            pager.release(&["w", "z"]).expect("release");
            check("release (sync, pin, hash, copy, unmap)");
            pager.resume(&["w", "z"]).expect("resume");
            check("resume (map, restore, fill)");
            pager.read(&w, 0, &mut back).expect("read after resume");
            assert_bytes_eq("after resume", &back, &data);
            pager.release(&["w"]).expect("release");
            pager.resume_on(&["w"], stream).expect("resume_on");
            check("resume_on (map, enqueue, fence)");
            pager.read(&w, 0, &mut back).expect("read after resume_on");
            check("pager read after resume_on (fence wait)");
            assert_bytes_eq("after resume_on", &back, &data);

            // KV kernels.
            let layout = KvLayout::new(2, 4, 64, 16, KvDtype::Bf16, KvOrder::Nhd).expect("layout");
            let kv_config = KvCacheConfig { chunk_bytes: g };
            let kv =
                KvCache::new(pager.clone(), "kv_cache", layout, 256, kv_config).expect("KvCache");
            check("KvCache::new");
            let token = 4 * 64 * 2;
            pager
                .region("io", 2 * g, Policy::Discard)
                .expect("io region");
            let keys = pager.alloc("io", 20 * token).expect("alloc");
            let values = pager.alloc("io", 20 * token).expect("alloc");
            let out = pager.alloc("io", 20 * token).expect("alloc");
            let slots_dev = pager.alloc("io", 20 * 8).expect("alloc");
            pager
                .write(&values, 0, &vec![9u8; 20 * token])
                .expect("write");
            let seq = kv.create_seq().expect("create_seq");
            kv.append_tokens(seq, 20).expect("append_tokens");
            check("append_tokens (back)");
            let slots = kv.prepare_write(seq, 0..20).expect("prepare_write");
            kv.write(1, &keys, &values, 20, token, &slots)
                .expect("KV write");
            check("KV write");
            let slot_bytes: Vec<u8> = slots.iter().flat_map(|s| s.to_le_bytes()).collect();
            pager.write(&slots_dev, 0, &slot_bytes).expect("write");
            let span = |buf: &gpu_pager::Buffer| DeviceSpan {
                addr: pager.ptr(buf).expect("ptr"),
                len: buf.len(),
            };
            // SAFETY: the stream is the backend's; `slots_dev` holds the slots; the buffers
            // and blocks stay as they are until the synchronize below.
            unsafe {
                kv.write_on(
                    stream,
                    0,
                    span(&keys),
                    span(&values),
                    20,
                    token,
                    &slots,
                    pager.ptr(&slots_dev).expect("ptr"),
                )
            }
            .expect("KV write_on");
            check("KV write_on");
            b.synchronize().expect("synchronize");
            assert_eq!(kv.gather(1, Kv::V, seq, &out).expect("gather"), 20);
            check("KV gather");
            pager.read(&out, 0, &mut back[..20 * token]).expect("read");
            assert!(back[..20 * token].iter().all(|&x| x == 9));
            drop(kv);
            check("dropping a KvCache (removes its region)");
            pager.remove("z").expect("remove");
            check("removing a region");
            assert_eq!(
                pager.take_deferred_errors(),
                Vec::<String>::new(),
                "no failure was deferred"
            );
            drop(pager);
            check("dropping the pager (its regions)");
        }

        // Dropping the backend releases the primary context (cudarc binds it to do so).
        set_current_context(foreign);
        assert!(b.deferred_errors().take().is_empty());
        drop(b);
        assert_eq!(
            current_context(),
            foreign,
            "dropping the backend left the thread's context changed"
        );
        drop(other);
    })
    .join()
    .expect("the test thread");
}
