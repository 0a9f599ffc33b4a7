//! Overwritten marks in the stress: owners mark and unmark their own buffers now and then
//! ([`gpu_pager::Pager::set_overwritten`]), while any thread may release the tag.
//!
//! A release skips the bytes marked at that moment, so after it a marked `Preserve`
//! buffer's contents are undefined: its owner does not check them, but rewrites the buffer
//! (the "update") and checks that the write took, so it must be mapped and writable. Every
//! other buffer, its neighbours included, is checked as strictly as ever. The owner knows
//! which releases may have skipped a buffer from the tag's release count
//! ([`gpu_pager::Pager::releases`]), read under a lease (no release can run then): a mark
//! set when the count was `m` exposes the buffer to every release counted after `m`, until
//! it is cleared at count `u`.

use gpu_pager::Policy;

use super::{Op, TAGS, Worker, policy};

/// The owner's marks on one buffer (whole-buffer marks).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Marked {
    /// Marked now, since the tag's release count was this.
    since: Option<u64>,
    /// A window `(m, u]` of release counts during which the buffer was marked, cleared when
    /// it no longer matters (the contents were written after it).
    past: Option<(u64, u64)>,
}

impl Worker<'_> {
    /// Tag `t`'s release count (exact under a lease); 0 with an error recorded if the tag
    /// is gone (then nothing counts as skipped: the checks stay strict).
    pub(super) fn releases_now(&self, t: usize) -> u64 {
        match self.pager.releases(TAGS[t].0) {
            Ok(n) => n,
            Err(e) => {
                self.fail("release count", &e);
                0
            }
        }
    }

    /// Under a lease: if a release skipped owned buffer `k` (marked at that release, after
    /// its contents were written), rewrites it with a fresh fill, checked right away, and
    /// returns true: its old contents are undefined, and must not be checked.
    pub(super) fn settle_marked(&mut self, k: usize) -> bool {
        let t = self.owned[k].tag;
        if policy(t) != Policy::Preserve {
            // Marks change nothing in Discard regions: their checks stay as they are.
            return false;
        }
        let marked = self.owned[k].marked;
        if marked.since.is_none() && marked.past.is_none() {
            return false;
        }
        let now = self.releases_now(t);
        let w = self.owned[k].written_at;
        let skipped = marked.since.is_some_and(|m| now > w.max(m))
            || marked.past.is_some_and(|(m, u)| u > w.max(m));
        // A past window matters no more: the contents were written after it, or are
        // rewritten now.
        self.owned[k].marked.past = None;
        if !skipped {
            return false;
        }
        self.sh.count(Op::MarkedRewrite);
        let pattern = self.rng.next_u64() as u32;
        self.fill(k, pattern, false);
        true
    }

    /// Marks a random owned buffer overwritten, or clears its mark, under a lease of its
    /// tag; checks that the pager reports the marks as set.
    pub(super) fn mark_own(&mut self) {
        let Some(k) = self.pick(|_| true) else {
            return;
        };
        let t = self.owned[k].tag;
        self.with_lease(&[t], "mark", |w| {
            w.settle_marked(k);
            let now = w.releases_now(t);
            let buf = w.owned[k].buf.clone();
            let on = w.owned[k].marked.since.is_none();
            w.sh.count(Op::Mark);
            if let Err(e) = w.pager.set_overwritten(&buf, 0..buf.len(), on) {
                return w.fail("set_overwritten", &e);
            }
            let m = &mut w.owned[k].marked;
            match m.since.take() {
                Some(since) => m.past = Some((since, now)),
                None => m.since = Some(now),
            }
            let want: Vec<_> = std::iter::once(0..buf.len()).filter(|_| on).collect();
            match w.pager.overwritten(&buf) {
                Ok(got) if got == want => {}
                Ok(got) => w.sh.error(format!(
                    "{}: `{}` buffer at +{:#x} ({} bytes): marks {got:?}, want {want:?}",
                    w.name,
                    buf.tag(),
                    buf.offset(),
                    buf.len()
                )),
                Err(e) => w.fail("overwritten", &e),
            }
        });
    }
}
