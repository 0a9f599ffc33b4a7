//! The copy pump: host↔device copies fed from the host to two movers, the GPU's copy engine
//! and the copy kernel, a few units at a time, each call waiting for exactly its own units.
//!
//! Why two movers: right after a trainer frees a large allocation, the copy engine copies
//! host→device well below the link for about a second, while the copy kernel (`gp_copy`,
//! which reads the pinned host memory directly over the link) does not slow down; settled,
//! the copy engine is the faster. The pump cuts every copy into units
//! ([`PumpConfig::unit_bytes`]) and keeps at most [`PumpConfig::depth`] units' worth of bytes
//! queued on each mover's stream, each unit followed by a fence; whenever a mover has room
//! it gets the next unit.
//! Copies shorter than a unit (a growing region's buffers, the runs between marked buffers)
//! are units of their own, several to a slot, so that the movers stay as busy as with whole
//! units while the feeding thread maps or hashes. With [`CopyRoute::Fastest`] (the
//! pager's default for restores) each mover is timed alone on the first [`PROBE_BYTES`]
//! and the faster takes the rest (the copy engine is timed twice before the kernel gets
//! it); [`CopyRoute::Engine`] and [`CopyRoute::Kernel`] use one.
//! (Both movers side by side lose: the kernel wins the link's arbitration and slows the
//! copy engine more than it adds.)
//!
//! The calling thread feeds the movers: every [`Pump::push_to_device`],
//! [`Pump::push_to_host`] and [`Pump::poll`] starts what fits, without blocking, so a caller
//! can interleave other work (a resume maps the next group of chunks while the last one
//! copies); the end of the [`scope`] feeds the rest and waits, polling the fences with short
//! sleeps. Because at most `2 × depth × unit_bytes` are ever in flight (`(1 +`
//! [`KERNEL_DEPTH_FACTOR`]`) × depth × unit_bytes` while the copy kernel carries a
//! host→device copy alone), another thread's device-wide synchronisation (a release of
//! another tag) waits for those only, and its copies in the other direction run on the
//! other direction's streams meanwhile.
//!
//! **Both directions at once.** The pumps of one link (one [`crate::Pager`]) share a
//! [`Traffic`]: the units each has in flight, per direction. While another pump has units
//! in flight the other way, a [`CopyRoute::Fastest`] pump gives its units to the copy
//! engine only: the two directions of the link run side by side on the two copy engines,
//! while the copy kernel would compete for the link and the SMs with the other direction's
//! copy.
//!
//! **Ownership.** A pump exists only inside [`scope`], which waits for every unit it started
//! before it returns — on success, on error, and when the closure panics (the pump's `Drop`
//! waits) — and no pump can be leaked out of it. Host memory enters a pump as [`Pinned`] or
//! [`PinnedMut`] borrowed for the scope's lifetime `'h`, so the borrow checker keeps it
//! alive and untouched (or, for a destination, unaliased) until every copy from or into it
//! has finished. Device memory is a plain address: that it stays mapped and untouched until
//! the scope returns is the one promise the caller makes, at [`Pump::push_to_device`] and
//! [`Pump::push_to_host`]; the source of a copy to the host may go once
//! [`Pump::pushes_done`] has passed its push (a release unmaps what it has saved while the
//! rest copies, see [`Pump::drain`]).
//!
//! **Errors.** The first failure (a unit that cannot be enqueued, a fence that reports an
//! error) stops the feeding: queued units are dropped, the units in flight are waited for,
//! and the error is returned (by the push or poll that saw it, else by the scope). Nothing
//! started by a pump is in flight once its scope has returned.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod pinned;

pub use pinned::{Pinned, PinnedMut};

use crate::backend::{
    Backend, BackendError, BackendResult, DeferredErrors, Direction, Fence, HostBuffer, Mover,
    RawCopy, RawStream,
};

/// Default unit size: 256 MiB (about 5 ms at 55 GB/s): smaller units resumed no faster and
/// cost more fences.
pub const DEFAULT_UNIT_BYTES: usize = 256 << 20;

/// Default slots per mover: 2 (a unit's worth copying, one ready behind it, so that the
/// mover never waits for the host's next poll).
pub const DEFAULT_DEPTH: usize = 2;

/// Smallest unit: units are rounded up to a multiple of this.
pub const MIN_UNIT_BYTES: usize = 4096;

/// Units in flight per mover and per slot of [`PumpConfig::depth`] at most, when copies are
/// shorter than a unit: 8 (a mover keeps `depth × unit_bytes` in flight, in at most
/// `8 × depth` units, so that tiny copies do not pile up fences).
pub const MAX_UNITS_PER_SLOT: usize = 8;

/// How much faster than the copy engine the copy kernel must have been for a
/// [`CopyRoute::Fastest`] pump to choose it: 1.25. The copy engine leaves the SMs to the
/// application and its first units pay for landing in memory mapped just before, so only a
/// clear win (right after a trainer's free) moves the copy to the kernel.
pub const KERNEL_MARGIN: f64 = 1.25;

/// What a [`CopyRoute::Fastest`] pump times each mover on (at most a unit): 64 MiB, about a
/// millisecond over the link, long enough to time and short next to a weights restore.
pub const PROBE_BYTES: usize = 64 << 20;

/// How many times the configured depth the copy kernel gets when it carries the whole copy
/// ([`CopyRoute::Kernel`], or [`CopyRoute::Fastest`] once it chose the kernel): 4. Right
/// after a trainer's free the resume's map calls, made ahead on a helper thread, wait for
/// the driver's scrubbing of the freed memory, and the copy kernel runs dry between the
/// feeding thread's launches with only the default depth queued.
pub const KERNEL_DEPTH_FACTOR: usize = 4;

/// How long the feeding thread sleeps when nothing finished and nothing could start.
const POLL: Duration = Duration::from_micros(20);

/// Which movers a copy may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyRoute {
    /// The copy engine only (`cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync`).
    Engine,
    /// The copy kernel only (zero-copy loads or stores of the pinned host memory).
    Kernel,
    /// Times each mover alone on the copy's first 64 MiB (the copy engine, then the copy
    /// kernel), then gives every later unit to the faster (the kernel only when more than
    /// 1.25 times as fast): right after a trainer's free the copy engine runs host→device
    /// below the link for about a second while the kernel keeps its pace; settled, the copy
    /// engine is the faster. While the link carries the other direction too, the copy
    /// engine alone, untimed.
    Fastest,
}

crate::names::short_names!(CopyRoute, "route", {
    Engine => "engine",
    Kernel => "kernel",
    Fastest => "fastest",
});

impl CopyRoute {
    /// Whether `mover` may take units on this route.
    pub fn allows(self, mover: Mover) -> bool {
        match self {
            CopyRoute::Engine => mover == Mover::CopyEngine,
            CopyRoute::Kernel => mover == Mover::CopyKernel,
            CopyRoute::Fastest => true,
        }
    }
}

impl std::fmt::Display for CopyRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyRoute::Engine => "copy engine",
            CopyRoute::Kernel => "copy kernel",
            CopyRoute::Fastest => "fastest",
        })
    }
}

/// How a pump moves its copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PumpConfig {
    /// Which movers to use.
    pub route: CopyRoute,
    /// Bytes per unit (rounded up to a multiple of [`MIN_UNIT_BYTES`]; the last unit of a
    /// copy may be shorter).
    pub unit_bytes: usize,
    /// Slots per mover (at least 1): a mover has at most `depth × unit_bytes` in flight
    /// (`depth` whole units, or more units shorter than a unit, up to
    /// `depth ×` [`MAX_UNITS_PER_SLOT`]); the copy kernel gets [`KERNEL_DEPTH_FACTOR`] times
    /// as many when it carries a host→device copy alone.
    pub depth: usize,
}

impl Default for PumpConfig {
    /// Fastest, [`DEFAULT_UNIT_BYTES`] units, [`DEFAULT_DEPTH`] per mover. (The pager saves
    /// on the copy engine alone; see [`crate::PagerConfig`].)
    fn default() -> Self {
        PumpConfig {
            route: CopyRoute::Fastest,
            unit_bytes: DEFAULT_UNIT_BYTES,
            depth: DEFAULT_DEPTH,
        }
    }
}

impl PumpConfig {
    /// The settings a pump runs with: the unit rounded up to a multiple of
    /// [`MIN_UNIT_BYTES`] (at least one), the depth at least 1.
    pub fn normalized(self) -> Self {
        PumpConfig {
            route: self.route,
            unit_bytes: self
                .unit_bytes
                .max(1)
                .checked_next_multiple_of(MIN_UNIT_BYTES)
                .unwrap_or(usize::MAX / MIN_UNIT_BYTES * MIN_UNIT_BYTES),
            depth: self.depth.max(1),
        }
    }
}

/// The units in flight on one link, per direction, over all the pumps that share it (the
/// pumps of one [`crate::Pager`]); a [`CopyRoute::Fastest`] pump reads the other direction's
/// count to decide whether the copy kernel may take units (see the module docs).
#[derive(Debug, Default)]
pub struct Traffic {
    units: [AtomicUsize; 2],
}

impl Traffic {
    /// Units in flight in `direction`, over all the pumps sharing this.
    pub fn in_flight(&self, direction: Direction) -> usize {
        self.units[slot(direction)].load(Ordering::Relaxed)
    }

    fn add(&self, direction: Direction) {
        self.units[slot(direction)].fetch_add(1, Ordering::Relaxed);
    }

    fn sub(&self, direction: Direction) {
        // Every `sub` follows its own `add` (a pump's `landed` follows its `launched`).
        self.units[slot(direction)].fetch_sub(1, Ordering::Relaxed);
    }
}

/// The index of a direction in per-direction arrays.
fn slot(direction: Direction) -> usize {
    match direction {
        Direction::ToDevice => 0,
        Direction::ToHost => 1,
    }
}

/// The other way.
fn opposite(direction: Direction) -> Direction {
    match direction {
        Direction::ToDevice => Direction::ToHost,
        Direction::ToHost => Direction::ToDevice,
    }
}

/// What a pump moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PumpStats {
    /// Bytes moved by each mover, indexed by [`Mover::index`].
    pub bytes: [usize; 2],
    /// Units moved by each mover, indexed by [`Mover::index`].
    pub units: [usize; 2],
    /// From the scope's start until its last unit was seen finished.
    pub elapsed: Duration,
    /// Of that, the time after the scope's closure returned: copying not hidden behind the
    /// caller's own work (mapping, hashing).
    pub waited: Duration,
}

impl PumpStats {
    /// Bytes moved by `mover`.
    pub fn bytes_by(&self, mover: Mover) -> usize {
        self.bytes[mover.index()]
    }

    /// Bytes moved in all.
    pub fn total_bytes(&self) -> usize {
        self.bytes.iter().sum()
    }
}

/// What a pump needs of a backend (a trait of its own so that the scheduling is tested
/// with scripted movers).
trait Movers {
    /// [`Backend::copy_unit`].
    ///
    /// # Safety
    /// As `copy_unit`.
    unsafe fn start(&self, copy: &RawCopy, mover: Mover) -> BackendResult<Box<dyn Fence>>;
    /// [`Backend::synchronize`].
    fn synchronize(&self) -> BackendResult<()>;
    /// [`Backend::deferred_errors`].
    fn errors(&self) -> &DeferredErrors;
    /// The clock the pump times its movers by.
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A backend's movers.
struct Via<'b>(&'b dyn Backend);

impl Movers for Via<'_> {
    unsafe fn start(&self, copy: &RawCopy, mover: Mover) -> BackendResult<Box<dyn Fence>> {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.copy_unit(copy, mover) }
    }
    fn synchronize(&self) -> BackendResult<()> {
        self.0.synchronize()
    }
    fn errors(&self) -> &DeferredErrors {
        self.0.deferred_errors()
    }
}

/// A mover's pace: the bytes it finished and the time it had units in flight.
#[derive(Debug, Clone, Copy, Default)]
struct Pace {
    /// Bytes of the units started on the mover.
    started: usize,
    /// Bytes of its units seen finished.
    done: usize,
    /// Time with units in flight, up to the last time it went idle.
    busy: Duration,
    /// Since when it has had units in flight (`None`: idle).
    since: Option<Instant>,
}

impl Pace {
    /// Bytes per second over the time it was busy (`None` before it finished anything).
    fn rate(&self) -> Option<f64> {
        (self.done > 0 && !self.busy.is_zero()).then(|| self.done as f64 / self.busy.as_secs_f64())
    }
}

/// A unit started on a mover.
struct InFlight {
    fence: Box<dyn Fence>,
    /// The number of the push it was cut from.
    push: u64,
    bytes: usize,
    direction: Direction,
}

/// Feeds copies to the movers; see the module docs. Only [`scope`] makes one.
pub struct Pump<'e, 'h> {
    movers: &'e dyn Movers,
    config: PumpConfig,
    /// The link's traffic, shared with the other pumps of the pager.
    traffic: &'e Traffic,
    /// This pump's own units in flight, per direction (its share of `traffic`).
    own: [usize; 2],
    /// Units not started yet, in order, each with the number of its push.
    queue: VecDeque<(u64, RawCopy)>,
    /// Pushes made so far: the next push's number.
    pushes: u64,
    /// [`Pump::pushes_done`] as of the first failure: nothing counts as done after it.
    done_at_failure: Option<u64>,
    /// Units started and not seen finished, per mover.
    flight: [Vec<InFlight>; 2],
    /// The first failure, until it is returned.
    failure: Option<BackendError>,
    /// A failure happened: nothing more starts.
    failed: bool,
    stats: PumpStats,
    started: Instant,
    /// How fast each mover has been, timed while it had units in flight.
    pace: [Pace; 2],
    /// A [`CopyRoute::Fastest`] pump's choice, once both movers are timed.
    chosen: Option<Mover>,
    /// The copy engine's rate on its first timing, kept while it is timed a second time
    /// because the copy kernel looked faster ([`Pump::choose`]).
    engine_first: Option<f64>,
    /// A [`CopyRoute::Fastest`] pump started a unit before choosing while the other
    /// direction was busy: its timings are spoiled, and start again once both movers are
    /// idle.
    retime: bool,
    /// Invariant in `'h`: the host borrows of every push live exactly as long.
    _host: PhantomData<&'h mut &'h ()>,
}

impl std::fmt::Debug for Pump<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pump")
            .field("config", &self.config)
            .field("queued", &self.queue.len())
            .field("in_flight", &[self.flight[0].len(), self.flight[1].len()])
            .field("failed", &self.failed)
            .field("stats", &self.stats)
            .finish()
    }
}

/// Runs `f` with a pump on `backend` and waits for every unit the pump started: after `f`
/// returns `Ok`, the pump copies what is still queued and the result is `f`'s value and the
/// pump's figures, or `copy_error` of the first copy failure not yet returned; after `f`
/// returns `Err` (or panics), queued units are dropped, the units in flight are waited for,
/// and `f`'s error is returned (a copy failure that `f` never saw is recorded in the
/// backend's [`DeferredErrors`]). Either way, nothing the pump started is in flight when
/// this returns.
///
/// `traffic` is the link's [`Traffic`], shared by every pump of the pager (a fresh one for a
/// pump that has the link to itself).
pub fn scope<'h, T, E>(
    backend: &dyn Backend,
    config: PumpConfig,
    traffic: &Traffic,
    f: impl for<'e> FnOnce(&mut Pump<'e, 'h>) -> Result<T, E>,
    copy_error: impl FnOnce(BackendError) -> E,
) -> Result<(T, PumpStats), E> {
    run(&Via(backend), config, traffic, f, copy_error)
}

fn run<'e, 'h, T, E>(
    movers: &'e dyn Movers,
    config: PumpConfig,
    traffic: &'e Traffic,
    f: impl FnOnce(&mut Pump<'e, 'h>) -> Result<T, E>,
    copy_error: impl FnOnce(BackendError) -> E,
) -> Result<(T, PumpStats), E> {
    let mut pump = Pump {
        movers,
        config: config.normalized(),
        traffic,
        own: [0, 0],
        queue: VecDeque::new(),
        pushes: 0,
        done_at_failure: None,
        flight: [Vec::new(), Vec::new()],
        failure: None,
        failed: false,
        stats: PumpStats::default(),
        started: Instant::now(),
        pace: [Pace::default(); 2],
        chosen: None,
        engine_first: None,
        retime: false,
        _host: PhantomData,
    };
    // A panic in `f` unwinds through `pump`'s drop, which waits like `abort`.
    match f(&mut pump) {
        Ok(value) => pump
            .finish()
            .map(|stats| (value, stats))
            .map_err(copy_error),
        Err(e) => {
            pump.abort();
            Err(e)
        }
    }
}

impl<'h> Pump<'_, 'h> {
    /// Queues a copy of `src` to device address `dst` and starts what fits, without
    /// blocking. Returns the first copy failure of this pump if one happened by now (then
    /// nothing more is copied).
    ///
    /// # Safety
    /// `dst .. dst + src.len()` is mapped device memory of the pump's backend that stays
    /// mapped, and that nothing else reads or writes, until the pump's [`scope`] returns;
    /// `src` is memory from that backend's [`Backend::alloc_pinned`], and does not overlap
    /// the destination.
    pub unsafe fn push_to_device(&mut self, src: Pinned<'h>, dst: u64) -> BackendResult<()> {
        self.push(
            src.span
                .copies(Direction::ToDevice, dst, self.config.unit_bytes),
        )
    }

    /// Queues a copy of device address `src` into `dst` and starts what fits, without
    /// blocking. Returns as [`Pump::push_to_device`].
    ///
    /// # Safety
    /// `src .. src + dst.len()` is mapped device memory of the pump's backend that stays
    /// mapped, and that nothing writes, until the pump's [`scope`] returns or
    /// [`Pump::pushes_done`] exceeds this push's number ([`Pump::pushes`] before the call);
    /// `dst` is memory from that backend's [`Backend::alloc_pinned`].
    pub unsafe fn push_to_host(&mut self, src: u64, dst: PinnedMut<'h>) -> BackendResult<()> {
        self.push(
            dst.span
                .copies(Direction::ToHost, src, self.config.unit_bytes),
        )
    }

    /// Retires finished units and starts queued ones on free slots, without blocking. Call it
    /// between other work to keep the movers busy. Returns as [`Pump::push_to_device`].
    pub fn poll(&mut self) -> BackendResult<()> {
        self.feed(false, |_| false);
        self.take_failure()
    }

    /// Pushes made so far. A push's copies have all finished once [`Pump::pushes_done`]
    /// exceeds its number (the value of `pushes` before it was made).
    pub fn pushes(&self) -> u64 {
        self.pushes
    }

    /// How many of the first pushes have finished every copy: all pushes numbered below it
    /// have (as of the last push, poll or drain; after a failure, as of the failure, which
    /// a push that failed or was dropped never passes). Their device memory may be unmapped
    /// while the scope goes on.
    pub fn pushes_done(&self) -> u64 {
        if let Some(done) = self.done_at_failure {
            return done;
        }
        let queued = self.queue.front().map(|(n, _)| *n);
        let flying = self.flight.iter().flatten().map(|u| u.push).min();
        [queued, flying]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(self.pushes)
    }

    /// Feeds the movers and waits until every push made so far has finished, calling
    /// `meanwhile` with [`Pump::pushes_done`] between polls: it does a small piece of other
    /// work and says whether it did any (when neither it nor the movers did, the thread
    /// sleeps briefly). Returns the first copy failure, as [`Pump::poll`].
    ///
    /// Why: a release unmaps what it has saved while the rest still copies, a piece per
    /// call so that the movers never run dry.
    pub fn drain(&mut self, meanwhile: impl FnMut(u64) -> bool) -> BackendResult<()> {
        self.feed(true, meanwhile);
        self.stop_error()
    }

    /// Queues a copy's units ([`Span::copies`]) as one push and feeds.
    fn push(&mut self, units: impl Iterator<Item = RawCopy>) -> BackendResult<()> {
        self.stop_error()?;
        let n = self.pushes;
        self.pushes += 1;
        self.queue.extend(units.map(|u| (n, u)));
        self.feed(false, |_| false);
        self.take_failure()
    }

    /// After a failure, the failure if not returned yet, else [`stopped`].
    fn stop_error(&mut self) -> BackendResult<()> {
        if self.failed {
            return Err(self.take_failure().err().unwrap_or_else(stopped));
        }
        Ok(())
    }

    fn take_failure(&mut self) -> BackendResult<()> {
        match self.failure.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Notes a failure: the first is kept to be returned, later ones are recorded; nothing
    /// more starts.
    fn fail(&mut self, e: BackendError) {
        if self.done_at_failure.is_none() {
            self.done_at_failure = Some(self.pushes_done());
        }
        self.queue.clear();
        if self.failed {
            self.movers.errors().record(format!(
                "a copy failed after an earlier failure of the same call (the first error \
                 was returned): {e}"
            ));
        } else {
            self.failed = true;
            self.failure = Some(e);
        }
    }

    /// Retires and starts units; with `block`, until nothing is queued or in flight (or a
    /// failure stops it), calling `meanwhile` between polls ([`Pump::drain`]).
    fn feed(&mut self, block: bool, mut meanwhile: impl FnMut(u64) -> bool) {
        loop {
            let retired = self.retire();
            if self.failed {
                return;
            }
            let started = self.dispatch();
            if self.failed || !block {
                return;
            }
            let worked = meanwhile(self.pushes_done());
            if self.queue.is_empty() && self.flight.iter().all(Vec::is_empty) {
                // What finished last may have let `meanwhile` start more.
                while meanwhile(self.pushes_done()) {}
                return;
            }
            if !retired && !started && !worked {
                std::thread::sleep(POLL);
            }
        }
    }

    /// Drops the units whose fence has passed, counting them. Stops at the first fence
    /// that reports an error (kept in flight: `abort` waits for it).
    fn retire(&mut self) -> bool {
        let mut any = false;
        for m in Mover::ALL {
            let mut i = 0;
            while i < self.flight[m.index()].len() {
                match self.flight[m.index()][i].fence.is_done() {
                    Ok(true) => {
                        let unit = self.flight[m.index()].swap_remove(i);
                        self.landed(unit.direction);
                        self.stats.bytes[m.index()] += unit.bytes;
                        self.stats.units[m.index()] += 1;
                        self.pace[m.index()].done += unit.bytes;
                        any = true;
                    }
                    Ok(false) => i += 1,
                    Err(e) => {
                        self.fail(e);
                        return any;
                    }
                }
            }
        }
        if any {
            self.stats.elapsed = self.started.elapsed();
            let now = self.movers.now();
            for m in Mover::ALL {
                let pace = &mut self.pace[m.index()];
                if let (true, Some(since)) = (self.flight[m.index()].is_empty(), pace.since) {
                    pace.busy += now.saturating_duration_since(since);
                    pace.since = None;
                }
            }
            self.choose();
        }
        any
    }

    /// A [`CopyRoute::Fastest`] pump picks its mover once each has finished the bytes it
    /// was timed on ([`Pump::timing`]) and gone idle: the copy kernel if it was more than
    /// [`KERNEL_MARGIN`] times as fast, else the copy engine. Before it picks the kernel it
    /// times the copy engine once more and takes the better of its two rates: right after a
    /// trainer's free the copy engine's first units may be slow for a few milliseconds only
    /// (an H100) or for about a second (an H200), and the kernel below the link on a GPU
    /// where the engine recovers at once would cost the whole copy. Timings spoiled by the
    /// other direction's traffic ([`Pump::retime`]) are dropped once both movers are idle.
    fn choose(&mut self) {
        if self.config.route != CopyRoute::Fastest || self.chosen.is_some() {
            return;
        }
        if self.retime {
            if self.flight.iter().all(Vec::is_empty) {
                self.pace = [Pace::default(); 2];
                self.engine_first = None;
                self.retime = false;
            }
            return;
        }
        let probe = self.probe_bytes();
        let timed = |m: Mover| {
            let p = &self.pace[m.index()];
            p.started >= probe && p.since.is_none()
        };
        if timed(Mover::CopyEngine) && timed(Mover::CopyKernel) {
            let rate = |m: Mover| self.pace[m.index()].rate().unwrap_or(0.0);
            let engine = rate(Mover::CopyEngine).max(self.engine_first.unwrap_or(0.0));
            let kernel_faster = rate(Mover::CopyKernel) > KERNEL_MARGIN * engine;
            if kernel_faster && self.engine_first.is_none() {
                self.engine_first = Some(engine);
                self.pace[Mover::CopyEngine.index()] = Pace::default();
                return;
            }
            self.chosen = Some(if kernel_faster {
                Mover::CopyKernel
            } else {
                Mover::CopyEngine
            });
        }
    }

    /// The mover a [`CopyRoute::Fastest`] pump is timing now: the copy engine until it
    /// started [`Pump::probe_bytes`], then, once it went idle, the copy kernel until it did
    /// too, then (when [`Pump::choose`] times it again) the copy engine once more (`None`:
    /// waiting for one to go idle, or decided).
    fn timing(&self) -> Option<Mover> {
        if self.chosen.is_some() {
            return None;
        }
        let probe = self.probe_bytes();
        let (engine, kernel) = (
            &self.pace[Mover::CopyEngine.index()],
            &self.pace[Mover::CopyKernel.index()],
        );
        if engine.started < probe {
            return Some(Mover::CopyEngine);
        }
        if engine.since.is_none() && kernel.started < probe {
            return Some(Mover::CopyKernel);
        }
        None
    }

    /// The bytes a [`CopyRoute::Fastest`] pump times each mover on: a unit, at most
    /// [`PROBE_BYTES`].
    fn probe_bytes(&self) -> usize {
        self.config.unit_bytes.min(PROBE_BYTES)
    }

    /// Unit slots of `mover` for units going `direction`: the configured depth, times
    /// [`KERNEL_DEPTH_FACTOR`] for the copy kernel carrying a host→device copy alone.
    fn slots(&self, mover: Mover, direction: Direction) -> usize {
        let deep = mover == Mover::CopyKernel
            && direction == Direction::ToDevice
            && match self.config.route {
                CopyRoute::Kernel => true,
                CopyRoute::Fastest => self.chosen == Some(Mover::CopyKernel),
                CopyRoute::Engine => false,
            };
        if deep {
            self.config.depth.saturating_mul(KERNEL_DEPTH_FACTOR)
        } else {
            self.config.depth
        }
    }

    /// The movers a unit going `direction` may take now: the route's, except that a fastest
    /// pump leaves the copy kernel out while another pump of the link has units in flight
    /// the other way (see the module docs).
    fn allowed(&self, mover: Mover, direction: Direction) -> bool {
        if !self.config.route.allows(mover) {
            return false;
        }
        let others_back = self.others_back(direction);
        match self.config.route {
            CopyRoute::Fastest if others_back > 0 => mover == Mover::CopyEngine,
            CopyRoute::Fastest => match self.chosen {
                Some(chosen) => mover == chosen,
                None => self.timing() == Some(mover),
            },
            CopyRoute::Engine | CopyRoute::Kernel => true,
        }
    }

    /// Units other pumps of the link have in flight against `direction`.
    fn others_back(&self, direction: Direction) -> usize {
        let back = opposite(direction);
        self.traffic
            .in_flight(back)
            .saturating_sub(self.own[slot(back)])
    }

    /// The mover that takes the next unit (going `direction`, `bytes` long): an allowed one
    /// with room for it; with both, the one with fewer bytes in flight (the copy engine on a
    /// tie). A mover has room while its bytes in flight plus the unit's stay within
    /// `depth × unit_bytes` and it has fewer than `depth ×` [`MAX_UNITS_PER_SLOT`] units in
    /// flight: a slot is a unit's worth of bytes, so that copies shorter than a unit (the
    /// buffers of a growing region, the runs between marked buffers) keep as much work
    /// queued as whole units do.
    fn free_mover(&self, direction: Direction, bytes: usize) -> Option<Mover> {
        let busy = |m: Mover| -> usize { self.flight[m.index()].iter().map(|u| u.bytes).sum() };
        let room = |m: Mover| {
            let depth = self.slots(m, direction);
            self.flight[m.index()].len() < depth.saturating_mul(MAX_UNITS_PER_SLOT)
                && busy(m).saturating_add(bytes) <= depth.saturating_mul(self.config.unit_bytes)
        };
        Mover::ALL
            .into_iter()
            .filter(|&m| self.allowed(m, direction) && room(m))
            .min_by_key(|&m| (busy(m), m.index()))
    }

    /// Counts a unit started going `direction`, here and in the link's traffic.
    fn launched(&mut self, direction: Direction) {
        self.own[slot(direction)] += 1;
        self.traffic.add(direction);
    }

    /// Counts a unit going `direction` as finished (or waited for).
    fn landed(&mut self, direction: Direction) {
        self.own[slot(direction)] -= 1;
        self.traffic.sub(direction);
    }

    /// Starts queued units on free slots.
    fn dispatch(&mut self) -> bool {
        let mut any = false;
        loop {
            self.cut_probe();
            let Some((_, next)) = self.queue.front() else {
                break;
            };
            let Some(mover) = self.free_mover(next.direction, next.bytes) else {
                break;
            };
            let Some((push, unit)) = self.queue.pop_front() else {
                break;
            };
            // SAFETY: the unit was cut from a push, whose caller promised that its device
            // range stays mapped and untouched until the scope returns and that its host
            // range is the backend's pinned memory; the host range is borrowed for `'h`,
            // which outlives this pump, and the pump waits for every unit it starts before
            // it is gone (`finish`, `abort`, `drop`), so the memory outlives the copy.
            match unsafe { self.movers.start(&unit, mover) } {
                Ok(fence) => {
                    self.flight[mover.index()].push(InFlight {
                        fence,
                        push,
                        bytes: unit.bytes,
                        direction: unit.direction,
                    });
                    self.launched(unit.direction);
                    if self.config.route == CopyRoute::Fastest
                        && self.chosen.is_none()
                        && self.others_back(unit.direction) > 0
                    {
                        self.retime = true;
                    }
                    let pace = &mut self.pace[mover.index()];
                    pace.started += unit.bytes;
                    if pace.since.is_none() {
                        pace.since = Some(self.movers.now());
                    }
                    any = true;
                }
                Err(e) => {
                    // Back in the queue for `fail` to see its push as not done.
                    self.queue.push_front((push, unit));
                    self.fail(e);
                    break;
                }
            }
        }
        any
    }

    /// While a [`CopyRoute::Fastest`] pump times a mover, cuts the next unit to what the
    /// mover still has to be timed on (whole pages), so that the timing costs
    /// [`PROBE_BYTES`], not a whole unit, on the slower mover.
    fn cut_probe(&mut self) {
        if self.config.route != CopyRoute::Fastest {
            return;
        }
        let Some(mover) = self.timing() else {
            return;
        };
        let left = self
            .probe_bytes()
            .saturating_sub(self.pace[mover.index()].started)
            .next_multiple_of(MIN_UNIT_BYTES);
        let quiet = self
            .queue
            .front()
            .is_some_and(|(_, next)| self.others_back(next.direction) == 0);
        let Some((push, next)) = self.queue.front_mut() else {
            return;
        };
        let push = *push;
        if !quiet || left == 0 || next.bytes <= left {
            return;
        }
        let rest = RawCopy {
            host: next.host.wrapping_add(left as u64),
            host_device: next.host_device.wrapping_add(left as u64),
            device: next.device.wrapping_add(left as u64),
            bytes: next.bytes - left,
            ..*next
        };
        next.bytes = left;
        self.queue.insert(1, (push, rest));
    }

    /// Copies everything queued and waits for it. On a failure, stops and waits for what is
    /// in flight (`abort`) and returns the failure (or [`stopped`] when it was returned to a
    /// push already).
    fn finish(&mut self) -> BackendResult<PumpStats> {
        let t = Instant::now();
        self.feed(true, |_| false);
        self.stats.waited = t.elapsed();
        if self.failed {
            let e = self.failure.take().unwrap_or_else(stopped);
            self.abort();
            return Err(e);
        }
        self.stats.elapsed = self.started.elapsed();
        Ok(self.stats)
    }

    /// Drops what is queued and waits for every unit in flight. If a wait fails (a broken
    /// context), synchronizes the device instead, and if even that fails, records it: the
    /// context then runs nothing more. A failure never returned is recorded.
    fn abort(&mut self) {
        self.queue.clear();
        let mut broken = None;
        let units: Vec<InFlight> = self.flight.iter_mut().flat_map(|f| f.drain(..)).collect();
        for unit in units {
            if let Err(e) = unit.fence.wait() {
                broken.get_or_insert(e);
            }
            // Waited for (or the device synchronized below): off the link either way.
            self.landed(unit.direction);
        }
        let errors = self.movers.errors();
        if let Some(e) = broken {
            errors.record(format!(
                "waiting for in-flight copies failed ({e}); synchronizing the device instead"
            ));
            if let Err(sync) = self.movers.synchronize() {
                errors.record(format!(
                    "synchronizing the device after a failed wait for copies failed: {sync}"
                ));
            }
        }
        if let Some(e) = self.failure.take() {
            errors.record(format!(
                "a copy failed while its call was failing for another reason (that error was \
                 returned): {e}"
            ));
        }
    }
}

impl Drop for Pump<'_, '_> {
    /// Waits for the units in flight (after a panic in the scope's closure; otherwise
    /// there are none left).
    fn drop(&mut self) {
        self.abort();
    }
}

/// The error of a push or scope after an earlier failure was already returned.
fn stopped() -> BackendError {
    BackendError::Invalid {
        op: "copy",
        reason: "an earlier copy of this call failed, so nothing more was copied".to_owned(),
    }
}

/// Where a restore's copies go: a pump (fed from the host, waited for by its scope), or a
/// caller's stream ([`crate::Pager::resume_on`]: enqueued there by one mover, not waited for).
pub(crate) enum Sink<'s, 'e, 'h> {
    /// A pump.
    Pump(&'s mut Pump<'e, 'h>),
    /// A caller's stream.
    Stream {
        backend: &'e dyn Backend,
        stream: RawStream,
        mover: Mover,
    },
}

impl<'h> Sink<'_, '_, 'h> {
    /// Starts what fits without blocking ([`Pump::poll`]); nothing to do for a stream,
    /// whose copies are all enqueued already.
    pub fn poll(&mut self) -> BackendResult<()> {
        match self {
            Sink::Pump(pump) => pump.poll(),
            Sink::Stream { .. } => Ok(()),
        }
    }

    /// Copies `src` to device address `dst`.
    ///
    /// # Safety
    /// As [`Pump::push_to_device`] for a pump. For a stream: the device range is mapped, and the
    /// host bytes alive and unwritten, until the stream has run the copy (the caller keeps
    /// a fence after it and waits for it before either changes).
    pub unsafe fn push_to_device(&mut self, src: Pinned<'h>, dst: u64) -> BackendResult<()> {
        match self {
            // SAFETY: forwarded from the caller.
            Sink::Pump(pump) => unsafe { pump.push_to_device(src, dst) },
            Sink::Stream {
                backend,
                stream,
                mover,
            } => {
                // One copy per registration of the host bytes.
                for copy in src.span.copies(Direction::ToDevice, dst, usize::MAX) {
                    // SAFETY: forwarded from the caller; `copy` is a part of `src`.
                    unsafe { backend.copy_on(&copy, *mover, *stream) }?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests;
