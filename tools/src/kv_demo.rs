//! The demo's KV phase: a paged KV cache on an elastic region, exercised the way an engine
//! does, with every claim checked: sequences allocated and written, a fork with
//! copy-on-write, a trim that gives memory back, a release that makes every id stale, a
//! lazy resume.

use std::sync::Arc;

use gpu_pager::kv::{Kv, KvCache, KvCacheConfig, KvDtype, KvError, KvLayout, KvOrder, SeqId};
use gpu_pager::{Buffer, Error, Pager, Policy};

use super::{GIB, Timeline, gib};

const TAG: &str = "kv_paged";
const IO: &str = "kv_io";

/// splitmix64 for the keys and values.
struct Rng(u64);

impl Rng {
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
        }
        out.truncate(n);
        out
    }
}

/// Layer 0's keys and values of one sequence, as the cache must return them.
#[derive(Clone, PartialEq)]
struct Expected {
    k: Vec<u8>,
    v: Vec<u8>,
}

struct Phase<'a> {
    pager: &'a Pager,
    cache: KvCache,
    rng: Rng,
    keys: Buffer,
    values: Buffer,
    out: Buffer,
    token: usize,
}

impl Phase<'_> {
    /// Writes fresh keys and values for tokens `from..to` of `seq` into layers 0 and the last
    /// (copy-on-write first where shared) and records layer 0's in `exp`.
    fn write(&mut self, seq: SeqId, from: u64, to: u64, exp: &mut Expected) -> Result<(), Error> {
        let slots = self.cache.prepare_write(seq, from..to)?;
        let n = slots.len();
        let last = self.cache.layout().layers() - 1;
        for layer in [0, last] {
            let k = self.rng.bytes(n * self.token);
            let v = self.rng.bytes(n * self.token);
            self.pager.write(&self.keys, 0, &k)?;
            self.pager.write(&self.values, 0, &v)?;
            self.cache
                .write(layer, &self.keys, &self.values, n, self.token, &slots)?;
            if layer == 0 {
                let start = from as usize * self.token;
                for (plane, new) in [(&mut exp.k, k), (&mut exp.v, v)] {
                    plane.resize(plane.len().max(to as usize * self.token), 0);
                    plane[start..start + n * self.token].copy_from_slice(&new);
                }
            }
        }
        Ok(())
    }

    /// Whether layer 0 of `seq` gathers back as `exp`.
    fn matches(&self, seq: SeqId, exp: &Expected) -> Result<bool, Error> {
        let mut ok = true;
        for (kv, want) in [(Kv::K, &exp.k), (Kv::V, &exp.v)] {
            let n = self.cache.gather(0, kv, seq, &self.out)? as usize * self.token;
            let mut got = vec![0u8; n];
            self.pager.read(&self.out, 0, &mut got)?;
            ok &= got == *want;
        }
        Ok(ok)
    }

    fn mapped(&self) -> Result<usize, Error> {
        Ok(self.cache.stats()?.mapped_bytes)
    }
}

/// Runs the KV phase on `pager` with about `gib_budget` GiB of cache; returns whether every
/// check held.
pub fn run(pager: &Arc<Pager>, t: &Timeline, gib_budget: f64) -> Result<bool, Error> {
    println!("--- KV phase: paged KV cache `{TAG}` on an elastic region");
    let free = |p: &Pager| p.backend().mem_info().map(|m| m.free).unwrap_or(0);
    // A Llama-8B-like cache: 2 MiB a block.
    let layout =
        KvLayout::new(32, 8, 128, 16, KvDtype::Bf16, KvOrder::Nhd).map_err(|error| Error::Kv {
            tag: Some(TAG.into()),
            error,
        })?;
    let blocks = ((gib_budget * GIB as f64) as u64 / layout.bytes_per_block()).max(64) as u32;
    let cache = KvCache::new(pager.clone(), TAG, layout, blocks, KvCacheConfig::default())?;
    let token = layout.token_bytes() as usize;
    // Eight sequences of 2/3 to 4/3 of `base` tokens fill about 60% of the blocks.
    let base = (u64::from(blocks) * 16 * 6 / 10 / 8).max(16);
    let max_tokens = (base * 4 / 3) as usize;
    pager.region(IO, 3 * max_tokens * token + (1 << 20), Policy::Discard)?;
    let mut p = Phase {
        pager,
        keys: pager.alloc(IO, max_tokens * token)?,
        values: pager.alloc(IO, max_tokens * token)?,
        out: pager.alloc(IO, max_tokens * token)?,
        cache,
        rng: Rng(0x6B76_5F64_656D_6F21),
        token,
    };
    t.line(
        "kv cache created",
        format!(
            "{blocks} blocks of {} MiB ({:.2} GiB reserved), {} MiB chunks, mapped {} bytes",
            layout.bytes_per_block() >> 20,
            gib(p.cache.stats()?.reserved_bytes),
            p.cache.chunk_bytes() >> 20,
            p.mapped()?
        ),
    );

    // Eight sequences, prefilled.
    let free0 = free(pager);
    let mut seqs = Vec::new();
    for i in 0..8u64 {
        let s = p.cache.create_seq()?;
        let n = base * (2 + i % 3) / 3;
        p.cache.append_tokens(s, n)?;
        let mut e = Expected {
            k: vec![],
            v: vec![],
        };
        p.write(s, 0, n, &mut e)?;
        seqs.push((s, e));
    }
    let live = p.cache.stats()?.pool.live;
    t.line(
        "8 sequences written",
        format!(
            "{live} blocks live, mapped {:.2} GiB, device free −{:.2} GiB",
            gib(p.mapped()?),
            gib(free0.saturating_sub(free(pager)))
        ),
    );
    let mut ok = true;
    for (s, e) in &seqs {
        ok &= p.matches(*s, e)?;
    }

    // Fork the first sequence and rewrite its last 10 tokens in the child.
    let (parent, parent_exp) = seqs[0].clone();
    let child = p.cache.fork(parent)?;
    let n = p.cache.block_table(parent)?.1;
    let mut child_exp = parent_exp.clone();
    p.write(child, n - 10, n, &mut child_exp)?;
    let fork_ok = p.matches(parent, &parent_exp)? && p.matches(child, &child_exp)?;
    ok &= fork_ok;
    t.line(
        "fork + copy-on-write",
        format!(
            "child rewrote its last 10 tokens: parent {}, child {}",
            if fork_ok { "unchanged" } else { "WRONG" },
            if fork_ok { "correct" } else { "WRONG" }
        ),
    );

    // Finish most sequences, trim.
    for (s, _) in seqs.drain(2..) {
        p.cache.free_seq(s)?;
    }
    let (before, free_before) = (p.mapped()?, free(pager));
    let trimmed = p.cache.trim()?;
    let (after, free_after) = (p.mapped()?, free(pager));
    // Nothing to give back when the survivors' blocks span every chunk (a small cache).
    ok &= trimmed == before - after && after <= before;
    for (s, e) in &seqs {
        ok &= p.matches(*s, e)?;
    }
    t.line(
        "6 finished, trim",
        format!(
            "mapped {:.2} → {:.2} GiB, device free +{:.2} GiB, survivors intact",
            gib(before),
            gib(after),
            gib(free_after.saturating_sub(free_before))
        ),
    );

    // Release: contents gone, ids stale.
    let old = p.cache.block_table(parent)?.0;
    let f = free(pager);
    pager.release(&[TAG])?;
    t.line(
        "release kv cache",
        format!("device free +{:.2} GiB", gib(free(pager).saturating_sub(f))),
    );
    pager.resume(&[TAG])?;
    let lazy = p.mapped()? == 0;
    ok &= lazy;
    let stale = matches!(
        p.cache.copy_blocks(&[(old[0], old[1])]),
        Err(Error::Kv {
            error: KvError::Stale { .. },
            ..
        })
    );
    let unknown = matches!(
        p.cache.gather(0, Kv::K, parent, &p.out),
        Err(Error::Kv {
            error: KvError::UnknownSeq { .. },
            ..
        })
    );
    ok &= stale && unknown;
    t.line(
        "resume kv cache",
        format!(
            "mapped {} bytes (lazy); old block ids {}, old sequences {}",
            p.mapped()?,
            if stale { "stale" } else { "NOT STALE" },
            if unknown { "unknown" } else { "STILL KNOWN" }
        ),
    );

    // A new sequence at the same addresses.
    let s = p.cache.create_seq()?;
    p.cache.append_tokens(s, base)?;
    let mut e = Expected {
        k: vec![],
        v: vec![],
    };
    p.write(s, 0, base, &mut e)?;
    let fresh = p.matches(s, &e)?;
    ok &= fresh;
    t.line(
        "verify kv",
        format!(
            "{}: new sequence {}, mapped {:.2} GiB",
            if ok { "OK" } else { "FAILED" },
            if fresh { "bit-exact" } else { "WRONG" },
            gib(p.mapped()?)
        ),
    );
    Ok(ok)
}
