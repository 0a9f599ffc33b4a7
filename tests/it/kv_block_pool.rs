//! Block pool of the paged KV cache against a simple model, plus one test per error variant.

use gpu_pager::kv::{BlockId, BlockPool, KvDtype, KvError, KvLayout, KvOrder, SeqId};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    NewSeq,
    Append(usize, u64),
    Fork(usize),
    Write(usize, u64),
    FreeSeq(usize),
    Alloc,
    Retain(usize),
    FreeRaw(usize),
    Invalidate,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::NewSeq),
        6 => (any::<usize>(), 0u64..12).prop_map(|(s, n)| Op::Append(s, n)),
        2 => any::<usize>().prop_map(Op::Fork),
        5 => (any::<usize>(), any::<u64>()).prop_map(|(s, t)| Op::Write(s, t)),
        2 => any::<usize>().prop_map(Op::FreeSeq),
        2 => Just(Op::Alloc),
        1 => any::<usize>().prop_map(Op::Retain),
        2 => any::<usize>().prop_map(Op::FreeRaw),
        1 => Just(Op::Invalidate),
    ]
}

struct Model {
    bs: u64,
    rc: Vec<u32>,
    generation: Vec<u32>,
    seqs: Vec<(SeqId, Vec<u32>, u64)>,
    /// References the test holds through the block-level API.
    raw: Vec<BlockId>,
    /// Every id ever handed out (checked against the model each step).
    seen: Vec<BlockId>,
    dead_seqs: Vec<SeqId>,
}

impl Model {
    fn id(&self, i: u32) -> BlockId {
        BlockId {
            index: i,
            generation: self.generation[i as usize],
        }
    }
    fn free(&self) -> u32 {
        self.rc.iter().filter(|&&r| r == 0).count() as u32
    }
    fn alloc(&mut self) -> u32 {
        let i = self
            .rc
            .iter()
            .position(|&r| r == 0)
            .expect("model: a free block") as u32;
        self.generation[i as usize] = self.generation[i as usize].wrapping_add(1);
        self.rc[i as usize] = 1;
        let id = self.id(i);
        self.seen.push(id);
        i
    }
    fn expect(&self, id: BlockId) -> Result<u32, &'static str> {
        let i = id.index as usize;
        if i >= self.rc.len() {
            Err("foreign")
        } else if self.generation[i] != id.generation {
            Err("stale")
        } else if self.rc[i] == 0 {
            Err("double")
        } else {
            Ok(self.rc[i])
        }
    }
}

fn kind(e: &KvError) -> &'static str {
    match e {
        KvError::ForeignOrOutOfRange { .. } => "foreign",
        KvError::Stale { .. } => "stale",
        KvError::DoubleFree { .. } => "double",
        KvError::KvExhausted { .. } => "exhausted",
        KvError::UnknownSeq { .. } => "unknown",
        KvError::OutOfRange { .. } => "range",
        _ => "other",
    }
}

fn check(pool: &BlockPool, m: &Model) {
    let cap = m.rc.len() as u32;
    // refcounts and liveness of every block, through its current id
    for i in 0..cap {
        let got = pool.refcount(m.id(i)).map_err(|e| kind(&e));
        assert_eq!(got, m.expect(m.id(i)), "block {i}");
    }
    // every id ever handed out is live, stale or double-freed exactly as the model says
    for &id in &m.seen {
        assert_eq!(
            pool.refcount(id).map_err(|e| kind(&e)),
            m.expect(id),
            "id {id}"
        );
    }
    let live = cap - m.free();
    assert_eq!(pool.live_blocks(), live);
    assert_eq!(pool.free_blocks(), m.free());
    let st = pool.stats();
    assert_eq!(st.live + st.free, cap);
    assert_eq!(st.shared, m.rc.iter().filter(|&&r| r > 1).count() as u32);
    assert_eq!(st.sequences, m.seqs.len());
    let highest = m.rc.iter().rposition(|&r| r > 0).map(|i| i as u32);
    assert_eq!(pool.highest_live_block(), highest);
    // no leak: the references held by sequences and the test are exactly the refcounts
    let mut held = vec![0u32; cap as usize];
    for (seq, table, tokens) in &m.seqs {
        let got = pool.block_table(*seq).unwrap();
        let want: Vec<BlockId> = table.iter().map(|&i| m.id(i)).collect();
        assert_eq!(got, want.as_slice(), "table of {seq}");
        assert_eq!(pool.seq_tokens(*seq).unwrap(), *tokens);
        assert_eq!(table.len() as u64, tokens.div_ceil(m.bs));
        for &i in table {
            held[i as usize] += 1;
        }
    }
    for id in &m.raw {
        held[id.index as usize] += 1;
    }
    assert_eq!(held, m.rc, "references held == refcounts");
    // trimming view: empty ranges hold no live block, and every block outside them is in a
    // chunk with a live block
    for chunk in [1u32, 3, 8] {
        let ranges = pool.empty_ranges(chunk).unwrap();
        for i in 0..cap {
            let in_empty = ranges.iter().any(|r| r.contains(&i));
            let c = i / chunk;
            let chunk_live = (c * chunk..((c + 1) * chunk).min(cap)).any(|j| m.rc[j as usize] > 0);
            assert_eq!(in_empty, !chunk_live, "block {i} chunk {chunk}");
        }
    }
    for &s in &m.dead_seqs {
        assert!(matches!(
            pool.block_table(s),
            Err(KvError::UnknownSeq { .. })
        ));
    }
}

fn pick<T: Clone>(v: &[T], sel: usize) -> Option<(usize, T)> {
    if v.is_empty() {
        None
    } else {
        let i = sel % v.len();
        Some((i, v[i].clone()))
    }
}

fn run(cap: u32, bs: u32, ops: Vec<Op>) {
    let mut pool = BlockPool::new(cap, bs).unwrap();
    let mut m = Model {
        bs: u64::from(bs),
        rc: vec![0; cap as usize],
        generation: vec![0; cap as usize],
        seqs: Vec::new(),
        raw: Vec::new(),
        seen: Vec::new(),
        dead_seqs: Vec::new(),
    };
    for op in ops {
        match op {
            Op::NewSeq => {
                let s = pool.create_seq();
                m.seqs.push((s, Vec::new(), 0));
            }
            Op::Append(sel, n) => {
                let Some((k, (s, table, tokens))) = pick(&m.seqs, sel) else {
                    continue;
                };
                let need = (tokens + n).div_ceil(m.bs) - table.len() as u64;
                let r = pool.append_tokens(s, n);
                if need > u64::from(m.free()) {
                    let e = r.unwrap_err();
                    assert_eq!(
                        e,
                        KvError::KvExhausted {
                            requested: need as u32,
                            free: m.free()
                        }
                    );
                } else {
                    let got: Vec<u32> = r.unwrap().iter().map(|b| b.index).collect();
                    let want: Vec<u32> = (0..need).map(|_| m.alloc()).collect();
                    assert_eq!(got, want, "append takes the lowest free ids");
                    m.seqs[k].1.extend(want);
                    m.seqs[k].2 = tokens + n;
                }
            }
            Op::Fork(sel) => {
                let Some((_, (s, table, tokens))) = pick(&m.seqs, sel) else {
                    continue;
                };
                let child = pool.fork(s).unwrap();
                for &i in &table {
                    m.rc[i as usize] += 1;
                }
                m.seqs.push((child, table, tokens));
            }
            Op::Write(sel, t) => {
                let Some((k, (s, table, tokens))) = pick(&m.seqs, sel) else {
                    continue;
                };
                if tokens == 0 {
                    let e = pool.write_slot(s, t % 3).unwrap_err();
                    assert_eq!(kind(&e), "range");
                    continue;
                }
                let t = t % tokens;
                let pos = (t / m.bs) as usize;
                let old = table[pos];
                let r = pool.write_slot(s, t);
                if m.rc[old as usize] == 1 {
                    let w = r.unwrap();
                    assert_eq!(w.block, m.id(old));
                    assert_eq!(w.needs_copy_from, None);
                    assert_eq!(w.slot, u64::from(old) * m.bs + t % m.bs);
                } else if m.free() == 0 {
                    assert_eq!(kind(&r.unwrap_err()), "exhausted");
                } else {
                    let old_id = m.id(old);
                    let new = m.alloc();
                    m.rc[old as usize] -= 1;
                    m.seqs[k].1[pos] = new;
                    let w = r.unwrap();
                    assert_eq!(w.block, m.id(new), "copy-on-write takes the lowest free id");
                    assert_eq!(w.needs_copy_from, Some(old_id));
                    assert_eq!(w.slot, u64::from(new) * m.bs + t % m.bs);
                    // writing again is in place
                    assert_eq!(pool.write_slot(s, t).unwrap().needs_copy_from, None);
                }
            }
            Op::FreeSeq(sel) => {
                let Some((k, (s, table, _))) = pick(&m.seqs, sel) else {
                    continue;
                };
                let freed: Vec<u32> = pool.free_seq(s).unwrap().iter().map(|b| b.index).collect();
                let mut want = Vec::new();
                for &i in &table {
                    m.rc[i as usize] -= 1;
                    if m.rc[i as usize] == 0 {
                        want.push(i);
                    }
                }
                assert_eq!(freed, want);
                m.seqs.remove(k);
                m.dead_seqs.push(s);
                assert_eq!(kind(&pool.free_seq(s).unwrap_err()), "unknown");
            }
            Op::Alloc => {
                let r = pool.allocate();
                if m.free() == 0 {
                    assert_eq!(
                        r.unwrap_err(),
                        KvError::KvExhausted {
                            requested: 1,
                            free: 0
                        }
                    );
                } else {
                    let i = m.alloc();
                    let id = r.unwrap();
                    assert_eq!(id, m.id(i), "allocate takes the lowest free id");
                    m.raw.push(id);
                }
            }
            Op::Retain(sel) => {
                let Some((_, id)) = pick(&m.raw, sel) else {
                    continue;
                };
                pool.retain(id).unwrap();
                m.rc[id.index as usize] += 1;
                m.raw.push(id);
            }
            Op::FreeRaw(sel) => {
                let Some((k, id)) = pick(&m.raw, sel) else {
                    continue;
                };
                let became_free = pool.free(id).unwrap();
                m.rc[id.index as usize] -= 1;
                assert_eq!(became_free, m.rc[id.index as usize] == 0);
                m.raw.swap_remove(k);
                if became_free {
                    assert_eq!(kind(&pool.free(id).unwrap_err()), "double");
                }
            }
            Op::Invalidate => {
                pool.invalidate_all();
                for g in &mut m.generation {
                    *g = g.wrapping_add(1);
                }
                m.rc.iter_mut().for_each(|r| *r = 0);
                m.dead_seqs.extend(m.seqs.drain(..).map(|s| s.0));
                for id in m.raw.drain(..) {
                    assert_eq!(kind(&pool.free(id).unwrap_err()), "stale");
                }
            }
        }
        check(&pool, &m);
    }
    // no leak: freeing everything leaves every block free
    for (s, _, _) in std::mem::take(&mut m.seqs) {
        pool.free_seq(s).unwrap();
    }
    for id in std::mem::take(&mut m.raw) {
        pool.free(id).unwrap();
    }
    assert_eq!(pool.live_blocks(), 0);
    assert_eq!(pool.free_blocks(), cap);
    assert_eq!(pool.highest_live_block(), None);
    assert_eq!(pool.empty_ranges(4).unwrap(), vec![0..cap]);
    assert_eq!(pool.allocate().unwrap().index, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_model(cap in 1u32..40, bs in 1u32..5, ops in prop::collection::vec(op(), 0..120)) {
        run(cap, bs, ops);
    }

    #[test]
    fn pool_matches_model_across_tree_levels(
        cap in 60u32..200,
        ops in prop::collection::vec(op(), 0..200),
    ) {
        run(cap, 1, ops);
    }
}

#[test]
fn double_free() {
    let mut p = BlockPool::new(4, 16).unwrap();
    let b = p.allocate().unwrap();
    assert!(p.free(b).unwrap());
    let e = p.free(b).unwrap_err();
    assert_eq!(e, KvError::DoubleFree { id: b });
    assert!(e.to_string().contains("double free"), "{e}");
    assert_eq!(p.retain(b).unwrap_err(), KvError::DoubleFree { id: b });
}

#[test]
fn foreign_or_out_of_range() {
    let mut p = BlockPool::new(4, 16).unwrap();
    let id = BlockId {
        index: 4,
        generation: 1,
    };
    let e = p.free(id).unwrap_err();
    assert_eq!(e, KvError::ForeignOrOutOfRange { id, capacity: 4 });
    assert!(e.to_string().contains("ids this pool handed out"), "{e}");
    assert!(p.refcount(id).is_err() && p.retain(id).is_err());
}

#[test]
fn stale_after_invalidate_and_after_reuse() {
    let mut p = BlockPool::new(4, 16).unwrap();
    let a = p.allocate().unwrap();
    let s = p.create_seq();
    p.append_tokens(s, 17).unwrap();
    let table = p.block_table(s).unwrap().to_vec();
    p.invalidate_all();
    let e = p.free(a).unwrap_err();
    assert_eq!(
        e,
        KvError::Stale {
            id: a,
            generation: a.generation + 1
        }
    );
    assert!(e.to_string().contains("allocate again"), "{e}");
    for b in table {
        assert!(matches!(p.refcount(b), Err(KvError::Stale { .. })));
    }
    // the same index handed out again has a new generation; the old id stays stale
    let a2 = p.allocate().unwrap();
    assert_eq!(a2.index, a.index);
    assert_ne!(a2.generation, a.generation);
    assert!(matches!(p.free(a), Err(KvError::Stale { .. })));
    // freed then re-allocated: the first id is stale, not silently the new block
    assert!(p.free(a2).unwrap());
    let a3 = p.allocate().unwrap();
    assert_eq!(a3.index, a2.index);
    assert!(matches!(p.retain(a2), Err(KvError::Stale { .. })));
    assert_eq!(p.refcount(a3).unwrap(), 1);
}

#[test]
fn exhausted_changes_nothing() {
    let mut p = BlockPool::new(3, 4).unwrap();
    let s = p.create_seq();
    p.append_tokens(s, 8).unwrap();
    let e = p.append_tokens(s, 5).unwrap_err();
    assert_eq!(
        e,
        KvError::KvExhausted {
            requested: 2,
            free: 1
        }
    );
    assert!(e.to_string().contains("free or preempt"), "{e}");
    assert_eq!(p.seq_tokens(s).unwrap(), 8);
    assert_eq!(p.live_blocks(), 2);
    assert_eq!(
        p.allocate_n(2).unwrap_err(),
        KvError::KvExhausted {
            requested: 2,
            free: 1
        }
    );
    // copy-on-write with nothing free
    let c = p.fork(s).unwrap();
    p.allocate().unwrap();
    assert!(matches!(
        p.write_slot(c, 0),
        Err(KvError::KvExhausted {
            requested: 1,
            free: 0
        })
    ));
    assert_eq!(p.block_table(c).unwrap(), p.block_table(s).unwrap());
    assert!(matches!(
        p.append_tokens(s, u64::MAX),
        Err(KvError::OutOfRange { .. })
    ));
}

#[test]
fn unknown_seq() {
    let mut p = BlockPool::new(3, 4).unwrap();
    let s = p.create_seq();
    p.free_seq(s).unwrap();
    let e = p.append_tokens(s, 1).unwrap_err();
    assert_eq!(e, KvError::UnknownSeq { seq: s });
    assert!(e.to_string().contains("create a new one"), "{e}");
    assert!(matches!(p.fork(s), Err(KvError::UnknownSeq { .. })));
    assert!(matches!(
        p.write_slot(s, 0),
        Err(KvError::UnknownSeq { .. })
    ));
    assert!(matches!(p.block_table(s), Err(KvError::UnknownSeq { .. })));
    assert!(matches!(
        p.free_seq(SeqId(99)),
        Err(KvError::UnknownSeq { .. })
    ));
    // sequences are dropped by invalidate_all too, and ids are never reused
    let s2 = p.create_seq();
    assert_ne!(s2, s);
    p.invalidate_all();
    assert!(matches!(p.seq_tokens(s2), Err(KvError::UnknownSeq { .. })));
}

#[test]
fn invalid_parameters() {
    assert!(matches!(
        BlockPool::new(0, 4),
        Err(KvError::InvalidLayout { .. })
    ));
    assert!(matches!(
        BlockPool::new(4, 0),
        Err(KvError::InvalidLayout { .. })
    ));
    let p = BlockPool::new(4, 4).unwrap();
    assert!(matches!(
        p.empty_ranges(0),
        Err(KvError::InvalidLayout { .. })
    ));
    let l = KvLayout::new(2, 2, 8, 4, KvDtype::F16, KvOrder::Nhd).unwrap();
    let p = BlockPool::for_layout(&l, l.bytes_per_block() * 7 + 5).unwrap();
    assert_eq!((p.capacity(), p.block_size()), (7, 4));
    assert!(matches!(
        BlockPool::for_layout(&l, l.bytes_per_block() - 1),
        Err(KvError::InvalidLayout { .. })
    ));
}

#[test]
fn fork_and_copy_on_write() {
    let mut p = BlockPool::new(8, 4).unwrap();
    let s = p.create_seq();
    p.append_tokens(s, 6).unwrap(); // blocks 0, 1
    let c = p.fork(s).unwrap();
    let t = p.block_table(s).unwrap().to_vec();
    assert_eq!(p.refcount(t[0]).unwrap(), 2);
    assert_eq!(p.stats().shared, 2);
    // the child writes token 5 (block 1): it gets block 2 and must copy block 1 into it
    let w = p.write_slot(c, 5).unwrap();
    assert_eq!(w.block.index, 2);
    assert_eq!(w.needs_copy_from, Some(t[1]));
    assert_eq!(w.slot, 2 * 4 + 1);
    assert_eq!(p.refcount(t[1]).unwrap(), 1);
    // the parent now owns block 1 alone: in place
    let w = p.write_slot(s, 4).unwrap();
    assert_eq!((w.block, w.needs_copy_from), (t[1], None));
    // appending to the child continues in a fresh block
    p.append_tokens(c, 3).unwrap();
    assert_eq!(
        p.block_table(c)
            .unwrap()
            .iter()
            .map(|b| b.index)
            .collect::<Vec<_>>(),
        [0, 2, 3]
    );
    assert_eq!(
        p.write_slot(c, 9).unwrap_err().to_string(),
        "token of the sequence 9 is out of range (limit 9); pass an index below the limit"
    );
    p.free_seq(s).unwrap();
    p.free_seq(c).unwrap();
    assert_eq!(p.live_blocks(), 0);
}
