//! Named backup files ([`crate::BackupFiles::Named`]): one file per backup, visible in the
//! backup directory, as torch_memory_saver lays them out (its users and its test suite look
//! at the directory to see what a pause put on disk).
//!
//! Names cannot be guessed or planted: every process that writes named backups in a
//! directory takes a random 128-bit id there and publishes it as an owner file,
//! `gpu-pager-<id>.owner`, that it keeps locked (`flock`) for its whole life; its backups are
//! `gpu-pager-<id>-<n>.backup`, created exclusively (never through a symbolic link), mode
//! 0600. A backup's file is opened only while bytes move, so a process holds one descriptor
//! per directory (the owner's), not one per backup.
//!
//! Nothing stays behind for long: a backup's file goes with the backup, every file of the
//! process goes at a normal exit, and the files of an owner that died without cleaning up
//! (SIGKILL, a crash, `os._exit`) go when the next process takes an id in that directory:
//! an owner file whose lock can be taken has no live owner. The lock lives in the kernel,
//! so this holds across PID namespaces (containers sharing a directory).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, PoisonError};

const PREFIX: &str = "gpu-pager-";
const OWNER_SUFFIX: &str = ".owner";
const BACKUP_SUFFIX: &str = ".backup";
/// An owner file before it is published (locked first, then renamed).
const PENDING_PREFIX: &str = ".gpu-pager-";
const PENDING_SUFFIX: &str = ".pending";

/// This process's id in one directory: its locked owner file and the backups it names.
#[derive(Debug)]
pub(crate) struct Owner {
    dir: PathBuf,
    id: String,
    /// The owner file, locked while this process (or a fork child sharing the descriptor)
    /// lives.
    lock: File,
    pid: u32,
    next: AtomicU64,
}

/// The owners of this process, one per directory, kept for the exit handler.
static OWNERS: Mutex<Vec<Arc<Owner>>> = Mutex::new(Vec::new());

impl Owner {
    /// This process's owner in `dir` (absolute, existing), published on first use after the
    /// files of dead owners there were removed.
    pub fn in_dir(dir: &Path) -> io::Result<Arc<Owner>> {
        let mut owners = OWNERS.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(o) = owners.iter().find(|o| o.dir == dir && o.is_ours()) {
            return Ok(o.clone());
        }
        shared_without_sticky_bit(dir)?;
        sweep(dir);
        let (id, lock) = publish(dir)?;
        static AT_EXIT: Once = Once::new();
        AT_EXIT.call_once(|| {
            // SAFETY: registers a handler without arguments; it never waits for a lock and
            // only removes files.
            unsafe { libc::atexit(remove_at_exit) };
        });
        let owner = Arc::new(Owner {
            dir: dir.to_owned(),
            id,
            lock,
            pid: std::process::id(),
            next: AtomicU64::new(0),
        });
        owners.push(owner.clone());
        Ok(owner)
    }

    /// Whether this process published the owner (a fork child did not).
    pub fn is_ours(&self) -> bool {
        self.pid == std::process::id()
    }

    /// A new backup file of `len` bytes, all allocated on disk; returns its path and
    /// identity. Nothing stays behind on failure. Touches the owner file, so that cleaners
    /// of old files in the directory see it in use.
    pub fn create(&self, len: u64) -> io::Result<(PathBuf, Identity)> {
        // SAFETY: a plain system call on the owner file's open descriptor; NULL times mean
        // now.
        unsafe { libc::futimens(self.lock.as_raw_fd(), std::ptr::null()) };
        loop {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            let path = self
                .dir
                .join(format!("{PREFIX}{}-{n}{BACKUP_SUFFIX}", self.id));
            let file = match create_new(&path) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                other => other?,
            };
            if len > 0 {
                let Ok(n) = libc::off_t::try_from(len) else {
                    let _ = std::fs::remove_file(&path);
                    return Err(io::Error::from_raw_os_error(libc::EFBIG));
                };
                // SAFETY: a plain system call on a descriptor this function owns.
                let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, n) };
                if rc != 0 {
                    let _ = std::fs::remove_file(&path);
                    return Err(io::Error::from_raw_os_error(rc));
                }
            }
            let id = identity(&file).inspect_err(|_| {
                let _ = std::fs::remove_file(&path);
            })?;
            return Ok((path, id));
        }
    }
}

/// A file's identity (`st_dev`, `st_ino`): a backup file is reopened by path for each move,
/// and must still be the file this process created.
pub(crate) type Identity = (u64, u64);

fn identity(file: &File) -> io::Result<Identity> {
    let m = file.metadata()?;
    Ok((
        std::os::unix::fs::MetadataExt::dev(&m),
        std::os::unix::fs::MetadataExt::ino(&m),
    ))
}

/// Opens the backup file at `path` for one move (never through a symbolic link); an error
/// when the file there is no longer the one created as `id` (another user who can write
/// the directory swapped it).
pub(crate) fn open(path: &Path, id: Identity) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    if identity(&file)? != id {
        return Err(io::Error::other(
            "the backup file was replaced by another file since it was written (someone \
             else can write the backup directory: use a directory only you can write)",
        ));
    }
    Ok(file)
}

/// An error when others can write `dir` and its sticky bit is off: another user could
/// remove or replace this process's named backups there.
fn shared_without_sticky_bit(dir: &Path) -> io::Result<()> {
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(dir)?.permissions());
    if mode & 0o002 != 0 && mode & 0o1000 == 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "every user can write the backup directory (mode {:o}) and its sticky bit is \
                 off, so another user could replace the backups: use a directory only you can \
                 write, or one with the sticky bit (chmod +t, as /tmp has)",
                mode & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Publishes a new owner in `dir`: a pending file made and locked, then renamed to its
/// owner name. A concurrent sweep of another process may take a pending file for abandoned
/// between its creation and its lock and remove it: that try is made again with a new id.
fn publish(dir: &Path) -> io::Result<(String, File)> {
    let mut tries = 0;
    loop {
        let id = format!("{:032x}", random()?);
        let pending = dir.join(format!("{PENDING_PREFIX}{id}{PENDING_SUFFIX}"));
        let lock = create_new(&pending)?;
        #[cfg(test)]
        tests::BEFORE_LOCK.with(|hook| {
            if let Some(hook) = hook.borrow().as_ref() {
                hook(dir);
            }
        });
        let published = flock(&lock, libc::LOCK_EX | libc::LOCK_NB)
            .and_then(|()| std::fs::rename(&pending, dir.join(owner_name(&id))));
        match published {
            Ok(()) => return Ok((id, lock)),
            Err(e) => {
                let _ = std::fs::remove_file(&pending);
                tries += 1;
                let raced = matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EWOULDBLOCK));
                if !raced || tries >= 8 {
                    return Err(e);
                }
            }
        }
    }
}

fn create_new(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

pub(super) fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    // SAFETY: a plain system call on an open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// 128 random bits from the kernel (the ids of owners, and the names of the spool's
/// fallback files).
pub(crate) fn random() -> io::Result<u128> {
    let mut bytes = [0u8; 16];
    // SAFETY: writes at most `bytes.len()` bytes into `bytes`.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        return Err(io::Error::last_os_error());
    }
    Ok(u128::from_ne_bytes(bytes))
}

fn owner_name(id: &str) -> String {
    format!("{PREFIX}{id}{OWNER_SUFFIX}")
}

/// The owner id of a name this module gives, and whether it is the owner file itself.
fn parse(name: &str) -> Option<(&str, bool)> {
    let is_id = |s: &str| s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit());
    if let Some(id) = name
        .strip_prefix(PREFIX)
        .and_then(|r| r.strip_suffix(OWNER_SUFFIX))
    {
        return is_id(id).then_some((id, true));
    }
    if let Some(id) = name
        .strip_prefix(PENDING_PREFIX)
        .and_then(|r| r.strip_suffix(PENDING_SUFFIX))
    {
        return is_id(id).then_some((id, true));
    }
    let rest = name.strip_prefix(PREFIX)?.strip_suffix(BACKUP_SUFFIX)?;
    let (id, n) = rest.split_once('-')?;
    (is_id(id) && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some((id, false))
}

/// Whether nobody holds the lock of the owner file at `path` (its owner is gone). Only a
/// regular file of this user counts: opened without blocking (a FIFO another user put
/// there under an owner file's name would block the open forever), then checked.
fn abandoned(path: &Path) -> bool {
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
    else {
        return false;
    };
    let Ok(meta) = file.metadata() else {
        return false;
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    meta.file_type().is_file()
        && std::os::unix::fs::MetadataExt::uid(&meta) == me
        && flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_ok()
}

/// Removes the files of owners in `dir` that a lock proves gone (their owner file unlocked)
/// and that this user may remove. A backup whose owner file is missing is left alone: a
/// cleaner of old files may have removed a live owner's file, and its owner removes its
/// backups itself at exit. Best effort: whatever cannot be read or removed is left as it is.
pub(crate) fn sweep(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| parse(n).is_some())
        .collect();
    let mut gone: Vec<String> = Vec::new();
    for name in &names {
        if let Some((id, true)) = parse(name)
            && abandoned(&dir.join(name))
        {
            gone.push(id.to_owned());
        }
    }
    for name in &names {
        let Some((id, false)) = parse(name) else {
            continue;
        };
        if gone.iter().any(|g| g == id) {
            let _ = std::fs::remove_file(dir.join(name));
        }
    }
    for name in &names {
        if let Some((id, true)) = parse(name)
            && gone.iter().any(|g| g == id)
        {
            let _ = std::fs::remove_file(dir.join(name));
        }
    }
}

/// Removes every file of `owner`: its backups first, then its owner file.
fn remove_all(owner: &Owner) {
    if let Ok(entries) = std::fs::read_dir(&owner.dir) {
        for e in entries.flatten() {
            if let Some(name) = e.file_name().to_str()
                && parse(name) == Some((owner.id.as_str(), false))
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::remove_file(owner.dir.join(owner_name(&owner.id)));
}

extern "C" fn remove_at_exit() {
    // Never wait at exit for a thread that holds the list: the next process's sweep removes
    // what is left then.
    let owners = match OWNERS.try_lock() {
        Ok(o) => o,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    for o in owners.iter().filter(|o| o.is_ours()) {
        remove_all(o);
    }
}

#[cfg(test)]
mod tests {
    /// A hook that looks at a directory.
    type DirHook = Box<dyn Fn(&std::path::Path)>;

    thread_local! {
        /// Runs in `publish` between making the pending file and locking it.
        pub(super) static BEFORE_LOCK: std::cell::RefCell<Option<DirHook>> =
            const { std::cell::RefCell::new(None) };
    }

    #[test]
    fn a_sweep_between_a_pending_file_and_its_lock_is_outlived() {
        let dir = std::env::temp_dir().join(format!("gpu-pager-publish-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Another process's sweep, at the worst moment: it takes the pending file for
        // abandoned and removes it. Once only.
        let swept = std::rc::Rc::new(std::cell::Cell::new(false));
        let once = swept.clone();
        BEFORE_LOCK.with(|h| {
            *h.borrow_mut() = Some(Box::new(move |d| {
                if !once.replace(true) {
                    super::sweep(d);
                }
            }))
        });
        let published = super::publish(&dir);
        BEFORE_LOCK.with(|h| h.borrow_mut().take());
        assert!(swept.get(), "the sweep ran");
        let (id, _lock) = published.expect("a raced publish is tried again");
        assert!(dir.join(super::owner_name(&id)).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_all_can_write_without_the_sticky_bit_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("gpu-pager-shared-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = super::Owner::in_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("sticky bit"), "{e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(super::Owner::in_dir(&dir).is_ok(), "sticky, as /tmp");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_backup_whose_owner_file_is_gone_is_left_alone() {
        let dir = std::env::temp_dir().join(format!("gpu-pager-ownerless-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A live owner's backup whose owner file a cleaner of old files removed.
        let backup = dir.join(format!("gpu-pager-{}-0.backup", "a".repeat(32)));
        std::fs::write(&backup, b"still needed").unwrap();
        super::sweep(&dir);
        assert!(backup.exists(), "a backup no lock proves dead was removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_backup_file_replaced_behind_the_owner_is_refused() {
        let dir = std::env::temp_dir().join(format!("gpu-pager-swapped-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let owner = super::Owner::in_dir(&dir).unwrap();
        let (path, id) = owner.create(4096).unwrap();
        assert!(super::open(&path, id).is_ok());
        let other = dir.join("other");
        std::fs::write(&other, [9u8; 4096]).unwrap();
        std::fs::rename(&other, &path).unwrap();
        let e = super::open(&path, id).unwrap_err().to_string();
        assert!(e.contains("replaced by another file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_fifo_named_like_an_owner_file_does_not_hang_the_sweep() {
        let dir = std::env::temp_dir().join(format!("gpu-pager-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join(super::owner_name(&"0".repeat(32)));
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.clone();
        std::thread::spawn(move || {
            super::sweep(&d);
            tx.send(()).unwrap();
        });
        let done = rx.recv_timeout(std::time::Duration::from_secs(10));
        if done.is_err() {
            // Unblock the stuck open before failing, so that the thread ends.
            let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
        }
        assert!(done.is_ok(), "the sweep hung on a FIFO");
        assert!(fifo.exists(), "another's file is left alone");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    use super::*;

    #[test]
    fn names_parse_only_as_given() {
        let id = "0123456789abcdef0123456789abcdef";
        assert_eq!(parse(&owner_name(id)), Some((id, true)));
        assert_eq!(
            parse(&format!("gpu-pager-{id}-17.backup")),
            Some((id, false))
        );
        assert_eq!(parse(&format!(".gpu-pager-{id}.pending")), Some((id, true)));
        for other in [
            "gpu-pager-1-2.backup",
            "gpu-pager-x.owner",
            &format!("gpu-pager-{id}-.backup"),
            &format!("gpu-pager-{id}-1x.backup"),
            "notes.txt",
        ] {
            assert_eq!(parse(other), None, "{other}");
        }
    }
}
