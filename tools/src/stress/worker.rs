//! One stress thread: random operations on the shared tags, each one checked.
//!
//! Every buffer belongs to the thread that allocated it; only its owner writes it, so the
//! owner knows what it must hold. Other threads release and resume the tags under it at any
//! time; the owner checks its buffers under a lease (which keeps the tag resident) after
//! every resume it observes.

use std::time::{Duration, Instant};

mod marks;
mod paged;
pub(crate) use paged::{
    IO_TAG, MAX_SEQ_TOKENS, MAX_TOKENS, PAGED_TAG, PagedIo, TOKEN, layout as paged_layout,
};

use super::StressConfig;
use super::content::{Content, FillHashes, Rng, random_window};
use super::shared::{KV, Op, Shared, TAGS};
use gpu_pager::backend::BackendError;
use gpu_pager::kernels::reference;
use gpu_pager::{Buffer, DEFAULT_ALIGN, Error, Move, Outcome, Pager, Policy, Report, Result};
use gpu_pager_testkit::Hog;

/// Attempts of one operation that keeps meeting injected faults.
const MAX_RETRIES: usize = 64;
/// Buffers a thread owns per tag at most.
const MAX_OWN_PER_TAG: usize = 6;
/// How long a thread may fail to get its tags resident (hogs, races) before it reports.
const STARVATION: Duration = Duration::from_secs(60);

/// A buffer and what its owner knows about it.
#[derive(Debug)]
pub(crate) struct Owned {
    pub buf: Buffer,
    /// Index into [`TAGS`].
    pub tag: usize,
    pub content: Content,
    /// Allocation order within the owner (orders the buffer against its owner's resumes).
    seq: u64,
    /// The tag's release count when `content` was last written (read under the lease).
    written_at: u64,
    /// The owner's overwritten marks on the buffer (see `marks`).
    marked: marks::Marked,
}

fn tag_names(set: &[usize]) -> Vec<&'static str> {
    set.iter().map(|&t| TAGS[t].0).collect()
}

fn policy(t: usize) -> Policy {
    TAGS[t].1
}

pub(crate) fn injected(e: &Error) -> bool {
    matches!(
        e,
        Error::Backend {
            error: BackendError::Injected { .. },
            ..
        }
    )
}

/// Outcomes that leave the pager consistent and that concurrent use legitimately meets.
fn benign(e: &Error) -> bool {
    matches!(
        e,
        Error::Busy { .. }
            | Error::NotResident { .. }
            | Error::OutOfMemory { .. }
            | Error::RegionFull { .. }
    )
}

/// One stress thread's state.
pub(crate) struct Worker<'a> {
    name: String,
    pager: &'a Pager,
    cfg: &'a StressConfig,
    sh: &'a Shared,
    rng: Rng,
    pub owned: Vec<Owned>,
    memo: FillHashes,
    /// Next allocation's sequence number.
    seq: u64,
    /// `Shared::resumes` as of this thread's last check of each tag.
    seen_resumes: [u64; 4],
    /// Set when a resume by this thread brought the tag back: buffers allocated before
    /// (sequence number below this) hold their backup (Preserve) or zeroes (DiscardZeroed).
    fresh: [Option<u64>; 4],
    /// The paged KV cache and this thread's io buffers (none for the final check).
    paged_io: Option<PagedIo<'a>>,
    /// This thread's sequences in the paged cache.
    paged: Vec<paged::PagedSeq>,
}

impl<'a> Worker<'a> {
    pub fn new(
        name: String,
        pager: &'a Pager,
        cfg: &'a StressConfig,
        sh: &'a Shared,
        seed: u64,
    ) -> Self {
        Worker {
            name,
            pager,
            cfg,
            sh,
            rng: Rng::new(seed),
            owned: Vec::new(),
            memo: FillHashes::default(),
            seq: 0,
            seen_resumes: [0; 4],
            fresh: [None; 4],
            paged_io: None,
            paged: Vec::new(),
        }
    }

    /// Gives the thread sequences of the shared paged KV cache to work on.
    pub fn with_paged(mut self, io: PagedIo<'a>) -> Self {
        self.paged_io = Some(io);
        self
    }

    /// Takes over buffers of other threads (the final check); they count as allocated before
    /// anything this worker does.
    pub fn adopt(&mut self, owned: Vec<Owned>) {
        self.seq = owned.iter().map(|o| o.seq + 1).max().unwrap_or(0);
        self.owned = owned;
    }

    /// Random operations until the run's deadline; returns the buffers still owned.
    pub fn run(mut self) -> Vec<Owned> {
        for t in 0..TAGS.len() {
            self.alloc(t);
        }
        while !self.sh.should_stop() {
            self.verify_observed();
            self.step();
        }
        self.paged_finish();
        self.owned
    }

    fn step(&mut self) {
        match self.rng.below(1000) {
            0..150 => self.release_random(),
            150..290 => self.resume_random(),
            290..370 => {
                let t = self.rng.below(TAGS.len());
                self.alloc(t)
            }
            370..420 => self.free_random(),
            420..500 => self.fill_own(false),
            500..550 => self.fill_own(true),
            550..610 => self.host_write_own(),
            610..660 => self.kv_op(),
            660..710 => self.paged_op(),
            710..760 => self.lease_hold(),
            760..830 => self.verify_random(),
            830..860 => self.mark_own(),
            860..940 => self.readback_random(),
            940..945 => self.free_backup_random(),
            _ if self.cfg.faults && self.rng.chance(400) => self.hog_cycle(),
            _ => self.verify_random(),
        }
    }

    // ---- error handling -------------------------------------------------------------

    fn fail(&self, what: &str, e: &Error) {
        self.sh.error(format!("{}: {what}: {e}", self.name));
    }

    /// Whether `e` is an `OutOfMemory` explained by this run's hog: one was held when the
    /// call started (`g0` odd) or was taken or dropped during it.
    fn hog_oom(&self, e: &Error, g0: u64) -> bool {
        matches!(e, Error::OutOfMemory { .. })
            && (g0 % 2 == 1 || Shared::get(&self.sh.hog_gen) != g0)
    }

    /// Runs `op` again after each injected fault. Faults are counted as seen, and as
    /// recovered once an attempt ends in success or a benign outcome.
    fn retry<T>(&self, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        let mut pending = 0;
        let mut last = None;
        for _ in 0..MAX_RETRIES {
            match op() {
                Err(e) if injected(&e) => {
                    pending += 1;
                    Shared::add(&self.sh.faults_seen, 1);
                    drain_absorbed(self.pager, self.sh);
                    last = Some(e);
                }
                r => {
                    if r.as_ref().err().is_none_or(benign) {
                        Shared::add(&self.sh.faults_recovered, pending);
                    }
                    return r;
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::InvalidArgument {
            tag: None,
            reason: "no attempt made".to_owned(),
        }))
    }

    /// Books a release or resume report.
    fn note(&mut self, rep: &Report) {
        for r in rep.regions.iter().filter(|r| r.outcome == Outcome::Done) {
            Shared::add(&self.sh.cycles, 1);
            Shared::add(&self.sh.bytes_moved, (r.bytes + r.copied) as u64);
            if rep.op == Move::Resume
                && let Some(t) = TAGS.iter().position(|(n, _)| *n == r.tag)
            {
                Shared::add(&self.sh.resumes[t], 1);
                self.fresh[t] = Some(self.seq);
            }
        }
    }

    // ---- residency --------------------------------------------------------------------

    /// Resumes `set`, waiting out the hog; false (error recorded) on anything unexpected.
    fn resume(&mut self, set: &[usize], what: &str) -> bool {
        let tags = tag_names(set);
        let pager = self.pager;
        let start = Instant::now();
        loop {
            let g0 = Shared::get(&self.sh.hog_gen);
            match self.retry(|| pager.resume(&tags)) {
                Ok(rep) => {
                    self.note(&rep);
                    return true;
                }
                Err(e) if self.hog_oom(&e, g0) && start.elapsed() < STARVATION => {
                    self.sh.count(Op::OomWait);
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => {
                    self.fail(what, &e);
                    return false;
                }
            }
        }
    }

    /// Runs `f` with `set` resident and leased, resuming first as often as other threads
    /// release it meanwhile. Buffers of tags this thread brought back are checked first.
    fn with_lease<T>(
        &mut self,
        set: &[usize],
        what: &str,
        f: impl FnOnce(&mut Self) -> T,
    ) -> Option<T> {
        let tags = tag_names(set);
        let start = Instant::now();
        loop {
            if !self.resume(set, what) {
                return None;
            }
            match self.pager.lease(&tags) {
                Ok(lease) => {
                    for &t in set {
                        if let Some(before) = self.fresh[t].take() {
                            self.verify_tag(t, Some(before));
                        }
                    }
                    let out = f(self);
                    drop(lease);
                    return Some(out);
                }
                Err(Error::NotResident { .. }) if start.elapsed() < STARVATION => {
                    self.sh.count(Op::LeaseRace)
                }
                Err(e) => {
                    self.fail(what, &e);
                    return None;
                }
            }
        }
    }

    // ---- checks ---------------------------------------------------------------------------

    /// Checks tag `t`'s base address and every buffer this thread owns in it (under a
    /// lease). `fresh`: a resume by this thread brought the tag back, and buffers with a
    /// sequence number below it were allocated before that resume, so a `DiscardZeroed`
    /// one must hold zeroes.
    fn verify_tag(&mut self, t: usize, fresh: Option<u64>) {
        self.sh.count(Op::Verify);
        self.seen_resumes[t] = Shared::get(&self.sh.resumes[t]);
        let tag = TAGS[t].0;
        match self.pager.info(tag) {
            Ok(i) if i.base == self.sh.bases[t] => {}
            Ok(i) => self.sh.error(format!(
                "{}: `{tag}` moved from {:#x} to {:#x}",
                self.name, self.sh.bases[t], i.base
            )),
            Err(e) => self.fail("region info", &e),
        }
        for k in 0..self.owned.len() {
            if self.owned[k].tag == t {
                self.verify_buffer(k, fresh);
            }
        }
    }

    fn verify_buffer(&mut self, k: usize, fresh: Option<u64>) {
        if self.settle_marked(k) {
            return;
        }
        let vchunk = self.cfg.verify_chunk_bytes;
        let o = &self.owned[k];
        let (t, buf) = (o.tag, o.buf.clone());
        let want_ptr = self.sh.bases[t] + buf.offset() as u64;
        match self.pager.ptr(&buf) {
            Ok(p) if p == want_ptr => {}
            Ok(p) => self.sh.error(format!(
                "{}: `{}` buffer at +{:#x} has address {p:#x}, not {want_ptr:#x}",
                self.name,
                buf.tag(),
                buf.offset()
            )),
            Err(e) => self.fail("pointer lookup under a lease", &e),
        }
        let is_fresh = fresh.is_some_and(|s| o.seq < s);
        let want = match policy(t) {
            Policy::Discard => None,
            Policy::DiscardZeroed if is_fresh => Some(self.memo.hashes(0, buf.len(), vchunk)),
            _ => o.content.hashes().map(<[u64]>::to_vec),
        };
        let Some(want) = want else { return };
        let got = match self.pager.hash(&buf, vchunk) {
            Ok(h) => h,
            Err(e) => return self.fail("hash under a lease", &e),
        };
        let zeroed = policy(t) == Policy::DiscardZeroed;
        // A DiscardZeroed buffer may have been zeroed by anyone's resume since it was
        // written; once seen zeroed (or just resumed by its owner), zeroes are expected.
        let now_zero = zeroed
            && if got == want {
                is_fresh
            } else {
                got == self.memo.hashes(0, buf.len(), vchunk)
            };
        if now_zero {
            self.owned[k].content = Content::Fill {
                pattern: 0,
                hashes: got,
            };
            return;
        }
        if got == want {
            return;
        }
        let bad = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        let o = &self.owned[k];
        self.sh.corruption(format!(
            "{}: `{}` buffer at +{:#x} ({} bytes, {}{}): hash chunk {bad} of {} differs \
             ({vchunk}-byte chunks; got {:#018x}, want {:#018x})",
            self.name,
            buf.tag(),
            buf.offset(),
            buf.len(),
            o.content.describe(),
            if is_fresh {
                ", just resumed by its owner"
            } else {
                ""
            },
            want.len(),
            got.get(bad).copied().unwrap_or(0),
            want.get(bad).copied().unwrap_or(0),
        ));
        // Report each damage once.
        self.owned[k].content = Content::Unknown;
    }

    /// Verifies tags that another thread brought back since this one last looked.
    fn verify_observed(&mut self) {
        for t in 0..TAGS.len() {
            let now = Shared::get(&self.sh.resumes[t]);
            if now == self.seen_resumes[t] {
                continue;
            }
            let known = self
                .owned
                .iter()
                .any(|o| o.tag == t && o.content != Content::Unknown);
            if policy(t) == Policy::Discard || !known {
                self.seen_resumes[t] = now;
                continue;
            }
            self.with_lease(&[t], "verifying after a resume", |w| w.verify_tag(t, None));
        }
    }

    /// Reads `len` bytes at `offset` of owned buffer `k` back and compares them.
    fn readback(&mut self, k: usize, offset: usize, len: usize) {
        self.settle_marked(k);
        let o = &self.owned[k];
        let Some(want) = o.content.window(offset, len) else {
            return;
        };
        let (t, buf) = (o.tag, o.buf.clone());
        self.sh.count(Op::Readback);
        let mut got = vec![0u8; len];
        let pager = self.pager;
        if let Err(e) = self.retry(|| pager.read(&buf, offset, &mut got)) {
            return self.fail("read-back", &e);
        }
        if got == want {
            return;
        }
        if policy(t) == Policy::DiscardZeroed && got.iter().all(|&b| b == 0) {
            let hashes = self.memo.hashes(0, buf.len(), self.cfg.verify_chunk_bytes);
            self.owned[k].content = Content::Fill { pattern: 0, hashes };
            return;
        }
        let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        let n = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        let end = (first + 8).min(len);
        self.sh.corruption(format!(
            "{}: `{}` buffer at +{:#x} ({} bytes, {}): read-back of {len} bytes at {offset}: \
             {n} differ, first at {}: got {:02x?}, want {:02x?}",
            self.name,
            buf.tag(),
            buf.offset(),
            buf.len(),
            self.owned[k].content.describe(),
            offset + first,
            &got[first..end],
            &want[first..end],
        ));
        self.owned[k].content = Content::Unknown;
    }

    // ---- operations -------------------------------------------------------------------

    /// A random owned buffer satisfying `f`.
    fn pick(&mut self, f: impl Fn(&Owned) -> bool) -> Option<usize> {
        let c: Vec<usize> = (0..self.owned.len())
            .filter(|&k| f(&self.owned[k]))
            .collect();
        (!c.is_empty()).then(|| c[self.rng.below(c.len())])
    }

    fn release_random(&mut self) {
        let set = self.rng.subset(TAGS.len());
        let tags = tag_names(&set);
        let pager = self.pager;
        self.sh.count(Op::Release);
        match self.retry(|| pager.release(&tags)) {
            Ok(rep) => self.note(&rep),
            Err(Error::Busy { .. }) => self.sh.count(Op::Busy),
            Err(e) => self.fail("release", &e),
        }
    }

    fn resume_random(&mut self) {
        let set = self.rng.subset(TAGS.len());
        self.sh.count(Op::Resume);
        if self.resume(&set, "resume") {
            let back: Vec<usize> = set
                .into_iter()
                .filter(|&t| self.fresh[t].is_some())
                .collect();
            if !back.is_empty() {
                // The lease checks what came back.
                self.with_lease(&back, "checking a resume", |_| ());
            }
        }
    }

    fn alloc(&mut self, t: usize) {
        if self.owned.iter().filter(|o| o.tag == t).count() >= MAX_OWN_PER_TAG {
            return;
        }
        let tag = TAGS[t].0;
        let size = self.sh.sizes[t];
        let max = self
            .cfg
            .max_buffer_bytes
            .min(size / (self.cfg.threads * 4))
            .max(1);
        let len = self.rng.len(max);
        let align = if self.rng.below(8) == 0 {
            1usize << (8 + self.rng.below(9))
        } else {
            DEFAULT_ALIGN
        };
        self.sh.count(Op::Alloc);
        match self.pager.alloc_aligned(tag, len, align) {
            Ok(buf) => {
                if buf.len() != len || buf.offset() % align != 0 || buf.offset() + len > size {
                    self.sh.error(format!(
                        "{}: alloc of {len} bytes aligned {align} in `{tag}` gave {} bytes at \
                         +{:#x} (region {size} bytes)",
                        self.name,
                        buf.len(),
                        buf.offset()
                    ));
                }
                self.owned.push(Owned {
                    buf,
                    tag: t,
                    content: Content::Unknown,
                    seq: self.seq,
                    written_at: 0,
                    marked: marks::Marked::default(),
                });
                self.seq += 1;
            }
            Err(Error::RegionFull { .. }) => self.sh.count(Op::RegionFull),
            Err(e) => self.fail("alloc", &e),
        }
    }

    fn free_random(&mut self) {
        if self.owned.is_empty() {
            return;
        }
        let k = self.rng.below(self.owned.len());
        let o = self.owned.swap_remove(k);
        self.sh.count(Op::Free);
        if let Err(e) = self.pager.free(&o.buf) {
            return self.fail("free", &e);
        }
        // A second free and any use of the freed handle are refused.
        match (self.pager.free(&o.buf), self.pager.ptr(&o.buf)) {
            (Err(Error::StaleBuffer { .. }), Err(Error::StaleBuffer { .. })) => {}
            other => self.sh.error(format!(
                "{}: a freed buffer was not refused as stale: {other:?}",
                self.name
            )),
        }
    }

    /// Fills owned buffer `k` (under a lease) with `pattern` through the pager or, `raw`, by
    /// launching the fill kernel at its raw address as an engine would; then checks the
    /// device hash against the reference.
    fn fill(&mut self, k: usize, pattern: u32, raw: bool) {
        let vchunk = self.cfg.verify_chunk_bytes;
        let buf = self.owned[k].buf.clone();
        self.sh.count(if raw { Op::RawFill } else { Op::Fill });
        let r = if raw {
            self.raw_fill(&buf, pattern)
        } else {
            self.pager.fill(&buf, pattern)
        };
        if let Err(e) = r {
            self.owned[k].content = Content::Unknown;
            return self.fail(if raw { "raw fill" } else { "fill" }, &e);
        }
        let want = self.memo.hashes(pattern, buf.len(), vchunk);
        match self.pager.hash(&buf, vchunk) {
            Ok(got) if got == want => {}
            Ok(_) => self.sh.corruption(format!(
                "{}: `{}` buffer at +{:#x} ({} bytes) filled with {pattern:#010x}: the device \
                 hash differs from the reference right after the fill",
                self.name,
                buf.tag(),
                buf.offset(),
                buf.len()
            )),
            Err(e) => self.fail("hash after fill", &e),
        }
        self.owned[k].content = Content::Fill {
            pattern,
            hashes: want,
        };
        self.owned[k].written_at = self.releases_now(self.owned[k].tag);
    }

    /// The fill kernel at the buffer's raw device address, outside the pager.
    fn raw_fill(&self, buf: &Buffer, pattern: u32) -> Result<()> {
        let addr = self.pager.ptr(buf)?;
        // SAFETY: the caller holds a lease on the buffer's region, so the region is mapped
        // and cannot be released meanwhile; the buffer is live and owned by this thread, so
        // nothing else writes or frees it; `addr .. addr + len` is exactly the buffer.
        unsafe { self.pager.backend().fill(addr, buf.len(), pattern) }.map_err(|e| Error::Backend {
            tags: vec![buf.tag().to_owned()],
            op: "a raw fill",
            error: e,
        })
    }

    fn fill_own(&mut self, raw: bool) {
        let Some(k) = self.pick(|o| policy(o.tag) != Policy::Discard) else {
            return;
        };
        let t = self.owned[k].tag;
        let pattern = self.rng.next_u64() as u32;
        self.with_lease(&[t], "fill", |w| w.fill(k, pattern, raw));
    }

    fn host_write_own(&mut self) {
        let max = self.cfg.max_host_write_bytes;
        let Some(k) = self.pick(|o| policy(o.tag) == Policy::Preserve && o.buf.len() <= max) else {
            return;
        };
        let t = self.owned[k].tag;
        let seed = self.rng.next_u64();
        let check = self.rng.below(4) == 0;
        self.with_lease(&[t], "host write", |w| {
            let buf = w.owned[k].buf.clone();
            let data = random_window(seed, 0, buf.len());
            w.sh.count(Op::HostWrite);
            let pager = w.pager;
            if let Err(e) = w.retry(|| pager.write(&buf, 0, &data)) {
                w.owned[k].content = Content::Unknown;
                return w.fail("host write", &e);
            }
            let hashes = reference::chunk_hash(&data, w.cfg.verify_chunk_bytes);
            w.owned[k].content = Content::Bytes { seed, hashes };
            w.owned[k].written_at = w.releases_now(t);
            if check {
                w.readback(k, 0, buf.len());
            }
        });
    }

    /// A KV-cache step on a Discard buffer: fill and hash it, then write a window from the
    /// host and read it back, all under one lease (sometimes with another tag leased too).
    fn kv_op(&mut self) {
        if self.pick(|o| o.tag == KV).is_none() {
            self.alloc(KV);
        }
        let Some(k) = self.pick(|o| o.tag == KV) else {
            return;
        };
        let mut set = vec![KV];
        let other = self.rng.below(TAGS.len() * 2);
        if other < TAGS.len() && other != KV {
            set.push(other);
        }
        let pattern = self.rng.next_u64() as u32;
        let seed = self.rng.next_u64();
        let len = self.owned[k].buf.len();
        let n = self.rng.len(len.min(self.cfg.max_host_write_bytes));
        let offset = self.rng.below(len - n + 1);
        self.with_lease(&set, "KV operation", |w| {
            w.sh.count(Op::Kv);
            w.fill(k, pattern, false);
            w.owned[k].content = Content::Bytes {
                seed,
                hashes: Vec::new(),
            };
            let buf = w.owned[k].buf.clone();
            let data = random_window(seed, offset, n);
            let pager = w.pager;
            match w.retry(|| pager.write(&buf, offset, &data)) {
                Ok(()) => w.readback(k, offset, n),
                Err(e) => w.fail("KV write", &e),
            }
            w.owned[k].content = Content::Unknown;
        });
    }

    fn lease_hold(&mut self) {
        let set = self.rng.subset(TAGS.len());
        let pause = Duration::from_micros(self.rng.below(2000) as u64);
        self.sh.count(Op::Lease);
        self.with_lease(&set.clone(), "lease", |w| {
            for t in set {
                if policy(t) != Policy::Discard {
                    w.verify_tag(t, None);
                }
            }
            std::thread::sleep(pause);
        });
    }

    fn verify_random(&mut self) {
        let Some(k) = self.pick(|o| policy(o.tag) != Policy::Discard) else {
            return;
        };
        let t = self.owned[k].tag;
        self.with_lease(&[t], "verify", |w| w.verify_tag(t, None));
    }

    fn readback_random(&mut self) {
        let Some(k) =
            self.pick(|o| policy(o.tag) != Policy::Discard && o.content != Content::Unknown)
        else {
            return;
        };
        let len = self.owned[k].buf.len();
        let n = self.rng.len(len.min(self.cfg.readback_bytes));
        let offset = self.rng.below(len - n + 1);
        let t = self.owned[k].tag;
        self.with_lease(&[t], "read-back", |w| w.readback(k, offset, n));
    }

    fn free_backup_random(&mut self) {
        let t = if self.rng.below(2) == 0 { 0 } else { 3 };
        self.sh.count(Op::FreeBackup);
        match self.pager.free_backup(TAGS[t].0) {
            // Refused while the region is released with its contents in the backup.
            Ok(_) | Err(Error::BackupInUse { .. }) => {}
            Err(e) => self.fail("free_backup", &e),
        }
    }

    /// Out of memory at resume: release a tag, take nearly all free device memory the way
    /// a trainer would, resume the tag (which must fail with `OutOfMemory`), drop the hog,
    /// resume again (which must succeed with the contents intact).
    fn hog_cycle(&mut self) {
        let Ok(_one_hogger) = self.sh.hog_lock.try_lock() else {
            return;
        };
        let t = self.rng.below(TAGS.len());
        let tag = [TAGS[t].0];
        let pager = self.pager;
        match self.retry(|| pager.release(&tag)) {
            Ok(rep) => self.note(&rep),
            Err(Error::Busy { .. }) => return self.sh.count(Op::Busy),
            Err(e) => return self.fail("release before a hog", &e),
        }
        self.sh.count(Op::Hog);
        Shared::add(&self.sh.hog_gen, 1);
        let oom = self.hogged_resume(t);
        Shared::add(&self.sh.hog_gen, 1);
        if !oom {
            return;
        }
        match self.retry(|| pager.resume(&tag)) {
            Ok(rep) => {
                self.note(&rep);
                Shared::add(&self.sh.faults_recovered, 1);
                self.with_lease(&[t], "checking a resume after a hog", |_| ());
            }
            Err(e) => self.sh.error(format!(
                "{}: unrecovered: resume of `{}` failed after the memory hog was dropped: {e}",
                self.name, tag[0]
            )),
        }
    }

    /// With a hog leaving less than half of tag `t`'s size free, resumes `t`. True when it
    /// failed with `OutOfMemory` as it should (false when memory moved meanwhile).
    fn hogged_resume(&mut self, t: usize) -> bool {
        let backend = self.pager.backend();
        let free = match backend.mem_info() {
            Ok(m) => m.free,
            Err(e) => {
                self.sh
                    .error(format!("{}: mem_info before a hog: {e}", self.name));
                return false;
            }
        };
        let bytes = free.saturating_sub(self.sh.sizes[t] / 2);
        // The hog itself may fail when other threads resumed meanwhile: then no fault.
        let Some(hog) = (bytes > 0)
            .then(|| Hog::take(self.sh.trainer.as_ref(), bytes).ok())
            .flatten()
        else {
            return false;
        };
        let tag = [TAGS[t].0];
        let pager = self.pager;
        let oom = match self.retry(|| pager.resume(&tag)) {
            Err(Error::OutOfMemory { .. }) => {
                Shared::add(&self.sh.oom_injected, 1);
                true
            }
            Ok(rep) => {
                self.note(&rep);
                false
            }
            Err(e) => {
                self.fail("resume under a hog", &e);
                false
            }
        };
        drop(hog);
        oom
    }

    // ---- the end ------------------------------------------------------------------------

    /// Resumes everything, checks every owned buffer (hash and read-back of its ends).
    pub fn final_check(&mut self) {
        let all: Vec<usize> = (0..TAGS.len()).collect();
        let window = self.cfg.readback_bytes;
        self.with_lease(&all, "final check", |w| {
            for t in 0..TAGS.len() {
                if policy(t) != Policy::Discard {
                    w.verify_tag(t, None);
                }
            }
            for k in 0..w.owned.len() {
                if policy(w.owned[k].tag) == Policy::Discard {
                    continue;
                }
                let len = w.owned[k].buf.len();
                let n = len.min(window);
                w.readback(k, 0, n);
                if len > n {
                    w.readback(k, len - n, n);
                }
            }
        });
    }

    /// Frees every owned buffer.
    pub fn free_all(&mut self) {
        for o in std::mem::take(&mut self.owned) {
            if let Err(e) = self.pager.free(&o.buf) {
                self.fail("final free", &e);
            }
        }
    }
}

/// Counts and drops the backend's deferred records of map faults that a failing resume
/// absorbed ([`gpu_pager::ABSORBED_MAP_ERROR`]); drained after every fault, so that the
/// sink's cap on kept messages never loses one.
pub(crate) fn drain_absorbed(pager: &Pager, sh: &Shared) {
    let absorbed = pager
        .backend()
        .deferred_errors()
        .take()
        .iter()
        .filter(|e| e.starts_with(gpu_pager::ABSORBED_MAP_ERROR) && e.contains("injected fault"))
        .count() as u64;
    Shared::add(&sh.faults_absorbed, absorbed);
}
