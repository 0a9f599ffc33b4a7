//! One host-memory budget for the backups of every gpu-pager process of this user on the
//! node ([`crate::PagerConfig::host_budget_bytes`]): a ledger in shared memory, a directory
//! (`/dev/shm/gpu-pager-ledger-<uid>`, or [`LEDGER_DIR_ENV`]) with one file per process
//! that holds the bytes its backups hold in host memory. Each process keeps its file locked
//! (`flock`) for its whole life, so the share of a process that died, killed or not, comes
//! back: the next reader finds its lock free and deletes the file. A reservation takes the
//! directory's lock file, reads every live share, and writes its own only if the sum stays
//! within the budget: two processes never both pass it.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use super::named::flock;
use crate::backend::{BackendError, BackendResult};

/// The environment variable that puts the ledger in another directory (tests; machines
/// without `/dev/shm`).
pub const LEDGER_DIR_ENV: &str = "GPU_PAGER_LEDGER_DIR";

/// A reservation the budget refused: the budget, what was asked, and every process's share
/// (this one's included) as (pid, bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverBudget {
    /// The budget, in bytes.
    pub budget: usize,
    /// What this reservation asked for.
    pub requested: usize,
    /// Each live process's share, largest first: (pid, bytes).
    pub shares: Vec<(u32, usize)>,
}

/// This process's entry in the ledger.
#[derive(Debug)]
pub(crate) struct Ledger {
    dir: PathBuf,
    /// Our share's file, locked for the process's life.
    file: File,
    name: String,
    /// Bytes of our share (what our file says).
    held: Mutex<usize>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read_share(file: &mut File) -> io::Result<usize> {
    let mut bytes = [0u8; 8];
    file.seek(SeekFrom::Start(0))?;
    match file.read_exact(&mut bytes) {
        Ok(()) => Ok(usize::try_from(u64::from_le_bytes(bytes)).unwrap_or(usize::MAX)),
        // A file whose owner has not written it yet holds nothing.
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(0),
        Err(e) => Err(e),
    }
}

impl Ledger {
    /// The process's ledger in the default directory (or [`LEDGER_DIR_ENV`]'s), opened once.
    pub(crate) fn process() -> io::Result<Arc<Ledger>> {
        static LEDGER: OnceLock<Mutex<Option<Arc<Ledger>>>> = OnceLock::new();
        let mut slot = locked(LEDGER.get_or_init(|| Mutex::new(None)));
        if let Some(l) = slot.as_ref() {
            return Ok(l.clone());
        }
        let dir = match std::env::var_os(LEDGER_DIR_ENV) {
            Some(d) if !d.is_empty() => PathBuf::from(d),
            // SAFETY: getuid has no preconditions.
            _ => PathBuf::from(format!("/dev/shm/gpu-pager-ledger-{}", unsafe {
                libc::getuid()
            })),
        };
        let l = Arc::new(Ledger::open(&dir)?);
        *slot = Some(l.clone());
        Ok(l)
    }

    /// A new entry in the ledger at `dir` (made `0700` if missing), locked until it is
    /// dropped. The directory must be a real directory (not a symbolic link), owned by this
    /// user, that no one else may enter (mode `0700`): its path is predictable, so another
    /// local user could have made it first to squat the budget, or to point the sweep of
    /// dead shares at a directory of this user's.
    pub(crate) fn open(dir: &Path) -> io::Result<Ledger> {
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        check_private_dir(dir)?;
        let name = format!(
            "{}-{:032x}.share",
            std::process::id(),
            super::named::random()?
        );
        // Made under another name and locked before it is renamed into place: a reader
        // that saw it unlocked would take it for a dead process's and delete it.
        let pending = dir.join(format!("{name}.new"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&pending)?;
        flock(&file, libc::LOCK_EX | libc::LOCK_NB)?;
        std::fs::rename(&pending, dir.join(&name))?;
        Ok(Ledger {
            dir: dir.to_owned(),
            file,
            name,
            held: Mutex::new(0),
        })
    }

    /// Runs `f` with the ledger's lock held (the directory's `lock` file).
    fn exclusive<T>(&self, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        self.exclusive_within(LOCK_WAIT, f)
    }

    /// [`Ledger::exclusive`], waiting at most `wait` for the lock: a process that holds it
    /// longer is stuck (a reservation holds it for a few file reads), and every release
    /// with a budget would hang behind it. The error names the holder when it wrote its pid.
    fn exclusive_within<T>(
        &self,
        wait: std::time::Duration,
        f: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        let path = self.dir.join("lock");
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        let start = std::time::Instant::now();
        let mut pause = std::time::Duration::from_micros(50);
        loop {
            match flock(&lock, libc::LOCK_EX | libc::LOCK_NB) {
                Ok(()) => break,
                Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {}
                Err(e) => return Err(e),
            }
            if start.elapsed() >= wait {
                let mut holder = String::new();
                let _ = (&lock).seek(SeekFrom::Start(0));
                let _ = (&lock).read_to_string(&mut holder);
                let holder = holder.trim();
                let who = if holder.is_empty() {
                    "another process".to_owned()
                } else {
                    format!("process {holder}")
                };
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the host-budget ledger's lock {} has been held by {who} for {:.0} s; \
                         a reservation holds it for a few file reads, so that process is \
                         stuck: stop it, or unset host_budget_bytes (GPU_PAGER_HOST_BUDGET) \
                         in this one",
                        path.display(),
                        wait.as_secs_f64(),
                    ),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(10));
        }
        // Who holds it, for a process that waits too long.
        let _ = lock.set_len(0);
        let _ = write!(lock, "{}", std::process::id());
        f()
        // The lock goes with the descriptor.
    }

    /// Every live process's share, largest first, this one's included; the files of dead
    /// processes are deleted on the way. Call with the ledger's lock held.
    fn shares_locked(&self, mine: usize) -> io::Result<Vec<(u32, usize)>> {
        let mut out = vec![(std::process::id(), mine)];
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".share.new") {
                forget_abandoned(&entry.path());
                continue;
            }
            if name == self.name || !name.ends_with(".share") {
                continue;
            }
            let Ok(mut file) = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
                .open(entry.path())
            else {
                continue;
            };
            if !file.metadata()?.is_file() {
                continue;
            }
            if flock(&file, libc::LOCK_SH | libc::LOCK_NB).is_ok() {
                // Nobody holds it: its process is gone, and so is its share.
                let _ = std::fs::remove_file(entry.path());
                continue;
            }
            let pid = name
                .split('-')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            out.push((pid, read_share(&mut file)?));
        }
        out.sort_by_key(|s| std::cmp::Reverse(s.1));
        Ok(out)
    }

    fn write_mine(&self, bytes: usize) -> io::Result<()> {
        let mut file = &self.file;
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&(bytes as u64).to_le_bytes())
    }

    /// Adds `bytes` to this process's share if every share together stays within
    /// `budget`; else changes nothing and says who holds what.
    pub(crate) fn reserve(
        &self,
        bytes: usize,
        budget: usize,
    ) -> io::Result<Result<(), OverBudget>> {
        let mut held = locked(&self.held);
        self.exclusive(|| {
            let shares = self.shares_locked(*held)?;
            let total = shares.iter().fold(0usize, |t, s| t.saturating_add(s.1));
            if total.saturating_add(bytes) > budget {
                return Ok(Err(OverBudget {
                    budget,
                    requested: bytes,
                    shares,
                }));
            }
            self.write_mine(*held + bytes)?;
            *held += bytes;
            Ok(Ok(()))
        })
    }

    /// Takes `bytes` off this process's share.
    pub(crate) fn give_back(&self, bytes: usize) {
        let mut held = locked(&self.held);
        *held = held.saturating_sub(bytes);
        // A write that fails leaves the share too large until the next one: others see
        // less room, never more.
        let _ = self.exclusive(|| self.write_mine(*held));
    }

    /// Every live process's share, largest first, this one's included.
    pub(crate) fn shares(&self) -> io::Result<Vec<(u32, usize)>> {
        let held = locked(&self.held);
        self.exclusive(|| self.shares_locked(*held))
    }
}

/// How long a reservation waits for the ledger's lock before it fails.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Refuses a ledger directory that another user could have made or could enter: not a
/// directory itself (a symbolic link is not followed), owned by another user, or open to
/// others (any mode bit beyond `0700`). The error says what is wrong and how to fix it.
fn check_private_dir(dir: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    let refuse = |what: String| {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the host-budget ledger's directory {} {what}; another local user may have \
                 made it: remove it (a new one is made), or set {LEDGER_DIR_ENV} to a \
                 directory of your own with mode 0700",
                dir.display()
            ),
        ))
    };
    if meta.file_type().is_symlink() {
        return refuse("is a symbolic link".to_owned());
    }
    if !meta.is_dir() {
        return refuse("is not a directory".to_owned());
    }
    // SAFETY: getuid has no preconditions.
    let me = unsafe { libc::getuid() };
    if meta.uid() != me {
        return refuse(format!(
            "belongs to user {}, not to this one ({me})",
            meta.uid()
        ));
    }
    if meta.mode() & 0o077 != 0 {
        return refuse(format!(
            "has mode {:04o}, open to other users (it must be 0700)",
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Deletes a share file left under its first name by a process that died between making
/// it and locking it: one that nobody locks and that is older than a minute (a live
/// process locks its file at once, and renames it a moment later).
fn forget_abandoned(path: &Path) {
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
    else {
        return;
    };
    let old = file
        .metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age > std::time::Duration::from_secs(60));
    if old && flock(&file, libc::LOCK_SH | libc::LOCK_NB).is_ok() {
        let _ = std::fs::remove_file(path);
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dir.join(&self.name));
    }
}

/// Bytes of a process's share held by one backup, given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Share {
    ledger: Option<Arc<Ledger>>,
    bytes: usize,
}

impl Share {
    /// A share of nothing (no budget).
    pub(crate) fn none() -> Share {
        Share {
            ledger: None,
            bytes: 0,
        }
    }

    /// `bytes` of `budget` reserved in the process's ledger; the error says who holds what
    /// when the budget would be passed.
    pub(crate) fn reserve(
        bytes: usize,
        budget: usize,
    ) -> io::Result<std::result::Result<Share, OverBudget>> {
        if budget == usize::MAX {
            return Ok(Ok(Share::none()));
        }
        let ledger = Ledger::process()?;
        Ok(ledger.reserve(bytes, budget)?.map(|()| Share {
            ledger: Some(ledger),
            bytes,
        }))
    }

    /// [`Share::reserve`] with its failures as backend errors: over the budget,
    /// [`BackendError::HostBudget`] (who holds what); a ledger that cannot be opened,
    /// [`BackendError::Os`].
    pub(crate) fn within(bytes: usize, budget: usize) -> BackendResult<Share> {
        match Share::reserve(bytes, budget) {
            Ok(Ok(share)) => Ok(share),
            Ok(Err(over)) => Err(BackendError::HostBudget {
                budget: over.budget,
                requested: over.requested,
                shares: over.shares,
                staging: false,
            }),
            Err(error) => Err(BackendError::Os {
                op: "opening the host-memory budget's ledger",
                error,
            }),
        }
    }

    /// Splits `bytes` off into a share of its own (for one of several buffers reserved
    /// together).
    pub(crate) fn split(&mut self, bytes: usize) -> Share {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        Share {
            ledger: self.ledger.clone(),
            bytes,
        }
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        if let Some(l) = &self.ledger
            && self.bytes > 0
        {
            l.give_back(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "gpu-pager-ledger-test-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_directory_others_could_have_made_or_enter_is_refused_saying_why() {
        use std::os::unix::fs::PermissionsExt;
        // A symbolic link to a directory of ours: the sweep would delete its *.share files.
        let target = dir("target");
        std::fs::create_dir_all(&target).unwrap();
        std::fs::write(target.join("mine.share"), b"keep").unwrap();
        let link = dir("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = Ledger::open(&link).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("is a symbolic link"), "{e}");
        assert!(target.join("mine.share").exists());
        // Open to others: anyone could plant shares in it.
        let open = dir("open");
        std::fs::create_dir_all(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = Ledger::open(&open).unwrap_err();
        assert!(e.to_string().contains("has mode 0755"), "{e}");
        assert!(e.to_string().contains(LEDGER_DIR_ENV), "{e}");
        // A file where the directory should be.
        let file = dir("file");
        std::fs::write(&file, b"").unwrap();
        assert!(
            Ledger::open(&file)
                .unwrap_err()
                .to_string()
                .contains("not a directory")
        );
        // Made here: 0700, taken.
        let fresh = dir("fresh");
        Ledger::open(&fresh).unwrap();
        assert_eq!(std::fs::metadata(&fresh).unwrap().mode() & 0o777, 0o700);
        for d in [target, link, open, file, fresh] {
            let _ = std::fs::remove_dir_all(&d).or_else(|_| std::fs::remove_file(&d));
        }
    }

    #[test]
    fn a_lock_held_too_long_fails_the_reservation_naming_the_holder() {
        let d = dir("stuck");
        let a = Ledger::open(&d).unwrap();
        let mut stuck = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(d.join("lock"))
            .unwrap();
        flock(&stuck, libc::LOCK_EX).unwrap();
        write!(stuck, "4242").unwrap();
        let t = std::time::Instant::now();
        let e = a
            .exclusive_within(std::time::Duration::from_millis(100), || Ok(()))
            .unwrap_err();
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("held by process 4242"), "{e}");
        drop(stuck);
        assert_eq!(a.reserve(1, 10).unwrap(), Ok(()));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn shares_add_up_across_entries_and_the_budget_holds() {
        let d = dir("budget");
        let (a, b) = (Ledger::open(&d).unwrap(), Ledger::open(&d).unwrap());
        assert_eq!(a.reserve(600, 1000).unwrap(), Ok(()));
        let refused = b.reserve(500, 1000).unwrap().unwrap_err();
        assert_eq!((refused.budget, refused.requested), (1000, 500));
        assert_eq!(
            refused.shares.iter().map(|s| s.1).collect::<Vec<_>>(),
            [600, 0]
        );
        assert_eq!(b.reserve(400, 1000).unwrap(), Ok(()));
        a.give_back(600);
        assert_eq!(b.reserve(600, 1000).unwrap(), Ok(()));
        assert_eq!(b.shares().unwrap()[0].1, 1000);
    }

    #[test]
    fn a_dead_entry_s_share_comes_back() {
        let d = dir("dead");
        let a = Ledger::open(&d).unwrap();
        let b = Ledger::open(&d).unwrap();
        assert_eq!(a.reserve(900, 1000).unwrap(), Ok(()));
        assert!(b.reserve(200, 1000).unwrap().is_err());
        // What the kernel does when a process dies: its lock goes, its file stays.
        let name = a.name.clone();
        drop(close_without_drop(a));
        assert!(d.join(&name).exists(), "a dead process leaves its file");
        assert_eq!(b.reserve(200, 1000).unwrap(), Ok(()));
        assert!(!d.join(&name).exists(), "the next reservation deleted it");
    }

    #[test]
    fn a_share_file_abandoned_before_its_lock_goes_after_a_minute_and_not_before() {
        let d = dir("abandoned");
        let l = Ledger::open(&d).unwrap();
        let fresh = d.join("1-fresh.share.new");
        let stale = d.join("2-stale.share.new");
        File::create(&fresh).unwrap();
        let f = File::create(&stale).unwrap();
        let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        f.set_modified(hour_ago).unwrap();
        drop(f);
        l.shares().unwrap();
        assert!(
            fresh.exists(),
            "a file a process may be about to lock stays"
        );
        assert!(!stale.exists(), "an abandoned one goes");
    }

    /// Drops `l`'s descriptor (releasing its lock) without running its `Drop` (which
    /// deletes the file, as an exiting process would not when killed).
    fn close_without_drop(l: Ledger) -> File {
        let l = std::mem::ManuallyDrop::new(l);
        // SAFETY: `l` is never used or dropped again; its file is moved out once.
        unsafe { std::ptr::read(&l.file) }
    }
}
