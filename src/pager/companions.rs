//! Companions: work registered to move with a tag, such as a transport's registration of
//! the KV cache, a communicator's buffers or the caller's own memory outside the pager. A
//! release runs each of the released tags' companions after the contents are saved and
//! before the memory is unmapped; a resume runs them after the memory is mapped and the
//! contents are restored. A companion that fails undoes the move: the companions that ran
//! are undone in reverse order and the regions stay as they were ([`Error::Companion`]).
//!
//! While its companions run, the thread holds the move's regions locked. It records them
//! (a thread-local list), so that a companion's read-only queries of them (`info`, `ptr`,
//! `stats`, `audit`, `buffer_containing`, `read`, ...) are answered from the held regions
//! instead of waiting for a lock this thread holds, and a move, free or removal of them
//! fails at once. The companion list is copied for each move, not held locked across the
//! calls: a nested move and a concurrent `add_companion` cannot deadlock.

use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use super::Pager;
use crate::error::{Error, Result};
use crate::region::Region;

thread_local! {
    /// The regions this thread holds locked while it runs companions, with their pager
    /// (its address).
    static HELD: RefCell<Vec<(usize, *const Region)>> = const { RefCell::new(Vec::new()) };
}

/// Takes what [`Pager::run_companions`] put on [`HELD`] off again when dropped.
struct Held(usize);

impl Drop for Held {
    fn drop(&mut self) {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            let keep = h.len().saturating_sub(self.0);
            h.truncate(keep);
        });
    }
}

/// A region as [`Pager::on_region`] lends it: held by this thread while its companions run
/// (its memory mapped, its state not yet flipped), or locked for the call.
pub(super) enum Access<'a> {
    Held(&'a Region),
    Locked(std::sync::MutexGuard<'a, Region>),
}

impl Access<'_> {
    pub(super) fn region(&self) -> &Region {
        match self {
            Access::Held(r) => r,
            Access::Locked(g) => g,
        }
    }

    /// Whether the region is in the middle of a move (its companions run).
    pub(super) fn moving(&self) -> bool {
        matches!(self, Access::Held(_))
    }

    /// Waits for a restore enqueued on the caller's stream (a locked region also forgets
    /// its fence; a held one is not changed).
    pub(super) fn settle(&mut self) -> Result<()> {
        match self {
            Access::Held(r) => r.wait_pending(),
            Access::Locked(g) => g.settle(),
        }
    }
}

/// Whether this thread is running a companion (of any pager).
fn in_companion() -> bool {
    HELD.with(|h| !h.borrow().is_empty())
}

/// What a companion says when it fails: any error, shown in [`Error::Companion`].
pub type CompanionError = Box<dyn std::error::Error + Send + Sync>;

/// Work that moves with a tag ([`Pager::add_companion`]). Both calls run with the tag's
/// region locked, so they must not release, resume or remove that tag, nor add or remove
/// companions, nor wait for a thread that may be allocating in the tag; they may run on any
/// thread that releases or resumes the tag. [`Pager::remove`] of a resident region does not
/// run them (removal is not a release).
pub trait Companion: Send + Sync {
    /// The name errors and logs give it, e.g. `"kv transport registration"`.
    fn name(&self) -> &str;
    /// Runs when `tag` is released, after its contents are saved and before its memory is
    /// unmapped: the memory is still mapped and holds its contents.
    fn before_release(&self, tag: &str) -> std::result::Result<(), CompanionError>;
    /// Runs when `tag` is resumed, after its memory is mapped and its contents restored
    /// (with [`Pager::resume_on`], enqueued on the caller's stream: a companion that reads
    /// the contents orders itself after that stream); also to undo a
    /// [`Companion::before_release`] whose release failed.
    fn after_resume(&self, tag: &str) -> std::result::Result<(), CompanionError>;
}

/// Which move a companion call belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Release,
    Resume,
}

impl Phase {
    fn opposite(self) -> Phase {
        match self {
            Phase::Release => Phase::Resume,
            Phase::Resume => Phase::Release,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Phase::Release => "release",
            Phase::Resume => "resume",
        }
    }
}

/// A registered companion.
pub(super) struct Entry {
    id: u64,
    tag: String,
    companion: Arc<dyn Companion>,
    /// Whether it was removed, and how many of its calls run now.
    calls: Mutex<(bool, usize)>,
    /// Signalled when a call ends.
    ended: Condvar,
}

impl Entry {
    /// Counts a call about to start; `false` once the companion was removed.
    fn enter(&self) -> bool {
        let mut c = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        if c.0 {
            return false;
        }
        c.1 += 1;
        true
    }

    fn leave(&self) {
        let mut c = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        c.1 -= 1;
        self.ended.notify_all();
    }

    /// Marks it removed and, unless `waiting` is off, waits for its running calls to end.
    fn retire(&self, waiting: bool) {
        let mut c = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        c.0 = true;
        while waiting && c.1 > 0 {
            c = self.ended.wait(c).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Runs `phase` of the companion unless it was removed (`None` then).
    fn run(&self, phase: Phase, tag: &str) -> Option<std::result::Result<(), String>> {
        if !self.enter() {
            return None;
        }
        let r = call(self.companion.as_ref(), phase, tag);
        self.leave();
        Some(r)
    }
}

/// Identities of companions, unique in the process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Calls `phase`'s method of `c` for `tag`; a panic is a failure like an error.
fn call(c: &dyn Companion, phase: Phase, tag: &str) -> std::result::Result<(), String> {
    let run = || match phase {
        Phase::Release => c.before_release(tag),
        Phase::Resume => c.after_resume(tag),
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(payload) => Err(format!(
            "panicked: {}",
            payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".to_owned())
        )),
    }
}

impl Pager {
    /// Registers `companion` to move with region `tag` (which need not exist yet): each
    /// release of `tag` runs its [`Companion::before_release`], each resume its
    /// [`Companion::after_resume`] (see the module docs for when, and what a failure
    /// undoes). A tag's companions run in registration order on resume and in reverse on
    /// release. A release or resume of `tag` running when it is added does not call it: it
    /// runs from the next move on. Returns the identity [`Pager::remove_companion`] takes.
    /// `InvalidArgument` when called from a companion (register companions before the
    /// moves, not during one).
    pub fn add_companion(&self, tag: &str, companion: Arc<dyn Companion>) -> Result<u64> {
        self.check_process()?;
        super::check_tag(tag)?;
        if in_companion() {
            return Err(Error::invalid(
                Some(tag),
                "add_companion was called from inside a companion, while a release or resume \
                 runs it; register companions before the moves, not during one",
            ));
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        self.companions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::new(Entry {
                id,
                tag: tag.to_owned(),
                companion,
                calls: Mutex::new((false, 0)),
                ended: Condvar::new(),
            }));
        Ok(id)
    }

    /// Unregisters the companion `id` (from [`Pager::add_companion`]): once this returns it
    /// is not called again (a call running it now on another thread finishes first; from
    /// inside a companion it does not wait). `InvalidArgument` if no companion of this
    /// pager has that identity.
    pub fn remove_companion(&self, id: u64) -> Result<()> {
        let entry = {
            let mut list = self.companions.write().unwrap_or_else(|p| p.into_inner());
            let Some(at) = list.iter().position(|e| e.id == id) else {
                return Err(Error::invalid(
                    None,
                    format!(
                        "companion {id} is not registered with this pager (removed already, \
                         or from another device's pager); remove each companion once"
                    ),
                ));
            };
            list.remove(at)
        };
        entry.retire(!in_companion());
        Ok(())
    }

    /// Runs `f` on the region that `pick` chooses among those this thread holds locked
    /// while it runs this pager's companions (`None` when it holds none such).
    pub(super) fn with_held<T>(
        &self,
        pick: impl Fn(&Region) -> bool,
        f: impl FnOnce(&Region) -> T,
    ) -> Option<T> {
        self.with_held_or(pick, (), |r, ()| f(r)).ok()
    }

    /// [`Pager::with_held`] that hands `arg` to `f`, or back when this thread holds no such
    /// region.
    fn with_held_or<A, T>(
        &self,
        pick: impl Fn(&Region) -> bool,
        arg: A,
        f: impl FnOnce(&Region, A) -> T,
    ) -> std::result::Result<T, A> {
        let me = std::ptr::from_ref(self) as usize;
        let region = HELD.with(|h| {
            h.borrow()
                .iter()
                .filter(|(p, _)| *p == me)
                // SAFETY: run_companions put these pointers here from shared borrows of
                // regions it holds locked, and takes them off before those borrows end;
                // only this thread reads its list, and nothing mutates those regions while
                // their companions run (other threads wait for the locks, and this thread
                // is inside run_companions, under shared borrows).
                .map(|&(_, r)| unsafe { &*r })
                .find(|r| pick(r))
                .map(std::ptr::from_ref)
        });
        match region {
            // SAFETY: as above: the region stays held and unmutated until this call returns.
            Some(region) => Ok(f(unsafe { &*region }, arg)),
            None => Err(arg),
        }
    }

    /// Runs `f` on region `tag`: the one this thread holds in a companion call of its move
    /// if it does, else the region behind `slot()` locked for the call.
    pub(super) fn on_region<T>(
        &self,
        tag: &str,
        slot: impl FnOnce() -> Result<super::Slot>,
        f: impl FnOnce(&mut Access<'_>) -> Result<T>,
    ) -> Result<T> {
        match self.with_held_or(|r| r.tag == tag, f, |r, f| f(&mut Access::Held(r))) {
            Ok(done) => done,
            Err(f) => {
                let slot = slot()?;
                f(&mut Access::Locked(super::lock(&slot)))
            }
        }
    }

    /// An error when this thread holds region `tag` locked in a companion call of this
    /// pager: a move, free or removal of it would wait for itself.
    pub(super) fn not_held(&self, tag: &str) -> Result<()> {
        if self.with_held(|r| r.tag == tag, |_| ()).is_some() {
            return Err(Error::invalid(
                Some(tag),
                format!(
                    "region `{tag}` is being released or resumed by this thread, which runs \
                     its companions now: a companion may look at it (info, ptr, read, \
                     stats) but not move, free, allocate in or remove it; do that after the \
                     move returns"
                ),
            ));
        }
        Ok(())
    }
}

/// The companions of a move's tags, taken once when the move starts: one added while the
/// move runs is not called by it (a release that found none unmaps beside its copies, so a
/// companion added then would run after the memory is gone), one removed meanwhile is not
/// called once its removal returned.
pub(super) struct Moving(Vec<Arc<Entry>>);

impl Moving {
    /// The companions registered now for any of `tags`.
    pub(super) fn of(pager: &Pager, tags: &[&str]) -> Moving {
        let list = pager.companions.read().unwrap_or_else(|p| p.into_inner());
        Moving(
            list.iter()
                .filter(|e| tags.contains(&e.tag.as_str()))
                .cloned()
                .collect(),
        )
    }

    /// Whether there are none.
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Runs `phase` for `companions` (those of the move's tags, taken when it started) of
/// `tags` (the regions that move, in tag order), with `held` (every region the move holds
/// locked) recorded for this thread's queries.
/// On a failure the ones that ran are undone in reverse order and the error names the
/// companion; an undo that fails too is a deferred error.
pub(super) fn run(
    pager: &Pager,
    companions: &Moving,
    phase: Phase,
    tags: &[&str],
    held: &[&Region],
) -> Result<()> {
    let list = &companions.0;
    if list.is_empty() {
        return Ok(());
    }
    let me = std::ptr::from_ref(pager) as usize;
    HELD.with(|h| {
        h.borrow_mut()
            .extend(held.iter().map(|r| (me, std::ptr::from_ref::<Region>(r))))
    });
    let _held = Held(held.len());
    let mut ran: Vec<(&str, &Entry)> = Vec::new();
    for &tag in tags {
        let mine: Vec<&Entry> = list.iter().filter(|e| e.tag == tag).map(|e| &**e).collect();
        let ordered: Box<dyn Iterator<Item = &&Entry>> = match phase {
            Phase::Resume => Box::new(mine.iter()),
            Phase::Release => Box::new(mine.iter().rev()),
        };
        for &e in ordered {
            match e.run(phase, tag) {
                None => continue,
                Some(Ok(())) => ran.push((tag, e)),
                Some(Err(reason)) => {
                    undo(pager, phase, &ran);
                    return Err(Error::Companion {
                        tag: tag.to_owned(),
                        companion: e.companion.name().to_owned(),
                        phase: phase.name(),
                        reason,
                    });
                }
            }
        }
    }
    Ok(())
}

/// Undoes the `phase` calls in `ran`, newest first.
fn undo(pager: &Pager, phase: Phase, ran: &[(&str, &Entry)]) {
    let undo = phase.opposite();
    for (tag, e) in ran.iter().rev() {
        if let Some(Err(reason)) = e.run(undo, tag) {
            pager.backend.deferred_errors().record(format!(
                "companion `{}` of region `{tag}` failed to undo its {} after another \
                 companion failed: {reason}",
                e.companion.name(),
                phase.name()
            ));
        }
    }
}
