//! Collecting the driver's scrubbed memory while nobody waits for it.
//!
//! The CUDA driver zeroes device memory after it is freed (its scrubber, on a copy engine),
//! and the scrubbed pages go back to its allocator only when the next allocation on the
//! device collects them. That allocation pays the bookkeeping of every page scrubbed since:
//! on an H100 with driver 580, 15–25 ms after a 64 GiB KV pause, most of a KV resume (the
//! first `cuMemCreate` of it) or of a trainer's first allocation after the pause.
//!
//! A [`Reclaimer`] runs an action (the CUDA backend's: create and release one
//! minimum-granularity chunk) on a helper thread at [`Schedule::first`], twice that, four
//! times that, … after the latest free, once at least [`Schedule::threshold_bytes`] have
//! been freed: each run collects what the scrubber finished since the last one, so that the
//! next real allocation finds nothing left to collect. Frees during a schedule start it
//! over; below the threshold nothing runs, and the next allocation pays a little.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// When a [`Reclaimer`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// Delay of the first run after the latest free; each later run doubles it.
    pub first: Duration,
    /// Runs per schedule.
    pub runs: u32,
    /// Bytes freed since the last schedule ended that start a new one.
    pub threshold_bytes: usize,
}

impl Schedule {
    /// 25 ms to 1.6 s after the latest free, 7 runs: the scrubber clears 64 GiB in about
    /// 0.1–0.25 s on an H100, and the schedule covers a device a few times larger or
    /// slower. Frees under 1 GiB leave the next allocation well under a millisecond to pay.
    pub const DEFAULT: Schedule = Schedule {
        first: Duration::from_millis(25),
        runs: 7,
        threshold_bytes: 1 << 30,
    };

    /// The delay of run `step` (0-based) after the latest free.
    fn delay(&self, step: u32) -> Duration {
        self.first
            .saturating_mul(1u32.checked_shl(step).unwrap_or(u32::MAX))
    }
}

/// What the helper thread runs; `false` means the owner is gone and the thread ends.
pub type Action = Box<dyn FnMut() -> bool + Send>;

#[derive(Debug)]
struct State {
    enabled: bool,
    /// The owner dropped: the thread ends.
    stop: bool,
    spawned: bool,
    /// Bytes freed since the last schedule ended.
    pending: usize,
    /// A schedule is under way.
    armed: bool,
    last_free: Instant,
    /// The next run of the schedule (0-based).
    step: u32,
    /// Counts frees, so that a run can tell that one came while it ran.
    frees: u64,
    /// Runs so far.
    done: u64,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere while it was held; the state stays
        // consistent (every update is a few plain stores).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs an action on a helper thread after large frees, as the module docs say. The thread
/// starts with the first schedule and ends when the reclaimer is dropped (it is not joined:
/// the owner may be dropped on that very thread).
#[derive(Debug)]
pub struct Reclaimer {
    schedule: Schedule,
    shared: Arc<Shared>,
}

impl Reclaimer {
    /// A reclaimer that runs on `schedule` once enabled ([`Reclaimer::set_enabled`]).
    pub fn new(schedule: Schedule, enabled: bool) -> Self {
        Reclaimer {
            schedule,
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    enabled,
                    stop: false,
                    spawned: false,
                    pending: 0,
                    armed: false,
                    last_free: Instant::now(),
                    step: 0,
                    frees: 0,
                    done: 0,
                }),
                wake: Condvar::new(),
            }),
        }
    }

    /// Turns the runs on or off; off also ends a schedule under way.
    pub fn set_enabled(&self, on: bool) {
        let mut st = self.shared.state();
        st.enabled = on;
        if !on {
            st.armed = false;
            st.pending = 0;
        }
    }

    /// How many times the action has run.
    #[cfg(any(test, feature = "testing"))]
    pub fn runs(&self) -> u64 {
        self.shared.state().done
    }

    /// `bytes` were freed just now. `action` makes the thread's action the first time a
    /// schedule starts; if the thread cannot be started, the reclaimer turns itself off.
    pub fn freed(&self, bytes: usize, action: impl FnOnce() -> Action) {
        let mut st = self.shared.state();
        if !st.enabled {
            return;
        }
        st.frees += 1;
        st.last_free = Instant::now();
        st.pending = st.pending.saturating_add(bytes);
        if st.armed {
            // The schedule starts over from its first, shortest delay: wake the thread if
            // it waits for a later run.
            let earlier = st.step > 0;
            st.step = 0;
            if earlier {
                self.shared.wake.notify_one();
            }
            return;
        }
        if st.pending < self.schedule.threshold_bytes {
            return;
        }
        if !st.spawned {
            let shared = self.shared.clone();
            let schedule = self.schedule;
            let action = action();
            let spawned = std::thread::Builder::new()
                .name("gpu-pager-reclaim".to_owned())
                .spawn(move || run(&shared, schedule, action));
            if let Err(e) = spawned {
                log::debug!("no thread to collect scrubbed device memory ahead: {e}");
                st.enabled = false;
                return;
            }
            st.spawned = true;
        }
        st.armed = true;
        st.step = 0;
        self.shared.wake.notify_one();
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        self.shared.state().stop = true;
        self.shared.wake.notify_one();
    }
}

/// The helper thread: waits for each run's time, runs the action without the lock held.
fn run(shared: &Shared, schedule: Schedule, mut action: Action) {
    let mut st = shared.state();
    loop {
        if st.stop {
            return;
        }
        if !st.armed {
            st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            continue;
        }
        let due = st.last_free + schedule.delay(st.step);
        let now = Instant::now();
        if now < due {
            st = shared
                .wake
                .wait_timeout(st, due - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            continue;
        }
        let frees = st.frees;
        drop(st);
        let alive = action();
        st = shared.state();
        st.done += 1;
        if !alive {
            return;
        }
        // A free that came during the run restarted the schedule; otherwise on to the next.
        if st.frees == frees && st.armed {
            st.step += 1;
            if st.step >= schedule.runs {
                st.armed = false;
                st.pending = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    const FAST: Schedule = Schedule {
        first: Duration::from_millis(1),
        runs: 3,
        threshold_bytes: 1 << 20,
    };

    fn counting() -> (Arc<AtomicU64>, impl FnOnce() -> Action) {
        let n = Arc::new(AtomicU64::new(0));
        let m = n.clone();
        let make = move || -> Action {
            Box::new(move || {
                m.fetch_add(1, Ordering::SeqCst);
                true
            })
        };
        (n, make)
    }

    /// A token, and an action that holds a clone of it and answers `alive`: the token's
    /// count tells whether the thread still holds the action.
    fn holding(alive: bool) -> (Arc<()>, impl FnOnce() -> Action) {
        let token = Arc::new(());
        let held = token.clone();
        let make = move || -> Action {
            Box::new(move || {
                let _ = &held;
                alive
            })
        };
        (token, make)
    }

    /// Waits until `f` holds, at most 10 s (a loaded CI machine); false if it never did.
    fn eventually(f: impl Fn() -> bool) -> bool {
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        f()
    }

    #[test]
    fn the_delays_double_and_saturate() {
        let s = Schedule::DEFAULT;
        assert_eq!(s.delay(0), Duration::from_millis(25));
        assert_eq!(s.delay(6), Duration::from_millis(1600));
        assert!(s.delay(40) >= Duration::from_secs(1 << 20));
    }

    #[test]
    fn a_large_free_runs_the_whole_schedule_once() {
        let r = Reclaimer::new(FAST, true);
        let (n, make) = counting();
        r.freed(2 << 20, make);
        assert!(eventually(|| r.runs() == 3), "runs: {}", r.runs());
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            n.load(Ordering::SeqCst),
            3,
            "a schedule runs {} times",
            FAST.runs
        );
        assert_eq!(r.runs(), 3);
    }

    #[test]
    fn small_frees_add_up_to_the_threshold() {
        let r = Reclaimer::new(FAST, true);
        let (n, make) = counting();
        r.freed(512 << 10, || {
            unreachable!("below the threshold no thread starts")
        });
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(r.runs(), 0);
        r.freed(512 << 10, make);
        assert!(eventually(|| n.load(Ordering::SeqCst) == 3));
    }

    #[test]
    fn a_second_schedule_reuses_the_thread() {
        let r = Reclaimer::new(FAST, true);
        let (n, make) = counting();
        r.freed(1 << 20, make);
        assert!(eventually(|| r.runs() == 3));
        r.freed(1 << 20, || unreachable!("the thread is started once"));
        assert!(eventually(|| n.load(Ordering::SeqCst) == 6));
    }

    #[test]
    fn a_free_during_a_schedule_starts_it_over() {
        let r = Reclaimer::new(
            Schedule {
                first: Duration::from_millis(200),
                ..FAST
            },
            true,
        );
        let (n, make) = counting();
        r.freed(1 << 20, make);
        assert!(eventually(|| r.runs() == 1));
        // The next run would come 200 ms from now; the free moves the schedule back to its
        // start, which then runs in full.
        r.freed(4096, || unreachable!("the thread is started once"));
        assert!(eventually(|| n.load(Ordering::SeqCst) == 4));
        std::thread::sleep(Duration::from_millis(1000));
        assert_eq!(r.runs(), 4, "one run, then a whole schedule");
    }

    #[test]
    fn disabled_it_never_runs() {
        let r = Reclaimer::new(FAST, true);
        r.set_enabled(false);
        r.freed(1 << 30, || unreachable!("disabled: no thread"));
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(r.runs(), 0);
    }

    #[test]
    fn dropping_it_ends_the_thread() {
        let r = Reclaimer::new(
            Schedule {
                first: Duration::from_secs(3600),
                ..FAST
            },
            true,
        );
        let (token, make) = holding(true);
        r.freed(1 << 20, make);
        assert_eq!(Arc::strong_count(&token), 2, "the thread holds the action");
        drop(r);
        assert!(
            eventually(|| Arc::strong_count(&token) == 1),
            "the thread ended and dropped its action"
        );
    }

    #[test]
    fn an_action_that_says_its_owner_is_gone_ends_the_thread() {
        let r = Reclaimer::new(FAST, true);
        let (token, make) = holding(false);
        r.freed(1 << 20, make);
        assert!(eventually(|| Arc::strong_count(&token) == 1));
        assert_eq!(r.runs(), 1);
    }
}
