//! File backups ([`crate::Medium::File`]): a `Preserve` region's contents in files on the
//! host's disk, for hosts whose memory cannot hold every GPU's weights.
//!
//! Bytes move between the device and a file through the pager's one pinned staging buffer
//! ([`FileIo`], two halves of [`crate::PagerConfig::file_chunk_bytes`]): the copy of one
//! chunk over the link overlaps the disk I/O of the other, so a move runs at the disk's
//! speed and never needs host memory for the whole region. Each backup is one file, created
//! with its whole size allocated on disk (`posix_fallocate`), so a full disk fails the
//! release up front, before anything is unmapped, and the region stays resident. A file is
//! deleted when its backup is dropped (the buffer freed, the region removed).

use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::backend::{
    Backend, BackendError, BackendResult, Direction, Fence, HostBuffer, Mover, RawCopy,
};

/// The environment variable that sets a new pager's backup directory
/// ([`crate::Pager::set_backup_dir`] changes it later).
pub const BACKUP_DIR_ENV: &str = "GPU_PAGER_BACKUP_DIR";

/// The backup files of this process, deleted at its exit by [`remove_at_exit`]: a pager
/// lives until then and never drops its regions, so their files would outlive it.
static LIVE: Mutex<std::collections::BTreeSet<PathBuf>> =
    Mutex::new(std::collections::BTreeSet::new());

extern "C" fn remove_at_exit() {
    let live = std::mem::take(&mut *LIVE.lock().unwrap_or_else(PoisonError::into_inner));
    for path in live {
        let _ = std::fs::remove_file(path);
    }
}

/// Remembers `path` for deletion at exit (registering the exit handler once).
fn register(path: &Path) {
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    AT_EXIT.call_once(|| {
        // SAFETY: registers a function without arguments that only removes files; a failure
        // to register leaves files behind at exit, nothing worse.
        unsafe { libc::atexit(remove_at_exit) };
    });
    LIVE.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(path.to_owned());
}

/// What a pager shares between its file backups: the directory new files go to, and the
/// pinned staging buffer every transfer streams through (one transfer at a time).
#[derive(Debug)]
pub(crate) struct FileIo {
    dir: RwLock<Option<PathBuf>>,
    /// Bytes per half of the staging buffer.
    chunk: usize,
    staging: Mutex<Option<Box<dyn HostBuffer>>>,
    /// Distinguishes this pager's files from other pagers' in one directory.
    owner: u64,
    next: AtomicU64,
}

impl FileIo {
    /// File I/O of the pager with process-unique number `owner`, with staging halves of
    /// `chunk` bytes and the directory from [`BACKUP_DIR_ENV`] if it is set.
    pub fn new(owner: u64, chunk: usize) -> FileIo {
        let dir = std::env::var_os(BACKUP_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        FileIo {
            dir: RwLock::new(dir),
            chunk: chunk.max(4096),
            staging: Mutex::new(None),
            owner,
            next: AtomicU64::new(0),
        }
    }

    /// The directory new backup files go to.
    pub fn dir(&self) -> Option<PathBuf> {
        self.dir
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Makes `dir` (created if missing) the directory of new backup files, after checking
    /// that a file can be created and written there. Files already made stay where they are.
    pub fn set_dir(&self, dir: &Path) -> BackendResult<()> {
        std::fs::create_dir_all(dir)
            .map_err(|e| file_error("creating the backup directory", dir, e))?;
        let probe = dir.join(format!(
            ".gpu-pager-probe-{}-{}",
            std::process::id(),
            self.owner
        ));
        let written = create_private(&probe).and_then(|f| f.write_all_at(&[0u8], 0));
        let _ = std::fs::remove_file(&probe);
        written.map_err(|e| file_error("writing a file in the backup directory", dir, e))?;
        *self.dir.write().unwrap_or_else(PoisonError::into_inner) = Some(dir.to_owned());
        Ok(())
    }

    /// A new file of `len` bytes, all of them allocated on disk.
    pub fn create(self: &Arc<Self>, len: usize) -> BackendResult<FileStore> {
        let dir = self.dir().ok_or_else(|| BackendError::Invalid {
            op: "creating a file backup",
            reason: format!(
                "no backup directory is set; set one on the pager (set_backup_dir) or in \
                 {BACKUP_DIR_ENV}, on a real disk rather than tmpfs"
            ),
        })?;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!(
            "gpu-pager-{}-{}-{n}.backup",
            std::process::id(),
            self.owner
        ));
        let file =
            create_private(&path).map_err(|e| file_error("creating the backup file", &path, e))?;
        register(&path);
        let store = FileStore {
            file,
            path,
            len,
            io: self.clone(),
        };
        if len > 0 {
            let size = libc::off_t::try_from(len).map_err(|_| BackendError::Invalid {
                op: "creating a file backup",
                reason: format!("{len} bytes do not fit in a file offset"),
            })?;
            // SAFETY: a plain system call on a descriptor this function owns (the store,
            // which deletes the file if this fails).
            let rc = unsafe { libc::posix_fallocate(store.file.as_raw_fd(), 0, size) };
            if rc != 0 {
                return Err(file_error(
                    "allocating the backup file",
                    &store.path,
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
            *slot = Some(backend.alloc_pinned(2 * self.chunk)?);
        }
        match slot.as_deref_mut() {
            Some(buf) => f(buf),
            None => Err(BackendError::Internal {
                op: "file backup",
                reason: "no staging buffer".to_owned(),
            }),
        }
    }
}

/// A copy into a staging half, with the file range it goes to.
type Pending = (Box<dyn Fence>, Range<usize>);

/// One backup in a file, deleted when dropped.
#[derive(Debug)]
pub(crate) struct FileStore {
    file: File,
    path: PathBuf,
    len: usize,
    io: Arc<FileIo>,
}

impl Drop for FileStore {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        LIVE.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.path);
    }
}

impl FileStore {
    /// Bytes the file holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Copies the file's bytes `range` into `out` (of `range.len()` bytes).
    pub fn read(&self, range: Range<usize>, out: &mut [u8]) -> BackendResult<()> {
        self.check(&range)?;
        self.file
            .read_exact_at(out, range.start as u64)
            .map_err(|e| file_error("reading the backup file", &self.path, e))
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
                    if let Some((f, p)) = inflight[1 - half].take() {
                        written += self.flush(staging, 1 - half, f, p)?;
                    }
                }
                for (half, slot) in inflight.iter_mut().enumerate() {
                    if let Some((f, p)) = slot.take() {
                        written += self.flush(staging, half, f, p)?;
                    }
                }
                Ok(())
            };
            let result = run();
            // No copy may still write the staging buffer once it is handed on.
            settle(inflight.into_iter().flatten().map(|(f, _)| f), result)?;
            // On the disk before the release unmaps anything, and out of the page cache:
            // the host memory is what a file backup spares.
            self.file
                .sync_data()
                .map_err(|e| file_error("writing the backup file", &self.path, e))?;
            self.drop_cached();
            Ok(written)
        })
    }

    /// Waits for the copy of `piece` into staging half `half`, then writes it to the file.
    fn flush(
        &self,
        staging: &dyn HostBuffer,
        half: usize,
        fence: Box<dyn Fence>,
        piece: Range<usize>,
    ) -> BackendResult<usize> {
        fence.wait()?;
        let at = half * self.io.chunk;
        let src = &staging.as_slice()[at..at + piece.len()];
        self.file
            .write_all_at(src, piece.start as u64)
            .map_err(|e| file_error("writing the backup file", &self.path, e))?;
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
        self.io.with_staging(backend, |staging| {
            let mut inflight: [Option<Box<dyn Fence>>; 2] = [None, None];
            let mut read = 0;
            let mut run = || -> BackendResult<()> {
                for (k, piece) in pieces.iter().enumerate() {
                    let half = k % 2;
                    // The half's last copy must be over before the disk overwrites it.
                    if let Some(f) = inflight[half].take() {
                        f.wait()?;
                    }
                    let at = half * self.io.chunk;
                    let dst = &mut staging.as_mut_slice()[at..at + piece.len()];
                    self.file
                        .read_exact_at(dst, piece.start as u64)
                        .map_err(|e| file_error("reading the backup file", &self.path, e))?;
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
            self.drop_cached();
            Ok(read)
        })
    }

    /// Asks the kernel to drop the file's pages from its cache (advice: failures change
    /// nothing that matters).
    fn drop_cached(&self) {
        // SAFETY: a plain system call on a descriptor this store owns.
        unsafe { libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
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

/// Creates a new file at `path`, readable and writable by this user only; fails if one is
/// there (a backup never takes over a file it did not make).
fn create_private(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// A failed file operation, with what to do about it.
fn file_error(op: &'static str, path: &Path, error: io::Error) -> BackendError {
    BackendError::File {
        op,
        path: path.display().to_string(),
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Reservation;
    use crate::backend::host::{HostBackend, HostConfig};

    const G: usize = 64 << 10;

    #[test]
    fn bytes_survive_a_round_trip_through_small_chunks() {
        let dir = std::env::temp_dir().join(format!("gpu-pager-file-test-{}", std::process::id()));
        let io = Arc::new(FileIo::new(9, 4096));
        io.set_dir(&dir).unwrap();
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
        assert_eq!(std::fs::metadata(&store.path).unwrap().len(), 4 * G as u64);
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
        let path = store.path.clone();
        drop(store);
        assert!(!path.exists(), "the file goes with its backup");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_directory_and_an_unwritable_one_are_clear_errors() {
        let io = Arc::new(FileIo {
            dir: RwLock::new(None),
            chunk: 4096,
            staging: Mutex::new(None),
            owner: 1,
            next: AtomicU64::new(0),
        });
        let e = io.create(10).unwrap_err().to_string();
        assert!(
            e.contains("no backup directory") && e.contains("set_backup_dir"),
            "{e}"
        );
        let e = io
            .set_dir(Path::new("/proc/gpu-pager-cannot-be-here"))
            .unwrap_err();
        assert!(e.to_string().contains("backup directory"), "{e}");
        assert!(io.dir().is_none(), "a failed set changes nothing");
    }
}
