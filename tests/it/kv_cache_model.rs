//! `KvCache` on the host backend against a model: random appends, writes (with
//! copy-on-write), forks, truncations, frees, trims, out-of-memory and release/resume cycles.
//! After every step: each live sequence gathers back exactly what was written, every live
//! block is backed, a trim leaves exactly the chunks under live blocks mapped, and ids from
//! before a release are refused. Plus a race of kernel calls against release/resume.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gpu_pager::backend::Backend;
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::kv::{Kv, KvCache, KvCacheConfig, KvDtype, KvError, KvLayout, KvOrder, SeqId};
use gpu_pager::{Buffer, Error, Pager, Policy};
use gpu_pager_testkit::Hog;
use proptest::prelude::*;

const CHUNK: usize = 4096;
const BLOCKS: u32 = 256;
const BS: u64 = 4;
/// 1 layer × 1 head × 8 bf16: 16-byte rows, 128-byte blocks, 32 blocks a chunk.
fn layout() -> KvLayout {
    KvLayout::new(1, 1, 8, BS as u32, KvDtype::Bf16, KvOrder::Nhd).unwrap()
}
const TOKEN: usize = 16;

#[derive(Debug, Clone)]
enum Op {
    NewSeq,
    Append(usize, u64),
    Rewrite(usize, u64, u64),
    Fork(usize),
    Truncate(usize, u64),
    FreeSeq(usize),
    Trim,
    AppendWithoutMemory(usize, u64),
    ReleaseResume,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::NewSeq),
        6 => (any::<usize>(), 1u64..80).prop_map(|(s, n)| Op::Append(s, n)),
        4 => (any::<usize>(), any::<u64>(), 1u64..9).prop_map(|(s, a, n)| Op::Rewrite(s, a, n)),
        2 => any::<usize>().prop_map(Op::Fork),
        1 => (any::<usize>(), any::<u64>()).prop_map(|(s, t)| Op::Truncate(s, t)),
        2 => any::<usize>().prop_map(Op::FreeSeq),
        2 => Just(Op::Trim),
        1 => (any::<usize>(), 1u64..200).prop_map(|(s, n)| Op::AppendWithoutMemory(s, n)),
        1 => Just(Op::ReleaseResume),
    ]
}

struct Harness {
    pager: Arc<Pager>,
    backend: Arc<HostBackend>,
    cache: KvCache,
    keys: Buffer,
    values: Buffer,
    out: Buffer,
    counter: u8,
}

/// A sequence in the model: its id and what each of its tokens holds (K, V).
type SeqModel = (SeqId, Vec<u8>, Vec<u8>);

impl Harness {
    fn new() -> Self {
        let backend = Arc::new(HostBackend::new(HostConfig {
            capacity: 64 << 20,
            granularity: CHUNK,
        }));
        let pager = Arc::new(Pager::new(backend.clone()));
        pager
            .region("io", 3 * 4096 * TOKEN, Policy::Discard)
            .unwrap();
        let cache = KvCache::new(
            pager.clone(),
            "kv",
            layout(),
            BLOCKS,
            KvCacheConfig { chunk_bytes: CHUNK },
        )
        .unwrap();
        Harness {
            keys: pager.alloc("io", 4096 * TOKEN).unwrap(),
            values: pager.alloc("io", 4096 * TOKEN).unwrap(),
            out: pager.alloc("io", 4096 * TOKEN).unwrap(),
            pager,
            backend,
            cache,
            counter: 0,
        }
    }

    /// Writes tokens `from..to` of `seq` with fresh bytes and records them in the model.
    fn write(&mut self, seq: &mut SeqModel, from: u64, to: u64) -> Result<(), Error> {
        let slots = self.cache.prepare_write(seq.0, from..to)?;
        let n = slots.len() * TOKEN;
        self.counter = self.counter.wrapping_add(1);
        let k: Vec<u8> = (0..n).map(|i| (i as u8) ^ self.counter).collect();
        let v: Vec<u8> = k.iter().map(|b| b.wrapping_mul(31) ^ 0x5A).collect();
        self.pager.write(&self.keys, 0, &k).unwrap();
        self.pager.write(&self.values, 0, &v).unwrap();
        self.cache
            .write(0, &self.keys, &self.values, slots.len(), TOKEN, &slots)?;
        let (a, b) = (from as usize * TOKEN, to as usize * TOKEN);
        seq.1.resize(seq.1.len().max(b), 0);
        seq.2.resize(seq.2.len().max(b), 0);
        seq.1[a..b].copy_from_slice(&k);
        seq.2[a..b].copy_from_slice(&v);
        Ok(())
    }

    fn check(&self, seqs: &[SeqModel]) {
        for (seq, k, v) in seqs {
            for (kv, want) in [(Kv::K, k), (Kv::V, v)] {
                let n = self.cache.gather(0, kv, *seq, &self.out).unwrap() as usize;
                assert_eq!(n * TOKEN, want.len(), "{seq} length");
                let mut got = vec![0u8; want.len()];
                self.pager.read(&self.out, 0, &mut got).unwrap();
                assert!(got == *want, "{seq} {kv:?} contents differ");
            }
        }
        let bpb = layout().bytes_per_block() as usize;
        let runs = self.cache.with_pool(|p| p.live_runs()).unwrap();
        for r in &runs {
            let bytes = r.start as usize * bpb..r.end as usize * bpb;
            assert!(
                self.pager.is_backed("kv", bytes).unwrap(),
                "live blocks {r:?} unbacked"
            );
        }
    }

    /// Chunks touching a live block.
    fn needed_chunks(&self) -> usize {
        let bpb = layout().bytes_per_block() as usize;
        let mut chunks = std::collections::BTreeSet::new();
        for r in self.cache.with_pool(|p| p.live_runs()).unwrap() {
            let (a, b) = (r.start as usize * bpb, r.end as usize * bpb);
            chunks.extend(a / CHUNK..b.div_ceil(CHUNK));
        }
        chunks.len()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn kv_cache_against_a_model(ops in proptest::collection::vec(op(), 1..60)) {
        let mut h = Harness::new();
        let mut seqs: Vec<SeqModel> = Vec::new();
        let mut gone: Vec<SeqId> = Vec::new();
        let pick = |n: usize, i: usize| (n > 0).then(|| i % n);
        for op in ops {
            match op {
                Op::NewSeq => seqs.push((h.cache.create_seq().unwrap(), vec![], vec![])),
                Op::Append(i, n) => if let Some(i) = pick(seqs.len(), i) {
                    let len = h.cache.block_table(seqs[i].0).unwrap().1;
                    match h.cache.append_tokens(seqs[i].0, n) {
                        Ok(_) => {
                            let mut s = seqs[i].clone();
                            h.write(&mut s, len, len + n).unwrap();
                            seqs[i] = s;
                        }
                        Err(Error::Kv { error: KvError::KvExhausted { .. }, .. }) => {
                            prop_assert_eq!(h.cache.block_table(seqs[i].0).unwrap().1, len);
                        }
                        Err(e) => panic!("append: {e}"),
                    }
                },
                Op::Rewrite(i, at, n) => if let Some(i) = pick(seqs.len(), i) {
                    let len = seqs[i].1.len() as u64 / TOKEN as u64;
                    if len > 0 {
                        let from = at % len;
                        let to = (from + n).min(len);
                        let mut s = seqs[i].clone();
                        match h.write(&mut s, from, to) {
                            Ok(()) => seqs[i] = s,
                            // Copy-on-write needs a free block.
                            Err(Error::Kv { error: KvError::KvExhausted { .. }, .. }) => {}
                            Err(e) => panic!("rewrite: {e}"),
                        }
                    }
                },
                Op::Fork(i) => if let Some(i) = pick(seqs.len(), i) {
                    let child = h.cache.fork(seqs[i].0).unwrap();
                    seqs.push((child, seqs[i].1.clone(), seqs[i].2.clone()));
                },
                Op::Truncate(i, t) => if let Some(i) = pick(seqs.len(), i) {
                    let len = seqs[i].1.len() as u64 / TOKEN as u64;
                    let t = t % (len + 1);
                    h.cache.truncate(seqs[i].0, t).unwrap();
                    seqs[i].1.truncate(t as usize * TOKEN);
                    seqs[i].2.truncate(t as usize * TOKEN);
                },
                Op::FreeSeq(i) => if let Some(i) = pick(seqs.len(), i) {
                    let (s, _, _) = seqs.swap_remove(i);
                    h.cache.free_seq(s).unwrap();
                    gone.push(s);
                },
                Op::Trim => {
                    h.cache.trim().unwrap();
                    let mapped = h.cache.stats().unwrap().mapped_bytes;
                    prop_assert_eq!(mapped, h.needed_chunks() * CHUNK, "trim keeps exactly the chunks under live blocks");
                },
                Op::AppendWithoutMemory(i, n) => if let Some(i) = pick(seqs.len(), i) {
                    let len = h.cache.block_table(seqs[i].0).unwrap().1;
                    let free = h.backend.mem_info().unwrap().free;
                    let hold = Hog::take(h.backend.as_ref(), free).unwrap();
                    let r = h.cache.append_tokens(seqs[i].0, n);
                    drop(hold);
                    match r {
                        Ok(_) => {
                            let mut s = seqs[i].clone();
                            h.write(&mut s, len, len + n).unwrap();
                            seqs[i] = s;
                        }
                        Err(Error::OutOfMemory { .. })
                        | Err(Error::Kv { error: KvError::KvExhausted { .. }, .. }) => {
                            prop_assert_eq!(h.cache.block_table(seqs[i].0).unwrap().1, len, "a failed append changed the sequence");
                        }
                        Err(e) => panic!("append without memory: {e}"),
                    }
                },
                Op::ReleaseResume => {
                    h.pager.release(&["kv"]).unwrap();
                    h.pager.resume(&["kv"]).unwrap();
                    prop_assert_eq!(h.cache.stats().unwrap().mapped_bytes, 0);
                    gone.extend(seqs.drain(..).map(|s| s.0));
                },
            }
            h.check(&seqs);
            for &s in gone.iter().rev().take(3) {
                let unknown = matches!(
                    h.cache.block_table(s),
                    Err(Error::Kv { error: KvError::UnknownSeq { .. }, .. })
                );
                prop_assert!(unknown, "{} is gone but still known", s);
            }
        }
        let live = h.cache.stats().unwrap().pool.live;
        for (s, _, _) in seqs.drain(..) {
            h.cache.free_seq(s).unwrap();
        }
        prop_assert!(live >= h.cache.stats().unwrap().pool.live);
        prop_assert_eq!(h.cache.stats().unwrap().pool.live, 0, "blocks leaked");
        h.cache.trim().unwrap();
        prop_assert_eq!(h.cache.stats().unwrap().mapped_bytes, 0);
    }
}

/// Kernel calls racing release/resume from another thread: every call either works or
/// fails with an error (Busy on the releasing side; NotResident, Stale or UnknownSeq on the
/// cache side) — never touches unmapped memory (which would fault on the host backend).
#[test]
fn kv_calls_race_release_and_resume_safely() {
    let h = Harness::new();
    let stop = Arc::new(AtomicBool::new(false));
    let pager = h.pager.clone();
    let cycler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut cycles = 0u32;
            while !stop.load(Ordering::Relaxed) {
                match pager.release(&["kv"]) {
                    Ok(_) | Err(Error::Busy { .. }) => {}
                    Err(e) => panic!("release: {e}"),
                }
                pager.resume(&["kv"]).unwrap();
                cycles += 1;
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            cycles
        })
    };
    let mut ok = 0u32;
    for i in 0..20_000u64 {
        let step = || -> Result<(), Error> {
            let s = h.cache.create_seq()?;
            h.cache.append_tokens(s, 1 + i % 20)?;
            let slots = h.cache.prepare_write(s, 0..1 + i % 20)?;
            h.cache
                .write(0, &h.keys, &h.values, slots.len(), TOKEN, &slots)?;
            h.cache.gather(0, Kv::V, s, &h.out)?;
            let t = h.cache.block_table(s)?.0;
            let mut host = h.cache.alloc_host(t.len() as u32)?;
            h.cache.swap_out(&t, &mut host)?;
            h.cache.swap_in(&t, &host)?;
            h.cache.free_seq(s)?;
            if i % 7 == 0 {
                h.cache.trim()?;
            }
            Ok(())
        };
        match step() {
            Ok(()) => ok += 1,
            Err(
                Error::NotResident { .. }
                | Error::Kv {
                    error: KvError::Stale { .. } | KvError::UnknownSeq { .. },
                    ..
                },
            ) => {}
            // Slots made before a release name blocks that are no longer allocated.
            Err(
                e @ Error::Kv {
                    error: KvError::InvalidArgument { .. },
                    ..
                },
            ) if e.to_string().contains("not allocated") => {}
            Err(e) => panic!("step {i}: {e}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let cycles = cycler.join().unwrap();
    eprintln!("{cycles} release/resume cycles, {ok} of 20,000 steps clean");
    assert!(cycles > 0 && ok > 0, "{cycles} cycles, {ok} clean steps");
}

/// Review item 18: KV errors name the cache's own tag and no other region, and a reversed
/// token range names its start, not its end.
#[test]
fn kv_errors_name_the_cache_s_tag_and_a_reversed_range_s_start() {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity: 64 << 20,
        granularity: CHUNK,
    }));
    let pager = Arc::new(Pager::new(backend));
    let cache = KvCache::new(
        pager,
        "ctx",
        layout(),
        8,
        KvCacheConfig { chunk_bytes: CHUNK },
    )
    .unwrap();
    let s = cache.create_seq().unwrap();
    cache.append_tokens(s, 6).unwrap();
    #[allow(clippy::reversed_empty_ranges)]
    let e = cache.prepare_write(s, 5..2).unwrap_err().to_string();
    assert!(
        e.contains("start of the token range") && e.contains('5'),
        "{e}"
    );
    let e = cache.append_tokens(s, 1000).unwrap_err().to_string();
    assert!(e.contains("`ctx`") && !e.contains("kv_cache"), "{e}");
    cache.free_seq(s).unwrap();
    let e = cache.append_tokens(s, 1).unwrap_err().to_string();
    assert!(e.contains("`ctx`") && !e.contains("kv_cache"), "{e}");
}
