//! The pump's scheduling on scripted movers, and its copies on the host backend.

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
            let stats = restore(&script, config(CopyRoute::Fastest), buf.as_ref(), piece).unwrap();
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
        let err = restore(&script, config(CopyRoute::Engine), buf.as_ref(), 4 * MIB).unwrap_err();
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
        let stats = restore(&script, config(CopyRoute::Fastest), buf.as_ref(), 16 * MIB).unwrap();
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

#[test]
fn pushes_done_counts_the_pushes_whose_units_all_finished_and_drain_waits_for_all() {
    // Ten pushes of 3 MiB (three 1 MiB units each) on the copy engine, two units in flight:
    // a push counts as done only once its last unit finished, in push order.
    let script = Script::costing([10, 10]);
    let buf = buffer(30 * MIB);
    let all = Pinned::new(buf.as_ref());
    let mut seen: Vec<(u64, usize)> = Vec::new();
    run(
        &script,
        config(CopyRoute::Engine),
        &script.traffic,
        |p| {
            for k in 0..10 {
                assert_eq!(p.pushes(), k);
                let src = all
                    .get(k as usize * 3 * MIB..(k as usize + 1) * 3 * MIB)
                    .unwrap();
                // SAFETY: the scripted movers touch no memory.
                unsafe { p.push_to_device(src, 0x1000_0000 + k * 3 * MIB as u64) }?;
                assert!(p.pushes_done() <= p.pushes());
            }
            assert_eq!(
                p.pushes_done(),
                0,
                "two units started: none of the pushes is done"
            );
            p.drain(|done| {
                let c = script.state.lock().unwrap();
                let finished = c.starts.len() - c.in_flight[0];
                drop(c);
                seen.push((done, finished));
                false
            })?;
            assert_eq!(p.pushes_done(), 10);
            Ok::<(), BackendError>(())
        },
        |e| e,
    )
    .unwrap();
    let c = script.state.lock().unwrap();
    assert_eq!(c.in_flight, [0, 0], "drain waited for every unit");
    assert!(
        seen.windows(2).all(|w| w[0].0 <= w[1].0),
        "it never goes back"
    );
    for &(done, finished) in &seen {
        // Units finish in order on one mover: `done` pushes need 3 × done units finished.
        assert!(
            3 * done as usize <= finished,
            "{done} pushes done with {finished} units finished"
        );
        assert!(
            finished < 3 * (done as usize + 1),
            "{done} pushes done with {finished} units finished"
        );
    }
    assert_eq!(seen.last().map(|s| s.0), Some(10));
}

#[test]
fn a_push_that_failed_or_was_dropped_never_counts_as_done() {
    // One 1 MiB unit per push, each done as soon as it is polled; the third unit (the third
    // push) fails to start once the first two are done: the third push and every later one
    // stay not done, though nothing is queued or in flight any more.
    let script = Script {
        cost: [1, 1],
        fail_start: Some(2),
        ..Script::default()
    };
    let buf = buffer(10 * MIB);
    let all = Pinned::new(buf.as_ref());
    let err = run(
        &script,
        config(CopyRoute::Engine),
        &script.traffic,
        |p| {
            for k in 0..10u64 {
                let src = all.get(k as usize * MIB..(k as usize + 1) * MIB).unwrap();
                // SAFETY: the scripted movers touch no memory.
                let pushed = unsafe { p.push_to_device(src, 0x1000_0000 + k * MIB as u64) };
                if pushed.is_err() {
                    assert!(p.pushes_done() <= 2, "{}", p.pushes_done());
                    return pushed;
                }
            }
            let drained = p.drain(|done| {
                assert!(done <= 2, "{done}");
                false
            });
            assert!(p.pushes_done() <= 2, "{}", p.pushes_done());
            drained
        },
        |e| e,
    )
    .unwrap_err();
    assert!(
        matches!(err, BackendError::Injected { op: "start" }),
        "{err}"
    );
}
