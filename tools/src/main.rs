//! The `gpu-pager` program: `demo` runs the multi-stage wake-up with a timeline; `info`
//! describes the device; `bench` times release and resume; `stress` soaks the pager.
//! Without a GPU they run on the host backend and say so.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::backend::{Backend, BackendKind};
use gpu_pager::report::{gbps, ms};
use gpu_pager::{Buffer, Error, Pager, PagerConfig, Policy, Report};

mod kv_demo;

const GIB: usize = 1 << 30;

#[derive(Parser)]
#[command(
    version,
    about = "Tagged GPU memory regions, released and resumed stage by stage"
)]
struct Cli {
    /// Run on the host backend even when a GPU is present.
    #[arg(long, global = true)]
    host: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The multi-stage wake-up: release weights and KV cache, resume weights, update them,
    /// resume the KV cache; prints a timeline and verifies contents and addresses.
    Demo(DemoArgs),
    /// Describes the device and the backend in use.
    Info,
    /// Release/resume latency table: every figure next to its limit measured in the same
    /// run (pinned link bandwidth, bare VMM calls), on DESIGN.md's workload.
    Bench(BenchArgs),
    /// A randomized soak: threads releasing, resuming, allocating, writing and leasing
    /// shared tags, every buffer's contents checked, faults injected; exits non-zero on any
    /// corruption, leak, unrecovered fault or unexpected error.
    Stress(StressArgs),
}

#[derive(clap::Args)]
struct StressArgs {
    /// How long to run: e.g. 500ms, 30s, 10m, 1h (a bare number is seconds).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    duration: Duration,
    /// Seed of the random choices and of the fault plan, decimal or 0x-hex [default: from
    /// the clock, printed].
    #[arg(long, value_parser = parse_seed)]
    seed: Option<u64>,
    /// Worker threads (at least 1).
    #[arg(long, default_value_t = 4, value_parser = positive)]
    threads: usize,
    /// Do not inject faults (no failing copies or maps, no memory hog).
    #[arg(long)]
    no_faults: bool,
}

/// The shape of the weights shared by `demo` and `bench` (their sizes are each command's own,
/// so each `--help` shows its own defaults).
#[derive(clap::Args)]
struct Workload {
    /// Number of weight allocations (tensors).
    #[arg(long, default_value_t = 291)]
    buffers: usize,
    /// Physical chunk size in MiB (at least 1; rounded up to the granularity and to a power
    /// of two).
    #[arg(long, default_value_t = 512, value_parser = positive)]
    chunk_mib: usize,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// GiB of weights (Preserve) [default: 16 on a GPU, scaled down with the KV cache to fit
    /// when neither size is given; 0.25 on the host backend, where first-touch page faults
    /// dominate].
    #[arg(long)]
    weights_gib: Option<f64>,
    /// GiB of KV cache (Discard) [default: 64 on a GPU, scaled down with the weights; 1 on the
    /// host backend].
    #[arg(long)]
    kv_gib: Option<f64>,
    #[command(flatten)]
    load: Workload,
    /// Repetitions of each timed move.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Skip the first release without prepin (it pins the whole backup on the critical path).
    #[arg(long)]
    no_cold: bool,
    /// Skip these groups of rows (comma-separated): cold, growing, alloc, after-free,
    /// marked. The base rows (link, weights, KV) always run.
    #[arg(long, value_delimiter = ',', value_parser = ["cold", "growing", "alloc", "after-free", "marked"])]
    skip: Vec<String>,
}

#[derive(clap::Args)]
struct DemoArgs {
    /// GiB of weights (Preserve) [default: 4 on a GPU, 1 on the host backend].
    #[arg(long)]
    weights_gib: Option<f64>,
    /// GiB of KV cache (Discard) [default: 8 on a GPU, 2 on the host backend].
    #[arg(long)]
    kv_gib: Option<f64>,
    #[command(flatten)]
    load: Workload,
    /// Sleep/wake cycles.
    #[arg(long, default_value_t = 2)]
    cycles: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let backend = match pick_backend(cli.host) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("gpu-pager: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Demo(args) => demo(backend, &args),
        Command::Info => info(backend.as_ref()),
        Command::Bench(args) => bench(backend, &args),
        Command::Stress(args) => stress(backend, &args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-pager: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The backend by the crate's one fallback rule ([`gpu_pager::registry::open_backend`]), or host memory with
/// `--host`; a malformed capacity variable is an error either way.
fn pick_backend(force_host: bool) -> Result<Arc<dyn Backend>, Error> {
    if force_host {
        println!("backend: host memory (--host)");
        let config = HostConfig::from_env()
            .map_err(|e| Error::invalid(None, format!("{e}, or unset it")))?;
        return Ok(Arc::new(HostBackend::new(config)));
    }
    let (b, why) = gpu_pager::registry::open_backend(0)?;
    match why {
        Some(why) => println!("backend: host memory — no GPU ({why}); figures are not GPU figures"),
        None => println!("backend: {} ({})", b.info().name, b.info().kind),
    }
    Ok(b)
}

fn info(b: &dyn Backend) -> Result<(), Error> {
    let i = b.info();
    let m = b.mem_info().map_err(|e| Error::Backend {
        tags: Vec::new(),
        op: "querying memory",
        error: e,
    })?;
    println!("device:       {}", i.name);
    println!("backend:      {}", i.kind);
    if let Some((maj, min)) = i.compute_capability {
        println!("compute:      sm_{maj}{min}");
    }
    println!("granularity:  {} KiB", i.granularity >> 10);
    println!(
        "memory:       {:.1} GiB free of {:.1} GiB",
        gib(m.free),
        gib(m.total)
    );
    println!(
        "chunk size:   {} MiB (default)",
        gpu_pager::DEFAULT_CHUNK_BYTES >> 20
    );
    Ok(())
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / GIB as f64
}

/// Prints timeline lines relative to the demo's start.
struct Timeline(Instant);

impl Timeline {
    fn line(&self, what: &str, detail: impl std::fmt::Display) {
        println!("[{:>9.1} ms] {what:<22} {detail}", ms(self.0.elapsed()));
    }
}

/// Per-buffer fill pattern for a generation of the weights.
fn pattern(buffer: usize, generation: usize) -> u32 {
    (buffer as u32).wrapping_mul(0x9E37_79B9) ^ (generation as u32).wrapping_mul(0x85EB_CA6B) | 1
}

fn hash(pager: &Pager, b: &Buffer) -> Result<u64, Error> {
    let h = pager.hash(b, b.len().next_multiple_of(16).max(16))?;
    Ok(h.first().copied().unwrap_or(0))
}

fn demo(backend: Arc<dyn Backend>, a: &DemoArgs) -> Result<(), Error> {
    let bad = |reason: &str| Error::InvalidArgument {
        tag: None,
        reason: reason.into(),
    };
    let on_gpu = backend.info().kind == BackendKind::Cuda;
    let weights_gib = a.weights_gib.unwrap_or(if on_gpu { 4.0 } else { 1.0 });
    let kv_gib = a.kv_gib.unwrap_or(if on_gpu { 8.0 } else { 2.0 });
    if !(weights_gib > 0.0 && kv_gib > 0.0 && a.load.buffers > 0 && a.cycles > 0) {
        return Err(bad(
            "--weights-gib, --kv-gib, --buffers and --cycles must be positive",
        ));
    }
    let weights_bytes = (weights_gib * GIB as f64) as usize;
    let kv_bytes = (kv_gib * GIB as f64) as usize;
    let capacity = backend.info().total_bytes;
    if !on_gpu && weights_bytes.saturating_add(kv_bytes) > capacity {
        return Err(bad(&format!(
            "--weights-gib {weights_gib} plus --kv-gib {kv_gib} do not fit in the host backend, \
             which holds {:.1} GiB (half of this machine's memory, at most 32 GiB: the weights' \
             backup takes host memory too); pass smaller sizes (the defaults are 1 and 2 GiB), \
             set {}=<bytes> to change the capacity, or run on a GPU",
            gib(capacity),
            gpu_pager::backend::host::CAPACITY_ENV
        )));
    }
    let pager = Arc::new(Pager::with_config(
        backend.clone(),
        PagerConfig {
            chunk_bytes: a.load.chunk_mib << 20,
            ..PagerConfig::default()
        },
    ));
    let t = Timeline(Instant::now());
    let free = |p: &Pager| p.backend().mem_info().map(|m| m.free).unwrap_or(0);

    let w = pager.region("weights", weights_bytes, Policy::Preserve)?;
    let kv = pager.region("kv_cache", kv_bytes, Policy::Discard)?;
    t.line(
        "regions created",
        format!(
            "weights {:.2} GiB @ {:#x}, kv_cache {:.2} GiB @ {:#x}, chunks {} MiB",
            gib(w.size),
            w.base,
            gib(kv.size),
            kv.base,
            pager.config().chunk_bytes >> 20
        ),
    );

    // Weights in `buffers` allocations of varying size (like a model's tensors).
    let unit = weights_bytes / a.load.buffers;
    let mut bufs = Vec::with_capacity(a.load.buffers);
    for i in 0..a.load.buffers {
        // 90–100% of an equal share, so the weights fill the region.
        let len = (unit - (i * 7919) % (unit / 10).max(1)).max(16);
        bufs.push(pager.alloc("weights", len)?);
    }
    let ptrs: Vec<u64> = bufs
        .iter()
        .map(|b| pager.ptr(b))
        .collect::<Result<_, _>>()?;
    let mut want = Vec::with_capacity(bufs.len());
    for (i, b) in bufs.iter().enumerate() {
        pager.fill(b, pattern(i, 0))?;
        want.push(hash(&pager, b)?);
    }
    let weight_bytes: usize = bufs.iter().map(|b| b.len()).sum();
    let kv_buf = pager.alloc("kv_cache", kv.size)?;
    pager.fill(&kv_buf, 0x4B56_4B56)?;
    t.line(
        "weights written",
        format!(
            "{} buffers, {:.2} GiB; kv_cache filled",
            bufs.len(),
            gib(weight_bytes)
        ),
    );

    // 2 GiB reaches the link's plateau on a GPU; on the host backend it only measures memcpy.
    let probe = if on_gpu { 2 * GIB } else { 256 << 20 };
    let link = gpu_pager_tools::bench::measure_link(&pager, probe)?;
    let (h2d, d2h) = (link.h2d_gbps, link.d2h_gbps);
    t.line(
        "link probe (pinned)",
        format!("host→device {h2d:.1} GB/s, device→host {d2h:.1} GB/s"),
    );

    for cycle in 0..a.cycles {
        println!("--- cycle {} of {}", cycle + 1, a.cycles);
        let before = free(&pager);
        let rel = pager.release(&["kv_cache", "weights"])?;
        let after = free(&pager);
        line(&t, "release all", &rel, d2h);
        t.line(
            "  device memory",
            format!(
                "free {:.2} → {:.2} GiB (+{:.2})",
                gib(before),
                gib(after),
                gib(after.saturating_sub(before))
            ),
        );

        // The bug other tools crash on: touching weights before their stage ran.
        match pager.fill(&bufs[0], 0) {
            Err(e @ Error::NotResident { .. }) => {
                t.line("write before resume", format!("refused: {e}"))
            }
            other => {
                return Err(bad(&format!(
                    "a write to released weights was not refused: {other:?}"
                )));
            }
        }

        let r1 = pager.resume(&["weights"])?;
        line(&t, "resume weights", &r1, h2d);

        // update_weights: new values for every other tensor, in place.
        let upd = Instant::now();
        for (i, b) in bufs.iter().enumerate().filter(|(i, _)| i % 2 == cycle % 2) {
            pager.fill(b, pattern(i, cycle + 1))?;
            want[i] = hash(&pager, b)?;
        }
        t.line(
            "update weights",
            format!(
                "{} buffers rewritten in {:.1} ms",
                bufs.len().div_ceil(2),
                ms(upd.elapsed())
            ),
        );

        let r2 = pager.resume(&["kv_cache"])?;
        line(&t, "resume kv_cache", &r2, h2d);
        pager.fill(&kv_buf, cycle as u32)?;
    }

    // Verification: every buffer's hash, a full read-back of a few, every address.
    let mut bad_bufs = 0;
    for (i, b) in bufs.iter().enumerate() {
        if hash(&pager, b)? != want[i] || pager.ptr(b)? != ptrs[i] {
            bad_bufs += 1;
        }
    }
    let last_gen = |i: usize| {
        (0..a.cycles)
            .rev()
            .find(|c| i % 2 == c % 2)
            .map_or(0, |c| c + 1)
    };
    for i in [0, bufs.len() / 2, bufs.len() - 1] {
        let mut got = vec![0u8; bufs[i].len()];
        pager.read(&bufs[i], 0, &mut got)?;
        let mut exp = vec![0u8; got.len()];
        gpu_pager::kernels::reference::fill(&mut exp, pattern(i, last_gen(i)));
        if got != exp {
            bad_bufs += 1;
        }
    }
    let same_base =
        pager.info("weights")?.base == w.base && pager.info("kv_cache")?.base == kv.base;
    let mut ok = bad_bufs == 0 && same_base;
    t.line(
        "verify",
        format!(
            "{}: {} buffers {}, addresses {}{}",
            if ok { "OK" } else { "FAILED" },
            bufs.len(),
            if bad_bufs == 0 {
                "bit-exact".to_owned()
            } else {
                format!("with {bad_bufs} mismatches")
            },
            if same_base && bad_bufs == 0 {
                "unchanged"
            } else {
                "checked"
            },
            if on_gpu { "" } else { " (host backend)" }
        ),
    );
    // The paged KV cache, in the memory the plain kv_cache region leaves.
    pager.remove("kv_cache")?;
    ok &= kv_demo::run(&pager, &t, a.kv_gib.map_or(kv_gib / 4.0, |k| k / 4.0))?;
    if ok {
        Ok(())
    } else {
        Err(bad("verification failed"))
    }
}

fn line(t: &Timeline, what: &str, r: &Report, link: f64) {
    let copy: Duration = r.regions.iter().map(|x| x.steps.copy).sum();
    // A release that pins the backup copies while it pins (its `copy` step is then empty):
    // its rate is over the pinning.
    let pin: Duration = r.regions.iter().map(|x| x.steps.pin).sum();
    let (moved, how) = if copy.is_zero() {
        (pin, " while pinning")
    } else {
        (copy, "")
    };
    let floor = if link > 0.0 {
        r.copied() as f64 / link / 1e6
    } else {
        0.0
    };
    let copied = if r.copied() > 0 {
        format!(
            "; copied {:.2} GiB{how} at {:.1} GB/s ({:.2}× the link floor {:.1} ms)",
            gib(r.copied()),
            gbps(r.copied(), moved),
            if floor > 0.0 {
                ms(r.total) / floor
            } else {
                0.0
            },
            floor
        )
    } else {
        String::new()
    };
    t.line(
        what,
        format!(
            "{:.2} GiB in {:.1} ms (sync {:.1} ms){copied}",
            gib(r.bytes()),
            ms(r.total),
            ms(r.sync)
        ),
    );
    for reg in &r.regions {
        let s = reg.steps;
        println!(
            "               {:<12} map {:>7.1} ms  unmap {:>7.1} ms  pin {:>7.1} ms  hash {:>5.1} ms  copy {:>7.1} ms",
            reg.tag,
            ms(s.map),
            ms(s.unmap),
            ms(s.pin),
            ms(s.hash),
            ms(s.copy)
        );
    }
}

fn bench(backend: Arc<dyn Backend>, a: &BenchArgs) -> Result<(), Error> {
    use gpu_pager_tools::bench::{self, BenchConfig};
    let on_gpu = backend.info().kind == BackendKind::Cuda;
    let mut cfg = if on_gpu {
        BenchConfig::design()
    } else {
        BenchConfig::small()
    };
    if let Some(w) = a.weights_gib {
        cfg.weights_bytes = (w * GIB as f64) as usize;
    }
    if let Some(k) = a.kv_gib {
        cfg.kv_bytes = (k * GIB as f64) as usize;
    }
    cfg.weight_buffers = a.load.buffers;
    cfg.repeats = a.repeats;
    cfg.chunk_bytes = a.load.chunk_mib << 20;
    let skip = |group: &str| a.skip.iter().any(|s| s == group);
    cfg.cold_release &= !a.no_cold && !skip("cold");
    cfg.growing &= !skip("growing");
    if skip("alloc") {
        cfg.alloc_sizes.clear();
    }
    cfg.after_free &= !skip("after-free");
    cfg.marked &= !skip("marked");
    if on_gpu && a.weights_gib.is_none() && a.kv_gib.is_none() {
        let free = backend.mem_info().map(|m| m.free).unwrap_or(0);
        cfg = cfg.fit(free);
    }
    let start = Instant::now();
    let table = bench::run(backend, &cfg, &mut |line| {
        eprintln!("[{:>7.1} s] {line}", start.elapsed().as_secs_f64())
    })?;
    println!("{table}");
    Ok(())
}

/// Parses `500ms`, `30s`, `10m`, `1h` (or a bare number of seconds).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}`: expected a number with a unit, e.g. 30s or 10m"))?;
    let secs = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (use ms, s, m or h)")),
    };
    n.checked_mul(secs)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("`{s}` is too long"))
}

/// A count of at least 1.
fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("`{s}`: expected a whole number of at least 1")),
    }
}

/// A seed: decimal, or hexadecimal with `0x`.
fn parse_seed(s: &str) -> Result<u64, String> {
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|_| format!("`{s}`: expected a number, decimal or 0x-hex (e.g. 42 or 0x2a)"))
}

fn stress(backend: Arc<dyn Backend>, a: &StressArgs) -> Result<(), Error> {
    use gpu_pager_tools::stress::{self, StressConfig};
    use indicatif::{ProgressBar, ProgressStyle};

    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let cfg = StressConfig {
        duration: a.duration,
        seed,
        threads: a.threads,
        faults: !a.no_faults,
        ..StressConfig::for_kind(backend.info().kind)
    };
    println!(
        "stress: {:.0} s, {} threads, seed {seed} (replay with --seed {seed}), faults {}; \
         regions: weights {:.2} GiB, kv_cache {:.2} GiB, graph {:.2} GiB, aux {:.2} GiB",
        cfg.duration.as_secs_f64(),
        cfg.threads,
        if cfg.faults { "on" } else { "off" },
        gib(cfg.weights_bytes),
        gib(cfg.kv_cache_bytes),
        gib(cfg.graph_bytes),
        gib(cfg.aux_bytes),
    );
    let total = cfg.duration.as_secs().max(1);
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30.cyan/blue} {pos}/{len} s  {msg}",
    ) {
        bar.set_style(style);
    }
    // Without a terminal (a log, CI) the bar is hidden: a line every tenth of the run
    // (at least 10 s apart) says the same.
    let every = (total / 10).max(10);
    let next_line = std::cell::Cell::new(every);
    let summary = stress::run(backend, &cfg, &|p| {
        let msg = format!(
            "cycles {}  faults {}  corruptions {}  errors {}",
            p.cycles, p.faults, p.corruptions, p.errors
        );
        let secs = p.elapsed.as_secs();
        if bar.is_hidden() && secs >= next_line.get() && secs < total {
            eprintln!("[{secs:>5} s of {total}] {msg}");
            next_line.set(secs + every);
        }
        bar.set_position(secs.min(total));
        bar.set_message(msg);
    })?;
    bar.finish_and_clear();
    println!("{summary}");
    if summary.ok() {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            tag: None,
            reason: format!(
                "the stress failed: {} corruptions, {} leaked bytes, {} of {} faults recovered \
                 ({} absorbed by a failed resume), {} errors",
                summary.corruptions,
                summary.leaked_bytes,
                summary.faults_recovered,
                summary.faults_injected,
                summary.faults_absorbed,
                summary.errors.len()
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        for bad in ["", "m", "10x", "1.5s", "-3s", "99999999999999999999h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
