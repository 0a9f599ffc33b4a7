//! File backups ([`super::Medium::File`]): a `Preserve` region's contents in a file on the
//! host's disk, for hosts whose memory cannot hold every GPU's weights.
//!
//! Bytes move between the device and the file through the pager's one pinned staging buffer
//! ([`FileIo`], two halves of [`crate::Tuning::file_chunk_bytes`]): the copy of one
//! chunk over the link overlaps the disk I/O of the other, so a move runs at the disk's
//! speed and never needs host memory for the whole region.
//!
//! A pager keeps all its backups in one directory in one file ([`Spool`]) that has no name:
//! it is opened with `O_TMPFILE` (or created under a random name and removed at once where
//! the filesystem lacks `O_TMPFILE`), so nothing outlives the process however it ends, no
//! other user can plant, take or block a name, and a pager holds one descriptor per
//! directory it used, not one per backup. Each backup is an extent of that file, allocated
//! on disk when the backup is made (`posix_fallocate`), so a full disk fails the release up
//! front, before anything is unmapped, and the region stays resident. Dropping a backup
//! punches its extent out of the file, giving the disk space back.
//!
//! Where the backups must be seen in the directory ([`BackupFiles::Named`], the
//! torch_memory_saver drop-in's layout), each has a file of its own instead
//! ([`super::named`]).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::Store;
use super::ledger::Share;
use super::named::{self, Owner};
use crate::backend::{
    Backend, BackendError, BackendResult, Direction, Fence, HostBuffer, Mover, RawCopy,
};
use crate::pump::{Pump, Sink};

/// The environment variable that sets a new pager's backup directory
/// ([`crate::Pager::set_backup_dir`] changes it later and wins over it).
pub const BACKUP_DIR_ENV: &str = "GPU_PAGER_BACKUP_DIR";

/// How a pager's file backups appear in their directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackupFiles {
    /// One file per pager and directory that has no name there (the default): nothing
    /// outlives the process however it ends, and the disk use shows in `df`, not in the
    /// directory.
    #[default]
    Unnamed,
    /// One file per backup, named `gpu-pager-<id>-<n>.backup` (`<id>` random per process and
    /// directory), as torch_memory_saver names its files: the directory shows what a release
    /// put on disk. The files go with their backups and at exit; those of a process that
    /// was killed go when the next process writes named backups in that directory.
    Named,
}

/// Largest staging half (1 GiB): pinned once per pager, so a larger one only costs host
/// memory, and it keeps `2 * chunk` and every file offset computed from it in range.
pub const MAX_FILE_CHUNK_BYTES: usize = 1 << 30;

/// Smallest staging half (one page).
const MIN_FILE_CHUNK_BYTES: usize = 4096;

/// A file chunk size within the bounds a [`FileIo`] works in.
pub(crate) fn clamp_chunk(bytes: usize) -> usize {
    bytes.clamp(MIN_FILE_CHUNK_BYTES, MAX_FILE_CHUNK_BYTES)
}

/// Backups start on this boundary in the spool, so that punching one out never touches a
/// block of another.
const EXTENT_ALIGN: u64 = 4096;

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The free and used extents of a spool: first fit over the holes, else the file grows.
#[derive(Debug, Default)]
struct Extents {
    /// End of the last extent in use (the file's logical size).
    end: u64,
    /// Holes below `end`, by start: start → length (disjoint, never adjacent).
    free: BTreeMap<u64, u64>,
}

impl Extents {
    /// Takes an extent of `len` bytes (rounded up to [`EXTENT_ALIGN`]); returns its start.
    fn take(&mut self, len: u64) -> Option<u64> {
        let len = len
            .checked_next_multiple_of(EXTENT_ALIGN)?
            .max(EXTENT_ALIGN);
        if let Some((&at, &hole)) = self.free.iter().find(|&(_, &l)| l >= len) {
            self.free.remove(&at);
            if hole > len {
                self.free.insert(at + len, hole - len);
            }
            return Some(at);
        }
        let at = self.end;
        self.end = at.checked_add(len).filter(|&e| e <= i64::MAX as u64)?;
        Some(at)
    }

    /// Gives back the extent of `len` bytes at `at` (as [`Extents::take`] rounded it),
    /// merging it with neighbouring holes; returns the file's new logical size.
    fn give(&mut self, at: u64, len: u64) -> u64 {
        let len = len.next_multiple_of(EXTENT_ALIGN).max(EXTENT_ALIGN);
        let (mut start, mut end) = (at, at + len);
        if let Some((&s, &l)) = self.free.range(..start).next_back()
            && s + l == start
        {
            self.free.remove(&s);
            start = s;
        }
        if let Some(l) = self.free.remove(&end) {
            end += l;
        }
        if end == self.end {
            self.end = start;
        } else {
            self.free.insert(start, end - start);
        }
        self.end
    }
}

/// One unnamed file in a backup directory holding every backup a pager made there.
#[derive(Debug)]
pub(crate) struct Spool {
    /// The directory it lives in (for messages: the file itself has no name).
    dir: PathBuf,
    file: File,
    /// The process that opened it: a fork child shares the descriptor, and must neither
    /// allocate in it nor punch the parent's extents out of it.
    pid: u32,
    extents: Mutex<Extents>,
}

impl Spool {
    /// Opens a new unnamed file in `dir` and checks that it can be written.
    fn open(dir: &Path) -> BackendResult<Spool> {
        let file =
            open_unnamed(dir).map_err(|e| file_error("creating a backup file in", dir, e))?;
        file.write_all_at(&[0u8], 0)
            .and_then(|()| file.set_len(0))
            .map_err(|e| file_error("writing a backup file in", dir, e))?;
        Ok(Spool {
            dir: dir.to_owned(),
            file,
            pid: std::process::id(),
            extents: Mutex::new(Extents::default()),
        })
    }

    fn is_ours(&self) -> bool {
        self.pid == std::process::id()
    }
}

/// Opens a new file in `dir` that has no name, readable and writable by this user only:
/// `O_TMPFILE` (never linkable: `O_EXCL`), or on filesystems without it a new file under a
/// random name, removed at once.
fn open_unnamed(dir: &Path) -> io::Result<File> {
    let unnamed = OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE | libc::O_EXCL | libc::O_CLOEXEC)
        .open(dir);
    match unnamed {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR)) => {}
        other => return other,
    }
    for _ in 0..16 {
        let path = dir.join(format!(".gpu-pager-{:032x}", named::random()?));
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            other => other?,
        };
        std::fs::remove_file(&path)?;
        return Ok(file);
    }
    Err(io::Error::from_raw_os_error(libc::EEXIST))
}

/// Where a pager's new file backups go: the directory, how they are named there, and what
/// they go to there once opened.
#[derive(Debug, Default)]
struct Target {
    dir: Option<PathBuf>,
    files: BackupFiles,
    open: Option<Dest>,
}

/// What new backups in a directory go to: the pager's spool, or this process's owner of
/// named files.
#[derive(Debug, Clone)]
enum Dest {
    Spool(Arc<Spool>),
    Owner(Arc<Owner>),
}

impl Dest {
    fn is_ours(&self) -> bool {
        match self {
            Dest::Spool(s) => s.is_ours(),
            Dest::Owner(o) => o.is_ours(),
        }
    }
}

impl Target {
    /// Opens what new backups in `dir` go to (checking that the directory can be written).
    fn open(dir: PathBuf, files: BackupFiles) -> BackendResult<Target> {
        let mut t = Target {
            dir: Some(dir),
            files,
            open: None,
        };
        t.ready()?;
        Ok(t)
    }

    /// What new backups go to, opened if this process has nothing open there (a fork child
    /// must not use its parent's).
    fn ready(&mut self) -> BackendResult<Dest> {
        if let Some(d) = self.open.as_ref().filter(|d| d.is_ours()) {
            return Ok(d.clone());
        }
        let dir = self.dir.clone().ok_or_else(|| BackendError::Invalid {
            op: "creating a file backup",
            reason: format!(
                "no backup directory is set; set one on the pager (set_backup_dir) or in \
                 {BACKUP_DIR_ENV}, on a real disk rather than tmpfs"
            ),
        })?;
        std::fs::create_dir_all(&dir)
            .map_err(|e| file_error("creating the backup directory", &dir, e))?;
        let dest = match self.files {
            BackupFiles::Unnamed => Dest::Spool(Arc::new(Spool::open(&dir)?)),
            BackupFiles::Named => Dest::Owner(
                Owner::in_dir(&dir)
                    .map_err(|e| file_error("creating a backup file in", &dir, e))?,
            ),
        };
        self.open = Some(dest.clone());
        Ok(dest)
    }
}

/// What a pager shares between its file backups: the directory and spool new backups go
/// to, and the pinned staging buffer every transfer streams through (one transfer at a
/// time).
#[derive(Debug)]
pub(crate) struct FileIo {
    target: Mutex<Target>,
    /// Bytes per half of the staging buffer.
    chunk: usize,
    /// The node's budget for host memory, which the staging buffer counts against.
    host_budget: usize,
    staging: Mutex<Option<(Box<dyn HostBuffer>, Share)>>,
}

impl FileIo {
    /// File I/O with staging halves of `chunk` bytes (clamped to 4 KiB ..=
    /// [`MAX_FILE_CHUNK_BYTES`]) and the directory from [`BACKUP_DIR_ENV`] if it is set
    /// (made absolute now: a later `chdir` does not move it). The directory is created and
    /// checked when the first backup is made. The staging buffer, pinned at the first
    /// transfer, counts against `host_budget` (the node's budget for host memory).
    pub fn new(chunk: usize, host_budget: usize) -> FileIo {
        let dir = std::env::var_os(BACKUP_DIR_ENV)
            .filter(|d| !d.is_empty())
            .and_then(|d| std::path::absolute(d).ok());
        FileIo {
            target: Mutex::new(Target {
                dir,
                ..Target::default()
            }),
            chunk: clamp_chunk(chunk),
            host_budget,
            staging: Mutex::new(None),
        }
    }

    /// The directory new backups go to.
    pub fn dir(&self) -> Option<PathBuf> {
        locked(&self.target).dir.clone()
    }

    /// How new backups are named.
    pub fn files(&self) -> BackupFiles {
        locked(&self.target).files
    }

    /// Makes `dir` (made absolute; created if missing) the directory of new backups, named
    /// as `files` says, after opening what they will go to there (and writing it). Backups
    /// made before stay where they are. An empty path, or one that cannot be used, changes
    /// nothing.
    pub fn set_dir(&self, dir: &Path, files: BackupFiles) -> BackendResult<()> {
        if dir.as_os_str().is_empty() {
            return Err(BackendError::Invalid {
                op: "setting the backup directory",
                reason: "the path is empty; pass a directory on a real disk".to_owned(),
            });
        }
        let dir = std::path::absolute(dir)
            .map_err(|e| file_error("finding the backup directory", dir, e))?;
        let mut target = locked(&self.target);
        if target.dir.as_deref() == Some(dir.as_path())
            && target.files == files
            && target.open.as_ref().is_some_and(Dest::is_ours)
        {
            // The same directory again: keep its spool (a new one would be one more open
            // descriptor per call).
            return Ok(());
        }
        *target = Target::open(dir, files)?;
        Ok(())
    }

    /// A new backup of `len` bytes, all of them allocated on disk.
    pub fn create(self: &Arc<Self>, len: usize) -> BackendResult<FileStore> {
        // What the backup goes to, taken under the lock; the file work happens outside it.
        let (dest, dir) = {
            let mut target = locked(&self.target);
            (target.ready()?, target.dir.clone().unwrap_or_default())
        };
        let spool = match dest {
            Dest::Spool(spool) => spool,
            Dest::Owner(owner) => {
                let (path, id) = owner
                    .create(len as u64)
                    .map_err(|e| file_error("allocating a backup file in", &dir, e))?;
                return Ok(FileStore {
                    place: Place::Named { owner, path, id },
                    len,
                    io: self.clone(),
                });
            }
        };
        let too_big = || BackendError::Invalid {
            op: "creating a file backup",
            reason: format!("{len} bytes do not fit in a file"),
        };
        let at = locked(&spool.extents)
            .take(u64::try_from(len).map_err(|_| too_big())?)
            .ok_or_else(too_big)?;
        // The store gives the extent back if allocating it fails.
        let store = FileStore {
            place: Place::Extent { spool, at },
            len,
            io: self.clone(),
        };
        if let Place::Extent { spool, at } = &store.place
            && len > 0
        {
            // SAFETY: a plain system call on the spool's descriptor; the extent is this
            // store's (`take` keeps it inside an off_t).
            let rc = unsafe {
                libc::posix_fallocate(
                    spool.file.as_raw_fd(),
                    *at as libc::off_t,
                    len as libc::off_t,
                )
            };
            if rc != 0 {
                return Err(file_error(
                    "allocating a backup file in",
                    &spool.dir,
                    io::Error::from_raw_os_error(rc),
                ));
            }
        }
        Ok(store)
    }

    /// Runs `f` with the staging buffer (pinned on first use), one transfer at a time.
    fn with_staging<T>(
        &self,
        backend: &dyn Backend,
        f: impl FnOnce(&mut dyn HostBuffer) -> BackendResult<T>,
    ) -> BackendResult<T> {
        let mut slot = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            let share = Share::within(2 * self.chunk, self.host_budget).map_err(|e| match e {
                BackendError::HostBudget {
                    budget,
                    requested,
                    shares,
                    ..
                } => BackendError::HostBudget {
                    budget,
                    requested,
                    shares,
                    staging: true,
                },
                e => e,
            })?;
            *slot = Some((backend.alloc_pinned(2 * self.chunk)?, share));
        }
        match slot.as_mut() {
            Some((buf, _)) => f(buf.as_mut()),
            None => Err(BackendError::Internal {
                op: "file backup",
                reason: "no staging buffer".to_owned(),
            }),
        }
    }
}

/// A copy into a staging half, with the file range it goes to.
type Pending = (Box<dyn Fence>, Range<usize>);

/// Where a backup's bytes are.
#[derive(Debug)]
enum Place {
    /// An extent of the pager's unnamed spool, starting at `at`.
    Extent { spool: Arc<Spool>, at: u64 },
    /// A named file of its own ([`BackupFiles::Named`]), opened for each move.
    Named {
        owner: Arc<Owner>,
        path: PathBuf,
        /// The file's identity when it was made, checked at each open.
        id: named::Identity,
    },
}

/// An open backup file and where the backup starts in it, for one move.
enum Opened<'a> {
    Shared(&'a File, u64),
    Own(File),
}

impl Opened<'_> {
    fn file(&self) -> &File {
        match self {
            Opened::Shared(f, _) => f,
            Opened::Own(f) => f,
        }
    }

    fn at(&self) -> u64 {
        match self {
            Opened::Shared(_, at) => *at,
            Opened::Own(_) => 0,
        }
    }
}

/// One backup: an extent of a spool, punched out of it when dropped, or a named file,
/// removed when dropped.
#[derive(Debug)]
pub(crate) struct FileStore {
    place: Place,
    len: usize,
    io: Arc<FileIo>,
}

impl Drop for FileStore {
    fn drop(&mut self) {
        match &self.place {
            // A fork child's copy of a backup is its parent's: never touched.
            Place::Named { owner, path, .. } => {
                if owner.is_ours() {
                    let _ = std::fs::remove_file(path);
                }
            }
            Place::Extent { spool, at } => {
                if !spool.is_ours() {
                    return;
                }
                let len = self.len as u64;
                if len > 0 {
                    // SAFETY: a plain system call on the spool's descriptor, over this
                    // store's own extent. Advice: where the filesystem cannot punch holes,
                    // the space is reused by a later backup and given back when the process
                    // ends.
                    unsafe {
                        libc::fallocate(
                            spool.file.as_raw_fd(),
                            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                            *at as libc::off_t,
                            len as libc::off_t,
                        )
                    };
                }
                let mut extents = locked(&spool.extents);
                let end = extents.give(*at, len);
                #[cfg(test)]
                tests::BEFORE_SHRINK.with(|hook| {
                    if let Some(hook) = hook.borrow().as_ref() {
                        hook();
                    }
                });
                if end <= *at {
                    // The extent was the file's last: shrink the file (advice, as above),
                    // under the extents' lock, so that no backup can take the freed tail
                    // and be cut by the shrink.
                    let _ = spool.file.set_len(end);
                }
                drop(extents);
            }
        }
    }
}

impl FileStore {
    /// Copies the file's bytes `range` into `out` (of `range.len()` bytes).
    pub fn read(&self, range: Range<usize>, out: &mut [u8]) -> BackendResult<()> {
        self.check(&range)?;
        let f = self.open().map_err(|e| self.lost("opening", e))?;
        f.file()
            .read_exact_at(out, f.at() + range.start as u64)
            .map_err(|e| self.lost("reading", e))
    }

    /// The file, opened for one move where the backup has a file of its own.
    fn open(&self) -> io::Result<Opened<'_>> {
        match &self.place {
            Place::Extent { spool, at } => Ok(Opened::Shared(&spool.file, *at)),
            Place::Named { path, id, .. } => named::open(path, *id).map(Opened::Own),
        }
    }

    /// Where the backup is, for messages: its file, or the directory of an unnamed one.
    fn path(&self) -> &Path {
        match &self.place {
            Place::Extent { spool, .. } => &spool.dir,
            Place::Named { path, .. } => path,
        }
    }

    fn check(&self, range: &Range<usize>) -> BackendResult<()> {
        if range.start > range.end || range.end > self.len {
            return Err(BackendError::Internal {
                op: "file backup",
                reason: format!("bytes {range:?} outside the {}-byte backup file", self.len),
            });
        }
        Ok(())
    }

    /// Writes device bytes `base + r` to the file at `r`, for each of `ranges`, through the
    /// staging buffer; returns the bytes written. A failure (a full disk) leaves the file
    /// partly written: the caller treats the backup as holding nothing.
    ///
    /// # Safety
    /// Each `base + r` is mapped device memory of `backend`, not written until the call
    /// returns.
    pub unsafe fn write_from_device(
        &self,
        backend: &dyn Backend,
        base: u64,
        ranges: &[Range<usize>],
    ) -> BackendResult<usize> {
        let pieces = self.pieces(ranges)?;
        let f = self
            .open()
            .map_err(|e| file_error("opening a backup file in", self.path(), e))?;
        self.io.with_staging(backend, |staging| {
            let mut inflight: [Option<Pending>; 2] = [None, None];
            let mut written = 0;
            let mut run = || -> BackendResult<()> {
                for (k, piece) in pieces.iter().enumerate() {
                    let half = k % 2;
                    // SAFETY: the device range is mapped (the caller's contract); the half is
                    // this pager's pinned staging, idle (its last piece was written out in
                    // the iteration before).
                    let fence = unsafe {
                        transfer(
                            backend,
                            staging,
                            half,
                            self.io.chunk,
                            Direction::ToHost,
                            base,
                            piece,
                        )
                    }?;
                    inflight[half] = Some((fence, piece.clone()));
                    // Write out the other half's piece while this one copies.
                    if let Some((fence, p)) = inflight[1 - half].take() {
                        written += self.flush(&f, staging, 1 - half, fence, p)?;
                    }
                }
                for (half, slot) in inflight.iter_mut().enumerate() {
                    if let Some((fence, p)) = slot.take() {
                        written += self.flush(&f, staging, half, fence, p)?;
                    }
                }
                Ok(())
            };
            let result = run();
            // No copy may still write the staging buffer once it is handed on.
            settle(inflight.into_iter().flatten().map(|(f, _)| f), result)?;
            // On the disk before the release unmaps anything, and out of the page cache:
            // the host memory is what a file backup spares.
            f.file()
                .sync_data()
                .map_err(|e| file_error("writing a backup file in", self.path(), e))?;
            self.drop_cached(&f);
            Ok(written)
        })
    }

    /// Waits for the copy of `piece` into staging half `half`, then writes it to the file.
    fn flush(
        &self,
        f: &Opened<'_>,
        staging: &dyn HostBuffer,
        half: usize,
        fence: Box<dyn Fence>,
        piece: Range<usize>,
    ) -> BackendResult<usize> {
        fence.wait()?;
        let at = half * self.io.chunk;
        let src = &staging.as_slice()[at..at + piece.len()];
        f.file()
            .write_all_at(src, f.at() + piece.start as u64)
            .map_err(|e| file_error("writing a backup file in", self.path(), e))?;
        Ok(piece.len())
    }

    /// Reads the file's bytes `r` to device `base + r`, for each of `ranges`, through the
    /// staging buffer, and waits for the copies; returns the bytes read.
    ///
    /// # Safety
    /// Each `base + r` is mapped device memory of `backend` that nothing else accesses until
    /// the call returns.
    pub unsafe fn read_to_device(
        &self,
        backend: &dyn Backend,
        base: u64,
        ranges: &[Range<usize>],
    ) -> BackendResult<usize> {
        let pieces = self.pieces(ranges)?;
        let f = self.open().map_err(|e| self.lost("opening", e))?;
        self.io.with_staging(backend, |staging| {
            let mut inflight: [Option<Box<dyn Fence>>; 2] = [None, None];
            let mut read = 0;
            let mut run = || -> BackendResult<()> {
                for (k, piece) in pieces.iter().enumerate() {
                    let half = k % 2;
                    // The half's last copy must be over before the disk overwrites it.
                    if let Some(fence) = inflight[half].take() {
                        fence.wait()?;
                    }
                    let at = half * self.io.chunk;
                    let dst = &mut staging.as_mut_slice()[at..at + piece.len()];
                    f.file()
                        .read_exact_at(dst, f.at() + piece.start as u64)
                        .map_err(|e| self.lost("reading", e))?;
                    // SAFETY: the device range is mapped and unused (the caller's contract);
                    // the half holds the piece and is not touched until its fence passed.
                    inflight[half] = Some(unsafe {
                        transfer(
                            backend,
                            staging,
                            half,
                            self.io.chunk,
                            Direction::ToDevice,
                            base,
                            piece,
                        )
                    }?);
                    read += piece.len();
                }
                Ok(())
            };
            let result = run();
            settle(inflight.into_iter().flatten(), result)?;
            self.drop_cached(&f);
            Ok(read)
        })
    }

    /// Asks the kernel to drop the file's pages from its cache (advice: failures change
    /// nothing that matters).
    fn drop_cached(&self, f: &Opened<'_>) {
        // SAFETY: a plain system call on an open descriptor, over this store's bytes.
        unsafe {
            libc::posix_fadvise(
                f.file().as_raw_fd(),
                f.at() as libc::off_t,
                self.len as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            )
        };
    }

    /// A failed read of this backup: its contents cannot be restored.
    fn lost(&self, op: &'static str, error: io::Error) -> BackendError {
        BackendError::File {
            op,
            path: self.path().display().to_string(),
            error,
            lost: true,
        }
    }

    /// `ranges` cut into pieces of at most one staging half.
    fn pieces(&self, ranges: &[Range<usize>]) -> BackendResult<Vec<Range<usize>>> {
        let mut out = Vec::new();
        for r in ranges {
            self.check(r)?;
            let mut at = r.start;
            while at < r.end {
                let end = (at + self.io.chunk).min(r.end);
                out.push(at..end);
                at = end;
            }
        }
        Ok(out)
    }
}

/// A file backup's saves and restores move through the staging buffer and are done when
/// they return: nothing is left for the pump or the sink.
impl Store for FileStore {
    fn len(&self) -> usize {
        self.len
    }

    fn host(&self) -> Option<&[u8]> {
        None
    }

    fn read(&self, range: Range<usize>, out: &mut [u8]) -> BackendResult<()> {
        FileStore::read(self, range, out)
    }

    unsafe fn save<'h>(
        &'h mut self,
        backend: &dyn Backend,
        base: u64,
        runs: &[Range<usize>],
        _pump: &mut Pump<'_, 'h>,
    ) -> BackendResult<usize> {
        // SAFETY: the caller's contract; the copies finish before this returns.
        unsafe { self.write_from_device(backend, base, runs) }
    }

    unsafe fn restore<'h>(
        &'h self,
        backend: &dyn Backend,
        base: u64,
        spans: &[Range<usize>],
        _sink: &mut Sink<'_, '_, 'h>,
    ) -> BackendResult<usize> {
        // SAFETY: the caller's contract; the copies finish before this returns.
        unsafe { self.read_to_device(backend, base, spans) }
    }
}

/// Enqueues the copy of `piece` (file offsets, equal to device offsets from `base`) between
/// the device and staging half `half` on the copy engine, and returns its fence.
///
/// # Safety
/// `base + piece` is mapped device memory of `backend`; the half is not touched by anyone
/// until the fence has passed.
unsafe fn transfer(
    backend: &dyn Backend,
    staging: &dyn HostBuffer,
    half: usize,
    chunk: usize,
    direction: Direction,
    base: u64,
    piece: &Range<usize>,
) -> BackendResult<Box<dyn Fence>> {
    let at = (half * chunk) as u64;
    let copy = RawCopy {
        direction,
        host: staging.as_slice().as_ptr() as u64 + at,
        host_device: staging.device_ptr() + at,
        device: base + piece.start as u64,
        bytes: piece.len(),
    };
    // SAFETY: the caller's contract covers the device side; the host side is pinned
    // memory of this backend (the staging buffer), untouched until the fence passes.
    unsafe { backend.copy_unit(&copy, Mover::CopyEngine) }
}

/// Waits for every fence of `inflight` (copies still using the staging buffer), then returns
/// `result`, or the first wait's error if `result` was fine.
fn settle(
    inflight: impl Iterator<Item = Box<dyn Fence>>,
    result: BackendResult<()>,
) -> BackendResult<()> {
    let mut out = result;
    for f in inflight {
        let waited = f.wait();
        if out.is_ok() {
            out = waited;
        }
    }
    out
}

/// A failed file operation that lost nothing (the move did not happen).
fn file_error(op: &'static str, path: &Path, error: io::Error) -> BackendError {
    BackendError::File {
        op,
        path: path.display().to_string(),
        error,
        lost: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Reservation;
    use crate::backend::host::{HostBackend, HostConfig};

    const G: usize = 64 << 10;

    thread_local! {
        /// Runs in a store's drop between giving its extent back and shrinking the spool.
        pub(super) static BEFORE_SHRINK: std::cell::RefCell<Option<Box<dyn Fn()>>> =
            const { std::cell::RefCell::new(None) };
    }

    #[test]
    fn a_backup_taking_the_freed_tail_is_not_cut_by_the_shrink() {
        let dir =
            std::env::temp_dir().join(format!("gpu-pager-file-shrink-{}", std::process::id()));
        let io = Arc::new(FileIo::new(4096, usize::MAX));
        io.set_dir(&dir, BackupFiles::Unnamed).unwrap();
        let b = Arc::new(HostBackend::new(HostConfig {
            capacity: 4 * G,
            granularity: G,
        }));
        let r: Arc<dyn Reservation> = b.reserve(2 * G).unwrap();
        // SAFETY: a fresh reservation of this backend.
        let _maps = unsafe { b.map(&r, 0, &[2 * G]) }.unwrap();
        let data: Vec<u8> = (0..2 * G).map(|i| (i * 13 % 251) as u8).collect();
        // SAFETY: mapped.
        unsafe { b.copy_to_device(r.base(), &data) }.unwrap();
        let base = r.base();
        let first = io.create(2 * G).unwrap();
        // Another tag's release on another thread takes the extent just given back (the
        // spool's tail) and writes its backup, before this drop shrinks the spool.
        let (tx, rx) = std::sync::mpsc::channel();
        let (io2, b2) = (io.clone(), b.clone());
        let base2 = base as usize;
        BEFORE_SHRINK.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                let (io, b, tx) = (io2.clone(), b2.clone(), tx.clone());
                let writer = std::thread::spawn(move || {
                    let store = io.create(2 * G).unwrap();
                    let whole = std::iter::once(0..2 * G).collect::<Vec<_>>();
                    // SAFETY: mapped, not written meanwhile.
                    unsafe { store.write_from_device(&*b, base2 as _, &whole) }.unwrap();
                    tx.send(store).unwrap();
                });
                // Without the lock held over the shrink, the writer ends before it.
                std::thread::sleep(std::time::Duration::from_millis(200));
                drop(writer);
            }))
        });
        drop(first);
        BEFORE_SHRINK.with(|hook| hook.borrow_mut().take());
        let second = rx.recv().unwrap();
        let mut back = vec![0u8; 2 * G];
        second.read(0..2 * G, &mut back).unwrap();
        assert!(
            back == data,
            "the backup written into the freed tail was cut"
        );
        drop(second);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bytes_survive_a_round_trip_through_small_chunks() {
        let dir = std::env::temp_dir().join(format!("gpu-pager-file-test-{}", std::process::id()));
        let io = Arc::new(FileIo::new(4096, usize::MAX));
        io.set_dir(&dir, BackupFiles::Unnamed).unwrap();
        let b = HostBackend::new(HostConfig {
            capacity: 4 * G,
            granularity: G,
        });
        let r: Arc<dyn Reservation> = b.reserve(4 * G).unwrap();
        // SAFETY: a fresh reservation of this backend.
        let _maps = unsafe { b.map(&r, 0, &[4 * G]) }.unwrap();
        let data: Vec<u8> = (0..4 * G).map(|i| (i * 7 % 251) as u8).collect();
        // SAFETY: mapped.
        unsafe { b.copy_to_device(r.base(), &data) }.unwrap();
        let store = io.create(4 * G).unwrap();
        let Place::Extent { spool, .. } = &store.place else {
            panic!("an extent of the spool")
        };
        let spool = spool.clone();
        assert_eq!(spool.file.metadata().unwrap().len(), 4 * G as u64);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "the backup has no name"
        );
        let ranges = [3..10_000, G..3 * G + 5];
        // SAFETY: mapped, not written meanwhile.
        let n = unsafe { store.write_from_device(&b, r.base(), &ranges) }.unwrap();
        assert_eq!(n, ranges.iter().map(Range::len).sum::<usize>());
        // SAFETY: mapped.
        unsafe { b.fill(r.base(), 4 * G, 0xEEEE_EEEE) }.unwrap();
        // SAFETY: mapped and unused.
        unsafe { store.read_to_device(&b, r.base(), &ranges) }.unwrap();
        let mut back = vec![0u8; 4 * G];
        // SAFETY: mapped.
        unsafe { b.copy_to_host(&mut back, r.base()) }.unwrap();
        for (i, (got, want)) in back.iter().zip(&data).enumerate() {
            let held = ranges.iter().any(|r| r.contains(&i));
            assert_eq!(*got, if held { *want } else { 0xEE }, "byte {i}");
        }
        let mut part = vec![0u8; 100];
        store.read(G..G + 100, &mut part).unwrap();
        assert_eq!(part, data[G..G + 100]);
        drop(store);
        assert_eq!(
            spool.file.metadata().unwrap().len(),
            0,
            "its extent goes with it"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_same_directory_again_keeps_its_spool() {
        let dir = std::env::temp_dir().join(format!("gpu-pager-same-dir-{}", std::process::id()));
        let io = Arc::new(FileIo::new(4096, usize::MAX));
        io.set_dir(&dir, BackupFiles::Unnamed).unwrap();
        let spool = |io: &FileIo| match locked(&io.target).open.clone() {
            Some(Dest::Spool(s)) => s,
            other => panic!("no spool: {other:?}"),
        };
        let first = spool(&io);
        io.set_dir(&dir, BackupFiles::Unnamed).unwrap();
        assert!(
            Arc::ptr_eq(&first, &spool(&io)),
            "a second spool was opened"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_directory_and_an_unwritable_one_are_clear_errors() {
        let io = Arc::new(FileIo {
            target: Mutex::new(Target::default()),
            chunk: 4096,
            host_budget: usize::MAX,
            staging: Mutex::new(None),
        });
        let e = io.create(10).unwrap_err().to_string();
        assert!(
            e.contains("no backup directory") && e.contains("set_backup_dir"),
            "{e}"
        );
        for files in [BackupFiles::Unnamed, BackupFiles::Named] {
            let e = io
                .set_dir(Path::new("/proc/gpu-pager-cannot-be-here"), files)
                .unwrap_err();
            assert!(e.to_string().contains("backup directory"), "{e}");
            assert!(io.dir().is_none(), "a failed set changes nothing");
            let e = io.set_dir(Path::new(""), files).unwrap_err().to_string();
            assert!(e.contains("empty"), "{e}");
        }
    }

    #[test]
    fn extents_reuse_holes_merge_neighbours_and_shrink_the_file() {
        let mut x = Extents::default();
        let a = x.take(1).unwrap();
        let b = x.take(5000).unwrap();
        let c = x.take(4096).unwrap();
        assert_eq!((a, b, c, x.end), (0, 4096, 3 * 4096, 4 * 4096));
        assert_eq!(x.give(b, 5000), 4 * 4096, "a hole inside the file");
        assert_eq!(x.take(4096), Some(b), "first fit");
        assert_eq!(x.free, BTreeMap::from([(2 * 4096, 4096)]));
        assert_eq!(x.give(b, 4096), 4 * 4096);
        assert_eq!(x.free, BTreeMap::from([(4096, 2 * 4096)]), "merged");
        assert_eq!(
            x.give(c, 4096),
            4096,
            "the last extent shrinks the file over the hole"
        );
        assert!(x.free.is_empty());
        assert_eq!(x.give(a, 1), 0);
        assert_eq!(x.take(u64::MAX), None, "no overflow");
        assert_eq!(x.take(i64::MAX as u64), None, "beyond a file offset");
    }

    #[test]
    fn a_fork_childs_copy_of_a_backup_leaves_the_extent_alone() {
        let dir = std::env::temp_dir().join(format!("gpu-pager-file-fork-{}", std::process::id()));
        let io = Arc::new(FileIo::new(4096, usize::MAX));
        io.set_dir(&dir, BackupFiles::Unnamed).unwrap();
        let store = io.create(8192).unwrap();
        let Place::Extent { spool, at } = &store.place else {
            panic!("an extent of the spool")
        };
        spool.file.write_all_at(&[7; 8192], *at).unwrap();
        // The child's view: the same descriptor, opened by another process.
        let theirs = FileStore {
            place: Place::Extent {
                spool: Arc::new(Spool {
                    dir: dir.clone(),
                    file: spool.file.try_clone().unwrap(),
                    pid: std::process::id() + 1,
                    extents: Mutex::new(Extents::default()),
                }),
                at: *at,
            },
            len: store.len,
            io: io.clone(),
        };
        drop(theirs);
        let mut back = [0u8; 8192];
        store.read(0..8192, &mut back).unwrap();
        assert_eq!(back, [7; 8192], "not punched out");
        // A fork child opens its own spool.
        let mut target = locked(&io.target);
        target.open = Some(Dest::Spool(Arc::new(Spool {
            pid: std::process::id() + 1,
            ..Spool::open(&dir).unwrap()
        })));
        assert!(!target.open.as_ref().is_some_and(Dest::is_ours));
        let ours = target.ready().unwrap();
        assert!(ours.is_ours());
        assert!(target.open.as_ref().is_some_and(Dest::is_ours));
        drop(target);
        drop(store);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_staging_chunk_is_clamped() {
        assert_eq!(FileIo::new(1, usize::MAX).chunk, MIN_FILE_CHUNK_BYTES);
        assert_eq!(
            FileIo::new(usize::MAX, usize::MAX).chunk,
            MAX_FILE_CHUNK_BYTES
        );
    }
}
