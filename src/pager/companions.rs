//! Companions: work registered to move with a tag, such as a transport's registration of
//! the KV cache, a communicator's buffers or the caller's own memory outside the pager. A
//! release runs each of the released tags' companions after the contents are saved and
//! before the memory is unmapped; a resume runs them after the memory is mapped and the
//! contents are restored. A companion that fails undoes the move: the companions that ran
//! are undone in reverse order and the regions stay as they were ([`Error::Companion`]).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Pager;
use crate::error::{Error, Result};

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
    /// release. Returns the identity [`Pager::remove_companion`] takes.
    pub fn add_companion(&self, tag: &str, companion: Arc<dyn Companion>) -> Result<u64> {
        self.check_process()?;
        super::check_tag(tag)?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        self.companions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(Entry {
                id,
                tag: tag.to_owned(),
                companion,
            });
        Ok(id)
    }

    /// Unregisters the companion `id` (from [`Pager::add_companion`]): once this returns it
    /// is not called again (a move running it now finishes first). `InvalidArgument` if no
    /// companion of this pager has that identity.
    pub fn remove_companion(&self, id: u64) -> Result<()> {
        let mut list = self.companions.write().unwrap_or_else(|p| p.into_inner());
        let Some(at) = list.iter().position(|e| e.id == id) else {
            return Err(Error::invalid(
                None,
                format!(
                    "companion {id} is not registered with this pager (removed already, or \
                     from another device's pager); remove each companion once"
                ),
            ));
        };
        list.remove(at);
        Ok(())
    }

    /// Runs `phase` for the companions of `tags` (the regions that move, in tag order). On a
    /// failure the ones that ran are undone in reverse order and the error names the
    /// companion; an undo that fails too is a deferred error.
    pub(super) fn run_companions(&self, phase: Phase, tags: &[&str]) -> Result<()> {
        // Held while the companions run, so that once `remove_companion` returns, no move
        // calls the removed one again.
        let list = self.companions.read().unwrap_or_else(|p| p.into_inner());
        if list.is_empty() {
            return Ok(());
        }
        let mut ran: Vec<(&str, &Entry)> = Vec::new();
        for &tag in tags {
            let mine: Vec<&Entry> = list.iter().filter(|e| e.tag == tag).collect();
            let ordered: Box<dyn Iterator<Item = &&Entry>> = match phase {
                Phase::Resume => Box::new(mine.iter()),
                Phase::Release => Box::new(mine.iter().rev()),
            };
            for &e in ordered {
                if let Err(reason) = call(e.companion.as_ref(), phase, tag) {
                    self.undo_companions(phase, &ran);
                    return Err(Error::Companion {
                        tag: tag.to_owned(),
                        companion: e.companion.name().to_owned(),
                        phase: phase.name(),
                        reason,
                    });
                }
                ran.push((tag, e));
            }
        }
        Ok(())
    }

    /// Undoes the `phase` calls in `ran`, newest first.
    fn undo_companions(&self, phase: Phase, ran: &[(&str, &Entry)]) {
        let undo = phase.opposite();
        for (tag, e) in ran.iter().rev() {
            if let Err(reason) = call(e.companion.as_ref(), undo, tag) {
                self.backend.deferred_errors().record(format!(
                    "companion `{}` of region `{tag}` failed to undo its {} after another \
                     companion failed: {reason}",
                    e.companion.name(),
                    phase.name()
                ));
            }
        }
    }
}
