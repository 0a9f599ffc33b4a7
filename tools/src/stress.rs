//! A bounded soak of the pager: several threads doing random releases, resumes, allocations,
//! writes, KV-cache steps and leases on shared tags, with every buffer's contents checked,
//! injected faults, and a leak check at the end.
//!
//! The tags are `weights` (Preserve), `kv_cache` (Discard), `graph` (DiscardZeroed) and
//! `aux` (Preserve, pinned ahead). Each buffer belongs to the thread that allocated it,
//! which records what it wrote (a fill pattern or the seed of random host bytes, with the
//! reference chunk hashes from [`gpu_pager::kernels::reference`]) and checks it under a lease
//! after every resume it observes, plus read-backs now and then.
//!
//! With [`StressConfig::faults`], the backend is wrapped in a
//! [`FaultyBackend`] that fails maps, copies and pinning at random, and a thread now and
//! then takes nearly all free device memory (a [`gpu_pager_testkit::Hog`], standing in for a
//! trainer) so that a resume fails with `OutOfMemory`, then drops it and resumes again.
//! Each fault must be recovered: the retry after its cause is gone succeeds and loses
//! nothing.
//!
//! The threads also share one paged KV cache ([`gpu_pager::kv::KvCache`] on the elastic region
//! `kv_paged`): each writes its own sequences, forks them with copy-on-write, swaps them out
//! and in, frees them, trims, and now and then releases and resumes the cache under the
//! others. A sequence must read back exactly what was written until a release, and its ids
//! must go stale exactly when a release happened after it was created.
//!
//! Everything goes through the [`Backend`] trait, so the same run works on a GPU and on the
//! host backend.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use gpu_pager::backend::host::{HostBackend, HostConfig};
//! use gpu_pager_tools::stress::{self, StressConfig};
//!
//! let cfg = StressConfig { duration: Duration::from_secs(3), ..StressConfig::default() };
//! let summary = stress::run(Arc::new(HostBackend::new(HostConfig::default())), &cfg, &|_| {})?;
//! assert!(summary.ok(), "{summary}");
//! # Ok::<(), gpu_pager::Error>(())
//! ```

mod content;
mod shared;
mod worker;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pager::backend::{Backend, BackendKind};
use gpu_pager::kernels::MAX_HASH_CHUNKS;
use gpu_pager::kv::{KvCache, KvCacheConfig};
use gpu_pager::{Error, Pager, PagerConfig, Policy, RegionOptions, Result, State};
use gpu_pager_testkit::{FaultCounts, FaultPlan, FaultyBackend};
use shared::{Shared, TAGS};
use worker::{Owned, Worker};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// What a stress run does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StressConfig {
    /// How long the threads run (the final checks come after).
    pub duration: Duration,
    /// Seed of every random choice and of the fault plan. Thread scheduling is not
    /// deterministic, so a seed replays the choices, not the interleaving.
    pub seed: u64,
    /// Threads doing random operations.
    pub threads: usize,
    /// Size of `weights` (Preserve).
    pub weights_bytes: usize,
    /// Size of `kv_cache` (Discard).
    pub kv_cache_bytes: usize,
    /// Size of `graph` (DiscardZeroed).
    pub graph_bytes: usize,
    /// Size of `aux` (Preserve, backup pinned at creation).
    pub aux_bytes: usize,
    /// Largest buffer a thread allocates (also capped by region size).
    pub max_buffer_bytes: usize,
    /// Largest buffer written with random bytes from the host, and largest KV window.
    pub max_host_write_bytes: usize,
    /// Largest read-back, in bytes.
    pub readback_bytes: usize,
    /// The pager's physical chunk size.
    pub chunk_bytes: usize,
    /// The pager's hash-chunk size (for skipping unchanged chunks on release).
    pub hash_chunk_bytes: usize,
    /// Hash-chunk size of the stress's own checks (a multiple of 16).
    pub verify_chunk_bytes: usize,
    /// The pager's `skip_unchanged` (copy only changed hash chunks on release).
    pub skip_unchanged: bool,
    /// The pager's `verify_restore`. (Its `overlap_restore` is switched at random.)
    pub verify_restore: bool,
    /// Inject faults: failing maps, copies and pinning, and out-of-memory through a hog.
    pub faults: bool,
    /// Probability that a copy fails, per mille.
    pub copy_fault_per_mille: u32,
    /// Probability that a map fails, per mille.
    pub map_fault_per_mille: u32,
    /// Probability that pinning a backup fails, per mille.
    pub pin_fault_per_mille: u32,
    /// Blocks of the paged KV cache `kv_paged` (16 KiB each, an elastic region in 2 MiB
    /// chunks) whose sequences the threads share.
    pub paged_kv_blocks: u32,
}

impl Default for StressConfig {
    /// Sized for the host backend: 128 MiB of regions in 4 MiB chunks, 4 threads, 10 s,
    /// faults on.
    fn default() -> Self {
        StressConfig {
            duration: Duration::from_secs(10),
            seed: 0,
            threads: 4,
            weights_bytes: 48 * MIB,
            kv_cache_bytes: 64 * MIB,
            graph_bytes: 8 * MIB,
            aux_bytes: 8 * MIB,
            max_buffer_bytes: 2 * MIB,
            max_host_write_bytes: 512 << 10,
            readback_bytes: 2 * MIB,
            chunk_bytes: 4 * MIB,
            hash_chunk_bytes: MIB,
            verify_chunk_bytes: 64 << 10,
            skip_unchanged: true,
            verify_restore: false,
            faults: true,
            copy_fault_per_mille: 20,
            map_fault_per_mille: 20,
            pin_fault_per_mille: 100,
            paged_kv_blocks: 2048,
        }
    }
}

impl StressConfig {
    /// Sized for a GPU: 26 GiB of regions (8 GiB weights, 16 GiB KV cache, 1 GiB each of
    /// graph and aux) in 512 MiB chunks, buffers up to 512 MiB.
    pub fn gpu() -> Self {
        StressConfig {
            weights_bytes: 8 * GIB,
            kv_cache_bytes: 16 * GIB,
            graph_bytes: GIB,
            aux_bytes: GIB,
            max_buffer_bytes: 512 * MIB,
            max_host_write_bytes: 32 * MIB,
            readback_bytes: 64 * MIB,
            chunk_bytes: 512 * MIB,
            hash_chunk_bytes: 32 * MIB,
            verify_chunk_bytes: 16 * MIB,
            paged_kv_blocks: 65_536,
            ..StressConfig::default()
        }
    }

    /// [`StressConfig::gpu`] on CUDA, the default on the host backend.
    pub fn for_kind(kind: BackendKind) -> Self {
        match kind {
            BackendKind::Cuda => Self::gpu(),
            BackendKind::Host => Self::default(),
        }
    }

    fn sizes(&self) -> [usize; 4] {
        [
            self.weights_bytes,
            self.kv_cache_bytes,
            self.graph_bytes,
            self.aux_bytes,
        ]
    }

    fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { tag: None, reason });
        if !(1..=64).contains(&self.threads) {
            return bad(format!("{} stress threads: use 1 to 64", self.threads));
        }
        if self.sizes().contains(&0)
            || self.paged_kv_blocks == 0
            || self.max_buffer_bytes == 0
            || self.max_host_write_bytes == 0
            || self.readback_bytes == 0
        {
            return bad("stress sizes must be non-zero".to_owned());
        }
        let v = self.verify_chunk_bytes;
        if v == 0 || !v.is_multiple_of(16) || self.max_buffer_bytes.div_ceil(v) > MAX_HASH_CHUNKS {
            return bad(format!(
                "verify chunk {v}: a non-zero multiple of 16 with at most {MAX_HASH_CHUNKS} \
                 chunks per buffer of up to {} bytes",
                self.max_buffer_bytes
            ));
        }
        Ok(())
    }
}

/// A snapshot handed to the progress callback about every 100 ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Time since the threads started.
    pub elapsed: Duration,
    /// Regions released plus regions resumed so far.
    pub cycles: u64,
    /// Faults injected and seen so far (backend faults and out-of-memory).
    pub faults: u64,
    /// Content mismatches so far.
    pub corruptions: u64,
    /// Failures so far (corruptions included).
    pub errors: u64,
}

/// How many operations of each kind the threads did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    /// Release calls.
    pub releases: u64,
    /// Resume calls (explicit ones; resumes before leases are not counted here).
    pub resumes: u64,
    /// Releases refused with `Busy` (another thread's lease).
    pub busy: u64,
    /// Resume attempts that waited out another thread's memory hog.
    pub oom_waits: u64,
    /// Buffer allocations.
    pub allocs: u64,
    /// Allocations refused with `RegionFull`.
    pub region_full: u64,
    /// Buffer frees (each followed by a refused double free).
    pub frees: u64,
    /// Fills through the pager.
    pub fills: u64,
    /// Fills at a raw device address, as an engine's kernels would.
    pub raw_fills: u64,
    /// Host writes of random bytes.
    pub host_writes: u64,
    /// KV-cache steps (fill, hash, write, read back).
    pub kv_ops: u64,
    /// Leases held on random tag sets.
    pub leases: u64,
    /// Tag verifications (every owned buffer's hash).
    pub verifies: u64,
    /// Read-backs compared byte by byte.
    pub readbacks: u64,
    /// Memory hogs taken.
    pub hogs: u64,
    /// Backups freed.
    pub free_backups: u64,
    /// Leases refused with `NotResident` because another thread released a tag between
    /// this thread's resume and its lease (then it resumes again).
    pub lease_races: u64,
    /// Steps on the paged KV cache (`kv_paged`): sequences written, forked, swapped,
    /// checked, freed; trims; release/resume cycles of the cache.
    pub paged_kv_steps: u64,
    /// Overwritten marks set or cleared by owners on their buffers.
    pub marks: u64,
    /// Marked `Preserve` buffers skipped by a release and rewritten by their owner (their
    /// contents undefined, not checked; the rewrite is).
    pub marked_rewrites: u64,
}

impl fmt::Display for OpCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "releases {} (busy {}), resumes {} (waited out a hog {}), allocs {} (full {}), \
             frees {}, fills {} + {} raw, host writes {}, KV steps {}, paged KV steps {}, leases \
             {} (lost races {}), verifies {}, read-backs {}, hogs {}, backups freed {}, marks {} \
             (skipped and rewritten {})",
            self.releases,
            self.busy,
            self.resumes,
            self.oom_waits,
            self.allocs,
            self.region_full,
            self.frees,
            self.fills,
            self.raw_fills,
            self.host_writes,
            self.kv_ops,
            self.paged_kv_steps,
            self.leases,
            self.lease_races,
            self.verifies,
            self.readbacks,
            self.hogs,
            self.free_backups,
            self.marks,
            self.marked_rewrites
        )
    }
}

/// What a stress run found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StressSummary {
    /// The device's name.
    pub device: String,
    /// The seed.
    pub seed: u64,
    /// Threads.
    pub threads: usize,
    /// Wall time of the threads.
    pub elapsed: Duration,
    /// Regions released plus regions resumed.
    pub cycles: u64,
    /// Bytes mapped, unmapped and copied by releases and resumes.
    pub bytes_moved: u64,
    /// Faults injected: backend faults plus out-of-memory resumes under a hog.
    pub faults_injected: u64,
    /// Faults after which a retry succeeded.
    pub faults_recovered: u64,
    /// Faults injected into map calls a resume made ahead, after it had failed for another
    /// reason: recorded by the pager, not returned ([`gpu_pager::ABSORBED_MAP_ERROR`]).
    pub faults_absorbed: u64,
    /// Backend faults by kind.
    pub injected: FaultCounts,
    /// Out-of-memory resumes caused by the hog.
    pub oom_faults: u64,
    /// Content mismatches.
    pub corruptions: u64,
    /// Free device memory missing after the pager was dropped.
    pub leaked_bytes: usize,
    /// What `leaked_bytes` may be without counting as a leak (0 on the host backend; on a
    /// GPU the driver's own allocations move free memory a little).
    pub leak_slack: usize,
    /// Every failure (corruptions, unexpected errors, unrecovered faults, panics).
    pub errors: Vec<String>,
    /// Operations done.
    pub ops: OpCounts,
}

impl StressSummary {
    /// No corruption, no leak, no unrecovered fault, no unexpected error.
    pub fn ok(&self) -> bool {
        self.errors.is_empty()
            && self.corruptions == 0
            && self.leaked_bytes <= self.leak_slack
            && self.faults_recovered + self.faults_absorbed == self.faults_injected
    }
}

impl fmt::Display for StressSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: f64| b / GIB as f64;
        writeln!(
            f,
            "stress on {}: {:.1} s, {} threads, seed {seed} (replay with --seed {seed})",
            self.device,
            self.elapsed.as_secs_f64(),
            self.threads,
            seed = self.seed
        )?;
        writeln!(f, "  cycles          {}", self.cycles)?;
        writeln!(
            f,
            "  bytes moved     {:.2} GiB",
            gib(self.bytes_moved as f64)
        )?;
        writeln!(
            f,
            "  faults          {} injected ({}; out of memory {}), {} recovered, {} absorbed by a failed resume",
            self.faults_injected,
            self.injected,
            self.oom_faults,
            self.faults_recovered,
            self.faults_absorbed
        )?;
        writeln!(f, "  corruptions     {}", self.corruptions)?;
        writeln!(
            f,
            "  leaked bytes    {} (slack {})",
            self.leaked_bytes, self.leak_slack
        )?;
        writeln!(f, "  operations      {}", self.ops)?;
        for e in &self.errors {
            writeln!(f, "  error: {e}")?;
        }
        write!(
            f,
            "  result          {}",
            if self.ok() { "OK" } else { "FAILED" }
        )
    }
}

/// Runs the stress on `backend` (wrapped in a [`FaultyBackend`] when `cfg.faults`), calling
/// `progress` about every 100 ms from the calling thread. Returns `Err` only when the run
/// cannot start (bad configuration, regions that do not fit); everything found while
/// running is in the summary.
pub fn run(
    backend: Arc<dyn Backend>,
    cfg: &StressConfig,
    progress: &dyn Fn(&Progress),
) -> Result<StressSummary> {
    cfg.validate()?;
    warm_up(&backend)?;
    let start_free = free_bytes(backend.as_ref())?;
    let leak_slack = match backend.info().kind {
        BackendKind::Host => 0,
        BackendKind::Cuda => (64 * MIB).max(2 * backend.info().granularity),
    };

    let faulty = cfg.faults.then(|| {
        let plan = FaultPlan {
            seed: cfg.seed ^ 0xFA17_FA17_FA17_FA17,
            copy_per_mille: cfg.copy_fault_per_mille,
            map_per_mille: cfg.map_fault_per_mille,
            pin_per_mille: cfg.pin_fault_per_mille,
        };
        Arc::new(FaultyBackend::new(backend.clone(), plan))
    });
    let set_faults = |on: bool| faulty.iter().for_each(|f| f.set_enabled(on));
    set_faults(false);
    let device: Arc<dyn Backend> = match &faulty {
        Some(f) => f.clone(),
        None => backend.clone(),
    };
    let pager = Arc::new(Pager::with_config(
        device,
        PagerConfig {
            chunk_bytes: cfg.chunk_bytes,
            skip_unchanged: cfg.skip_unchanged,
            verify_restore: cfg.verify_restore,
            tuning: gpu_pager::Tuning {
                // Discard regions in chunks too, so that injected map faults land mid-region.
                discard_chunk_bytes: cfg.chunk_bytes,
                hash_chunk_bytes: cfg.hash_chunk_bytes,
                // Both restore paths (overlapped with mapping, or map then copy), by seed.
                overlap_restore: cfg.seed.is_multiple_of(2),
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    ));
    let mut bases = [0; 4];
    let mut sizes = [0; 4];
    for (t, ((tag, policy), bytes)) in TAGS.iter().zip(cfg.sizes()).enumerate() {
        let options = RegionOptions {
            prepin: *tag == "aux",
            ..Default::default()
        };
        let info = pager.region_with(tag, bytes, *policy, options)?;
        (bases[t], sizes[t]) = (info.base, info.size);
    }

    // The paged KV cache the threads share, and each thread's io buffers.
    let paged = KvCache::new(
        pager.clone(),
        worker::PAGED_TAG,
        worker::paged_layout(),
        cfg.paged_kv_blocks,
        KvCacheConfig {
            chunk_bytes: 2 * MIB,
        },
    )?;
    let io_buffer = worker::MAX_SEQ_TOKENS * worker::TOKEN;
    pager.region(worker::IO_TAG, cfg.threads * 3 * io_buffer, Policy::Discard)?;
    let mut io = Vec::with_capacity(cfg.threads);
    for _ in 0..cfg.threads {
        let b = || pager.alloc(worker::IO_TAG, io_buffer);
        io.push((b()?, b()?, b()?));
    }

    let sh = Shared::new(Instant::now() + cfg.duration, bases, sizes, backend.clone());
    let started = Instant::now();
    set_faults(true);
    let owned = run_threads(&pager, cfg, &sh, started, progress, &paged, io);
    let elapsed = started.elapsed();
    set_faults(false);

    // Every thread freed its sequences: nothing live, and a trim leaves nothing mapped.
    match paged.trim().and_then(|_| paged.stats()) {
        Ok(s) if s.pool.live == 0 && s.mapped_bytes == 0 => {}
        Ok(s) => sh.error(format!(
            "paged KV cache at the end: {} live blocks, {} bytes mapped after a trim (both \
             should be 0)",
            s.pool.live, s.mapped_bytes
        )),
        Err(e) => sh.error(format!("paged KV cache at the end: {e}")),
    }
    drop(paged); // removes its region
    if pager.info(worker::PAGED_TAG).is_ok() {
        sh.error("the paged KV cache's region outlived the cache".to_owned());
    }
    if let Err(e) = pager.remove(worker::IO_TAG) {
        sh.error(format!("removing `{}` at the end: {e}", worker::IO_TAG));
    }

    // The end: everything resumed and checked, memory accounted for, buffers freed.
    let mut last = Worker::new("final check".to_owned(), &pager, cfg, &sh, cfg.seed);
    let count = owned.len();
    last.adopt(owned);
    last.final_check();
    check_stats(&pager, &sh, count, start_free, leak_slack);
    last.free_all();
    drop(last);
    if pager.stats().regions.iter().any(|r| r.buffers != 0) {
        sh.error("buffers left after freeing every buffer".to_owned());
    }
    let injected = faulty.as_ref().map(|f| f.injected()).unwrap_or_default();
    // A resume maps ahead on a helper thread: a fault injected into a map call made after
    // the resume had failed for another reason is recorded, not returned (one error per
    // call). Those count as seen.
    worker::drain_absorbed(&pager, &sh);
    let absorbed = Shared::get(&sh.faults_absorbed);
    let seen = Shared::get(&sh.faults_seen) + absorbed;
    if injected.total() != seen {
        sh.error(format!(
            "{} backend faults were injected but {seen} came back as errors: the pager \
             swallowed some",
            injected.total()
        ));
    }
    drop(pager);
    drop(faulty);
    let leaked_bytes = start_free.saturating_sub(free_bytes(backend.as_ref())?);

    let oom_faults = Shared::get(&sh.oom_injected);
    Ok(StressSummary {
        device: backend.info().name.clone(),
        seed: cfg.seed,
        threads: cfg.threads,
        elapsed,
        cycles: Shared::get(&sh.cycles),
        bytes_moved: Shared::get(&sh.bytes_moved),
        faults_injected: injected.total() + oom_faults,
        faults_recovered: Shared::get(&sh.faults_recovered),
        faults_absorbed: absorbed,
        injected,
        oom_faults,
        corruptions: Shared::get(&sh.corruptions),
        leaked_bytes,
        leak_slack,
        errors: sh.errors(),
        ops: sh.ops(),
    })
}

/// Runs the worker threads to the deadline, reporting progress; returns their buffers.
fn run_threads(
    pager: &Pager,
    cfg: &StressConfig,
    sh: &Shared,
    started: Instant,
    progress: &dyn Fn(&Progress),
    paged: &KvCache,
    io: Vec<(gpu_pager::Buffer, gpu_pager::Buffer, gpu_pager::Buffer)>,
) -> Vec<Owned> {
    let snapshot = || Progress {
        elapsed: started.elapsed(),
        cycles: Shared::get(&sh.cycles),
        faults: Shared::get(&sh.faults_seen) + Shared::get(&sh.oom_injected),
        corruptions: Shared::get(&sh.corruptions),
        errors: sh.error_count(),
    };
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (i, (keys, values, out)) in io.into_iter().enumerate() {
            let seed = content::mix(cfg.seed ^ (i as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
            let w = Worker::new(format!("thread {i}"), pager, cfg, sh, seed).with_paged(
                worker::PagedIo {
                    kv: paged,
                    keys,
                    values,
                    out,
                },
            );
            match std::thread::Builder::new()
                .name(format!("stress-{i}"))
                .spawn_scoped(s, move || w.run())
            {
                Ok(h) => handles.push(h),
                Err(e) => sh.error(format!("spawning thread {i}: {e}")),
            }
        }
        while !handles.iter().all(|h| h.is_finished()) {
            progress(&snapshot());
            std::thread::sleep(Duration::from_millis(100));
        }
        progress(&snapshot());
        let mut owned = Vec::new();
        for (i, h) in handles.into_iter().enumerate() {
            match h.join() {
                Ok(o) => owned.extend(o),
                Err(panic) => {
                    let msg = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    sh.error(format!("thread {i} panicked: {msg}"));
                }
            }
        }
        owned
    })
}

/// After the final resume: every region resident, unleased, at its address, holding the
/// buffers the threads own; device memory in use is the regions' size.
fn check_stats(pager: &Pager, sh: &Shared, buffers: usize, start_free: usize, slack: usize) {
    let stats = pager.stats();
    for (t, (tag, _)) in TAGS.iter().enumerate() {
        match stats.region(tag) {
            Some(r) => {
                if r.info.state != State::Resident || r.resident_bytes != r.info.size {
                    sh.error(format!("`{tag}` is not resident after the final resume"));
                }
                if r.leases != 0 {
                    sh.error(format!("`{tag}` still has {} leases at the end", r.leases));
                }
                if r.info.base != sh.bases[t] {
                    sh.error(format!("`{tag}` moved"));
                }
            }
            None => sh.error(format!("`{tag}` is missing from the stats")),
        }
    }
    let live: usize = stats.regions.iter().map(|r| r.buffers).sum();
    if live != buffers {
        sh.error(format!(
            "the pager has {live} live buffers, the threads own {buffers}"
        ));
    }
    match free_bytes(pager.backend().as_ref()) {
        Ok(free) => {
            let used = start_free.saturating_sub(free);
            let want = stats.resident_bytes();
            if used.abs_diff(want) > slack {
                sh.error(format!(
                    "after the final resume {used} bytes of device memory are in use, but the \
                     regions map {want}"
                ));
            }
        }
        Err(e) => sh.error(format!("querying device memory: {e}")),
    }
}

fn free_bytes(backend: &dyn Backend) -> Result<usize> {
    backend
        .mem_info()
        .map(|m| m.free)
        .map_err(|e| Error::Backend {
            tags: Vec::new(),
            op: "querying device memory",
            error: e,
        })
}

/// Loads the kernels and sizes the backend's hash scratch memory once, so that neither
/// counts as a leak nor fails under a hog later.
fn warm_up(backend: &Arc<dyn Backend>) -> Result<()> {
    let g = backend.info().granularity;
    let pager = Pager::new(backend.clone());
    let tag = "stress-warm-up";
    pager.region(tag, 2 * g, Policy::Discard)?;
    let b = pager.alloc(tag, g)?;
    pager.fill(&b, 0)?;
    pager.hash(&b, g.div_ceil(MAX_HASH_CHUNKS).next_multiple_of(16))?;
    // The KV kernels' module and index scratch memory, sized for the largest write.
    let pager = Arc::new(pager);
    let kv = KvCache::new(
        pager.clone(),
        "stress-warm-up-kv",
        worker::paged_layout(),
        64,
        KvCacheConfig::default(),
    )?;
    let s = kv.create_seq()?;
    kv.append_tokens(s, worker::MAX_TOKENS as u64)?;
    let slots = kv.prepare_write(s, 0..worker::MAX_TOKENS as u64)?;
    let io = pager.alloc(tag, worker::MAX_TOKENS * worker::TOKEN)?;
    kv.write(0, &io, &io, worker::MAX_TOKENS, worker::TOKEN, &slots)?;
    Ok(())
}
