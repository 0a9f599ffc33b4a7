//! Rows for issue #11: pinning host memory (item 3: a first release without `prepin` in at
//! most 1 s for 16 GiB) and the number of physical handles of a KV cache (item 2).
//!
//! - [`first_release_rows`]: the pager's first release of the weights without `prepin`, fixed
//!   and growing (each with `first_save_overlap`, the default, and without), against a 1 s budget
//!   per 16 GiB, with its pinning (the copy in it, with `first_save_overlap`) and the pump's
//!   copy (the report's steps) next to the link.
//! - [`pin_rows`] (CUDA only): pinning the weights' size by each method — `cuMemHostAlloc` and
//!   zeroing (the old `alloc_pinned`), and anonymous memory touched and then registered: with
//!   and without huge pages, touched by one thread or all, by `MADV_POPULATE_WRITE` or a
//!   write per page, registered in one piece or in pieces (serially, on parallel threads) —
//!   each against `cuMemHostAlloc` in the same run; the growing region's backups pinned in one
//!   batch (`pin_many`: one mapping, one registration per buffer, registered one after
//!   another or on parallel threads); a copy across two registrations (does the
//!   driver take it, and at what speed); and pinning overlapped with the copy
//!   (`pin_from_device`) against pinning then copying, and the same for the growing region's
//!   batch (`pin_many_from_device` against `pin_many`, then a copy each).
//! - [`kv_pattern_rows`]: releasing and resuming the KV cache as 1 handle, 32 handles and 128
//!   handles, each through the pager and as the bare VMM loop, alternated in one run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pager::backend::cuda::{CudaBackend, PinOptions, PinTimings};
use gpu_pager::backend::{Backend, BackendKind, HostBuffer};
use gpu_pager::report::ms;
use gpu_pager::{Error, Pager, Policy, RegionOptions, Result};

use super::{
    Bare, BenchConfig, GIB, Link, MIB, OverLink, Row, Spread, size_name, weight_buffers,
    weight_sizes,
};

fn err(tag: &str, what: impl std::fmt::Display) -> Error {
    Error::InvalidArgument {
        tag: tag.to_owned(),
        reason: what.to_string(),
    }
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / GIB as f64
}

fn gib_per_s(bytes: usize, d: Duration) -> f64 {
    gib(bytes) / d.as_secs_f64().max(1e-9)
}

/// The first release of the weights without `prepin`: a fixed region and a growing region
/// (`cfg.weight_buffers` buffers), each with `first_save_overlap` (the default: the backup,
/// or the growing region's backups in one batch, pinned and filled in one pass, the save
/// after it copying nothing) and without (pin, then copy through the pump): the total against
/// 1 s per 16 GiB, its pinning (with the copy in it, with the switch on) and the pump's copy
/// against the link.
/// Each sample is a first release (the backup is freed between samples). Leaves no region
/// and the switch on.
pub(super) fn first_release_rows(
    pager: &Pager,
    cfg: &BenchConfig,
    link: &Link,
    repeats: usize,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let budget = Duration::from_secs(1).mul_f64(cfg.weights_bytes as f64 / (16 * GIB) as f64);
    let skip = pager.config().skip_unchanged;
    for (growing, overlap) in [(false, true), (false, false), (true, true), (true, false)] {
        let (tag, what) = if growing && overlap && skip {
            (
                "weights_cold_grow",
                format!(
                    "growing region ({} buffers), pinned and copied in one pass \
                     (first_save_overlap)",
                    cfg.weight_buffers
                ),
            )
        } else if growing {
            (
                "weights_cold_grow",
                format!(
                    "growing region ({} buffers), pin then copy (first_save_overlap off)",
                    cfg.weight_buffers
                ),
            )
        } else if overlap && skip {
            (
                "weights_cold",
                "fixed region, pinned and copied in one pass (first_save_overlap)".to_owned(),
            )
        } else {
            (
                "weights_cold",
                "fixed region, pin then copy (first_save_overlap off)".to_owned(),
            )
        };
        pager.set_first_save_overlap(overlap);
        log(&format!(
            "first release without prepin, {what}: pinning on the critical path"
        ));
        let bufs = if growing {
            pager.region(tag, 0, Policy::Preserve)?;
            weight_buffers(pager, tag, cfg)?
        } else {
            pager.region(tag, cfg.weights_bytes, Policy::Preserve)?;
            vec![pager.alloc(tag, cfg.weights_bytes)?]
        };
        let (mut total, mut pin, mut copy, mut hash) = (vec![], vec![], vec![], vec![]);
        let (mut copied, mut pumped) = (0, 0);
        for rep in 0..repeats.clamp(1, 3) {
            if rep > 0 {
                pager.resume(&[tag])?;
                pager.free_backup(tag)?;
            }
            for b in &bufs {
                pager.fill(b, 0x5A5A_5A5A ^ rep as u32)?;
            }
            let r = pager.release(&[tag])?;
            let steps = r.region(tag).map(|x| x.steps).unwrap_or_default();
            total.push(r.total);
            pin.push(steps.pin);
            copy.push(steps.copy);
            hash.push(steps.hash);
            copied = r.copied();
            pumped = r.copies.total_bytes();
        }
        pager.set_first_save_overlap(true);
        rows.push(Row {
            name: format!("first release, no prepin, {what}: pin + copy"),
            figure: Spread::of(&total),
            limit: Spread::of(&[budget]),
            limit_name: format!("1 s per 16 GiB (target; {:.2} GiB)", gib(copied)),
            target: Some(1.0),
            over: None,
        });
        let pinning = if pumped < copied {
            format!(
                "pinning the backup with the copy of {:.2} GiB in it",
                gib(copied - pumped)
            )
        } else {
            "pinning the backup".to_owned()
        };
        let d2h = || format!("{:.2} GiB / D2H", gib(copied));
        rows.push(Row::over_link(
            format!("  … of which {pinning} ({what})"),
            &pin,
            OverLink::d2h(copied),
            link,
            d2h(),
            None,
        ));
        rows.push(Row::over_link(
            format!(
                "  … of which the pump's copy, {:.2} GiB, hashing {:.1} ms apart ({what})",
                gib(pumped),
                ms(Spread::of(&hash).median)
            ),
            &copy,
            OverLink::d2h(copied),
            link,
            d2h(),
            if pumped == copied { Some(1.1) } else { None },
        ));
        pager.remove(tag)?;
    }
    Ok(())
}

/// The bracketed choice of a `/sys/kernel/mm/transparent_hugepage/*` file ("madvise").
fn thp_setting(file: &str) -> String {
    let path = format!("/sys/kernel/mm/transparent_hugepage/{file}");
    match std::fs::read_to_string(&path) {
        Ok(s) => s
            .split_whitespace()
            .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
            .unwrap_or(s.trim())
            .to_owned(),
        Err(_) => "unavailable".to_owned(),
    }
}

/// Bytes of this process's anonymous memory in transparent huge pages now.
fn anon_huge_bytes() -> usize {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("AnonHugePages:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// One pinning: its wall time, its steps, and the bytes that came in huge pages.
#[derive(Debug, Clone, Copy)]
struct PinSample {
    wall: Duration,
    steps: PinTimings,
    huge: usize,
}

fn pin_once(cuda: &CudaBackend, bytes: usize, opts: &PinOptions) -> Result<PinSample> {
    let huge0 = anon_huge_bytes();
    let t = Instant::now();
    let p = cuda
        .pin(bytes, opts)
        .map_err(|e| Error::backend("bench_pin", "pinning", e))?;
    let wall = t.elapsed();
    let huge = anon_huge_bytes().saturating_sub(huge0);
    let steps = p.timings();
    drop(p);
    Ok(PinSample { wall, steps, huge })
}

/// `cuMemHostAlloc` of `bytes` and zeroing them: what `alloc_pinned` did before.
fn host_alloc_once(cuda: &CudaBackend, bytes: usize) -> Result<Duration> {
    use cudarc::driver::sys;
    cuda.context()
        .bind_to_thread()
        .map_err(|e| err("bench_pin", format!("binding the context: {e:?}")))?;
    let t = Instant::now();
    let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer; the context is current.
    let rc = unsafe { sys::cuMemHostAlloc(&mut p, bytes, sys::CU_MEMHOSTALLOC_PORTABLE) };
    if rc != sys::CUresult::CUDA_SUCCESS || p.is_null() {
        return Err(err("bench_pin", format!("cuMemHostAlloc: {rc:?}")));
    }
    // SAFETY: `p` points to `bytes` bytes of host memory just allocated and used by no one.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
    let d = t.elapsed();
    // SAFETY: `p` came from cuMemHostAlloc and is freed once, here.
    let rc = unsafe { sys::cuMemFreeHost(p) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(err("bench_pin", format!("cuMemFreeHost: {rc:?}")));
    }
    Ok(d)
}

/// The sample with the median wall time.
fn median_sample(samples: &[PinSample]) -> PinSample {
    let mut s = samples.to_vec();
    s.sort_by_key(|x| x.wall);
    s[s.len() / 2]
}

/// The pinning rows (CUDA only; nothing on the host backend), at the weights' size
/// (`cfg.weights_bytes`, as `cfg.weight_buffers` buffers for the batch rows). Needs the
/// weights' size of free device memory for the overlap rows and 1 GiB for the probe.
pub(super) fn pin_rows(
    backend: &Arc<dyn Backend>,
    pager: &Pager,
    cfg: &BenchConfig,
    link: &Link,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let bytes = cfg.weights_bytes;
    if backend.info().kind != BackendKind::Cuda {
        log("pinning rows: CUDA only, skipped on this backend");
        return Ok(());
    }
    let cuda = CudaBackend::new(0).map_err(|e| Error::backend("bench_pin", "opening", e))?;
    let thp = format!(
        "THP enabled={} defrag={}",
        thp_setting("enabled"),
        thp_setting("defrag")
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    log(&format!(
        "pinning {}: {thp}, {cores} cores; cuMemHostAlloc + zero first (slow)",
        size_name(bytes)
    ));
    let old = host_alloc_once(&cuda, bytes)?;
    let limit = Spread::of(&[old]);
    rows.push(Row::over_link(
        format!(
            "pin {}: cuMemHostAlloc + zero (the old alloc_pinned), {:.2} GiB/s",
            size_name(bytes),
            gib_per_s(bytes, old)
        ),
        &[old],
        OverLink::d2h(bytes),
        link,
        format!("{} / D2H", size_name(bytes)),
        None,
    ));
    let d = PinOptions::default();
    let methods: Vec<(String, PinOptions, usize)> = vec![
        (format!("alloc_pinned ({thp})"), d, 3),
        (
            "no MADV_HUGEPAGE".to_owned(),
            PinOptions {
                huge_pages: false,
                ..d
            },
            2,
        ),
        (
            "a write per page instead of MADV_POPULATE_WRITE".to_owned(),
            PinOptions {
                populate: false,
                ..d
            },
            2,
        ),
        (
            "touched by 1 thread".to_owned(),
            PinOptions {
                touch_threads: 1,
                ..d
            },
            1,
        ),
        (
            "1 GiB pieces registered one after another".to_owned(),
            PinOptions {
                piece_bytes: GIB,
                ..d
            },
            2,
        ),
        (
            "256 MiB pieces registered in parallel".to_owned(),
            PinOptions {
                piece_bytes: 256 * MIB,
                parallel_register: true,
                ..d
            },
            2,
        ),
        (
            "1 GiB pieces registered in parallel".to_owned(),
            PinOptions {
                piece_bytes: GIB,
                parallel_register: true,
                ..d
            },
            2,
        ),
        (
            "4 GiB pieces registered in parallel".to_owned(),
            PinOptions {
                piece_bytes: 4 * GIB,
                parallel_register: true,
                ..d
            },
            2,
        ),
    ];
    for (what, opts, n) in &methods {
        log(&format!("pinning {}: {what}", size_name(bytes)));
        let samples = (0..*n)
            .map(|_| pin_once(&cuda, bytes, opts))
            .collect::<Result<Vec<_>>>()?;
        rows.push(pin_row(
            format!("pin {}: mmap + touch + register, {what}", size_name(bytes)),
            bytes,
            &samples,
            limit,
            "cuMemHostAlloc + zero, same bytes",
        ));
    }
    batch_rows(&cuda, cfg, limit, log, rows)?;
    cross_registration_rows(&cuda, pager, log, rows)?;
    overlap_rows(&cuda, pager, bytes, link, log, rows)?;
    batch_from_device_rows(&cuda, pager, cfg, link, log, rows)
}

/// The growing region's backups (`cfg.weight_buffers` buffers of the weights' sizes, their
/// sources back to back in one device range) pinned and filled in one pipeline
/// (`pin_many_from_device` in [`gpu_pager::backend::cuda::FIRST_BACKUP_PIECE_BYTES`] parts,
/// what its first release does with `first_save_overlap`) against pinning the batch first
/// and copying each buffer then (`pin_many`, then `copy_to_host` each), alternated; against
/// 1 s per 16 GiB.
fn batch_from_device_rows(
    cuda: &CudaBackend,
    pager: &Pager,
    cfg: &BenchConfig,
    link: &Link,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    use gpu_pager::backend::DeviceRange;
    use gpu_pager::backend::cuda::FIRST_BACKUP_PIECE_BYTES;
    let sizes = weight_sizes(cfg.weights_bytes, cfg.weight_buffers);
    let bytes: usize = sizes.iter().sum();
    log(&format!(
        "pinning and filling {} as {} buffers: pin_many_from_device against pin_many, then copy",
        size_name(bytes),
        sizes.len()
    ));
    let tag = "bench_pin_batch_src";
    pager.region(tag, bytes, Policy::Discard)?;
    let buf = pager.alloc(tag, bytes)?;
    pager.fill(&buf, 0x1234_5678)?;
    let base = pager.ptr(&buf)?;
    let mut ranges = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &n in &sizes {
        ranges.push(DeviceRange {
            src: base + at as u64,
            bytes: n,
        });
        at += n;
    }
    // The last buffer's tail holds the pattern at its device offset.
    let last = sizes.last().copied().unwrap_or(0);
    let tail = last.min(4096);
    let phase = bytes - tail;
    let d = PinOptions::default();
    let opts = PinOptions {
        piece_bytes: FIRST_BACKUP_PIECE_BYTES,
        ..d
    };
    let small_pages = PinOptions {
        huge_pages: false,
        ..opts
    };
    let (mut serial, mut overlapped, mut overlapped_small) = (vec![], vec![], vec![]);
    let mut counters = [ThpCounters::default(); 2];
    for _ in 0..2 {
        let t = Instant::now();
        let mut bufs = cuda
            .pin_many(&sizes, &d)
            .map_err(|e| Error::backend(tag, "pinning a batch", e))?;
        for (host, r) in bufs.iter_mut().zip(&ranges) {
            // SAFETY: `r` lies inside the live buffer; the copy waits.
            unsafe { cuda.copy_to_host(host.as_mut_slice(), r.src) }
                .map_err(|e| Error::backend(tag, "copying", e))?;
        }
        serial.push(t.elapsed());
        drop(bufs);
        // With huge pages (the default), then without: on a host whose free memory is
        // fragmented, every huge-page fault may have to compact memory first.
        for (k, o) in [opts, small_pages].iter().enumerate() {
            let before = ThpCounters::now();
            let t = Instant::now();
            // SAFETY: every range lies inside the live buffer, not written meanwhile.
            let bufs = unsafe { cuda.pin_many_from_device(&ranges, o) }
                .map_err(|e| Error::backend(tag, "pin_many_from_device", e))?;
            let wall = t.elapsed();
            counters[k].add(&ThpCounters::now().since(&before));
            let ok = bufs
                .last()
                .is_some_and(|h| holds_pattern(&h.as_slice()[last - tail..], 0x1234_5678, phase));
            if !ok {
                return Err(err(tag, "pin_many_from_device copied wrong data"));
            }
            let steps = bufs.first().map(|p| p.timings()).unwrap_or_default();
            [&mut overlapped, &mut overlapped_small][k].push((wall, steps));
        }
    }
    log(&format!(
        "pin_many_from_device, the kernel's counters over its runs: with MADV_HUGEPAGE {}; \
         without {}",
        counters[0], counters[1]
    ));
    pager.remove(tag)?;
    let budget = Duration::from_secs(1).mul_f64(bytes as f64 / (16 * GIB) as f64);
    let what = format!("{} as {} buffers", size_name(bytes), sizes.len());
    rows.push(Row {
        name: format!("backups of {what}: pin_many, then copy each"),
        figure: Spread::of(&serial),
        limit: Spread::of(&[budget]),
        limit_name: "1 s per 16 GiB (target)".into(),
        target: Some(1.0),
        over: None,
    });
    rows.push(pipeline_row(
        format!(
            "backups of {what}: pin_many_from_device, {} parts",
            size_name(FIRST_BACKUP_PIECE_BYTES)
        ),
        &overlapped,
        bytes,
        link,
    ));
    rows.push(pipeline_row(
        format!(
            "backups of {what}: pin_many_from_device, {} parts, no MADV_HUGEPAGE",
            size_name(FIRST_BACKUP_PIECE_BYTES)
        ),
        &overlapped_small,
        bytes,
        link,
    ));
    Ok(())
}

/// The kernel's counters of direct compaction and transparent huge-page faults
/// (`/proc/vmstat`; zeros where it cannot be read).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ThpCounters {
    compact_stall: u64,
    thp_fault_alloc: u64,
    thp_fault_fallback: u64,
}

impl ThpCounters {
    fn now() -> ThpCounters {
        let text = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
        let get = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
                .unwrap_or(0)
        };
        ThpCounters {
            compact_stall: get("compact_stall"),
            thp_fault_alloc: get("thp_fault_alloc"),
            thp_fault_fallback: get("thp_fault_fallback"),
        }
    }

    fn since(&self, before: &ThpCounters) -> ThpCounters {
        ThpCounters {
            compact_stall: self.compact_stall.saturating_sub(before.compact_stall),
            thp_fault_alloc: self.thp_fault_alloc.saturating_sub(before.thp_fault_alloc),
            thp_fault_fallback: self
                .thp_fault_fallback
                .saturating_sub(before.thp_fault_fallback),
        }
    }

    fn add(&mut self, d: &ThpCounters) {
        self.compact_stall += d.compact_stall;
        self.thp_fault_alloc += d.thp_fault_alloc;
        self.thp_fault_fallback += d.thp_fault_fallback;
    }
}

impl std::fmt::Display for ThpCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "compact_stall +{}, thp_fault_alloc +{}, thp_fault_fallback +{}",
            self.compact_stall, self.thp_fault_alloc, self.thp_fault_fallback
        )
    }
}

/// The row of a pin-and-copy pipeline over `bytes` (`samples`: wall time and the pinning's
/// timings of each run; the median run's steps go into the name), against 1 s per 16 GiB.
fn pipeline_row(
    what: String,
    samples: &[(Duration, PinTimings)],
    bytes: usize,
    link: &Link,
) -> Row {
    let mut s = samples.to_vec();
    s.sort_by_key(|x| x.0);
    let t = s.get(s.len() / 2).map(|x| x.1).unwrap_or_default();
    Row {
        name: format!(
            "{what} touched on a helper while earlier ones register and copy (waited for \
             touching {:.0} ms, register+enqueue {:.0} ms, then wait {:.0} ms)",
            ms(t.touch),
            ms(t.register),
            ms(t.wait)
        ),
        figure: Spread::of(&samples.iter().map(|x| x.0).collect::<Vec<_>>()),
        limit: Spread::of(&[Duration::from_secs(1).mul_f64(bytes as f64 / (16 * GIB) as f64)]),
        limit_name: format!(
            "1 s per 16 GiB (target; copy alone {:.0} ms)",
            ms(OverLink::d2h(bytes).time(link))
        ),
        target: Some(1.0),
        over: None,
    }
}

/// The growing region's backups (`cfg.weight_buffers` buffers of the weights' sizes, each
/// rounded up to the 2 MiB the region maps) pinned in one batch, as its first release pins
/// them (`pin_many`, one registration per buffer), registered one after another (what
/// `alloc_pinned_many` does) and on parallel threads; against `limit` (cuMemHostAlloc + zero
/// of the same bytes, this run).
fn batch_rows(
    cuda: &CudaBackend,
    cfg: &BenchConfig,
    limit: Spread,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let sizes: Vec<usize> = weight_sizes(cfg.weights_bytes, cfg.weight_buffers)
        .into_iter()
        .map(|n| n.next_multiple_of(2 * MIB))
        .collect();
    let bytes: usize = sizes.iter().sum();
    let d = PinOptions::default();
    for (what, opts) in [
        ("registered one after another (alloc_pinned_many)", d),
        (
            "registered on parallel threads",
            PinOptions {
                parallel_register: true,
                ..d
            },
        ),
    ] {
        log(&format!(
            "pinning {} as {} buffers in one batch, {what}",
            size_name(bytes),
            sizes.len()
        ));
        let mut samples = Vec::new();
        for _ in 0..2 {
            let huge0 = anon_huge_bytes();
            let t = Instant::now();
            let bufs = cuda
                .pin_many(&sizes, &opts)
                .map_err(|e| Error::backend("bench_pin", "pinning a batch", e))?;
            let wall = t.elapsed();
            let huge = anon_huge_bytes().saturating_sub(huge0);
            let steps = bufs.first().map(|p| p.timings()).unwrap_or_default();
            drop(bufs);
            samples.push(PinSample { wall, steps, huge });
        }
        rows.push(pin_row(
            format!(
                "pin {} as {} buffers in one batch, {what}",
                size_name(bytes),
                sizes.len()
            ),
            bytes,
            &samples,
            limit,
            "cuMemHostAlloc + zero, weights' bytes",
        ));
    }
    Ok(())
}

/// A pinning method's row: `what`, then the median sample's rate and steps, against
/// `limit` (named `limit_name`).
fn pin_row(
    what: String,
    bytes: usize,
    samples: &[PinSample],
    limit: Spread,
    limit_name: &str,
) -> Row {
    let m = median_sample(samples);
    let s = m.steps;
    Row {
        name: format!(
            "{what}: {:.2} GiB/s (touch {:.0} ms on {} threads, register {:.0} ms, {} \
             registrations; {:.1} GiB in huge pages)",
            gib_per_s(bytes, m.wall),
            ms(s.touch),
            s.touch_threads,
            ms(s.register),
            s.pieces,
            gib(m.huge)
        ),
        figure: Spread::of(&samples.iter().map(|x| x.wall).collect::<Vec<_>>()),
        limit,
        limit_name: limit_name.into(),
        target: None,
        over: None,
    }
}

/// Whether `host` holds the 32-bit `pattern` repeated from byte `phase` of it.
fn holds_pattern(host: &[u8], pattern: u32, phase: usize) -> bool {
    let p = pattern.to_le_bytes();
    host.iter()
        .enumerate()
        .all(|(i, &b)| b == p[(i + phase) % 4])
}

/// A 1 GiB copy whose host range spans two registrations (1 GiB pieces, the boundary in its
/// middle) against the same copy inside one, each way, through the driver's copy (not the
/// backend's path): does the driver take it, and at what speed.
fn cross_registration_rows(
    cuda: &CudaBackend,
    pager: &Pager,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    use cudarc::driver::sys;
    log("a copy across two registrations against one inside a registration");
    let tag = "bench_pin_probe";
    pager.region(tag, GIB, Policy::Discard)?;
    let dev = pager.alloc(tag, GIB)?;
    let src = pager.ptr(&dev)?;
    let pattern = 0x0F1E_2D3C;
    let opts = PinOptions {
        piece_bytes: GIB,
        ..PinOptions::default()
    };
    let mut host = cuda
        .pin(2 * GIB, &opts)
        .map_err(|e| Error::backend(tag, "pinning", e))?;
    cuda.context()
        .bind_to_thread()
        .map_err(|e| err(tag, format!("binding the context: {e:?}")))?;
    let inside = 0..GIB;
    let across = GIB / 2..GIB / 2 + GIB;
    let mut d2h = [vec![], vec![]];
    let mut h2d = [vec![], vec![]];
    let mut failure: [Option<String>; 2] = [None, None];
    for _ in 0..3 {
        for (k, range) in [inside.clone(), across.clone()].into_iter().enumerate() {
            pager.fill(&dev, pattern)?;
            let dst = &mut host.as_mut_slice()[range];
            dst.fill(0);
            let t = Instant::now();
            // SAFETY: `dst` is 1 GiB of live pinned memory, `src` 1 GiB of live device memory.
            let rc = unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, GIB) };
            let d = t.elapsed();
            if rc != sys::CUresult::CUDA_SUCCESS {
                failure[k] = Some(format!("D2H refused: {rc:?}"));
                continue;
            }
            if !holds_pattern(dst, pattern, 0) {
                failure[k] = Some("D2H WRONG DATA".into());
            }
            d2h[k].push(d);
            // Back again, into a poisoned device buffer.
            pager.fill(&dev, !pattern)?;
            let t = Instant::now();
            // SAFETY: as above.
            let rc = unsafe { sys::cuMemcpyHtoD_v2(src, dst.as_ptr().cast(), GIB) };
            let d = t.elapsed();
            if rc != sys::CUresult::CUDA_SUCCESS {
                failure[k] = Some(format!("H2D refused: {rc:?}"));
                continue;
            }
            let mut back = vec![0u8; 64 * MIB];
            for offset in [0, GIB / 2 - 32 * MIB, GIB - 64 * MIB] {
                pager.read(&dev, offset, &mut back)?;
                if !holds_pattern(&back, pattern, offset) {
                    failure[k] = Some("H2D WRONG DATA".into());
                }
            }
            h2d[k].push(d);
        }
    }
    drop(host);
    pager.remove(tag)?;
    for (dir, samples) in [("D2H", &d2h), ("H2D", &h2d)] {
        let note = match &failure[1] {
            Some(f) => format!(": {f}"),
            None if samples[1].is_empty() => ": no sample".into(),
            None => format!(
                ": taken, {:.1} GB/s",
                GIB as f64 / Spread::of(&samples[1]).median.as_secs_f64() / 1e9
            ),
        };
        rows.push(Row {
            name: format!("{dir} 1 GiB across two registrations (1 GiB pieces){note}"),
            figure: Spread::of(&samples[1]),
            limit: Spread::of(&samples[0]),
            limit_name: format!(
                "{dir} 1 GiB inside one registration{}",
                failure[0]
                    .as_ref()
                    .map_or(String::new(), |f| format!(" ({f})"))
            ),
            target: None,
            over: None,
        });
    }
    Ok(())
}

/// A first backup in one pass (`pin_from_device`: a helper touches piece k+1 while piece k
/// registers and piece k-1 copies), in pieces of 256 MiB to 2 GiB (the pager's first backups
/// use [`gpu_pager::backend::cuda::FIRST_BACKUP_PIECE_BYTES`]), against pinning first and
/// copying then, alternated, on a device range of `bytes`.
fn overlap_rows(
    cuda: &CudaBackend,
    pager: &Pager,
    bytes: usize,
    link: &Link,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    log("pinning overlapped with the copy (pin_from_device) against pin, then copy");
    let tag = "bench_pin_src";
    pager.region(tag, bytes, Policy::Discard)?;
    let buf = pager.alloc(tag, bytes)?;
    pager.fill(&buf, 0x1234_5678)?;
    let src = pager.ptr(&buf)?;
    let d = PinOptions::default();
    let pieces = [256 * MIB, 512 * MIB, GIB, 2 * GIB];
    let mut serial = vec![];
    let mut overlapped: Vec<Vec<(Duration, PinTimings)>> = vec![vec![]; pieces.len()];
    for _ in 0..2 {
        let t = Instant::now();
        let mut host = cuda
            .pin(bytes, &d)
            .map_err(|e| Error::backend(tag, "pinning", e))?;
        // SAFETY: `src .. src + bytes` is the live buffer; the copy waits.
        unsafe { cuda.copy_to_host(host.as_mut_slice(), src) }
            .map_err(|e| Error::backend(tag, "copying", e))?;
        serial.push(t.elapsed());
        drop(host);
        for (k, &piece) in pieces.iter().enumerate() {
            let opts = PinOptions {
                piece_bytes: piece,
                ..d
            };
            let t = Instant::now();
            // SAFETY: `src .. src + bytes` is the live buffer, not written meanwhile.
            let host = unsafe { cuda.pin_from_device(bytes, &opts, src) }
                .map_err(|e| Error::backend(tag, "pin_from_device", e))?;
            let wall = t.elapsed();
            if !holds_pattern(&host.as_slice()[bytes - 4096..], 0x1234_5678, bytes - 4096) {
                return Err(err(tag, "pin_from_device copied wrong data"));
            }
            overlapped[k].push((wall, host.timings()));
        }
    }
    pager.remove(tag)?;
    let budget = Duration::from_secs(1).mul_f64(bytes as f64 / (16 * GIB) as f64);
    rows.push(Row {
        name: format!(
            "first backup of {}: pin (one registration), then copy",
            size_name(bytes)
        ),
        figure: Spread::of(&serial),
        limit: Spread::of(&[budget]),
        limit_name: "1 s per 16 GiB (target)".into(),
        target: Some(1.0),
        over: None,
    });
    for (k, samples) in overlapped.iter().enumerate() {
        rows.push(pipeline_row(
            format!(
                "first backup of {}: pin_from_device, {} pieces,",
                size_name(bytes),
                size_name(pieces[k])
            ),
            samples,
            bytes,
            link,
        ));
    }
    Ok(())
}

/// Releases and resumes of the KV cache (`kv_size` bytes, `Discard`) as 1 handle (or the
/// fewest the driver creates), 32 handles and 128 handles: each through the pager and as the
/// bare VMM loop of the same pattern, all alternated round by round so that every pattern
/// sees the same driver state. Needs `kv_size` of free device memory (one pattern is mapped
/// at a time). Leaves no region.
pub(super) fn kv_pattern_rows(
    pager: &Pager,
    kv_size: usize,
    repeats: usize,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let backend = pager.backend().clone();
    let g = backend.info().granularity;
    let round = |c: usize| c.max(g).next_multiple_of(g);
    // Memory unmapped a moment ago is not always available at once: retry out-of-memory
    // failures for up to 5 s before taking them for an answer.
    let create = |tag: &str, chunk: usize| {
        let opts = RegionOptions {
            chunk_bytes: Some(chunk),
            ..RegionOptions::default()
        };
        let started = Instant::now();
        loop {
            match pager.region_with(tag, kv_size, Policy::Discard, opts) {
                Err(Error::OutOfMemory { .. }) if started.elapsed().as_secs() < 5 => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                other => return other,
            }
        }
    };
    // The single handle: as large as the driver creates (halving on failure).
    let mut one = round(kv_size);
    let single = loop {
        match create("kv_1", one) {
            Ok(info) => break info.chunk_bytes,
            Err(e) if one > 2 * GIB => {
                log(&format!(
                    "kv patterns: one handle of {} failed ({e}); trying half",
                    size_name(one)
                ));
                one /= 2;
            }
            Err(e) => return Err(e),
        }
    };
    pager.release(&["kv_1"])?;
    let patterns = [
        ("kv_1", single),
        ("kv_32", round(kv_size.div_ceil(32))),
        ("kv_128", round(kv_size.div_ceil(128))),
    ];
    for &(tag, chunk) in &patterns[1..] {
        create(tag, chunk)?;
        pager.release(&[tag])?;
    }
    let chunks: Vec<usize> = patterns
        .iter()
        .map(|(tag, _)| pager.info(tag).map(|i| i.chunk_bytes))
        .collect::<Result<_>>()?;
    let name = |k: usize| format!("{} × {}", kv_size.div_ceil(chunks[k]), size_name(chunks[k]));
    log(&format!(
        "kv patterns: {}, {}, {}, pager and bare loop alternated",
        name(0),
        name(1),
        name(2)
    ));
    let mut bare = Bare::new(backend.as_ref(), kv_size)?;
    let n = patterns.len();
    let (mut res, mut rel, mut map, mut unmap) = (
        vec![vec![]; n],
        vec![vec![]; n],
        vec![vec![]; n],
        vec![vec![]; n],
    );
    for _ in 0..repeats * 3 {
        for (k, (tag, _)) in patterns.iter().enumerate() {
            res[k].push(pager.resume(&[tag])?.total);
            rel[k].push(pager.release(&[tag])?.total);
            let (m, u) = bare.cycle(backend.as_ref(), chunks[k])?;
            map[k].push(m);
            unmap[k].push(u);
        }
    }
    super::kv_order::rows(
        pager,
        backend.as_ref(),
        &mut bare,
        patterns[1].0,
        chunks[1],
        chunks[2],
        (&name(1), &name(2)),
        repeats,
        rows,
    )?;
    let gib_name = format!("{:.0} GiB", gib(kv_size));
    for k in 0..n {
        rows.push(Row {
            name: format!("resume KV {gib_name} as {} (pager)", name(k)),
            figure: Spread::of(&res[k]),
            limit: Spread::of(&map[k]),
            limit_name: format!("bare create+map+set-access, {}", name(k)),
            target: Some(1.1),
            over: None,
        });
        rows.push(Row {
            name: format!("release KV {gib_name} as {} (pager)", name(k)),
            figure: Spread::of(&rel[k]),
            limit: Spread::of(&unmap[k]),
            limit_name: format!("bare unmap+release, {}", name(k)),
            target: Some(1.1),
            over: None,
        });
    }
    let base = n - 1; // 128 handles: the pattern of the old 512 MiB default
    for k in 0..base {
        rows.push(Row {
            name: format!("bare map, {}", name(k)),
            figure: Spread::of(&map[k]),
            limit: Spread::of(&map[base]),
            limit_name: format!("bare map, {}", name(base)),
            target: None,
            over: None,
        });
        rows.push(Row {
            name: format!("bare unmap, {}", name(k)),
            figure: Spread::of(&unmap[k]),
            limit: Spread::of(&unmap[base]),
            limit_name: format!("bare unmap, {}", name(base)),
            target: None,
            over: None,
        });
    }
    if bare.retries > 0 {
        log(&format!(
            "kv patterns: the bare loop waited {} times for memory unmapped just before",
            bare.retries
        ));
    }
    for (tag, _) in &patterns {
        pager.remove(tag)?;
    }
    Ok(())
}
