//! Backup media: [`Medium`] (which one a region uses), the rules each one brings (its arms in
//! the one `impl Medium`), [`Store`] (where a backup's bytes are, one implementation per
//! medium: `memory.rs`, `file.rs`) and [`Media`], the context the media need beyond the
//! backend, which the pager owns and lends whole to its regions. A new medium is its store
//! in a file of its own, its variant with one arm per rule, and its context in `Media` if
//! it needs one.

use std::ops::Range;
use std::sync::Arc;

use super::file::FileIo;
use super::ledger::Share;
use super::memory::MemoryStore;
use crate::backend::{Backend, BackendResult};
use crate::pump::{Pump, Sink};

/// What the media need beyond the backend, owned by the pager and lent whole to each region
/// and backup: the file medium's directory and I/O.
#[derive(Debug)]
pub(crate) struct Media {
    pub(crate) files: Arc<FileIo>,
    /// The node's budget for backups in host memory (`usize::MAX`: none).
    host_budget: usize,
}

impl Media {
    /// The media of a new pager: file I/O staging `file_chunk_bytes` at a time, backups in
    /// host memory within `host_budget` bytes for the node's processes together.
    pub(crate) fn new(file_chunk_bytes: usize, host_budget: usize) -> Media {
        Media {
            files: Arc::new(FileIo::new(file_chunk_bytes, host_budget)),
            host_budget,
        }
    }

    /// `bytes` of host memory for backups, within the node's budget.
    pub(crate) fn reserve(&self, bytes: usize) -> BackendResult<Share> {
        Share::within(bytes, self.host_budget)
    }
}

/// Where a `Preserve` region's contents go while it is released (its backup medium).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Pinned host memory, pinned once and kept across cycles: the fastest, and a release
    /// of unchanged contents copies nothing; holds host memory for the region's life.
    #[default]
    Pinned,
    /// Pinned host memory that each resume gives back to the system (the process's memory
    /// use drops), pinned again at the next release, for hosts that need their memory
    /// between rollouts (torch_memory_saver's "mmap" backend). A resume may keep it
    /// ([`crate::ResumeOptions::keep_host_backups`]).
    Host,
    /// A file in the pager's backup directory ([`crate::Pager::set_backup_dir`]), streamed
    /// through a bounded pinned staging buffer, for hosts whose memory cannot hold every
    /// GPU's weights (torch_memory_saver's disk backup). The file is allocated on disk when
    /// the backup is made, so a full disk fails the release before anything is unmapped.
    File,
}

crate::names::short_names!(Medium, "medium", {
    Pinned => "pinned",
    Host => "host",
    File => "file",
});

impl std::fmt::Display for Medium {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a backup's bytes are: one implementation per backup medium ([`Medium`]). A new
/// medium is a store in a file of its own, its variant of [`Medium`] with its arms in the
/// `impl Medium` below, and its name in the bindings.
pub(super) trait Store: std::fmt::Debug + Send + Sync {
    /// Bytes the store holds room for.
    fn len(&self) -> usize;

    /// The bytes, where they are in host memory (read in place, and lent to readers by
    /// address); `None` for a store that must be read through [`Store::read`].
    fn host(&self) -> Option<&[u8]>;

    /// Copies the store's bytes `range` into `out` (of `range.len()` bytes).
    fn read(&self, range: Range<usize>, out: &mut [u8]) -> BackendResult<()>;

    /// Copies device bytes `base + r` into the store at `r` for each of `runs` (sorted,
    /// disjoint, inside the store): pushed into `pump`, or done before it returns. Returns
    /// the bytes copied. A failure leaves the store partly written.
    ///
    /// # Safety
    /// Each `base + r` is mapped device memory of `backend` (the pump's), not written until
    /// the pump's scope returns.
    unsafe fn save<'h>(
        &'h mut self,
        backend: &dyn Backend,
        base: u64,
        runs: &[Range<usize>],
        pump: &mut Pump<'_, 'h>,
    ) -> BackendResult<usize>;

    /// Copies the store's bytes `r` to device `base + r` for each of `spans` (inside the
    /// store): pushed into `sink`, or done before it returns. Returns the bytes sent.
    ///
    /// # Safety
    /// As [`Sink::push_to_device`] for each device range `base + r`.
    unsafe fn restore<'h>(
        &'h self,
        backend: &dyn Backend,
        base: u64,
        spans: &[Range<usize>],
        sink: &mut Sink<'_, '_, 'h>,
    ) -> BackendResult<usize>;
}

/// What each medium means for the pager: the one place its rules live, next to the stores.
impl Medium {
    /// Whether the backup's host memory is given back after each resume (pinned again at
    /// the next release).
    pub fn gives_back_after_resume(self) -> bool {
        match self {
            Medium::Host => true,
            Medium::Pinned | Medium::File => false,
        }
    }

    /// Whether `prepin` (pinning the backup at creation) makes sense: only for pinned host
    /// memory kept across cycles; not for a backup that each resume gives back, nor for a
    /// file, which has no host memory to pin (and whose early creation would turn a full
    /// disk into a failure at model load).
    pub fn can_prepin(self) -> bool {
        match self {
            Medium::Pinned => true,
            Medium::Host | Medium::File => false,
        }
    }

    /// Whether the backup lives in the pager's backup directory (file I/O).
    pub fn uses_files(self) -> bool {
        match self {
            Medium::File => true,
            Medium::Pinned | Medium::Host => false,
        }
    }

    /// Whether the backup is one pinned host buffer ([`Backup::adopt`]): such backups are
    /// pinned many in one batch, and a first one is pinned and filled from the device in
    /// one pass ([`Backup::ensure_from_device`]).
    pub(crate) fn is_pinned_memory(self) -> bool {
        match self {
            Medium::Pinned | Medium::Host => true,
            Medium::File => false,
        }
    }

    /// A new store of `size` bytes: pinned on `backend`, or a file in `media`'s directory.
    pub(super) fn store(
        self,
        backend: &dyn Backend,
        media: &Media,
        size: usize,
    ) -> BackendResult<Box<dyn Store>> {
        Ok(match self {
            Medium::Pinned | Medium::Host => {
                let share = media.reserve(size)?;
                Box::new(MemoryStore(backend.alloc_pinned(size)?, share))
            }
            Medium::File => Box::new(media.files.create(size)?),
        })
    }
}
