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
//! and the faster takes the rest; [`CopyRoute::Engine`] and [`CopyRoute::Kernel`] use one.
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
//! [`Pump::push_to_host`].
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

impl CopyRoute {
    /// Every route.
    pub const ALL: [CopyRoute; 3] = [CopyRoute::Engine, CopyRoute::Kernel, CopyRoute::Fastest];

    /// The route's short name, as the bindings spell it: `"engine"`, `"kernel"` or
    /// `"fastest"`.
    pub fn name(self) -> &'static str {
        match self {
            CopyRoute::Engine => "engine",
            CopyRoute::Kernel => "kernel",
            CopyRoute::Fastest => "fastest",
        }
    }

    /// The route with this short name ([`CopyRoute::name`]), if any.
    pub fn from_name(name: &str) -> Option<CopyRoute> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }

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

/// Pinned host bytes borrowed for `'h`, to be read by copies (a restore's source). Cheap to
/// copy; any number may borrow the same buffer.
#[derive(Debug, Clone, Copy)]
pub struct Pinned<'h> {
    span: Span,
    _borrow: PhantomData<&'h [u8]>,
}

/// Borrowed pinned bytes as addresses: `len` bytes at `host`, which kernels reach at
/// `device`, and where the buffer's registrations end.
#[derive(Debug, Clone, Copy)]
struct Span {
    host: u64,
    device: u64,
    len: usize,
    regs: Regs,
}

impl Span {
    /// All of `buf`, whose bytes start at `host`.
    fn of(buf: &dyn HostBuffer, host: *const u8) -> Self {
        Span {
            host: host as u64,
            device: buf.device_ptr(),
            len: buf.len(),
            regs: Regs::of(buf),
        }
    }

    /// `len` of these bytes from `start` on.
    fn sub(self, start: usize, len: usize) -> Self {
        Span {
            host: self.host + start as u64,
            device: self.device + start as u64,
            len,
            regs: self.regs.advanced(start),
        }
    }

    /// The copies between these bytes and device address `device`, in order: each at most
    /// `unit` bytes, none crossing the end of a registration.
    fn copies(
        self,
        direction: Direction,
        device: u64,
        unit: usize,
    ) -> impl Iterator<Item = RawCopy> {
        let mut at = 0usize;
        std::iter::from_fn(move || {
            (at < self.len).then(|| {
                let bytes = (self.len - at).min(unit).min(self.regs.advanced(at).room());
                let off = at as u64;
                at += bytes;
                RawCopy {
                    direction,
                    host: self.host.wrapping_add(off),
                    host_device: self.device.wrapping_add(off),
                    device: device.wrapping_add(off),
                    bytes,
                }
            })
        })
    }
}

/// Where the registrations of a borrowed buffer's bytes end ([`HostBuffer::piece_bytes`]):
/// pieces of `piece` bytes from the buffer's start (0: one registration), the first borrowed
/// byte `phase` bytes into its piece. A copy never crosses a piece's end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Regs {
    piece: usize,
    phase: usize,
}

impl Regs {
    fn of(buf: &dyn HostBuffer) -> Self {
        Regs {
            piece: buf.piece_bytes(),
            phase: 0,
        }
    }

    /// The same, `n` bytes further on.
    fn advanced(self, n: usize) -> Self {
        match self.piece {
            0 => self,
            p => Regs {
                piece: p,
                phase: ((self.phase as u128 + n as u128) % p as u128) as usize,
            },
        }
    }

    /// Bytes from the first borrowed byte to the end of its piece (`usize::MAX`: no end).
    fn room(self) -> usize {
        match self.piece {
            0 => usize::MAX,
            p => p - self.phase,
        }
    }
}

impl<'h> Pinned<'h> {
    /// All of `buf`.
    pub fn new(buf: &'h dyn HostBuffer) -> Self {
        Pinned {
            span: Span::of(buf, buf.as_slice().as_ptr()),
            _borrow: PhantomData,
        }
    }

    /// Bytes.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.span.len
    }

    /// The bytes `range` of these; `None` unless the range lies inside them.
    pub fn get(self, range: Range<usize>) -> Option<Self> {
        (range.start <= range.end && range.end <= self.span.len).then(|| Pinned {
            span: self.span.sub(range.start, range.len()),
            _borrow: PhantomData,
        })
    }
}

/// Pinned host bytes borrowed exclusively for `'h`, to be written by copies (a backup's
/// destination). Split it, like a `&mut [u8]`, to hand disjoint parts to several copies.
#[derive(Debug)]
pub struct PinnedMut<'h> {
    span: Span,
    _borrow: PhantomData<&'h mut [u8]>,
}

impl<'h> PinnedMut<'h> {
    /// All of `buf`.
    pub fn new(buf: &'h mut dyn HostBuffer) -> Self {
        let host = buf.as_mut_slice().as_mut_ptr();
        PinnedMut {
            span: Span::of(buf, host),
            _borrow: PhantomData,
        }
    }

    /// Bytes.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.span.len
    }

    /// The bytes before `mid` and those from `mid` on; `None` if `mid` is past the end.
    pub fn split_at(self, mid: usize) -> Option<(Self, Self)> {
        let part = |start, len| PinnedMut {
            span: self.span.sub(start, len),
            _borrow: PhantomData,
        };
        (mid <= self.span.len).then(|| (part(0, mid), part(mid, self.span.len - mid)))
    }

    /// The bytes `range` of these (the rest is given up); `None` unless the range lies
    /// inside them.
    #[cfg(test)]
    pub fn get(self, range: Range<usize>) -> Option<Self> {
        if range.start > range.end || range.end > self.span.len {
            return None;
        }
        let (_, tail) = self.split_at(range.start)?;
        let (part, _) = tail.split_at(range.len())?;
        Some(part)
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
    /// Units not started yet, in order.
    queue: VecDeque<RawCopy>,
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
    /// mapped, and that nothing writes, until the pump's [`scope`] returns; `dst` is memory
    /// from that backend's [`Backend::alloc_pinned`].
    pub unsafe fn push_to_host(&mut self, src: u64, dst: PinnedMut<'h>) -> BackendResult<()> {
        self.push(
            dst.span
                .copies(Direction::ToHost, src, self.config.unit_bytes),
        )
    }

    /// Retires finished units and starts queued ones on free slots, without blocking. Call it
    /// between other work to keep the movers busy. Returns as [`Pump::push_to_device`].
    pub fn poll(&mut self) -> BackendResult<()> {
        self.feed(false);
        self.take_failure()
    }

    /// Queues a copy's units ([`Span::copies`]) and feeds.
    fn push(&mut self, units: impl Iterator<Item = RawCopy>) -> BackendResult<()> {
        if self.failed {
            return Err(self.take_failure().err().unwrap_or_else(stopped));
        }
        self.queue.extend(units);
        self.feed(false);
        self.take_failure()
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
    /// failure stops it).
    fn feed(&mut self, block: bool) {
        loop {
            let retired = self.retire();
            if self.failed {
                return;
            }
            let started = self.dispatch();
            let idle = self.queue.is_empty() && self.flight.iter().all(Vec::is_empty);
            if self.failed || !block || idle {
                return;
            }
            if !retired && !started {
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
            let Some(next) = self.queue.front() else {
                break;
            };
            let Some(mover) = self.free_mover(next.direction, next.bytes) else {
                break;
            };
            let Some(unit) = self.queue.pop_front() else {
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
            .is_some_and(|next| self.others_back(next.direction) == 0);
        let Some(next) = self.queue.front_mut() else {
            return;
        };
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
        self.queue.insert(1, rest);
    }

    /// Copies everything queued and waits for it. On a failure, stops and waits for what is
    /// in flight (`abort`) and returns the failure (or [`stopped`] when it was returned to a
    /// push already).
    fn finish(&mut self) -> BackendResult<PumpStats> {
        let t = Instant::now();
        self.feed(true);
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
mod tests {
    use super::*;
    use crate::backend::host::{HostBackend, HostConfig};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    /// Scripted movers on a virtual clock that advances by one tick per fence query: a unit
    /// on mover `m` takes `cost[m]` ticks after the previous unit on `m` (or its start).
    #[derive(Default)]
    struct Script {
        cost: [u64; 2],
        /// The copy engine's first this many units cost this many ticks each instead.
        engine_slow_start: Option<(usize, u64)>,
        /// Fail the start of this unit (counting from 0), once.
        fail_start: Option<usize>,
        /// The fence of this unit reports an error when polled.
        fail_fence: Option<usize>,
        state: Arc<Mutex<Clock>>,
        errors: DeferredErrors,
        /// The link's traffic the pump under test shares.
        traffic: Traffic,
    }

    #[derive(Default, Debug)]
    struct Clock {
        now: u64,
        last: [u64; 2],
        starts: Vec<(Mover, RawCopy)>,
        /// Units the other mover had in flight at each start.
        other_busy: Vec<usize>,
        in_flight: [usize; 2],
        max_in_flight: [usize; 2],
        in_flight_bytes: [usize; 2],
        max_in_flight_bytes: [usize; 2],
        synced: usize,
    }

    #[derive(Debug)]
    struct ScriptFence {
        state: Arc<Mutex<Clock>>,
        mover: Mover,
        bytes: usize,
        due: u64,
        broken: bool,
        done: AtomicBool,
    }

    impl ScriptFence {
        fn finish(&self, c: &mut Clock) {
            if !self.done.swap(true, Ordering::SeqCst) {
                c.in_flight[self.mover.index()] -= 1;
                c.in_flight_bytes[self.mover.index()] -= self.bytes;
            }
        }
    }

    impl Fence for ScriptFence {
        fn wait(&self) -> BackendResult<()> {
            let mut c = self.state.lock().unwrap();
            c.now = c.now.max(self.due);
            self.finish(&mut c);
            Ok(())
        }
        fn is_done(&self) -> BackendResult<bool> {
            let mut c = self.state.lock().unwrap();
            c.now += 1;
            if self.broken {
                return Err(BackendError::Injected { op: "fence" });
            }
            if c.now >= self.due {
                self.finish(&mut c);
                return Ok(true);
            }
            Ok(false)
        }
    }

    impl Script {
        /// Movers that take `cost` ticks per unit (copy engine, copy kernel), nothing failing.
        fn costing(cost: [u64; 2]) -> Script {
            Script {
                cost,
                ..Script::default()
            }
        }
    }

    impl Movers for Script {
        unsafe fn start(&self, copy: &RawCopy, mover: Mover) -> BackendResult<Box<dyn Fence>> {
            let mut c = self.state.lock().unwrap();
            let n = c.starts.len();
            if self.fail_start == Some(n) {
                return Err(BackendError::Injected { op: "start" });
            }
            c.starts.push((mover, *copy));
            let m = mover.index();
            let other = c.in_flight[1 - m];
            c.other_busy.push(other);
            let engine_units = c.starts[..n]
                .iter()
                .filter(|(m, _)| *m == Mover::CopyEngine)
                .count();
            let cost = match self.engine_slow_start {
                Some((units, slow)) if mover == Mover::CopyEngine && engine_units < units => slow,
                _ => self.cost[m],
            };
            let due = c.now.max(c.last[m]) + cost;
            c.last[m] = due;
            c.in_flight[m] += 1;
            c.max_in_flight[m] = c.max_in_flight[m].max(c.in_flight[m]);
            c.in_flight_bytes[m] += copy.bytes;
            c.max_in_flight_bytes[m] = c.max_in_flight_bytes[m].max(c.in_flight_bytes[m]);
            Ok(Box::new(ScriptFence {
                state: self.state.clone(),
                mover,
                bytes: copy.bytes,
                due,
                broken: self.fail_fence == Some(n),
                done: AtomicBool::new(false),
            }))
        }
        fn synchronize(&self) -> BackendResult<()> {
            self.state.lock().unwrap().synced += 1;
            Ok(())
        }
        fn errors(&self) -> &DeferredErrors {
            &self.errors
        }
        /// The virtual clock, a tick a microsecond.
        fn now(&self) -> Instant {
            static BASE: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);
            *BASE + Duration::from_micros(self.state.lock().unwrap().now)
        }
    }

    const MIB: usize = 1 << 20;

    fn buffer(len: usize) -> Box<dyn HostBuffer> {
        HostBackend::new(HostConfig::default())
            .alloc_pinned(len)
            .unwrap()
    }

    fn config(route: CopyRoute) -> PumpConfig {
        PumpConfig {
            route,
            unit_bytes: MIB,
            depth: 2,
        }
    }

    /// Pushes `buf` to device address 0x1000_0000 in pieces of `piece` bytes.
    fn restore(
        script: &Script,
        cfg: PumpConfig,
        buf: &dyn HostBuffer,
        piece: usize,
    ) -> Result<PumpStats, BackendError> {
        let all = Pinned::new(buf);
        run(
            script,
            cfg,
            &script.traffic,
            |p| {
                let mut at = 0;
                while at < all.len() {
                    let end = (at + piece).min(all.len());
                    let src = all.get(at..end).unwrap();
                    // SAFETY: the scripted movers touch no memory.
                    unsafe { p.push_to_device(src, 0x1000_0000 + at as u64) }?;
                    at = end;
                }
                Ok(())
            },
            |e| e,
        )
        .map(|((), s)| s)
    }

    #[test]
    fn units_are_cut_from_each_piece_and_cover_it() {
        let script = Script::costing([3, 3]);
        let buf = buffer(5 * MIB + 123);
        let stats = restore(&script, config(CopyRoute::Engine), buf.as_ref(), 3 * MIB).unwrap();
        let c = script.state.lock().unwrap();
        let sizes: Vec<usize> = c.starts.iter().map(|(_, u)| u.bytes).collect();
        assert_eq!(sizes, vec![MIB, MIB, MIB, MIB, MIB, 123]);
        let mut at = 0u64;
        for (m, u) in &c.starts {
            assert_eq!(*m, Mover::CopyEngine);
            assert_eq!(u.direction, Direction::ToDevice);
            assert_eq!(u.device, 0x1000_0000 + at);
            assert_eq!(u.host, buf.as_slice().as_ptr() as u64 + at);
            assert_eq!(u.host_device, buf.device_ptr() + at);
            at += u.bytes as u64;
        }
        assert_eq!(stats.bytes, [5 * MIB + 123, 0]);
        assert_eq!(stats.units, [6, 0]);
        assert_eq!(c.in_flight, [0, 0]);
        assert!(c.max_in_flight[0] <= 2);
    }

    /// A host buffer registered in pieces of `piece` bytes, as `alloc_pinned_from_device`
    /// makes them on CUDA.
    #[derive(Debug)]
    struct InPieces {
        bytes: Vec<u8>,
        piece: usize,
    }

    impl HostBuffer for InPieces {
        fn as_slice(&self) -> &[u8] {
            &self.bytes
        }
        fn as_mut_slice(&mut self) -> &mut [u8] {
            &mut self.bytes
        }
        fn piece_bytes(&self) -> usize {
            self.piece
        }
    }

    #[test]
    fn no_unit_crosses_a_registration_of_the_host_buffer() {
        let piece = 3 * MIB / 2 + 4096;
        let mut buf = InPieces {
            bytes: vec![0; 5 * MIB + 123],
            piece,
        };
        let start = buf.as_slice().as_ptr() as u64;
        let len = buf.len();
        let crosses = |u: &RawCopy| {
            let (a, b) = (u.host - start, u.host - start + u.bytes as u64 - 1);
            a / piece as u64 != b / piece as u64
        };
        // Restores of parts starting at odd offsets (`Fastest` also cuts its timed units),
        // then a save of a part.
        for (route, push) in [
            (CopyRoute::Kernel, 700_001),
            (CopyRoute::Fastest, 700_001),
            (CopyRoute::Fastest, len),
        ] {
            let script = Script::costing([3, 3]);
            let cfg = PumpConfig {
                unit_bytes: 2 * MIB,
                ..config(route)
            };
            let stats = restore(&script, cfg, &buf, push).unwrap();
            assert_eq!(stats.total_bytes(), len);
            let mut units: Vec<RawCopy> = script
                .state
                .lock()
                .unwrap()
                .starts
                .iter()
                .map(|(_, u)| *u)
                .collect();
            units.sort_by_key(|u| u.host);
            let mut at = start;
            for u in &units {
                assert!(!crosses(u), "{route}: {u:?} crosses a registration");
                assert!(u.bytes > 0);
                assert_eq!(u.host, at, "{route}: the units cover the buffer");
                at += u.bytes as u64;
            }
        }
        let script = Script::default();
        let part = 100_000..len - 77;
        run(
            &script,
            config(CopyRoute::Engine),
            &script.traffic,
            |p| {
                let dst = PinnedMut::new(&mut buf).get(part.clone()).unwrap();
                // SAFETY: the scripted movers touch no memory.
                unsafe { p.push_to_host(0x1000_0000, dst) }
            },
            |e| e,
        )
        .unwrap();
        let c = script.state.lock().unwrap();
        assert!(c.starts.iter().all(|(_, u)| !crosses(u)));
        assert_eq!(
            c.starts.iter().map(|(_, u)| u.bytes).sum::<usize>(),
            part.len()
        );
        // A stream sink cuts its copy at the same boundaries.
        let host = HostBackend::new(HostConfig::default());
        let mut sink = Sink::Stream {
            backend: &host,
            stream: RawStream(0),
            mover: Mover::CopyEngine,
        };
        let mut dev = vec![0u8; len];
        buf.bytes
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8);
        // SAFETY: `dev` is host memory standing in for the device on the host backend,
        // which copies at once; the ranges do not overlap.
        unsafe { sink.push_to_device(Pinned::new(&buf), dev.as_mut_ptr() as u64) }.unwrap();
        assert!(dev == buf.bytes);
    }

    #[test]
    fn each_route_uses_its_movers_and_respects_the_depth() {
        for route in CopyRoute::ALL {
            for depth in [1, 2, 3] {
                let script = Script::costing([5, 5]);
                let cfg = PumpConfig {
                    depth,
                    ..config(route)
                };
                let buf = buffer(40 * MIB);
                let stats = restore(&script, cfg, buf.as_ref(), 7 * MIB).unwrap();
                let c = script.state.lock().unwrap();
                assert_eq!(stats.total_bytes(), 40 * MIB);
                for m in Mover::ALL {
                    // The kernel carrying a whole copy gets KERNEL_DEPTH_FACTOR times the
                    // slots (with equal costs, `Fastest` keeps the copy engine).
                    let slots = match (route, m) {
                        (CopyRoute::Kernel, Mover::CopyKernel) => depth * KERNEL_DEPTH_FACTOR,
                        _ => depth,
                    };
                    assert!(c.max_in_flight[m.index()] <= slots, "{route:?} {depth}");
                    assert_eq!(stats.bytes_by(m) > 0, route.allows(m), "{route:?} {m}");
                }
                assert_eq!(c.in_flight, [0, 0]);
            }
        }
    }

    #[test]
    fn copies_shorter_than_a_unit_fill_the_slots_by_bytes() {
        // 1 MiB units, depth 2: copies of 256 KiB (and odd ones) keep up to 2 MiB in flight
        // per mover, in at most 2 × MAX_UNITS_PER_SLOT units; whole units still 2 at most.
        for (piece, most_units) in [(256 << 10, 8), (100_000, 2 * MAX_UNITS_PER_SLOT), (MIB, 2)] {
            let script = Script::costing([50, 50]);
            let buf = buffer(24 * MIB);
            let cfg = config(CopyRoute::Engine);
            let stats = restore(&script, cfg, buf.as_ref(), piece).unwrap();
            let c = script.state.lock().unwrap();
            let e = Mover::CopyEngine.index();
            assert_eq!(stats.total_bytes(), 24 * MIB);
            assert!(c.max_in_flight_bytes[e] <= 2 * MIB, "{piece}: {c:?}");
            assert!(c.max_in_flight[e] <= most_units, "{piece}: {c:?}");
            assert_eq!(c.max_in_flight[e], most_units, "{piece}: the slots filled");
            assert_eq!((c.in_flight, c.in_flight_bytes), ([0, 0], [0, 0]));
        }
    }

    #[test]
    fn fastest_times_each_mover_alone_then_gives_the_rest_to_the_faster() {
        // Whole units, and pieces shorter than a unit (a growing region's buffers).
        for piece in [64 * MIB, 300 * 1024] {
            // The kernel 4 times as fast, 4 times as slow, and only 1.2 times as fast
            // (within the margin: the copy engine keeps the copy).
            for (cost, fast) in [
                ([40, 10], Mover::CopyKernel),
                ([10, 40], Mover::CopyEngine),
                ([60, 50], Mover::CopyEngine),
            ] {
                if piece < MIB && cost == [60, 50] {
                    // Short units: the virtual clock's fence polls blur a 1.2× difference.
                    continue;
                }
                let script = Script::costing(cost);
                let buf = buffer(64 * MIB);
                let stats =
                    restore(&script, config(CopyRoute::Fastest), buf.as_ref(), piece).unwrap();
                assert_eq!(stats.total_bytes(), 64 * MIB);
                let c = script.state.lock().unwrap();
                let movers: Vec<Mover> = c.starts.iter().map(|(m, _)| *m).collect();
                // The copy engine first, until a unit's worth (1 MiB) started; then the
                // kernel, until it did too; then only the faster.
                let bytes_until =
                    |k: usize| -> usize { c.starts[..k].iter().map(|(_, u)| u.bytes).sum() };
                let first_kernel = movers
                    .iter()
                    .position(|&m| m == Mover::CopyKernel)
                    .expect("the kernel is timed");
                assert!(
                    movers[..first_kernel]
                        .iter()
                        .all(|&m| m == Mover::CopyEngine)
                );
                assert!(
                    bytes_until(first_kernel) >= MIB,
                    "{piece}: the engine's share"
                );
                let kernel_done = first_kernel
                    + movers[first_kernel..]
                        .iter()
                        .position(|&m| m != Mover::CopyKernel)
                        .unwrap_or(movers.len() - first_kernel);
                assert!(bytes_until(kernel_done) - bytes_until(first_kernel) >= MIB);
                assert!(
                    c.other_busy[..kernel_done].iter().all(|&n| n == 0),
                    "{piece} {cost:?}: each mover timed alone"
                );
                // Before the kernel takes the copy, the engine is timed once more, alone.
                let decided = if fast == Mover::CopyKernel {
                    assert!(
                        c.max_in_flight[fast.index()] > 2,
                        "{piece}: the kernel carrying the copy gets more slots"
                    );
                    let again = kernel_done
                        + movers[kernel_done..]
                            .iter()
                            .position(|&m| m != Mover::CopyEngine)
                            .expect("the kernel takes the rest");
                    assert!(bytes_until(again) - bytes_until(kernel_done) >= MIB);
                    assert!(c.other_busy[..again].iter().all(|&n| n == 0));
                    again
                } else {
                    kernel_done
                };
                assert!(
                    movers[decided..].iter().all(|&m| m == fast),
                    "{piece} {cost:?}: the rest on {fast}: {movers:?}"
                );
                assert!(
                    stats.bytes_by(fast) > 60 * MIB,
                    "{piece} {cost:?}: {stats:?}"
                );
                assert_eq!(c.in_flight, [0, 0]);
            }
        }
    }

    #[test]
    fn fastest_times_each_mover_on_probe_bytes_of_a_longer_unit() {
        let script = Script::costing([40, 10]);
        let cfg = PumpConfig {
            unit_bytes: 2 * PROBE_BYTES,
            ..config(CopyRoute::Fastest)
        };
        let buf = buffer(6 * PROBE_BYTES + 4096);
        let stats = restore(&script, cfg, buf.as_ref(), buf.len()).unwrap();
        assert_eq!(stats.total_bytes(), buf.len());
        let c = script.state.lock().unwrap();
        let starts: Vec<(Mover, usize)> = c.starts.iter().map(|(m, u)| (*m, u.bytes)).collect();
        assert_eq!(starts[0], (Mover::CopyEngine, PROBE_BYTES), "{starts:?}");
        assert_eq!(starts[1], (Mover::CopyKernel, PROBE_BYTES), "{starts:?}");
        assert_eq!(
            starts[2],
            (Mover::CopyEngine, PROBE_BYTES),
            "timed again: {starts:?}"
        );
        assert!(starts[3..].iter().all(|&(m, _)| m == Mover::CopyKernel));
        // The units still cover the buffer back to back.
        let mut at = buf.as_slice().as_ptr() as u64;
        let mut sorted: Vec<&RawCopy> = c.starts.iter().map(|(_, u)| u).collect();
        sorted.sort_by_key(|u| u.host);
        for u in sorted {
            assert_eq!(u.host, at);
            assert_eq!(u.device - 0x1000_0000, at - buf.as_slice().as_ptr() as u64);
            at += u.bytes as u64;
        }
    }

    #[test]
    fn fastest_keeps_the_copy_engine_when_only_its_first_units_were_slow() {
        // The engine half as fast as the kernel on its first unit only (an H100 right
        // after a trainer's free), then twice as fast: timed again, it keeps the copy.
        let script = Script {
            engine_slow_start: Some((1, 40)),
            ..Script::costing([10, 20])
        };
        let buf = buffer(64 * MIB);
        let stats = restore(&script, config(CopyRoute::Fastest), buf.as_ref(), MIB).unwrap();
        let c = script.state.lock().unwrap();
        let movers: Vec<Mover> = c.starts.iter().map(|(m, _)| *m).collect();
        assert_eq!(
            movers[..3],
            [Mover::CopyEngine, Mover::CopyKernel, Mover::CopyEngine],
            "{movers:?}"
        );
        assert!(
            movers[3..].iter().all(|&m| m == Mover::CopyEngine),
            "{movers:?}"
        );
        assert_eq!(stats.bytes_by(Mover::CopyKernel), MIB);
        // Slow for longer (an H200: about a second), the kernel still takes it.
        let script = Script {
            engine_slow_start: Some((usize::MAX, 40)),
            ..Script::costing([10, 10])
        };
        let stats = restore(&script, config(CopyRoute::Fastest), buf.as_ref(), MIB).unwrap();
        assert!(stats.bytes_by(Mover::CopyKernel) > 60 * MIB, "{stats:?}");
    }

    #[test]
    fn fastest_times_again_once_the_other_direction_is_quiet() {
        let script = Script::costing([40, 10]);
        script.traffic.add(Direction::ToHost);
        let buf = buffer(64 * MIB);
        let all = Pinned::new(buf.as_ref());
        let mut quiet_from = 0;
        let ((), stats) = run(
            &script,
            config(CopyRoute::Fastest),
            &script.traffic,
            |p| {
                // SAFETY: the scripted movers touch no memory.
                unsafe { p.push_to_device(all.get(0..8 * MIB).unwrap(), 0x1000) }?;
                // The other direction ends while these units are in flight.
                quiet_from = script.state.lock().unwrap().starts.len();
                script.traffic.sub(Direction::ToHost);
                // SAFETY: as above.
                unsafe {
                    p.push_to_device(all.get(8 * MIB..64 * MIB).unwrap(), 0x1000 + 8 * MIB as u64)
                }
            },
            |e| e,
        )
        .unwrap();
        let c = script.state.lock().unwrap();
        let movers: Vec<Mover> = c.starts.iter().map(|(m, _)| *m).collect();
        assert!(movers[..quiet_from].iter().all(|&m| m == Mover::CopyEngine));
        let first_kernel = movers.iter().position(|&m| m == Mover::CopyKernel).unwrap();
        assert!(first_kernel >= quiet_from);
        assert_eq!(c.other_busy[first_kernel], 0, "the kernel is timed alone");
        assert!(stats.bytes_by(Mover::CopyKernel) > 40 * MIB, "{stats:?}");
    }

    #[test]
    fn fastest_keeps_to_the_copy_engine_while_the_other_direction_is_busy() {
        let script = Script::costing([40, 10]);
        script.traffic.add(Direction::ToHost);
        let buf = buffer(16 * MIB);
        let stats = restore(&script, config(CopyRoute::Fastest), buf.as_ref(), 16 * MIB).unwrap();
        assert_eq!(stats.bytes_by(Mover::CopyEngine), 16 * MIB);
        assert_eq!(script.traffic.in_flight(Direction::ToHost), 1);
    }

    #[test]
    fn a_failed_start_stops_the_feeding_and_waits_for_the_units_in_flight() {
        for fail in [0, 1, 5] {
            let script = Script {
                cost: [50, 50],
                fail_start: Some(fail),
                ..Script::default()
            };
            let buf = buffer(20 * MIB);
            let err =
                restore(&script, config(CopyRoute::Engine), buf.as_ref(), 4 * MIB).unwrap_err();
            assert!(
                matches!(err, BackendError::Injected { op: "start" }),
                "{err}"
            );
            let c = script.state.lock().unwrap();
            assert_eq!(c.starts.len(), fail, "nothing starts after the failure");
            assert_eq!(c.in_flight, [0, 0], "every started unit was waited for");
            assert_eq!(script.traffic.in_flight(Direction::ToDevice), 0);
            assert!(script.errors.take().is_empty());
        }
    }

    #[test]
    fn a_failed_fence_is_returned_by_the_scope_after_the_others_finished() {
        let script = Script {
            cost: [5, 5],
            fail_fence: Some(2),
            ..Script::default()
        };
        let buf = buffer(20 * MIB);
        // One piece: the failure shows up while the scope waits.
        let err = restore(&script, config(CopyRoute::Engine), buf.as_ref(), 20 * MIB).unwrap_err();
        assert!(
            matches!(err, BackendError::Injected { op: "fence" }),
            "{err}"
        );
        let c = script.state.lock().unwrap();
        assert!(
            c.starts.len() < 20,
            "the feeding stopped: {}",
            c.starts.len()
        );
        assert_eq!(c.in_flight, [0, 0]);
        assert_eq!(script.traffic.in_flight(Direction::ToDevice), 0);
    }

    #[test]
    fn the_closures_error_wins_and_the_units_in_flight_are_waited_for() {
        let script = Script {
            cost: [1, 1],
            fail_fence: Some(0),
            ..Script::default()
        };
        let buf = buffer(4 * MIB);
        let all = Pinned::new(buf.as_ref());
        let got: Result<((), PumpStats), &str> = run(
            &script,
            config(CopyRoute::Engine),
            &script.traffic,
            |p| {
                // SAFETY: the scripted movers touch no memory.
                let _ = unsafe { p.push_to_device(all, 0x1000) };
                Err("mapping failed")
            },
            |_| "copy failed",
        );
        assert_eq!(got.unwrap_err(), "mapping failed");
        assert_eq!(script.state.lock().unwrap().in_flight, [0, 0]);
        assert_eq!(script.traffic.in_flight(Direction::ToDevice), 0);
    }

    #[test]
    fn fastest_leaves_the_kernel_out_while_the_other_direction_is_busy() {
        for (busy_back, kernel_used) in [(0, true), (1, false)] {
            // The kernel four times as fast: alone on the link, it takes the copy.
            let script = Script::costing([40, 10]);
            // Another pump of the link copying device→host.
            for _ in 0..busy_back {
                script.traffic.add(Direction::ToHost);
            }
            let buf = buffer(16 * MIB);
            let stats =
                restore(&script, config(CopyRoute::Fastest), buf.as_ref(), 16 * MIB).unwrap();
            assert_eq!(stats.total_bytes(), 16 * MIB);
            assert_eq!(
                stats.bytes_by(Mover::CopyKernel) > 0,
                kernel_used,
                "other direction busy: {busy_back}; {stats:?}"
            );
            assert!(stats.bytes_by(Mover::CopyEngine) > 0);
            // This pump's units are off the link again; the other pump's are not.
            assert_eq!(script.traffic.in_flight(Direction::ToDevice), 0);
            assert_eq!(script.traffic.in_flight(Direction::ToHost), busy_back);
        }
        // A route that names its mover keeps it whatever the other direction does.
        let script = Script::costing([10, 10]);
        script.traffic.add(Direction::ToHost);
        let buf = buffer(4 * MIB);
        let stats = restore(&script, config(CopyRoute::Kernel), buf.as_ref(), 4 * MIB).unwrap();
        assert_eq!(stats.bytes_by(Mover::CopyKernel), 4 * MIB);
    }

    #[test]
    fn a_pump_counts_its_units_on_the_link_while_they_fly() {
        let script = Script::costing([1000, 1000]);
        let buf = buffer(8 * MIB);
        let all = Pinned::new(buf.as_ref());
        let ((), _) = run(
            &script,
            config(CopyRoute::Engine),
            &script.traffic,
            |p| {
                // SAFETY: the scripted movers touch no memory.
                unsafe { p.push_to_device(all, 0x1000) }?;
                // Two units on the copy engine started, none finished yet.
                assert_eq!(script.traffic.in_flight(Direction::ToDevice), 2);
                assert_eq!(script.traffic.in_flight(Direction::ToHost), 0);
                Ok::<(), BackendError>(())
            },
            |e| e,
        )
        .unwrap();
        assert_eq!(script.traffic.in_flight(Direction::ToDevice), 0);
    }

    #[test]
    fn a_panic_in_the_scope_still_waits_for_the_units_in_flight() {
        let script = Script::costing([1000, 1000]);
        let buf = buffer(8 * MIB);
        let all = Pinned::new(buf.as_ref());
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _: Result<((), PumpStats), BackendError> = run(
                &script,
                config(CopyRoute::Engine),
                &script.traffic,
                |p| {
                    // SAFETY: the scripted movers touch no memory.
                    unsafe { p.push_to_device(all, 0x1000) }?;
                    panic!("the caller panics with units in flight");
                },
                |e| e,
            );
        }));
        assert!(caught.is_err());
        let c = script.state.lock().unwrap();
        assert_eq!(c.starts.len(), 2, "two were in flight");
        assert_eq!(c.in_flight, [0, 0]);
        assert_eq!(script.traffic.in_flight(Direction::ToDevice), 0);
    }

    #[test]
    fn pinned_parts_stay_inside_their_buffer() {
        let mut buf = buffer(100);
        let base = buf.as_slice().as_ptr() as u64;
        let p = Pinned::new(buf.as_ref());
        assert!(p.get(10..101).is_none());
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 20..10;
        assert!(p.get(backwards).is_none());
        let q = p.get(10..30).unwrap();
        assert_eq!((q.span.host, q.len()), (base + 10, 20));
        assert!(q.get(0..21).is_none());
        let m = PinnedMut::new(buf.as_mut());
        assert!(m.split_at(101).is_none());
        let m = PinnedMut::new(buf.as_mut());
        let (a, b) = m.split_at(40).unwrap();
        assert_eq!(
            (a.span.host, a.len(), b.span.host, b.len()),
            (base, 40, base + 40, 60)
        );
        let c = b.get(5..25).unwrap();
        assert_eq!((c.span.host, c.len()), (base + 45, 20));
        assert!(PinnedMut::new(buf.as_mut()).get(50..101).is_none());
    }

    #[test]
    fn the_config_is_normalized() {
        let c = PumpConfig {
            route: CopyRoute::Kernel,
            unit_bytes: 0,
            depth: 0,
        }
        .normalized();
        assert_eq!((c.unit_bytes, c.depth), (MIN_UNIT_BYTES, 1));
        let c = PumpConfig {
            unit_bytes: MIN_UNIT_BYTES + 1,
            ..PumpConfig::default()
        }
        .normalized();
        assert_eq!(c.unit_bytes, 2 * MIN_UNIT_BYTES);
        assert_eq!(PumpConfig::default().normalized(), PumpConfig::default());
    }
}
