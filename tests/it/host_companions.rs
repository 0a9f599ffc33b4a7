//! Companions: work that moves with a tag, run by release (before unmap) and resume (after
//! map), undone with the move when one fails. On the host backend.

use std::sync::{Arc, Mutex};

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Companion, CompanionError, ErrorCode, Pager, Policy, State};

const MIB: usize = 1 << 20;

fn pager() -> Pager {
    Pager::new(Arc::new(HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: 64 << 10,
    })))
}

/// Records its calls in a shared log, and fails (or panics) on request.
struct Recorder {
    name: &'static str,
    log: Arc<Mutex<Vec<String>>>,
    fail_release: Mutex<bool>,
    fail_resume: Mutex<bool>,
    panic: bool,
}

impl Recorder {
    fn new(name: &'static str, log: &Arc<Mutex<Vec<String>>>) -> Arc<Recorder> {
        Arc::new(Recorder {
            name,
            log: log.clone(),
            fail_release: Mutex::new(false),
            fail_resume: Mutex::new(false),
            panic: false,
        })
    }

    fn step(&self, what: &str, tag: &str, fail: &Mutex<bool>) -> Result<(), CompanionError> {
        if self.panic {
            panic!("{} cannot go on", self.name);
        }
        if *fail.lock().unwrap() {
            return Err(format!("{} refused {tag}", self.name).into());
        }
        self.log
            .lock()
            .unwrap()
            .push(format!("{} {what} {tag}", self.name));
        Ok(())
    }
}

impl Companion for Recorder {
    fn name(&self) -> &str {
        self.name
    }
    fn before_release(&self, tag: &str) -> Result<(), CompanionError> {
        self.step("release", tag, &self.fail_release)
    }
    fn after_resume(&self, tag: &str) -> Result<(), CompanionError> {
        self.step("resume", tag, &self.fail_resume)
    }
}

fn taken(log: &Mutex<Vec<String>>) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

#[test]
fn companions_run_with_the_tags_that_move_in_nested_order() {
    let p = pager();
    p.region("kv", 4 * MIB, Policy::Discard).unwrap();
    p.region("w", 4 * MIB, Policy::Preserve).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let a = p.add_companion("kv", Recorder::new("a", &log)).unwrap();
    p.add_companion("kv", Recorder::new("b", &log)).unwrap();
    p.add_companion("w", Recorder::new("c", &log)).unwrap();
    p.add_companion("not-yet", Recorder::new("d", &log))
        .unwrap();

    p.release(&["kv", "w"]).unwrap();
    assert_eq!(taken(&log), ["b release kv", "a release kv", "c release w"]);
    // Released already: nothing moves, no companion runs.
    p.release(&["kv"]).unwrap();
    assert!(taken(&log).is_empty());
    p.resume(&["w"]).unwrap();
    assert_eq!(taken(&log), ["c resume w"]);
    p.resume(&["kv", "w"]).unwrap();
    assert_eq!(taken(&log), ["a resume kv", "b resume kv"]);

    p.remove_companion(a).unwrap();
    p.release(&["kv"]).unwrap();
    assert_eq!(taken(&log), ["b release kv"]);
    let e = p.remove_companion(a).unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    assert!(e.to_string().contains("not registered"), "{e}");
}

#[test]
fn a_failing_companion_undoes_the_release() {
    let p = pager();
    p.region("w", 4 * MIB, Policy::Preserve).unwrap();
    let buf = p.alloc("w", MIB).unwrap();
    p.write(&buf, 0, &[5u8; MIB]).unwrap();
    let base = p.ptr(&buf).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    p.add_companion("w", Recorder::new("first", &log)).unwrap();
    let failing = Recorder::new("transport", &log);
    *failing.fail_release.lock().unwrap() = true;
    let id = p.add_companion("w", failing.clone()).unwrap();
    p.add_companion("w", Recorder::new("last", &log)).unwrap();

    let e = p.release(&["w"]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Companion);
    assert_eq!(e.tag(), Some("w"));
    let msg = e.to_string();
    assert!(
        msg.contains("`transport`")
            && msg.contains("transport refused w")
            && msg.contains("undone"),
        "{msg}"
    );
    // "last" ran first (reverse order) and was undone; "first" never ran.
    assert_eq!(taken(&log), ["last release w", "last resume w"]);
    assert_eq!(p.info("w").unwrap().state, State::Resident);
    let mut back = vec![0u8; MIB];
    p.read(&buf, 0, &mut back).unwrap();
    assert_eq!(back, vec![5u8; MIB]);

    // Once the companion is fixed, the same release goes through.
    *failing.fail_release.lock().unwrap() = false;
    p.release(&["w"]).unwrap();
    assert_eq!(p.info("w").unwrap().state, State::Released);
    p.remove_companion(id).unwrap();
    p.resume(&["w"]).unwrap();
    assert_eq!(p.ptr(&buf).unwrap(), base);
    p.read(&buf, 0, &mut back).unwrap();
    assert_eq!(back, vec![5u8; MIB]);
}

#[test]
fn a_failing_companion_undoes_the_resume_and_a_later_resume_succeeds() {
    let p = pager();
    p.region("w", 4 * MIB, Policy::Preserve).unwrap();
    p.region("kv", 4 * MIB, Policy::Discard).unwrap();
    let buf = p.alloc("w", MIB).unwrap();
    p.write(&buf, 0, &[9u8; MIB]).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    p.add_companion("kv", Recorder::new("kv-side", &log))
        .unwrap();
    let failing = Recorder::new("weights-side", &log);
    p.add_companion("w", failing.clone()).unwrap();
    p.release(&["kv", "w"]).unwrap();
    taken(&log);

    *failing.fail_resume.lock().unwrap() = true;
    let e = p.resume(&["kv", "w"]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Companion);
    assert!(e.to_string().contains("during the resume"), "{e}");
    // kv's companion ran, then was undone when w's failed; both regions stay released.
    assert_eq!(taken(&log), ["kv-side resume kv", "kv-side release kv"]);
    for tag in ["kv", "w"] {
        assert_eq!(p.info(tag).unwrap().state, State::Released, "{tag}");
    }
    assert_eq!(p.stats().resident_bytes(), 0);

    *failing.fail_resume.lock().unwrap() = false;
    p.resume(&["kv", "w"]).unwrap();
    let mut back = vec![0u8; MIB];
    p.read(&buf, 0, &mut back).unwrap();
    assert_eq!(
        back,
        vec![9u8; MIB],
        "the backup survived the undone resume"
    );
}

#[test]
fn a_panicking_companion_is_a_companion_error() {
    let p = pager();
    p.region("kv", 4 * MIB, Policy::Discard).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    p.add_companion(
        "kv",
        Arc::new(Recorder {
            panic: true,
            ..Arc::into_inner(Recorder::new("loud", &log)).unwrap()
        }),
    )
    .unwrap();
    let e = p.release(&["kv"]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Companion);
    assert!(e.to_string().contains("panicked: loud cannot go on"), "{e}");
    assert_eq!(p.info("kv").unwrap().state, State::Resident);
}

/// The second user: the caller's own memory outside the pager (here a host vector standing
/// in for a buffer of another allocator), given back at each release and brought back, with
/// its contents, at each resume.
struct SideBuffer {
    live: Mutex<Option<Vec<u8>>>,
    kept: Mutex<Option<Box<[u8]>>>,
}

impl Companion for SideBuffer {
    fn name(&self) -> &str {
        "side buffer"
    }
    fn before_release(&self, _tag: &str) -> Result<(), CompanionError> {
        let live = self.live.lock().unwrap().take().ok_or("no live buffer")?;
        *self.kept.lock().unwrap() = Some(live.into_boxed_slice());
        Ok(())
    }
    fn after_resume(&self, _tag: &str) -> Result<(), CompanionError> {
        let kept = self.kept.lock().unwrap().take().ok_or("nothing kept")?;
        *self.live.lock().unwrap() = Some(kept.into_vec());
        Ok(())
    }
}

#[test]
fn a_companion_moves_a_buffer_outside_the_pager_with_the_tag() {
    let p = pager();
    p.region("kv", 4 * MIB, Policy::Discard).unwrap();
    let data: Vec<u8> = (0..3 * MIB).map(|i| (i * 7 + 1) as u8).collect();
    let side = Arc::new(SideBuffer {
        live: Mutex::new(Some(data.clone())),
        kept: Mutex::new(None),
    });
    p.add_companion("kv", side.clone()).unwrap();
    for _ in 0..3 {
        p.release(&["kv"]).unwrap();
        assert!(side.live.lock().unwrap().is_none(), "dropped with the tag");
        p.resume(&["kv"]).unwrap();
        assert_eq!(side.live.lock().unwrap().as_deref(), Some(&data[..]));
    }
}

/// Runs `f` on a thread; panics if it has not returned within 20 s (a hang).
fn within_20_s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// What a transport's companion looks at: its own region's info, pointer, contents,
/// statistics and audit, and the buffer at an address (each hung, since the thread holds
/// the region); and what it may not do: move its own tag, or add a companion (both fail
/// at once, in words).
struct LooksAtItself {
    pager: std::sync::Weak<Pager>,
    buf: Mutex<Option<gpu_pager::Buffer>>,
    seen: Mutex<Vec<String>>,
}

impl LooksAtItself {
    fn look(&self, phase: &str, tag: &str) -> Result<(), CompanionError> {
        let p = self.pager.upgrade().ok_or("no pager")?;
        let buf = self.buf.lock().unwrap().clone().ok_or("no buffer")?;
        let info = p.info(tag)?;
        let ptr = p.ptr(&buf)?;
        let mut bytes = [0u8; 4];
        p.read(&buf, 0, &mut bytes)?;
        let stats = p.region_stats(tag)?;
        let all = p.stats();
        let audit = p.audit()?;
        let (found, at) = p.buffer_containing(ptr + 1).ok_or("no buffer there")?;
        let own = p
            .release(&[tag])
            .expect_err("a companion released its own tag");
        let add = p
            .add_companion(
                tag,
                Recorder::new("late", &Arc::new(Mutex::new(Vec::new()))),
            )
            .expect_err("a companion added a companion");
        self.seen.lock().unwrap().push(format!(
            "{phase} {} {} {bytes:?} {} {} {} {} {} {:?} {:?}",
            info.tag,
            ptr == p.address(&buf)?,
            stats.allocated_bytes,
            all.regions.len(),
            audit.regions.len(),
            found == buf,
            at,
            own.code(),
            add.code(),
        ));
        Ok(())
    }
}

impl Companion for LooksAtItself {
    fn name(&self) -> &str {
        "looks at itself"
    }
    fn before_release(&self, tag: &str) -> Result<(), CompanionError> {
        self.look("release", tag)
    }
    fn after_resume(&self, tag: &str) -> Result<(), CompanionError> {
        self.look("resume", tag)
    }
}

#[test]
fn a_companion_looks_at_its_own_region_without_hanging() {
    let p = Arc::new(pager());
    p.region("self", 4 * MIB, Policy::Preserve).unwrap();
    p.region("other", 4 * MIB, Policy::Discard).unwrap();
    let buf = p.alloc("self", 4096).unwrap();
    p.write(&buf, 0, &[1, 2, 3, 4]).unwrap();
    let c = Arc::new(LooksAtItself {
        pager: Arc::downgrade(&p),
        buf: Mutex::new(Some(buf)),
        seen: Mutex::new(Vec::new()),
    });
    p.add_companion("self", c.clone()).unwrap();
    let q = p.clone();
    within_20_s("a release whose companion looks at its region", move || {
        q.release(&["self", "other"]).unwrap();
        q.resume(&["self"]).unwrap();
    });
    assert_eq!(
        *c.seen.lock().unwrap(),
        [
            "release self true [1, 2, 3, 4] 4096 2 2 true 1 InvalidArgument InvalidArgument",
            "resume self true [1, 2, 3, 4] 4096 2 2 true 1 InvalidArgument InvalidArgument",
        ]
    );
    assert_eq!(p.info("self").unwrap().state, State::Resident);
}

/// A companion that moves another tag, while another thread adds companions: the list is
/// not held across the calls, so neither waits for the other.
#[test]
fn a_nested_move_and_a_concurrent_add_companion_do_not_deadlock() {
    struct MovesOther(std::sync::Weak<Pager>);
    impl Companion for MovesOther {
        fn name(&self) -> &str {
            "moves other"
        }
        fn before_release(&self, _: &str) -> Result<(), CompanionError> {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let p = self.0.upgrade().ok_or("no pager")?;
            p.release(&["nested-other"])?;
            Ok(())
        }
        fn after_resume(&self, _: &str) -> Result<(), CompanionError> {
            let p = self.0.upgrade().ok_or("no pager")?;
            p.resume(&["nested-other"])?;
            Ok(())
        }
    }
    let p = Arc::new(pager());
    p.region("nested-main", 4 * MIB, Policy::Discard).unwrap();
    p.region("nested-other", 4 * MIB, Policy::Discard).unwrap();
    p.add_companion("nested-main", Arc::new(MovesOther(Arc::downgrade(&p))))
        .unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let adder = {
        let (p, log) = (p.clone(), log.clone());
        std::thread::spawn(move || {
            for _ in 0..50 {
                let id = p
                    .add_companion("nested-x", Recorder::new("x", &log))
                    .unwrap();
                p.remove_companion(id).unwrap();
            }
        })
    };
    let q = p.clone();
    within_20_s("a nested move beside add_companion", move || {
        for _ in 0..5 {
            q.release(&["nested-main"]).unwrap();
            q.resume(&["nested-main"]).unwrap();
        }
    });
    adder.join().unwrap();
    assert_eq!(p.info("nested-other").unwrap().state, State::Resident);
}
