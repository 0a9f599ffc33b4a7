//! The release/resume benchmark: every figure next to the physical limit measured in the
//! same run, on the same device, in the same memory state.
//!
//! Used by `gpu-pager bench` (the table in BENCHMARKS.md) and by the criterion bench
//! `resume_latency`. The workload is DESIGN.md's: 16 GiB of weights in 291 buffers
//! (`Preserve`) and 64 GiB of KV cache (`Discard`), scaled down when the device has less
//! free memory.
//!
//! Limits: the pinned host↔device bandwidth (one large copy each way, best of three, through
//! the backend's own copy path) for the copies, and the bare VMM calls — `cuMemCreate` +
//! `cuMemMap` + one `cuMemSetAccess` over the range, and `cuMemUnmap` + `cuMemRelease` — on a
//! separate reservation of the KV cache's size, alternated with the pager's own moves so both
//! see the same driver state.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pager::backend::{Backend, BackendError, Direction, Mapping, Reservation};
use gpu_pager::report::{gbps, ms};
use gpu_pager::{Buffer, Error, Pager, PagerConfig, Policy, RegionOptions, Result};
use gpu_pager_testkit::Hog;

mod marked;

const GIB: usize = 1 << 30;
const MIB: usize = 1 << 20;

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchConfig {
    /// Bytes of weights (Preserve).
    pub weights_bytes: usize,
    /// Number of weight buffers.
    pub weight_buffers: usize,
    /// Bytes of KV cache (Discard).
    pub kv_bytes: usize,
    /// Physical chunk size.
    pub chunk_bytes: usize,
    /// Repetitions of each timed move (the median is reported, with min and max).
    pub repeats: usize,
    /// Also time a first release without prepin (pins on the critical path).
    pub cold_release: bool,
    /// Also cycle the weights in a growing region (created with 0 bytes, one mapping per
    /// buffer) next to the fixed one.
    pub growing: bool,
    /// Buffer sizes whose allocation latency in a growing region is timed against a bare
    /// `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` of the same size (empty: none).
    pub alloc_sizes: Vec<usize>,
    /// Also time the weights' resume right after a trainer-like allocation of all but a
    /// small margin of the free memory was written and freed.
    pub after_free: bool,
    /// Also time update-aware release: the weights marked overwritten (all, half), and the
    /// RL wake-up with them (see `bench/marked.rs`).
    pub marked: bool,
}

impl BenchConfig {
    /// DESIGN.md's workload: 16 GiB of weights in 291 buffers, 64 GiB of KV cache.
    pub fn design() -> Self {
        BenchConfig {
            weights_bytes: 16 * GIB,
            weight_buffers: 291,
            kv_bytes: 64 * GIB,
            chunk_bytes: gpu_pager::DEFAULT_CHUNK_BYTES,
            repeats: 5,
            cold_release: true,
            growing: true,
            alloc_sizes: vec![2 * MIB, 20 * MIB, 128 * MIB, GIB],
            after_free: true,
            marked: true,
        }
    }

    /// A small workload for the host backend.
    pub fn small() -> Self {
        BenchConfig {
            weights_bytes: 256 * MIB,
            weight_buffers: 291,
            kv_bytes: GIB,
            chunk_bytes: 64 * MIB,
            repeats: 3,
            cold_release: false,
            growing: true,
            alloc_sizes: vec![2 * MIB, 20 * MIB],
            after_free: true,
            marked: true,
        }
    }

    /// Peak device bytes the run needs: weights (twice with `cold_release`), the KV cache,
    /// the bare VMM range of the same size while the KV cache is released, a link buffer.
    pub fn peak_bytes(&self) -> usize {
        let cold = if self.cold_release {
            self.weights_bytes
        } else {
            0
        };
        self.weights_bytes + cold + self.kv_bytes + self.link_bytes()
    }

    pub(crate) fn link_bytes(&self) -> usize {
        self.weights_bytes.min(4 * GIB)
    }

    /// Halves the workload until it fits in `free` bytes with 4 GiB to spare.
    pub fn fit(mut self, free: usize) -> Self {
        while self.peak_bytes() + 4 * GIB > free && self.kv_bytes > 64 * MIB {
            self.weights_bytes /= 2;
            self.kv_bytes /= 2;
        }
        self
    }
}

/// Median, min and max of repeated timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spread {
    /// Median.
    pub median: Duration,
    /// Fastest.
    pub min: Duration,
    /// Slowest.
    pub max: Duration,
}

impl Spread {
    /// The spread of `samples` (at least one).
    pub fn of(samples: &[Duration]) -> Spread {
        let mut s = samples.to_vec();
        s.sort();
        Spread {
            median: s.get(s.len() / 2).copied().unwrap_or_default(),
            min: s.first().copied().unwrap_or_default(),
            max: s.last().copied().unwrap_or_default(),
        }
    }
}

/// One line of the table: a figure, the limit it is compared with, and the target ratio.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// What was timed.
    pub name: String,
    /// The pager's time.
    pub figure: Spread,
    /// The limit's time for the same work.
    pub limit: Spread,
    /// How the limit was obtained.
    pub limit_name: String,
    /// The target for figure / limit (`None`: for information).
    pub target: Option<f64>,
    /// What the limit is made of when it is bytes over the link: [`run`] computes it again
    /// at the end against the best link measure of the run. `None`: the limit is fixed
    /// (bare VMM calls timed next to the pager, a target in milliseconds).
    pub over: Option<OverLink>,
}

impl Row {
    /// A row whose limit is `over` against `link` (the link measure so far).
    pub fn over_link(
        name: impl Into<String>,
        samples: &[Duration],
        over: OverLink,
        link: &Link,
        limit_name: impl Into<String>,
        target: Option<f64>,
    ) -> Row {
        Row {
            name: name.into(),
            figure: Spread::of(samples),
            limit: Spread::of(&[over.time(link)]),
            limit_name: limit_name.into(),
            target,
            over: Some(over),
        }
    }

    /// Median figure over median limit.
    pub fn ratio(&self) -> f64 {
        let l = self.limit.median.as_secs_f64();
        if l > 0.0 {
            self.figure.median.as_secs_f64() / l
        } else {
            f64::INFINITY
        }
    }

    /// Whether the target is met (true when there is none).
    pub fn met(&self) -> bool {
        self.target.is_none_or(|t| self.ratio() <= t)
    }
}

/// The measured limits of the link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Pinned host→device, GB/s (10^9 bytes).
    pub h2d_gbps: f64,
    /// Pinned device→host, GB/s.
    pub d2h_gbps: f64,
    /// Pinned host→device into physical memory mapped just before, GB/s (one copy).
    pub h2d_fresh_gbps: f64,
}

impl Link {
    /// The faster of two measures, each direction on its own: the link can do at least
    /// that, and a low measure would flatter every ratio against it.
    pub fn best(&self, other: &Link) -> Link {
        Link {
            h2d_gbps: self.h2d_gbps.max(other.h2d_gbps),
            d2h_gbps: self.d2h_gbps.max(other.d2h_gbps),
            h2d_fresh_gbps: self.h2d_fresh_gbps.max(other.h2d_fresh_gbps),
        }
    }
}

/// A limit made of bytes over the link, each direction, plus a fixed part (a target's
/// allowance).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OverLink {
    /// Bytes host→device.
    pub h2d_bytes: usize,
    /// Bytes device→host.
    pub d2h_bytes: usize,
    /// Time added to the link's.
    pub fixed: Duration,
}

impl OverLink {
    /// `bytes` host→device.
    pub fn h2d(bytes: usize) -> OverLink {
        OverLink {
            h2d_bytes: bytes,
            ..OverLink::default()
        }
    }

    /// `bytes` device→host.
    pub fn d2h(bytes: usize) -> OverLink {
        OverLink {
            d2h_bytes: bytes,
            ..OverLink::default()
        }
    }

    /// The same with `fixed` more time allowed.
    pub fn plus(self, fixed: Duration) -> OverLink {
        OverLink {
            fixed: self.fixed + fixed,
            ..self
        }
    }

    /// The limit's time on `link`. A link measured at 0 (never on a working machine) adds
    /// nothing, so that the rows over it read as missed rather than met.
    pub fn time(&self, link: &Link) -> Duration {
        let secs = |bytes: usize, gbps: f64| {
            if bytes == 0 {
                0.0
            } else {
                bytes as f64 / (gbps * 1e9)
            }
        };
        let over = secs(self.h2d_bytes, link.h2d_gbps) + secs(self.d2h_bytes, link.d2h_gbps);
        self.fixed
            .saturating_add(Duration::try_from_secs_f64(over).unwrap_or(Duration::ZERO))
    }
}

/// "H2D" or "D2H", and `bytes` over the link in `direction`.
pub(crate) fn over_link(direction: Direction, bytes: usize) -> (&'static str, OverLink) {
    match direction {
        Direction::ToDevice => ("H2D", OverLink::h2d(bytes)),
        Direction::ToHost => ("D2H", OverLink::d2h(bytes)),
    }
}

/// The result of [`run`].
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// Device name and backend.
    pub device: String,
    /// Whether it ran on a GPU. The targets are GPU targets: on the host backend the table
    /// shows the figures without judging them.
    pub on_gpu: bool,
    /// What was measured.
    pub config: BenchConfig,
    /// The link limits the rows are judged against: the best of the measure at the start
    /// of the run and the one at its end, each direction on its own.
    pub link: Link,
    /// The link measured at the start of the run.
    pub link_start: Link,
    /// The link measured again at the end of the run.
    pub link_end: Link,
    /// The rows.
    pub rows: Vec<Row>,
}

fn ms_spread(s: &Spread) -> String {
    if s.min == s.max {
        format!("{:.2}", ms(s.median))
    } else {
        format!("{:.2} ({:.2}–{:.2})", ms(s.median), ms(s.min), ms(s.max))
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "{}: weights {:.2} GiB in {} buffers, KV {:.2} GiB, chunks {} MiB, {} repeats",
            self.device,
            c.weights_bytes as f64 / GIB as f64,
            c.weight_buffers,
            c.kv_bytes as f64 / GIB as f64,
            c.chunk_bytes / MIB,
            c.repeats
        )?;
        let (a, z) = (&self.link_start, &self.link_end);
        writeln!(
            f,
            "link (pinned, best of the start and the end of this run): host→device {:.1} GB/s \
             ({:.1} at the start, {:.1} at the end), device→host {:.1} GB/s ({:.1}, {:.1}); \
             host→device into memory mapped just before: {:.1} GB/s",
            self.link.h2d_gbps,
            a.h2d_gbps,
            z.h2d_gbps,
            self.link.d2h_gbps,
            a.d2h_gbps,
            z.d2h_gbps,
            self.link.h2d_fresh_gbps
        )?;
        writeln!(
            f,
            "| operation | pager ms (median, min–max) | limit ms | limit | ratio | target |"
        )?;
        writeln!(f, "|---|---|---|---|---|---|")?;
        for r in &self.rows {
            let target = match r.target {
                Some(t) if self.on_gpu => {
                    format!("≤ {t:.2} {}", if r.met() { "met" } else { "MISSED" })
                }
                Some(t) => format!("≤ {t:.2} on a GPU (not judged here)"),
                None => "—".to_owned(),
            };
            writeln!(
                f,
                "| {} | {} | {} | {} | {:.3} | {} |",
                r.name,
                ms_spread(&r.figure),
                ms_spread(&r.limit),
                r.limit_name,
                r.ratio(),
                target
            )?;
        }
        Ok(())
    }
}

fn backend_err<'a>(tag: &'a str, op: &'static str) -> impl Fn(BackendError) -> Error + 'a {
    move |e| Error::backend(tag, op, e)
}

/// Pinned host↔device bandwidth through the backend's copy path, best of three copies of
/// `bytes` each way, plus one copy into freshly mapped memory. Uses a temporary `Discard`
/// region tagged `bench_link` (removed again) and a pinned buffer of `bytes`.
pub fn measure_link(pager: &Pager, bytes: usize) -> Result<Link> {
    let b = pager.backend();
    pager.region("bench_link", bytes, Policy::Discard)?;
    let buf = pager.alloc("bench_link", bytes)?;
    let dst = pager.ptr(&buf)?;
    let mut host = b
        .alloc_pinned(bytes)
        .map_err(backend_err("bench_link", "pinning"))?;
    let (mut h2d, mut d2h) = (0f64, 0f64);
    for _ in 0..3 {
        let t = Instant::now();
        // SAFETY: `dst..dst+bytes` is a live buffer of the resident bench_link region.
        unsafe { b.copy_to_device(dst, host.as_slice()) }
            .map_err(backend_err("bench_link", "copy"))?;
        h2d = h2d.max(gbps(bytes, t.elapsed()));
        let t = Instant::now();
        // SAFETY: as above.
        unsafe { b.copy_to_host(host.as_mut_slice(), dst) }
            .map_err(backend_err("bench_link", "copy"))?;
        d2h = d2h.max(gbps(bytes, t.elapsed()));
    }
    // The same copy into physical memory mapped a moment ago (as a resume does).
    pager.release(&["bench_link"])?;
    pager.resume(&["bench_link"])?;
    let t = Instant::now();
    // SAFETY: as above; the region was resumed at the same address.
    unsafe { b.copy_to_device(dst, host.as_slice()) }.map_err(backend_err("bench_link", "copy"))?;
    let fresh = gbps(bytes, t.elapsed());
    drop(host);
    pager.remove("bench_link")?;
    Ok(Link {
        h2d_gbps: h2d,
        d2h_gbps: d2h,
        h2d_fresh_gbps: fresh,
    })
}

/// The bare VMM loop on its own reservation.
struct Bare {
    mapped: Vec<Box<dyn Mapping>>,
    range: Arc<dyn Reservation>,
    /// Out-of-memory retries so far (memory freed a moment ago not yet available).
    retries: usize,
}

impl Bare {
    fn new(b: &dyn Backend, bytes: usize) -> Result<Bare> {
        Ok(Bare {
            retries: 0,
            mapped: Vec::new(),
            range: b
                .reserve(bytes)
                .map_err(backend_err("bench_bare", "reserving"))?,
        })
    }

    /// (map time, unmap time) for the whole range in chunks of `chunk`. Memory the pager
    /// unmapped a moment ago is not always available again at once: an out-of-memory
    /// failure is retried for up to 5 s (the retries are not timed, and are counted).
    fn cycle(&mut self, b: &dyn Backend, chunk: usize) -> Result<(Duration, Duration)> {
        let sizes = chunk_sizes(self.range.len(), chunk);
        let started = Instant::now();
        let (map, mapped) = loop {
            let t = Instant::now();
            // SAFETY: the range is this backend's reservation, unmapped (mapped is empty
            // between cycles).
            match unsafe { b.map(&self.range, 0, &sizes) } {
                Ok(m) => break (t.elapsed(), m),
                Err(BackendError::OutOfMemory { .. }) if started.elapsed().as_secs() < 5 => {
                    self.retries += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    let free = b.mem_info().map_or(0, |m| m.free);
                    let e = Error::backend("bench_bare", "mapping", e);
                    return Err(Error::InvalidArgument {
                        tag: Some("bench_bare".into()),
                        reason: format!("{e} (device free now: {free} bytes)"),
                    });
                }
            }
        };
        self.mapped = mapped;
        let t = Instant::now();
        self.mapped.clear();
        Ok((map, t.elapsed()))
    }
}

/// Weight buffers in `tag`: sizes vary ±5% around an equal share, as a model's tensors do.
fn weight_buffers(pager: &Pager, tag: &str, cfg: &BenchConfig) -> Result<Vec<Buffer>> {
    weight_sizes(cfg.weights_bytes, cfg.weight_buffers)
        .into_iter()
        .map(|len| pager.alloc(tag, len))
        .collect()
}

/// The sizes of [`weight_buffers`]: `buffers` odd sizes a little under `bytes / buffers`.
fn weight_sizes(bytes: usize, buffers: usize) -> Vec<usize> {
    let unit = bytes / buffers.max(1);
    (0..buffers)
        .map(|i| {
            unit.saturating_sub(4096 + (i * 7919) % (unit / 20).max(1))
                .max(16)
        })
        .collect()
}

/// What a trainer does between release and resume: allocates all but `margin` bytes of
/// the free device memory with a plain allocation, writes all of it, and frees it.
fn trainer_step(backend: &dyn Backend, margin: usize) -> Result<usize> {
    let free = backend
        .mem_info()
        .map_err(backend_err("bench_trainer", "querying memory"))?
        .free;
    let g = backend.info().granularity;
    let bytes = free.saturating_sub(margin) / g * g;
    if bytes == 0 {
        return Ok(0);
    }
    let held = Hog::take(backend, bytes).map_err(backend_err("bench_trainer", "allocating"))?;
    if let Some(p) = held.ptr() {
        // SAFETY: `p .. p + bytes` is the plain device allocation `held` owns.
        unsafe { backend.fill(p, bytes, 0x7A7A_7A7A) }
            .map_err(backend_err("bench_trainer", "writing"))?;
    }
    drop(held);
    Ok(bytes)
}

/// Human size for row names: "2 MiB", "1 GiB".
fn size_name(bytes: usize) -> String {
    if bytes >= GIB && bytes.is_multiple_of(GIB) {
        format!("{} GiB", bytes / GIB)
    } else {
        format!("{} MiB", bytes / MIB)
    }
}

fn write_weights(pager: &Pager, bufs: &[Buffer], generation: u32) -> Result<()> {
    for (i, b) in bufs.iter().enumerate() {
        pager.fill(
            b,
            (i as u32).wrapping_mul(0x9E37_79B9) ^ generation.wrapping_mul(0x85EB_CA6B),
        )?;
    }
    Ok(())
}

/// [`write_weights`], timed (each fill waits for its kernel, `Backend::fill`).
fn timed_writes(pager: &Pager, bufs: &[Buffer], generation: u32) -> Result<Duration> {
    let t = Instant::now();
    write_weights(pager, bufs, generation)?;
    Ok(t.elapsed())
}

/// Runs the benchmark. `log` gets a line per phase.
pub fn run(
    backend: Arc<dyn Backend>,
    cfg: &BenchConfig,
    log: &mut dyn FnMut(&str),
) -> Result<Table> {
    let device = format!("{} ({})", backend.info().name, backend.info().kind);
    let pager = Pager::with_config(
        backend.clone(),
        PagerConfig {
            chunk_bytes: cfg.chunk_bytes,
            ..PagerConfig::default()
        },
    );
    let repeats = cfg.repeats.max(1);
    let mut rows = Vec::new();
    let mem = backend.clone();
    let mut log = |line: &str| {
        let free = mem.mem_info().map_or(0, |m| m.free);
        log(&format!(
            "{line} (device free {:.1} GiB)",
            free as f64 / GIB as f64
        ));
    };
    let log: &mut dyn FnMut(&str) = &mut log;

    log("measuring the link (pinned copies, best of 3)");
    let link = measure_link(&pager, cfg.link_bytes())?;

    log("weights: creating the region with its backup pinned ahead (prepin)");
    pager.region_with(
        "weights",
        cfg.weights_bytes,
        Policy::Preserve,
        RegionOptions {
            prepin: true,
            ..Default::default()
        },
    )?;
    let bufs = weight_buffers(&pager, "weights", cfg)?;
    write_weights(&pager, &bufs, 0)?;
    let first = pager.release(&["weights"])?;
    let first_row = (first.total, first.copied());

    let (mut resume, mut changed, mut unchanged) = (vec![], vec![], vec![]);
    let mut resume_idle = vec![];
    let mut changed_bytes = 0;
    let (mut writes, mut changed_steps) = (vec![], vec![]);
    let idle = Duration::from_secs(1);
    for rep in 0..repeats {
        log(&format!("weights: cycle {} of {repeats}", rep + 1));
        // Right after a release (the driver may still be reclaiming the freed memory) ...
        resume.push(pager.resume(&["weights"])?.total);
        unchanged.push(pager.release(&["weights"])?.total);
        // ... and after an idle second, as when a trainer ran in between.
        std::thread::sleep(idle);
        resume_idle.push(pager.resume(&["weights"])?.total);
        writes.push(timed_writes(&pager, &bufs, rep as u32 + 1)?);
        let r = pager.release(&["weights"])?;
        changed.push(r.total);
        changed_steps.push((r.sync, marked::steps(&r)));
        changed_bytes = r.copied();
    }
    log(&format!(
        "weights: writes {:.1} ms, then the release of the changed weights: {} (medians)",
        ms(Spread::of(&writes).median),
        marked::breakdown(&changed_steps)
    ));
    let restored = pager
        .stats()
        .region("weights")
        .map_or(0, |s| s.last_resume.as_ref().map_or(0, |r| r.copied));
    // A copy-bound row: `samples` against `bytes` over the link in `direction`.
    let copy_row = |name: &str, samples: &[Duration], bytes: usize, direction, target| {
        let (dir, over) = over_link(direction, bytes);
        let what = format!("{:.2} GiB / {dir}", bytes as f64 / GIB as f64);
        Row::over_link(name, samples, over, &link, what, target)
    };
    rows.push(copy_row(
        "first release, backup pinned ahead (prepin)",
        &[first_row.0],
        first_row.1,
        Direction::ToHost,
        Some(1.1),
    ));
    rows.push(copy_row(
        "resume weights, immediately after the release",
        &resume,
        restored,
        Direction::ToDevice,
        Some(1.05),
    ));
    rows.push(copy_row(
        "resume weights, 1 s after the release",
        &resume_idle,
        restored,
        Direction::ToDevice,
        Some(1.05),
    ));
    rows.push(copy_row(
        "release weights, contents changed",
        &changed,
        changed_bytes,
        Direction::ToHost,
        Some(1.05),
    ));
    let budget = Duration::from_millis(20).mul_f64(cfg.weights_bytes as f64 / (16 * GIB) as f64);
    rows.push(Row {
        name: "release weights, unchanged since last backup".into(),
        figure: Spread::of(&unchanged),
        limit: Spread::of(&[budget]),
        limit_name: "20 ms per 16 GiB (target)".into(),
        target: Some(1.0),
        over: None,
    });
    pager.resume(&["weights"])?;

    if cfg.cold_release {
        first_release_rows(&pager, cfg, &link, repeats, log, &mut rows)?;
    }

    log("kv_cache: release/resume alternated with the bare VMM loop");
    pager.region("kv_cache", cfg.kv_bytes, Policy::Discard)?;
    let kv_info = pager.info("kv_cache")?;
    let (kv_size, kv_chunk) = (kv_info.size, kv_info.chunk_bytes);
    let mut bare = Bare::new(backend.as_ref(), kv_size)?;
    let (mut rel, mut res, mut bmap, mut bunmap) = (vec![], vec![], vec![], vec![]);
    for _ in 0..repeats * 3 {
        rel.push(pager.release(&["kv_cache"])?.total);
        let (m, u) = bare.cycle(backend.as_ref(), kv_chunk)?;
        bmap.push(m);
        bunmap.push(u);
        res.push(pager.resume(&["kv_cache"])?.total);
    }
    // The KV cache stays released from here on, so that the rows below fit.
    pager.release(&["kv_cache"])?;
    if bare.retries > 0 {
        log(&format!(
            "kv_cache: the bare loop waited {} times for memory unmapped just before",
            bare.retries
        ));
    }
    let chunks = kv_size.div_ceil(kv_chunk);
    rows.push(Row {
        name: format!("release KV {}", size_name(kv_size)),
        figure: Spread::of(&rel),
        limit: Spread::of(&bunmap),
        limit_name: format!("bare unmap+release, {chunks} chunks"),
        target: Some(1.1),
        over: None,
    });
    rows.push(Row {
        name: format!("resume KV {}", size_name(kv_size)),
        figure: Spread::of(&res),
        limit: Spread::of(&bmap),
        limit_name: format!("bare create+map+set-access, {chunks} chunks"),
        target: Some(1.1),
        over: None,
    });

    // The rows added for growing regions and the after-free sequence run last, so that
    // the trainer-like allocations cannot disturb the rows above (the KV cache stays
    // released).
    if cfg.growing {
        log("weights in a growing region: the same buffers, one mapping each, cycles 1 s apart");
        let growing = RegionOptions {
            prepin: true,
            ..RegionOptions::GROWING
        };
        pager.region_with("weights_grow", 0, Policy::Preserve, growing)?;
        let gbufs = weight_buffers(&pager, "weights_grow", cfg)?;
        write_weights(&pager, &gbufs, 0)?;
        pager.release(&["weights_grow"])?;
        let (mut res, mut rel) = (vec![], vec![]);
        let (mut restored, mut changed) = (0, 0);
        for rep in 0..repeats {
            std::thread::sleep(idle);
            let r = pager.resume(&["weights_grow"])?;
            res.push(r.total);
            restored = r.copied();
            write_weights(&pager, &gbufs, rep as u32 + 1)?;
            let r = pager.release(&["weights_grow"])?;
            rel.push(r.total);
            changed = r.copied();
        }
        rows.push(copy_row(
            &format!(
                "growing region ({} buffers): resume weights, 1 s after",
                gbufs.len()
            ),
            &res,
            restored,
            Direction::ToDevice,
            Some(1.05),
        ));
        rows.push(copy_row(
            "growing region: release weights, contents changed",
            &rel,
            changed,
            Direction::ToHost,
            Some(1.05),
        ));
        pager.remove("weights_grow")?;
    }

    if !cfg.alloc_sizes.is_empty() {
        log("alloc latency in a growing region, alternated with bare VMM of the same size");
        pager.region_with(
            "alloc_lat",
            0,
            Policy::Discard,
            gpu_pager::RegionOptions::GROWING,
        )?;
        for &size in &cfg.alloc_sizes {
            let mut bare = Bare::new(backend.as_ref(), size)?;
            let (mut alloc, mut free, mut bmap, mut bunmap) = (vec![], vec![], vec![], vec![]);
            for _ in 0..repeats * 4 {
                let t = Instant::now();
                let b = pager.alloc("alloc_lat", size)?;
                alloc.push(t.elapsed());
                let t = Instant::now();
                pager.free(&b)?;
                free.push(t.elapsed());
                let (m, u) = bare.cycle(backend.as_ref(), size)?;
                bmap.push(m);
                bunmap.push(u);
            }
            rows.push(Row {
                name: format!("alloc {} (growing region, maps it)", size_name(size)),
                figure: Spread::of(&alloc),
                limit: Spread::of(&bmap),
                limit_name: "bare create+map+set-access".into(),
                target: Some(1.25),
                over: None,
            });
            rows.push(Row {
                name: format!("free {} (waits for the device, unmaps)", size_name(size)),
                figure: Spread::of(&free),
                limit: Spread::of(&bunmap),
                limit_name: "bare unmap+release".into(),
                target: None,
                over: None,
            });
        }
        pager.remove("alloc_lat")?;
    }

    if cfg.after_free {
        after_free_rows(&pager, &link, repeats, log, &mut rows)?;
    }
    if cfg.marked {
        marked::rows(&pager, cfg, &link, &bufs, repeats, log, &mut rows)?;
    }

    log("measuring the link again (the rows over the link are judged against the best measure)");
    let link_end = measure_link(&pager, cfg.link_bytes())?;
    let best = link.best(&link_end);
    rejudge(&mut rows, &best);
    Ok(Table {
        device,
        on_gpu: backend.info().kind == gpu_pager::backend::BackendKind::Cuda,
        config: cfg.clone(),
        link: best,
        link_start: link,
        link_end,
        rows,
    })
}

/// Recomputes the limit of every row made of bytes over the link against `link`.
fn rejudge(rows: &mut [Row], link: &Link) {
    for r in rows {
        if let Some(over) = r.over {
            r.limit = Spread::of(&[over.time(link)]);
        }
    }
}

/// A first release without `prepin` of the weights' size, in a fixed region (one buffer) and
/// in a growing one (`cfg.weight_buffers` buffers): the backup pinned and filled in one pass
/// ([`gpu_pager::Tuning::first_save_overlap`]), the save after it copying nothing. The
/// total against 1 s per 16 GiB, and the pinning with the copy in it against the link. Each
/// sample is a first release (the backup is freed between samples). Leaves no region.
fn first_release_rows(
    pager: &Pager,
    cfg: &BenchConfig,
    link: &Link,
    repeats: usize,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let budget = Duration::from_secs(1).mul_f64(cfg.weights_bytes as f64 / (16 * GIB) as f64);
    for growing in [false, true] {
        let (tag, what) = if growing {
            let what = format!("growing region ({} buffers)", cfg.weight_buffers);
            ("weights_cold_grow", what)
        } else {
            ("weights_cold", "fixed region".to_owned())
        };
        log(&format!(
            "first release without prepin, {what}: pinning on the critical path"
        ));
        let bufs = if growing {
            pager.region_with(tag, 0, Policy::Preserve, gpu_pager::RegionOptions::GROWING)?;
            weight_buffers(pager, tag, cfg)?
        } else {
            pager.region(tag, cfg.weights_bytes, Policy::Preserve)?;
            vec![pager.alloc(tag, cfg.weights_bytes)?]
        };
        let (mut total, mut pin) = (vec![], vec![]);
        let mut copied = 0;
        for rep in 0..repeats.clamp(1, 3) {
            if rep > 0 {
                pager.resume(&[tag])?;
                pager.free_backup(tag)?;
            }
            for b in &bufs {
                pager.fill(b, 0x5A5A_5A5A ^ rep as u32)?;
            }
            let r = pager.release(&[tag])?;
            total.push(r.total);
            pin.push(r.region(tag).map(|x| x.steps.pin).unwrap_or_default());
            copied = r.copied();
        }
        rows.push(Row {
            name: format!("first release, no prepin, {what}: pin + copy"),
            figure: Spread::of(&total),
            limit: Spread::of(&[budget]),
            limit_name: format!(
                "1 s per 16 GiB (target; {:.2} GiB)",
                copied as f64 / GIB as f64
            ),
            target: Some(1.0),
            over: None,
        });
        rows.push(Row::over_link(
            format!("  … of which pinning the backup with the copy in it ({what})"),
            &pin,
            OverLink::d2h(copied),
            link,
            format!("{:.2} GiB / D2H", copied as f64 / GIB as f64),
            None,
        ));
        pager.remove(tag)?;
    }
    Ok(())
}

/// The weights' resume right after a trainer-like allocation of all but 2 GiB of the free
/// memory was written and freed, when the driver still scrubs the freed memory and the copy
/// engine runs host→device below the link. Needs the weights resident with a current backup;
/// leaves them resident.
fn after_free_rows(
    pager: &Pager,
    link: &Link,
    repeats: usize,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let backend = pager.backend().clone();
    let margin = 2 * GIB;
    let (mut resume_after, mut after_steps) = (vec![], vec![]);
    let mut restored = 0;
    for rep in 0..repeats {
        log(&format!(
            "resume right after a trainer's allocate/write/free of all but {} GiB: {} of {repeats}",
            margin / GIB,
            rep + 1
        ));
        pager.release(&["weights"])?;
        trainer_step(backend.as_ref(), margin)?;
        let r = pager.resume(&["weights"])?;
        resume_after.push(r.total);
        after_steps.push((r.sync, marked::steps(&r)));
        restored = r.copied();
    }
    log(&format!(
        "resume of the weights right after a trainer's free: {} (medians)",
        marked::breakdown(&after_steps)
    ));
    rows.push(Row::over_link(
        "resume weights right after a trainer's allocate/write/free",
        &resume_after,
        OverLink::h2d(restored),
        link,
        format!("{:.2} GiB / H2D", restored as f64 / GIB as f64),
        Some(1.15),
    ));
    Ok(())
}

/// Splits `size` into chunks of `chunk` bytes, the last one shorter: how a region of
/// `size` bytes is mapped, timed here with bare VMM calls.
fn chunk_sizes(size: usize, chunk: usize) -> Vec<usize> {
    let mut out = vec![chunk; size / chunk];
    if !size.is_multiple_of(chunk) {
        out.push(size % chunk);
    }
    out
}
