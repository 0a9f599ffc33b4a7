//! A forked child inherits the parent's pager (review item 5): every call in the child must
//! fail with a clear error, as CUDA does, instead of writing into the parent's memory (the
//! host backend's chunks are shared mappings) or hanging on a lock a parent thread held at
//! the fork. Each case runs in a process of its own (`--exact`), as fork wants.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpu_pager::{Pager, Policy};

const MIB: usize = 1 << 20;

/// Runs test `name` of this module alone in a child process (see [`common::run_alone`]).
fn in_own_process(name: &str) -> bool {
    common::run_alone(module_path!(), name, &[])
}

/// Forks; the child runs `child` and exits with its result (0: it held); the parent waits at
/// most 10 s and says whether the child exited 0.
pub fn fork_and_check(child: impl FnOnce() -> bool) -> bool {
    // SAFETY: the child only runs `child` and `_exit`s; no lock of the parent's is taken
    // before the pager's own check (what the test is about).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let ok = child();
        // SAFETY: ends the child at once, without running the parent's exit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child without blocking.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            return libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        }
        if start.elapsed() > Duration::from_secs(10) {
            // SAFETY: our own child, hung.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the forked child hung in a pager call");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn pager() -> Pager {
    common::host_pager(256 * MIB)
}

#[test]
fn a_forked_child_gets_an_error_and_cannot_write_the_parents_memory() {
    if in_own_process("a_forked_child_gets_an_error_and_cannot_write_the_parents_memory") {
        return;
    }
    let pager = pager();
    pager.region("w", 16 * MIB, Policy::Preserve).unwrap();
    let b = pager.alloc("w", 4096).unwrap();
    pager.write(&b, 0, &[1; 4096]).unwrap();
    let held = fork_and_check(|| match pager.write(&b, 0, &[2; 4096]) {
        Err(e) => e.to_string().contains("fork"),
        Ok(()) => false,
    });
    assert!(
        held,
        "the child's write was refused with a message about the fork"
    );
    let mut back = [0u8; 4096];
    pager.read(&b, 0, &mut back).unwrap();
    assert_eq!(back, [1; 4096], "the parent's memory is untouched");
    // Everything else refuses too, not only writes.
    assert!(fork_and_check(|| pager.release(&["w"]).is_err()
        && pager.region("x", 2 * MIB, Policy::Discard).is_err()
        && pager.alloc("w", 64).is_err()));
}

#[test]
fn a_fork_while_another_thread_is_inside_the_pager_does_not_hang_the_child() {
    if in_own_process("a_fork_while_another_thread_is_inside_the_pager_does_not_hang_the_child") {
        return;
    }
    let pager = Arc::new(pager());
    pager.region("w", 64 * MIB, Policy::Preserve).unwrap();
    let b = pager.alloc("w", 64 * MIB).unwrap();
    pager.write(&b, 0, &vec![3; 64 * MIB]).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let (pager, stop) = (pager.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                pager.release(&["w"]).unwrap();
                pager.resume(&["w"]).unwrap();
            }
        })
    };
    for _ in 0..20 {
        assert!(fork_and_check(
            || pager.info("w").is_err() && pager.stats().regions.is_empty()
        ));
    }
    stop.store(true, Ordering::Relaxed);
    busy.join().unwrap();
}
