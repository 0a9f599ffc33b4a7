//! Where a resume's mapping time goes after memory was freed, and what it does to a copy
//! kernel running at the same time.
//!
//! Right after a trainer's free, mapping 16 GiB took 41–44 ms against 8 ms settled, and the
//! resume that maps while the copy kernel runs took as long as mapping first and copying
//! after (BENCHMARKS.md, third session). These rows time `cuMemCreate`, `cuMemMap` and
//! `cuMemSetAccess` apart, at several delays after a free (the trainer's, or the release
//! of the same handles), and time a copy kernel alone against the same kernel with each of
//! those calls made while it runs, and, right after a trainer's free, the same 16 GiB made
//! of handles of several sizes, with the device idle and while the copy kernel runs;
//! whether releasing the KV cache's 32 handles of 2 GiB goes faster on several threads; and
//! whether those 32 handles cost the same in one reserved range as in a range each.
//! CUDA only: the calls are made here, on raw handles.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, sys};
use gpu_pager::backend::{Backend, Direction, HostBuffer, Mover, RawCopy};
use gpu_pager::report::ms;
use gpu_pager::{Error, Result};

use super::{GIB, Link, MIB, OverLink, Row, Spread, size_name, streams::Stream, trainer_step};

/// Handles created with `cuMemCreate` and, once [`Vmm::map`] ran, mapped back to back into
/// a reservation of their total size. Dropping them unmaps what is mapped, releases the
/// handles and frees the reservation.
struct Handles {
    base: sys::CUdeviceptr,
    /// The reservation's length (all handles, created or not).
    reserved: usize,
    size: usize,
    handles: Vec<sys::CUmemGenericAllocationHandle>,
    mapped: usize,
}

impl Drop for Handles {
    fn drop(&mut self) {
        for (i, &h) in self.handles.iter().enumerate() {
            if i < self.mapped {
                let at = self.base + (i * self.size) as u64;
                // SAFETY: handle i is mapped at `at` (by `Vmm::map`), and the probe waited
                // for every kernel that used it.
                let _ = unsafe { sys::cuMemUnmap(at, self.size) };
            }
            // SAFETY: the handle came from cuMemCreate and is released once, here.
            let _ = unsafe { sys::cuMemRelease(h) };
        }
        // SAFETY: the reservation came from cuMemAddressReserve with this size, and nothing
        // is mapped in it any more.
        let _ = unsafe { sys::cuMemAddressFree(self.base, self.reserved) };
    }
}

/// The raw VMM calls, on the device's primary context (the backend's).
struct Vmm {
    ctx: Arc<CudaContext>,
    prop: sys::CUmemAllocationProp,
    access: sys::CUmemAccessDesc,
}

fn driver(what: &str, r: sys::CUresult) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(Error::InvalidArgument {
            tag: "vmm_probe".into(),
            reason: format!("{what} failed: {e:?}"),
        }),
    }
}

/// The times of one create, map and access change.
#[derive(Clone, Copy, Default)]
struct Times {
    /// The first handle's create (how long a resume waits before its first copy can start).
    first: Duration,
    create: Duration,
    map: Duration,
    access: Duration,
}

impl Vmm {
    fn new() -> Result<Vmm> {
        let ctx = CudaContext::new(0).map_err(|e| Error::InvalidArgument {
            tag: "vmm_probe".into(),
            reason: format!("opening the primary context failed: {e:?}"),
        })?;
        ctx.bind_to_thread().map_err(|e| Error::InvalidArgument {
            tag: "vmm_probe".into(),
            reason: format!("binding the primary context failed: {e:?}"),
        })?;
        let location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        };
        Ok(Vmm {
            ctx,
            prop: gpu_pager::backend::cuda::device_alloc_prop(0),
            access: sys::CUmemAccessDesc {
                location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            },
        })
    }

    /// Reserves `count * size` bytes and creates `count` handles of `size`; returns them
    /// with the time the creates took and the time the first one took.
    fn create(&self, count: usize, size: usize) -> Result<(Handles, Duration, Duration)> {
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is a valid out-pointer; alignment 0 and address 0 let the driver
        // choose.
        driver("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, count * size, 0, 0, 0)
        })?;
        let mut out = Handles {
            base,
            reserved: count * size,
            size,
            handles: Vec::with_capacity(count),
            mapped: 0,
        };
        let t = Instant::now();
        let mut first = Duration::ZERO;
        for _ in 0..count {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `h` is a valid out-pointer and `prop` is fully initialised.
            driver("cuMemCreate", unsafe {
                sys::cuMemCreate(&mut h, size, &self.prop, 0)
            })?;
            out.handles.push(h);
            if out.handles.len() == 1 {
                first = t.elapsed();
            }
        }
        Ok((out, t.elapsed(), first))
    }

    /// Maps every handle of `h` and enables access over them; returns the two times.
    fn map(&self, h: &mut Handles) -> Result<(Duration, Duration)> {
        let t = Instant::now();
        for i in 0..h.handles.len() {
            let at = h.base + (i * h.size) as u64;
            // SAFETY: `at .. at + size` lies in h's reservation, unmapped; the handle is
            // live and exactly `size` bytes.
            driver("cuMemMap", unsafe {
                sys::cuMemMap(at, h.size, 0, h.handles[i], 0)
            })?;
            h.mapped = i + 1;
        }
        let map = t.elapsed();
        let t = Instant::now();
        // SAFETY: the whole reservation is mapped just above; one valid descriptor.
        driver("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(h.base, h.size * h.handles.len(), &self.access, 1)
        })?;
        Ok((map, t.elapsed()))
    }

    /// Unmaps `h` (a call per handle), then releases its handles on `threads` threads
    /// (each a share of them, in order); returns the two times. The reservation is freed
    /// when `h` drops.
    fn give_back(&self, mut h: Handles, threads: usize) -> Result<(Duration, Duration)> {
        let t = Instant::now();
        for i in 0..h.mapped {
            let at = h.base + (i * h.size) as u64;
            // SAFETY: handle i is mapped at `at` (by `Vmm::map`); no kernel uses it.
            driver("cuMemUnmap", unsafe { sys::cuMemUnmap(at, h.size) })?;
        }
        h.mapped = 0;
        let unmap = t.elapsed();
        let handles = std::mem::take(&mut h.handles);
        let per = handles.len().div_ceil(threads.max(1)).max(1);
        let ctx = &self.ctx;
        let t = Instant::now();
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let joins: Vec<_> = handles
                .chunks(per)
                .map(|share| {
                    s.spawn(move || {
                        // Bound or not, the releases are tried, so that no handle leaks.
                        let bound = ctx.bind_to_thread().map_err(|e| Error::InvalidArgument {
                            tag: "vmm_probe".into(),
                            reason: format!("binding the primary context failed: {e:?}"),
                        });
                        // Every handle of the share is released, also after a failure
                        // (the first error is returned), so that none leaks.
                        let mut first = Ok(());
                        for &handle in share {
                            // SAFETY: each handle came from cuMemCreate, is unmapped above and
                            // is released once, here (the shares do not overlap).
                            let r = driver("cuMemRelease", unsafe { sys::cuMemRelease(handle) });
                            first = first.and(r);
                        }
                        bound.and(first)
                    })
                })
                .collect();
            joins
                .into_iter()
                .map(|j| {
                    j.join().unwrap_or_else(|_| {
                        Err(Error::InvalidArgument {
                            tag: "vmm_probe".into(),
                            reason: "a release thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        let release = t.elapsed();
        results.into_iter().collect::<Result<()>>()?;
        Ok((unmap, release))
    }

    /// Creates, maps and enables `count` handles of `size`.
    fn cycle(&self, count: usize, size: usize) -> Result<(Handles, Times)> {
        let (mut h, create, first) = self.create(count, size)?;
        let (map, access) = self.map(&mut h)?;
        Ok((
            h,
            Times {
                first,
                create,
                map,
                access,
            },
        ))
    }
}

/// What the probe needs from the after-free rows: a resident device buffer, pinned host
/// memory of the same size and a stream of the backend's context.
pub(super) struct Probe<'a> {
    pub backend: &'a dyn Backend,
    pub dst: u64,
    pub host: &'a dyn HostBuffer,
    pub stream: &'a Stream,
    /// The link measured settled: `host`'s bytes over it are the rows' limit.
    pub link: &'a Link,
}

/// Appends the rows; `margin` is what the trainer leaves free.
pub(super) fn rows(
    p: &Probe<'_>,
    margin: usize,
    repeats: usize,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let vmm = Vmm::new()?;
    let (count, size) = (8, 2 * GIB);
    let what = format!("{count} × {} GiB", size / GIB);
    log(&format!(
        "VMM calls of {what} after a free, and a copy kernel of {} GiB with VMM calls made while it runs",
        p.host.len() / GIB
    ));
    // For (c): enough kernels in a row to outlast the VMM calls.
    let over = OverLink::h2d(p.host.len());
    let launches = ((Duration::from_millis(500).as_secs_f64() / over.time(p.link).as_secs_f64())
        .ceil() as usize)
        .clamp(1, 64);
    log(&format!(
        "then (c), handle size: {} as handles of 2 GiB to 128 MiB right after a trainer's \
         free, idle and while {launches} copy kernels of {} GiB run",
        size_name(count * size),
        p.host.len() / GIB
    ));
    // (a) After a trainer's free / after releasing the same handles, at several delays.
    let delays = [0u64, 50, 200, 1000];
    let mut summary = |name: String, t: &[Times], rows: &mut Vec<Row>| {
        let pick = |f: fn(&Times) -> Duration| Spread::of(&t.iter().map(f).collect::<Vec<_>>());
        let (c, m, a) = (pick(|t| t.create), pick(|t| t.map), pick(|t| t.access));
        log(&format!(
            "{name}: create {:.1} ms (the first handle {:.1} ms), map {:.1} ms, access {:.1} ms (medians)",
            ms(c.median),
            ms(pick(|t| t.first).median),
            ms(m.median),
            ms(a.median)
        ));
        let total: Vec<Duration> = t.iter().map(|t| t.create + t.map + t.access).collect();
        let limit = format!("{} GiB / H2D (settled)", p.host.len() / GIB);
        rows.push(Row::over_link(name, &total, over, p.link, limit, None));
    };
    for &delay in &delays {
        let (mut trainer, mut own) = (vec![], vec![]);
        for _ in 0..repeats {
            trainer_step(p.backend, margin)?;
            std::thread::sleep(Duration::from_millis(delay));
            let (h, t) = vmm.cycle(count, size)?;
            trainer.push(t);
            drop(h);
            std::thread::sleep(Duration::from_millis(delay));
            own.push(vmm.cycle(count, size)?.1);
        }
        summary(
            format!("create+map+access {what}, {delay} ms after a trainer's free"),
            &trainer,
            rows,
        );
        summary(
            format!("create+map+access {what}, {delay} ms after releasing the same handles"),
            &own,
            rows,
        );
    }

    // (b) The copy kernel alone, and with VMM calls made while it runs.
    let copy = RawCopy::whole(Direction::ToDevice, p.host, p.dst);
    // Launches the kernel `launches` times in a row, runs `f` while they copy, waits for
    // them (always, before anything can return: they read `host`), and returns the
    // kernels' time and `f`'s value (handles it made stay alive until the caller drops
    // them, after the kernels).
    type Made = (Option<Handles>, Times);
    let meanwhile_n =
        |launches: usize, f: &mut dyn FnMut() -> Result<Made>| -> Result<(Duration, Made)> {
            let t = Instant::now();
            let mut launched = Ok(());
            for _ in 0..launches {
                // SAFETY: `dst` is a resident device buffer of the host buffer's size, the host
                // buffer is this backend's pinned memory, and both live until the stream is
                // synchronized just below, whatever happens here.
                launched = unsafe { p.backend.copy_on(&copy, Mover::CopyKernel, p.stream.raw()) }
                    .map_err(|e| Error::backend("vmm_probe", "copy kernel", e));
                if launched.is_err() {
                    break;
                }
            }
            let made = if launched.is_ok() {
                f()
            } else {
                Ok((None, Times::default()))
            };
            p.stream.sync()?;
            launched?;
            Ok((t.elapsed(), made?))
        };
    let meanwhile = |f: &mut dyn FnMut() -> Result<Made>| meanwhile_n(1, f);
    let cycle = || -> Result<Made> {
        let (h, times) = vmm.cycle(count, size)?;
        Ok((Some(h), times))
    };
    let settle = Duration::from_secs(1);
    let (mut alone, mut with_create, mut with_map, mut with_all, mut after_free) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut during_create, mut during_map, mut during_all, mut during_after) =
        (vec![], vec![], vec![], vec![]);
    for _ in 0..repeats {
        std::thread::sleep(settle);
        alone.push(meanwhile(&mut || Ok((None, Times::default())))?.0);

        std::thread::sleep(settle);
        let (k, (created, times)) = meanwhile(&mut || {
            let (h, create, first) = vmm.create(count, size)?;
            let times = Times {
                first,
                create,
                ..Times::default()
            };
            Ok((Some(h), times))
        })?;
        with_create.push(k);
        during_create.push(times);

        std::thread::sleep(settle);
        let mut created = created;
        let (k, (_, times)) = meanwhile(&mut || {
            let Some(h) = created.as_mut() else {
                return Ok((None, Times::default()));
            };
            let (map, access) = vmm.map(h)?;
            let times = Times {
                map,
                access,
                ..Times::default()
            };
            Ok((None, times))
        })?;
        with_map.push(k);
        during_map.push(times);
        drop(created);

        std::thread::sleep(settle);
        let (k, (made, times)) = meanwhile(&mut { cycle })?;
        drop(made);
        with_all.push(k);
        during_all.push(times);

        trainer_step(p.backend, margin)?;
        let (k, (made, times)) = meanwhile(&mut { cycle })?;
        drop(made);
        after_free.push(k);
        during_after.push(times);
    }
    let gib = p.host.len() / GIB;
    let mut kernel_row = |name: &str, samples: &[Duration], during: &[Times]| {
        if !during.is_empty() {
            summary(format!("… the VMM calls made while {name}"), during, rows);
        }
        rows.push(Row::over_link(
            format!("copy kernel {gib} GiB H2D, {name}"),
            samples,
            over,
            p.link,
            format!("{gib} GiB / H2D (settled)"),
            None,
        ));
    };
    kernel_row("alone, settled", &alone, &[]);
    kernel_row(
        &format!("creating {what} (not mapped) meanwhile"),
        &with_create,
        &during_create,
    );
    kernel_row(
        &format!("mapping {what} created before meanwhile"),
        &with_map,
        &during_map,
    );
    kernel_row(
        &format!("creating and mapping {what} meanwhile"),
        &with_all,
        &during_all,
    );
    kernel_row(
        &format!("right after a trainer's free, creating and mapping {what} meanwhile"),
        &after_free,
        &during_after,
    );

    // (c) Handle size right after a trainer's free: the same bytes as handles of several
    // sizes, with the device idle, and while the copy kernel runs (queued so that it
    // outlasts the calls, as in a resume that maps ahead while it copies).
    let total = count * size;
    for piece in [2 * GIB, 512 * MIB, 256 * MIB, 128 * MIB] {
        let n = total / piece;
        let (mut idle, mut busy) = (vec![], vec![]);
        for _ in 0..repeats {
            trainer_step(p.backend, margin)?;
            idle.push(vmm.cycle(n, piece)?.1);
            trainer_step(p.backend, margin)?;
            let (_, (made, times)) = meanwhile_n(launches, &mut || {
                let (h, times) = vmm.cycle(n, piece)?;
                Ok((Some(h), times))
            })?;
            drop(made);
            busy.push(times);
        }
        let what = format!("{} as {n} × {}", size_name(total), size_name(piece));
        summary(
            format!("create+map+access {what}, right after a trainer's free"),
            &idle,
            rows,
        );
        summary(
            format!(
                "create+map+access {what}, right after a trainer's free, while the copy kernel runs"
            ),
            &busy,
            rows,
        );
    }

    // (d) Giving back the KV cache's pattern (32 × 2 GiB, what a KV pause unmaps): the
    // releases on one thread against releases spread over several, alternated. Does the
    // driver release handles in parallel?
    let (kv_count, kv_size) = (32, 2 * GIB);
    let spreads = [1usize, 4, 8];
    log(&format!(
        "then (d), giving back {kv_count} × {} GiB: cuMemRelease on {spreads:?} threads",
        kv_size / GIB
    ));
    let mut given = vec![(vec![], vec![]); spreads.len()];
    for _ in 0..repeats * 3 {
        for (k, &threads) in spreads.iter().enumerate() {
            let (h, _) = vmm.cycle(kv_count, kv_size)?;
            let (unmap, release) = vmm.give_back(h, threads)?;
            given[k].0.push(unmap);
            given[k].1.push(release);
        }
    }
    let base = Spread::of(&given[0].1);
    for (k, &threads) in spreads.iter().enumerate() {
        let (unmap, release) = (Spread::of(&given[k].0), Spread::of(&given[k].1));
        log(&format!(
            "give back {kv_count} × {} GiB, releases on {}: unmap {:.1} ms, release {:.1} ms \
             (medians)",
            kv_size / GIB,
            on_threads(threads),
            ms(unmap.median),
            ms(release.median)
        ));
        rows.push(Row {
            name: format!(
                "cuMemRelease of {kv_count} × {} GiB (unmapped just before) on {}",
                kv_size / GIB,
                on_threads(threads)
            ),
            figure: release,
            limit: base,
            limit_name: "the same on 1 thread".into(),
            target: None,
            over: None,
        });
    }

    // (e) The KV cache's 32 × 2 GiB laid out as the pager's growing region lays out torch's
    // segments (one reserved range, one access change over it) and as torch_memory_saver
    // does (a reserved range and an access change per tensor), alternated, each held
    // 0.5 s as in the side-by-side KV cycles: does the layout change what the driver's
    // calls cost?
    log(&format!(
        "then (e), {kv_count} × {} GiB in one reserved range against a range per handle, \
         alternated, 0.5 s apart",
        kv_size / GIB
    ));
    let hold = Duration::from_millis(500);
    let (mut one, mut each) = ((vec![], vec![]), (vec![], vec![]));
    for _ in 0..repeats * 4 {
        std::thread::sleep(hold);
        let t = Instant::now();
        let (h, _) = vmm.cycle(kv_count, kv_size)?;
        one.0.push(t.elapsed());
        std::thread::sleep(hold);
        let t = Instant::now();
        drop(h);
        one.1.push(t.elapsed());
        std::thread::sleep(hold);
        let t = Instant::now();
        let hs = (0..kv_count)
            .map(|_| vmm.cycle(1, kv_size).map(|(h, _)| h))
            .collect::<Result<Vec<_>>>()?;
        each.0.push(t.elapsed());
        std::thread::sleep(hold);
        let t = Instant::now();
        drop(hs);
        each.1.push(t.elapsed());
    }
    let (one_map, one_unmap) = (Spread::of(&one.0), Spread::of(&one.1));
    for (what, samples, limit) in [
        ("map (create+map+access)", &each.0, one_map),
        ("unmap+release", &each.1, one_unmap),
    ] {
        rows.push(Row {
            name: format!(
                "{what} {kv_count} × {} GiB, a reserved range and an access change per handle",
                kv_size / GIB
            ),
            figure: Spread::of(samples),
            limit,
            limit_name: "the same in one reserved range, one access change".into(),
            target: None,
            over: None,
        });
    }
    Ok(())
}

/// "1 thread", "4 threads".
fn on_threads(n: usize) -> String {
    if n == 1 {
        "1 thread".to_owned()
    } else {
        format!("{n} threads")
    }
}
