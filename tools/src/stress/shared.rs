//! State shared by the stress threads: the tags, counters, the hog's generation, errors.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::OpCounts;
use gpu_pager::Policy;
use gpu_pager::backend::Backend;

/// The tags every thread moves, with their policies.
pub(crate) const TAGS: [(&str, Policy); 4] = [
    ("weights", Policy::Preserve),
    ("kv_cache", Policy::Discard),
    ("graph", Policy::DiscardZeroed),
    ("aux", Policy::Preserve),
];

/// Index of `kv_cache` in [`TAGS`].
pub(crate) const KV: usize = 1;

/// Most error messages kept (the count goes on).
const MAX_ERRORS: usize = 100;
/// The run stops early after this many errors.
const STOP_AFTER_ERRORS: u64 = 200;

/// What the threads count; one index per field of [`OpCounts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Release,
    Resume,
    Busy,
    OomWait,
    Alloc,
    RegionFull,
    Free,
    Fill,
    RawFill,
    HostWrite,
    Kv,
    Lease,
    Verify,
    Readback,
    Hog,
    FreeBackup,
    LeaseRace,
    Paged,
    Mark,
    MarkedRewrite,
}

const OPS: usize = 20;

/// Counters, the error list, and the run's clock.
#[derive(Debug)]
pub(crate) struct Shared {
    pub deadline: Instant,
    stop: AtomicBool,
    /// Each region's base address at creation.
    pub bases: [u64; 4],
    /// Each region's size.
    pub sizes: [usize; 4],
    /// Regions released plus regions resumed.
    pub cycles: AtomicU64,
    /// Bytes mapped, unmapped and copied by releases and resumes.
    pub bytes_moved: AtomicU64,
    /// Injected backend faults that came back as errors.
    pub faults_seen: AtomicU64,
    /// Injected map faults a failing resume recorded instead of returning
    /// ([`gpu_pager::ABSORBED_MAP_ERROR`]), drained from the backend after each fault.
    pub faults_absorbed: AtomicU64,
    /// Resumes that failed with `OutOfMemory` because of this run's hog.
    pub oom_injected: AtomicU64,
    /// Faults whose retry succeeded (or ended in an expected, consistent outcome).
    pub faults_recovered: AtomicU64,
    /// Content mismatches.
    pub corruptions: AtomicU64,
    /// Successful resumes that brought each tag back (Done), by any thread.
    pub resumes: [AtomicU64; 4],
    /// Odd while a hog is held (or being taken or dropped): OOM is expected then.
    pub hog_gen: AtomicU64,
    /// One hogger at a time.
    pub hog_lock: Mutex<()>,
    /// The backend under the fault injector: the hog takes its memory there, as a trainer
    /// does, so that no pager fault is injected into it.
    pub trainer: Arc<dyn Backend>,
    ops: [AtomicU64; OPS],
    errors: Mutex<Vec<String>>,
    error_count: AtomicU64,
}

impl Shared {
    pub fn new(
        deadline: Instant,
        bases: [u64; 4],
        sizes: [usize; 4],
        trainer: Arc<dyn Backend>,
    ) -> Self {
        Shared {
            deadline,
            stop: AtomicBool::new(false),
            bases,
            sizes,
            cycles: AtomicU64::new(0),
            bytes_moved: AtomicU64::new(0),
            faults_seen: AtomicU64::new(0),
            faults_absorbed: AtomicU64::new(0),
            oom_injected: AtomicU64::new(0),
            faults_recovered: AtomicU64::new(0),
            corruptions: AtomicU64::new(0),
            resumes: Default::default(),
            hog_gen: AtomicU64::new(0),
            hog_lock: Mutex::new(()),
            trainer,
            ops: Default::default(),
            errors: Mutex::new(Vec::new()),
            error_count: AtomicU64::new(0),
        }
    }

    /// Whether the threads should finish: time is up, or too many errors.
    pub fn should_stop(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || Instant::now() >= self.deadline
    }

    pub fn count(&self, op: Op) {
        self.ops[op as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::SeqCst);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::SeqCst)
    }

    /// Records a failure of the run.
    pub fn error(&self, message: String) {
        let n = self.error_count.fetch_add(1, Ordering::SeqCst) + 1;
        if n >= STOP_AFTER_ERRORS {
            self.stop.store(true, Ordering::Relaxed);
        }
        let mut e = lock(&self.errors);
        if e.len() < MAX_ERRORS {
            e.push(message);
        }
    }

    /// Records a content mismatch (an error too).
    pub fn corruption(&self, message: String) {
        self.corruptions.fetch_add(1, Ordering::SeqCst);
        self.error(format!("corruption: {message}"));
    }

    pub fn error_count(&self) -> u64 {
        self.error_count.load(Ordering::SeqCst)
    }

    /// The error messages, with a last line for those not kept.
    pub fn errors(&self) -> Vec<String> {
        let mut e = lock(&self.errors).clone();
        let n = self.error_count();
        if n > e.len() as u64 {
            e.push(format!("... and {} more", n - e.len() as u64));
        }
        e
    }

    pub fn ops(&self) -> OpCounts {
        let n = |op: Op| self.ops[op as usize].load(Ordering::Relaxed);
        OpCounts {
            releases: n(Op::Release),
            resumes: n(Op::Resume),
            busy: n(Op::Busy),
            oom_waits: n(Op::OomWait),
            allocs: n(Op::Alloc),
            region_full: n(Op::RegionFull),
            frees: n(Op::Free),
            fills: n(Op::Fill),
            raw_fills: n(Op::RawFill),
            host_writes: n(Op::HostWrite),
            kv_ops: n(Op::Kv),
            leases: n(Op::Lease),
            verifies: n(Op::Verify),
            readbacks: n(Op::Readback),
            hogs: n(Op::Hog),
            free_backups: n(Op::FreeBackup),
            lease_races: n(Op::LeaseRace),
            paged_kv_steps: n(Op::Paged),
            marks: n(Op::Mark),
            marked_rewrites: n(Op::MarkedRewrite),
        }
    }
}

/// Locks a mutex, recovering from poisoning (a panicking thread is reported on its own).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
