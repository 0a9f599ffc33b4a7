//! A [`Backend`] wrapper that makes chosen calls fail, to test the pager's error paths.
//!
//! [`FaultyBackend`] delegates every call to the backend it wraps. Before delegating
//! [`Backend::map`], the copies ([`Backend::copy_to_device`], [`Backend::copy_to_host`],
//! and each unit of a pumped copy: [`Backend::copy_unit`], [`Backend::copy_on`]) and
//! [`Backend::alloc_pinned`], it may return [`BackendError::Injected`] instead — **without**
//! calling the wrapped backend, so a failed `map` maps nothing (it stays all or nothing) and
//! a failed copy moves no byte (a pumped copy fails at that unit, after the units before it
//! moved). A batch of pinned buffers ([`Backend::alloc_pinned_many`]) meets the
//! [`FaultPoint::AllocPinned`] decision once per buffer, in order, and fails whole at the
//! first injected one, before the wrapped backend pins anything; otherwise the wrapped
//! backend pins the batch (its own batch path). A batch pinned and filled from the device
//! ([`Backend::alloc_pinned_many_from_device`]) meets one [`FaultPoint::AllocPinned`]
//! decision per buffer, then one [`FaultPoint::CopyToHost`] decision per buffer, the same
//! way, before the wrapped backend's own call.
//!
//! Two sources of faults:
//! - a seeded [`FaultPlan`]: each call at a [`FaultPoint`] fails with the plan's probability.
//!   The decision is a pure function of the seed, the point and how many calls that point
//!   has seen, so one sequence of calls always meets the same faults;
//! - [`FaultyBackend::fail_next`] / [`FaultyBackend::fail_after`]: the next (or the
//!   `n+1`-th next) call at a point fails, for deterministic tests.
//!
//! [`FaultyBackend::injected`] counts what was injected.
//!
//! A failure inside a `Drop` cannot be returned, so it is injected differently:
//! [`FaultyBackend::fail_next_unmap`] makes a later drop of a mapping record an injected
//! unmap failure in the backend's [`DeferredErrors`] (after really unmapping), which is how
//! a real failed `cuMemUnmap` or `munmap` surfaces.
//!
//! [`Hog`] takes device memory the way a trainer does, to put the pager under memory
//! pressure.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub mod c_build;
pub mod driver_stub;
mod hog;
pub mod spool;
pub use hog::Hog;

use gpu_pager::backend::{
    Backend, BackendError, BackendResult, DeferredErrors, DeviceRange, Direction, Fence,
    HostBuffer, Mapping, Mover, RawCopy, RawStream, Reservation,
};

/// A call that can be made to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultPoint {
    /// [`Backend::map`] (resume, region creation).
    Map,
    /// [`Backend::copy_to_device`] (writes), and each host→device unit of
    /// [`Backend::copy_unit`] and [`Backend::copy_on`] (restores).
    CopyToDevice,
    /// [`Backend::copy_to_host`] (reads), and each device→host unit of
    /// [`Backend::copy_unit`] and [`Backend::copy_on`] (backups).
    CopyToHost,
    /// [`Backend::alloc_pinned`] (the first release of a `Preserve` region, also through
    /// [`Backend::alloc_pinned_from_device`], whose default this wrapper keeps: a pinning
    /// fault there, or a [`FaultPoint::CopyToHost`] fault in its copy), and each buffer of
    /// [`Backend::alloc_pinned_many`] and [`Backend::alloc_pinned_many_from_device`].
    AllocPinned,
}

impl FaultPoint {
    /// Every point, in index order.
    pub const ALL: [FaultPoint; 4] = [
        FaultPoint::Map,
        FaultPoint::CopyToDevice,
        FaultPoint::CopyToHost,
        FaultPoint::AllocPinned,
    ];

    fn index(self) -> usize {
        match self {
            FaultPoint::Map => 0,
            FaultPoint::CopyToDevice => 1,
            FaultPoint::CopyToHost => 2,
            FaultPoint::AllocPinned => 3,
        }
    }
}

/// Which calls fail at random, and how often (per mille: 0 never, 1000 always).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Seed of the decisions.
    pub seed: u64,
    /// Probability that a copy (either direction, sync or async) fails, per mille.
    pub copy_per_mille: u32,
    /// Probability that a `map` fails, per mille.
    pub map_per_mille: u32,
    /// Probability that an `alloc_pinned` fails, per mille.
    pub pin_per_mille: u32,
}

impl FaultPlan {
    /// A plan that injects nothing (use [`FaultyBackend::fail_next`] alone).
    pub fn none() -> Self {
        FaultPlan::default()
    }

    fn per_mille(&self, point: FaultPoint) -> u32 {
        match point {
            FaultPoint::Map => self.map_per_mille,
            FaultPoint::CopyToDevice | FaultPoint::CopyToHost => self.copy_per_mille,
            FaultPoint::AllocPinned => self.pin_per_mille,
        }
    }

    /// Whether the `n`-th call (from 0) at `point` fails under this plan.
    pub fn fails(&self, point: FaultPoint, n: u64) -> bool {
        let p = self.per_mille(point);
        if p == 0 {
            return false;
        }
        let salt = (point.index() as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
        splitmix64(self.seed ^ salt ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)) % 1000 < u64::from(p)
    }
}

/// Faults injected so far, per point.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Failed `map` calls.
    pub map: u64,
    /// Failed host→device copies.
    pub copy_to_device: u64,
    /// Failed device→host copies.
    pub copy_to_host: u64,
    /// Failed pinned allocations.
    pub alloc_pinned: u64,
}

impl FaultCounts {
    /// All faults.
    pub fn total(&self) -> u64 {
        self.map + self.copy_to_device + self.copy_to_host + self.alloc_pinned
    }
}

impl fmt::Display for FaultCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "map {}, copy to device {}, copy to host {}, pin {}",
            self.map, self.copy_to_device, self.copy_to_host, self.alloc_pinned
        )
    }
}

/// A call that can be made to wait ([`FaultyBackend::hold_next`]), to test that one slow
/// call does not stall the calls on other tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HoldPoint {
    /// [`Backend::map`] (region creation, resume).
    Map,
    /// [`Backend::synchronize`] (release, remove, trim).
    Synchronize,
    /// [`Backend::copy_unit`] (a release's or resume's pumped copy), before the copy.
    CopyUnit,
}

/// A call held by [`FaultyBackend::hold_next`]: it waits inside the backend until
/// [`Hold::open`] (or the hold is dropped).
#[derive(Debug)]
pub struct Hold {
    state: HoldCell,
}

/// A hold's state and the condition its waiters wait on.
type HoldCell = Arc<(Mutex<HoldState>, std::sync::Condvar)>;

#[derive(Debug, Default)]
struct HoldState {
    /// A call is waiting in the hold.
    entered: bool,
    /// The call may go on.
    open: bool,
}

impl Hold {
    /// Blocks until a call has entered the hold; false if none did within `timeout`.
    pub fn wait_entered(&self, timeout: std::time::Duration) -> bool {
        let (m, cv) = &*self.state;
        let guard = m.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = cv
            .wait_timeout_while(guard, timeout, |s| !s.entered)
            .unwrap_or_else(|p| p.into_inner());
        guard.entered
    }

    /// Lets the held call go on.
    pub fn open(&self) {
        let (m, cv) = &*self.state;
        m.lock().unwrap_or_else(|p| p.into_inner()).open = true;
        cv.notify_all();
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.open();
    }
}

/// Delegates to another backend, injecting faults; see the module docs.
pub struct FaultyBackend {
    /// Holds armed per [`HoldPoint`] (map, synchronize), taken by the next such call.
    holds: [Mutex<Option<HoldCell>>; 3],
    inner: Arc<dyn Backend>,
    plan: FaultPlan,
    enabled: AtomicBool,
    /// Calls seen per point (drives the plan).
    calls: [AtomicU64; 4],
    /// Armed one-shot faults per point: for each, how many calls still pass before it fires
    /// ([`FaultyBackend::fail_after`]).
    armed: [Mutex<Vec<u64>>; 4],
    /// Faults injected per point.
    injected: [AtomicU64; 4],
    /// Unmap failures still to inject, shared with the mappings handed out.
    unmap_faults: Arc<UnmapFaults>,
    /// `alloc_pinned_many` and `alloc_pinned_many_from_device` calls seen, failed or not.
    pin_batches: AtomicU64,
}

/// Armed and injected unmap failures ([`FaultyBackend::fail_next_unmap`]).
#[derive(Debug, Default)]
struct UnmapFaults {
    armed: AtomicU64,
    injected: AtomicU64,
}

/// A mapping of the wrapped backend that may report an injected unmap failure when dropped.
#[derive(Debug)]
struct FaultyMapping {
    inner: Box<dyn Mapping>,
    faults: Arc<UnmapFaults>,
    errors: Arc<DeferredErrors>,
}

impl Mapping for FaultyMapping {
    fn ptr(&self) -> u64 {
        self.inner.ptr()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn unmapped(&mut self) {
        self.inner.unmapped();
    }
}

impl Drop for FaultyMapping {
    /// Records an injected failure if one is armed; the wrapped mapping, dropped right
    /// after, still unmaps for real.
    fn drop(&mut self) {
        let armed = self
            .faults
            .armed
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if armed {
            self.faults.injected.fetch_add(1, Ordering::SeqCst);
            self.errors.record(format!(
                "unmapping {} bytes at {:#x} failed: {}",
                self.inner.len(),
                self.inner.ptr(),
                BackendError::Injected { op: "unmap" }
            ));
        }
    }
}

impl fmt::Debug for FaultyBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyBackend")
            .field("inner", &self.inner)
            .field("plan", &self.plan)
            .field("enabled", &self.enabled.load(Ordering::Relaxed))
            .field("injected", &self.injected())
            .finish()
    }
}

impl FaultyBackend {
    /// Wraps `inner`; the plan is active from the start (see [`FaultyBackend::set_enabled`]).
    pub fn new(inner: Arc<dyn Backend>, plan: FaultPlan) -> Self {
        FaultyBackend {
            inner,
            plan,
            enabled: AtomicBool::new(true),
            calls: Default::default(),
            armed: Default::default(),
            injected: Default::default(),
            unmap_faults: Default::default(),
            pin_batches: AtomicU64::new(0),
            holds: Default::default(),
        }
    }

    /// Makes the next call at `point` (from any thread) wait inside the backend until the
    /// returned [`Hold`] is opened or dropped.
    pub fn hold_next(&self, point: HoldPoint) -> Hold {
        let state = Arc::new((Mutex::new(HoldState::default()), std::sync::Condvar::new()));
        *self.holds[point as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(state.clone());
        Hold { state }
    }

    /// Waits in an armed hold at `point`, if one is armed (and disarms it).
    fn held(&self, point: HoldPoint) {
        let armed = self.holds[point as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(state) = armed {
            let (m, cv) = &*state;
            let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
            s.entered = true;
            cv.notify_all();
            while !s.open {
                s = cv.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        }
    }

    /// [`Backend::alloc_pinned_many`] and [`Backend::alloc_pinned_many_from_device`] calls
    /// seen so far, failed or not (a growing region's first release makes one).
    pub fn pin_batches(&self) -> u64 {
        self.pin_batches.load(Ordering::SeqCst)
    }

    /// Calls seen so far at `point`, failed or not (e.g. [`FaultPoint::Map`]: `map` calls).
    pub fn calls(&self, point: FaultPoint) -> u64 {
        self.calls[point.index()].load(Ordering::SeqCst)
    }

    /// Makes the next drop of a mapping handed out by this backend record an injected
    /// unmap failure in [`Backend::deferred_errors`] (the memory is still unmapped).
    /// Calling it `n` times arms `n` failures.
    pub fn fail_next_unmap(&self) {
        self.unmap_faults.armed.fetch_add(1, Ordering::SeqCst);
    }

    /// Unmap failures injected so far ([`FaultyBackend::fail_next_unmap`]).
    pub fn injected_unmaps(&self) -> u64 {
        self.unmap_faults.injected.load(Ordering::SeqCst)
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    /// The plan.
    pub fn plan(&self) -> FaultPlan {
        self.plan
    }

    /// Turns the random plan on or off (armed [`FaultyBackend::fail_next`] faults still
    /// fire). Calls made while it is off do not advance the plan.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::SeqCst);
    }

    /// Whether the random plan is on.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::SeqCst)
    }

    /// Makes the next call at `point` fail (calling it `n` times arms `n` faults).
    pub fn fail_next(&self, point: FaultPoint) {
        self.fail_after(point, 0);
    }

    /// Lets `pass` calls at `point` through, then makes the next one fail (once). Calls from
    /// every thread count.
    pub fn fail_after(&self, point: FaultPoint, pass: u64) {
        self.armed(point).push(pass);
    }

    fn armed(&self, point: FaultPoint) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.armed[point.index()]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Faults injected so far.
    pub fn injected(&self) -> FaultCounts {
        let n = |p: FaultPoint| self.injected[p.index()].load(Ordering::SeqCst);
        FaultCounts {
            map: n(FaultPoint::Map),
            copy_to_device: n(FaultPoint::CopyToDevice),
            copy_to_host: n(FaultPoint::CopyToHost),
            alloc_pinned: n(FaultPoint::AllocPinned),
        }
    }

    /// Decides whether this call at `point` fails; `Err` (to return as is) when it does.
    fn check(&self, point: FaultPoint, op: &'static str) -> BackendResult<()> {
        let i = point.index();
        let armed = {
            let mut countdowns = self.armed(point);
            let due = countdowns.iter().position(|&n| n == 0);
            match due {
                Some(k) => {
                    countdowns.swap_remove(k);
                }
                None => countdowns.iter_mut().for_each(|n| *n -= 1),
            }
            due.is_some()
        };
        let planned = !armed && self.enabled() && {
            let n = self.calls[i].fetch_add(1, Ordering::SeqCst);
            self.plan.fails(point, n)
        };
        if armed || planned {
            self.injected[i].fetch_add(1, Ordering::SeqCst);
            return Err(BackendError::Injected { op });
        }
        Ok(())
    }
}

/// The fault point of a pumped copy unit: by its direction.
fn copy_point(copy: &RawCopy) -> FaultPoint {
    match copy.direction {
        Direction::ToDevice => FaultPoint::CopyToDevice,
        Direction::ToHost => FaultPoint::CopyToHost,
    }
}

/// splitmix64's output function: a well-mixed 64-bit hash of `x`.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Backend for FaultyBackend {
    // No fault is injected into these; the KV kernels are the wrapped backend's.
    gpu_pager::forward_backend!(inner:
        info, deferred_errors, set_reclaim_scrubbed, mem_info, processes, reserve, unmap_runs,
        fence, fill, chunk_hash, kv_kernels);

    /// Pins, then copies, through this wrapper's own (faulty) `alloc_pinned` and
    /// `copy_to_host`.
    ///
    /// # Safety
    /// As [`Backend::alloc_pinned_from_device`].
    unsafe fn alloc_pinned_from_device(
        &self,
        bytes: usize,
        src: u64,
    ) -> BackendResult<Box<dyn HostBuffer>> {
        // SAFETY: the caller's contract, passed on.
        unsafe { gpu_pager::backend::pin_then_copy(self, bytes, src) }
    }

    /// # Safety
    /// As [`Backend::map`]. An injected fault returns before anything is mapped.
    unsafe fn map(
        &self,
        reservation: &Arc<dyn Reservation>,
        offset: usize,
        chunk_sizes: &[usize],
    ) -> BackendResult<Vec<Box<dyn Mapping>>> {
        self.held(HoldPoint::Map);
        self.check(FaultPoint::Map, "map")?;
        // SAFETY: the caller upholds `map`'s contract, which is the wrapped backend's (its
        // reservations are the wrapped backend's).
        let mapped = unsafe { self.inner.map(reservation, offset, chunk_sizes) }?;
        let errors = self.inner.deferred_errors();
        Ok(mapped
            .into_iter()
            .map(|inner| {
                Box::new(FaultyMapping {
                    inner,
                    faults: self.unmap_faults.clone(),
                    errors: errors.clone(),
                }) as Box<dyn Mapping>
            })
            .collect())
    }

    fn synchronize(&self) -> BackendResult<()> {
        self.held(HoldPoint::Synchronize);
        self.inner.synchronize()
    }

    fn alloc_pinned(&self, bytes: usize) -> BackendResult<Box<dyn HostBuffer>> {
        self.check(FaultPoint::AllocPinned, "alloc_pinned")?;
        self.inner.alloc_pinned(bytes)
    }

    /// One [`FaultPoint::AllocPinned`] decision per buffer, as many `alloc_pinned` calls
    /// would meet, stopping at the first fault (the batch then fails whole, nothing pinned);
    /// otherwise the wrapped backend's batch.
    fn alloc_pinned_many(&self, sizes: &[usize]) -> BackendResult<Vec<Box<dyn HostBuffer>>> {
        self.pin_batches.fetch_add(1, Ordering::SeqCst);
        for _ in sizes {
            self.check(FaultPoint::AllocPinned, "alloc_pinned_many")?;
        }
        self.inner.alloc_pinned_many(sizes)
    }

    /// One [`FaultPoint::AllocPinned`] decision per buffer, then one
    /// [`FaultPoint::CopyToHost`] decision per buffer (the pinning and the copy that the
    /// default's calls would meet), stopping at the first fault (the batch then fails whole,
    /// nothing pinned or copied); otherwise the wrapped backend's call (its own overlapped
    /// path). Counted in [`FaultyBackend::pin_batches`].
    ///
    /// # Safety
    /// As [`Backend::alloc_pinned_many_from_device`].
    unsafe fn alloc_pinned_many_from_device(
        &self,
        ranges: &[DeviceRange],
    ) -> BackendResult<Vec<Box<dyn HostBuffer>>> {
        self.pin_batches.fetch_add(1, Ordering::SeqCst);
        for _ in ranges {
            self.check(FaultPoint::AllocPinned, "alloc_pinned_many_from_device")?;
        }
        for _ in ranges {
            self.check(FaultPoint::CopyToHost, "alloc_pinned_many_from_device")?;
        }
        // SAFETY: the caller upholds the contract, the wrapped backend's.
        unsafe { self.inner.alloc_pinned_many_from_device(ranges) }
    }

    /// # Safety
    /// As [`Backend::copy_to_device`]. An injected fault returns before the copy starts.
    unsafe fn copy_to_device(&self, dst: u64, src: &[u8]) -> BackendResult<()> {
        self.check(FaultPoint::CopyToDevice, "copy_to_device")?;
        // SAFETY: the caller upholds `copy_to_device`'s contract, the wrapped backend's.
        unsafe { self.inner.copy_to_device(dst, src) }
    }

    /// # Safety
    /// As [`Backend::copy_to_host`]. An injected fault returns before the copy starts.
    unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64) -> BackendResult<()> {
        self.check(FaultPoint::CopyToHost, "copy_to_host")?;
        // SAFETY: the caller upholds `copy_to_host`'s contract, the wrapped backend's.
        unsafe { self.inner.copy_to_host(dst, src) }
    }

    /// # Safety
    /// As [`Backend::copy_unit`]. An injected fault returns before anything is enqueued.
    unsafe fn copy_unit(&self, copy: &RawCopy, mover: Mover) -> BackendResult<Box<dyn Fence>> {
        self.held(HoldPoint::CopyUnit);
        self.check(copy_point(copy), "copy_unit")?;
        // SAFETY: the caller upholds `copy_unit`'s contract (lifetimes until the fence passes
        // included), the wrapped backend's.
        unsafe { self.inner.copy_unit(copy, mover) }
    }

    /// # Safety
    /// As [`Backend::copy_on`]. An injected fault returns before anything is enqueued.
    unsafe fn copy_on(&self, copy: &RawCopy, mover: Mover, stream: RawStream) -> BackendResult<()> {
        self.check(copy_point(copy), "copy_on")?;
        // SAFETY: the caller upholds `copy_on`'s contract, the wrapped backend's.
        unsafe { self.inner.copy_on(copy, mover, stream) }
    }
}
