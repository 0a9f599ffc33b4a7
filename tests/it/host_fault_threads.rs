//! Concurrency with faults: four threads move their own tags (two fixed, two growing
//! `Preserve` regions) through random alloc / free / write / mark / release / resume /
//! resume_on sequences while copies, maps and pinning fail at random, and a fifth thread
//! polls the stats and leases two of the tags. Nothing deadlocks, and every byte that was
//! not marked at a thread's last successful release reads back bit-exact after every step.

use crate::common;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::backend::{Backend, RawStream};
use gpu_pager::{Buffer, Pager, PagerConfig, Policy, State};
use gpu_pager_testkit::{FaultPlan, FaultyBackend};

const KIB: usize = 1 << 10;
const STEPS: usize = 1500;

/// xorshift64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A range inside `0..len`.
    fn range(&mut self, len: usize) -> std::ops::Range<usize> {
        let a = self.below(len);
        a..a + self.below(len - a + 1)
    }
}

struct Model {
    buf: Buffer,
    data: Vec<u8>,
    known: Vec<bool>,
    marked: Vec<bool>,
    marked_at_release: Vec<bool>,
}

/// The device address of `buf`; reads and writes go to the wrapped backend, so that the
/// faults hit the pager's own moves only.
fn addr(pager: &Pager, buf: &Buffer) -> u64 {
    pager.ptr(buf).expect("resident")
}

fn run(pager: &Pager, host: &HostBackend, tag: &'static str, seed: u64) {
    let mut rng = Rng(seed);
    let mut bufs: Vec<Model> = Vec::new();
    let mut resident = true;
    for step in 0..STEPS {
        match rng.below(8) {
            0 => {
                let len = 1 + rng.below(150_000);
                if let Ok(buf) = pager.alloc(tag, len) {
                    let mut m = Model {
                        buf,
                        data: vec![0; len],
                        known: vec![false; len],
                        marked: vec![false; len],
                        marked_at_release: vec![false; len],
                    };
                    if resident {
                        m.data.iter_mut().for_each(|x| *x = rng.next() as u8);
                        // SAFETY: a live buffer of a resident region.
                        unsafe { host.copy_to_device(addr(pager, &m.buf), &m.data) }.unwrap();
                        m.known.fill(true);
                    }
                    bufs.push(m);
                }
            }
            1 if !bufs.is_empty() => {
                let m = bufs.swap_remove(rng.below(bufs.len()));
                pager.free(&m.buf).unwrap();
            }
            2 if !bufs.is_empty() && resident => {
                let i = rng.below(bufs.len());
                let m = &mut bufs[i];
                let r = rng.range(m.data.len());
                m.data[r.clone()]
                    .iter_mut()
                    .for_each(|x| *x = rng.next() as u8);
                m.known[r.clone()].fill(true);
                let at = addr(pager, &m.buf) + r.start as u64;
                // SAFETY: inside a live buffer of a resident region.
                unsafe { host.copy_to_device(at, &m.data[r]) }.unwrap();
            }
            3 if !bufs.is_empty() => {
                let i = rng.below(bufs.len());
                let m = &mut bufs[i];
                let (r, on) = (rng.range(m.data.len()), rng.next().is_multiple_of(2));
                pager.set_overwritten(&m.buf, r.clone(), on).unwrap();
                m.marked[r].fill(on);
            }
            4 | 5 => {
                if pager.release(&[tag]).is_ok() {
                    if resident {
                        bufs.iter_mut()
                            .for_each(|m| m.marked_at_release = m.marked.clone());
                    }
                    resident = false;
                } else if resident && pager.info(tag).unwrap().state == State::Released {
                    // Mapping back what the failed release had unmapped beside its copies
                    // failed too (`host_fault_model` checks that this is the only way): the
                    // region is released with what it saved; its bytes are forgotten.
                    resident = false;
                    bufs.iter_mut().for_each(|m| m.known.fill(false));
                }
            }
            _ => {
                let resumed = if rng.next().is_multiple_of(2) {
                    pager.resume(&[tag])
                } else {
                    pager.resume_on(&[tag], RawStream(0))
                };
                if resumed.is_ok() {
                    if !resident {
                        for m in &mut bufs {
                            for (k, &was) in m.known.iter_mut().zip(&m.marked_at_release) {
                                *k &= !was;
                            }
                        }
                    }
                    resident = true;
                }
            }
        }
        if !resident {
            continue;
        }
        for (i, m) in bufs.iter().enumerate() {
            let mut got = vec![0u8; m.data.len()];
            // SAFETY: a live buffer of a resident region.
            unsafe { host.copy_to_host(&mut got, addr(pager, &m.buf)) }.unwrap();
            for (j, ((g, d), k)) in got.iter().zip(&m.data).zip(&m.known).enumerate() {
                assert!(!k || g == d, "{tag}, step {step}, buffer {i}, byte {j}");
            }
        }
    }
}

#[test]
fn threads_moving_their_own_tags_with_faults_lose_nothing() {
    let host = Arc::new(HostBackend::new(HostConfig {
        capacity: 64 << 20,
        granularity: 64 * KIB,
    }));
    let faulty = Arc::new(FaultyBackend::new(
        host.clone(),
        FaultPlan {
            seed: 3,
            copy_per_mille: 30,
            map_per_mille: 30,
            pin_per_mille: 30,
        },
    ));
    let pager = Arc::new(Pager::with_config(
        faulty.clone(),
        PagerConfig {
            chunk_bytes: 128 * KIB,
            tuning: gpu_pager::Tuning {
                hash_chunk_bytes: 16 * KIB,
                copy_unit_bytes: 4096,
                copy_gap_bytes: 3000,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    ));
    let tags = ["a", "b", "c", "d"];
    for (i, t) in tags.iter().enumerate() {
        let bytes = if i % 2 == 0 { 1 << 20 } else { 0 };
        common::table_region(
            &pager,
            t,
            bytes,
            Policy::Preserve,
            gpu_pager::RegionOptions::default(),
        )
        .unwrap();
    }
    let movers: Vec<_> = tags
        .into_iter()
        .enumerate()
        .map(|(i, tag)| {
            let (pager, host) = (pager.clone(), host.clone());
            std::thread::spawn(move || run(&pager, &host, tag, 0x9E37_79B9 + i as u64))
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let (pager, stop) = (pager.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = pager.stats();
                let _ = pager.lease(&["a", "c"]);
            }
        })
    };
    for m in movers {
        m.join().expect("a mover failed");
    }
    stop.store(true, Ordering::Relaxed);
    poller.join().expect("the poller failed");
    let f = faulty.injected();
    assert!(
        f.copy_to_host > 0 && f.copy_to_device > 0 && f.map > 0,
        "{f:?}"
    );
}
