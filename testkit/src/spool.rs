//! What this process holds on disk for file backups, seen from outside the pager: its open
//! files in a directory that have no name there (unnamed or removed), as
//! `/proc/self/fd` lists them, with the bytes the disk really holds for each, and the named
//! backup files (`gpu-pager-<id>-<n>.backup`) of the named layout.

use std::path::Path;

/// One open backup file of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spooled {
    /// The file's size (holes included).
    pub len: u64,
    /// Bytes the disk holds for it (punched holes excluded).
    pub on_disk: u64,
}

/// The files this process holds open in `dir` that have no name there, sorted by size.
pub fn spooled(dir: &Path) -> Vec<Spooled> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let mut out = Vec::new();
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return out;
    };
    for fd in fds.flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        let text = target.to_string_lossy();
        let Some(path) = text.strip_suffix(" (deleted)") else {
            continue;
        };
        if Path::new(path).parent() != Some(dir.as_path()) {
            continue;
        }
        // The magic link reaches the inode even without a name.
        if let Ok(meta) = std::fs::metadata(fd.path()) {
            use std::os::unix::fs::MetadataExt;
            out.push(Spooled {
                len: meta.len(),
                on_disk: meta.blocks() * 512,
            });
        }
    }
    out.sort_by_key(|s| (s.len, s.on_disk));
    out
}

/// Bytes the disk holds for every backup file in `dir`: this process's unnamed ones and
/// every named one.
pub fn on_disk(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let named: u64 = named(dir)
        .iter()
        .filter_map(|n| std::fs::metadata(dir.join(n)).ok())
        .map(|m| m.blocks() * 512)
        .sum();
    named + spooled(dir).iter().map(|s| s.on_disk).sum::<u64>()
}

/// The named backup files in `dir` (`gpu-pager-*.backup`), sorted.
pub fn named(dir: &Path) -> Vec<String> {
    ours(dir, ".backup")
}

/// The owner files in `dir` (`gpu-pager-<id>.owner`: one per process that writes named
/// backups there), sorted.
pub fn owners(dir: &Path) -> Vec<String> {
    ours(dir, ".owner")
}

/// The names in `dir` of the named layout that end in `suffix`.
fn ours(dir: &Path, suffix: &str) -> Vec<String> {
    names(dir)
        .into_iter()
        .filter(|n| n.starts_with("gpu-pager-") && n.ends_with(suffix))
        .collect()
}

/// Names in `dir` (none, while every backup file is unnamed).
pub fn names(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}
