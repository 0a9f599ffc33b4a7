//! The stress threads' paged-KV-cache steps: every thread owns sequences of one shared
//! [`KvCache`] (on the elastic region [`PAGED_TAG`]), writes their keys and values, forks
//! them with copy-on-write, swaps them out and in, frees them, trims, and now and then
//! releases and resumes the cache under the other threads.
//!
//! The rule checked: a sequence's contents survive everything but a release of the cache,
//! and its ids go stale exactly when a release happened after it was created. A call that
//! succeeds after the last release must read back exactly what was written; a call that
//! answers `Stale` / `UnknownSeq` must be explained by a release (the region's release
//! count moved since the sequence was created).

use super::{Worker, injected};
use crate::stress::content::random_window;
use crate::stress::shared::Op;
use gpu_pager::kv::{Kv, KvCache, KvDtype, KvError, KvLayout, KvOrder, SeqId};
use gpu_pager::{Buffer, Error, Result};

/// Tag of the stress's paged KV cache.
pub(crate) const PAGED_TAG: &str = "kv_paged";
/// Tag of the per-thread key, value and output buffers.
pub(crate) const IO_TAG: &str = "kv_io";
/// Most tokens one write moves.
pub(crate) const MAX_TOKENS: usize = 256;
/// Most tokens a sequence grows to (sizes the io buffers, which a gather fills).
pub(crate) const MAX_SEQ_TOKENS: usize = 4 * MAX_TOKENS;
/// Sequences a thread owns at most.
const MAX_SEQS: usize = 8;

/// 2 layers × 2 KV heads × 64 bf16, 16 tokens a block, HND: 256 bytes a token per layer and
/// plane, 16 KiB blocks.
pub(crate) fn layout() -> KvLayout {
    KvLayout::new(2, 2, 64, 16, KvDtype::Bf16, KvOrder::Hnd).expect("the stress layout is valid")
}

/// Bytes of one token of one layer and plane.
pub(crate) const TOKEN: usize = 2 * 64 * 2;

/// A sequence a thread owns and what it must hold: per layer, K and V token-major.
#[derive(Debug, Clone)]
pub(crate) struct PagedSeq {
    id: SeqId,
    /// The cache's release count when the sequence was created.
    epoch: u64,
    data: Vec<[Vec<u8>; 2]>,
}

impl PagedSeq {
    fn tokens(&self) -> u64 {
        (self.data[0][0].len() / TOKEN) as u64
    }
}

/// A thread's handles on the paged cache: the cache and its three io buffers.
pub(crate) struct PagedIo<'a> {
    pub kv: &'a KvCache,
    pub keys: Buffer,
    pub values: Buffer,
    pub out: Buffer,
}

/// What a failed paged call means.
#[derive(PartialEq)]
enum Verdict {
    /// A release invalidated the sequence (or the cache is released now): drop it.
    Gone,
    /// An expected, harmless outcome (pool full, no memory, injected fault, busy).
    Benign,
    /// A bug: reported.
    Wrong,
}

impl Worker<'_> {
    fn paged_epoch(&self) -> u64 {
        self.pager.releases(PAGED_TAG).unwrap_or(u64::MAX)
    }

    /// Classifies `e` from a call on a sequence created at `epoch`.
    fn paged_verdict(&self, e: &Error, epoch: Option<u64>) -> Verdict {
        let released_since = epoch.is_none_or(|e0| self.paged_epoch() != e0);
        match e {
            Error::Kv {
                error: KvError::Stale { .. } | KvError::UnknownSeq { .. },
                ..
            } if released_since => Verdict::Gone,
            Error::NotResident { .. } => Verdict::Gone,
            Error::Kv {
                error: KvError::KvExhausted { .. },
                ..
            }
            | Error::OutOfMemory { .. }
            | Error::Busy { .. } => Verdict::Benign,
            Error::Backend { .. } if injected(e) => Verdict::Benign,
            _ => Verdict::Wrong,
        }
    }

    /// Handles a failed call on owned sequence `i` (or a cache-wide call when `None`).
    fn paged_failed(&mut self, what: &str, e: &Error, i: Option<usize>) {
        let epoch = i.map(|i| self.paged[i].epoch);
        match self.paged_verdict(e, epoch) {
            Verdict::Gone => {
                if matches!(e, Error::NotResident { .. }) {
                    // Another thread released the cache: bring it back (its sequences are
                    // gone; ours are dropped when their calls say so).
                    let _ = self.retry(|| self.pager.resume(&[PAGED_TAG]));
                } else if let Some(i) = i {
                    self.paged.swap_remove(i);
                }
            }
            Verdict::Benign => {}
            Verdict::Wrong => self.fail(what, e),
        }
    }

    /// One random paged step.
    pub(crate) fn paged_op(&mut self) {
        if self.paged_io.is_none() {
            return;
        }
        self.sh.count(Op::Paged);
        match self.rng.below(100) {
            0..25 => self.paged_new(),
            25..40 => self.paged_append(),
            40..52 => self.paged_fork(),
            52..75 => self.paged_verify(),
            75..85 => self.paged_free(),
            85..92 => self.paged_swap(),
            92..98 => {
                if let Some(io) = &self.paged_io {
                    let kv = io.kv;
                    if let Err(e) = self.retry(|| kv.trim()) {
                        self.paged_failed("paged trim", &e, None);
                    }
                }
            }
            _ => self.paged_cycle(),
        }
    }

    fn paged_pick(&mut self) -> Option<usize> {
        (!self.paged.is_empty()).then(|| self.rng.below(self.paged.len()))
    }

    /// Writes fresh bytes into tokens `from..to` of owned sequence `i` (copy-on-write first),
    /// every layer, and records them. Returns false (after handling) when a call failed;
    /// then nothing is recorded for the tokens, so the model keeps the old bytes — write
    /// failures are only ever benign before the kernel runs.
    fn paged_write(&mut self, i: usize, from: u64, to: u64) -> bool {
        let Some(io) = &self.paged_io else {
            return false;
        };
        let (kv, keys, values) = (io.kv, io.keys.clone(), io.values.clone());
        let id = self.paged[i].id;
        // Slots carry no generation: hold the cache resident from prepare_write to the last
        // write, or a release and another thread's allocation in between would put this
        // thread's keys into that thread's blocks (the documented contract of `write`).
        let _lease = match self.pager.lease(&[PAGED_TAG]) {
            Ok(l) => l,
            Err(e) => {
                self.paged_failed("paged lease", &e, Some(i));
                return false;
            }
        };
        let slots = match self.retry(|| kv.prepare_write(id, from..to)) {
            Ok(s) => s,
            Err(e) => {
                self.paged_failed("paged prepare_write", &e, Some(i));
                return false;
            }
        };
        let n = slots.len();
        let layers = self.paged[i].data.len();
        for layer in 0..layers {
            let k = random_window(self.rng.next_u64(), 0, n * TOKEN);
            let v = random_window(self.rng.next_u64(), 0, n * TOKEN);
            let pager = self.pager;
            let r = self
                .retry(|| pager.write(&keys, 0, &k))
                .and_then(|()| self.retry(|| pager.write(&values, 0, &v)))
                .and_then(|()| kv.write(layer as u32, &keys, &values, n, TOKEN, &slots));
            if let Err(e) = r {
                // A release between prepare_write and here invalidates the sequence; the
                // layers written so far hold bytes the model does not know, so the
                // sequence is dropped unless the failure was before any kernel ran.
                self.paged_failed("paged write", &e, Some(i));
                if i < self.paged.len() && self.paged[i].id == id && layer > 0 {
                    self.paged_drop(i);
                }
                return false;
            }
            let (a, b) = (from as usize * TOKEN, to as usize * TOKEN);
            for (plane, new) in self.paged[i].data[layer].iter_mut().zip([k, v]) {
                plane.resize(plane.len().max(b), 0);
                plane[a..b].copy_from_slice(&new);
            }
        }
        true
    }

    /// Forgets owned sequence `i` and frees it (whatever the cache says about it).
    fn paged_drop(&mut self, i: usize) {
        let s = self.paged.swap_remove(i);
        if let Some(io) = &self.paged_io {
            let _ = io.kv.free_seq(s.id);
        }
    }

    fn paged_new(&mut self) {
        if self.paged.len() >= MAX_SEQS {
            return self.paged_free();
        }
        let Some(io) = &self.paged_io else { return };
        let kv = io.kv;
        let before = self.paged_epoch();
        let id = match kv.create_seq() {
            Ok(id) => id,
            Err(e) => return self.paged_failed("paged create_seq", &e, None),
        };
        if self.paged_epoch() != before {
            // Created across a release: which side of it is unknown; let it go.
            let _ = kv.free_seq(id);
            return;
        }
        let layers = layout().layers() as usize;
        self.paged.push(PagedSeq {
            id,
            epoch: before,
            data: vec![[Vec::new(), Vec::new()]; layers],
        });
        let i = self.paged.len() - 1;
        self.paged_append_to(i);
    }

    fn paged_append(&mut self) {
        match self.paged_pick() {
            Some(i) => self.paged_append_to(i),
            None => self.paged_new(),
        }
    }

    fn paged_append_to(&mut self, i: usize) {
        let Some(io) = &self.paged_io else { return };
        let kv = io.kv;
        let (id, len) = (self.paged[i].id, self.paged[i].tokens());
        let room = (MAX_SEQ_TOKENS as u64).saturating_sub(len);
        if room == 0 {
            return self.paged_check(i);
        }
        let n = 1 + self.rng.below(MAX_TOKENS.min(room as usize)) as u64;
        if let Err(e) = self.retry(|| kv.append_tokens(id, n)) {
            return self.paged_failed("paged append", &e, Some(i));
        }
        if !self.paged_write(i, len, len + n) && i < self.paged.len() && self.paged[i].id == id {
            // The tokens were appended but not written: their contents are unknown.
            let _ = kv.truncate(id, len);
        }
    }

    fn paged_fork(&mut self) {
        if self.paged.len() >= MAX_SEQS {
            return;
        }
        let Some(i) = self.paged_pick() else { return };
        let Some(io) = &self.paged_io else { return };
        let kv = io.kv;
        let parent = self.paged[i].clone();
        let child = match kv.fork(parent.id) {
            Ok(c) => c,
            Err(e) => return self.paged_failed("paged fork", &e, Some(i)),
        };
        self.paged.push(PagedSeq {
            id: child,
            ..parent
        });
        let c = self.paged.len() - 1;
        let len = self.paged[c].tokens();
        if len > 0 {
            let from = self.rng.below(len as usize) as u64;
            let to = (from + 1 + self.rng.below(24) as u64).min(len);
            self.paged_write(c, from, to);
        }
    }

    /// Gathers every layer's K and V of owned sequence `i` and compares.
    fn paged_check(&mut self, i: usize) {
        let Some(io) = &self.paged_io else { return };
        let (kv, out) = (io.kv, io.out.clone());
        let s = self.paged[i].clone();
        for (layer, planes) in s.data.iter().enumerate() {
            for (plane, want) in [Kv::K, Kv::V].into_iter().zip(planes) {
                let n = match kv.gather(layer as u32, plane, s.id, &out) {
                    Ok(n) => n as usize,
                    Err(e) => return self.paged_failed("paged gather", &e, Some(i)),
                };
                if n * TOKEN != want.len() {
                    self.sh.corruption(format!(
                        "{}: paged sequence {} has {n} tokens, {} were written",
                        self.name,
                        s.id,
                        want.len() / TOKEN
                    ));
                    return self.paged_drop(i);
                }
                let mut got = vec![0u8; want.len()];
                let pager = self.pager;
                if let Err(e) = self.retry(|| pager.read(&out, 0, &mut got)) {
                    return self.fail("paged read-back", &e);
                }
                if got != *want {
                    self.sh.corruption(format!(
                        "{}: paged sequence {} layer {layer} {plane:?} differs from what was \
                         written",
                        self.name, s.id
                    ));
                    return self.paged_drop(i);
                }
            }
        }
    }

    fn paged_verify(&mut self) {
        if let Some(i) = self.paged_pick() {
            self.paged_check(i);
        }
    }

    fn paged_free(&mut self) {
        let Some(i) = self.paged_pick() else { return };
        let Some(io) = &self.paged_io else { return };
        let id = self.paged[i].id;
        match io.kv.free_seq(id) {
            Ok(_) => {
                self.paged.swap_remove(i);
            }
            Err(e) => self.paged_failed("paged free", &e, Some(i)),
        }
    }

    /// Preemption: swap a sequence out, free it, bring it back into new blocks, check.
    fn paged_swap(&mut self) {
        let Some(i) = self.paged_pick() else { return };
        let Some(io) = &self.paged_io else { return };
        let kv = io.kv;
        let s = self.paged[i].clone();
        let result = (|| -> Result<SeqId> {
            let (table, tokens) = kv.block_table(s.id)?;
            let mut host = self.retry(|| kv.alloc_host(table.len() as u32))?;
            kv.swap_out(&table, &mut host)?;
            kv.free_seq(s.id)?;
            let id = kv.create_seq()?;
            let fresh = self.retry(|| kv.append_tokens(id, tokens));
            let blocks = match fresh {
                Ok(b) => b,
                Err(e) => {
                    let _ = kv.free_seq(id);
                    return Err(e);
                }
            };
            kv.swap_in(&blocks, &host)?;
            Ok(id)
        })();
        match result {
            Ok(id) => {
                self.paged[i].id = id;
                self.paged_check(i);
            }
            Err(e) => {
                // Part of the round trip may have happened (the old sequence freed): the
                // sequence is no longer trustworthy either way.
                self.paged_failed("paged swap", &e, Some(i));
                if i < self.paged.len() && self.paged[i].id == s.id {
                    self.paged_drop(i);
                }
            }
        }
    }

    /// Releases and resumes the cache: every thread's sequences become stale.
    fn paged_cycle(&mut self) {
        let pager = self.pager;
        match self.retry(|| pager.release(&[PAGED_TAG])) {
            Ok(_) | Err(Error::Busy { .. }) => {}
            Err(e) => self.fail("paged release", &e),
        }
        if let Err(e) = self.retry(|| pager.resume(&[PAGED_TAG]))
            && self.paged_verdict(&e, None) == Verdict::Wrong
        {
            self.fail("paged resume", &e);
        }
    }

    /// At the end of the run: check and free every owned sequence.
    pub(crate) fn paged_finish(&mut self) {
        if self.paged_io.is_none() {
            return;
        }
        let pager = self.pager;
        if let Err(e) = self.retry(|| pager.resume(&[PAGED_TAG]))
            && !matches!(e, Error::OutOfMemory { .. })
        {
            self.fail("paged resume at the end", &e);
        }
        while let Some(i) = self.paged.len().checked_sub(1) {
            let id = self.paged[i].id;
            self.paged_check(i);
            if self.paged.last().is_some_and(|s| s.id == id) {
                self.paged_drop(self.paged.len() - 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn token_matches_the_layout() {
        assert_eq!(super::TOKEN as u64, super::layout().token_bytes());
    }
}
