//! The pager on a real GPU: the multi-stage wake-up at scale, memory really returned, OOM
//! rollback against a real allocation, a CUDA graph replayed across a release, and an
//! elastic region backed and trimmed.
//!
//! Every test is `#[ignore = "needs a CUDA GPU"]` and fails (never passes) without one.
//! Run on the H200 with `bash .gpu/on-device gpu-tests` after `scripts/gpu-pack` (see `scripts/gpu-check`).

use crate::common;

use common::{Rng, assert_bytes_eq, free_bytes, gpu, gpu_lock, scale};

use gpu_pager::kernels::reference;
use gpu_pager::{Buffer, Error, Pager, Policy, RegionOptions, State};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

fn whole_hash(pager: &Pager, b: &Buffer) -> u64 {
    pager
        .hash(b, b.len().next_multiple_of(16))
        .expect("chunk_hash")[0]
}

/// ≥ 8 GiB of weights in ≥ 200 buffers and ≥ 32 GiB of KV cache, three cycles of the
/// multi-stage wake-up: contents bit-exact, addresses unchanged, memory really returned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_seed_scenario_at_scale() {
    let _lock = gpu_lock();
    let backend = gpu();
    let pager = Pager::new(backend.clone());
    let weights = 8 * GIB / scale();
    let kv = 32 * GIB / scale();
    let w_info = pager.region("weights", weights, Policy::Preserve).unwrap();
    let kv_info = pager.region("kv_cache", kv, Policy::Discard).unwrap();

    let mut rng = Rng::seeded("gpu_seed_scenario_at_scale");
    let n = 233 / scale().min(4);
    let unit = weights / n;
    let bufs: Vec<Buffer> = (0..n)
        .map(|i| {
            let len = unit - 4096 - (i * 977) % (unit / 2); // odd, varied sizes
            pager.alloc("weights", len).unwrap()
        })
        .collect();
    let ptrs: Vec<u64> = bufs.iter().map(|b| pager.ptr(b).unwrap()).collect();
    // Random data from the host in a few buffers (checked by full read-back), the fill
    // kernel with per-buffer patterns in the rest (checked by hash).
    let mut random: Vec<(usize, Vec<u8>)> = (0..n)
        .step_by(37)
        .map(|i| (i, rng.bytes(bufs[i].len())))
        .collect();
    for (i, b) in bufs.iter().enumerate() {
        pager.fill(b, rng.next_u64() as u32).unwrap();
        if let Some((_, data)) = random.iter().find(|(j, _)| *j == i) {
            pager.write(b, 0, data).unwrap();
        }
    }
    let mut want: Vec<u64> = bufs.iter().map(|b| whole_hash(&pager, b)).collect();
    // The kernel's hash agrees with the reference on what was written.
    for (i, data) in &random {
        assert_eq!(
            want[*i],
            reference::chunk_hash(data, data.len().next_multiple_of(16))[0]
        );
    }
    let kv_buf = pager.alloc("kv_cache", kv).unwrap();

    for cycle in 0..3 {
        pager.fill(&kv_buf, 0x1234_5678).unwrap();
        let before = free_bytes(&backend);
        let rel = pager.release(&["kv_cache", "weights"]).unwrap();
        let after = free_bytes(&backend);
        eprintln!("cycle {cycle}: {rel}");
        assert_eq!(rel.bytes(), weights + kv);
        assert!(
            after >= before + weights + kv - 256 * MIB,
            "free memory rose by {} bytes, released {}",
            after - before,
            weights + kv
        );
        // The freed memory is really usable by someone else (the trainer).
        {
            let ctx = backend.context();
            ctx.bind_to_thread().unwrap();
            // SAFETY: plain allocation and free of device memory on the bound context.
            let p = unsafe { cudarc::driver::result::malloc_sync(weights + kv) }
                .expect("a plain cuMemAlloc of the released size must succeed");
            // SAFETY: `p` came from malloc_sync above and is freed once.
            unsafe { cudarc::driver::result::free_sync(p) }.unwrap();
        }
        assert!(matches!(
            pager.ptr(&bufs[0]),
            Err(Error::NotResident { .. })
        ));

        let r1 = pager.resume(&["weights"]).unwrap();
        eprintln!("cycle {cycle}: {r1}");
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(pager.ptr(b).unwrap(), ptrs[i], "buffer {i} moved");
            assert_eq!(
                whole_hash(&pager, b),
                want[i],
                "buffer {i} differs after cycle {cycle}"
            );
        }
        for (i, data) in &random {
            let mut got = vec![0u8; data.len()];
            pager.read(&bufs[*i], 0, &mut got).unwrap();
            assert_bytes_eq(&format!("buffer {i} after cycle {cycle}"), &got, data);
        }
        // Update the weights in place (every third buffer), then stage 2. Buffers checked
        // by read-back get fresh random bytes, the others a new fill pattern.
        for (i, b) in bufs.iter().enumerate().skip(cycle).step_by(3) {
            match random.iter_mut().find(|(j, _)| *j == i) {
                Some((_, data)) => {
                    *data = rng.bytes(b.len());
                    pager.write(b, 0, data).unwrap();
                }
                None => pager.fill(b, rng.next_u64() as u32).unwrap(),
            }
            want[i] = whole_hash(&pager, b);
        }
        let r2 = pager.resume(&["kv_cache"]).unwrap();
        eprintln!("cycle {cycle}: {r2}");
        assert_eq!(pager.info("weights").unwrap().base, w_info.base);
        assert_eq!(pager.info("kv_cache").unwrap().base, kv_info.base);
    }
    let s = pager.stats();
    assert_eq!(s.resident_bytes(), weights + kv);
    assert_eq!(s.backup_bytes(), weights);
}

/// A trainer's real allocation holds the memory: resume fails with OutOfMemory, undoes its
/// mappings (free memory unchanged), keeps the backup; after the trainer frees, it succeeds.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_oom_rollback_with_a_real_allocation() {
    let _lock = gpu_lock();
    let backend = gpu();
    let pager = Pager::new(backend.clone());
    pager.region("weights", 2 * GIB, Policy::Preserve).unwrap();
    pager.region("kv_cache", 8 * GIB, Policy::Discard).unwrap();
    let w = pager.alloc("weights", 2 * GIB - 4096).unwrap();
    let mut rng = Rng::seeded("gpu_oom_rollback");
    let data = rng.bytes(64 * MIB + 3);
    pager.fill(&w, 0xC0FF_EE00).unwrap();
    pager.write(&w, 123, &data).unwrap();
    let want = whole_hash(&pager, &w);
    pager.release(&["weights", "kv_cache"]).unwrap();

    // The trainer takes all but 4 GiB: the weights (2 GiB) fit, weights + KV (10) do not.
    let ctx = backend.context();
    ctx.bind_to_thread().unwrap();
    let hog_bytes = free_bytes(&backend) - 4 * GIB;
    // SAFETY: a plain device allocation, freed below.
    let hog = unsafe { cudarc::driver::result::malloc_sync(hog_bytes) }.unwrap();
    let before = free_bytes(&backend);
    let err = pager.resume(&["weights", "kv_cache"]).unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(err, Error::OutOfMemory { ref tag, requested, .. } if tag == "kv_cache" && requested == 8 * GIB)
    );
    let after = free_bytes(&backend);
    assert!(
        after + 64 * MIB >= before,
        "the failed resume leaked {} bytes",
        before - after
    );
    assert_eq!(pager.info("weights").unwrap().state, State::Released);
    // Stage 1 alone fits.
    pager.resume(&["weights"]).unwrap();
    assert_eq!(whole_hash(&pager, &w), want);
    assert!(matches!(
        pager.resume(&["kv_cache"]),
        Err(Error::OutOfMemory { .. })
    ));
    // SAFETY: `hog` came from malloc_sync and is freed once.
    unsafe { cudarc::driver::result::free_sync(hog) }.unwrap();
    pager.resume(&["kv_cache"]).unwrap();
    let mut got = vec![0u8; data.len()];
    pager.read(&w, 123, &mut got).unwrap();
    assert_bytes_eq("weights after the retry", &got, &data);
    assert_eq!(whole_hash(&pager, &w), want);
}

/// A CUDA graph captured before the release (a kernel reading the weights region and
/// writing the KV region) replays correctly after resume: the addresses are the same.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_graph_captured_before_release_replays_after_resume() {
    let _lock = gpu_lock();
    let backend = gpu();
    let pager = Pager::new(backend.clone());
    pager.region("weights", GIB, Policy::Preserve).unwrap();
    pager.region("kv_cache", GIB, Policy::Discard).unwrap();
    let w = pager.alloc("weights", 96 * MIB + 48).unwrap();
    let out = pager.alloc("kv_cache", 4096).unwrap();
    let chunk = 4 * MIB;
    let mut rng = Rng::seeded("gpu_graph_replay");
    let data = rng.bytes(w.len());
    pager.write(&w, 0, &data).unwrap();
    let want = reference::chunk_hash(&data, chunk);
    let n = want.len();

    backend.preload_kernels().unwrap();
    let stream = backend.context().new_stream().unwrap();
    let (src, dst) = (pager.ptr(&w).unwrap(), pager.ptr(&out).unwrap());
    stream
        .begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
        .unwrap();
    // SAFETY: both ranges are live buffers of resident regions during capture and replay
    // (the test resumes them before each replay).
    unsafe { backend.chunk_hash_on(&stream, src, w.len(), chunk, dst) }.unwrap();
    let graph = stream
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a captured graph");

    let read_out = |pager: &Pager| {
        let mut bytes = vec![0u8; n * 8];
        pager.read(&out, 0, &mut bytes).unwrap();
        bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect::<Vec<u64>>()
    };
    pager.fill(&out, 0xDEAD_BEEF).unwrap();
    graph.launch().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(read_out(&pager), want);

    for _ in 0..2 {
        pager.release(&["weights", "kv_cache"]).unwrap();
        pager.resume(&["weights", "kv_cache"]).unwrap();
        pager.fill(&out, 0xDEAD_BEEF).unwrap(); // poison: the replay must write every hash
        graph.launch().unwrap();
        stream.synchronize().unwrap();
        assert_eq!(read_out(&pager), want);
    }
}

/// `resume_on(stream)`: the restore is enqueued on the engine's stream, so a kernel launched
/// on that stream right after (here: hashing the weights into the KV region) sees the
/// restored contents without any host-side wait; pager reads from the host wait too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_resume_on_orders_the_restore_before_the_engines_kernels() {
    let _lock = gpu_lock();
    let backend = gpu();
    let pager = Pager::new(backend.clone());
    pager
        .region("weights", 4 * GIB / scale(), Policy::Preserve)
        .unwrap();
    pager.region("kv_cache", GIB, Policy::Discard).unwrap();
    let w = pager.alloc("weights", 3 * GIB / scale() + 4096).unwrap();
    let out = pager.alloc("kv_cache", 1 << 20).unwrap();
    let mut rng = Rng::seeded("gpu_resume_on");
    let data = rng.bytes(64 * MIB);
    pager.fill(&w, rng.next_u64() as u32).unwrap();
    pager.write(&w, w.len() - data.len(), &data).unwrap();
    let chunk = 16 * MIB;
    let want = pager.hash(&w, chunk).unwrap();
    backend.preload_kernels().unwrap();
    let stream = backend.context().new_stream().unwrap();
    for _ in 0..3 {
        pager.release(&["weights", "kv_cache"]).unwrap();
        pager.resume(&["kv_cache"]).unwrap();
        pager.fill(&out, 0xDEAD_BEEF).unwrap();
        let raw = gpu_pager::backend::RawStream(stream.cu_stream() as usize);
        pager.resume_on(&["weights"], raw).unwrap();
        let (src, dst) = (pager.ptr(&w).unwrap(), pager.ptr(&out).unwrap());
        // SAFETY: both buffers are live in resident regions; the kernel is ordered after the
        // restore on `stream`.
        unsafe { backend.chunk_hash_on(&stream, src, w.len(), chunk, dst) }.unwrap();
        stream.synchronize().unwrap();
        let mut bytes = vec![0u8; want.len() * 8];
        pager.read(&out, 0, &mut bytes).unwrap();
        let got: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(
            got, want,
            "the kernel after resume_on saw unrestored weights"
        );
        let mut tail = vec![0u8; data.len()];
        pager.read(&w, w.len() - data.len(), &mut tail).unwrap();
        assert_bytes_eq("tail after resume_on", &tail, &data);
    }
}

/// An elastic KV region backed 1 GiB at a time in 64 MiB chunks: device free memory drops
/// by the backed bytes, the memory holds data, and a trim gives it back to the device.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_elastic_back_and_trim_move_real_memory() {
    let _lock = gpu_lock();
    let backend = gpu();
    let pager = Pager::new(backend.clone());
    let options = RegionOptions {
        kind: gpu_pager::RegionKind::Elastic,
        chunk_bytes: Some(64 * MIB),
        ..Default::default()
    };
    let info = pager
        .region_with("kv_cache", 8 * GIB, Policy::Discard, options)
        .unwrap();
    assert_eq!(info.chunk_bytes, 64 * MIB);
    let kv = pager.alloc("kv_cache", GIB).unwrap();
    assert!(matches!(pager.ptr(&kv), Err(Error::NotBacked { .. })));

    let before = free_bytes(&backend);
    let range = kv.offset()..kv.offset() + kv.len();
    let backed = pager.back("kv_cache", range.clone()).unwrap();
    assert!(backed >= GIB, "backed {backed} bytes");
    let after = free_bytes(&backend);
    assert!(
        before >= after + GIB,
        "free memory fell by {} bytes after backing 1 GiB",
        before.saturating_sub(after)
    );
    assert!(pager.is_backed("kv_cache", range).unwrap());

    let mut rng = Rng::seeded("gpu_elastic_back_and_trim");
    pager.fill(&kv, 0x5A5A_0F0F).unwrap();
    let data = rng.bytes(64 * MIB + 5);
    pager.write(&kv, kv.len() - data.len(), &data).unwrap();
    let mut got = vec![0u8; data.len()];
    pager.read(&kv, kv.len() - data.len(), &mut got).unwrap();
    assert_bytes_eq("elastic tail", &got, &data);
    let mut head = vec![0u8; 4096];
    pager.read(&kv, 0, &mut head).unwrap();
    assert_eq!(head, reference_fill(0x5A5A_0F0F, 4096));

    let trimmed = pager.trim("kv_cache", &[]).unwrap();
    assert_eq!(trimmed, backed);
    let end = free_bytes(&backend);
    assert!(
        end + 64 * MIB >= before,
        "the trim gave back only {} of {backed} bytes",
        end.saturating_sub(after)
    );
    assert!(matches!(
        pager.read(&kv, 0, &mut head),
        Err(Error::NotBacked { .. })
    ));
}

fn reference_fill(pattern: u32, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    reference::fill(&mut v, pattern);
    v
}

/// The process's resident memory, as the kernel counts it.
fn rss_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib * 1024
}

/// Every backup medium on the GPU, fixed and growing: contents bit-exact over cycles with
/// new contents each cycle; host backups give their memory back (the process's resident
/// memory drops by the backup's size); file backups hold their files while released only
/// on disk, and the files go with the region.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_every_backup_medium_cycles_bit_exact() {
    use gpu_pager::{BackupFiles, Medium, PagerConfig};
    use gpu_pager_testkit::spool;
    let _lock = gpu_lock();
    let backend = gpu();
    let dir = std::env::temp_dir().join(format!("gpu-pager-media-{}", std::process::id()));
    let bytes = 2 * GIB / scale();
    let mut rng = Rng::seeded("gpu_every_backup_medium_cycles_bit_exact");
    let layouts = [
        (Medium::Pinned, BackupFiles::Unnamed),
        (Medium::Host, BackupFiles::Unnamed),
        (Medium::File, BackupFiles::Unnamed),
        (Medium::File, BackupFiles::Named),
    ];
    for (medium, files) in layouts {
        for growing in [false, true] {
            let pager = Pager::with_config(
                backend.clone(),
                PagerConfig {
                    tuning: gpu_pager::Tuning {
                        file_chunk_bytes: 16 * MIB,
                        ..gpu_pager::Tuning::default()
                    },
                    ..PagerConfig::default()
                },
            );
            pager.set_backup_files(&dir, files).unwrap();
            let options = RegionOptions {
                medium,
                ..RegionOptions::default()
            };
            let size = if growing { 0 } else { bytes };
            common::table_region(&pager, "w", size, Policy::Preserve, options).unwrap();
            let lens = [bytes / 2 + 12_345, bytes / 4 - 777];
            let bufs: Vec<Buffer> = lens.iter().map(|&n| pager.alloc("w", n).unwrap()).collect();
            for cycle in 0..2 {
                let what = format!("{medium:?} {files:?}, growing {growing}, cycle {cycle}");
                let want: Vec<u64> = bufs
                    .iter()
                    .map(|b| {
                        pager.fill(b, rng.next_u64() as u32).unwrap();
                        let head = rng.bytes(4099);
                        pager.write(b, 7, &head).unwrap();
                        whole_hash(&pager, b)
                    })
                    .collect();
                let before = rss_bytes();
                pager.release(&["w"]).unwrap();
                let released = rss_bytes();
                if medium == Medium::File {
                    let held = lens.iter().sum::<usize>() as u64;
                    assert!(spool::on_disk(&dir) >= held, "{what}: on disk");
                    let (named, unnamed) = (spool::named(&dir).len(), spool::spooled(&dir).len());
                    let want = match files {
                        // One file per backup: a growing region backs each buffer up apart.
                        BackupFiles::Named => (if growing { 2 } else { 1 }, 0),
                        BackupFiles::Unnamed => (0, 1),
                    };
                    assert_eq!((named, unnamed), want, "{what}: files");
                }
                pager.resume(&["w"]).unwrap();
                let resumed = rss_bytes();
                for (b, w) in bufs.iter().zip(&want) {
                    assert_eq!(whole_hash(&pager, b), *w, "{what}");
                }
                eprintln!(
                    "{what}: resident memory {:+} MiB at the release, {:+} MiB at the resume",
                    (released as i64 - before as i64) >> 20,
                    (resumed as i64 - released as i64) >> 20
                );
                if medium == Medium::Host {
                    let held = lens.iter().sum::<usize>();
                    assert!(
                        released as i64 - resumed as i64 >= (held - held / 8) as i64,
                        "{what}: host memory given back ({released} -> {resumed})"
                    );
                }
                if medium == Medium::File {
                    assert!(
                        released < before + bytes / 4,
                        "{what}: a file backup holds no host memory of its size"
                    );
                }
            }
            pager.remove("w").unwrap();
            assert_eq!(spool::named(&dir), Vec::<String>::new());
            assert_eq!(spool::on_disk(&dir), 0, "the disk space is back");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With `Tuning::reclaim_scrubbed` (the default), a release of more than a gigabyte has the
/// backend's helper thread collect the pages the driver scrubs on a schedule that ends, and
/// the region comes back at its address; with the knob off, nothing is collected.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_release_collects_scrubbed_pages_ahead() {
    use std::time::{Duration, Instant};
    let _lock = gpu_lock();
    let backend = gpu();
    let pager = Pager::new(backend.clone());
    pager.region("kv_cache", 2 * GIB, Policy::Discard).unwrap();
    let kv = pager.alloc("kv_cache", 2 * GIB).unwrap();
    let ptr = pager.ptr(&kv).unwrap();
    let wait_for = |what: &str, f: &dyn Fn() -> bool| {
        let end = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < end, "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };

    let start = backend.scrub_collections();
    pager.release(&["kv_cache"]).unwrap();
    wait_for("no collection within 10 s of a 2 GiB release", &|| {
        backend.scrub_collections() > start
    });
    // The schedule's last run is 1.6 s after the release.
    std::thread::sleep(Duration::from_millis(2500));
    let ended = backend.scrub_collections();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(backend.scrub_collections(), ended, "the schedule ended");
    assert!(ended - start >= 2, "{} collections", ended - start);
    pager.resume(&["kv_cache"]).unwrap();
    assert_eq!(pager.ptr(&kv).unwrap(), ptr);
    pager.fill(&kv, 0x0102_0304).unwrap();

    // A pager with the knob off turns it off for its backend.
    let off = gpu_pager::PagerConfig {
        tuning: gpu_pager::Tuning {
            reclaim_scrubbed: false,
            ..gpu_pager::Tuning::default()
        },
        ..gpu_pager::PagerConfig::default()
    };
    let _quiet = Pager::with_config(backend.clone(), off);
    let before = backend.scrub_collections();
    pager.release(&["kv_cache"]).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        backend.scrub_collections(),
        before,
        "off: nothing collected"
    );
    pager.resume(&["kv_cache"]).unwrap();
    common::assert_no_deferred_errors(&backend);
}
